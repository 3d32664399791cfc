"""An engine server's own /metrics, read as the engine kinds read them (EngineKind.load, status_load): each sample
name summed over its label sets. Used by the replicas (autoscaling, drain), `status` and the tests."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families


def engine_metrics(url: str, timeout_s: float = 10.0, api_key: str | None = None) -> dict[str, float]:
    """One engine's own /metrics: each sample name (`vllm:num_requests_running`, `vllm:prefix_cache_hits_total`,
    `..._count`) -> its value summed over every label set. Raises OSError when the engine does not answer.
    `api_key`: the deployment's, which an engine requires on /metrics too (engines/vllm_auth.py)."""
    return engine_metrics_and_buckets(url, timeout_s, api_key)[0]


def engine_metrics_and_buckets(
    url: str, timeout_s: float = 10.0, api_key: str | None = None
) -> tuple[dict[str, float], dict[str, dict[float, float]]]:
    """engine_metrics' sums, and each histogram's cumulative buckets: family name -> {upper bound (`le`) -> count
    summed over the other labels} (the SLO planner's latency percentiles, flagscale/planner/histogram.py)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with urllib.request.urlopen(urllib.request.Request(url + "/metrics", headers=headers), timeout=timeout_s) as resp:
        text = resp.read().decode()
    sums: dict[str, float] = {}
    buckets: dict[str, dict[float, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
            if family.type == "histogram" and sample.name.endswith("_bucket") and "le" in sample.labels:
                counts = buckets.setdefault(family.name, {})
                bound = float(sample.labels["le"])
                counts[bound] = counts.get(bound, 0.0) + sample.value
    return sums, buckets


def by_replica(text: str, name: str, **labels: str) -> dict[str, float]:
    """The samples `name` of a router's /metrics `text` (where each engine's series carry a `replica` label) whose
    labels include `labels`: replica id -> value, summed over its other label sets."""
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            replica = sample.labels.get("replica")
            if sample.name == name and replica and labels.items() <= sample.labels.items():
                found[replica] = found.get(replica, 0.0) + sample.value
    return found
