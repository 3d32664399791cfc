"""A latency percentile from a Prometheus histogram's cumulative bucket counts (`le` -> count), as the engines
publish TTFT and inter-token latency. Two scrapes' difference gives the window's histogram."""

from __future__ import annotations

import math


def bucket_delta(now: dict[float, float], before: dict[float, float]) -> dict[float, float]:
    """The counts that arrived between two scrapes of one replica's cumulative buckets (a restart: all of now)."""
    delta = {le: count - before.get(le, 0.0) for le, count in now.items()}
    return now if any(value < 0 for value in delta.values()) else delta


def merge(histograms: list[dict[float, float]]) -> dict[float, float]:
    """Several replicas' windows as one pool's."""
    total: dict[float, float] = {}
    for histogram in histograms:
        for le, count in histogram.items():
            total[le] = total.get(le, 0.0) + count
    return total


def percentile(buckets: dict[float, float], q: float) -> float | None:
    """The q-th percentile (0..100) of cumulative buckets, interpolated inside its bucket as Prometheus'
    histogram_quantile does; None when the window holds no observation. Past the last finite bound: that bound."""
    bounds = sorted(buckets)
    total = buckets[bounds[-1]] if bounds else 0.0
    if total <= 0:
        return None
    rank = total * q / 100.0
    lower_bound, lower_count = 0.0, 0.0
    for le in bounds:
        count = buckets[le]
        if count >= rank:
            if math.isinf(le):
                return lower_bound
            share = (rank - lower_count) / (count - lower_count) if count > lower_count else 1.0
            return lower_bound + (le - lower_bound) * share
        lower_bound, lower_count = le, count
    return lower_bound
