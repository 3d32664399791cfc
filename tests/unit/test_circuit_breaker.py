"""The per-replica circuit breaker: its state machine, and through the router on real sockets (4xx passed on
without blaming the replica, 5xx counted, an open replica skipped, a probe readmitting it)."""

from __future__ import annotations

import asyncio
import contextlib
import time

import aiohttp
from aiohttp import web

from flagscale.config.routing import RoutingSpec
from flagscale.net import free_port
from flagscale.router.circuit_breaker import BREAKER_FAILURES, CircuitBreaker, CircuitState
from flagscale.router.policies import make_policy
from tests.conftest import bare_router, router_listening, serve
from tests.unit.fakes import upstream


def test_consecutive_failures_open_the_circuit_then_one_probe_readmits():
    breaker = CircuitBreaker(threshold=3, cooldown_s=5)
    for _ in range(2):
        breaker.failure(now=0.0)
    assert breaker.state(0.0) is CircuitState.CLOSED
    breaker.success()  # a success in between: the count starts again
    for _ in range(2):
        breaker.failure(now=0.0)
    assert breaker.state(0.0) is CircuitState.CLOSED and breaker.allows(0.0)
    breaker.failure(now=1.0)
    assert breaker.state(1.0) is CircuitState.OPEN and not breaker.allows(5.9) and not breaker.begin(5.9)
    assert breaker.state(6.0) is CircuitState.HALF_OPEN and breaker.allows(6.0)
    assert breaker.begin(6.0)  # the probe
    assert not breaker.begin(6.0) and not breaker.allows(6.0)  # only one
    breaker.success()
    assert breaker.state(6.0) is CircuitState.CLOSED and breaker.failures == 0 and breaker.opened == 1


def test_a_failed_probe_opens_the_circuit_again():
    breaker = CircuitBreaker(threshold=3, cooldown_s=5)
    breaker.trip(now=0.0)  # refused connection: open at once
    assert breaker.state(0.0) is CircuitState.OPEN
    assert breaker.begin(5.0)
    breaker.failure(now=5.0)
    assert (
        breaker.state(5.0) is CircuitState.OPEN
        and breaker.state(9.9) is CircuitState.OPEN
        and breaker.state(10.0) is CircuitState.HALF_OPEN
    )
    assert breaker.opened == 2


def test_a_probe_that_ends_without_a_verdict_lets_the_next_request_probe():
    """A request that held the half-open probe and was cancelled, or got an answer that says nothing of the
    replica (a 5xx on a path where the engine does not run the model), hands the probe on."""
    breaker = CircuitBreaker(threshold=3, cooldown_s=5)
    breaker.trip(now=0.0)
    assert breaker.begin(5.0) and not breaker.allows(5.0)
    breaker.release()
    assert breaker.state(5.0) is CircuitState.HALF_OPEN and breaker.begin(5.0)
    assert breaker.failures == 3 and breaker.opened == 1  # no verdict: nothing counted


class Replica:
    """A fake engine whose answers the test sets: status and body per request, /health status."""

    def __init__(self, status: int = 200, health: int = 200):
        self.status, self.health, self.seen = status, health, 0

    async def start(self) -> str:
        async def complete(request):
            self.seen += 1
            await request.read()
            return web.json_response(
                {"error": {"message": f"status {self.status}"}}
                if self.status >= 400
                else {"choices": [{"text": "ok"}]},
                status=self.status,
            )

        async def health(request):
            return web.Response(status=self.health)

        app = web.Application()
        app.router.add_post("/v1/completions", complete)
        app.router.add_get("/health", health)
        self.runner, port = await serve(app)
        return f"http://127.0.0.1:{port}"


class RouterUnderTest:
    def __init__(self, upstreams):
        self.router = bare_router(upstreams, "round_robin")

    async def __aenter__(self):
        self._stack = contextlib.AsyncExitStack()
        self.url = f"{await self._stack.enter_async_context(router_listening(self.router))}/v1/completions"
        self.client = await self._stack.enter_async_context(aiohttp.ClientSession())
        return self

    async def __aexit__(self, *exc):
        await self._stack.aclose()

    async def complete(self) -> tuple[int, dict]:
        async with self.client.post(self.url, json={"model": "m", "prompt": "x"}) as resp:
            return resp.status, await resp.json()


def with_url(name: str, url: str, cooldown_s: float = 5.0):
    up = upstream(name, 0, sent=0)
    up.record.url = url
    up.breaker = CircuitBreaker(cooldown_s=cooldown_s)
    return up


def test_4xx_is_passed_on_and_does_not_mark_the_replica():
    async def main():
        replica = Replica(status=400)
        bad_request = with_url("r", await replica.start())
        try:
            async with RouterUnderTest([bad_request]) as router:
                for _ in range(BREAKER_FAILURES + 2):
                    status, body = await router.complete()
                    assert status == 400 and body["error"]["message"] == "status 400"
        finally:
            await replica.runner.cleanup()
        assert replica.seen == BREAKER_FAILURES + 2  # each sent once, none retried
        assert bad_request.breaker.state() is CircuitState.CLOSED and bad_request.breaker.failures == 0

    asyncio.run(main())


