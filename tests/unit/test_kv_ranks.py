"""A replica of several data-parallel vLLM engines, routed on their KV events (flagscale/router/kv_ranks.py): a
stream and an index per rank, the replica routed to as a whole, the request pinned to the rank with the most
reusable blocks (against load) by the X-data-parallel-rank header, and the approximate table unchanged."""

from __future__ import annotations

import asyncio
import time

import aiohttp

from flagscale.config.routing import RoutingSpec
from flagscale.router.kv_events import KVEvents
from flagscale.router.kv_index import GPU
from flagscale.router.kv_keys import PromptTokens
from flagscale.router.kv_ranks import RANK_HEADER, RankLoad, parts, pick_rank, with_headers
from flagscale.router.policies import RequestInfo, make_policy
from tests.conftest import bare_router, router_listening
from tests.unit.fakes import FakeEngine, upstream

PROMPT = "A long shared system prompt about the weather in many places. " * 20


def dp_info(demo_model_path, name: str, ranks: int) -> dict:
    base = 31000 + 10 * len(name)
    return {
        "endpoint": f"tcp://127.0.0.1:{base}",
        "replay_endpoint": f"tcp://127.0.0.1:{base + 5}",
        "tokenizer": str(demo_model_path),
        "ranks": [
            {"endpoint": f"tcp://127.0.0.1:{base + r}", "replay_endpoint": f"tcp://127.0.0.1:{base + 5 + r}"}
            for r in range(ranks)
        ],
    }


def followed(demo_model_path, ranks: dict[str, int], policy=None):
    """A cache_aware policy and a KVEvents over replicas named by `ranks` (name -> DP ranks), their streams synced
    (no loop: no subscriptions), each index live with the engines' block size."""
    policy = policy or make_policy(RoutingSpec.of("cache_aware"))
    ups = [upstream(name, 0, sent=i) for i, name in enumerate(ranks)]
    hub = KVEvents()
    for up in ups:
        up.record.kv_events = dp_info(demo_model_path, up.replica_id, ranks[up.replica_id])
    hub.sync({"m": [u.record for u in ups]}, {"m": policy})
    for index in hub.index.replicas.values():
        index.synced, index.block_size = True, 16
    return policy, hub, ups


def keys_of(hub: KVEvents, demo_model_path, body: dict) -> list[int]:
    tokens, _ = PromptTokens(str(demo_model_path)).of(body, 65536)
    return hub.model_keys["m"].hasher.keys(tokens, 16)


def test_pick_rank_takes_the_deepest_rank_within_the_load_bound():
    idle = [RankLoad(), RankLoad(), RankLoad()]
    assert pick_rank([2, 8, 8], idle, 16, 160, 4, 0.3) == 1  # deepest; equally deep: the first, both idle
    busy_first = [RankLoad(), RankLoad(inflight=2), RankLoad()]
    assert pick_rank([2, 8, 8], busy_first, 16, 160, 4, 0.3) == 2  # equally deep: the less busy one
    saturated = [RankLoad(), RankLoad(inflight=5), RankLoad(inflight=1)]
    assert pick_rank([2, 8, 1], saturated, 16, 160, 4, 0.3) == 0  # the warm rank saturated: the least busy
    sent_more = [RankLoad(sent=3), RankLoad(sent=1), RankLoad(sent=2)]
    assert pick_rank([0, 0, 0], sent_more, 16, 160, 4, 0.3) == 1  # nothing cached: least busy, fewest sent
    assert pick_rank([0, 2, 0], sent_more, 16, 160, 4, 0.3) == 1  # 32 of 160 tokens, under 0.3: by load


def test_a_records_ranks_are_followed_apart_and_a_single_engine_as_before():
    info = {"endpoint": "tcp://h:1", "ranks": [{"endpoint": "tcp://h:1"}, {"endpoint": "tcp://h:2"}]}
    assert [(i, e["endpoint"]) for i, e in parts("r1", info)] == [("r1/dp0", "tcp://h:1"), ("r1/dp1", "tcp://h:2")]
    assert parts("r1", {"endpoint": "tcp://h:1"}) == [("r1", {"endpoint": "tcp://h:1"})]  # a record of old
    assert with_headers({"x-data-parallel-rank": "0", "a": "b"}, {RANK_HEADER: "1"}) == {"a": "b", RANK_HEADER: "1"}


