"""The one typed schema of an experiment config. Field docs here are the reference for docs/config.md."""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Literal, get_type_hints

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PositiveInt,
    PrivateAttr,
    create_model,
    field_validator,
    model_validator,
)

from flagscale import engines
from flagscale.actions import ACTIONS
from flagscale.router import policies

# How the router picks an engine node's replica per request: a name in the policies' registry
# (flagscale/router/policies/, docs/routing.md).
RoutingPolicy = Literal[tuple(policies.POLICIES)]

ENGINES = tuple(engines.ENGINES)  # every engine a node may name (flagscale/engines/)
# task.backend: an engine, or `native` (a graph of custom nodes); the names come from the engine registry
Backend = Literal[(*ENGINES, "native")]  # type: ignore[valid-type]

# Engine args a node must opt into (allow_engine_args), per engine kind (EngineKind.unsafe_args)
UNSAFE_ARGS = "; ".join(
    f"{name}: {', '.join(engines.get(name).unsafe_args)}" for name in ENGINES if engines.get(name).unsafe_args
)

# A node id names files and Serve deployments: no path separators, no `..`, nothing a shell or URL treats specially.
SAFE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def launcher_key(default: Any, why: str, **kwargs: Any) -> Any:
    """A FlagScale key that configures FlagScale's own launcher and has no meaning here: typed (a wrong value is
    still an error), accepted, and listed by `run`/`dryrun` with `why` (flagscale/config/compat.py)."""
    return Field(
        default,
        description=f"FlagScale key, accepted and ignored: {why}.",
        json_schema_extra={"ignored_because": why},
        **kwargs,
    )


