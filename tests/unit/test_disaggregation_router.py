"""The router's disaggregated path on real sockets, against fake engines: the prompt goes to a prefill replica
(max_tokens 1, not streamed, asked to keep its KV cache for remote decode), its kv_transfer_params go with the
client's request to a decode replica, whose answer streams back; a failing prefill replica hands the prompt to
another; a decode replica failing before the client got anything hands it to another decode replica, which
computes the prompt itself (no KV transfer parameters)."""

from __future__ import annotations

import asyncio
import json

import aiohttp

from flagscale.router.pd import REMOTE_DECODE
from tests.conftest import router_listening
from tests.unit.fakes import (
    FakeEngine,
    FakePrefill,
    events,
    greedy,
    pd_router,
    streamed_text,
    text_of,
    through_pd_router,
    tokenize,
)


def test_prompt_is_prefilled_then_decoded_with_the_kv_transfer_parameters():
    body = {"model": "m", "prompt": "hello", "max_tokens": 6, "stream": True, "stream_options": {"include_usage": True}}
    prefill, decode = FakePrefill("p0"), FakeEngine("d0")
    status, raw = asyncio.run(through_pd_router([prefill], [decode], "/v1/completions", body))
    assert status == 200 and streamed_text(raw) == text_of(greedy(tokenize("hello"), 6))
    (sent,) = prefill.bodies
    assert sent["max_tokens"] == 1 and sent["stream"] is False and "stream_options" not in sent
    assert sent["kv_transfer_params"] == REMOTE_DECODE and sent["prompt"] == "hello"
    ((_, decoded),) = decode.bodies
    assert decoded["kv_transfer_params"] == {"from": "p0"} and decoded["max_tokens"] == 6 and decoded["stream"]


def test_failing_prefill_replica_hands_the_prompt_to_another():
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 4}
    bad, good, decode = FakePrefill("bad", status=500), FakePrefill("good"), FakeEngine("d0")
    status, raw = asyncio.run(through_pd_router([bad, good], [decode], "/v1/chat/completions", body))
    assert status == 200, raw
    assert len(bad.bodies) == 1 and good.bodies[0]["max_completion_tokens"] == 1
    assert decode.bodies[0][1]["kv_transfer_params"] == {"from": "good"}


def test_prefill_4xx_is_the_clients_answer_and_no_decode_runs():
    prefill, decode = FakePrefill("p0", status=400), FakeEngine("d0")
    status, raw = asyncio.run(through_pd_router([prefill], [decode], "/v1/completions", {"model": "m", "prompt": "x"}))
    assert status == 400 and json.loads(raw)["error"]["message"] == "prefill failed" and decode.bodies == []


def test_decode_replica_failing_first_hands_the_request_over_without_kv_parameters():
    body = {"model": "m", "prompt": "hello", "max_tokens": 5, "stream": True}
    prefill, dying, spare = FakePrefill("p0"), FakeEngine("dying", die_after=0), FakeEngine("spare")
    status, raw = asyncio.run(through_pd_router([prefill], [dying, spare], "/v1/completions", body))
    assert status == 200 and streamed_text(raw) == text_of(greedy(tokenize("hello"), 5))
    assert events(raw)[-1] == "[DONE]"
    assert dying.bodies[0][1]["kv_transfer_params"] == {"from": "p0"}
    assert "kv_transfer_params" not in spare.bodies[0][1]


def test_prefill_pool_gone_decodes_without_prefill_counted_and_said_in_health():
    async def main():
        router, _ = await pd_router([], [decode := FakeEngine("d0")])
        try:
            async with router_listening(router) as url, aiohttp.ClientSession() as client:
                body = {"model": "m", "prompt": "hello", "max_tokens": 5, "stream": True}
                async with client.post(f"{url}/v1/completions", json=body) as resp:
                    status, raw = resp.status, await resp.read()
                health = await router.frontend.health(None)
            return status, raw, decode.bodies, router.collect_stats(), health
        finally:
            await decode.runner.cleanup()

    status, raw, bodies, stats, health = asyncio.run(main())
    assert status == 200 and streamed_text(raw) == text_of(greedy(tokenize("hello"), 5))  # not 503
    ((_, decoded),) = bodies
    assert "kv_transfer_params" not in decoded  # the decode replica computed the prompt itself
    assert stats["decode_only"] == 1 and stats["kv_released"] == 0
    assert health.status == 503 and "m (prefill; decoding without it)" in health.text


def test_every_prefill_replica_refusing_falls_back_to_decode_only():
    async def main():
        refusing = FakePrefill("gone")
        router, _ = await pd_router([refusing], [decode := FakeEngine("d0")])
        await refusing.runner.cleanup()  # nothing listens there any more
        try:
            async with router_listening(router) as url, aiohttp.ClientSession() as client:
                body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
                async with client.post(f"{url}/v1/chat/completions", json=body) as resp:
                    return resp.status, await resp.read(), decode.bodies, router.collect_stats()
        finally:
            await decode.runner.cleanup()

    status, raw, bodies, stats = asyncio.run(main())
    assert status == 200, raw
    assert len(bodies) == 1 and "kv_transfer_params" not in bodies[0][1] and stats["decode_only"] == 1


def test_client_hanging_up_between_prefill_and_decode_has_the_kv_blocks_released():
    """The decode hop waits for a free slot (its replica is at max_ongoing_requests) when the client hangs up: the
    prefill's blocks are pulled by a decode replica (one token), not left on the prefill engine."""

    async def main():
        prefill, decode = FakePrefill("p0"), FakeEngine("d0")
        router, (busy,) = await pd_router([prefill], [decode])
        busy.max_ongoing = 0  # (every decode request waits in the router's queue)
        try:
            async with router_listening(router) as url, aiohttp.ClientSession() as client:
                body = {"model": "m", "prompt": "hello", "max_tokens": 50, "stream": True}
                request = asyncio.ensure_future(client.post(f"{url}/v1/completions", json=body))
                await wait_until(lambda: router.admission.waiting, "the decode hop to wait for a slot")
                assert prefill.bodies and not decode.bodies
                request.cancel()  # the client hangs up
                await wait_until(lambda: router.counters.kv_released, "the prefill's KV blocks to be released")
                return decode.bodies, router.collect_stats()
        finally:
            for engine in (prefill, decode):
                await engine.runner.cleanup()

    bodies, stats = asyncio.run(main())
    ((path, released),) = bodies
    assert path == "/v1/completions" and released["kv_transfer_params"] == {"from": "p0"}
    assert released["max_tokens"] == 1 and released["stream"] is False and released["prompt"] == "hello"
    assert stats["kv_released"] == 1 and stats["decode_only"] == 0


def test_a_decode_replica_that_answered_leaves_the_kv_blocks_to_its_engine():
    body = {"model": "m", "prompt": "hello", "max_tokens": 4}
    prefill, decode = FakePrefill("p0"), FakeEngine("d0")
    status, _ = asyncio.run(through_pd_router([prefill], [decode], "/v1/completions", body))
    assert status == 200 and len(decode.bodies) == 1  # no release request after it


async def wait_until(condition, what: str, timeout_s: float = 10.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.02)
