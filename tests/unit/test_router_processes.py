"""Several router processes of one deployment (deploy.router_processes): routing hints make every process's
cache_aware table agree (real loopback UDP between two routers' request paths), stats merge over processes,
and the default count follows the engines' GPUs and the head's cores."""

from __future__ import annotations

import asyncio
import json

import aiohttp

from flagscale.router import peers
from flagscale.router.peers import RoutingHints, decode_hint, encode_hint, merge_stats
from tests.conftest import bare_router, router_listening
from tests.unit.fakes import healthy_replica, upstream

SECRET = "0123456789abcdef" * 4  # the deployment's peer secret (RouterSpec.peer_secret)
PROMPTS = [f"document {d}: " + "lorem ipsum dolor sit amet " * 20 + f"question {q}" for d in range(6) for q in range(3)]


def test_a_hint_survives_its_encoding():
    keys = [bytes([i]) * 12 for i in range(5)]
    assert decode_hint(encode_hint("serve", "m", "r1", keys)) == ("serve", "m", "r1", keys)
    for bad in (b"no newline", b'["serve","m","r1"]\n' + b"x" * 5):
        try:
            decode_hint(bad)
            raise AssertionError("a malformed hint was taken")
        except ValueError:
            pass


async def _two_routers_route(prompts: list[str], hints: bool) -> list[str]:
    """Two bare routers over the same two replicas, each a separate cache_aware table; prompts alternate between
    them. Returns, per prompt, the replica that served it."""
    seen_a: list = []
    seen_b: list = []
    runner_a, port_a = await healthy_replica(seen_a)
    runner_b, port_b = await healthy_replica(seen_b)
    routers = []
    for _ in range(2):
        router = bare_router([upstream("a", port_a, 0), upstream("b", port_b, 0)], "cache_aware")
        routers.append(router)
    if hints:
        for router in routers:
            router.peers.hints = await RoutingHints.open(router.peers.learn_hint, SECRET)
        routers[0].peers.hints.peers = [routers[1].peers.hints.port]
        routers[1].peers.hints.peers = [routers[0].peers.hints.port]
    served = []
    try:
        async with router_listening(routers[0]) as url0, router_listening(routers[1]) as url1:
            async with aiohttp.ClientSession() as client:
                for i, prompt in enumerate(prompts):
                    before = (len(seen_a), len(seen_b))
                    body = {"model": "m", "prompt": prompt, "max_tokens": 1}
                    async with client.post((url0, url1)[i % 2] + "/v1/completions", json=body) as resp:
                        assert resp.status == 200
                    served.append("a" if len(seen_a) > before[0] else "b")
                    await asyncio.sleep(0.01)  # the hint crosses to the other process
    finally:
        for router in routers:
            if router.peers.hints is not None:
                router.peers.hints.transport.close()
        await runner_a.cleanup()
        await runner_b.cleanup()
    return served


def test_routing_hints_make_two_routers_send_a_prefix_where_it_went_first():
    served = asyncio.run(_two_routers_route(PROMPTS, hints=True))
    for d in range(6):  # each document's three questions went to one replica, whichever router had them
        assert len(set(served[d * 3 : d * 3 + 3])) == 1, served
    assert set(served) == {"a", "b"}  # new documents still spread


def test_without_hints_two_routers_split_a_prefix():
    """The test above can fail: without hints, the routers' tables disagree on where prefixes went."""
    served = asyncio.run(_two_routers_route(PROMPTS, hints=False))
    assert any(len(set(served[d * 3 : d * 3 + 3])) > 1 for d in range(6)), served


def test_stats_of_several_processes_merge():
    one = {
        "pid": 1,
        "inflight": 2,
        "moved": 1,
        "resumed": 0,
        "replicas": {
            "r1": {
                "served": 5,
                "inflight": 2,
                "prefill_queue_chars": 700,
                "migrations": 1,
                "circuit": "closed",
                "prefix_blocks": 10,
            }
        },
    }
    two = {
        "pid": 2,
        "inflight": 1,
        "moved": 0,
        "resumed": 1,
        "draining": True,
        "replicas": {
            "r1": {
                "served": 3,
                "inflight": 1,
                "prefill_queue_chars": 300,
                "migrations": 0,
                "circuit": "open",
                "prefix_blocks": 12,
            },
            "r2": {"served": 4, "inflight": 0, "migrations": 0, "circuit": "closed"},
        },
    }
    merged = merge_stats({"h:1": one, "h:2": two})
    assert (merged["inflight"], merged["moved"], merged["resumed"]) == (3, 1, 1)
    assert merged["replicas"]["r1"] == {
        "served": 8,
        "inflight": 3,
        "prefill_queue_chars": 1000,  # the replica's queue as all the processes sent it
        "migrations": 1,
        "circuit": "open",
        "prefix_blocks": 12,
    }
    assert merged["replicas"]["r2"]["served"] == 4
    assert merged["processes"] == {
        "h:1": {"pid": 1, "inflight": 2, "served": 5, "moved": 1, "resumed": 0, "draining": False},
        "h:2": {"pid": 2, "inflight": 1, "served": 7, "moved": 0, "resumed": 1, "draining": True},
    }
    json.dumps(merged)  # status prints it