class DeployConfig(Strict):
    """Where and how the HTTP entry point is exposed, and bounds on start-up and shutdown."""

    host: str = Field("127.0.0.1", description="Address the OpenAI-compatible router binds to.")
    port: int | None = Field(
        None, ge=1, le=65535, description="Public port. Default: engine_args.port of the first node, else 8000."
    )
    startup_timeout_s: float = Field(900, gt=0, description="Bound on `run` waiting for every deployment.")
    schedule_timeout_s: float = Field(
        90, gt=0, description="How long a replica may stay unscheduled before `run` gives up."
    )
    drain_timeout_s: float = Field(30, ge=0, description="Bound on `stop` waiting for in-flight requests.")
    api_key: str | None = Field(
        None,
        min_length=1,
        repr=False,
        description="Clients must send `Authorization: Bearer <key>` (every request but GET /health; GET /metrics "
        "too with protect_metrics); engines get it too, so they refuse direct access. Prefer api_key_env.",
    )
    api_key_env: str | None = Field(
        None, min_length=1, description="Name of an env var holding api_key, so the key stays out of YAML."
    )
    protect_metrics: bool = Field(
        True,
        description="With an API key: /metrics requires it as well (Prometheus sends it as a bearer token); "
        "false leaves /metrics open to anyone who reaches the port.",
    )
    max_body_bytes: int = Field(
        16 * 1024 * 1024,
        ge=1024,
        description="Largest request body the router takes; a larger one is refused with 413 before it is read.",
    )
    max_queued_requests: int = Field(
        1000,
        ge=0,
        description="Per model: requests that wait in the router while every replica has max_ongoing_requests in "
        "flight; beyond this, 503 with Retry-After.",
    )
    queue_timeout_s: float = Field(
        30, gt=0, description="How long a request waits in that queue before it gets 503 with Retry-After."
    )
    router_processes: int | None = Field(
        None,
        ge=1,
        le=64,
        description="Router processes on the endpoint's host, sharing its port (SO_REUSEPORT), each a full router; "
        "they share routing hints, load, /metrics and drains (docs/design.md). Default: one per GPU the engines "
        "may use (at least one), at most a quarter of the head host's cores.",
    )
    cpu_affinity: Literal["auto", "off"] = Field(
        "auto",
        description="auto: when the engine binds its CPU workers to cores (engine kinds with cpu_worker_binding), "
        "its engine core joins those cores and its API server and the router keep to the others "
        "(flagscale/replica/cpu_layout.py); off: leave CPU placement to the OS.",
    )
    use_fs_serve: bool | None = launcher_key(
        None,
        "FlagScale's choice between its own server and Ray Serve; this project always serves through Ray Serve "
        "with its own router (FlagScale's slides spell it use_fs_server)",
    )
    enable_composition: bool | None = launcher_key(
        None, "a config with custom nodes is a graph here, composed without this switch"
    )
    # Graph entry (deployment graphs): route and request fields.
    name: str | None = Field(None, description="HTTP route of a graph's entry, e.g. /generate.")
    request: dict[str, Any] | list[dict[str, Any]] | None = Field(
        None,
        description="Graph request fields: a list of {arg, type, required?, default?}, or the older "
        "{args: [...], types: [...]}. Types: str int float bool list dict tuple set Any Optional[..] Union[..].",
    )
    # Prefill/decode disaggregation, FlagScale's keys: every engine node without `disaggregation` gets one.
    prefill_decode_disaggregation: bool = Field(False, description="Serve prefill and decode on separate engines.")
    prefill_num: int = Field(1, ge=1, description="Prefill replicas (with prefill_decode_disaggregation).")
    decode_num: int = Field(1, ge=1, description="Decode replicas (with prefill_decode_disaggregation).")
    prefill_address: str = Field("auto", min_length=1, description="Host the prefill pool is pinned to, or auto.")
    decode_address: str = Field("auto", min_length=1, description="Host the decode pool is pinned to, or auto.")
    prefill_decode_strategy: Literal["slo", "random", "robin"] = Field(
        "slo",
        description="How a request's prefill replica is picked: robin = round_robin, random = random, slo = the "
        "node's routing (cache_aware by default: the replica holding the longest prefix, within a load bound).",
    )
    decode_gpu_memory_utilization: float | None = Field(
        None, gt=0, le=1, description="gpu_memory_utilization of the decode engines."
    )

    @model_validator(mode="after")
    def _one_key_source(self) -> DeployConfig:
        if self.api_key is not None and self.api_key_env is not None:
            raise ValueError("give api_key or api_key_env, not both")
        return self

    def resolved_api_key(self) -> str | None:
        """The API key clients must send, or None; api_key_env must name a set, non-empty variable."""
        import os

        if self.api_key_env is None:
            return self.api_key
        key = os.environ.get(self.api_key_env)
        if not key:
            raise ValueError(f"api_key_env names {self.api_key_env}, which is not set (or empty) in this environment")
        return key


