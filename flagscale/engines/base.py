"""What an engine kind provides to the orchestrator: the one interface the planner, the replicas, the router,
`status` and autoscaling talk to. They never ask which engine it is; they ask it.

An engine kind is stateless and importable everywhere (the planner's process and every Serve replica): its
methods are pure over their arguments except `check_available` and `check_model`, which look at this machine's
files and packages. One module per kind under flagscale/engines/, registered in flagscale/engines/__init__.py.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from flagscale.engines.cli_flags import flags_of
from flagscale.errors import ConfigError


@dataclass(frozen=True)
class Capabilities:
    """What the serving layer may rely on (docs/engines.md has the table)."""

    resume_from_tokens: bool = False  # a stream can go on elsewhere from its token ids (router: mid-stream resume)
    kv_transfer: bool = False  # prefill/decode disaggregation (KV pulled between replicas)
    prefix_caching: bool = False  # reuses the KV cache of a shared prompt prefix (cache-aware routing pays off)
    cpu_worker_binding: bool = False  # binds its CPU workers to cores itself (flagscale/replica/cpu_layout.py)
    multi_host: bool = False  # one replica's ranks may span hosts
    parallel: tuple[str, ...] = ()  # which of "tp", "pp", "dp" a replica may have above 1
    expert_parallel: bool = False  # spreads a MoE model's experts over its DP x TP ranks (enable_expert_parallel)
    keeps_connections: bool = True  # its server keeps a connection open after a response (the router reuses it)
    sleep_on_gpu: bool = False  # on a GPU, frees its memory while idle and takes it back (EngineKind.sleep_mode)
    sleep_on_cpu: bool = False  # the same on a replica without GPUs (its host memory)
    kv_events: bool = False  # publishes its KV cache's block events (the router's exact prefix index: kv_events)


@dataclass(frozen=True)
class SleepMode:
    """An engine's sleep and wake (resources.sleep_delay_s, flagscale/replica/sleep.py): the engine args and the
    server env that turn it on; GET `sleeping_path` (JSON with `sleeping_field` true or false); and the counters of
    its /metrics that move with every request (with load_metrics at zero and these unchanged, it idles).

    Put to sleep by the replica: POST `sleep_path` (in-flight requests finish first; new ones are held until the
    wake), woken by the router: POST `wake_path`. An engine that sleeps by itself has neither: `idle_arg`, the
    engine arg its idle delay goes to, and its next request wakes it."""

    args: dict[str, Any]
    env: dict[str, str]
    sleeping_path: str
    sleeping_field: str
    activity_metrics: tuple[str, ...]
    asleep_means: str  # what a sleeping replica has let go of and how it comes back (dryrun, docs)
    sleep_path: str | None = None
    wake_path: str | None = None
    idle_arg: str | None = None

    def __post_init__(self) -> None:
        assert (self.idle_arg is None) == (self.sleep_path is not None and self.wake_path is not None), self

    @property
    def sleeps_by_itself(self) -> bool:
        return self.idle_arg is not None


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
    what it was given for them (flagscale/replica/ranks.py decides; the engine kind turns it into a launch)."""

    host: str  # the host's IP
    node_rank: int  # 0: the host of the API server (and rank 0); > 0: headless ranks
    nnodes: int  # hosts the replica spans
    ranks: tuple[int, ...]  # the global ranks this host runs
    rank_cpus: tuple[tuple[int, ...], ...] = ()  # CPU engines: each rank's cores, in `ranks` order
    gpus: tuple[str, ...] = ()  # GPU engines: the devices Ray granted on this host
    visible_env: str = "CUDA_VISIBLE_DEVICES"  # the variable that shows them (their family's: flagscale/devices)
    device_resource: str = "GPU"  # Ray's resource for them (GPU, NPU, ...): what each host's ranks were assigned
    interface_env: tuple[str, ...] = ("NCCL_SOCKET_IFNAME",)  # their collective's variables naming `interface`
    master: tuple[str, int] | None = None  # nnodes > 1: node rank 0's address and port for the rendezvous
    interface: str | None = None  # nnodes > 1: the network interface that carries `host`
    # data-parallel ranks spread over hosts (expert parallel): the DP ranks (engines) this host runs, and the first
    # one's DP rank; `master` is then the DP master's address and RPC port. 0: DP, if any, stays on one host.
    dp_local: int = 0
    dp_start: int = 0


