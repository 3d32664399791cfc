from flagscale.router.policies import rank_replicas
from flagscale.router.replicas import Upstream as _Upstream
from tests.conftest import replica_record


def upstream(name, inflight=0, down_until=0.0, sent=0):
    record = replica_record(name, f"http://{name}")
    up = _Upstream(record, inflight=inflight, sent=sent)
    if down_until:
        up.breaker.trip(now=down_until - up.breaker.cooldown_s)  # circuit open until then
    return up


def names(ups):
    return [u.record.replica_id for u in ups]


def test_idle_replicas_take_turns():
    ups = [upstream("a"), upstream("b")]
    firsts = [names(rank_replicas(ups, turn, now=1.0))[0] for turn in range(6)]
    assert firsts == ["a", "b", "a", "b", "a", "b"]


def test_least_in_flight_first():
    ups = [upstream("a", inflight=5), upstream("b", inflight=1), upstream("c", inflight=3)]
    assert names(rank_replicas(ups, turn=0, now=1.0)) == ["b", "c", "a"]


def test_faster_replica_does_not_take_every_freed_slot():
    # "a" just finished a request (3 in flight vs 4) but was already sent more: "b" gets the next one.
    ups = [upstream("a", inflight=3, sent=40), upstream("b", inflight=4, sent=30)]
    assert names(rank_replicas(ups, turn=0, now=1.0)) == ["b", "a"]


def test_replica_far_behind_is_not_fed_to_even_out_counts():
    ups = [upstream("slow", inflight=6, sent=10), upstream("fast", inflight=2, sent=50)]
    assert names(rank_replicas(ups, turn=0, now=1.0)) == ["fast", "slow"]


def simulate(slowdown_of_b: float, clients=8, requests=600) -> dict[str, int]:
    """Closed loop: `clients` keep one request each in flight; "b" takes `slowdown_of_b` times as long."""
    ups = [upstream("a"), upstream("b")]
    finishing: list[tuple[float, _Upstream]] = []
    now = 0.0
    for turn in range(requests):
        if len(finishing) == clients:
            finishing.sort(key=lambda item: item[0])
            now, done = finishing.pop(0)
            done.inflight -= 1
        chosen = rank_replicas(ups, turn, now)[0]
        chosen.inflight += 1
        chosen.sent += 1
        finishing.append((now + (slowdown_of_b if chosen.record.replica_id == "b" else 1.0), chosen))
    return {u.record.replica_id: u.sent for u in ups}


def test_even_split_when_one_replica_is_a_little_faster():
    counts = simulate(slowdown_of_b=1.25)
    assert max(counts.values()) <= 1.1 * min(counts.values()), counts


def test_much_slower_replica_gets_less():
    counts = simulate(slowdown_of_b=3.0)
    assert counts["a"] > 1.3 * counts["b"], counts