class RunnerConfig(Strict):
    hostfile: str | None = Field(
        None,
        description="FlagScale hostfile; `slurm`: the nodes of the Slurm allocation this runs in; null serves on "
        "this machine.",
    )
    head: str | None = Field(None, description="Host of the hostfile that runs the Ray head (default: first).")
    ray_port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description="GCS port of the Ray head, with or without a hostfile (default: a port free on the head's "
        "host when the run starts).",
    )
    num_cpus: int | None = Field(
        None,
        ge=1,
        description="Logical CPUs each Ray node this run starts declares: the local head, or every hostfile host "
        "(default: without a hostfile, this machine's cores, raised to what the replicas reserve; with one, "
        "each host's cores as Ray counts them).",
    )
    ssh_port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description="SSH port of the hostfile's hosts (default: the host's Port in ssh_config, else 22).",
    )
    ssh_user: str | None = Field(
        None, description="SSH user (default: the host's User in ssh_config, else the current user)."
    )
    ssh_key: str | None = Field(
        None,
        description="Private key file (default: the host's IdentityFile in ssh_config, else the agent's and ~/.ssh's keys).",
    )
    ssh_timeout_s: float = Field(10, gt=0, description="Bound on connecting to one host.")
    ssh_accept_new_host_keys: bool = Field(
        False, description="Trust and record a host key seen for the first time (default: it must be known)."
    )
    ssh_known_hosts: str | None = Field(
        None, description="known_hosts file checked for host keys (default ~/.ssh/known_hosts)."
    )
    ssh_config: str | None = Field(
        None,
        description="OpenSSH client config read for each host: Host aliases, HostName, User, Port, IdentityFile, "
        "ProxyJump (default ~/.ssh/config; the ssh_* keys above win over it).",
    )
    join_timeout_s: float = Field(120, gt=0, description="Bound on waiting for every host to join the Ray cluster.")
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK", description="Placement group strategy of an engine replica that spans hosts."
    )
    deploy: DeployConfig = Field(default_factory=DeployConfig, description="The HTTP entry point: see below.")
    cli_args: dict[str, Any] = Field(
        default_factory=dict,
        description="FlagScale key: engine args given to every engine node (a node's own engine_args win).",
    )
    # FlagScale keys that configure its own launcher; nothing here depends on them.
    type: Literal["ssh", "ray", "cloud"] | None = Field(
        None,
        description="Where the cluster comes from: null or `ssh`: this runner starts Ray (this machine, or the "
        "hostfile's hosts over SSH); `ray`: an existing Ray cluster at `address`, nothing started or stopped but the "
        "deployment; `cloud` (FlagScale's Kubernetes runner) is refused: use `ray` with a KubeRay cluster.",
    )
    address: str | None = Field(
        None,
        description="`type: ray`: the cluster's address (`host:port` of its GCS, as `ray start --address` takes it; "
        "default: RAY_ADDRESS). Token auth as Ray reads it: RAY_AUTH_MODE=token with RAY_AUTH_TOKEN or "
        "RAY_AUTH_TOKEN_PATH.",
    )
    nnodes: int | None = launcher_key(None, "the hosts are the hostfile's lines", ge=1)
    nproc_per_node: int | None = launcher_key(
        None, "devices per host come from the hostfile's slots, devices per replica from TP x PP x DP", ge=1
    )
    docker: str | None = launcher_key(None, "processes start on each host directly, not in a container")
    no_shared_fs: bool | None = launcher_key(None, "nothing is copied between hosts except the Ray auth token")
    device_type: str | None = launcher_key(None, "chip types come from the hostfile's type=")
    master_addr: str | None = launcher_key(None, "the Ray head is runner.head (default: the hostfile's first host)")
    master_port: int | None = launcher_key(None, "Ray's port is runner.ray_port", ge=1, le=65535)


class TaskConfig(Strict):
    type: Literal["serve"] = Field("serve", description="Only `serve`.")
    backend: Backend | None = Field(
        None,
        description="Default engine of every node without `engine` or `module`; `native`: a graph of custom nodes.",
    )
    entrypoint: None = Field(None, description="FlagScale's custom entrypoint script is not supported.")


class CmdsConfig(Strict):
    before_start: str | None = Field(None, description="Shell snippet run before `ray start` on each host.")
    after_stop: str | None = Field(
        None, description="Shell snippet run after `stop` on each host that ran before_start; a failure is reported."
    )


class ProfileConfig(Strict):
    """FlagScale's per-node benchmark profile: the default of `action=bench` for that node's model."""

    prefix_len: int | None = Field(None, ge=0, description="Shared prefix tokens in every prompt.")
    input_len: int | None = Field(None, ge=1, description="Prompt tokens.")
    output_len: int | None = Field(None, ge=1, description="Output tokens.")
    num_prompts: int | None = Field(None, ge=1, description="Requests per concurrency level.")
    range_ratio: float | None = Field(None, ge=0, lt=1.0000001, description="Length spread: len x [1-r, 1+r].")


