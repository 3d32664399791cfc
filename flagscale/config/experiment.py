"""`experiment:`: the run's name and directory, where it runs (runner, deploy), its env vars, commands and benchmark
settings."""

from __future__ import annotations

import os
from typing import Any, Literal

from pydantic import (
    Field,
    PositiveInt,
    field_validator,
    model_validator,
)

from flagscale import engines
from flagscale.config.fields import Backend, Strict, launcher_key
from flagscale.config.tuner import AutoTunerConfig

# Shorter keys are refused before anything starts: a key is all that stands between the port and the engines.
MIN_API_KEY_CHARS = 16


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
        "too with protect_metrics). At least 16 characters. Prefer api_key_env.",
    )
    api_key_env: str | None = Field(
        None, min_length=1, description="Name of an env var holding api_key, so the key stays out of YAML."
    )
    old_key_grace_s: float = Field(
        300,
        ge=0,
        description="When `run` changes the API key in place: how long after the update is done the previous key is "
        "still accepted beside the new one (docs/operations.md, Rotating the key). 0: refused once it is done.",
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
    upstream_first_byte_timeout_s: float = Field(
        900,
        gt=0,
        description="The most a replica may take to send the first byte of its answer's body (a prompt's prefill; "
        "a whole non-streamed answer) before the router gives up on it and retries the request elsewhere.",
    )
    upstream_idle_timeout_s: float = Field(
        30,
        gt=0,
        description="The most a replica may stay silent between two pieces of a streamed answer before the router "
        "takes it as frozen and resumes the stream on another replica.",
    )
    client_idle_timeout_s: float = Field(
        60,
        gt=0,
        description="A client connection is closed when it has not sent a whole request head within this long of "
        "opening or of its previous answer's end (idle keep-alive and slow headers alike). Applied at router start.",
    )
    client_body_timeout_s: float = Field(
        300,
        gt=0,
        description="The most a client may take to send a request's body once its head is in (408 after).",
    )
    max_client_connections: int = Field(
        10000,
        ge=1,
        description="Open client connections per router process (at most half its open-file limit); beyond it a new "
        "connection gets 503 and is closed. Applied at router start.",
    )
    max_reading_body_bytes: int = Field(
        256 * 1024 * 1024,
        ge=1024,
        description="Per router process: bytes of request bodies being read and parsed at once; a request that "
        "would go beyond gets 503 with Retry-After.",
    )
    allowed_hosts: list[str] = Field(
        default_factory=list,
        description="Without an API key, the router answers only requests whose Host header is an IP address, "
        "localhost, its own host name or deploy.host (against DNS rebinding from web pages); names added here are "
        "accepted too.",
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

    @field_validator("api_key")
    @classmethod
    def _long_enough(cls, key: str | None) -> str | None:
        if key is not None and len(key) < MIN_API_KEY_CHARS:
            raise ValueError(f"the API key is {len(key)} characters long; use at least {MIN_API_KEY_CHARS}")
        return key

    def resolved_api_key(self) -> str | None:
        """The API key clients must send, or None; api_key_env must name a set, non-empty variable."""
        if self.api_key_env is None:
            return self.api_key
        key = os.environ.get(self.api_key_env)
        if not key:
            raise ValueError(f"api_key_env names {self.api_key_env}, which is not set (or empty) in this environment")
        if len(key) < MIN_API_KEY_CHARS:
            raise ValueError(
                f"the key in {self.api_key_env} (api_key_env) is {len(key)} characters long; use at least "
                f"{MIN_API_KEY_CHARS}"
            )
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


class ExperimentConfig(Strict):
    exp_name: str = Field(description="Also the Ray Serve application name.")
    exp_dir: str = Field(
        description="State file, serve_logs/, bench/, hydra/; a relative path is from the working directory."
    )
    task: TaskConfig = Field(default_factory=TaskConfig, description="What kind of job: see below.")
    runner: RunnerConfig = Field(default_factory=RunnerConfig, description="Where and how it runs: see below.")
    envs: dict[str, Any] = Field(
        default_factory=dict,
        description="Env vars for every host; device_type_specific per hostfile type= (or family), nodes_envs per host.",
    )
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
            if key in ENV_TABLES:
                if not isinstance(value, dict) or not all(isinstance(v, dict) for v in value.values()):
                    raise ValueError(f"{key} must map {ENV_TABLES[key]} -> {{VAR: value}}")
            elif isinstance(value, (dict, list)):
                raise ValueError(f"env var {key} must be a scalar, got {type(value).__name__}")
        tables = [table for key in ENV_TABLES for table in envs.get(key, {}).values()]
        for table in [envs, *tables]:
            for key, value in table.items():  # what engines read once started is checked here, before
                if key not in ENV_TABLES:
                    engines.checked_env(key, _env_str(value))
        return envs

    def env_for(self, host: str | None = None, chip: tuple[str | None, ...] = ()) -> dict[str, str]:
        """The envs of a host: every host's, then device_type_specific's for each of `chip` (its family, then its
        type= as written: FlagScale keys the table by type), then nodes_envs' for the host."""
        env = {k: _env_str(v) for k, v in self.envs.items() if k not in ENV_TABLES}
        for key in chip:
            if key is not None:
                env.update({k: _env_str(v) for k, v in self.envs.get("device_type_specific", {}).get(key, {}).items()})
        if host is not None:
            env.update({k: _env_str(v) for k, v in self.envs.get("nodes_envs", {}).get(host, {}).items()})
        return env


# experiment.envs' tables of envs, and what each is keyed by (FlagScale's names)
ENV_TABLES = {"nodes_envs": "host", "device_type_specific": "hostfile type= or device family"}


def _env_str(value: Any) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)
