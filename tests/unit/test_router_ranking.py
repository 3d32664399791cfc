from flagscale.serve.registry import ReplicaRecord
from flagscale.serve.router import _Upstream, rank_replicas


def upstream(name, inflight=0, down_until=0.0):
    record = ReplicaRecord(app="a", serve_id="s", replica_id=name, models=["m"], url=f"http://{name}", node_id="n",
                           node_ip="127.0.0.1", pid=1, engine_pid=2, log_path="", updated_at=0.0)
    return _Upstream(record, inflight=inflight, down_until=down_until)


def names(ups):
    return [u.record.replica_id for u in ups]


def test_idle_replicas_take_turns():
    ups = [upstream("a"), upstream("b")]
    firsts = [names(rank_replicas(ups, turn, now=1.0))[0] for turn in range(6)]
    assert firsts == ["a", "b", "a", "b", "a", "b"]


def test_least_in_flight_first():
    ups = [upstream("a", inflight=3), upstream("b", inflight=1), upstream("c", inflight=2)]
    assert names(rank_replicas(ups, turn=0, now=1.0)) == ["b", "c", "a"]


def test_cooling_down_replica_is_skipped_until_its_time():
    ups = [upstream("a", down_until=10.0), upstream("b")]
    assert names(rank_replicas(ups, turn=0, now=5.0)) == ["b"]
    assert set(names(rank_replicas(ups, turn=0, now=10.0))) == {"a", "b"}