class BenchConfig(Strict):
    input_len: int = Field(128, ge=1, description="Random-dataset prompt tokens.")
    output_len: int = Field(64, ge=1, description="Output tokens (the benchmark ignores EOS).")
    num_prompts: int = Field(200, ge=1, description="Requests per concurrency level.")
    prefix_len: int = Field(0, ge=0, description="Shared prefix tokens in every prompt.")
    range_ratio: float = Field(0.0, ge=0, le=1, description="Input/output lengths vary by this ratio.")
    concurrency: list[PositiveInt] = Field(
        default_factory=lambda: [1, 16], min_length=1, description="One benchmark pass per max-concurrency value."
    )
    model: str | None = Field(None, description="Model id to load (default: the first served model).")
    endpoint: Literal["/v1/completions", "/v1/chat/completions"] = Field(
        "/v1/completions", description="The OpenAI route the load goes to."
    )
    slo_ttft_ms: float | None = Field(None, gt=0, description="Goodput SLO on time to first token.")
    slo_tpot_ms: float | None = Field(None, gt=0, description="Goodput SLO on time per output token.")
    seed: int = Field(0, description="Dataset seed.")


class NodeArgs(Strict):
    engine_args: dict[str, Any] = Field(
        default_factory=dict, description="Engine args over the node's own for replicas on this host."
    )


# SLO metrics and percentiles of action=auto_tune: what vLLM's serving benchmark reports (flagscale/actions/bench.py).
SLO_METRICS = ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms")
SLO_STATISTICS = ("mean", "p50", "p90", "p99")


class TunerControl(Strict):
    """How long the search may take, and what is left serving at its end (FlagScale's keys and defaults)."""

    interval: float = Field(10, ge=0, description="Seconds of rest between one trial's end and the next one's start.")
    run_best: bool = Field(True, description="Leave the best candidate serving at the end (else stop everything).")
    max_time_per_task: float = Field(
        3000, gt=0, description="Bound on one trial: deploy, wait healthy, load; past it the trial fails."
    )
    max_time: float | None = Field(None, gt=0, description="Bound on the whole search; no new trial starts past it.")


class TunerPerformance(Strict):
    """How trials rank without an SLO (FlagScale's keys and defaults); with `slo`, goodput per device ranks."""

    metric: str = Field(
        "itl",
        min_length=1,
        description="A history.csv column, or FlagScale's names: itl, ttft, tpot (topt), e2e_latency "
        "(mean ms), request_throughput, token_throughput.",
    )
    order: Literal["ascend", "descend"] = Field("ascend", description="ascend: smallest first.")


class AutoTunerConfig(Strict):
    """action=auto_tune (docs/auto-tune.md): one engine node's candidates, each deployed and loaded for real."""

    space: dict[str, Any] = Field(
        default_factory=dict,
        description="Dimension -> values to try: tensor_model_parallel_size, pipeline_model_parallel_size, "
        "instance (replicas), or any engine arg; or per engine (space.<engine>.<dim>).",
    )
    engines: list[str] | None = Field(None, description="The engines whose space.<engine> block is searched.")
    control: TunerControl = Field(default_factory=TunerControl, description="Bounds and the end: see below.")
    performance: TunerPerformance = Field(
        default_factory=TunerPerformance, description="Ranking without an SLO: see below."
    )
    cards: int | None = Field(
        None, ge=1, description="Devices the search may use: TP x PP x instance above it is skipped."
    )
    slo: dict[str, dict[str, float]] | None = Field(
        None,
        description="Latency limits, e.g. {ttft_ms: {p99: 500}, tpot_ms: {p99: 50}}; metrics "
        f"{', '.join(SLO_METRICS)}; statistics {', '.join(SLO_STATISTICS)}. A trial's goodput: the request "
        "throughput at the highest concurrency that meets every limit.",
    )
    concurrency: list[PositiveInt] | None = Field(
        None,
        min_length=1,
        description="Concurrency levels each trial climbs (default: experiment.bench.concurrency when set, else "
        "1, 2, 4, 8, 16).",
    )
    concurrency_per_device: bool = Field(
        False,
        description="Each level (and num_prompts) times the candidate's devices, so every device of every candidate "
        "sees the same load: for comparing layouts over different device counts (instance x TP).",
    )
    serve_id: str | None = Field(None, description="The engine node to tune (required with several engine nodes).")

    @field_validator("slo")
    @classmethod
    def _known_slo(cls, slo: dict[str, dict[str, float]] | None) -> dict[str, dict[str, float]] | None:
        import difflib

        for metric, limits in (slo or {}).items():
            for name, known in ((metric, SLO_METRICS), *((s, SLO_STATISTICS) for s in limits)):
                if name not in known:
                    close = difflib.get_close_matches(name, known, n=1, cutoff=0.5)
                    hint = f"did you mean '{close[0]}'? " if close else ""
                    raise ValueError(f"unknown SLO key '{name}' ({hint}known: {', '.join(known)})")
            for statistic, limit in limits.items():
                if limit <= 0:
                    raise ValueError(f"slo.{metric}.{statistic} must be positive, got {limit!r}")
        return slo


