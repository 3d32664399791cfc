"""Following the engines' KV events (flagscale/router/kv_events.py) against a fake publisher that speaks vLLM's
protocol on real loopback sockets (PUB: topic, sequence, msgpack batch; ROUTER replays from a sequence, then -1),
and cache_aware routing on the index they feed."""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest
import zmq
import zmq.asyncio

from flagscale.config.routing import RoutingSpec
from flagscale.net import free_port
from flagscale.router import token_prefixes
from flagscale.router.kv_events import KVEvents
from flagscale.router.kv_index import GPU
from flagscale.router.kv_keys import PromptTokens
from flagscale.router.policies import RequestInfo, cache_aware, make_policy
from flagscale.router.policies.adapters import AdapterAware, Placement
from tests.unit.fakes import upstream


def synced_hub(tokenizer, **settings):
    """cache_aware over replicas r1 and r2 that publish (no sockets: no loop), their indexes synced, blocks of 16."""
    policy, (r1, r2) = cache_aware_over("r1", "r2", **settings)
    hub = KVEvents()
    for up in (r1, r2):
        up.record.kv_events = {"endpoint": f"tcp://127.0.0.1:1/{up.replica_id}", "tokenizer": str(tokenizer)}
    hub.sync({"m": [r1.record, r2.record]}, {"m": policy})
    for up in (r1, r2):
        index = hub.index.replicas[up.replica_id]
        index.synced, index.block_size = True, 16
    return policy, hub, (r1, r2)


class FakePublisher:
    """The engine side: every batch published is buffered for replays; `drop` leaves one off the stream."""

    def __init__(self, topic: str = "kv@r1"):
        self.topic = topic.encode()
        self.pub_port, self.replay_port = free_port(), free_port()
        ctx = zmq.asyncio.Context.instance()
        self.pub = ctx.socket(zmq.PUB)
        self.pub.bind(f"tcp://127.0.0.1:{self.pub_port}")
        self.replay = ctx.socket(zmq.ROUTER)
        self.replay.bind(f"tcp://127.0.0.1:{self.replay_port}")
        self.buffer: list[tuple[int, bytes]] = []
        self.task = asyncio.get_running_loop().create_task(self._serve_replays())

    @property
    def info(self) -> dict:
        return {
            "endpoint": f"tcp://127.0.0.1:{self.pub_port}",
            "replay_endpoint": f"tcp://127.0.0.1:{self.replay_port}",
            "topic": self.topic.decode(),
        }

    async def publish(self, *hashes_per_event: list[int], drop: bool = False) -> None:
        seq = len(self.buffer)
        events = [
            {"type": "BlockStored", "block_hashes": h, "block_size": 4, "medium": "GPU"} for h in hashes_per_event
        ]
        payload = msgspec.msgpack.encode([time.time(), events])
        self.buffer.append((seq, payload))
        if not drop:
            await self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])

    async def _serve_replays(self) -> None:
        while True:
            client, _, start = await self.replay.recv_multipart()
            for seq, payload in self.buffer:
                if seq >= int.from_bytes(start, "big"):
                    await self.replay.send_multipart([client, b"", self.topic, seq.to_bytes(8, "big"), payload])
            await self.replay.send_multipart([client, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])

    def close(self) -> None:
        self.task.cancel()
        self.pub.close(0)
        self.replay.close(0)


