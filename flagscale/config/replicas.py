"""What every Serve deployment of a node gets from its `resources`: replica count or autoscaling, and the
Ray resources each replica reserves. Shared by engine nodes (plan/engine_plan.py) and custom nodes (config/graph.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from flagscale.config.schema import Resources


@dataclass(frozen=True)
class ReplicaSettings:
    """Base of every planned node (EnginePlan, CustomNodePlan)."""

    num_replicas: int | None  # None when autoscaling
    autoscaling: dict[str, Any] | None
    ray_actor_options: dict[str, Any]
    max_ongoing_requests: int | None  # None: the deployment's own default

    @property
    def initial_replicas(self) -> int:
        if self.num_replicas is not None:
            return self.num_replicas
        assert self.autoscaling is not None
        return max(1, self.autoscaling.get("min_replicas", 1))

    @property
    def most_replicas(self) -> int:
        """The most replicas that run at once: the count, or autoscaling's max_replicas."""
        if self.autoscaling is None:
            return self.initial_replicas
        return max(self.initial_replicas, self.autoscaling.get("max_replicas", 1))

    def serve_scaling(self, default_max_ongoing: int | None = None) -> dict[str, Any]:
        """The replica keywords of `serve.deployment`: count or autoscaling, and requests per replica."""
        autoscaling = {key: value for key, value in (self.autoscaling or {}).items() if key != "slo"}
        scaling: dict[str, Any] = (
            {"autoscaling_config": autoscaling} if self.autoscaling else {"num_replicas": self.num_replicas or 1}
        )
        max_ongoing = self.max_ongoing_requests or default_max_ongoing
        if max_ongoing:
            scaling["max_ongoing_requests"] = max_ongoing
        return scaling

    def describe_replicas(self) -> str:
        if self.num_replicas is not None:
            return str(self.num_replicas)
        scaling = self.autoscaling or {}
        target, slo = scaling.get("target_ongoing_requests"), scaling.get("slo")
        on = f" (target {target:g} in flight)" if target is not None else ""
        if slo:
            bounds = [f"{key[:-3].upper()} {slo[key]:g} ms" for key in ("ttft_ms", "itl_ms") if slo.get(key)]
            seeds = slo.get("seeds") or {}
            seeded = f"; seeded by auto_tune: {seeds['seed_output_tps']:.0f} output tok/s a replica" if seeds else ""
            on = f" (SLO p{slo['percentile']:g} {', '.join(bounds)}{seeded})"
        return f"autoscale {scaling.get('min_replicas', 1)}..{scaling.get('max_replicas', '?')}{on}"


AUTOSCALING_KEYS = ("min_replicas", "max_replicas", "target_ongoing_requests", "upscale_delay_s", "downscale_delay_s")


def actor_options(res: Resources, default_cpus: float = 1, default_gpus: float = 0) -> dict[str, Any]:
    """Ray actor options of one replica; `default_*` apply where `resources` leaves num_cpus / num_gpus unset."""
    options: dict[str, Any] = {"num_cpus": res.num_cpus if res.num_cpus is not None else default_cpus}
    gpus = res.num_gpus if res.num_gpus is not None else default_gpus
    if gpus:
        options["num_gpus"] = gpus
    if res.memory:
        options["memory"] = res.memory
    if res.accelerator:
        options["resources"] = {f"accelerator_type:{res.accelerator}": 0.001}
    return options


def replica_settings(
    res: Resources, ray_actor_options: dict[str, Any] | None = None, auto_replicas: int | None = None
) -> ReplicaSettings:
    """Replica count or autoscaling from `resources`. `ray_actor_options`: what placement decided (engine nodes),
    default `actor_options(res)`; `auto_replicas`: what `num_replicas: auto` comes to on the target."""
    options = ray_actor_options if ray_actor_options is not None else actor_options(res)
    if not res.autoscaling:
        count = auto_replicas if res.num_replicas == "auto" else res.num_replicas
        assert count != "auto", "num_replicas: auto needs the caller's device count"
        return ReplicaSettings(count or 1, None, options, res.max_ongoing_requests)
    autoscaling = {key: getattr(res, key) for key in AUTOSCALING_KEYS if getattr(res, key) is not None}
    if res.slo is not None:  # the SLO planner's (engine nodes: replica/slo_policy.py); never Serve's own key
        autoscaling["slo"] = res.slo.model_dump()
    return ReplicaSettings(None, autoscaling, options, res.max_ongoing_requests)