class ExperimentConfig(Strict):
    exp_name: str = Field(description="Also the Ray Serve application name.")
    exp_dir: str = Field(
        description="State file, serve_logs/, bench/, hydra/; a relative path is from the working directory."
    )
    task: TaskConfig = Field(default_factory=TaskConfig, description="What kind of job: see below.")
    runner: RunnerConfig = Field(default_factory=RunnerConfig, description="Where and how it runs: see below.")
    envs: dict[str, Any] = Field(default_factory=dict, description="Env vars for every host; nodes_envs per host.")
    cmds: CmdsConfig = Field(default_factory=CmdsConfig, description="Shell snippets around the run: see below.")
    bench: BenchConfig = Field(default_factory=BenchConfig, description="`action=bench` settings: see below.")
    node_args: dict[str, NodeArgs] = Field(
        default_factory=dict, description="Per host of the hostfile: engine args for the replicas placed there."
    )
    auto_tuner: AutoTunerConfig | None = Field(None, description="FlagScale's auto-tuner (action=auto_tune).")

    @field_validator("envs")
    @classmethod
    def _envs_scalar(cls, envs: dict[str, Any]) -> dict[str, Any]:
        for key, value in envs.items():
            if key == "nodes_envs":
                if not isinstance(value, dict) or not all(isinstance(v, dict) for v in value.values()):
                    raise ValueError("nodes_envs must map host -> {VAR: value}")
            elif isinstance(value, (dict, list)):
                raise ValueError(f"env var {key} must be a scalar, got {type(value).__name__}")
        for table in [envs, *envs.get("nodes_envs", {}).values()]:
            for key, value in table.items():  # what engines read once started is checked here, before
                if key != "nodes_envs":
                    engines.checked_env(key, _env_str(value))
        return envs

    def env_for(self, host: str | None = None) -> dict[str, str]:
        env = {k: _env_str(v) for k, v in self.envs.items() if k != "nodes_envs"}
        if host is not None:
            env.update({k: _env_str(v) for k, v in self.envs.get("nodes_envs", {}).get(host, {}).items()})
        return env


def _env_str(value: Any) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)


