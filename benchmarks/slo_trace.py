"""benchmarks/slo_load.py's pure parts (issue 51): the step trace, its split over benchmark workers, the choice of
one replica's sustainable rate from a calibration ladder, the least replica-seconds the trace allows, and the
issue's targets as ratios between systems. No engine, no network: tests/unit/test_slo_trace.py."""

from __future__ import annotations

import math
from typing import Any

# (label, seconds, rate at its start, rate at its end) in multiples of one replica's sustainable rate; a ramp goes in
# steps of STEP_S (both scaled by --time-scale)
TRACE = (
    ("idle", 20, 0.0, 0.0),
    ("ramp", 90, 0.3, 2.0),
    ("plateau", 60, 1.6, 1.6),
    ("spike", 20, 3.0, 3.0),
    ("fall", 60, 0.5, 0.5),
    ("idle", 40, 0.0, 0.0),
)
STEP_S = 15


def steps(rate: float, time_scale: float = 1.0) -> list[dict[str, Any]]:
    """The trace as steps: {segment, start_s, seconds, rps}; idle segments have rps 0 (nothing is sent). The same
    steps at any `time_scale`, each `time_scale` times as long."""
    out, t = [], 0.0
    for label, seconds, first, last in TRACE:
        count = max(1, round(seconds / STEP_S)) if first != last else 1
        length = seconds * time_scale / count
        for i in range(count):
            share = first + (last - first) * (i + 0.5) / count if count > 1 else first
            out.append({"segment": label, "start_s": t, "seconds": length, "rps": share * rate})
            t += length
    return out


def parts(step: dict[str, Any], worker_rps: float | None) -> list[dict[str, Any]]:
    """A step's arrivals split over as few benchmark workers as keep each at or under `worker_rps` (None: one):
    k independent Poisson streams at rps / k are one Poisson stream at rps. Each part: {part, rps, prompts}."""
    if step["rps"] <= 0:
        return []
    k = 1 if not worker_rps else max(1, math.ceil(step["rps"] / worker_rps - 1e-9))
    rps = step["rps"] / k
    return [{"part": i, "rps": rps, "prompts": max(1, round(rps * step["seconds"]))} for i in range(k)]


def workers_needed(plan: list[dict[str, Any]], worker_rps: float | None) -> int:
    """The benchmark workers the trace keeps busy at once: a step's parts while the previous step's still wait for
    their last answers. A pass waits for a free worker, so with fewer the trace's peaks arrive late, all at once."""
    counts = [len(parts(step, worker_rps)) for step in plan]
    return max((a + b for a, b in zip([0, *counts], counts, strict=False)), default=0)


