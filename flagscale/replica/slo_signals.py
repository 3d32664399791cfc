"""What the SLO planner reads of a pool, through Serve's custom autoscaling metrics.

Each engine replica reports its engine's own cumulative figures (`replica_stats`, from EngineReplica.
record_autoscaling_stats): the TTFT and ITL histograms bucket by bucket (`ttft_le:<bound>`), prompt and output
token counters, finished requests, running and waiting requests, KV cache usage, how long its server took to
start, and whether it sleeps (resources.sleep_delay_s). Serve keeps each replica's figures over the look-back
window (`raw_metrics`); `observe` turns them into the planner's Observation: each counter's rise over the window,
the window's histogram (the newest buckets less the oldest) merged over the replicas and read at the SLO's
percentile, the gauges as they are now.
"""

from __future__ import annotations

import math
from typing import Any

from flagscale.engines.base import EngineKind
from flagscale.planner.histogram import bucket_delta, merge, percentile
from flagscale.planner.types import Observation

HISTOGRAMS = ("ttft", "itl")
COUNTERS = ("prompt_tokens", "output_tokens", "finished")
START_S = "start_s"
ASLEEP = "asleep"


def replica_stats(
    kind: EngineKind,
    sums: dict[str, float],
    buckets: dict[str, dict[float, float]],
    start_s: float,
    asleep: bool = False,
) -> dict[str, float]:
    """One replica's figures for the planner, from its engine's /metrics (engine_metrics_and_buckets)."""
    stats = {START_S: start_s, ASLEEP: float(asleep)}
    for signal, name in kind.slo_samples.items():
        if signal in HISTOGRAMS:
            stats |= {f"{signal}_le:{bound}": count for bound, count in buckets.get(name, {}).items()}
        elif name in sums:
            stats[signal] = sums[name]
    return stats


def _ends(series: list[Any]) -> tuple[Any, Any] | None:
    """The oldest and newest point of one replica's series (Serve's TimeStampedValue: timestamp, value)."""
    if not series:
        return None
    ordered = sorted(series, key=lambda point: point.timestamp)
    return ordered[0], ordered[-1]


def _latency_ms(raw: dict[str, dict[Any, list[Any]]], signal: str, q: float) -> float | None:
    """The SLO's percentile of one latency histogram over the window, all replicas together (ms)."""
    per_replica: dict[Any, tuple[dict[float, float], dict[float, float]]] = {}
    for key, by_replica in raw.items():
        if not key.startswith(f"{signal}_le:"):
            continue
        bound = float(key.split(":", 1)[1])
        for replica, series in by_replica.items():
            ends = _ends(series)
            if ends:
                old, new = per_replica.setdefault(replica, ({}, {}))
                old[bound], new[bound] = ends[0].value, ends[1].value
    windows = [bucket_delta(new, old) for old, new in per_replica.values()]
    found = percentile(merge(windows), q) if windows else None
    return None if found is None or math.isnan(found) else found * 1000.0


def _rate(raw: dict[str, dict[Any, list[Any]]], signal: str) -> float:
    """A counter's rise per second over the window, summed over the replicas (a restart's drop: skipped)."""
    total = 0.0
    for series in raw.get(signal, {}).values():
        ends = _ends(series)
        if ends and ends[1].timestamp > ends[0].timestamp and ends[1].value >= ends[0].value:
            total += (ends[1].value - ends[0].value) / (ends[1].timestamp - ends[0].timestamp)
    return total


def _arrival_rate(raw: dict[str, dict[Any, list[Any]]], finished: float) -> float:
    """Requests that arrived per second over the window: those that finished, plus the rise of those in flight (a
    ramp shows in the queue at once, in the finished count only once its requests end)."""
    rise = 0.0
    for signal in ("running", "waiting"):
        for series in raw.get(signal, {}).values():
            ends = _ends(series)
            if ends and ends[1].timestamp > ends[0].timestamp:
                rise += (ends[1].value - ends[0].value) / (ends[1].timestamp - ends[0].timestamp)
    return max(0.0, finished + rise)


def _now(raw: dict[str, dict[Any, list[Any]]], signal: str) -> list[float]:
    return [ends[1].value for series in raw.get(signal, {}).values() if (ends := _ends(series))]


def observe(raw: dict[str, dict[Any, list[Any]]], time_s: float, replicas: int, held: int, q: float) -> Observation:
    """The pool over Serve's look-back window (`raw`: Serve's raw_metrics, metric -> replica -> series)."""
    kv = _now(raw, "kv_usage")
    finished = _rate(raw, "finished")
    in_flight = sum(_now(raw, "running")) + sum(_now(raw, "waiting"))
    busy = finished or (1.0 if in_flight or _rate(raw, "output_tokens") else 0.0)  # no counter: busy or not
    return Observation(
        time_s=time_s,
        replicas=replicas,
        asleep=min(replicas, round(sum(_now(raw, ASLEEP)))),
        ttft_ms=_latency_ms(raw, "ttft", q),
        itl_ms=_latency_ms(raw, "itl", q),
        queue=sum(_now(raw, "waiting")),
        running=sum(_now(raw, "running")),
        kv_usage=sum(kv) / len(kv) if kv else 0.0,
        prompt_tps=_rate(raw, "prompt_tokens"),
        output_tps=_rate(raw, "output_tokens"),
        arrival_rps=_arrival_rate(raw, finished) if "finished" in raw else busy,
        held=held,
    )


def measured_start_s(raw: dict[str, dict[Any, list[Any]]]) -> float | None:
    """The longest start-up the pool's replicas took (their servers to healthy), if any reported one."""
    found = _now(raw, START_S)
    return max(found) if found else None
