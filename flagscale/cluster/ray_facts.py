"""An existing Ray cluster as one connection found it before planning (cluster/ray_existing.py reads it): its
alive nodes, what each offers, and what `resources.accelerator` names there. Plain data: placement (cluster/
placement.py) and the launcher both read it."""

from __future__ import annotations

from dataclasses import dataclass, field

from flagscale.errors import ConfigError

UNSCHEDULABLE = ("node:", "memory", "object_store_memory")  # totals that are no one's to ask for


@dataclass(frozen=True)
class NodeFacts:
    node_id: str
    ip: str
    is_head: bool
    total: dict[str, float]
    available: dict[str, float]
    labels: dict[str, str] = field(default_factory=dict)

    def offers(self, free: bool = False) -> dict[str, float]:
        """What replicas can ask for here (CPU, GPU, custom resources), in total or free now."""
        resources = self.available if free else self.total
        return {k: v for k, v in resources.items() if not k.startswith(UNSCHEDULABLE)}


@dataclass(frozen=True)
class ClusterFacts:
    """The cluster as one connection found it, before planning: its alive nodes and its Serve applications."""

    address: str
    nodes: list[NodeFacts]
    applications: list[str] = field(default_factory=list)

    @property
    def head(self) -> NodeFacts:
        return next((n for n in self.nodes if n.is_head), self.nodes[0])

    def most(self, resource: str) -> float:
        return max((n.total.get(resource, 0.0) for n in self.nodes), default=0.0)

    def resource_names(self) -> list[str]:
        return sorted({k for n in self.nodes for k in n.offers() if k not in ("CPU", "GPU")})


def fmt(resources: dict[str, float]) -> str:
    return ", ".join(f"{k}:{v:g}" for k, v in sorted(resources.items()) if v) or "nothing"


def fmt_labels(labels: dict[str, str]) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(labels.items()))


def accelerator_requirement(accelerator: str, facts: ClusterFacts, where: str) -> tuple[str, str]:
    """resources.accelerator on a Ray cluster names what its nodes already have, looked for in this order:
    ("resource", "accelerator_type:<X>"): Ray's resource of GPU nodes of that type;
    ("devices", "<X>"): a custom resource <X>, counted in devices (TP x PP x DP per replica);
    ("label", key): a node label whose value is <X> (e.g. ray.io/accelerator-type=<X>), a label selector."""
    typed = f"accelerator_type:{accelerator}"
    names = facts.resource_names()
    if typed in names:
        return "resource", typed
    if accelerator in names:
        return "devices", accelerator
    keys = sorted({k for n in facts.nodes for k, v in n.labels.items() if v == accelerator})
    if keys:
        return "label", keys[0]
    types = [n.removeprefix("accelerator_type:") for n in names if n.startswith("accelerator_type:")]
    custom = [n for n in names if not n.startswith("accelerator_type:")]
    labels = sorted({f"{k}={v}" for n in facts.nodes for k, v in n.labels.items() if not k.startswith("ray.io/node")})
    raise ConfigError(
        f"resources.accelerator={accelerator!r}, but no node of the Ray cluster at {facts.address} has it (accelerator "
        f"types: {', '.join(types) or 'none'}; custom resources: {', '.join(custom) or 'none'}; labels: "
        f"{', '.join(labels) or 'none'})",
        where,
    )
