"""`status`'s result, typed: what collect (flagscale/actions/status.py) finds and the table (status_table.py) shows.
`to_json()` is `output=json`'s document (its keys are part of the CLI's interface: tests and scripts read them).

The engines' load (EngineKind.status_load) and the router's view of a replica come as their producers give them
(the metric names and the routing policy's counters differ per engine and per policy), and stay dicts."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any


@dataclass
class Scaling:
    """The replica settings Serve applies to a deployment: num_replicas or autoscaling_config, and its target."""

    target_replicas: int | None
    num_replicas: int | None
    autoscaling: dict[str, Any] | None


@dataclass
class DeploymentStatus:
    status: str  # Serve's: HEALTHY, UPDATING, UNHEALTHY, ...
    replicas: dict[str, int]  # replica state -> count
    message: str = ""
    scaling: Scaling | None = None  # absent when Serve's controller did not tell

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"status": self.status, "replicas": self.replicas, "message": self.message}
        if self.scaling is not None:
            out["scaling"] = asdict(self.scaling)
        return out


@dataclass
class ReplicaRow:
    """One engine replica as its registry record has it, with what status learnt of it."""

    serve_id: str
    replica_id: str
    engine_kind: str
    role: str  # colocated, prefill, decode
    host: str
    node_id: str
    pid: int | None
    engine_pid: int | None
    url: str
    # since the router saw its heartbeat advance, by the router's clock (None: the router has not told)
    heartbeat_age_s: float | None
    state: str  # READY; STALE: the router saw no heartbeat for registry.STALE_AFTER_S
    worker_cpus: list[int] = field(
        default_factory=list
    )  # cores the CPU layout gave the engine's workers; [] = not pinned
    gpus: list[str] = field(default_factory=list)  # device ids Ray gave the replica (of `family`); [] = none
    family: str = ""  # the device family they are of (flagscale/devices); "" for records before families
    ranks: list[dict[str, Any]] = field(
        default_factory=list
    )  # an engine of several processes: each rank's pid, host, ...
    log: str = ""
    kv_events: str = ""  # where its engine publishes KV-cache events ("" none: the router's approximate table)
    engine: dict[str, float] | None = None  # its engine's load (EngineKind.status_load); None: /metrics did not answer
    requests_served: int | None = None  # since the router started
    router: dict[str, Any] | None = None  # the router's view: in-flight, circuit, routing table (docs/routing.md)
    asleep: bool = False  # its engine sleeps (resources.sleep_delay_s): GPU memory freed, woken by the next request
    models: list[str] = field(default_factory=list)  # what it serves: its model names, then the adapters it loaded
    adapter_errors: dict[str, str] = field(default_factory=dict)  # LoRA adapters it failed to load: name -> why

    @property
    def node(self) -> str:
        """The graph node it serves, and its role when not colocated."""
        return self.serve_id if self.role == "colocated" else f"{self.serve_id} ({self.role})"


@dataclass
class RouterProcess:
    pid: int | None = None
    inflight: int = 0
    served: int = 0
    moved: int = 0
    resumed: int = 0
    draining: bool = False


@dataclass
class RouterTotals:
    """The router's counters over all its processes: in flight, requests moved to another replica, streams resumed."""

    inflight: int = 0
    moved: int = 0
    resumed: int = 0
    processes: dict[str, RouterProcess] = field(default_factory=dict)
    decode_only: int = 0  # disaggregated requests decoded without prefill (their prefill pool was gone)
    kv_released: int = 0  # prefills' KV blocks no decode replica took, released by the router

    @classmethod
    def of(cls, stats: dict[str, Any]) -> RouterTotals:
        """From the router's stats (flagscale/router/peers.py: merge_stats), without its per-replica part."""
        known = {f.name for f in fields(RouterProcess)}
        processes = {
            name: RouterProcess(**{k: v for k, v in p.items() if k in known})
            for name, p in (stats.get("processes") or {}).items()
        }
        counts = {k: stats.get(k, 0) for k in ("inflight", "moved", "resumed", "decode_only", "kv_released")}
        return cls(**counts, processes=processes)


@dataclass
class HostRow:
    """A host or Ray node (Launcher.hosts), with the replicas on it."""

    host: str
    role: str
    chip: str | None
    slots: Any
    ray_node: str  # alive, dead
    node_id: str = ""
    session: Any = None
    replicas: list[str] = field(default_factory=list)
    family: str = ""  # the device family its type= names (flagscale/devices)
    devices: list[dict] | None = None  # what its family's vendor CLI listed at start; None: no listing


@dataclass
class StatusReport:
    app: str
    endpoint: str
    models: list[str]
    status: str  # the application's: RUNNING, DEPLOYING, ..., NOT_DEPLOYED
    http_health: str = "ok"  # "ok", or why /health did not answer
    healthy: bool = False
    phase: str = ""
    ray_address: str = ""
    message: str = ""
    deployments: dict[str, DeploymentStatus] = field(default_factory=dict)
    replicas: list[ReplicaRow] = field(default_factory=list)
    router: RouterTotals | None = None
    hosts: list[HostRow] | None = None  # None: the launcher has no host table
    planner: dict[str, dict[str, Any]] = field(default_factory=dict)  # serve_id -> its SLO planner's last decision
    # serve_id -> the LoRA adapter set given at run time through the router's admin call (replica/runtime_adapters.py)
    runtime_adapters: dict[str, dict[str, str]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "app": self.app,
            "endpoint": self.endpoint,
            "models": self.models,
            "phase": self.phase,
            "ray_address": self.ray_address,
            "status": self.status,
            "message": self.message,
            "deployments": {name: d.to_json() for name, d in self.deployments.items()},
            "replicas": [asdict(r) for r in self.replicas],
            "router": asdict(self.router) if self.router else None,
            "http_health": self.http_health,
            "planner": self.planner,
            "runtime_adapters": self.runtime_adapters,
        }
        if self.hosts is not None:
            out["hosts"] = [asdict(h) for h in self.hosts]
        out["healthy"] = self.healthy
        return out
