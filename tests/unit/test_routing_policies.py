"""The routing policies on synthetic replica states: no Ray, no HTTP."""

from __future__ import annotations

import pytest

from flagscale.config.routing import RoutingSpec
from flagscale.router.policies import POLICIES, RequestInfo, make_policy
from flagscale.router.policies.cache_aware import CacheAware, PrefixTable, prompt_text
from flagscale.router.policies.session import Session
from flagscale.router.replicas import Upstream
from tests.conftest import replica_record


def upstream(name: str, inflight: int = 0, sent: int = 0) -> Upstream:
    record = replica_record(name, f"http://{name}")
    return Upstream(record, inflight=inflight, sent=sent)


def names(ups) -> list[str]:
    return [u.replica_id for u in ups]


_SENT: dict[int, RequestInfo] = {}  # id(body) -> the request `send` routed, for `finish`'s hooks


def send(policy, ups, body, headers=None, now=1.0) -> Upstream:
    """Route one request and account it as the router does (picked: sent, hooks); it stays in flight."""
    info = _SENT[id(body)] = RequestInfo("m", body, headers or {})
    chosen = policy.select(ups, info, now)[0]
    policy.before_request(chosen, info)
    chosen.inflight += 1
    chosen.sent += 1
    return chosen


def finish(policy, up: Upstream, body) -> None:
    up.inflight -= 1
    policy.after_request(up, _SENT.pop(id(body), None) or RequestInfo("m", body), True)


PREFIX_A = "alpha " * 40  # 240 characters: 3 blocks of 64 and some
PREFIX_B = "bravo " * 40


def test_every_policy_name_makes_its_policy():
    for name in POLICIES:
        assert make_policy(RoutingSpec(policy=name)).name == name
    with pytest.raises(ValueError, match="unknown routing policy"):
        make_policy(RoutingSpec(policy="fastest"))


def test_prompt_text_of_completions_and_chat():
    assert prompt_text({"prompt": "hello"}) == "hello"
    assert prompt_text({"prompt": ["first", "second"]}) == "first"
    assert prompt_text({"prompt": [1, 2, 3]}) == "1 2 3"
    chat = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]}
    assert prompt_text(chat) == "<system>be brief<user>hi"
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}
    assert prompt_text(parts) == "<user>ab"
    assert prompt_text({}) == ""


def test_prefix_table_longest_match_and_lru_bound():
    table = PrefixTable(block_chars=4, max_blocks=6)
    keys_abc = table.keys("aaaabbbbcccc")
    keys_abd = table.keys("aaaabbbbdddd")
    assert len(keys_abc) == 3 and keys_abc[:2] == keys_abd[:2] and keys_abc[2] != keys_abd[2]
    assert table.keys("aaaabbbbccc") == keys_abc[:2]  # a partial block is not a block
    table.insert(keys_abc, "r1")
    table.insert(keys_abd[:2], "r2")
    assert table.match(keys_abc) == {"r1": 3, "r2": 2}
    assert table.match(keys_abd) == {"r1": 2, "r2": 2}
    table.insert(table.keys("xxxxyyyyzzzz"), "r2")  # 3 new blocks: 6 in all, at the bound
    assert len(table.blocks) == 6
    table.insert(table.keys("qqqq"), "r3")  # over the bound: the least recently used block goes first
    assert len(table.blocks) == 6
    assert table.match(keys_abc) == {"r1": 2, "r2": 2}  # abc's deepest block was evicted, its first ones stay


def test_prefix_table_counts_only_what_was_sent_since_a_replicas_own_time():
    table = PrefixTable(block_chars=4, max_blocks=100)
    keys = table.keys("aaaabbbbcccc")
    table.insert(keys, "r1", now=10.0)
    table.insert(keys[:2], "r2", now=20.0)
    table.insert(keys[:1], "r1", now=30.0)  # r1 sent the first block again, later
    assert table.match(keys, since=lambda replica: 15.0) == {"r1": 1, "r2": 2}  # r1's deeper blocks are older
    assert table.match(keys, since={"r1": 0.0, "r2": 25.0}.get) == {"r1": 3}


