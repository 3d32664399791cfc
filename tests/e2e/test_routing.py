"""End to end: cache-aware routing raises the engines' own prefix-cache hit rate (issue 11's workload).

Real Ray, real vLLM (CPU) engines on the demo model, 2 replicas of one model behind the router. The workload:
16 long prompt prefixes (several hundred tokens) x 3 requests each (the prefix plus a short distinct question),
shuffled, one request at a time. The hit rate is the engines' `vllm:prefix_cache_hits_total /
vllm:prefix_cache_queries_total`, summed over both replicas' /metrics, counted over the workload only. Sending
everything to one replica would give about 0.55 here; cache_aware must reach 0.45. least_load is measured in
the same test for comparison, on the same engines after `run` switched the node's routing in place, with new
prefixes; both numbers are printed and written to $ROUTING_E2E_REPORT when set.

Then the same update scales the router to 2 processes (deploy.router_processes) and switches back to cache_aware:
every request on a new connection, so the kernel spreads them over both processes (both must take some), and the
hit rate must stay what one router reached (the processes share routing hints).
"""

from __future__ import annotations

import json
import os
import random

import httpx
import openai

from flagscale.engines.metrics import engine_metrics
from tests.conftest import demo_engine_args, run_cli, wait_for, write_config

PORT = 19111
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


def status_json(conf) -> dict:
    result = run_cli(conf, "action=status", "output=json", timeout=120)
    assert result.returncode == 0, result.output
    return json.loads(result.stdout[result.stdout.index("{") :])


def runner(router_processes: int) -> dict:
    deploy = {"host": "127.0.0.1", "port": PORT, "startup_timeout_s": 600, "router_processes": router_processes}
    return {"runner": {"hostfile": None, "deploy": deploy}}


def node(routing: str) -> dict:
    return {
        "serve_id": "demo",
        "engine": "vllm",
        "engine_args": demo_engine_args(served_model_name="demo"),
        "resources": {"num_replicas": 2, "num_cpus": 1},
        "routing": routing,
    }


def router_processes(conf) -> dict[str, dict]:
    return status_json(conf)["router"]["processes"]


def measure(conf, routing: str, seed: int, processes: int = 1) -> dict:
    """One pass of the workload (its own prefixes, by `seed`) once the router routes with `routing`, in
    `processes` router processes (more than one: each request on a new connection)."""

    def both_replicas_routed() -> list[dict] | None:  # the routers know both replicas, with this policy
        report = status_json(conf)
        replicas = [r for r in report["replicas"] if r["requests_served"] is not None]
        ready = len(replicas) == 2 and {r["router"]["routing"] for r in replicas} == {routing}
        return replicas if ready and len(report["router"]["processes"]) == processes else None

    replicas = wait_for(both_replicas_routed, 180, f"{processes} router(s) to route to both replicas with {routing}")
    served0 = {r["replica_id"]: r["requests_served"] for r in replicas}
    by_process0 = router_processes(conf)
    urls = [r["url"] for r in replicas]
    http = httpx.Client(limits=httpx.Limits(max_keepalive_connections=0)) if processes > 1 else None
    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{PORT}/v1", api_key="none", timeout=120, max_retries=0, http_client=http
    )
    hits0, queries0 = prefix_cache_counters(urls)
    prompt_tokens = []
    for prompt in workload(seed):
        completion = client.completions.create(model="demo", prompt=prompt, max_tokens=2, temperature=0)
        prompt_tokens.append(completion.usage.prompt_tokens)
    hits1, queries1 = prefix_cache_counters(urls)
    after = {r["replica_id"]: r for r in status_json(conf)["replicas"]}
    by_process = router_processes(conf)
    return {
        "processes": {p: r["served"] - by_process0.get(p, {}).get("served", 0) for p, r in by_process.items()},
        "routing": routing,
        "hit_rate": (hits1 - hits0) / (queries1 - queries0),
        "hits": hits1 - hits0,
        "queries": queries1 - queries0,
        "prompt_tokens": [min(prompt_tokens), max(prompt_tokens)],
        "served": sorted(r["requests_served"] - served0.get(i, 0) for i, r in after.items()),
        "router": [r["router"] for r in after.values()],
    }


def test_cache_aware_routing_raises_the_prefix_cache_hit_rate(tmp_path):
    conf = write_config(tmp_path / "conf", [node("cache_aware")], tmp_path / "exp", PORT)
    started = run_cli(conf, timeout=900)
    try:
        assert started.returncode == 0, started.output
        cache_aware = measure(conf, "cache_aware", seed=11)
        # The same engines, the router switched in place (no engine restarts); new prefixes, so that what the
        # first pass left in the engines' caches does not count.
        conf = write_config(tmp_path / "conf", [node("least_load")], tmp_path / "exp", PORT)
        switched = run_cli(conf, timeout=300)
        assert switched.returncode == 0, switched.output
        least_load = measure(conf, "least_load", seed=12)
        # The router scaled to two processes in place, back to cache_aware (the engines stay)
        conf = write_config(tmp_path / "conf", [node("cache_aware")], tmp_path / "exp", PORT, runner(2))
        scaled = run_cli(conf, timeout=300)
        assert scaled.returncode == 0, scaled.output
        two_routers = measure(conf, "cache_aware", seed=13, processes=2)
    finally:
        stopped = run_cli(conf, "action=stop", timeout=300)
        assert stopped.returncode == 0, stopped.output
    report = {"cache_aware": cache_aware, "least_load": least_load, "cache_aware_2_routers": two_routers}
    print(json.dumps(report, indent=1))
    if os.environ.get("ROUTING_E2E_REPORT"):
        with open(os.environ["ROUTING_E2E_REPORT"], "w") as f:
            json.dump(report, f, indent=1)
    low, high = cache_aware["prompt_tokens"]
    assert 250 <= low and high < 500, cache_aware["prompt_tokens"]  # long prompts, under max_model_len 512
    assert cache_aware["queries"] >= PREFIXES * PER_PREFIX * low  # every request's prompt was looked up
    assert cache_aware["hit_rate"] >= 0.45, report
    assert cache_aware["hit_rate"] > least_load["hit_rate"] + 0.1, report
    assert min(cache_aware["served"]) > 0  # new prefixes still went to both replicas
    assert all(r["prefix_blocks"] > 0 and r["circuit"] == "closed" for r in cache_aware["router"]), cache_aware
    # two router processes: both took requests, and together they lost no hit rate
    assert len(two_routers["processes"]) == 2 and min(two_routers["processes"].values()) > 0, two_routers
    assert two_routers["hit_rate"] >= cache_aware["hit_rate"] - 0.03, report