class Resources(Strict):
    """Replicas and what each replica reserves. Engine nodes reserve devices for TP x PP x DP themselves."""

    num_replicas: int | Literal["auto"] | None = Field(
        None, description="Fixed replica count, or auto: as many as the target's devices fit."
    )
    min_replicas: int | None = Field(None, ge=0, description="Autoscaling (instead of num_replicas): lower bound.")
    max_replicas: int | None = Field(None, ge=1, description="Autoscaling: upper bound.")
    target_ongoing_requests: float | None = Field(
        None, gt=0, description="Autoscaling: in-flight requests per replica."
    )
    upscale_delay_s: float | None = Field(None, ge=0, description="Autoscaling: load must last this long to add.")
    downscale_delay_s: float | None = Field(None, ge=0, description="Autoscaling: idle this long to remove.")
    max_ongoing_requests: int | None = Field(
        None,
        ge=1,
        description="Requests one replica takes at once; the router holds further ones in its queue "
        "(deploy.max_queued_requests). Default: 1000 for engine nodes (well above an engine's max_num_seqs: the "
        "rest queues inside the engine), Ray Serve's for custom nodes.",
    )
    num_cpus: float | None = Field(
        None, ge=0, description="Logical CPUs per replica (default: CPU engines TP x PP x DP, others 1)."
    )
    num_gpus: float | None = Field(None, ge=0, description="GPUs per replica (default: TP x PP x DP on GPU).")
    accelerator: str | None = Field(None, description="Hostfile chip type the replica must land on.")
    memory: int | None = Field(None, ge=0, description="Bytes of RAM reserved per replica.")

    @field_validator("num_replicas")
    @classmethod
    def _count(cls, value: int | str | None) -> int | str | None:
        if isinstance(value, int) and value < 1:
            raise ValueError("num_replicas must be at least 1 (or auto)")
        return value

    @model_validator(mode="after")
    def _replicas(self) -> Resources:
        autoscale = [
            self.min_replicas,
            self.max_replicas,
            self.target_ongoing_requests,
            self.upscale_delay_s,
            self.downscale_delay_s,
        ]
        if self.num_replicas is not None and any(v is not None for v in autoscale):
            raise ValueError("give either num_replicas or min_replicas/max_replicas, not both")
        if self.min_replicas is not None and self.max_replicas is not None and self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) > max_replicas ({self.max_replicas})")
        return self

    @property
    def autoscaling(self) -> bool:
        return any(
            v is not None
            for v in (
                self.min_replicas,
                self.max_replicas,
                self.target_ongoing_requests,
                self.upscale_delay_s,
                self.downscale_delay_s,
            )
        )


def _routing_options() -> type[Strict]:
    """`routing_options`: the settings of every policy's settings type (Policy.settings_type, each declared with
    base.py's `setting`), each key once: those of one or some policies first, in POLICIES' order, then those every
    policy has. A setting two policies declare apart must be declared alike. NodeConfig checks that the keys a node
    sets are settings of its own policy (check_routing_options)."""
    declared: dict[str, tuple[dataclasses.Field, Any]] = {}
    owners: dict[str, list[str]] = {}
    for name, policy in policies.POLICIES.items():
        hints = get_type_hints(policy.settings_type)
        for setting in dataclasses.fields(policy.settings_type):
            first, hint = declared.setdefault(setting.name, (setting, hints[setting.name]))
            if (first.default, first.metadata, hint) != (setting.default, setting.metadata, hints[setting.name]):
                raise TypeError(f"routing setting {setting.name!r} is declared twice, differently (by {name})")
            owners.setdefault(setting.name, []).append(name)
    fields = {}
    for key in sorted(declared, key=lambda key: len(owners[key]) == len(policies.POLICIES)):  # a stable sort
        setting, hint = declared[key]
        who = "Every policy" if len(owners[key]) == len(policies.POLICIES) else ", ".join(owners[key])
        meta = setting.metadata
        fields[key] = (hint, Field(setting.default, ge=meta["ge"], le=meta["le"], description=f"{who}: {meta['doc']}"))
    return create_model(
        "RoutingOptions", __base__=Strict, __doc__="Settings of the routing policies (docs/routing.md).", **fields
    )


RoutingOptions = _routing_options()


def check_routing_options(policy: str | None, options: BaseModel) -> None:
    """The `routing_options` an engine node sets are settings of its policy (`routing`; unset: the default)."""
    name = policy or policies.DEFAULT_POLICY
    own = policies.POLICIES[name].settings_type.names()
    foreign = sorted(options.model_fields_set - set(own))
    if foreign:
        owners = [other for other, kind in policies.POLICIES.items() if foreign[0] in kind.settings_type.names()]
        raise ValueError(
            f"routing_options.{foreign[0]} is a setting of {' and '.join(owners)}, not of routing {name} (whose "
            f"settings are: {', '.join(own)})"
        )


