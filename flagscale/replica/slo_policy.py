"""The SLO planner as Serve's custom autoscaling policy of an engine node with `resources.slo`
(docs/autoscaling.md).

Serve instantiates SloPolicy once per deployment (a class policy, its kwargs from with_slo_policy) and calls it
on every autoscaling tick with the deployment's AutoscalingContext. It reads the replicas' reports
(slo_signals.observe), asks the planner (flagscale/planner/planner.py, the code the simulator runs too), and
returns the planner's target. The planner applies the node's upscale_delay_s / downscale_delay_s itself (the
simulator must decide as the deployment does), so Serve's own delays are set to zero for these nodes; Serve still
keeps the count within min/max and starts the first replica of a pool at zero at once when a request waits for it
(the router's held request reaches Serve as a handle call, flagscale/router/cold_start.py).

A node whose replicas sleep (resources.sleep_delay_s) is planned in replicas kept *awake*: the planner's target
goes to the router, which sends the node's requests to that many replicas (awake ones first) so that the rest
idle into sleep, and wakes one when the target rises (flagscale/router/wake.py). Serve's count is then the most
replicas the planner has wanted awake (within min/max): a replica no longer wanted sleeps, holding no device
memory, and is a wake away (a fraction of a second) where a new one is a cold start (a minute and more on GPUs).

Each decision is published in Ray's key-value store (`planner/<app>/<serve_id>`): `status` shows it per pool
(the SLO, what is measured, the forecast, the target and the reason of the last change), the router counts the
changes in its /metrics, and the router's hold bound at zero replicas comes from the measured start time.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from typing import Any

from flagscale.cluster.ray_compat import kv_get, kv_list, kv_put
from flagscale.planner.planner import Planner
from flagscale.planner.types import PlannerSettings, Slo, planned_awake
from flagscale.replica.registry import KV_NAMESPACE
from flagscale.replica.slo_signals import measured_start_s, observe

log = logging.getLogger("ray.serve")
POLICY_CLASS = "flagscale.replica.slo_policy:SloPolicy"
PUBLISH_EVERY_S = 2.0
# How fresh the planner's figures are. With Serve's defaults (a replica pushes its figures every 10 s, rates over a
# 30 s window) a ramp reaches the planner 15-25 s late, a third of a GPU replica's start (2026-11-29,
# docs/benchmarks.md): an SLO node's replicas record and push every 2 s (Serve 2.60 reads `metrics_interval_s`,
# deprecated in favour of an env var it does not read yet), over a 10 s window.
LOOK_BACK_S = 10.0
PUSH_EVERY_S = 2.0


def _key(app: str, serve_id: str) -> bytes:
    return f"planner/{app}/{serve_id}".encode()


class SloPolicy:
    """Serve's policy callable: (AutoscalingContext) -> (replicas, policy state)."""

    def __init__(
        self,
        slo: dict[str, Any],
        min_replicas: int,
        max_replicas: int,
        sleep_delay_s: float | None = None,
        **settings: Any,
    ):
        planned = PlannerSettings(Slo(**slo), min_replicas, max_replicas, **settings)
        self.sleeps = sleep_delay_s is not None
        self.planner = Planner(planned_awake(planned, sleep_delay_s) if self.sleeps else planned)
        self.bounds = [min_replicas, max_replicas]  # the node's: Serve keeps the count in them
        self.changes = 0
        self.last_change_s: float | None = None
        self.published_s = float("-inf")

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        raw = ctx.raw_metrics or {}
        start_s = measured_start_s(raw)
        if start_s:  # the forecast looks as far ahead as a replica takes to start
            self.planner.settings = dataclasses.replace(self.planner.settings, start_s=start_s)
        held = round(ctx.total_num_requests or 0)  # requests through Serve's handles: the router's held ones
        now = time.time()
        obs = observe(raw, now, ctx.current_num_replicas, held, self.planner.settings.slo.percentile)
        # Serve keeps the count of a node that sleeps, not the planner's (awake) target
        decision = self.planner.decide(obs, target_now=None if self.sleeps else ctx.target_num_replicas)
        if decision.changed:
            self.changes += 1
            self.last_change_s = now
            log.info(
                "SLO planner %s: %d -> %d: %s", ctx.deployment_name, decision.current, decision.target, decision.reason
            )
        if decision.changed or now - self.published_s >= PUBLISH_EVERY_S:
            self._publish(ctx, decision, obs.asleep, now)
        if self.sleeps:
            return max(decision.target, ctx.target_num_replicas or 0), {}
        return decision.target, {}

    def _publish(self, ctx: Any, decision: Any, asleep: int, now: float) -> None:
        settings = self.planner.settings
        record = {
            "slo": dataclasses.asdict(settings.slo),
            "role": settings.role,
            "bounds": self.bounds,
            "start_s": settings.start_s,
            "replicas": ctx.current_num_replicas,
            "sleeps": self.sleeps,  # the target is the replicas kept awake
            "asleep": asleep,
            "target": decision.target,
            "desired": decision.desired,
            "reason": decision.reason,
            "last_change": self.planner.last_reason,
            "last_change_at": self.last_change_s,
            "changes": self.changes,
            "measured": decision.measured,
            "forecast": decision.forecast,
            "updated_at": now,
        }
        try:
            kv_put(_key(ctx.app_name or "", ctx.deployment_name), json.dumps(record).encode(), KV_NAMESPACE)
            self.published_s = now
        except Exception as exc:  # the GCS did not take it: the decision stands, status shows the last one
            log.warning("SLO planner %s: could not publish its decision: %r", ctx.deployment_name, exc)


