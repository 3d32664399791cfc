"""Failover through the router on real sockets, against small fake engines that speak vLLM's streaming format
(token ids included when asked) and can die part-way: a request whose replica fails before answering goes to
another replica, a stream that breaks off goes on from another replica exactly where it stopped (same id, the
same tokens an unbroken run gives), and when that is not possible the stream ends with a clean error event."""

from __future__ import annotations

import asyncio
import json

import aiohttp
from aiohttp import web

from flagscale.config.routing import RoutingSpec
from flagscale.router.policies import make_policy
from flagscale.router.resume import ClientStream, unresumable
from tests.conftest import bare_router, router_listening, serve
from tests.unit.test_router_retry import started_upstreams


def next_token(last: int) -> int:
    return (last * 7 + 3) % 97


def tokenize(prompt) -> list[int]:
    return list(prompt) if isinstance(prompt, list) else [ord(c) % 97 for c in prompt]


def greedy(prompt_ids: list[int], n: int) -> list[int]:
    out, last = [], prompt_ids[-1]
    for _ in range(n):
        last = next_token(last)
        out.append(last)
    return out


def text_of(ids: list[int]) -> str:
    return "".join(f"<{t}>" for t in ids)


def part_of_a_character(token: int) -> bool:
    """The toy model's byte-fallback tokens: they stream no text until the next token completes it."""
    return token % 5 == 0