def test_a_drain_request_concerns_processes_started_before_it(monkeypatch):
    store: dict = {}
    monkeypatch.setattr(peers, "kv_put", lambda key, value, namespace: store.__setitem__(key, value))
    monkeypatch.setattr(peers, "kv_get", lambda key, namespace: store.get(key))
    peers.request_drain("app", timeout_s=30)
    set_at = json.loads(store[b"router-drain/app"])["set_at"]
    assert peers.drain_requested("app", started_at=set_at - 5)
    assert not peers.drain_requested("app", started_at=set_at + 1)  # a later deployment of the name
    assert not peers.drain_requested("other", started_at=0)


def test_default_router_processes():
    from types import SimpleNamespace

    from flagscale.plan import default_router_processes

    def engine(replicas, gpus):
        return SimpleNamespace(most_replicas=replicas, ray_actor_options={"num_cpus": 1, "num_gpus": gpus})

    assert default_router_processes([engine(2, 0)], head_cpus=2) == 1  # CPU engines
    assert default_router_processes([engine(8, 1)], head_cpus=128) == 8  # one per GPU
    assert default_router_processes([engine(2, 0.5)], head_cpus=16) == 1  # two replicas sharing one GPU
    assert default_router_processes([engine(8, 1)], head_cpus=16) == 4  # a quarter of the cores


def test_metrics_on_one_process_carry_every_processs_series():
    import time

    from prometheus_client.parser import text_string_to_metric_families

    async def scrape() -> str:
        router = bare_router([], "least_load")
        router.metrics.requests.labels("m", "200").inc(3)
        other = bare_router([], "least_load")
        other.metrics.requests.labels("m", "200").inc(5)
        peer = peers.PeerReport("h:2", 2, 0.0, time.time(), {}, other.metrics.text().decode())
        router.peers.peer_reports = [peer]  # (stale ones are left out when read: test_one_clock.py)
        async with router_listening(router) as url, aiohttp.ClientSession() as client:
            async with client.get(url + "/metrics") as resp:
                return await resp.text()

    samples = [
        s
        for family in text_string_to_metric_families(asyncio.run(scrape()))
        for s in family.samples
        if s.name == "flagscale_router_requests_total"
    ]
    by_process = {s.labels["router_process"]: s.value for s in samples}
    assert by_process == {peers.this_process(): 3.0, "h:2": 5.0}


# ---- the hints are authenticated, and only feed what this process knows (issue 34, item 6) ----


def test_only_hints_signed_with_the_deployments_secret_are_taken():
    """Real loopback UDP: a peer with the secret is heard; one with another secret, an unsigned datagram in the
    old format and a truncated one are dropped and counted."""

    async def main():
        heard: list = []
        receiver = await RoutingHints.open(lambda *hint: heard.append(hint), SECRET)
        peer = await RoutingHints.open(lambda *hint: None, SECRET)
        stranger = await RoutingHints.open(lambda *hint: None, "another deployment's secret" * 2)
        keys = [b"k" * 12, b"l" * 12]
        try:
            for sender in (peer, stranger):
                sender.peers = [receiver.port]
                sender.send("serve", "m", "r1", keys)
            raw = encode_hint("serve", "m", "r9", keys)
            stranger.transport.sendto(raw, ("127.0.0.1", receiver.port))
            stranger.transport.sendto(peer.sign(raw)[:20], ("127.0.0.1", receiver.port))
            for _ in range(100):
                if len(heard) + receiver.dropped >= 4:
                    break
                await asyncio.sleep(0.01)
        finally:
            for hints in (receiver, peer, stranger):
                hints.transport.close()
        return heard, receiver.dropped

    heard, dropped = asyncio.run(main())
    assert heard == [("serve", "m", "r1", [b"k" * 12, b"l" * 12])]
    assert dropped == 3


def test_hints_naming_replicas_this_router_does_not_know_are_dropped():
    router = bare_router([upstream("a", 1, 0), upstream("b", 2, 0)], "cache_aware")
    keys = [bytes([i]) * 12 for i in range(3)]
    router.peers.learn_hint("serve", "m", "a", keys)
    for pool, model, replica_id in (("serve", "m", "ghost"), ("serve", "other", "a"), ("prefill", "m", "b")):
        router.peers.learn_hint(pool, model, replica_id, keys)
    table = router.replicas.policies["m"].table
    assert {r for holders in table.blocks.values() for r in holders} == {"a"}
    assert table.match(keys) == {"a": 3}
    many = [i.to_bytes(12, "big") for i in range(peers.HINT_MAX_KEYS + 1)]
    try:  # a hint is bounded: more keys than one hint carries is not a hint
        decode_hint(b'["serve","m","a"]\n' + b"".join(many))
        raise AssertionError("an oversized hint was taken")
    except ValueError:
        pass


