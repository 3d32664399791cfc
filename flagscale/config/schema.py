"""The one typed schema of an experiment config. Field docs here are the reference for docs/config.md."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, field_validator, model_validator

ACTIONS = ("run", "stop", "status", "dryrun", "bench")


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


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
    cpu_affinity: Literal["auto", "off"] = Field(
        "auto",
        description="auto: when vLLM's CPU backend binds a worker to some cores, its engine core joins those "
        "cores and its API server and the router keep to the others (flagscale/serve/cpu_layout.py); off: leave "
        "CPU placement to the OS.",
    )
    use_fs_serve: bool | None = Field(None, description="FlagScale key, accepted and ignored.")
    # Graph entry (deployment graphs): route and request fields.
    name: str | None = Field(None, description="HTTP route of a graph's entry, e.g. /generate.")
    request: dict[str, Any] | None = Field(None, description="Graph request fields: {args: [...], types: [...]}.")


class RunnerConfig(Strict):
    hostfile: str | None = Field(None, description="FlagScale hostfile; null serves on this machine.")
    head: str | None = Field(None, description="Host of the hostfile that runs the Ray head (default: first).")
    ray_port: int | None = Field(None, ge=1, le=65535, description="Ray GCS port (default: a free port).")
    num_cpus: int | None = Field(
        None, ge=1, description="Logical CPUs the local Ray head declares (default: sized to the plan)."
    )
    ssh_port: int = 22
    ssh_user: str | None = None
    ssh_key: str | None = None
    ssh_timeout_s: float = Field(10, gt=0)
    ssh_accept_new_host_keys: bool = False
    ssh_known_hosts: str | None = Field(None, description="known_hosts file checked for host keys (default ~/.ssh/known_hosts).")
    join_timeout_s: float = Field(120, gt=0)
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    deploy: DeployConfig = Field(default_factory=DeployConfig)
    # FlagScale keys that do not change anything here.
    type: str | None = None
    master_addr: str | None = None
    master_port: int | None = None


class TaskConfig(Strict):
    type: Literal["serve"] = "serve"
    backend: Literal["vllm"] | None = None
    entrypoint: None = Field(None, description="FlagScale's custom entrypoint script is not supported.")


class CmdsConfig(Strict):
    before_start: str | None = Field(None, description="Shell snippet run before `ray start` on each host.")


class BenchConfig(Strict):
    input_len: int = Field(128, ge=1)
    output_len: int = Field(64, ge=1)
    num_prompts: int = Field(200, ge=1)
    concurrency: list[PositiveInt] = Field(default_factory=lambda: [1, 16], min_length=1,
                                           description="One benchmark pass per max-concurrency value.")
    model: str | None = Field(None, description="Model id to load (default: the first served model).")
    endpoint: Literal["/v1/completions", "/v1/chat/completions"] = "/v1/completions"
    slo_ttft_ms: float | None = Field(None, gt=0)
    slo_tpot_ms: float | None = Field(None, gt=0)
    seed: int = 0


class ExperimentConfig(Strict):
    exp_name: str
    exp_dir: str
    task: TaskConfig = Field(default_factory=TaskConfig)
    runner: RunnerConfig = Field(default_factory=RunnerConfig)
    envs: dict[str, Any] = Field(default_factory=dict, description="Env vars for every host; nodes_envs per host.")
    cmds: CmdsConfig = Field(default_factory=CmdsConfig)
    bench: BenchConfig = Field(default_factory=BenchConfig)

    @field_validator("envs")
    @classmethod
    def _envs_scalar(cls, envs: dict[str, Any]) -> dict[str, Any]:
        for key, value in envs.items():
            if key == "nodes_envs":
                if not isinstance(value, dict) or not all(isinstance(v, dict) for v in value.values()):
                    raise ValueError("nodes_envs must map host -> {VAR: value}")
            elif isinstance(value, (dict, list)):
                raise ValueError(f"env var {key} must be a scalar, got {type(value).__name__}")
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

    num_replicas: int | None = Field(None, ge=1)
    min_replicas: int | None = Field(None, ge=0)
    max_replicas: int | None = Field(None, ge=1)
    target_ongoing_requests: float | None = Field(None, gt=0)
    num_cpus: float | None = Field(None, ge=0, description="Logical CPUs per replica (default 1).")
    num_gpus: float | None = Field(None, ge=0, description="GPUs per replica (default: TP x PP x DP on GPU).")
    accelerator: str | None = Field(None, description="Hostfile chip type the replica must land on.")
    memory: int | None = Field(None, ge=0, description="Bytes of RAM reserved per replica.")

    @model_validator(mode="after")
    def _replicas(self) -> "Resources":
        autoscale = [self.min_replicas, self.max_replicas, self.target_ongoing_requests]
        if self.num_replicas is not None and any(v is not None for v in autoscale):
            raise ValueError("give either num_replicas or min_replicas/max_replicas, not both")
        if self.min_replicas is not None and self.max_replicas is not None and self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) > max_replicas ({self.max_replicas})")
        return self

    @property
    def autoscaling(self) -> bool:
        return any(v is not None for v in (self.min_replicas, self.max_replicas, self.target_ongoing_requests))


class NodeConfig(Strict):
    """A graph node: an engine node (`engine: vllm`) or a custom Python node (`module` + `name`)."""

    serve_id: str = Field(min_length=1)
    engine: str | None = None
    engine_args: dict[str, Any] = Field(default_factory=dict)
    resources: Resources = Field(default_factory=Resources)
    module: str | None = None
    name: str | None = None
    depends: list[str] = Field(default_factory=list)
    profile: dict[str, Any] | None = Field(None, description="FlagScale per-node bench profile.")

    @model_validator(mode="after")
    def _kind(self) -> "NodeConfig":
        if self.engine is None and self.module is None:
            raise ValueError("a node needs `engine: vllm` or `module` + `name`")
        if self.engine is not None and self.module is not None:
            raise ValueError("a node is either an engine node (`engine`) or a custom node (`module`), not both")
        if self.engine is not None and self.engine != "vllm":
            raise ValueError(f"unknown engine {self.engine!r}; supported: vllm")
        if self.module is not None and not self.name:
            raise ValueError("a custom node with `module` also needs `name` (the class)")
        return self

    @property
    def is_engine(self) -> bool:
        return self.engine is not None


class ServeConfig(Strict):
    """The whole resolved config: what `run.py --config-name serve` composes."""

    experiment: ExperimentConfig
    serve: list[NodeConfig] = Field(min_length=1)
    action: str = "run"
    foreground: bool = Field(False, description="Keep `run` attached; Ctrl-C stops everything.")
    output: Literal["table", "json"] = Field("table", description="`status` output format.")

    @field_validator("action")
    @classmethod
    def _action(cls, action: str) -> str:
        if action not in ACTIONS:
            raise ValueError(f"unknown action {action!r}; one of: {', '.join(ACTIONS)}")
        return action