class FakeEngine:
    """Streams `max_tokens` tokens of the toy model above; `die_after` tokens: the connection is cut there.
    Like vLLM, a token that is part of a character streams empty text, and a prompt of token ids that ends
    part-way through a character gets the whole prompt's text streamed back with the first token."""

    def __init__(self, name: str, die_after: int | None = None, status: int = 200):
        self.name, self.die_after, self.status = name, die_after, status
        self.bodies: list[tuple[str, dict]] = []

    async def start(self) -> str:
        app = web.Application()
        app.router.add_post("/v1/completions", self.handle)
        app.router.add_post("/v1/chat/completions", self.handle)
        self.runner, port = await serve(app)
        return f"http://127.0.0.1:{port}"

    async def handle(self, request: web.Request):
        body = await request.json()
        self.bodies.append((request.path, body))
        if self.status != 200:
            return web.json_response({"error": {"message": f"{self.name} failed"}}, status=self.status)
        chat = request.path.endswith("chat/completions")
        prompt_ids = [1, 2] + [len(m["content"]) for m in body["messages"]] if chat else tokenize(body["prompt"])
        limit = body.get("max_completion_tokens", body.get("max_tokens", None if chat else 16))
        ids = greedy(prompt_ids, limit or 8)
        with_ids = bool(body.get("return_token_ids"))
        rid, created = f"{'chatcmpl' if chat else 'cmpl'}-{self.name}-{len(self.bodies)}", 1000 + len(self.bodies)
        if not body.get("stream"):
            return web.json_response({"id": rid, "choices": [{"index": 0, "text": text_of(ids)}]})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)

        async def send(obj):
            await response.write(b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n")

        obj_kind = "chat.completion.chunk" if chat else "text_completion"
        if chat:
            first = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            await send(
                {"id": rid, "object": obj_kind, "created": created, "model": body["model"], "choices": [first]}
                | {"prompt_token_ids": prompt_ids if with_ids else None}
            )
        held = (
            text_of(prompt_ids) if isinstance(body.get("prompt"), list) and part_of_a_character(prompt_ids[-1]) else ""
        )
        for i, token in enumerate(ids):
            if self.die_after is not None and i == self.die_after:
                await response.write(b'data: {"id":"partial')  # half an event, then the connection is cut
                request.transport.abort()
                return response
            finish = "length" if i == len(ids) - 1 else None
            held += text_of([token])
            text, held = ("", held) if part_of_a_character(token) and not finish else (held, "")
            if chat:
                choice = {"index": 0, "delta": {"content": text}, "logprobs": None}
                choice |= {"finish_reason": finish, "token_ids": [token] if with_ids else None}
            else:
                choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
                choice |= {"stop_reason": None, "prompt_token_ids": prompt_ids if (with_ids and i == 0) else None}
                choice |= {"token_ids": [token] if with_ids else None}
            await send({"id": rid, "object": obj_kind, "created": created, "model": body["model"], "choices": [choice]})
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = {"prompt_tokens": len(prompt_ids), "completion_tokens": len(ids)}
            usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
            await send(
                {"id": rid, "object": obj_kind, "created": created, "model": body["model"], "choices": []}
                | {"usage": usage}
            )
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


async def through_router(engines: list[FakeEngine], path: str, body: dict, max_migrations: int = 2):
    """Send one request through a router over `engines` (tried in this order); returns status and raw bytes."""
    router = bare_router(await started_upstreams(engines), "least_load")
    router.spec.routing["m"] = RoutingSpec.of("least_load", max_migrations=max_migrations)
    router.policies["m"] = make_policy(router.spec.routing["m"])
    try:
        async with router_listening(router) as url, aiohttp.ClientSession() as client:
            async with client.post(f"{url}{path}", json=body) as resp:
                return resp.status, await resp.read(), router
    finally:
        for engine in engines:
            await engine.runner.cleanup()


def events(raw: bytes) -> list:
    out = []
    for event in raw.split(b"\n\n"):
        if event.startswith(b"data: "):
            payload = event[6:]
            out.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    return out


def streamed_text(raw: bytes, chat: bool = False) -> str:
    parts = []
    for ev in events(raw):
        if isinstance(ev, dict):
            for choice in ev.get("choices", []):
                parts.append((choice.get("delta") or {}).get("content") or "" if chat else choice["text"])
    return "".join(parts)


def test_completion_stream_resumes_on_another_replica_exactly_where_it_broke_off():
    body = {"model": "m", "prompt": "hello", "max_tokens": 12, "stream": True, "temperature": 0}
    dying, spare = FakeEngine("dying", die_after=5), FakeEngine("spare")
    status, raw, router = asyncio.run(through_router([dying, spare], "/v1/completions", body))
    assert status == 200
    evs = events(raw)
    assert evs[-1] == "[DONE]" and not any("error" in e for e in evs if isinstance(e, dict))
    assert streamed_text(raw) == text_of(greedy(tokenize("hello"), 12))  # what an unbroken run streams
    chunks = [e for e in evs if isinstance(e, dict)]
    assert {c["id"] for c in chunks} == {"cmpl-dying-1"} and {c["created"] for c in chunks} == {1001}
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    # the client did not ask for token ids: none reach it
    assert all(c["choices"][0]["token_ids"] is None and c["choices"][0]["prompt_token_ids"] is None for c in chunks)
    # the spare got the prompt's tokens plus the 5 generated, for the 7 still missing
    path, resumed = spare.bodies[0]
    assert path == "/v1/completions"
    assert resumed["prompt"] == tokenize("hello") + greedy(tokenize("hello"), 5) and resumed["max_tokens"] == 7
    assert dying.bodies[0][1]["return_token_ids"] is True and "return_token_ids" not in body
    stats = router.collect_stats()
    assert stats["moved"] == 1 and stats["resumed"] == 1 and stats["replicas"]["dying"]["migrations"] == 1


def test_chat_stream_resumes_as_chat_chunks_with_usage_over_both_parts():
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi there"}],
        "max_tokens": 10,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    dying, spare = FakeEngine("dying", die_after=4), FakeEngine("spare")
    status, raw, _ = asyncio.run(through_router([dying, spare], "/v1/chat/completions", body))
    assert status == 200
    prompt_ids = [1, 2, len("hi there")]
    assert streamed_text(raw, chat=True) == text_of(greedy(prompt_ids, 10))
    chunks = [e for e in events(raw) if isinstance(e, dict)]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"} and {c["id"] for c in chunks} == {
        "chatcmpl-dying-1"
    }
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant" and chunks[0]["prompt_token_ids"] is None
    assert [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"] == "length"]
    assert chunks[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 10, "total_tokens": 13}
    path, resumed = spare.bodies[0]
    assert path == "/v1/completions" and resumed["prompt"] == prompt_ids + greedy(prompt_ids, 4)
    assert resumed["max_tokens"] == 6 and resumed["stream_options"] == {"include_usage": True}


def test_client_asking_for_token_ids_gets_them_across_the_resume():
    body = {"model": "m", "prompt": "abc", "max_tokens": 6, "stream": True, "return_token_ids": True}
    status, raw, _ = asyncio.run(
        through_router([FakeEngine("a", die_after=2), FakeEngine("b")], "/v1/completions", body)
    )
    ids = [t for e in events(raw) if isinstance(e, dict) for t in e["choices"][0]["token_ids"]]
    assert status == 200 and ids == greedy(tokenize("abc"), 6)


def test_stream_broken_part_way_through_a_character_resumes_from_its_last_whole_one():
    body = {"model": "m", "prompt": "zz", "max_tokens": 12, "stream": True, "temperature": 0}
    tokens = greedy(tokenize("zz"), 12)
    assert part_of_a_character(tokens[1]) and not part_of_a_character(tokens[0])
    dying, spare = FakeEngine("dying", die_after=2), FakeEngine("spare")  # cut after the half character
    status, raw, _ = asyncio.run(through_router([dying, spare], "/v1/completions", body))
    assert status == 200 and streamed_text(raw) == text_of(tokens)  # no prompt echoed, nothing twice
    assert spare.bodies[0][1]["prompt"] == tokenize("zz") + tokens[:1] and spare.bodies[0][1]["max_tokens"] == 11

    with_ids = {**body, "return_token_ids": True}
    status, raw, _ = asyncio.run(
        through_router([FakeEngine("a", die_after=2), FakeEngine("b")], "/v1/completions", with_ids)
    )
    ids = [t for e in events(raw) if isinstance(e, dict) for t in e["choices"][0]["token_ids"]]
    assert status == 200 and ids == tokens and streamed_text(raw) == text_of(tokens)


def test_resumed_stream_does_not_send_again_the_text_the_client_has():
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi there"}], "max_tokens": 10, "stream": True}
    prompt_ids = [1, 2, len("hi there")]
    tokens = greedy(prompt_ids, 10)
    stream = ClientStream("/v1/chat/completions", chat)
    stream.first_request(b"")
    first = {"id": "c", "created": 1, "model": "m", "prompt_token_ids": prompt_ids}
    role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "token_ids": []}
    stream.feed(b"data: " + json.dumps(first | {"choices": [role]}).encode() + b"\n\n")
    # one chunk of two tokens whose text is whole: which token completed it is unknown, so both go again
    two = {"index": 0, "delta": {"content": "ab"}, "token_ids": tokens[:2], "finish_reason": None}
    assert b'"ab"' in stream.feed(b"data: " + json.dumps({"id": "c", "choices": [two]}).encode() + b"\n\n")
    path, body = stream.resume_request()
    assert json.loads(body)["prompt"] == prompt_ids and json.loads(body)["max_tokens"] == 10
    again = [{"text": "a", "token_ids": tokens[:1]}, {"text": "bc", "token_ids": tokens[1:2]}]
    out = [stream.feed(b"data: " + json.dumps({"id": "x", "choices": [c]}).encode() + b"\n\n") for c in again]
    assert out[0] == b"" and json.loads(out[1][6:])["choices"][0]["delta"] == {"content": "c"}
    assert stream.generated == tokens[:2] and stream.clean == 2