def test_the_peer_secret_is_stable_private_and_never_shown(tmp_path):
    from flagscale.router.spec import RouterSpec

    secret = peers.secret_of(tmp_path)
    path = tmp_path / peers.SECRET_FILE
    assert len(secret) >= 32 and path.stat().st_mode & 0o777 == 0o600
    path.chmod(0o644)
    assert peers.secret_of(tmp_path) == secret  # the same for every router process, update and restart
    assert path.stat().st_mode & 0o777 == 0o600
    assert peers.secret_of(tmp_path / "other") != secret  # per deployment
    spec = RouterSpec(app="a", host="127.0.0.1", port=1, models={"m": "s"}, peer_secret=secret)
    assert secret not in repr(spec) and secret not in json.dumps(spec.user_config())


def test_each_process_admits_its_share_of_every_limit():
    """N router processes share the port, and the kernel spreads clients over them: each admits 1/N of a replica's
    max_ongoing_requests, of the queue and of the graph route, so that together they admit what one would."""
    from dataclasses import replace

    from flagscale.config.routing import Admission
    from flagscale.replica.registry import ReplicaRecord
    from flagscale.router.replicas import Upstream

    router = bare_router([], "round_robin")
    record = ReplicaRecord("a", "s", "r", ["m"], "http://127.0.0.1:1", "n", "127.0.0.1", 1, 2, "", 0.0)
    router.spec = replace(
        router.spec, max_ongoing={"s": 9}, admission=Admission(max_queued_requests=5), graph_max_ongoing=3
    )
    assert router._max_ongoing(Upstream(record)) == 9
    router.spec = replace(router.spec, processes=2)
    assert router._max_ongoing(Upstream(record)) == 5  # rounded up: never 0
    assert router.spec.share(router.spec.admission.max_queued_requests) == 3
    assert router.spec.share(1) == 1
    assert "processes" in router.spec.user_config()  # a scale of the router deployment reaches running routers


def test_the_graph_route_answers_503_beyond_its_share_of_requests_in_flight():
    """The graph route has a bound too: the driver's max_ongoing_requests, shared by the router processes."""
    from dataclasses import replace

    release = asyncio.Event()
    started = []

    class Driver:
        class run:  # noqa: N801 - stands in for a DeploymentHandle's method
            @staticmethod
            async def remote(payload, with_trace):
                started.append(payload)
                await release.wait()
                return {"status": 200, "result": {"ok": True}}

    router = bare_router([], "round_robin")
    router.frontend.graph = Driver()
    router.spec = replace(router.spec, graph_route="/graph", graph_max_ongoing=4, processes=2)

    async def main():
        async with router_listening(router) as url, aiohttp.ClientSession() as client:
            held = [asyncio.create_task(client.post(url + "/graph", json={"i": i})) for i in range(2)]
            async with asyncio.timeout(30):  # bounded: both requests reach the driver
                while len(started) < 2:
                    await asyncio.sleep(0.01)
            async with client.post(url + "/graph", json={"i": 2}) as over:
                assert over.status == 503 and over.headers["Retry-After"], await over.text()
                assert "requests in flight" in (await over.json())["error"]["message"]
            release.set()
            for task in held:
                async with await task as answer:
                    assert answer.status == 200 and await answer.json() == {"ok": True}

    asyncio.run(main())


def test_a_stopped_router_process_withdraws_its_report_and_a_stop_removes_every_key(monkeypatch):
    """Serve stopping a router process (__del__) takes its report out of the key-value store at once; a stop's
    peers.withdraw_all removes every process's report and the drain mark (issue 56)."""
    store = {}
    monkeypatch.setattr(peers, "kv_put", lambda key, value, namespace: store.__setitem__(key, value))
    monkeypatch.setattr(peers, "kv_del", lambda key, namespace: store.pop(key, None))
    monkeypatch.setattr(peers, "kv_list", lambda prefix, namespace: [k for k in store if k.startswith(prefix)])
    router = bare_router([], "least_load")
    router.peers.sharing = True
    for process in (router.peers.process, "other:1"):
        peers.publish("a", peers.PeerReport(process, pid=1, started_at=0.0, updated_at=0.0, stats={}, metrics=""))
    peers.request_drain("a", 30)
    router.__del__()
    assert sorted(store) == [b"router-drain/a", b"routers/a/other:1"]
    peers.withdraw_all("a")
    assert store == {}
