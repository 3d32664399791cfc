"""Which upstream failures the router retries on another replica, on real sockets: a refused connection
(nothing was sent; the circuit opens at once), and a replica that took the request and dropped the connection
before answering (the client has nothing yet, and running an inference request again has no side effect)."""

from __future__ import annotations

import asyncio
import threading
import time

import aiohttp

from flagscale.net import free_port
from flagscale.router.replicas import Upstream as _Upstream
from tests.conftest import bare_router, replica_record, router_listening
from tests.unit.fakes import dropping_replica, healthy_replica, upstream


async def through_router(upstreams: list[_Upstream]) -> tuple[int, dict]:
    async with router_listening(bare_router(upstreams, "least_load")) as url, aiohttp.ClientSession() as client:
        async with client.post(f"{url}/v1/completions", json={"model": "m", "prompt": "x"}) as r:
            return r.status, await r.json()


def test_refused_connection_goes_to_the_next_replica():
    async def main():
        seen: list = []
        runner, port = await healthy_replica(seen)
        refused = upstream("refused", free_port(), sent=0)  # nothing listens there
        good = upstream("good", port, sent=1)
        try:
            status, body = await through_router([refused, good])
        finally:
            await runner.cleanup()
        assert status == 200 and body["choices"][0]["text"] == "ok"
        assert seen == [{"model": "m", "prompt": "x"}]
        assert refused.breaker.state() == "open" and good.breaker.state() == "closed"

    asyncio.run(main())


def test_request_dropped_before_an_answer_goes_to_another_replica():
    async def main():
        dropped_seen: list = []
        good_seen: list = []
        dropper, dropper_port = await dropping_replica(dropped_seen)
        runner, good_port = await healthy_replica(good_seen)
        dropping = upstream("dropping", dropper_port, sent=0)
        good = upstream("good", good_port, sent=1)
        try:
            status, body = await through_router([dropping, good])
        finally:
            dropper.close()
            await runner.cleanup()
        assert status == 200 and body["choices"][0]["text"] == "ok"
        assert dropped_seen == [{"model": "m", "prompt": "x"}]  # the request did reach that replica ...
        assert good_seen == [{"model": "m", "prompt": "x"}]  # ... and was answered by the other one
        assert dropping.breaker.failures == 1 and dropping.breaker.state() == "closed"  # 1 of BREAKER_FAILURES
        assert dropping.migrations == 1

    asyncio.run(main())


def test_request_dropped_by_every_replica_is_a_502_naming_the_last():
    async def main():
        seen: list = []
        servers = [await dropping_replica(seen) for _ in range(2)]
        ups = [upstream(f"dropping{i}", port, sent=i) for i, (_, port) in enumerate(servers)]
        try:
            status, body = await through_router(ups)
        finally:
            for server, _ in servers:
                server.close()
        assert status == 502 and "dropping1" in body["error"]["message"], body
        assert len(seen) == 2  # each replica got it once

    asyncio.run(main())


def test_a_request_that_finds_no_replica_has_the_registry_read_again_and_takes_one_that_just_joined(monkeypatch):
    """The registry has a replica the router's table does not have yet (it joined since the last refresh_s tick,
    and `status` already shows it): the request gets it, not a 503."""
    from flagscale.replica import registry

    async def main():
        seen: list = []
        runner, port = await healthy_replica(seen)
        joined = replica_record("joined", f"http://127.0.0.1:{port}")
        reads: list[str] = []
        monkeypatch.setattr(registry, "list_replicas", lambda app: reads.append(app) or [joined])
        try:
            status, body = await through_router([])  # the table as last read: no replica of "m"
        finally:
            await runner.cleanup()
        assert status == 200 and body["choices"][0]["text"] == "ok" and seen, body
        assert reads == ["a"]

    asyncio.run(main())


def test_requests_for_a_model_without_replicas_share_the_registry_reads_and_get_a_503(monkeypatch):
    from flagscale.replica import registry

    async def main():
        reads: list[str] = []

        def slow_empty_read(app):
            reads.append(app)
            time.sleep(0.1)
            return []

        monkeypatch.setattr(registry, "list_replicas", slow_empty_read)
        async with router_listening(bare_router([], "least_load")) as url, aiohttp.ClientSession() as client:

            async def one() -> tuple[int, str]:
                async with client.post(f"{url}/v1/completions", json={"model": "m", "prompt": "x"}) as r:
                    return r.status, (await r.json())["error"]["message"]

            answers = await asyncio.gather(*(one() for _ in range(20)))
        assert answers == [(503, "no ready replica for model 'm'")] * 20
        assert 1 <= len(reads) <= 2, reads  # 20 requests at once: one read, or one begun before the rest asked

    asyncio.run(main())


def test_a_registry_that_does_not_answer_holds_a_request_without_replicas_a_bounded_time(monkeypatch):
    from flagscale.replica import registry
    from flagscale.router import router as router_module

    hung = threading.Event()
    monkeypatch.setattr(registry, "list_replicas", lambda app: hung.wait(3) or [])
    monkeypatch.setattr(router_module, "MISS_REFRESH_TIMEOUT_S", 0.3)

    async def main():
        async with router_listening(bare_router([], "least_load")) as url, aiohttp.ClientSession() as client:
            began = time.monotonic()
            async with client.post(f"{url}/v1/completions", json={"model": "m", "prompt": "x"}) as r:
                return r.status, time.monotonic() - began

    try:
        status, took = asyncio.run(main())
    finally:
        hung.set()
    assert status == 503 and took < 2, (status, took)  # the read hangs 3 s