def test_one_dp_replica_gets_each_request_on_the_rank_holding_its_prefix(demo_model_path):
    policy, hub, (r1,) = followed(demo_model_path, {"r1": 2})
    assert sorted(hub.index.replicas) == ["r1/dp0", "r1/dp1"] and hub.parts == {"r1": ["r1/dp0", "r1/dp1"]}
    body = {"model": "m", "prompt": PROMPT, "max_tokens": 1}
    keys = keys_of(hub, demo_model_path, body)
    hub.index.replicas["r1/dp1"].media[GPU] = dict.fromkeys(keys)  # rank 1's engine holds the prompt
    request = RequestInfo("m", body)
    assert policy.select([r1], request, time.monotonic()) == [r1]  # one replica: matched still
    assert request.memo["kv_rank_depths"] == {"r1": [0, len(keys)]} and request.memo["kv_depths"] == {"r1": len(keys)}
    policy.before_request(r1, request)
    assert request.upstream_headers == {RANK_HEADER: "1"} and hub.rank_loads["r1/dp1"].inflight == 1
    policy.after_request(r1, request, True)
    assert hub.rank_loads["r1/dp1"].inflight == 0 and hub.rank_loads["r1/dp1"].sent == 1

    hub.rank_loads["r1/dp1"].inflight = policy.settings.balance_abs_threshold + 1  # saturated: the other rank
    again = RequestInfo("m", body)
    policy.select([r1], again, time.monotonic())
    policy.before_request(r1, again)
    assert again.upstream_headers == {RANK_HEADER: "0"}

    untokenizable = RequestInfo("m", {**body, "suffix": "x"})  # the approximate table: vLLM picks the rank
    policy.select([r1], untokenizable, time.monotonic())
    policy.before_request(r1, untokenizable)
    assert untokenizable.upstream_headers == {} and "kv_rank" not in untokenizable.memo


def test_the_replica_with_the_deepest_rank_goes_first_and_its_ranks_sum_up_in_status(demo_model_path):
    policy, hub, (r1, r2) = followed(demo_model_path, {"r1": 2, "r2": 1})
    body = {"model": "m", "prompt": PROMPT, "max_tokens": 1}
    keys = keys_of(hub, demo_model_path, body)
    hub.index.replicas["r1/dp0"].media[GPU] = dict.fromkeys(keys[:2])
    hub.index.replicas["r1/dp1"].media[GPU] = dict.fromkeys(keys)
    hub.index.replicas["r2"].media[GPU] = dict.fromkeys(keys[: len(keys) - 1])
    request = RequestInfo("m", body)
    assert policy.select([r2, r1], request, time.monotonic())[0] is r1
    policy.before_request(r1, request)
    assert request.upstream_headers == {RANK_HEADER: "1"}
    other = RequestInfo("m", body)
    policy.select([r2, r1], other, time.monotonic())
    policy.before_request(r2, other)  # a replica of one engine: no header
    assert other.upstream_headers == {}
    stats = policy.stats("r1")["kv_index"]
    assert stats["blocks"] == 2 + len(keys) and stats["last_seq"] == [-1, -1] and len(stats["ranks"]) == 2
    assert stats["live"] and stats["state"] == "live"
    hub.index.replicas["r1/dp0"].synced = False
    assert policy.stats("r1")["kv_index"]["state"] == "syncing"
    assert policy.stats("r2")["kv_index"]["blocks"] == len(keys) - 1


def test_the_engine_gets_the_rank_header_through_the_router(demo_model_path):
    engine = FakeEngine("r1")
    body = {"model": "m", "prompt": PROMPT, "max_tokens": 2}

    async def run():
        up = upstream("r1", 0, sent=0)
        up.record.url = await engine.start()
        router = bare_router([up], "cache_aware")
        policy = router.replicas.policies["m"] = make_policy(RoutingSpec.of("cache_aware"))
        up.record.kv_events = dp_info(demo_model_path, "r1", 2)
        hub = router.replicas.kv_events
        await asyncio.get_running_loop().run_in_executor(None, hub.sync, {"m": [up.record]}, {"m": policy})
        for index in hub.index.replicas.values():
            index.synced, index.block_size = True, 16
        hub.index.replicas["r1/dp1"].media[GPU] = dict.fromkeys(keys_of(hub, demo_model_path, body))
        try:
            async with router_listening(router) as url, aiohttp.ClientSession() as client:
                for sent in ({RANK_HEADER: "0"}, {}):  # a client's own rank header: the router's replaces it
                    async with client.post(f"{url}/v1/completions", json=body, headers=sent) as resp:
                        assert resp.status == 200, await resp.text()
                async with client.post(f"{url}/v1/completions", json={**body, "suffix": "x"}) as resp:
                    assert resp.status == 200  # by the table: no rank pinned
        finally:
            await engine.runner.cleanup()
        return hub

    hub = asyncio.run(run())
    ranks = [{k.lower(): v for k, v in h.items()}.get(RANK_HEADER.lower()) for h in engine.headers]
    assert ranks == ["1", "1", None]
    assert all(load.inflight == 0 for load in hub.rank_loads.values())