def split_streams(concurrency: int, per_worker: int) -> list[int]:
    """`concurrency` closed-loop streams over as few workers as keep each at or under `per_worker` streams."""
    k = max(1, math.ceil(concurrency / per_worker))
    return [concurrency // k + (1 if i < concurrency % k else 0) for i in range(k)]


def met(request: dict[str, Any], ttft_ms: float, itl_ms: float) -> bool:
    """A request meets the SLO: no error, TTFT and mean inter-token latency within bounds."""
    itls = request["itl_s"]
    itl = sum(itls) / len(itls) if itls else 0.0
    return not request["error"] and request["ttft_s"] * 1000 <= ttft_ms and itl * 1000 <= itl_ms


def attainment_by_segment(requests: list[dict[str, Any]], ttft_ms: float, itl_ms: float) -> dict[str, float]:
    """The share of each trace segment's requests (their `segment` label: ramp, spike, ...) that met the SLO, in
    the order the segments first appear: where a system lost its attainment."""
    counts: dict[str, list[int]] = {}
    for request in requests:
        good_total = counts.setdefault(request["segment"], [0, 0])
        good_total[0] += met(request, ttft_ms, itl_ms)
        good_total[1] += 1
    return {segment: round(good / total, 4) for segment, (good, total) in counts.items()}


def replica_s_by_segment(counts: list[tuple[Any, ...]], plan: list[dict[str, Any]]) -> dict[str, float]:
    """Replica-seconds awake in each trace segment, from the replica counts over time ((seconds into the trace,
    awake, ...), each count holding until the next) and the plan's steps (segment, start_s, seconds): where a
    system spent its replicas."""
    found: dict[str, float] = {}
    for (t0, awake, *_), (t1, *_) in zip(counts, counts[1:], strict=False):
        for step in plan:
            overlap = min(t1, step["start_s"] + step["seconds"]) - max(t0, step["start_s"])
            if overlap > 0:
                found[step["segment"]] = found.get(step["segment"], 0.0) + awake * overlap
    return {segment: round(value, 1) for segment, value in found.items()}


def ladder_pass(concurrency: int, requests: list[dict[str, Any]], ttft_ms: float, itl_ms: float) -> dict[str, Any]:
    """One closed-loop calibration pass at `concurrency` streams from its steady requests (the first wave left out
    by the caller): SLO attainment, and the request rate and output tokens/s by Little's law (streams / latency)."""
    if not requests:
        return {"concurrency": concurrency, "requests": 0, "attainment": 0.0, "rate": 0.0, "output_tps": 0.0}
    latency = sum(r["ttft_s"] + sum(r["itl_s"]) for r in requests) / len(requests)
    tokens = sum(len(r["itl_s"]) + 1 for r in requests) / len(requests)
    rate = concurrency / latency if latency > 0 else 0.0
    good = sum(1 for r in requests if met(r, ttft_ms, itl_ms))
    return {
        "concurrency": concurrency,
        "requests": len(requests),
        "attainment": good / len(requests),
        "rate": rate,
        "output_tps": rate * tokens,
        "latency_s": latency,
    }


def per_replica(p: dict[str, Any], replicas: int) -> dict[str, Any]:
    """A pass over `replicas` balanced replicas as one replica's share: streams, request rate and tokens/s divided."""
    share = {k: p[k] / replicas for k in ("rate", "output_tps")}
    return {**p, **share, "concurrency": p["concurrency"] / replicas, "replicas": replicas}


def sustainable(passes: list[dict[str, Any]], share: float) -> dict[str, Any] | None:
    """The pass of the most streams before the first whose attainment falls under `share` (the ladder in
    order of streams): one replica's sustainable point. None when even the first pass misses."""
    best = None
    for p in passes:
        if p["attainment"] < share:
            break
        best = p
    return best


def least_replica_s(plan: list[dict[str, Any]], rate: float, low: int, high: int) -> float:
    """The fewest replica-seconds any min..max system could spend on the trace: replicas that start at once, one per
    `rate` of load (at least `low`, at most `high`)."""
    total = 0.0
    for step in plan:
        need = math.ceil(step["rps"] / rate - 1e-9) if rate > 0 else low
        total += min(high, max(low, need)) * step["seconds"]
    return total


def calibration_order(systems: list[str], calibrating: bool) -> list[str]:
    """The systems in the order they run: the calibration's deployment first (static_min's one replica, else static
    max's replicas, else one replica of its own, `calibrate`, that takes no trace)."""
    if not calibrating:
        return list(systems)
    for first in ("static_min", "static_max"):
        if first in systems:
            return [first, *(s for s in systems if s != first)]
    return ["calibrate", *systems]


def target_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The issue's targets as ratios, for each planner system present (slo, slo_sleep): its goodput per
    replica-second against request counting's at equal or better attainment (>= 1.37x); its attainment within 5
    points of static max's at <= 60 % of static max's replica-seconds; no failed request anywhere."""
    by = {r["system"]: r for r in rows}
    lines = []
    for name in ("slo", "slo_sleep"):
        if name in by:
            lines += _planner_targets(name, by[name], by)
    failed = {r["system"]: r["failed"] for r in rows}
    lines.append(f"- failed requests: {failed} (target 0)")
    return lines


def _planner_targets(name: str, slo: dict[str, Any], by: dict[str, dict[str, Any]]) -> list[str]:
    lines = []
    if "request_count" in by:
        rc = by["request_count"]
        ratio = slo["goodput_per_replica_s"] / rc["goodput_per_replica_s"] if rc["goodput_per_replica_s"] else math.inf
        points = 100 * (slo["attainment"] - rc["attainment"])
        ok = ratio >= 1.37 and points >= 0
        lines.append(
            f"- {name} vs request_count: goodput per replica-s {ratio:.2f}x (target >= 1.37x), attainment "
            f"{points:+.1f} points (target >= 0): {'met' if ok else 'not met'}"
        )
    if "static_max" in by:
        sm = by["static_max"]
        points = 100 * (slo["attainment"] - sm["attainment"])
        share = slo["replica_s"] / sm["replica_s"] if sm["replica_s"] else math.inf
        ok = points >= -5 and share <= 0.6
        lines.append(
            f"- {name} vs static_max: attainment {points:+.1f} points (target >= -5), replica-s {100 * share:.0f} % "
            f"of static max's (target <= 60 %): {'met' if ok else 'not met'}"
        )
    return lines