def test_stream_that_cannot_move_ends_with_an_error_event_not_a_cut():
    body = {"model": "m", "prompt": "hello", "max_tokens": 12, "stream": True}
    status, raw, _ = asyncio.run(
        through_router([FakeEngine("dying", die_after=3), FakeEngine("spare")], "/v1/completions", body, 0)
    )
    evs = events(raw)
    assert status == 200 and evs[-1] == "[DONE]" and "broke off the stream" in evs[-2]["error"]["message"]
    assert streamed_text(b"\n\n".join(raw.split(b"\n\n")[:3])) == text_of(greedy(tokenize("hello"), 3))


def test_unresumable_stream_gets_an_error_event_and_is_not_run_twice():
    body = {"model": "m", "prompt": "hello", "max_tokens": 12, "stream": True, "stop": ["<5>"]}
    spare = FakeEngine("spare")
    status, raw, _ = asyncio.run(through_router([FakeEngine("dying", die_after=3), spare], "/v1/completions", body))
    assert status == 200 and "cannot be resumed" in events(raw)[-2]["error"]["message"]
    assert spare.bodies == []
    assert unresumable("/v1/completions", body) == "stop strings"


def test_replica_failing_before_answering_hands_the_request_to_another():
    body = {"model": "m", "prompt": "x", "max_tokens": 3}
    failing, good = FakeEngine("failing", status=500), FakeEngine("good")
    status, raw, router = asyncio.run(through_router([failing, good], "/v1/completions", body))
    assert status == 200 and json.loads(raw)["choices"][0]["text"] == text_of(greedy(tokenize("x"), 3))
    assert len(failing.bodies) == 1 and len(good.bodies) == 1
    assert router.collect_stats()["replicas"]["failing"]["migrations"] == 1


def test_every_replica_failing_returns_the_last_answer_each_tried_once():
    engines = [FakeEngine(f"e{i}", status=503) for i in range(3)]
    status, raw, _ = asyncio.run(through_router(engines, "/v1/completions", {"model": "m", "prompt": "x"}))
    assert status == 503 and [len(e.bodies) for e in engines] == [1, 1, 1]


def test_stripping_token_ids_gives_back_the_bytes_the_engine_sends_without_them():
    plain = (
        b'data: {"id":"cmpl-1","object":"text_completion","created":5,"model":"m","choices":[{"index":0,'
        b'"text":"\xc3\xa9","logprobs":null,"finish_reason":null,"stop_reason":null,"prompt_token_ids":null,'
        b'"token_ids":null}]}\n\n'
    )
    with_ids = plain.replace(b'"prompt_token_ids":null', b'"prompt_token_ids":[1,2]').replace(
        b'"token_ids":null', b'"token_ids":[7]'
    )
    stream = ClientStream("/v1/completions", {"model": "m", "prompt": "ab", "stream": True})
    assert stream.feed(with_ids[:40]) == b""  # half an event waits for the rest
    assert stream.feed(with_ids[40:]) == plain
    assert stream.prompt_ids == [1, 2] and stream.generated == [7] and stream.can_resume()
