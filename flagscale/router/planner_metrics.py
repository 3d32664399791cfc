"""The SLO planners' and the scale-from-zero series on the endpoint's /metrics (docs/autoscaling.md): per pool
with `resources.slo`, the replica count changes its planner made and its target (from the records the planners
publish, flagscale/replica/slo_policy.py), what its sizing asks for before the delays, what it measured and what
it forecasts; and this router process's requests held for a model at zero replicas.

The planners' series are the same on every router process (one record per pool in the KV store): they are
written once, after the router processes' own series, without a router_process label."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from flagscale.replica.slo_policy import planner_records
from flagscale.router.metrics import _escape

log = logging.getLogger("flagscale.router")


def _family(name: str, kind: str, help_text: str, samples: list[tuple[dict[str, str], float]]) -> list[str]:
    if not samples:
        return []
    lines = [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
    for labels, value in samples:
        inner = ",".join(f'{key}="{_escape(str(v))}"' for key, v in labels.items())
        lines.append(f"{name}{{{inner}}} {value:g}")
    return lines


def planner_text(records: dict[str, dict[str, Any]], held: dict[str, int], timeouts: int) -> str:
    pools = sorted(records.items())
    lines = _family(
        "flagscale_router_planner_changes_total",
        "counter",
        "Replica count changes the SLO planner made, per pool (each logged with its reason; status shows the last).",
        [({"serve_id": serve_id}, record.get("changes", 0)) for serve_id, record in pools],
    )
    lines += _family(
        "flagscale_router_planner_target_replicas",
        "gauge",
        "The replica count the SLO planner asks for, per pool.",
        [({"serve_id": serve_id}, record.get("target", 0)) for serve_id, record in pools],
    )
    lines += _family(
        "flagscale_router_planner_desired_replicas",
        "gauge",
        "The replica count the SLO planner's sizing asks for before its delays, per pool.",
        [({"serve_id": serve_id}, record["desired"]) for serve_id, record in pools if "desired" in record],
    )
    for part in ("measured", "forecast"):
        lines += _family(
            f"flagscale_router_planner_{part}",
            "gauge",
            f"What the SLO planner {'measured over its last window' if part == 'measured' else 'forecasts'}, per "
            "pool and signal (as status shows it: latencies in ms, rates per second).",
            [
                ({"serve_id": serve_id, "signal": signal}, value)
                for serve_id, record in pools
                for signal, value in sorted((record.get(part) or {}).items())
            ],
        )
    lines += _family(
        "flagscale_router_held_requests",
        "gauge",
        "Requests this router process holds for a model at zero replicas while one starts.",
        [({"model": model}, count) for model, count in sorted(held.items())],
    )
    lines += _family(
        "flagscale_router_held_requests_timed_out_total",
        "counter",
        "Held requests answered 503 because no replica started within the bound.",
        [({}, timeouts)] if held or timeouts else [],
    )
    return "\n".join(lines) + "\n" if lines else ""


async def planner_series(app: str, cold_start: Any) -> str:
    """The series for /metrics ('' when no pool has a planner and nothing was held)."""
    try:
        records = await asyncio.get_running_loop().run_in_executor(None, planner_records, app)
    except Exception as exc:  # no GCS (a router run without Ray) or no answer: the rest of /metrics stands
        log.debug("no SLO planner records: %r", exc)
        records = {}
    held = dict(cold_start.held) if cold_start is not None else {}
    return planner_text(records, held, cold_start.timeouts if cold_start is not None else 0)