def test_5xx_opens_the_circuit_after_n_in_a_row_and_a_probe_readmits_the_replica():
    async def main():
        failing, healthy = Replica(status=500), Replica()
        bad = with_url("bad", await failing.start(), cooldown_s=0.5)
        good = with_url("good", await healthy.start())
        try:
            async with RouterUnderTest([bad, good]) as router:
                statuses = [(await router.complete())[0] for _ in range(2 * BREAKER_FAILURES)]
                # round robin: every other request went to "bad" first; its 500 sent the request on to "good"
                assert statuses == [200] * (2 * BREAKER_FAILURES)
                assert failing.seen == BREAKER_FAILURES and bad.breaker.state() is CircuitState.OPEN
                assert healthy.seen == 2 * BREAKER_FAILURES
                for _ in range(4):  # open: skipped
                    assert (await router.complete())[0] == 200
                assert failing.seen == BREAKER_FAILURES
                await asyncio.sleep(0.6)
                assert bad.breaker.state() is CircuitState.HALF_OPEN
                failing.status = 200  # it recovered: the next request it is offered is the probe
                for _ in range(2):
                    assert (await router.complete())[0] == 200
                assert failing.seen == BREAKER_FAILURES + 1 and bad.breaker.state() is CircuitState.CLOSED
        finally:
            await failing.runner.cleanup()
            await healthy.runner.cleanup()

    asyncio.run(main())


def test_a_5xx_answer_is_returned_as_is_when_no_other_replica_can_take_the_request():
    async def main():
        failing = Replica(status=500)
        bad = with_url("bad", await failing.start())
        try:
            async with RouterUnderTest([bad]) as router:
                status, body = await router.complete()
        finally:
            await failing.runner.cleanup()
        assert status == 500 and body["error"]["message"] == "status 500" and failing.seen == 1

    asyncio.run(main())


def test_health_probe_readmits_a_half_open_replica_or_keeps_it_out():
    async def main():
        replica = Replica(health=503)
        up = with_url("r", await replica.start(), cooldown_s=0.2)
        up.breaker.trip(time.monotonic())
        try:
            async with RouterUnderTest([up]) as router:
                await router.router._probe_half_open()  # still cooling down: no probe
                assert up.breaker.state() is CircuitState.OPEN and up.breaker.opened == 1
                await asyncio.sleep(0.25)
                await router.router._probe_half_open()  # /health says 503: open again
                assert up.breaker.state() is CircuitState.OPEN and up.breaker.opened == 2
                await asyncio.sleep(0.25)
                replica.health = 200
                await router.router._probe_half_open()
                assert up.breaker.state() is CircuitState.CLOSED
                assert replica.seen == 0  # no client request was used as a probe
        finally:
            await replica.runner.cleanup()

    asyncio.run(main())


def test_refused_connection_is_retried_elsewhere_and_opens_the_circuit_at_once():
    async def main():
        healthy = Replica()
        refused = with_url("refused", f"http://127.0.0.1:{free_port()}")
        good = with_url("good", await healthy.start())
        try:
            async with RouterUnderTest([refused, good]) as router:
                for _ in range(4):
                    assert (await router.complete())[0] == 200
        finally:
            await healthy.runner.cleanup()
        assert healthy.seen == 4 and refused.breaker.state() is CircuitState.OPEN and refused.breaker.opened == 1

    asyncio.run(main())


def test_stats_show_circuit_and_routing_table_per_replica():
    async def main():
        healthy = Replica()
        up = with_url("r", await healthy.start())
        try:
            async with RouterUnderTest([up]) as router:
                router.router.replicas.policies["m"] = make_policy(RoutingSpec.of("cache_aware", prefix_block_chars=1))
                assert (await router.complete())[0] == 200
                return router.router.stats()
        finally:
            await healthy.runner.cleanup()

    stats = asyncio.run(main())
    entry = stats["replicas"]["r"]
    assert entry["served"] == 1 and entry["inflight"] == 0 and entry["circuit"] == "closed"
    assert type(entry["circuit"]) is str  # (stats cross to `status` through Ray and the KV store: plain values)
    assert entry["routing"] == "cache_aware" and entry["prefix_blocks"] == 1  # the prompt "x": one block of 1


def test_an_opened_circuit_waits_for_a_heartbeat_of_the_replica_after_it_opened():
    """The replica publishes only after its own health check (which checks that the engine it started holds the
    port): a circuit opened at T does not go half-open on a heartbeat from before T, even one first read after T.
    The first registry read begun after T finds seq 8 (perhaps published before T); seq 9 was published after it."""
    breaker = CircuitBreaker(threshold=3, cooldown_s=5)
    breaker.heartbeat(7, read_began=time.monotonic() - 1)
    breaker.trip(now=0.0)
    assert breaker.state(6.0) is CircuitState.OPEN and not breaker.allows(6.0) and not breaker.begin(6.0)
    breaker.heartbeat(7, read_began=time.monotonic() - 0.5)  # a read begun before the opening
    breaker.heartbeat(8, read_began=time.monotonic())
    assert breaker.state(6.0) is CircuitState.OPEN
    breaker.heartbeat(8, read_began=time.monotonic())  # (no new heartbeat)
    assert breaker.state(6.0) is CircuitState.OPEN
    breaker.heartbeat(9, read_began=time.monotonic())
    assert breaker.state(6.0) is CircuitState.HALF_OPEN and breaker.begin(6.0)
    breaker.success()
    assert breaker.state(6.0) is CircuitState.CLOSED