async def wait_until(predicate, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"not within {timeout_s}s: {what}"
        await asyncio.sleep(0.05)


def cache_aware_over(*names: str, **settings):
    policy = make_policy(RoutingSpec.of("cache_aware", **settings))
    return policy, [upstream(name, 0, sent=i) for i, name in enumerate(names)]


def test_a_subscription_replays_what_came_before_then_follows_and_fills_gaps():
    async def run():
        publisher = FakePublisher()
        try:
            await publisher.publish([1, 2])  # before the router follows: only a replay has it
            policy, ups = cache_aware_over("r1")
            ups[0].record.kv_events = publisher.info
            hub = KVEvents()
            hub.sync({"m": [ups[0].record]}, {"m": policy})
            assert policy.exact is hub
            index = hub.index.replicas["r1"]
            await wait_until(lambda: index.synced and index.depth([1, 2]) == (2, 2), "the replay applied")
            await asyncio.sleep(0.3)  # the subscription is joined (a PUB drops what no subscriber is joined for)
            await publisher.publish([3])
            await wait_until(lambda: index.depth([1, 2, 3]) == (3, 3), "the stream applied")
            await publisher.publish([4], drop=True)  # lost on the stream
            await publisher.publish([5])  # the gap shows: a replay brings 4 and 5
            await wait_until(lambda: index.depth([1, 2, 3, 4, 5]) == (5, 5), "the gap filled by a replay")
            assert index.gaps == 1 and index.replays == 2 and index.last_seq == 3 and index.lost == 0

            restarted = KVEvents()  # a router process started afresh rebuilds its index from the replay
            restarted.sync({"m": [ups[0].record]}, {"m": policy})
            again = restarted.index.replicas["r1"]
            await wait_until(lambda: again.synced and again.depth([1, 2, 3, 4, 5]) == (5, 5), "rebuilt by replay")

            hub.sync({"m": []}, {"m": policy})  # the replica left: its entries go, its subscription ends
            assert "r1" not in hub.index.replicas and not hub.tasks
            for other in (hub, restarted):
                for _, task in other.tasks.values():
                    task.cancel()
        finally:
            publisher.close()

    asyncio.run(run())


def test_cache_aware_goes_by_the_engines_blocks_over_its_table(demo_model_path):
    policy, (r1, r2) = cache_aware_over("r1", "r2")
    hub = KVEvents()
    for up in (r1, r2):
        up.record.kv_events = {"endpoint": f"tcp://127.0.0.1:1/{up.replica_id}", "tokenizer": str(demo_model_path)}
    hub.sync({"m": [r1.record, r2.record]}, {"m": policy})  # no loop: the tokenizer loads here, no subscriptions
    assert hub.model_keys["m"].tokens is not None
    prompt = "A long shared system prompt about the weather in many places. " * 20
    body = {"model": "m", "prompt": prompt, "max_tokens": 1}
    tokens, _ = PromptTokens(str(demo_model_path)).of(body, 65536)
    keys = hub.model_keys["m"].hasher.keys(tokens, 16)
    sent = RequestInfo("m", body)
    policy._prompt_keys(sent)  # the table says: r1 was sent it (a minute ago: not in flight any more)
    policy.table.insert(sent.memo["prefix_keys"], "r1", now=time.monotonic() - 60)
    for up in (r1, r2):
        hub.index.replicas[up.replica_id].synced = True
    hub.index.replicas["r2"].media[GPU] = dict.fromkeys(keys)  # the engines say: r2 holds it (r1 evicted it)
    hub.index.replicas["r2"].block_size = 16
    request = RequestInfo("m", body)
    assert policy.select([r1, r2], request, time.monotonic())[0] is r2
    assert request.memo["kv_depths"] == {"r1": 0, "r2": len(keys)}

    untokenizable = RequestInfo("m", {"model": "m", "prompt": prompt, "suffix": "x"})
    assert policy.select([r1, r2], untokenizable, time.monotonic())[0] is r1  # the table's answer
    hub.index.replicas["r2"].expect(time.monotonic() - 60)  # sent work, no event since: silent
    assert policy.select([r1, r2], RequestInfo("m", body), time.monotonic())[0] is r1
    assert hub.fallbacks == {("m", "not tokenizable"): 1, ("m", "index not live"): 1}
    assert policy.stats("r2")["kv_index"]["state"] == "silent"


def test_a_prompt_just_sent_counts_as_held_until_its_engine_announces_it_or_empties(demo_model_path):
    policy, hub, (r1, r2) = synced_hub(demo_model_path, balance_by="inflight")
    body = {"model": "m", "prompt": "A new customer's long system prompt, then a question. " * 12}
    first = RequestInfo("m", body)
    assert policy.select([r1, r2], first, time.monotonic())[0] is r1  # nothing held anywhere: by load
    policy.before_request(r1, first)
    r1.inflight, r1.sent = 1, r2.sent + 1  # its prefill runs; r1's engine has announced nothing yet
    burst = RequestInfo("m", body)
    assert policy.select([r1, r2], burst, time.monotonic())[0] is r1  # not spread to r2 meanwhile
    assert burst.memo["kv_depths"] == {"r1": 0, "r2": 0}  # (the events' depth, and so the prediction: none)
    later = time.monotonic() + cache_aware.SENT_FRESH_S + 1  # never announced: no longer taken as held
    assert policy.select([r1, r2], RequestInfo("m", body), later)[0] is r2
    hub.index.replicas["r1"].apply(0, [0.0, [{"type": "AllBlocksCleared"}]], time.monotonic())
    assert policy.select([r1, r2], RequestInfo("m", body), time.monotonic())[0] is r2  # r1's engine emptied since


def test_a_disaggregated_models_prefill_pool_is_followed_and_routed_on_its_events(demo_model_path):
    decode_policy, (d1,) = cache_aware_over("d1")
    prefill_policy, (p1, p2) = cache_aware_over("p1", "p2")
    hub = KVEvents()
    for up in (d1, p1, p2):
        up.record.kv_events = {"endpoint": f"tcp://127.0.0.1:1/{up.replica_id}", "tokenizer": str(demo_model_path)}
    prefill_pool = ({"m": [p1.record, p2.record]}, {"m": prefill_policy})
    hub.sync({"m": [d1.record]}, {"m": decode_policy}, prefill_pool)
    assert prefill_policy.exact is hub and decode_policy.exact is hub
    assert hub.model_replicas["m"] == {"d1", "p1", "p2"} and set(hub.tasks) == {"d1", "p1", "p2"}
    body = {"model": "m", "prompt": "A long shared system prompt for the prefill pool. " * 20}
    tokens, _ = PromptTokens(str(demo_model_path)).of(body, 65536)
    keys = hub.model_keys["m"].hasher.keys(tokens, 16)
    for index in hub.index.replicas.values():
        index.synced, index.block_size = True, 16
    hub.index.replicas["p2"].media[GPU] = dict.fromkeys(keys)  # the second prefill engine holds the prompt
    request = RequestInfo("m", body)
    assert prefill_policy.select([p1, p2], request, time.monotonic())[0] is p2
    assert request.memo["kv_depths"] == {"p1": 0, "p2": len(keys)}
    hub.sync({"m": []}, {"m": decode_policy}, prefill_pool)  # the decode pool left: only its stream goes
    assert set(hub.index.replicas) == {"p1", "p2"} and hub.model_replicas["m"] == {"p1", "p2"}


def test_replicas_that_publish_nothing_stay_on_the_table():
    policy, (r1, r2) = cache_aware_over("r1", "r2")  # llama.cpp: records without kv_events
    hub = KVEvents()
    hub.sync({"m": [r1.record, r2.record]}, {"m": policy})
    body = {"model": "m", "prompt": "x" * 400}
    policy.before_request(r2, RequestInfo("m", body))
    assert policy.select([r1, r2], RequestInfo("m", body), time.monotonic())[0] is r2
    assert not hub.fallbacks and "kv_index" not in policy.stats("r1")


def test_a_node_with_kv_events_off_is_not_followed():
    policy = make_policy(RoutingSpec.of("cache_aware", kv_events=False))
    hub = KVEvents()
    up = upstream("r1", 0, sent=0)
    up.record.kv_events = {"endpoint": "tcp://127.0.0.1:1", "tokenizer": "/nowhere"}
    hub.sync({"m": [up.record]}, {"m": policy})
    assert policy.exact is None and not hub.tasks


@pytest.mark.parametrize("balance_by", ["inflight", "prefill"])
def test_the_cost_counts_gpu_blocks_above_cpu_tier_ones_and_keeps_the_load_bound(demo_model_path, balance_by):
    policy, hub, (r1, r2) = synced_hub(demo_model_path, balance_by=balance_by)
    body = {"model": "m", "prompt": "Shared context for the cost test, long enough for some blocks. " * 12}
    tokens, _ = PromptTokens(str(demo_model_path)).of(body, 65536)
    keys = hub.model_keys["m"].hasher.keys(tokens, 16)
    assert len(keys) >= 8
    hub.index.replicas["r1"].media["CPU"] = dict.fromkeys(keys)  # all of it, on the CPU tier: worth half
    hub.index.replicas["r2"].media[GPU] = dict.fromkeys(keys[: len(keys) // 2 + 1])  # over half, on the GPU
    request = RequestInfo("m", body)
    assert policy.select([r1, r2], request, time.monotonic())[0] is r2
    assert request.memo["kv_depths"] == {"r1": len(keys) / 2, "r2": len(keys) // 2 + 1}
    if balance_by == "inflight":
        r2.inflight = policy.settings.balance_abs_threshold + 1  # the warm replica saturated: the load decides
    else:  # a prefill queued at r2 longer than what it saves: r1 computes the prompt's rest first
        r2.prefill_chars = len(body["prompt"])
    assert policy.select([r1, r2], RequestInfo("m", body), time.monotonic())[0] is r1


def test_a_long_prompt_is_keyed_in_a_thread_before_it_is_routed(demo_model_path):
    policy, hub, (r1, r2) = synced_hub(demo_model_path)
    long_body = {"model": "m", "prompt": "A long document to key off the loop. " * 400}
    early = RequestInfo("m", long_body)
    asyncio.run(hub.prepare(early, policy))
    assert len(early.memo["kv_keys"]) > 100
    late = RequestInfo("m", long_body)  # keyed when routed instead: the same keys
    policy.select([r1, r2], late, time.monotonic())
    assert late.memo["kv_keys"] == early.memo["kv_keys"]
    short = RequestInfo("m", {"model": "m", "prompt": "short"})
    asyncio.run(hub.prepare(short, policy))
    assert "kv_keys" not in short.memo  # keyed when routed: a thread's hop would cost more


def test_a_prompt_is_tokenized_no_further_than_the_first_block_no_replica_holds(demo_model_path):
    policy, hub, (r1, r2) = synced_hub(demo_model_path)
    prefixes = hub.model_keys["m"].tokens.prefixes
    prefixes.checked = token_prefixes.CHECKS  # the chunked tokens trusted, as after CHECKS prompts
    tokenized: list[int] = []
    encode = prefixes._encode
    prefixes._encode = lambda text, special: tokenized.append(len(text)) or encode(text, special)
    shared = "A shared system prompt about the weather in many places and its history. " * 60  # ~4 chunks
    reference = PromptTokens(str(demo_model_path))

    def whole(body):
        tokens, _ = reference.of(body, 65536)
        return tokens, hub.model_keys["m"].hasher.keys(tokens, 16)

    body = {"model": "m", "prompt": shared + "What is the forecast?"}
    tokens, keys = whole(body)
    cold = RequestInfo("m", body)  # no replica holds its first block: one chunk tokenized
    policy.select([r1, r2], cold, time.monotonic())
    assert sum(tokenized) <= token_prefixes.CHUNK_CHARS + 80
    assert 0 < len(cold.memo["kv_keys"]) < len(keys) and cold.memo["kv_keys"] == keys[: len(cold.memo["kv_keys"])]
    assert abs(cold.memo["kv_tokens"] - len(tokens)) < 0.1 * len(tokens)  # estimated from the characters left
    assert cold.memo["kv_depths"] == {"r1": 0, "r2": 0}

    held = len(keys) * 2 // 3  # r2 holds two thirds of the shared prompt's blocks: keyed past them
    hub.index.replicas["r2"].media[GPU] = dict.fromkeys(keys[:held])
    warm = RequestInfo("m", {"model": "m", "prompt": shared + "And tomorrow?"})
    assert policy.select([r1, r2], warm, time.monotonic())[0] is r2
    assert warm.memo["kv_depths"] == {"r1": 0, "r2": held}
    assert len(warm.memo["kv_keys"]) > held


def test_a_lora_adapters_request_is_keyed_with_the_adapter(demo_model_path):
    policy, (r1,) = cache_aware_over("r1")
    r1.record.models = ["m", "sql"]
    r1.record.kv_events = {
        "endpoint": "tcp://127.0.0.1:1",
        "tokenizer": str(demo_model_path),
        "loras": {"sql": "/adapters/sql"},
    }
    hub = KVEvents()
    hub.sync({"m": [r1.record], "sql": [r1.record]}, {"m": policy, "sql": policy})
    index = hub.index.replicas["r1"]
    index.synced, index.block_size = True, 16
    body = {"model": "sql", "prompt": "Select the rows of a table, many times over. " * 10}
    request = RequestInfo("sql", body)
    assert hub.match(request, [r1], time.monotonic()) is not None
    tokens, _ = PromptTokens(str(demo_model_path)).of(body, 65536)
    assert request.memo["kv_keys"] == hub.model_keys["sql"].hasher.keys(tokens, 16, lora=("sql", "/adapters/sql"))
    assert request.memo["kv_keys"] != hub.model_keys["sql"].hasher.keys(tokens, 16)


def test_an_adapters_placed_policy_routes_on_the_events_with_the_adapters_keys(demo_model_path):
    """An adapter's policy is its node's wrapped in the adapter placement (policies/adapters.py): it is handed the
    KV events like its node's, and matches the adapter's requests on the adapter's keys."""
    inner, (r1,) = cache_aware_over("r1")
    placed = AdapterAware("sql", inner, Placement(max_loras=1))
    r1.record.models = ["m", "sql"]
    r1.record.kv_events = {"endpoint": "tcp://127.0.0.1:1", "tokenizer": str(demo_model_path), "loras": {"sql": "/a"}}
    hub = KVEvents()
    hub.sync({"sql": [r1.record]}, {"sql": placed})
    assert placed.uses_kv_events and placed.exact is hub and inner.exact is hub
    index = hub.index.replicas["r1"]
    index.synced, index.block_size = True, 16
    request = RequestInfo("sql", {"model": "sql", "prompt": "Select the rows of a table, many times over. " * 10})
    assert hub.match(request, [r1], time.monotonic()) is not None
    tokens, _ = PromptTokens(str(demo_model_path)).of(request.body, 65536)
    assert request.memo["kv_keys"] == hub.model_keys["sql"].hasher.keys(tokens, 16, lora=("sql", "/a"))
