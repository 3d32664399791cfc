"""What an engine kind provides to the orchestrator: the one interface the planner, the replicas, the router,
`status` and autoscaling talk to. They never ask which engine it is; they ask it.

An engine kind is stateless and importable everywhere (the planner's process and every Serve replica): its
methods are pure over their arguments except `check_available` and `check_model`, which look at this machine's
files and packages. One module per kind under flagscale/engines/, registered in flagscale/engines/__init__.py.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Capabilities:
    """What the serving layer may rely on (docs/engines.md has the table)."""

    resume_from_tokens: bool = False  # a stream can go on elsewhere from its token ids (router: mid-stream resume)
    kv_transfer: bool = False  # prefill/decode disaggregation (KV pulled between replicas)
    prefix_caching: bool = False  # reuses the KV cache of a shared prompt prefix (cache-aware routing pays off)
    cpu_worker_binding: bool = False  # binds its CPU workers to cores itself (flagscale/serve/cpu_layout.py)
    multi_host: bool = False  # one replica's ranks may span hosts
    parallel: tuple[str, ...] = ()  # which of "tp", "pp", "dp" a replica may have above 1
    keeps_connections: bool = True  # its server keeps a connection open after a response (the router reuses it)


@dataclass(frozen=True)
class ServerLaunch:
    """How one replica starts its engine's server on its host."""

    argv: list[str]  # the whole command line (no secrets in it: `ps` shows argv)
    env: dict[str, str] = field(default_factory=dict)  # over the replica's env (shown in the engine log)
    env_defaults: dict[str, str] = field(default_factory=dict)  # under the user's envs (experiment.envs win)
    secret_env: dict[str, str] = field(default_factory=dict, repr=False)  # over everything, never shown


@dataclass(frozen=True)
class HostShare:
    """One host's share of a replica whose engine has several ranks (TP x PP x DP > 1): which ranks it runs and
    what it was given for them (flagscale/serve/ranks.py decides; the engine kind turns it into a launch)."""

    host: str  # the host's IP
    node_rank: int  # 0: the host of the API server (and rank 0); > 0: headless ranks
    nnodes: int  # hosts the replica spans
    ranks: tuple[int, ...]  # the global ranks this host runs
    rank_cpus: tuple[tuple[int, ...], ...] = ()  # CPU engines: each rank's cores, in `ranks` order
    gpus: tuple[str, ...] = ()  # GPU engines: the devices Ray granted on this host
    master: tuple[str, int] | None = None  # nnodes > 1: node rank 0's address and port for the rendezvous
    interface: str | None = None  # nnodes > 1: the network interface that carries `host`


class EngineKind(ABC):
    """One engine: its args, its server, its health and load. Subclasses set the class attributes."""

    name: str  # the config's spelling: `engine: <name>`, `backend: <name>`, engine_args_specific.<name>
    display: str  # in messages: "vLLM", "llama.cpp"
    capabilities: Capabilities = Capabilities()
    health_path: str = "/health"  # answers 200 when the server can take requests
    # engine metric sample name -> status column ("running", "waiting", "kv_cache_usage", ...), from its /metrics
    status_gauges: dict[str, str] = {}
    # the metric samples whose sum is the requests a replica holds (running + queued): autoscaling, drain, status
    load_metrics: tuple[str, ...] = ()
    # engine args that size a replica's reservation (TP, PP, DP): the same on every host, never per host
    sizing_args: tuple[str, ...] = ()
    secret_args: tuple[str, ...] = ()  # engine args whose values are secrets (secret_env carries them)
    # engine args other engines' configs carry that mean nothing to this one: dropped by map_common_args, and the
    # config's notices say so (key -> why), rather than refused
    ignored_args: dict[str, str] = {}

    # ---- before start (the planner) ----

    def check_available(self, where: str) -> None:
        """Raise ConfigError naming what is missing when this machine cannot run the engine at all."""

    @abstractmethod
    def check_model(self, model: Any, where: str) -> str:
        """The `model` engine arg checked (local path resolved), or a ConfigError naming it."""

    def map_common_args(self, args: dict[str, Any]) -> dict[str, Any]:
        """FlagScale's engine-neutral keys (max_num_seqs, max_model_len, served_model_name, ...) in this engine's
        own spelling; keys the engine spells alike pass through."""
        return dict(args)

    @abstractmethod
    def argv(self, args: dict[str, Any], where: str) -> list[str]:
        """engine args (after map_common_args) -> the server's own flags, checked by the engine's own parser where
        it has one. Bind address, port and secrets are not in it: the replica adds them."""

    def secret_env(self, args: dict[str, Any], where: str) -> dict[str, str]:
        """Secret engine args (tokens) as the env vars that carry them to the server instead of argv."""
        return {}

    def parallel(self, args: dict[str, Any], where: str) -> tuple[int, int, int]:
        """(TP, PP, DP) of one replica: the devices it reserves are their product."""
        return (1, 1, 1)

    def check_parallel(self, parallel: tuple[int, int, int], on_cpu: bool, where: str) -> None:
        """Raise ConfigError naming the engine arg when this engine cannot run that split on that device."""

    def served_names(self, args: dict[str, Any], default: str) -> list[str]:
        names = args.get("served_model_name") or [default]
        return [names] if isinstance(names, str) else list(names)

    # ---- prefill/decode disaggregation (engines with capabilities.kv_transfer) ----

    def check_kv_transfer(self, pd: Any, args: dict[str, Any], where: str) -> None:
        """Before start: the node's `disaggregation` (config.schema.Disaggregation) can be served."""
        raise NotImplementedError

    def kv_transfer_args(self, pd: Any, role: str, on_cpu: bool, args: dict[str, Any]) -> dict[str, Any]:
        """Engine args that make a pool's replicas produce (prefill) or consume (decode) KV caches."""
        raise NotImplementedError

    def pool_note(self, device: str, argv: list[str]) -> str:
        """What dryrun adds about a pool's engine args (", dtype float32 (why)"), or ""."""
        return ""

    # ---- in the replica ----

    @abstractmethod
    def launch(self, argv: list[str], host: str, port: int, api_key: str | None, role: str | None) -> ServerLaunch:
        """The command that serves `argv` on host:port. With `api_key`, every path but the health path must
        require it; it goes to the server in ServerLaunch.env, never in argv. `role`: "prefill" / "decode" in a
        disaggregated node (only engines with kv_transfer)."""

    def bind_ranks(self, launch: ServerLaunch, share: HostShare) -> ServerLaunch:
        """The server's `launch` made to run the ranks of `share` (node rank 0) on what they were given. Only
        called for engines whose capabilities.parallel allows more than one rank."""
        return launch

    def headless_launch(self, argv: list[str], share: HostShare) -> ServerLaunch:
        """The process that runs `share`'s ranks on a host other than the server's (node rank > 0). Only called
        for engines with capabilities.multi_host."""
        raise NotImplementedError(f"{self.display} has no ranks on other hosts")

    def load(self, metrics: dict[str, float]) -> float:
        """Requests the replica holds now (running + queued), from its /metrics samples summed by name."""
        return sum(metrics.get(name, 0.0) for name in self.load_metrics)

    def status_load(self, metrics: dict[str, float]) -> dict[str, float]:
        return {column: metrics[name] for name, column in self.status_gauges.items() if name in metrics}