class PoolConfig(Strict):
    """One engine pool of a disaggregated node: its replicas, and what differs from the node's settings."""

    engine_args: dict[str, Any] = Field(
        default_factory=dict, description="Merged over the node's engine_args for this pool's engines."
    )
    resources: Resources | None = Field(
        None, description="This pool's replicas and what each reserves (default: the node's resources)."
    )
    host: str | None = Field(None, description="Hostfile host every replica of the pool is pinned to.")


class Disaggregation(Strict):
    """Prefill/decode disaggregation of an engine node (docs/disaggregation.md): a prefill pool computes each
    prompt's KV cache, the KV connector moves it to a decode replica, which streams the answer."""

    prefill: PoolConfig = Field(default_factory=PoolConfig, description="The prefill pool: see PoolConfig.")
    decode: PoolConfig = Field(default_factory=PoolConfig, description="The decode pool: see PoolConfig.")
    kv_connector: str = Field(
        "NixlConnector",
        min_length=1,
        description="The engine's KV connector moving the KV cache (kv_transfer_config).",
    )
    kv_connector_extra_config: dict[str, Any] = Field(
        default_factory=dict, description="The connector's own settings (kv_transfer_config.kv_connector_extra_config)."
    )
    kv_load_failure_policy: Literal["recompute", "fail"] = Field(
        "recompute",
        description="A decode engine whose KV transfer fails: recompute the prompt itself, or fail the request.",
    )
    prefill_routing: RoutingPolicy | None = Field(
        None, description="How the prefill replica is picked (default: the node's routing); decode: the node's."
    )


class NodeConfig(Strict):
    """A graph node: an engine node (`engine: vllm`, or no `module` under task.backend vllm) or a custom Python
    node (`module` + `name`)."""

    serve_id: str = Field(min_length=1, description="Unique node name; the Serve deployment; default model name.")
    engine: str | None = Field(
        None,
        description=f"An engine kind of flagscale/engines/: {', '.join(ENGINES)} (docs/engines.md says which ones "
        "serve here); default task.backend.",
    )
    engine_args: dict[str, Any] = Field(
        default_factory=dict, description="The engine's own args (docs/engines.md), and FlagScale's common ones."
    )
    engine_args_specific: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="Per engine: args merged over engine_args for that engine only."
    )
    allow_engine_args: list[str] = Field(
        default_factory=list,
        description="Engine node: engine args that hand every client of the endpoint more than the model (remote "
        "code, shell tools, files read or written at a client's request), opted into by name, e.g. "
        f"`allow_engine_args: [tools]`; without it they are refused. Per engine: {UNSAFE_ARGS}.",
    )
    resources: Resources = Field(default_factory=Resources, description="Replicas and what each reserves: below.")
    module: str | None = Field(None, description="Custom node: its .py file (docs/graphs.md).")
    name: str | None = Field(None, description="Custom node: the class in `module`.")
    depends: list[str] = Field(default_factory=list, description="Custom node: the nodes whose outputs it takes.")
    profile: ProfileConfig | None = Field(None, description="FlagScale per-node default of action=bench.")
    routing: RoutingPolicy | None = Field(
        None,
        description="Engine node: how the router picks a replica per request (docs/routing.md). cache_aware "
        "(default): the replica that was sent the longest prefix of the prompt (chat: of the conversation), within "
        "a load bound; least_load: the least busy; session: sticky per OpenAI `user` field or X-Session-Id "
        "header, else least_load; round_robin: in turn.",
    )
    routing_options: RoutingOptions = Field(
        default_factory=RoutingOptions,
        description="Engine node: settings of its `routing` policy, each key one the policy has: see below.",
    )
    disaggregation: Disaggregation | None = Field(
        None,
        description="Engine node: serve it as a prefill pool and a decode pool (docs/disaggregation.md); "
        "deploy.prefill_decode_disaggregation gives every engine node one.",
    )

    @field_validator("serve_id")
    @classmethod
    def _safe_serve_id(cls, serve_id: str) -> str:
        if not SAFE_ID.fullmatch(serve_id):
            raise ValueError(
                f"serve_id {serve_id!r} is not a safe name: use letters, digits, '.', '_' and '-', starting with a "
                "letter or digit (it names log files and Ray Serve deployments)"
            )
        return serve_id

    @model_validator(mode="after")
    def _kind(self) -> NodeConfig:
        if self.engine is not None and self.module is not None:
            raise ValueError("a node is either an engine node (`engine`) or a custom node (`module`), not both")
        if self.module is not None and self.disaggregation is not None:
            raise ValueError("`disaggregation` is for engine nodes; a custom node has no prefill or decode")
        if self.engine is not None and self.engine not in ENGINES:
            raise ValueError(f"unknown engine {self.engine!r}; known: {', '.join(ENGINES)}")
        if self.module is not None and self.allow_engine_args:
            raise ValueError("`allow_engine_args` is for engine nodes; a custom node has no engine args")
        if self.module is not None and self.routing is not None:
            raise ValueError("`routing` is for engine nodes; a custom node is called by the graph, not routed")
        if self.module is not None and not self.name:
            raise ValueError("a custom node with `module` also needs `name` (the class)")
        if self.module is None:
            check_routing_options(self.routing, self.routing_options)
        unknown = sorted(set(self.engine_args_specific) - set(ENGINES))
        if unknown:
            raise ValueError(f"engine_args_specific has unknown engine(s) {unknown}; known: {', '.join(ENGINES)}")
        return self

    def merged_engine_args(self) -> dict[str, Any]:
        """engine_args with engine_args_specific.<engine> over them."""
        return {**self.engine_args, **self.engine_args_specific.get(self.engine or "", {})}

    @property
    def is_engine(self) -> bool:
        return self.module is None


