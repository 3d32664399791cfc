"""The router tests' shared doubles (as httpx ships MockTransport): fake engines and replicas on real loopback
sockets, a bare router over them, and readers of what comes back. Every test module takes them from here, never
from another test module.

- replicas: `upstream` (a replica record the router routes to), `started_upstreams`, `healthy_replica` (answers
  every completion), `dropping_replica` (reads the request, then closes the connection);
- the toy model and its engine: `tokenize`, `greedy`, `text_of`, `FakeEngine` (vLLM's streaming format, token ids
  included when asked; it can die part-way or answer an error status);
- one request through a bare router: `through_router` (colocated), `through_pd_router` (prefill, then decode; its
  router alone: `pd_router`);
- reading answers: `events`, `streamed_text`; writing requests byte for byte: `raw_request`, `post_head`.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
from aiohttp import web

from flagscale.config.routing import RoutingSpec
from flagscale.router.policies import make_policy
from flagscale.router.replicas import Upstream as _Upstream
from tests.conftest import bare_router, replica_record, router_listening, serve


def upstream(name: str, port: int, sent: int) -> _Upstream:
    record = replica_record(name, f"http://127.0.0.1:{port}")
    return _Upstream(record, sent=sent)  # fewer sent: tried first


async def started_upstreams(engines) -> list:
    """Each test engine started, as the router's upstream records, in the order given (the first least loaded)."""
    ups = []
    for sent, engine in enumerate(engines):
        up = upstream(engine.name, 0, sent=sent)
        up.record.url = await engine.start()
        up.record.fingerprint = getattr(engine, "fingerprint", "")
        ups.append(up)
    return ups


async def healthy_replica(seen: list) -> tuple[web.AppRunner, int]:
    async def complete(request):
        seen.append(await request.json())
        return web.json_response({"choices": [{"text": "ok"}]})

    app = web.Application()
    app.router.add_post("/v1/completions", complete)
    return await serve(app)


async def dropping_replica(seen: list) -> tuple[asyncio.Server, int]:
    """Reads a whole request, then closes the connection without answering (a replica dying mid-request)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(next(ln.split(b":")[1] for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length")))
        seen.append(json.loads(await reader.readexactly(length)))
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


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
    """Streams `max_tokens` tokens of the toy model above, `pace_s` apart; `die_after` tokens: the connection is
    cut there; `freeze_after` tokens: it stops writing there and keeps the connection open (a hung engine). Like
    vLLM, a token that is part of a character streams empty text, and a prompt of token ids that ends part-way
    through a character gets the whole prompt's text streamed back with the first token. GET /health answers 200."""

    def __init__(
        self,
        name: str,
        die_after: int | None = None,
        status: int = 200,
        pace_s: float = 0.0,
        freeze_after: int | None = None,
        fingerprint: str = "",
    ):
        self.name, self.die_after, self.status = name, die_after, status
        self.fingerprint = fingerprint  # of the model it serves (an update may change it)
        self.pace_s, self.freeze_after = pace_s, freeze_after
        self.bodies: list[tuple[str, dict]] = []
        self.headers: list[dict[str, str]] = []  # each request's headers, as the engine got them

    async def start(self, port: int = 0) -> str:
        app = web.Application()
        app.router.add_post("/v1/completions", self.handle)
        app.router.add_post("/v1/chat/completions", self.handle)
        app.router.add_get("/health", lambda _: web.Response(text="ok"))
        self.runner, port = await serve(app, port=port)
        return f"http://127.0.0.1:{port}"

    async def handle(self, request: web.Request):
        body = await request.json()
        self.bodies.append((request.path, body))
        self.headers.append(dict(request.headers))
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
            if self.freeze_after is not None and i == self.freeze_after:
                while request.transport is not None and not request.transport.is_closing():
                    await asyncio.sleep(0.05)  # hung: not a byte more, the connection open until the router closes it
                return response
            if self.pace_s:
                await asyncio.sleep(self.pace_s)
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
    router.replicas.policies["m"] = make_policy(router.spec.routing["m"])
    try:
        async with router_listening(router) as url, aiohttp.ClientSession() as client:
            async with client.post(f"{url}{path}", json=body) as resp:
                return resp.status, await resp.read(), router
    finally:
        for engine in engines:
            await engine.runner.cleanup()


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


class FakeHandle:
    """A Serve deployment handle whose `wake.remote()` is counted (Serve would queue it)."""

    def __init__(self):
        self.wakes = 0
        self.wake = self

    def remote(self):
        self.wakes += 1


async def pd_router(prefills, decodes):
    """A bare router over started prefill and decode engines of model "m": (router, decode upstreams)."""
    ups = []
    for role, engines in (("prefill", prefills), ("decode", decodes)):
        for sent, engine in enumerate(engines):
            up = upstream(engine.name, 0, sent=sent)
            up.record.url = await engine.start()
            up.record.role = role
            ups.append(up)
    router = bare_router([u for u in ups if u.record.role == "decode"], "least_load")
    router.replicas.table.prefill_by_model = {"m": [u for u in ups if u.record.role == "prefill"]}
    router.replicas.prefill_policies = {"m": make_policy(RoutingSpec(policy="least_load"))}
    return router, [u for u in ups if u.record.role == "decode"]


async def through_pd_router(prefills, decodes, path, body):
    router, _ = await pd_router(prefills, decodes)
    try:
        async with router_listening(router) as url, aiohttp.ClientSession() as client:
            async with client.post(f"{url}{path}", json=body) as resp:
                return resp.status, await resp.read()
    finally:
        for engine in [*prefills, *decodes]:
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


async def raw_request(url: str, head: bytes, body: bytes = b"") -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """An HTTP request written byte for byte (headers no client library would send); the open connection."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(head + b"\r\n" + body)
    await writer.drain()
    return reader, writer


def post_head(path: str, body: bytes, *headers: bytes) -> bytes:
    lines = [f"POST {path} HTTP/1.1".encode(), b"Host: 127.0.0.1", b"Content-Type: application/json"]
    lines += [f"Content-Length: {len(body)}".encode(), *headers]
    return b"\r\n".join(lines) + b"\r\n"
