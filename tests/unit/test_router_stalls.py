"""Issue 56: an engine that stops answering (a GPU or NCCL hang, SIGSTOP, a host gone) no longer holds requests for
ever. On real sockets: a fake engine process SIGSTOPped under streaming load with 2 replicas (its streams resume on
the other one, found by the health probe of a silent replica), a fake engine that stops writing mid-stream while
its server still answers (found by the idle bound between two pieces), one silent before its first byte (the
first-byte bound), and GET /v1/models with a frozen replica. A long prefill on a healthy engine is not cut."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import aiohttp
import pytest

from flagscale.net import free_port
from flagscale.router import replicas as replicas_module
from tests.conftest import bare_router, router_listening
from tests.unit.fakes import FakeEngine, greedy, started_upstreams, streamed_text, text_of, tokenize, upstream

ROOT = Path(__file__).resolve().parents[2]
BODY = {"model": "m", "prompt": "hello", "max_tokens": 24, "stream": True, "temperature": 0}
EXPECTED = text_of(greedy(tokenize("hello"), 24))


def with_bounds(router, **bounds):
    router.spec.admission = replace(router.spec.admission, **bounds)
    router.clients.relay.watch.first_byte_s = router.spec.admission.upstream_first_byte_timeout_s
    router.clients.relay.watch.idle_s = router.spec.admission.upstream_idle_timeout_s
    return router


async def stream_all(url: str, n: int, body=BODY) -> list[tuple[int, bytes, float]]:
    async with aiohttp.ClientSession() as client:

        async def one():
            began = time.monotonic()
            async with client.post(f"{url}/v1/completions", json=body) as r:
                return r.status, await r.read(), time.monotonic() - began

        return await asyncio.wait_for(asyncio.gather(*(one() for _ in range(n))), 60)


ENGINE_PROCESS = """
import asyncio, sys
sys.path.insert(0, sys.argv[1])
from tests.unit.fakes import FakeEngine

async def main():
    await FakeEngine("frozen", pace_s=0.05).start(int(sys.argv[2]))
    print("listening", flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


def test_a_sigstopped_engine_under_streaming_load_has_its_streams_resumed_on_the_other_replica(monkeypatch):
    """The engine's whole process stops (SIGSTOP): no FIN, no RST. Its server stops answering /health too, so the
    router gives up on it after QUIET_PROBE_S of silence and a probe's timeout, far within the idle bound."""
    monkeypatch.setattr(replicas_module, "QUIET_PROBE_S", 1.0)
    monkeypatch.setattr(replicas_module, "FROZEN_PROBE_TIMEOUT_S", 1.0)
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-c", ENGINE_PROCESS, str(ROOT), str(port)], stdout=subprocess.PIPE, text=True
    )

    async def main():
        healthy = FakeEngine("healthy", pace_s=0.02)
        (up_healthy,) = await started_upstreams([healthy])
        frozen = upstream("frozen", port, sent=0)  # tried first
        up_healthy.sent = 100
        router = with_bounds(bare_router([frozen, up_healthy], "least_load"), upstream_idle_timeout_s=120)
        router.spec.refresh_s = 0.5
        watch = asyncio.create_task(router._watch_forever())
        try:
            async with router_listening(router) as url:
                streams = asyncio.create_task(stream_all(url, 8))
                for _ in range(1500):  # bounded: 30 s for the streams to reach the replica about to freeze
                    if frozen.inflight >= 4:
                        break
                    await asyncio.sleep(0.02)
                assert frozen.inflight >= 4, "the streams never reached the replica about to freeze"
                await asyncio.sleep(0.3)  # streams under way on the engine
                os.kill(proc.pid, signal.SIGSTOP)
                stopped = time.monotonic()
                results = await streams
                took = time.monotonic() - stopped
                async with aiohttp.ClientSession() as client:  # /v1/models answers with a frozen replica
                    began = time.monotonic()
                    async with client.get(f"{url}/v1/models", timeout=aiohttp.ClientTimeout(total=20)) as r:
                        models = (r.status, time.monotonic() - began)
        finally:
            watch.cancel()
            await healthy.runner.cleanup()
        return results, took, models, router

    try:
        assert proc.stdout.readline().strip() == "listening"
        results, took, models, router = asyncio.run(main())
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.wait(10)
    assert [status for status, _, _ in results] == [200] * 8
    assert all(streamed_text(raw) == EXPECTED for _, raw, _ in results), [streamed_text(r) for _, r, _ in results]
    # the quiet (5 s) plus the unanswered /health probe (5 s) plus a sweep, with room for a busy machine; before
    # the bound, these streams waited for good
    assert took < 20, f"the streams took {took:.1f} s after the SIGSTOP"
    assert router.collect_stats()["resumed"] >= 4
    assert models[0] == 200 and models[1] < 8, models