class ServeConfig(Strict):
    """The whole resolved config: what `run.py --config-name serve` composes."""

    experiment: ExperimentConfig = Field(description="The experiment: see below.")
    serve: list[NodeConfig] = Field(min_length=1, description="The graph's nodes, at least one: see below.")
    action: str = Field("run", description=f"One of {', '.join(ACTIONS)}.")
    foreground: bool = Field(False, description="Keep `run` attached; Ctrl-C stops everything.")
    output: Literal["table", "wide", "json"] = Field(
        "table",
        description="`status` output: table (what an operator scans first, 80 columns), wide (every column), json.",
    )
    serve_id: str | None = Field(
        None,
        description="`logs`: only this node's engine replicas (a disaggregated node's: both of its pools; or one "
        "pool, `<node>-prefill` / `<node>-decode`).",
    )
    replica: str | None = Field(
        None, description="`logs`: only this engine replica: its id, or a prefix of it that names one replica."
    )
    follow: bool = Field(
        False, description="`logs`: keep printing new lines (like tail -f) until Ctrl-C or until the deployment stops."
    )
    lines: int = Field(50, ge=0, description="`logs`: how many of each log's last lines to print.")
    _notices: list[str] = PrivateAttr(default_factory=list)

    @property
    def notices(self) -> list[str]:
        """What loading mapped or ignored (flagscale/config/compat.py); `run` and `dryrun` print them."""
        return self._notices

    @field_validator("action")
    @classmethod
    def _action(cls, action: str) -> str:
        if action not in ACTIONS:
            raise ValueError(f"unknown action {action!r}; one of: {', '.join(ACTIONS)}")
        return action

    @field_validator("serve_id", "replica", mode="before")
    @classmethod
    def _id_text(cls, value: Any) -> Any:
        """An id typed on the command line: Hydra reads `replica=4` as a number; a digit-only prefix is fine."""
        if isinstance(value, int) and not isinstance(value, bool):
            return str(value)
        if value is not None and not isinstance(value, str):
            raise ValueError(f"{value!r} is not an id; quote it for Hydra, e.g. replica=\"'1e5'\"")
        return value
