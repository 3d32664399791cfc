"""`status`'s SLO planner table (docs/autoscaling.md): per pool with `resources.slo`, the SLO, what its engines
measured over the last window, the forecast, the replicas now and the target (a node whose replicas sleep: the
replicas kept awake), and the reason of the last change (the records flagscale/replica/slo_policy.py publishes)."""

from __future__ import annotations

from typing import Any

from rich.markup import escape
from rich.table import Table


def slo_text(slo: dict[str, Any]) -> str:
    bounds = [f"{key[:-3].upper()} {slo[key]:g} ms" for key in ("ttft_ms", "itl_ms") if slo.get(key)]
    return f"p{slo.get('percentile', 90):g} " + ", ".join(bounds)


def measured_text(measured: dict[str, float]) -> str:
    parts = [f"{key[:-3].upper()} {measured[key]:.0f} ms" for key in ("ttft_ms", "itl_ms") if key in measured]
    parts.append(f"{measured.get('arrival_rps', 0):.2g} req/s, {measured.get('queue', 0):.0f} queued")
    tokens = (measured.get("prompt_tps", 0), measured.get("output_tps", 0))
    if any(tokens):
        parts.append(f"{tokens[0]:.0f}/{tokens[1]:.0f} tok/s in/out")
    if measured.get("kv_usage"):
        parts.append(f"KV {measured['kv_usage']:.0%}")
    return "; ".join(parts)


def forecast_text(forecast: dict[str, float]) -> str:
    ahead = f"in {forecast.get('horizon_s', 0):.0f} s: {forecast.get('arrival_rps', 0):.2g} req/s"
    per_replica = [f"{v:.0f} {k.split('_')[0]} tok/s" for k, v in forecast.items() if k.endswith("_per_replica")]
    return ahead + (f"; a replica sustains {', '.join(per_replica)}" if per_replica else "")


def planner_table(records: dict[str, dict[str, Any]], table: Table) -> Table:
    """Fill `table` (columns: pool, SLO, measured, forecast, replicas, last change) from the planners' records."""
    for serve_id, record in sorted(records.items()):
        low, high = record.get("bounds", ["?", "?"])
        replicas = f"{record.get('replicas')} -> {record.get('target')} ({low}..{high})"
        if record.get("sleeps"):  # the target is the replicas kept awake; Serve keeps the others asleep
            awake = (record.get("replicas") or 0) - (record.get("asleep") or 0)
            replicas = f"{record.get('replicas')} ({awake} awake) -> {record.get('target')} awake (..{high})"
        last = record.get("last_change") or ""
        cells = (
            serve_id + (f" ({record['role']})" if record.get("role") else ""),
            slo_text(record.get("slo", {})),
            measured_text(record.get("measured", {})),
            forecast_text(record.get("forecast", {})),
            replicas,
            f"{last} (now: {record.get('reason', '')})" if record.get("reason") != last else last,
        )
        table.add_row(*(escape(cell) for cell in cells))
    return table
