"""End to end: routing on the engines' own KV events (issue 53) on real vLLM CPU engines.

One deployment: the demo model, 2 replicas whose KV caches are capped (num_gpu_blocks_override: 12 blocks of 128
tokens each, so the workload's prefixes do not all fit and the engines evict), cache_aware routing with
kv_events auto (vLLM: on), one router process.

- hit prediction: requests one at a time (completions and chats sharing long prefixes, some to a LoRA adapter of
  the node); for each one, the prompt tokens the router predicted the chosen engine would find cached (its index
  of that engine's blocks, keyed as the engine keys them, the adapter included) equal the prefix-cache hits the
  engine itself counts (vllm:prefix_cache_hits). Both are read on the router's /metrics, which carries the
  engines' own series beside its own.
- a replica killed and replaced: its entries leave the router's index with it, the new replica's index starts
  empty and live, and requests whose prefixes were on the dead replica are predicted exactly again (none is
  routed on stale blocks: a prediction of blocks the new engine lacks would exceed its hits).
- the router process killed: Serve starts another, whose index is rebuilt from the engines' replay buffers (the
  same blocks and sequences as before) before it routes on it, and its predictions are exact.
"""

from __future__ import annotations

import json
import random
import signal
import time
import urllib.request

import openai
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from flagscale.demo_model import ensure_demo_lora
from tests.conftest import STATUS_WAIT_S, demo_engine_args, run_cli, status_cli, wait_for, write_config
from tests.kv_publishers import Sequences

PORT = 19431
CACHE_BLOCKS = 12  # per replica, of 128 tokens: ~4 of the workload's prompts
ADAPTER = "sql"  # a LoRA adapter of the node: its requests are keyed with it, as the engine keys their blocks
WORDS = "serve engine prefix cache block token router replica event index keys hash chat model".split()


def status_json(conf, while_replacing: bool = False) -> dict:
    result = status_cli(conf, "output=json")
    assert result.returncode in ((0, 1) if while_replacing else (0,)), result.output
    return json.loads(result.stdout[result.stdout.index("{") :])


def router_series() -> dict[tuple[str, str], float]:
    """(sample name, replica) -> value, of the router's /metrics (the engines' series and the router's own)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{PORT}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    values: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = (sample.name, sample.labels.get("replica", ""))
            values[key] = values.get(key, 0.0) + sample.value
    return values


def total(series: dict, name: str) -> float:
    return sum(value for (sample, _), value in series.items() if sample == name)


def router_caught_up(sequences: Sequences) -> dict | None:
    """The router's /metrics once the engines have published nothing for 0.5 s and the router applied all of it."""
    if time.monotonic() - sequences.changed_at < 0.5:
        return None
    series = router_series()
    applied = {replica: series.get(("flagscale_router_kv_last_sequence", replica)) for replica in sequences.last}
    return series if all(applied[r] == seq for r, seq in sequences.last.items()) else None


def workload(seed: int, prefixes: int = 12, per_prefix: int = 2) -> list[dict]:
    """Long shared prefixes (~300 tokens: 2 full blocks), each asked a few short questions, half as chats; every
    third prefix's last question to the LoRA adapter (its blocks hash with the adapter: none is a hit of the base
    model's same prefix)."""
    rng = random.Random(seed)
    heads = [f"manual {seed}.{p}: " + " ".join(rng.choice(WORDS) for _ in range(85)) for p in range(prefixes)]
    requests = []
    for p, head in enumerate(heads):
        for q in range(per_prefix):
            question = f"question {q}: " + " ".join(rng.choice(WORDS) for _ in range(3))
            model = ADAPTER if p % 3 == 0 and q == per_prefix - 1 else "demo"
            if p % 2:
                requests.append(
                    {
                        "model": model,
                        "messages": [{"role": "system", "content": head}, {"role": "user", "content": question}],
                    }
                )
            else:
                requests.append({"model": model, "prompt": f"{head}\n{question}"})
    rng.shuffle(requests)
    return requests


def send(client: openai.OpenAI, request: dict) -> None:
    if "messages" in request:
        client.chat.completions.create(
            model=request["model"], messages=request["messages"], max_tokens=1, temperature=0
        )
    else:
        client.completions.create(model=request["model"], prompt=request["prompt"], max_tokens=1, temperature=0)


def predicted_and_reported(client: openai.OpenAI, requests: list[dict], sequences: Sequences) -> list[tuple]:
    """Each request sent once the router's index holds everything the engines published before it: (predicted hit
    tokens, the engines' own hit tokens) for it."""
    pairs = []
    before = wait_for(lambda: router_caught_up(sequences), 30, "the router to apply every KV event published")
    for request in requests:
        send(client, request)
        after = wait_for(lambda: router_caught_up(sequences), 30, "the router to apply every KV event published")
        predicted = total(after, "flagscale_router_kv_predicted_hit_tokens_total") - total(
            before, "flagscale_router_kv_predicted_hit_tokens_total"
        )
        reported = total(after, "vllm:prefix_cache_hits_total") - total(before, "vllm:prefix_cache_hits_total")
        pairs.append((predicted, reported))
        before = after
    return pairs