def test_cache_aware_sends_a_prefix_back_where_it_went():
    policy = make_policy(RoutingSpec(policy="cache_aware"))
    ups = [upstream("r1"), upstream("r2")]
    first = {}
    for prefix in (PREFIX_A, PREFIX_B):  # new prefixes spread as least_load spreads them
        body = {"prompt": prefix + "question 0"}
        first[prefix] = send(policy, ups, body)
        finish(policy, first[prefix], body)
    assert first[PREFIX_A] is not first[PREFIX_B]
    for i in range(1, 6):
        for prefix in (PREFIX_A, PREFIX_B):
            body = {"prompt": prefix + f"question {i}"}
            chosen = send(policy, ups, body)
            finish(policy, chosen, body)
            assert chosen is first[prefix]


def test_cache_aware_falls_back_to_least_load_beyond_the_imbalance_bound():
    policy = make_policy(RoutingSpec.of("cache_aware", balance_by="inflight", balance_abs_threshold=2))
    ups = [upstream("r1"), upstream("r2")]
    body = {"prompt": PREFIX_A + "?"}
    holder = send(policy, ups, body)
    other = next(u for u in ups if u is not holder)
    # The holder keeps the prefix while it is at most 2 requests above the least busy replica ...
    for _ in range(2):
        assert send(policy, ups, {"prompt": PREFIX_A + "again"}) is holder
    assert holder.inflight == 3 and other.inflight == 0
    # ... 3 in flight against 0 exceeds the bound: the hot prefix goes to the least busy replica.
    assert send(policy, ups, {"prompt": PREFIX_A + "more"}) is other
    assert policy.table.match(policy.table.keys(PREFIX_A)) == {"r1": 3, "r2": 3}  # both hold it now
    # Within the bound again, ties between equal matches go to the less busy one.
    assert send(policy, ups, {"prompt": PREFIX_A + "then"}) is other


def test_cache_aware_without_a_match_is_least_load():
    policy = make_policy(RoutingSpec(policy="cache_aware"))
    ups = [upstream("r1", inflight=4), upstream("r2", inflight=0)]
    assert names(policy.select(ups, RequestInfo("m", {"prompt": "short"}), 1.0)) == ["r2", "r1"]
    assert names(policy.select(ups, RequestInfo("m", {"prompt": PREFIX_B}), 1.0)) == ["r2", "r1"]


def test_cache_aware_multi_turn_chat_sticks_to_the_replica_holding_its_history():
    policy = make_policy(RoutingSpec.of("cache_aware", prefix_block_chars=16))
    ups = [upstream("r1"), upstream("r2"), upstream("r3")]
    system = {"role": "system", "content": "You are a helpful assistant. "}  # shared, under cache_threshold
    homes = {}
    for conv in range(6):
        messages = [system, {"role": "user", "content": f"conversation {conv}: " + "tell me about caching " * 8}]
        for turn in range(4):
            body = {"messages": list(messages)}
            chosen = send(policy, ups, body)
            finish(policy, chosen, body)
            if turn == 0:
                homes[conv] = chosen
            assert chosen is homes[conv], (conv, turn)
            messages += [
                {"role": "assistant", "content": f"answer {turn}"},
                {"role": "user", "content": f"and then {turn}?"},
            ]
    assert sorted(names(homes.values())) == ["r1", "r1", "r2", "r2", "r3", "r3"]  # new conversations spread


def test_cache_aware_short_shared_prefix_does_not_pin_new_prompts():
    policy = make_policy(RoutingSpec.of("cache_aware", cache_threshold=0.5))
    ups = [upstream("r1"), upstream("r2")]
    shared = "x" * 64  # one block, shared by every prompt
    homes = []
    for i in range(4):
        body = {"prompt": shared + f"{i}" * 100}
        homes.append(send(policy, ups, body).replica_id)
        finish(policy, ups[0] if homes[-1] == "r1" else ups[1], body)
    assert sorted(homes) == ["r1", "r1", "r2", "r2"]
    body = {"prompt": shared + "0" * 100 + "more"}  # most of it is cached on r1: it goes back there
    assert send(policy, ups, body).replica_id == homes[0]