# How a node asks for expert parallelism: vLLM's engine arg (`--enable-expert-parallel`), as FlagScale's configs
# pass it through.
EXPERT_PARALLEL_ARG = "enable_expert_parallel"

# The OpenAI routes where every engine kind here runs the model: each kind's inference_paths start with these.
OPENAI_INFERENCE_PATHS = (
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/embeddings",
    "/v1/responses",
    "/v1/audio/transcriptions",
)


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
    # the SLO planner's inputs (flagscale/replica/slo_signals.py): signal -> the sample (a histogram family for
    # "ttft" / "itl", read bucket by bucket; counters and gauges summed over their label sets)
    slo_samples: dict[str, str] = {}
    # engine args that size a replica's reservation (TP, PP, DP): the same on every host, never per host
    sizing_args: tuple[str, ...] = ()
    secret_args: tuple[str, ...] = ()  # engine args whose values are secrets (secret_env carries them)
    secret_arg_env: dict[str, str] = {}  # of those, the ones the server reads from an env var: arg -> variable
    # engine args the replica sets itself (each replica binds its own address and port): never passed on, and the
    # config's notices say so
    address_args: tuple[str, ...] = ("host", "port")
    # the share of each of its GPUs a replica is taken to fill when engine_args set no gpu_memory_utilization (the
    # checks of GPUs shared by replicas and of weights that must fit)
    default_gpu_memory_utilization: float = 0.9
    # log lines that mean the server will never become healthy although its process lives on (a thread of it
    # died): a replica's start-up that meets one fails then, not at startup_timeout_s
    start_failure_lines: tuple[str, ...] = ()
    rank_runner: str = "the engine's own executor"  # what runs a replica's ranks (TP x PP x DP > 1), for dryrun
    # engine args that give its KV cache a size of their own, where it otherwise takes what it finds free on the
    # device at start: with one set, its start measures nothing a neighbour starting beside it could disturb
    kv_size_args: tuple[str, ...] = ()
    # FlagScale's engine-neutral keys this engine spells otherwise (max_num_seqs, max_model_len, ...): key -> its own
    # spelling, renamed by map_common_args; its own key, if also given, wins
    common_args: dict[str, str] = {}
    # engine args other engines' configs carry that mean nothing to this one: dropped by map_common_args, and the
    # config's notices say so (key -> why), rather than refused
    ignored_args: dict[str, str] = {}
    # engine args this engine checks before start (in `parallel`) but has no flag for: dropped by map_common_args
    # without a notice
    checked_only_args: tuple[str, ...] = ()
    # engine args that give every client of the endpoint more than the model (code run on the host, shell tools,
    # files read or written at a client's request): key -> what it turns on. Refused unless the node opts in by
    # name (allow_engine_args); a false or empty value turns nothing on and passes.
    unsafe_args: dict[str, str] = {}
    # The router's public surface for this engine (docs/operations.md): the paths of its server clients may reach
    # through the endpoint (its OpenAI API and the like; GET /v1/models the router answers itself, from the
    # engines'); everything else answers 404 at the router. A `{name}` part stands for one path segment.
    public_paths: tuple[str, ...] = ()
    # Of public_paths, those where the engine runs the model: a 5xx there is the replica failing (its circuit
    # breaker counts it, another replica may take the request); a 5xx elsewhere is passed on as it is.
    inference_paths: tuple[str, ...] = ()
    # Request body fields only the router sets (where a decode engine pulls its KV cache from): a client's are
    # dropped; and fields holding extra engine arguments the engine reads those fields from as well.
    router_fields: tuple[str, ...] = ("kv_transfer_params",)
    extra_args_fields: tuple[str, ...] = ()
    # The body of a 5xx answer that says the engine itself died (not only this request): counted as a dropped
    # connection (docs/routing.md). Empty: the engine has no such answer.
    dead_engine_marker: bytes = b""
    # request headers (lower case) the router must not pass on to this engine: they change what the engine does in
    # ways the router cannot undo (llama.cpp's X-Conversation-Id keeps a hung-up stream generating)
    dropped_request_headers: tuple[str, ...] = ()
    # variables of experiment.envs this engine's processes read, each with its check (raises ValueError naming it):
    # the schema runs them before anything starts
    env_checks: dict[str, Callable[[str], object]] = {}
    # sleep mode (capabilities.sleep_on_gpu; resources.sleep_delay_s): how the replica's server is asked to sleep,
    # wake, and whether it sleeps (paths on the engine's own port, never public), and what its start needs for it
    sleep_mode: SleepMode | None = None

    # ---- before start (the planner) ----

    def measures_device_at_start(self, argv: list[str]) -> bool:
        """Whether a server started with `argv` sizes its memory from what it finds free on its GPUs: replicas
        sharing one then start in turn (replica/startup_lock.py). True unless an arg of kv_size_args is set."""
        flags = flags_of(argv)
        return not any(f"--{arg.replace('_', '-')}" in flags for arg in self.kv_size_args)

    def kv_cache_bytes(self, argv: list[str]) -> int | None:
        """The KV cache's size per GPU that `argv` gives it (kv_size_args), as the engine reads it; None: sized
        by the engine at start."""
        return None

    def check_unsafe_args(self, args: dict[str, Any], allowed: list[str], where: str) -> None:
        """Refuse (ConfigError naming the key) an engine arg of `unsafe_args` that is on and not in `allowed`, and
        an `allowed` name that is none of them."""
        unknown = [key for key in allowed if key not in self.unsafe_args]
        if unknown:
            known = ", ".join(self.unsafe_args) or "none"
            raise ConfigError(
                f"allow_engine_args names {', '.join(unknown)}, which {self.display} does not need opted into "
                f"(it needs: {known})",
                where.rpartition(".engine_args")[0] + ".allow_engine_args",
            )
        for key, what in self.unsafe_args.items():
            if key in allowed or args.get(key) in (None, False, "", [], {}):
                continue
            raise ConfigError(
                f"{key} {what}, for every client of the endpoint; refused unless the node opts in with "
                f"allow_engine_args: [{key}] (docs/operations.md)",
                f"{where}.{key}",
            )

    # LoRA adapters served as models (`lora:`, flagscale/config/lora.py): why this engine does not, for the error
    lora_refusal: str = "serves no LoRA adapters as models clients name here"
    lora_defaults: dict[str, int] = {"max_loras": 1, "max_lora_rank": 16}  # what the engine assumes when unset

    def lora_args(self, lora: Any, where: str) -> dict[str, Any]:
        """The engine args that let a replica load the node's adapters at run time (`lora`: its LoraConfig), or a
        ConfigError naming the engine where it cannot serve them."""
        raise ConfigError(f"{self.display} {self.lora_refusal}; adapters are served with engine: vllm", where)

    def lora_running(self, metrics_text: str) -> list[str] | None:
        """The adapters the engine runs or has queued now (held in its batch's adapter slots), from its /metrics
        text; None: the engine does not say."""
        return None

    def lora_load_request(self, name: str, path: str, replace: bool) -> tuple[str, dict[str, Any]]:
        """The server's path and JSON body that load adapter `name` from `path` at run time (`replace`: one of that
        name is loaded already). Only asked of engines whose lora_args do not refuse."""
        raise NotImplementedError

    def lora_unload_request(self, name: str) -> tuple[str, dict[str, Any]]:
        """The server's path and JSON body that unload adapter `name` at run time."""
        raise NotImplementedError

    def check_available(self, where: str) -> None:
        """Raise ConfigError naming what is missing when this machine cannot run the engine at all."""

    @abstractmethod
    def check_model(self, model: Any, where: str) -> str:
        """The `model` engine arg checked (local path resolved), or a ConfigError naming it."""

    def map_common_args(self, args: dict[str, Any]) -> dict[str, Any]:
        """FlagScale's engine-neutral keys (max_num_seqs, max_model_len, served_model_name, ...) in this engine's
        own spelling (common_args); ignored_args and checked_only_args dropped; other keys pass through."""
        mapped = {}
        for key, value in args.items():
            if key in self.ignored_args or key in self.checked_only_args:
                continue
            own = self.common_args.get(key)
            if own is not None:
                if own in args:
                    continue
                key = own
            mapped[key] = value
        return mapped

    @abstractmethod
    def argv(self, args: dict[str, Any], where: str) -> list[str]:
        """engine args (after map_common_args) -> the server's own flags, checked by the engine's own parser where
        it has one. Bind address, port and secrets are not in it: the replica adds them."""

    def secret_env(self, args: dict[str, Any], where: str) -> dict[str, str]:
        """Secret engine args (tokens) as the env vars that carry them to the server instead of argv
        (secret_arg_env: engine arg -> env var)."""
        env = {}
        for key, var in self.secret_arg_env.items():
            value = args.get(key)
            if value is None:
                continue
            if not isinstance(value, str) or not value:
                raise ConfigError(f"engine arg '{key}' must be the token itself (a non-empty string)", f"{where}.{key}")
            env[var] = value
        return env

    def check_api_key(self, api_key: str, where: str) -> None:
        """Raise ConfigError (at `where`, the key's config entry) when this engine cannot take `api_key` safely."""

    def parallel(self, args: dict[str, Any], where: str) -> tuple[int, int, int]:
        """(TP, PP, DP) of one replica: the devices it reserves are their product."""
        return (1, 1, 1)

    def check_parallel(self, parallel: tuple[int, int, int], on_cpu: bool, where: str) -> None:
        """Raise ConfigError naming the engine arg when this engine cannot run that split on that device."""

    def expert_parallel(
        self, args: dict[str, Any], parallel: tuple[int, int, int], on_cpu: bool, experts: int | None, where: str
    ) -> bool:
        """Whether the node asks for expert parallelism (`enable_expert_parallel`, vLLM's spelling), refused with a
        ConfigError where it cannot run (`experts`: the model's expert count from its config.json, 0: a dense
        model, None: unknown). Engines with capabilities.expert_parallel override it."""
        if args.get(EXPERT_PARALLEL_ARG):
            raise ConfigError(
                f"{EXPERT_PARALLEL_ARG}: {self.display} has no expert parallelism here; spreading a MoE model's "
                "experts over GPUs needs engine: vllm (docs/parallelism.md)",
                f"{where}.{EXPERT_PARALLEL_ARG}",
            )
        return False

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

    def shown_args(self, argv: list[str]) -> dict[str, Any]:
        """The engine args dryrun shows for `argv` (the server's flags): by default the flags it sets, as given
        (`--n-gpu-layers 0` -> n_gpu_layers: "0", a switch -> True). Engines with a parser show its defaults too."""
        shown: dict[str, Any] = {}
        for index, token in enumerate(argv):
            if token.startswith("--"):
                value = argv[index + 1] if index + 1 < len(argv) else None
                shown[token[2:].replace("-", "_")] = True if value is None or value.startswith("--") else value
        return shown

    # ---- in the replica ----

    @abstractmethod
    def launch(self, argv: list[str], host: str, port: int, api_key: str | None, role: str | None) -> ServerLaunch:
        """The command that serves `argv` on host:port. With `api_key`, every path but the health path must
        require it; it goes to the server in ServerLaunch.env, never in argv. `role`: "prefill" / "decode" in a
        disaggregated node (only engines with kv_transfer)."""

    def kv_events_launch(
        self,
        argv: list[str],
        host: str,
        pub_port: int,
        replay_port: int,
        topic: str,
        env: dict[str, str],
        ranks: int = 1,
    ) -> tuple[list[str], dict[str, Any]] | None:
        """Engines with capabilities.kv_events: the args that make the server publish its KV cache's block events
        on host:pub_port (replays on replay_port) under `topic`, and what the replica's record tells the router of
        them (flagscale/router/kv_events.py); None when this server cannot publish events the router can use.
        `ranks`: the server's data-parallel engines, rank r publishing on both ports + r (reserved by the caller)."""
        return None

    def bind_ranks(self, launch: ServerLaunch, share: HostShare) -> ServerLaunch:
        """The server's `launch` made to run the ranks of `share` (node rank 0) on what they were given. Only
        called for engines whose capabilities.parallel allows more than one rank."""
        return launch

    def headless_launch(self, argv: list[str], share: HostShare) -> ServerLaunch:
        """The process that runs `share`'s ranks on a host other than the server's (node rank > 0). Only called
        for engines with capabilities.multi_host."""
        raise NotImplementedError(f"{self.display} has no ranks on other hosts")

    def worker_rank(self, title: str, tp: int, pp: int, parent_title: str = "") -> int | None:
        """The global rank of one of the engine's worker processes, from its title (command line) and its parent
        process's, or None when the process is no worker. Only asked of engines whose capabilities.parallel allows
        more than one rank."""
        return None

    def load(self, metrics: dict[str, float]) -> float:
        """Requests the replica holds now (running + queued), from its /metrics samples summed by name."""
        return sum(metrics.get(name, 0.0) for name in self.load_metrics)

    def status_load(self, metrics: dict[str, float]) -> dict[str, float]:
        return {column: metrics[name] for name, column in self.status_gauges.items() if name in metrics}