def live_replicas(conf, without: str | None = None) -> list[dict] | None:
    """The two replicas once both are READY with a live index in the router, and `without` gone from status."""
    report = status_json(conf, while_replacing=True)
    if without in {r["replica_id"] for r in report["replicas"]}:
        return None
    replicas = [r for r in report["replicas"] if r["state"] == "READY"]
    live = [r for r in replicas if ((r.get("router") or {}).get("kv_index") or {}).get("live")]
    return live if len(live) == 2 else None


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    root = tmp_path_factory.mktemp("kv-events")
    node = {
        "serve_id": "demo",
        "engine": "vllm",
        "engine_args": demo_engine_args(served_model_name="demo", num_gpu_blocks_override=CACHE_BLOCKS),
        "lora": {"adapters": {ADAPTER: str(ensure_demo_lora(ADAPTER))}, "max_loras": 1},
        "resources": {"num_replicas": 2, "num_cpus": 1},
        "routing": "cache_aware",
        "routing_options": {"kv_events": True},
    }
    deploy = {"host": "127.0.0.1", "port": PORT, "startup_timeout_s": 600, "router_processes": 1}
    conf = write_config(root / "conf", [node], root / "exp", PORT, {"runner": {"hostfile": None, "deploy": deploy}})
    started = run_cli(conf, timeout=900)
    try:
        assert started.returncode == 0, started.output
        yield conf
    finally:
        stopped = run_cli(conf, "action=stop", timeout=300)
        assert stopped.returncode == 0, stopped.output


def test_predicted_hits_equal_the_engines_and_a_replaced_replica_starts_clean(deployment):
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{PORT}/v1", api_key="none", timeout=120, max_retries=0)
    replicas = wait_for(lambda: live_replicas(deployment), STATUS_WAIT_S, "both replicas' KV indexes live")
    assert all(r["kv_events"].startswith("tcp://") for r in replicas), replicas
    sequences = Sequences({r["replica_id"]: r["kv_events"] for r in replicas})
    try:
        time.sleep(1)  # the test's subscriptions joined (a PUB socket drops what no subscriber has joined for)
        pairs = predicted_and_reported(client, workload(seed=53), sequences)
        print("predicted vs reported hit tokens per request:", pairs)
        assert all(p == r for p, r in pairs), pairs
        assert sum(r for _, r in pairs) >= 8 * 128, pairs  # the workload reuses prefixes: the test can fail

        report = status_json(deployment)
        indexed = {r["replica_id"]: r["router"]["kv_index"] for r in report["replicas"]}
        assert all(0 < i["blocks"] <= CACHE_BLOCKS and i["last_seq"] >= 0 for i in indexed.values()), indexed
        victim = max(report["replicas"], key=lambda r: r["router"]["kv_index"]["blocks"])
    finally:
        sequences.close()

    # the replica holding the most blocks dies; Serve replaces it; its entries go, the new one starts empty
    psutil.Process(victim["engine_pid"]).children()[0].send_signal(signal.SIGKILL)
    replicas = wait_for(
        lambda: live_replicas(deployment, without=victim["replica_id"]), STATUS_WAIT_S, "a live replacement"
    )
    new = [r for r in replicas if r["replica_id"] not in indexed]
    assert len(new) == 1 and new[0]["router"]["kv_index"]["blocks"] == 0, replicas  # it starts empty
    sequences = Sequences({r["replica_id"]: r["kv_events"] for r in replicas})
    try:
        time.sleep(1)
        again = predicted_and_reported(client, workload(seed=53)[:12], sequences)
        print("after the replacement:", again)
        assert all(p == r for p, r in again), again
    finally:
        sequences.close()


def indexes_rebuilt(conf, killed_pid: int, before: dict[str, dict]) -> dict | None:
    """The replicas' indexes in a router process other than `killed_pid`, once each is live and holds what the
    killed one held (no request in between: the engines' caches did not change)."""
    result = status_cli(conf, "output=json")
    try:
        report = json.loads(result.stdout[result.stdout.index("{") :])
        pids = {p["pid"] for p in report["router"]["processes"].values()}
        now = {r["replica_id"]: r["router"]["kv_index"] for r in report["replicas"] if r["replica_id"] in before}
    except (ValueError, KeyError, TypeError):  # the router is not back yet
        return None
    if not pids or killed_pid in pids or len(now) != len(before):
        return None
    same = all(
        now[r]["live"] and (now[r]["blocks"], now[r]["last_seq"]) == (i["blocks"], i["last_seq"])
        for r, i in before.items()
    )
    return now if same else None


def test_a_restarted_router_rebuilds_its_index_by_replay(deployment):
    """The router process is killed; Serve starts another, whose index (empty at its start) is rebuilt from the
    engines' replay buffers before it routes on it, and its predictions are exact again."""
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{PORT}/v1", api_key="none", timeout=120, max_retries=0)
    replicas = wait_for(lambda: live_replicas(deployment), STATUS_WAIT_S, "both replicas' KV indexes live")
    before = {r["replica_id"]: r["router"]["kv_index"] for r in replicas}
    assert any(i["blocks"] for i in before.values()), before  # the earlier test left blocks cached
    (process,) = status_json(deployment)["router"]["processes"].values()
    psutil.Process(process["pid"]).send_signal(signal.SIGKILL)
    rebuilt = wait_for(
        lambda: indexes_rebuilt(deployment, process["pid"], before), STATUS_WAIT_S, "a new router's index rebuilt"
    )
    assert all(i["replays"] >= 1 for i in rebuilt.values()), rebuilt
    sequences = Sequences({r["replica_id"]: r["kv_events"] for r in replicas})
    try:
        time.sleep(1)
        again = predicted_and_reported(client, workload(seed=53)[12:], sequences)
        print("after the router's restart:", again)
        assert all(p == r for p, r in again), again
        assert sum(r for _, r in again) > 0, again  # prefixes cached before the restart were found
    finally:
        sequences.close()
