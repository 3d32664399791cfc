"""Staleness and circuit readmission judged by one clock (issue 56): records written on one host carry a `seq` their
publisher advances, and the reader judges them by when it saw the `seq` advance, on its own monotonic clock
(flagscale/replica/liveness.py). Hosts whose wall clocks are an hour off either way change nothing: a replica whose
clock is behind is routed and readmitted after its circuit opened; one whose clock is ahead and that stopped
publishing is dropped (and withdrawn from the registry) all the same."""

from __future__ import annotations

import json
import time
from dataclasses import asdict

import pytest

from flagscale.replica import registry
from flagscale.replica.liveness import Liveness
from flagscale.router import peers
from flagscale.router.circuit_breaker import CircuitState
from flagscale.router.replicas import Replicas
from tests.conftest import bare_router, replica_record

HOUR = 3600.0


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def store(monkeypatch):
    """Ray's key-value store as a dict, for the registry and the router processes' reports."""
    kv: dict[bytes, bytes] = {}
    for module in (registry, peers):
        monkeypatch.setattr(module, "kv_put", lambda key, value, namespace: kv.__setitem__(key, value))
        monkeypatch.setattr(module, "kv_get", lambda key, namespace: kv.get(key))
        monkeypatch.setattr(module, "kv_del", lambda key, namespace: kv.pop(key, None))
        monkeypatch.setattr(module, "kv_list", lambda prefix, namespace: [k for k in kv if k.startswith(prefix)])
    return kv


def publish_from_host(monkeypatch, record, skew_s: float) -> None:
    """`record` published by a replica on a host whose wall clock is `skew_s` off."""
    wall_clock = time.time
    with monkeypatch.context() as host:
        host.setattr(registry.time, "time", lambda: wall_clock() + skew_s)
        registry.publish(record)


def router_replicas(clock: FakeClock) -> Replicas:
    replicas = Replicas({}, {})
    replicas.liveness = Liveness(registry.STALE_AFTER_S, clock)
    return replicas


def test_replicas_are_judged_by_their_heartbeats_not_by_their_hosts_wall_clocks(store, monkeypatch):
    clock = FakeClock()
    replicas = router_replicas(clock)
    behind, ahead = replica_record("behind", "http://10.0.0.1:1"), replica_record("ahead", "http://10.0.0.2:1")
    behind.app = ahead.app = "a"
    for step in range(3):  # both publish on every health check; the router reads every few seconds
        publish_from_host(monkeypatch, behind, -HOUR)
        publish_from_host(monkeypatch, ahead, +HOUR)
        assert replicas.update(registry.list_replicas("a"), lambda u: 8, clock.now) == []
        assert set(replicas.table.by_replica) == {"behind", "ahead"}, step  # an hour behind: still routed
        clock.now += 5
    # "ahead" stops publishing (its replica died without a word); its wall clock an hour ahead does not keep it
    for _ in range(int(registry.STALE_AFTER_S // 5) + 1):
        publish_from_host(monkeypatch, behind, -HOUR)
        stale = replicas.update(registry.list_replicas("a"), lambda u: 8, clock.now)
        clock.now += 5
    assert [r.replica_id for r in stale] == ["ahead"] and set(replicas.table.by_replica) == {"behind"}
    registry.withdraw_stale("a", stale)  # (what the router does with them: every reader sees them gone)
    assert [r.replica_id for r in registry.list_replicas("a")] == ["behind"]
    assert replicas.stats()["behind"]["heartbeat_age_s"] == 5.0  # since the router saw it advance, by its own clock


def test_an_opened_circuit_is_readmitted_on_heartbeats_of_a_replica_whose_clock_is_behind(store, monkeypatch):
    replicas = Replicas({}, {})
    record = replica_record("r", "http://10.0.0.1:1")
    record.app = "a"

    def read() -> None:
        replicas.update(registry.list_replicas("a"), lambda u: 8, time.monotonic())

    publish_from_host(monkeypatch, record, -HOUR)
    read()
    breaker = replicas.table.by_replica["r"].breaker
    breaker.trip(time.monotonic())
    after_cooldown = time.monotonic() + breaker.cooldown_s + 1
    read()  # the first read after the opening: its heartbeat may be from before it
    assert breaker.state(after_cooldown) is CircuitState.OPEN
    publish_from_host(monkeypatch, record, -HOUR)  # the replica's next health check passed
    read()
    assert breaker.state(after_cooldown) is CircuitState.HALF_OPEN  # (a wall-clock comparison kept it open)


def test_router_processes_reports_are_judged_by_their_seq(store):
    clock = FakeClock()
    link = bare_router([], "least_load").peers
    link.liveness = Liveness(peers.STALE_AFTER_S, clock)

    def report(process: str, seq: int, wall_clock: float) -> None:
        """A report as a process whose wall clock reads `wall_clock` publishes it."""
        stamped = peers.PeerReport(process, 1, 0.0, wall_clock, {"inflight": 1}, "", seq=seq)
        store[b"routers/a/" + process.encode()] = json.dumps(asdict(stamped)).encode()

    for seq in range(1, 4):
        report("h:behind", seq, time.time() - HOUR)
        report("h:ahead", 1, time.time() + HOUR)  # stopped at its first report
        live = {r.process for r in link.live_reports("a")}
        clock.now += peers.STALE_AFTER_S / 2 + 0.1
    assert live == {"h:behind"}
    assert [r.process for r in peers.reports("a")] == ["h:behind"]  # the gone one's report withdrawn


def test_the_stop_mark_holds_no_time_a_replica_host_would_read_with_its_own_clock(store, monkeypatch):
    """`stop` marks the deployment stopping on its host; replicas on other hosts read it as they shut down."""
    registry.mark_stopping("a")
    wall_clock = time.time
    with monkeypatch.context() as replica_host:  # a replica host whose clock is an hour ahead of the CLI's
        replica_host.setattr(registry.time, "time", lambda: wall_clock() + HOUR)
        assert registry.stopping("a")
    registry.clear_stopping("a")  # (what a later deploy of the name does with a mark a dead stop left)
    assert not registry.stopping("a")