def test_cache_aware_forgets_a_departed_replica_and_uses_a_new_one():
    policy = make_policy(RoutingSpec(policy="cache_aware"))
    r1, r2 = upstream("r1"), upstream("r2")
    holder = {}
    for prefix in (PREFIX_A, PREFIX_B):
        body = {"prompt": prefix}
        holder[prefix] = send(policy, [r1, r2], body)
        finish(policy, holder[prefix], body)
    assert isinstance(policy, CacheAware) and holder[PREFIX_A] is not holder[PREFIX_B]
    assert {u.replica_id: policy.stats(u.replica_id)["prefix_blocks"] for u in (r1, r2)} == {"r1": 3, "r2": 3}
    gone, stays = holder[PREFIX_A], holder[PREFIX_B]
    policy.on_replica_left(gone.replica_id)
    assert policy.stats(gone.replica_id)["prefix_blocks"] == 0 and policy.stats(stays.replica_id)["prefix_blocks"] == 3
    r3 = upstream("r3", sent=stays.sent)
    policy.on_replica_joined(r3)
    # The departed replica's prefix is held by nobody now: it goes by load; the other stays where it is.
    stays.inflight = 3
    assert send(policy, [stays, r3], {"prompt": PREFIX_A + "x"}) is r3
    r3.inflight = 2
    assert send(policy, [stays, r3], {"prompt": PREFIX_B + "x"}) is stays


def test_cache_aware_skips_a_replica_whose_circuit_is_open():
    policy = make_policy(RoutingSpec(policy="cache_aware"))
    r1, r2 = upstream("r1"), upstream("r2")
    holder = send(policy, [r1, r2], {"prompt": PREFIX_A})
    holder.breaker.trip(now=1.0)
    ranked = policy.select([r1, r2], RequestInfo("m", {"prompt": PREFIX_A}), now=2.0)
    assert ranked == [r2 if holder is r1 else r1]


def test_least_load_keeps_its_bounded_load_rule():
    policy = make_policy(RoutingSpec(policy="least_load"))
    ups = [upstream("a", inflight=5), upstream("b", inflight=1), upstream("c", inflight=3)]
    assert names(policy.select(ups, RequestInfo("m", {"prompt": PREFIX_A}), 1.0)) == ["b", "c", "a"]


def test_round_robin_takes_turns_whatever_the_load():
    policy = make_policy(RoutingSpec(policy="round_robin"))
    ups = [upstream("a", inflight=9), upstream("b"), upstream("c")]
    firsts = [policy.select(ups, RequestInfo("m", {}), 1.0)[0].replica_id for _ in range(6)]
    assert sorted(firsts) == ["a", "a", "b", "b", "c", "c"]
    assert firsts[:3] == firsts[3:] and len(set(firsts[:3])) == 3
    ups[1].breaker.trip(now=1.0)
    assert "b" not in {policy.select(ups, RequestInfo("m", {}), 2.0)[0].replica_id for _ in range(4)}


def test_session_affinity_by_user_field_and_header():
    policy = make_policy(RoutingSpec(policy="session"))
    ups = [upstream("r1"), upstream("r2")]
    homes = {}
    for turn in range(5):
        for user in ("ann", "bob", "cy", "dee"):
            body = {"prompt": f"turn {turn}", "user": user}
            chosen = send(policy, ups, body)
            finish(policy, chosen, body)
            assert homes.setdefault(user, chosen) is chosen
    assert {u.replica_id for u in homes.values()} == {"r1", "r2"}  # first requests spread by load
    by_header = send(policy, ups, {"prompt": "x"}, {"x-session-id": "s-1"})
    for _ in range(4):
        assert send(policy, ups, {"prompt": "y"}, {"x-session-id": "s-1"}) is by_header
    # No session: least load.
    ups[0].inflight, ups[1].inflight = 10, 0
    assert send(policy, ups, {"prompt": "z"}) is ups[1]


