"""The plan's types: Plan, what `run` deploys and `dryrun` prints, and EnginePlan, one engine deployment of it; and
what the plan says about who can reach it without a key."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flagscale import engines, launchers
from flagscale.cluster.placement import ClusterPlan
from flagscale.config.graph import GraphPlan
from flagscale.config.replicas import ReplicaSettings
from flagscale.config.routing import Admission, RoutingSpec
from flagscale.engines.base import EngineKind
from flagscale.net import is_loopback
from flagscale.plan.lora import LoraPlan

ROUTER_DEPLOYMENT = "router"


@dataclass(frozen=True)
class EnginePlan(ReplicaSettings):
    """One engine node, planned once: its argv and where its replicas go (cluster.placement.reserve)."""

    serve_id: str
    model: str
    model_names: list[str]
    argv: list[str]
    device: str  # "cpu", "gpu", or a hostfile chip type
    devices_per_replica: int
    parallel: tuple[int, int, int] = (1, 1, 1)  # TP, PP, DP
    expert_parallel: bool = False  # a MoE model's experts spread over its DP x TP ranks (enable_expert_parallel)
    host_argv: dict[str, list[str]] = field(default_factory=dict)  # node IP -> argv (experiment.node_args)
    chip: str | None = None  # hostfile chip type the replicas run on (multi-host)
    family: str = "cpu"  # the device family they run on (flagscale/devices)
    family_env: dict[str, str] = field(default_factory=dict)  # its plugin's env for this engine kind (VLLM_PLUGINS)
    placement_bundles: list[dict[str, float]] | None = None  # set when TP x PP spans hosts
    placement_strategy: str | None = None
    ranks_per_host: int = 1  # the engine ranks each host of a replica runs (placement.Reservation)
    routing: RoutingSpec = field(default_factory=RoutingSpec)  # how the router picks a replica (node `routing`)
    role: str | None = None  # "prefill" / "decode": a pool of a disaggregated node (docs/disaggregation.md)
    group: str = ""  # the node's serve_id (a pool's serve_id is <node>-<role>)
    pinned_host: str | None = None  # the hostfile host a pool is pinned to (disaggregation.<role>.host)
    gpu_memory_utilization: float | None = None  # GPU engines: what each replica promises vLLM of its GPU
    # secret engine args (hf_token) as the env vars that carry them to the server, never in argv
    secret_env: dict[str, str] = field(default_factory=dict, repr=False)
    engine: str = engines.DEFAULT_ENGINE  # the engine kind (flagscale/engines/)
    sleep_delay_s: float | None = None  # resources.sleep_delay_s: idle this long, a replica sleeps (plan/sleep.py)
    kv_events: bool = False  # its replicas publish KV-cache events for the router's index (routing_options.kv_events)
    lora: LoraPlan | None = None  # the node's LoRA adapters, each served as a model (docs/routing.md)

    @property
    def adapters(self) -> dict[str, str]:
        """The node's LoRA adapters: name (a model clients name) -> directory."""
        return self.lora.adapters if self.lora else {}

    @property
    def kind(self) -> EngineKind:
        return engines.get(self.engine)

    @property
    def slo(self) -> dict | None:
        """resources.slo, where the SLO planner sizes the node (or the pool)."""
        return (self.autoscaling or {}).get("slo")

    @property
    def planned_awake(self) -> bool:
        """The SLO planner sizes its replicas kept awake: an SLO, and replicas that sleep (docs/autoscaling.md)."""
        return self.sleep_delay_s is not None and bool(self.slo)

    @property
    def initial_replicas(self) -> int:
        """A node planned awake starts max_replicas at `run`: the ones not wanted awake sleep, so a rising load
        wakes a replica (a second) instead of starting one (a minute or more), and what max needs is checked
        before anything starts."""
        if self.planned_awake:
            return max(1, (self.autoscaling or {}).get("max_replicas", 1))
        return super().initial_replicas


@dataclass
class Plan:
    app_name: str
    exp_dir: str
    host: str
    port: int
    engines: list[EnginePlan]
    head_num_cpus: int
    envs: dict[str, str]
    before_start: str | None
    after_stop: str | None
    startup_timeout_s: float
    schedule_timeout_s: float
    drain_timeout_s: float
    pin_cpus: bool = True  # deploy.cpu_affinity == "auto"
    ray_port: int | None = None  # runner.ray_port; None: a port free on the head's host when the run starts
    notes: list[str] = field(default_factory=list)
    api_key: str | None = field(default=None, repr=False)  # deploy.api_key / api_key_env, resolved
    old_key_grace_s: float = 300.0  # deploy.old_key_grace_s: the previous key's grace after a rotation
    protect_metrics: bool = False
    admission: Admission = field(default_factory=Admission)  # the router's body cap and queue bounds (deploy.*)
    router_processes: int = 1  # deploy.router_processes, or default_router_processes
    graph: GraphPlan | None = None  # custom nodes and the graph's HTTP entry, when the config has any
    launcher: str = "local"  # where the Ray cluster comes from (flagscale/launchers/: LAUNCHERS)
    # the launcher's part of the plan, read by the launcher only:
    cluster: ClusterPlan | None = None  # hosts of the hostfile, when runner.hostfile is set
    ray_cluster: Any = None  # an existing Ray cluster's ClusterFacts (runner.type: ray), read before planning
    placement: Any = None  # ray_cluster only: where each replica would go (ray_cluster.Placement)
    # where the launcher moved deploy.host to, and why (a Ray cluster: loopback -> the head's address); None: as set
    endpoint_moved: str | None = None

    @property
    def model_ids(self) -> list[str]:
        """Every model clients may name: each engine node's served names, then its LoRA adapters."""
        return list(dict.fromkeys(name for e in self.engines for name in [*e.model_names, *e.adapters]))

    @property
    def endpoint(self) -> str:
        return f"http://{launchers.get(self.launcher).endpoint_host(self)}:{self.port}"

    @property
    def log_dir(self) -> Path:
        return Path(self.exp_dir) / "serve_logs"


def open_without_key(plan: Plan) -> str | None:
    """The warning for a deployment that listens beyond loopback with no API key (what listens where), or None:
    anyone who reaches those addresses can use the models, and the engines' own admin paths."""
    if plan.api_key:
        return None
    launcher = launchers.get(plan.launcher)
    listening = []
    if not is_loopback(plan.host):
        listening.append(f"the router on {plan.host}:{plan.port}")
    if plan.engines and not is_loopback(launcher.engine_bind_host):
        hosts = launcher.engine_hosts(plan)
        where = f" ({', '.join(hosts)})" if hosts else ""
        listening.append(f"every engine server on its node's address{where}, on a port of its own")
    if not listening:
        return None
    return (
        f"no API key, and {' and '.join(listening)} listen beyond loopback: anyone who can reach those addresses "
        "can use them without a key; set experiment.runner.deploy.api_key_env (docs/operations.md)"
    )