def planner_records(app: str) -> dict[str, dict[str, Any]]:
    """serve_id -> the last decision its planner published (status, the router)."""
    found = {}
    for key in kv_list(f"planner/{app}/".encode(), KV_NAMESPACE):
        value = kv_get(key, KV_NAMESPACE)
        if value:
            found[key.decode().rsplit("/", 1)[-1]] = json.loads(value)
    return found


def recorded_start_s(app: str, serve_id: str) -> float | None:
    """How long the node's replicas took to start, as its planner last saw (None: no planner, or none seen)."""
    value = kv_get(_key(app, serve_id), KV_NAMESPACE)
    return json.loads(value).get("start_s") if value else None


def with_slo_policy(
    autoscaling: dict[str, Any], role: str | None, sleep_delay_s: float | None = None
) -> dict[str, Any]:
    """An SLO node's Serve autoscaling config: the planner as its policy, its bounds and delays as the planner's
    settings, Serve's own delays zero. `sleep_delay_s`: its replicas sleep after this long idle (planned in
    replicas awake); None: they do not sleep."""
    settings = {key: autoscaling[key] for key in ("upscale_delay_s", "downscale_delay_s") if key in autoscaling}
    slo = dict(autoscaling["slo"])
    settings |= slo.pop("seeds", {})  # auto_tune's measured figures (plan/engine_plan.py), where there are some
    kwargs = {
        "slo": slo,
        "min_replicas": autoscaling.get("min_replicas", 1),
        "max_replicas": autoscaling.get("max_replicas", 1),
        "role": role,
        **({"sleep_delay_s": sleep_delay_s} if sleep_delay_s is not None else {}),
        **settings,
    }
    config = {key: value for key, value in autoscaling.items() if key != "slo"}
    config |= {"upscale_delay_s": 0, "downscale_delay_s": 0}
    config |= {"look_back_period_s": LOOK_BACK_S, "metrics_interval_s": PUSH_EVERY_S}
    if sleep_delay_s is not None:  # all started at `run` (EnginePlan.initial_replicas); the planner wakes them
        config["initial_replicas"] = kwargs["max_replicas"]
    return {**config, "policy": {"policy_function": POLICY_CLASS, "policy_kwargs": kwargs}}