def test_session_moves_when_its_replica_leaves_or_fails():
    policy = make_policy(RoutingSpec.of("session", max_sessions=2))
    r1, r2 = upstream("r1"), upstream("r2", sent=1)
    assert send(policy, [r1, r2], {"user": "ann"}) is r1
    r1.breaker.trip(now=1.0)
    assert send(policy, [r1, r2], {"user": "ann"}, now=2.0) is r2  # r1's circuit is open
    assert send(policy, [r1, r2], {"user": "ann"}, now=100.0) is r2  # and the session stays where it went
    policy.on_replica_left("r2")
    assert session_of("ann") not in policy.sessions
    for user in ("a", "b", "c"):
        send(policy, [r1, r2], {"user": user}, now=100.0)
    assert list(policy.sessions) == [session_of("b"), session_of("c")]  # bounded, least recently used forgotten


def session_of(user: str) -> bytes:
    return Session.key(RequestInfo("m", {"user": user}))


def test_a_session_costs_the_same_however_long_its_name():
    policy = make_policy(RoutingSpec.of("session", max_sessions=10))
    r1 = upstream("r1")
    send(policy, [r1], {"user": "u" * 1_000_000})
    send(policy, [r1], {}, {"x-session-id": "\udcff" * 10_000})  # (header bytes that are not UTF-8)
    assert [len(key) for key in policy.sessions] == [16, 16]


def test_routing_options_are_every_policys_settings_with_the_same_defaults():
    from dataclasses import asdict, fields

    from flagscale.config.schema import RoutingOptions

    declared = set()
    for name in POLICIES:
        settings = RoutingSpec(policy=name).settings
        assert type(settings) is POLICIES[name].settings_type
        declared |= {f.name for f in fields(settings)}
        assert {k: v for k, v in RoutingOptions().model_dump().items() if k in asdict(settings)} == asdict(settings)
    assert declared == set(RoutingOptions.model_fields)


def test_cache_aware_by_prefill_keeps_the_warm_replica_past_the_in_flight_bound_while_its_prefill_queue_is_short():
    policy = make_policy(RoutingSpec.of("cache_aware", balance_by="prefill", balance_abs_threshold=2))
    ups = [upstream("r1"), upstream("r2")]
    first = RequestInfo("m", {"prompt": PREFIX_A * 4 + "?"})
    holder = policy.select(ups, first, 1.0)[0]
    policy.before_request(holder, first)
    holder.inflight += 1
    policy.first_byte(first)  # decoding: no prefill left of it
    other = next(u for u in ups if u is not holder)
    # answered requests (past their prefill) do not weigh: 8 in flight against 0 and the warm replica still wins
    for i in range(7):
        info = RequestInfo("m", {"prompt": PREFIX_A * 4 + f"q{i}"})
        assert policy.select(ups, info, 1.0)[0] is holder
        policy.before_request(holder, info)
        holder.inflight += 1
        policy.first_byte(info)
    assert holder.inflight == 8 and holder.prefill_chars == 0
    # requests still in prefill there queue their uncached characters, until computing the whole prompt elsewhere is less
    waiting = []
    while True:
        info = RequestInfo("m", {"prompt": PREFIX_A * 4 + "a longer question " * 3})
        chosen = policy.select(ups, info, 1.0)[0]
        if chosen is other:
            break
        policy.before_request(chosen, info)
        waiting.append(info)
        assert len(waiting) < 20
    prompt_chars = info.memo["prompt_chars"]
    uncached = info.memo["uncached_chars"][holder.replica_id]
    assert 0 < uncached < prompt_chars
    assert holder.prefill_chars + uncached > prompt_chars >= holder.prefill_chars
    # their first bytes (or their ends) take the queue off: the warm replica again
    policy.first_byte(waiting[0])
    policy.after_request(holder, waiting[1], True)
    policy.first_byte(waiting[1])  # (already off: counted once)
    again = RequestInfo("m", {"prompt": PREFIX_A * 4 + "a longer question " * 3})
    assert policy.select(ups, again, 1.0)[0] is holder
    for info in waiting[2:]:
        policy.after_request(holder, info, True)
    assert holder.prefill_chars == 0 and other.prefill_chars == 0


def on_gpu(name: str, gpu: str, inflight: int = 0) -> Upstream:
    up = upstream(name, inflight=inflight)
    up.record.gpus, up.record.family = [gpu], "nvidia"
    return up


