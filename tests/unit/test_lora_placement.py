"""Where a LoRA adapter's requests go (flagscale/router/policies/adapters.py, docs/routing.md): table tests of the
placement's decisions, and the router's wiring (an adapter is a model of its node, its policy placed, its loads and
evictions in /metrics)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import aiohttp
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from flagscale.config.routing import RoutingSpec
from flagscale.router.circuit_breaker import CircuitBreaker
from flagscale.router.lora import AdapterRouting
from flagscale.router.policies import RequestInfo, make_policy
from flagscale.router.policies.adapters import (
    FREE_SLOT,
    FULL,
    HELD,
    OVERLOADED,
    RUNNING,
    AdapterAware,
    Placement,
    tier,
)
from flagscale.router.spec import RouterSpec
from tests.conftest import bare_router, router_listening
from tests.unit.fakes import FakeEngine, events, greedy, started_upstreams, streamed_text, text_of, tokenize


@dataclass
class Rep:
    replica_id: str
    inflight: int = 0
    sent: int = 0
    prefill_chars: float = 0.0
    devices: frozenset[str] = frozenset()
    breaker: CircuitBreaker = field(default_factory=CircuitBreaker)


@pytest.mark.parametrize(
    "running, holds, inflight, least, busy, expected",
    [
        (True, True, 3, 0, 2, RUNNING),  # its requests run there: this one joins their batch
        (True, True, 5, 0, 2, OVERLOADED),  # but more than the slack (4) above the least busy: not preferred
        (False, True, 0, 0, 1, HELD),  # ran it lately, a slot free
        (False, False, 0, 0, 1, FREE_SLOT),  # a slot free: loads it there
        (False, True, 0, 0, 2, FULL),  # both slots taken by other adapters' requests: it would wait
        (False, False, 9, 0, 0, OVERLOADED),
    ],
)
def test_tiers(running, holds, inflight, least, busy, expected):
    assert tier(running, holds, inflight, least, busy, max_loras=2, slack=4) == expected


def ids(replicas) -> list[str]:
    return [r.replica_id for r in replicas]


def placed(active: dict[str, list[str]], held: dict[str, list[str]]) -> Placement:
    """A placement with these adapters in flight (one request each) and, beyond them, these held last."""
    placement = Placement(max_loras=2)
    for replica, adapters in held.items():
        for name in adapters:
            placement.sent(name, replica, in_flight=False)
    for replica, adapters in active.items():
        for name in adapters:
            placement.sent(name, replica)
    return placement


@pytest.mark.parametrize(
    "active, held, inflight, adapter, first",
    [
        # running on a: joins its batch there, though b is less busy
        ({"a": ["x"]}, {}, {"a": 3, "b": 0}, "x", "a"),
        # running on a, which is overloaded: a replica with a free slot takes it
        ({"a": ["x"]}, {}, {"a": 9, "b": 0}, "x", "b"),
        # running on a, 9 above b; but b's slots are all taken (y, z): joining a's batch beats waiting for a slot
        ({"a": ["x"], "b": ["y", "z"]}, {}, {"a": 9, "b": 0}, "x", "a"),
        # ... unless a is overloaded against a third replica with a free slot
        ({"a": ["x"], "b": ["y", "z"]}, {}, {"a": 9, "b": 0, "c": 4}, "x", "c"),
        # nobody runs it: a replica that held it lately, with a free slot, before one with a free slot
        ({}, {"b": ["x"]}, {"a": 0, "b": 0}, "x", "b"),
        # a's slots are taken by y and z: b, with a free slot, though it is busier
        ({"a": ["y", "z"], "b": ["w"]}, {}, {"a": 2, "b": 3}, "x", "b"),
        # running on both: the policy's order decides between them (here: the order given)
        ({"a": ["x"], "b": ["x"]}, {}, {"a": 1, "b": 1, "c": 0}, "x", "a"),
    ],
)
def test_placement_decisions(active, held, inflight, adapter, first):
    replicas = [Rep(name, inflight[name]) for name in inflight]
    assert ids(placed(active, held).order(adapter, replicas))[0] == first


def test_the_policys_order_is_kept_within_a_tier():
    placement = placed({"c": ["x"], "a": ["x"]}, {})
    order = placement.order("x", [Rep("a", 1), Rep("b"), Rep("c", 1)])
    assert ids(order) == ["a", "c", "b"]  # running on a and c, in the given (policy's) order, then b


def test_a_request_that_ends_frees_its_adapters_slot():
    placement = placed({"r": ["x", "x", "y"]}, {})
    assert placement.active["r"] == {"x": 2, "y": 1}
    placement.done("x", "r")
    placement.done("y", "r")
    assert placement.active["r"] == {"x": 1}
    assert ids(placement.order("z", [Rep("r", 1), Rep("s", 5)])) == ["r", "s"]  # a slot free on r now


def test_max_loras_bounds_what_a_replica_holds_least_recently_used_out():
    placement = Placement(max_loras=2)
    assert placement.sent("x", "r") == [] and placement.sent("y", "r") == []
    placement.sent("x", "r")  # x used again: y is now the least recently used
    assert placement.sent("z", "r") == ["y"]
    assert list(placement.held["r"]) == ["x", "z"]
    assert placement.loads == {"x": 1, "y": 1, "z": 1} and placement.evictions == {"y": 1}


def test_a_hot_adapter_spreads_and_a_cold_one_stays():
    """Requests for hot adapter h join its batch on one replica until that one is overloaded, then spread to
    the other; cold adapter c, asked now and then, stays where it ran."""
    placement = Placement(max_loras=2)
    replicas = [Rep("a"), Rep("b")]

    def route(adapter):
        chosen = placement.order(adapter, replicas)[0]
        placement.sent(adapter, chosen.replica_id)
        chosen.inflight += 1  # every request still running
        return chosen.replica_id

    assert route("h") == "a"
    picks = [route("h") for _ in range(8)]
    assert picks[:4] == ["a"] * 4 and "b" in picks  # spread once "a" was 5 above "b"
    for r in replicas:
        for adapter in list(placement.active.get(r.replica_id, {})):
            while adapter in placement.active.get(r.replica_id, {}):
                placement.done(adapter, r.replica_id)
        r.inflight = 0
    cold = route("c")
    for r in replicas:
        r.inflight = 0
    placement.done("c", cold)
    assert route("c") == cold  # held there, a slot free: back to it


def test_the_router_places_only_adapters_and_counts_loads_and_evictions():
    spec = RouterSpec(
        app="a",
        host="127.0.0.1",
        port=0,
        models={"m": "s", "x": "s", "y": "s", "z": "s"},
        routing={name: RoutingSpec(policy="least_load") for name in "mxyz"},
        adapters={"x": "m", "y": "m", "z": "m"},
        max_loras={"s": 1},
    )
    registry = CollectorRegistry()
    routing = AdapterRouting(registry)
    base = routing.policy("m", spec)
    assert not isinstance(base, AdapterAware)
    policies = {name: routing.policy(name, spec) for name in "xyz"}
    assert all(isinstance(p, AdapterAware) for p in policies.values())
    assert policies["x"].placement is policies["y"].placement  # one node, one placement
    replica = Rep("r")
    for name in "xyx":
        info = RequestInfo(name, {"model": name, "prompt": "p"})
        chosen = policies[name].select([replica], info, 0.0)[0]
        policies[name].before_request(chosen, info)
    text = generate_latest(registry).decode()
    assert 'flagscale_router_adapter_loads_total{model="x"} 2.0' in text  # max_loras 1: y pushed x out
    assert 'flagscale_router_adapter_evictions_total{model="x"} 1.0' in text
    assert policies["x"].stats("r")["adapters"] == ["x"]


def test_an_adapters_own_policy_still_orders_within_the_tier():
    """cache_aware within an adapter: a prompt seen before goes back to its replica among the holders."""
    placement = Placement(max_loras=4)
    policy = AdapterAware("x", make_policy(RoutingSpec(policy="cache_aware")), placement)
    replicas = [Rep("a"), Rep("b")]
    for r in replicas:
        policy.on_replica_joined(r)
        placement.sent("x", r.replica_id)
    prompt = "a long shared prefix " * 20
    info = RequestInfo("x", {"model": "x", "prompt": prompt})
    policy.select(replicas, info, 0.0)
    policy.before_request(replicas[1], info)  # sent to b first
    policy.first_byte(info)  # (its prefill done: b has nothing queued before a next request)
    assert replicas[1].prefill_chars == 0
    again = RequestInfo("x", {"model": "x", "prompt": prompt + " more"})
    assert ids(policy.select(replicas, again, 0.0))[0] == "b"


async def _adapter_stream_through_router(engines, body):
    """One streamed request for adapter "sql" of node "s" (base model "m") through a router over `engines`."""
    router = bare_router(await started_upstreams(engines), "least_load")
    router.spec.models["sql"] = "s"
    router.spec.adapters["sql"] = "m"
    router.spec.routing["sql"] = RoutingSpec(policy="least_load")
    router.replicas.policies["sql"] = router.adapter_routing.policy("sql", router.spec)
    ups = list(router.replicas.table.by_replica.values())
    for up in ups:
        up.record.models = ["m", "sql"]
    router.replicas.table.by_model["sql"] = ups
    try:
        async with router_listening(router) as url, aiohttp.ClientSession() as client:
            async with client.post(f"{url}/v1/completions", json=body) as resp:
                return resp.status, await resp.read(), router
    finally:
        for engine in engines:
            await engine.runner.cleanup()


def test_an_adapters_stream_resumes_on_another_replica_naming_the_same_adapter():
    body = {"model": "sql", "prompt": "hello", "max_tokens": 12, "stream": True, "temperature": 0}
    dying, spare = FakeEngine("dying", die_after=5), FakeEngine("spare")
    status, raw, router = asyncio.run(_adapter_stream_through_router([dying, spare], body))
    assert status == 200 and streamed_text(raw) == text_of(greedy(tokenize("hello"), 12))
    assert [b["model"] for _, b in dying.bodies] == ["sql"]
    assert [b["model"] for _, b in spare.bodies] == ["sql"]  # the resumed request names the same adapter
    assert {e["model"] for e in events(raw) if isinstance(e, dict)} == {"sql"}
    metrics = router.metrics.text().decode()
    assert 'flagscale_router_streamed_tokens_total{model="sql"} 12.0' in metrics  # both parts, per adapter
    assert 'flagscale_router_requests_total{model="sql",status="200"} 1.0' in metrics


def test_a_replica_that_drops_an_adapter_keeps_holding_the_others():
    placement = Placement(max_loras=3)
    policy_x = AdapterAware("x", make_policy(RoutingSpec(policy="least_load")), placement)
    for adapter in ("x", "y"):
        placement.sent(adapter, "r")
    policy_x.on_replica_left("r")  # r unloaded x (or left: then every adapter's policy is told)
    assert list(placement.held["r"]) == ["y"] and placement.holders("x") == []


def test_an_adapter_the_engine_reports_running_counts_as_held():
    """Another router process (or a router just restarted) sent it there: the engine's report says so."""

    @dataclass
    class Record:
        adapters_running: list[str]

    @dataclass
    class Reported(Rep):
        record: Record = field(default_factory=lambda: Record([]))

    placement = Placement(max_loras=2)
    a, b = Reported("a", inflight=1), Reported("b", record=Record(["x"]), inflight=2)
    assert ids(placement.order("x", [a, b])) == ["b", "a"]
    assert ids(placement.order("y", [a, b])) == ["a", "b"]  # nobody holds y: both free, the policy's order
