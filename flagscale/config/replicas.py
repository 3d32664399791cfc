"""What every Serve deployment of a node gets from its `resources`: replica count or autoscaling, and the
Ray resources each replica reserves. Shared by engine nodes (plan.py) and custom nodes (config/graph.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from flagscale.config.schema import Resources


@dataclass
class ReplicaSettings:
    """Base of every planned node (EnginePlan, CustomNodePlan)."""

    num_replicas: int | None  # None when autoscaling
    autoscaling: dict[str, Any] | None
    ray_actor_options: dict[str, Any]

    @property
    def initial_replicas(self) -> int:
        if self.num_replicas is not None:
            return self.num_replicas
        assert self.autoscaling is not None
        return max(1, self.autoscaling.get("min_replicas", 1))

    def serve_scaling(self) -> dict[str, Any]:
        """The replica keyword of `serve.deployment`."""
        if self.autoscaling:
            return {"autoscaling_config": self.autoscaling}
        return {"num_replicas": self.num_replicas or 1}

    def describe_replicas(self) -> str:
        if self.num_replicas is not None:
            return str(self.num_replicas)
        scaling = self.autoscaling or {}
        target = scaling.get("target_ongoing_requests")
        return f"autoscale {scaling.get('min_replicas', 1)}..{scaling.get('max_replicas', '?')}" + (
            f" (target {target:g} in flight)" if target is not None else ""
        )


def replica_settings(res: Resources, default_cpus: float = 1, default_gpus: float = 0) -> ReplicaSettings:
    """`default_*` apply where `resources` leaves num_cpus / num_gpus unset."""
    options: dict[str, Any] = {"num_cpus": res.num_cpus if res.num_cpus is not None else default_cpus}
    gpus = res.num_gpus if res.num_gpus is not None else default_gpus
    if gpus:
        options["num_gpus"] = gpus
    if res.memory:
        options["memory"] = res.memory
    if res.accelerator:
        options["resources"] = {f"accelerator_type:{res.accelerator}": 0.001}
    if not res.autoscaling:
        return ReplicaSettings(res.num_replicas or 1, None, options)
    autoscaling = {
        key: value
        for key, value in (("min_replicas", res.min_replicas), ("max_replicas", res.max_replicas),
                           ("target_ongoing_requests", res.target_ongoing_requests))
        if value is not None
    }  # fmt: skip
    return ReplicaSettings(None, autoscaling, options)