def test_a_replicas_devices_are_its_gpus_else_its_pinned_cores_on_its_host():
    gpu, cpu, unknown = upstream("g"), upstream("c"), upstream("u")
    gpu.record.gpus, gpu.record.family = ["0", "1"], "ascend"
    cpu.record.worker_cpus = [2, 3]
    assert gpu.devices == {"n/ascend:0", "n/ascend:1"} and cpu.devices == {"n/cpu:2", "n/cpu:3"}
    assert unknown.devices == frozenset()  # neither: shares nothing as far as the router knows
    cpu.record = replica_record("c", "http://c")  # a new record (the registry re-read): its devices again
    assert cpu.devices == frozenset()


@pytest.mark.parametrize("scope", ["device", "replica"])
def test_cache_aware_by_prefill_weighs_the_queue_of_the_gpu_a_replica_shares_not_its_own(scope):
    # r1 and r2 share GPU 0, r3 (busier, so least_load ranks it after r2) has GPU 1 to itself
    policy = make_policy(RoutingSpec.of("cache_aware", balance_by="prefill", balance_scope=scope))
    ups = [on_gpu("r1", "0"), on_gpu("r2", "0"), on_gpu("r3", "1", inflight=5)]
    assert ups[0].devices == {"n/nvidia:0"} and not ups[0].devices & ups[2].devices
    warm = RequestInfo("m", {"prompt": PREFIX_A * 4 + "?"})
    policy.select(ups, warm, 1.0)
    policy.before_request(ups[0], warm)
    policy.first_byte(warm)
    queued = 0
    while True:  # prompts on r1's prefix queue on r1 until computing it elsewhere is less
        info = RequestInfo("m", {"prompt": PREFIX_A * 4 + f"a longer question {queued} " * 3})
        chosen = policy.select(ups, info, 1.0)[0]
        if chosen is not ups[0]:
            break
        policy.before_request(chosen, info)
        queued += 1
        assert queued < 50
    # moving it to r2 queues it behind the same GPU's prefill: only the other GPU saves time
    assert chosen.replica_id == ("r3" if scope == "device" else "r2")
    # a prompt nobody holds, GPU 1 busier still: the GPU's queue ties, and r2, whose own queue is empty, starts it first
    ups[2].prefill_chars = ups[0].prefill_chars * 3
    ups[1].sent = ups[0].sent + 5  # (and least_load would put r1 first)
    assert policy.select(ups, RequestInfo("m", {"prompt": "unseen " * 40}), 1.0)[0].replica_id == "r2"


def test_cache_aware_by_prefill_without_reuse_spreads_by_the_prefill_queue_then_least_load():
    policy = make_policy(RoutingSpec.of("cache_aware", balance_by="prefill"))
    ups = [upstream("r1", inflight=3), upstream("r2", inflight=0)]
    assert names(policy.select(ups, RequestInfo("m", {"prompt": "short"}), 1.0)) == ["r2", "r1"]  # least_load
    long_prompt = RequestInfo("m", {"prompt": PREFIX_B})
    policy.before_request(ups[1], RequestInfo("m", {"prompt": "x"}))  # (no select: nothing queued)
    assert ups[1].prefill_chars == 0
    policy.select(ups, long_prompt, 1.0)
    policy.before_request(ups[1], long_prompt)  # r2 computes PREFIX_B: 240 characters before its first byte
    assert ups[1].prefill_chars == len(PREFIX_B)
    assert names(policy.select(ups, RequestInfo("m", {"prompt": "other " * 40}), 1.0)) == ["r1", "r2"]
    # sent again elsewhere (the first replica failed it before any byte): counted at the new replica only
    policy.before_request(ups[0], long_prompt)
    assert (ups[0].prefill_chars, ups[1].prefill_chars) == (len(PREFIX_B), 0)
    # another model's policy (an adapter, another served name) on the same replicas sees that queue too
    neighbour = make_policy(RoutingSpec.of("cache_aware", balance_by="prefill"))
    assert names(neighbour.select(ups, RequestInfo("m", {"prompt": "third " * 40}), 1.0)) == ["r2", "r1"]
    policy.first_byte(long_prompt)
    assert ups[0].prefill_chars == 0
