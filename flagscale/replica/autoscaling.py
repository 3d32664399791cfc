"""Autoscaling engine replicas on the load their engine servers report.

Serve's default policy counts the requests that reach a replica through Serve. Requests reach an engine replica
through the router, straight to its engine server, so Serve would see none and never scale an engine up. Each
engine replica therefore reports its server's requests (running + waiting, from the engine's /metrics as its
engine kind reads them) through Serve's custom autoscaling metrics (EngineReplica.record_autoscaling_stats), and
`engine_load_policy` turns their sum into a replica count with the node's target_ongoing_requests. Serve applies
the node's min/max_replicas, upscale and downscale delays on top, as for its own policy. A node with
`resources.slo` is sized by the SLO planner instead (slo_policy.py).

A node that may scale to zero (min_replicas 0) starts with one replica, so `run` sees it serve; it goes to zero
when idle, and Serve starts one again when the router holds a request for it (flagscale/router/cold_start.py).
"""

from __future__ import annotations

from typing import Any

from flagscale.replica.slo_policy import with_slo_policy

ENGINE_REQUESTS = "engine_requests"  # running + waiting requests in one replica's engine server
POLICY_FUNCTION = "flagscale.replica.autoscaling:engine_load_policy"


def engine_load_policy(ctx: Any) -> tuple[float, dict[str, Any]]:
    """Serve's autoscaling policy signature: (AutoscalingContext) -> (desired replicas, policy state)."""
    loads = (ctx.aggregated_metrics or {}).get(ENGINE_REQUESTS) or {}
    if ctx.current_num_replicas == 0 or not loads:  # nothing reported yet: stay
        return ctx.target_num_replicas, {}
    return sum(loads.values()) / ctx.config.get_target_ongoing_requests(), {}


def with_engine_load_policy(
    scaling: dict[str, Any],
    slo: dict[str, Any] | None = None,
    role: str | None = None,
    sleep_delay_s: float | None = None,
) -> dict[str, Any]:
    """An engine deployment's replica keywords, its autoscaling (if any) driven by the engines' load, or by the
    SLO planner where the node states an `slo` (role: the pool's, for what the planner sizes it on;
    `sleep_delay_s`: its replicas sleep after this long idle, and the planner sizes the replicas awake)."""
    if "autoscaling_config" not in scaling:
        return scaling
    autoscaling = dict(scaling["autoscaling_config"])
    if autoscaling.get("min_replicas") == 0:
        autoscaling["initial_replicas"] = 1
    if slo:
        autoscaling = with_slo_policy({**autoscaling, "slo": slo}, role, sleep_delay_s)
    else:
        autoscaling["policy"] = {"policy_function": POLICY_FUNCTION}
    return {**scaling, "autoscaling_config": autoscaling}
