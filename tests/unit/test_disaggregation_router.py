"""The router's disaggregated path on real sockets, against fake engines: the prompt goes to a prefill replica
(max_tokens 1, not streamed, asked to keep its KV cache for remote decode), its kv_transfer_params go with the
client's request to a decode replica, whose answer streams back; a failing prefill replica hands the prompt to
another; a decode replica failing before the client got anything hands it to another decode replica, which
computes the prompt itself (no KV transfer parameters)."""

from __future__ import annotations

import asyncio
import json

from aiohttp import web

from flagscale.router.pd import REMOTE_DECODE
from tests.conftest import serve
from tests.unit.fakes import FakeEngine, events, greedy, streamed_text, text_of, through_pd_router, tokenize


class FakePrefill:
    def __init__(self, name: str, status: int = 200):
        self.name, self.status, self.bodies = name, status, []

    async def start(self) -> str:
        async def complete(request):
            body = await request.json()
            self.bodies.append(body)
            if self.status != 200:
                return web.json_response({"error": {"message": "prefill failed"}}, status=self.status)
            return web.json_response({"choices": [{"text": "x"}], "kv_transfer_params": {"from": self.name}})

        app = web.Application()
        app.router.add_post("/v1/completions", complete)
        app.router.add_post("/v1/chat/completions", complete)
        self.runner, port = await serve(app)
        return f"http://127.0.0.1:{port}"


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
