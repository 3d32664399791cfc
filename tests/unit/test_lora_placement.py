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
    EVICTS,
    FREE_SLOT,
    HOLDER,
    OVERLOADED,
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
    breaker: CircuitBreaker = field(default_factory=CircuitBreaker)


@pytest.mark.parametrize(
    "holds, inflight, least, held, max_loras, expected",
    [
        (True, 0, 0, 1, 2, HOLDER),  # holds it, idle
        (True, 4, 0, 2, 2, HOLDER),  # holds it, busy but within the slack (4)
        (True, 5, 0, 2, 2, OVERLOADED),  # holds it, beyond the slack: not preferred
        (False, 0, 0, 1, 2, FREE_SLOT),  # a free slot: loads it without evicting
        (False, 0, 0, 2, 2, EVICTS),  # full: loading it evicts another adapter
        (False, 9, 0, 0, 2, OVERLOADED),
    ],
)
def test_tiers(holds, inflight, least, held, max_loras, expected):
    assert tier(holds, inflight, least, held, max_loras) == expected


def ids(replicas) -> list[str]:
    return [r.replica_id for r in replicas]


@pytest.mark.parametrize(
    "held, inflight, adapter, first",
    [
        # a cold adapter stays where it is held, even when another replica is a little less busy
        ({"a": ["x"]}, {"a": 2, "b": 0}, "x", "a"),
        # its holder overloaded: the least busy replica with a free slot takes it (and loads it)
        ({"a": ["x"]}, {"a": 9, "b": 0, "c": 0}, "x", "b"),
        # nobody holds it: a replica with a free slot before one that must evict
        ({"a": ["y", "z"], "b": ["y"]}, {"a": 0, "b": 0}, "x", "b"),
        # held by two: the policy's order decides between them (here: the order given)
        ({"a": ["x"], "b": ["x"]}, {"a": 0, "b": 0, "c": 0}, "x", "a"),
    ],
)
def test_placement_decisions(held, inflight, adapter, first):
    placement = Placement(max_loras=2)
    for replica, adapters in held.items():
        for name in adapters:
            placement.sent(name, replica)
    replicas = [Rep(name, inflight[name]) for name in inflight]
    assert ids(placement.order(adapter, replicas))[0] == first


def test_the_policys_order_is_kept_within_a_tier():
    placement = Placement(max_loras=2)
    placement.sent("x", "c")
    placement.sent("x", "a")
    order = placement.order("x", [Rep("a"), Rep("b"), Rep("c")])
    assert ids(order) == ["a", "c", "b"]  # holders a, c in the given (policy's) order, then b


def test_max_loras_bounds_what_a_replica_holds_least_recently_used_out():
    placement = Placement(max_loras=2)
    assert placement.sent("x", "r") == [] and placement.sent("y", "r") == []
    placement.sent("x", "r")  # x used again: y is now the least recently used
    assert placement.sent("z", "r") == ["y"]
    assert list(placement.held["r"]) == ["x", "z"]
    assert placement.loads == {"x": 1, "y": 1, "z": 1} and placement.evictions == {"y": 1}


def test_a_hot_adapter_spreads_and_a_cold_one_stays():
    """Requests for hot adapter h pile up on its holder until it is overloaded, then go to the other replica;
    cold adapter c, sent now and then, keeps its one holder."""
    placement = Placement(max_loras=2)
    replicas = [Rep("a"), Rep("b")]

    def route(adapter):
        chosen = placement.order(adapter, replicas)[0]
        placement.sent(adapter, chosen.replica_id)
        chosen.inflight += 1  # every request still running
        return chosen.replica_id

    assert route("h") == "a"
    picks = [route("h") for _ in range(8)]
    assert "b" in picks and placement.holders("h") == ["a", "b"]  # spread once "a" was 5 above "b"
    for r in replicas:
        r.inflight = 0
    cold = route("c")
    assert [route("c") for _ in range(3)] == [cold] * 3 and placement.holders("c") == [cold]


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
