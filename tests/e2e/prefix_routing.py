"""The prefix-cache workload of the routing test (tests/e2e/test_failover.py, issue 11): long shared prefixes, a
few short questions on each, one request at a time; the hit rate is what the engines' own /metrics count."""

from __future__ import annotations

import random
from collections.abc import Callable

import httpx
import openai

from flagscale.engines.metrics import engine_metrics
from tests.conftest import STATUS_WAIT_S, wait_for

PREFIXES, PER_PREFIX = 16, 3
WORDS = (
    "the quick brown fox jumps over a lazy dog while serving engineers measure tokens per second ray "
    "serve routes requests to vllm engines on many hosts and chips prefill decode cache hello world"
).split()


def workload(seed: int) -> list[str]:
    rng = random.Random(seed)
    prefixes = [f"document {seed}.{p}: " + " ".join(rng.choice(WORDS) for _ in range(300)) for p in range(PREFIXES)]
    prompts = [
        f"{prefix}\nquestion {q}: " + " ".join(rng.choice(WORDS) for _ in range(12))
        for prefix in prefixes
        for q in range(PER_PREFIX)
    ]
    rng.shuffle(prompts)
    return prompts


def prefix_cache_counters(urls: list[str]) -> tuple[float, float]:
    """Prefix-cache hits and queries (tokens), summed over the replicas' own /metrics."""
    sums = [engine_metrics(url) for url in urls]
    return (
        sum(m.get("vllm:prefix_cache_hits_total", 0.0) for m in sums),
        sum(m.get("vllm:prefix_cache_queries_total", 0.0) for m in sums),
    )


def measure(status: Callable[[], dict], port: int, routing: str, seed: int, processes: int = 1) -> dict:
    """One pass of the workload (its own prefixes, by `seed`) once the router routes with `routing`, in
    `processes` router processes (more than one: each request on a new connection). `status`: the deployment's
    `status` as JSON."""

    def both_replicas_routed() -> list[dict] | None:  # the routers know both replicas, with this policy
        report = status()
        replicas = [r for r in report["replicas"] if r["requests_served"] is not None]
        ready = len(replicas) == 2 and {r["router"]["routing"] for r in replicas} == {routing}
        return replicas if ready and len(report["router"]["processes"]) == processes else None

    replicas = wait_for(
        both_replicas_routed, STATUS_WAIT_S, f"{processes} router(s) to route to both replicas with {routing}"
    )
    served0 = {r["replica_id"]: r["requests_served"] for r in replicas}
    by_process0 = status()["router"]["processes"]
    urls = [r["url"] for r in replicas]
    http = httpx.Client(limits=httpx.Limits(max_keepalive_connections=0)) if processes > 1 else None
    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=120, max_retries=0, http_client=http
    )
    hits0, queries0 = prefix_cache_counters(urls)
    prompt_tokens = []
    for prompt in workload(seed):
        completion = client.completions.create(model="demo", prompt=prompt, max_tokens=2, temperature=0)
        prompt_tokens.append(completion.usage.prompt_tokens)
    hits1, queries1 = prefix_cache_counters(urls)

    def served_by_process(report: dict) -> dict[str, int]:
        by_process = report["router"]["processes"]
        return {p: r["served"] - by_process0.get(p, {}).get("served", 0) for p, r in by_process.items()}

    def all_counted() -> dict | None:
        # the process that answers counts its own requests live, the others' as of their last report (published
        # every refresh_s, 2 s): the workload can take less than that
        report = status()
        return report if sum(served_by_process(report).values()) >= len(prompt_tokens) else None

    report = wait_for(
        all_counted, STATUS_WAIT_S, f"the router processes' reports to count the {len(prompt_tokens)} requests"
    )
    after = {r["replica_id"]: r for r in report["replicas"]}
    return {
        "processes": served_by_process(report),
        "routing": routing,
        "hit_rate": (hits1 - hits0) / (queries1 - queries0),
        "hits": hits1 - hits0,
        "queries": queries1 - queries0,
        "prompt_tokens": [min(prompt_tokens), max(prompt_tokens)],
        "served": sorted(r["requests_served"] - served0.get(i, 0) for i, r in after.items()),
        "router": [r["router"] for r in after.values()],
    }