def test_an_engine_that_stops_writing_mid_stream_is_left_after_the_idle_bound():
    """Its server still answers /health (an engine core hung, the API server alive): the idle bound between two
    pieces of a stream gives up on it, and every stream resumes on the other replica."""

    async def main():
        hung = FakeEngine("hung", freeze_after=5, pace_s=0.01)
        healthy = FakeEngine("healthy", pace_s=0.01)
        ups = await started_upstreams([hung, healthy])
        ups[1].sent = 100
        router = with_bounds(bare_router(ups, "least_load"), upstream_idle_timeout_s=1.5)
        try:
            async with router_listening(router) as url:
                began = time.monotonic()
                results = await stream_all(url, 6)
                took = time.monotonic() - began
        finally:
            for engine in (hung, healthy):
                await engine.runner.cleanup()
        return results, took, router, ups

    results, took, router, ups = asyncio.run(main())
    assert [status for status, _, _ in results] == [200] * 6
    assert all(streamed_text(raw) == EXPECTED for _, raw, _ in results)
    assert took < 8, took
    assert router.collect_stats()["resumed"] >= 1 and ups[0].breaker.opened


def test_a_replica_silent_before_its_first_byte_is_left_after_the_first_byte_bound():
    async def main():
        hung = FakeEngine("hung", freeze_after=0)  # takes the request, sends its head, then nothing
        healthy = FakeEngine("healthy")
        ups = await started_upstreams([hung, healthy])
        ups[1].sent = 100
        router = with_bounds(bare_router(ups, "least_load"), upstream_first_byte_timeout_s=1.5)
        try:
            async with router_listening(router) as url:
                began = time.monotonic()
                ((status, raw, _),) = await stream_all(url, 1)
                took = time.monotonic() - began
        finally:
            for engine in (hung, healthy):
                await engine.runner.cleanup()
        return status, raw, took, hung

    status, raw, took, hung = asyncio.run(main())
    assert status == 200 and streamed_text(raw) == EXPECTED and len(hung.bodies) == 1
    assert 1.4 < took < 6, took


@pytest.mark.parametrize("streamed", [True, False], ids=["streamed", "non-streamed"])
def test_a_long_prefill_on_a_healthy_engine_is_not_cut(monkeypatch, streamed):
    """Silent for longer than the idle bound before its first byte, but within the first-byte bound, and its
    server answers /health: the answer comes from it."""
    monkeypatch.setattr(replicas_module, "QUIET_PROBE_S", 0.5)

    class SlowPrefill(FakeEngine):
        async def handle(self, request):
            await asyncio.sleep(3.0)  # "prefill"
            return await super().handle(request)

    async def main():
        engine = SlowPrefill("slow")
        ups = await started_upstreams([engine])
        router = with_bounds(bare_router(ups, "least_load"), upstream_idle_timeout_s=1.0)
        router.spec.refresh_s = 0.3
        watch = asyncio.create_task(router._watch_forever())
        try:
            async with router_listening(router) as url:
                ((status, raw, _),) = await stream_all(url, 1, {**BODY, "stream": streamed})
        finally:
            watch.cancel()
            await engine.runner.cleanup()
        return status, raw, router

    status, raw, router = asyncio.run(main())
    assert status == 200 and router.collect_stats()["resumed"] == 0 and router.counters.moved == 0
    assert (streamed_text(raw) if streamed else json.loads(raw)["choices"][0]["text"]) == EXPECTED
