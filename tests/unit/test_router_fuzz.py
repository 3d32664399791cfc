"""The router's HTTP surface against generated malformed requests (a seeded generator, so a failure replays): bodies
of every JSON shape with the fields the router reads set to wrong types, broken JSON and bytes, headers with
bytes that are not UTF-8, any method, and paths on and off the public surface (engines' admin paths, the router's
own routes, paths spelt to slip past an allowlist). The router itself never answers 5xx nor fails a handler, no
path off the public surface reaches an engine, and a good request is still answered afterwards. The fake
engines answer what they can parse (streams in vLLM's format, token ids included) and refuse the rest with 400,
as vLLM does."""

from __future__ import annotations

import asyncio
import json
import logging
import random
from dataclasses import replace

import aiohttp
from aiohttp import web

from tests.conftest import bare_router, router_listening, serve
from tests.unit.fakes import post_head, raw_request, upstream

SEED = 19
CASES = 400
PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/completions?x=%ff", "/v1/embeddings")
# Off the public surface (engines' admin and native paths, the router's own routes with another method, spellings
# of a public path that are not it): never reach an engine, answered 401 (no key) or 404/405 by the router.
OFF_SURFACE = (
    "/load",
    "/collective_rpc",
    "/scale_elastic_ep",
    "/slots",
    "/slots/0?action=save",
    "/props",
    "/v1/load_lora_adapter",
    "/v1/completions/../../load",
    "/v1/%2e%2e/load",
    "//v1/completions",
    "/v1/completions/",
    "/health",
    "/metrics",
    "/v1/models",
    "/",
)
METHODS = ("POST", "POST", "POST", "GET", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD")


class TolerantEngine:
    """vLLM-shaped answers to whatever parses; 400 for the rest. A stream is cut off part-way now and then, so
    the router's resume path sees the same bodies."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.answers = 0
        self.paths: list[str] = []

    async def start(self) -> str:
        async def handle(request: web.Request):
            self.paths.append(request.path)
            try:
                body = await request.json()
                stream = body.get("stream") is True
                limit = int(body.get("max_tokens") or 4) % 6 + 1
            except (ValueError, AttributeError, TypeError) as exc:
                return web.json_response({"error": {"message": repr(exc)}}, status=400)
            self.answers += 1
            if not stream:
                return web.json_response({"id": "x", "choices": [{"index": 0, "text": "ok"}]})
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            with_ids = body.get("return_token_ids") is True
            for i in range(limit):
                if self.answers % 7 == 0 and i == 2:
                    request.transport.abort()  # this engine "dies" mid-stream
                    return response
                choice = {"index": 0, "text": f"t{i}", "finish_reason": "length" if i == limit - 1 else None}
                if with_ids:
                    choice |= {"token_ids": [i + 5], "prompt_token_ids": [1, 2] if i == 0 else None}
                chunk = {"id": "c", "object": "text_completion", "created": 1, "model": "m", "choices": [choice]}
                await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            await response.write(b"data: [DONE]\n\n")
            return response

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", handle)
        self.runner, port = await serve(app)
        return f"http://127.0.0.1:{port}"


def junk_value(rng: random.Random, depth: int = 0):
    kinds = ["int", "bigint", "float", "str", "bool", "null", "list", "dict", "unicode"]
    kind = rng.choice(kinds if depth < 3 else kinds[:6])
    if kind == "int":
        return rng.randint(-(2**63), 2**63 - 1)
    if kind == "bigint":
        return rng.choice([2**64, -(2**64) - 1, 10**30])
    if kind == "float":
        return rng.choice([0.5, -1e308, 1e-300])
    if kind == "str":
        return rng.choice(["", "m", "yes", "x" * rng.randint(0, 300), "\u0000", "[DONE]"])
    if kind == "unicode":
        return "".join(chr(rng.randint(0x80, 0x2FFFF)) for _ in range(rng.randint(1, 8)))
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "null":
        return None
    if kind == "list":
        return [junk_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return {rng.choice(["text", "role", "content", "type", "a"]): junk_value(rng, depth + 1) for _ in range(3)}


FIELDS = (
    "model",
    "stream",
    "stream_options",
    "messages",
    "prompt",
    "max_tokens",
    "max_completion_tokens",
    "min_tokens",
    "user",
    "n",
    "logprobs",
    "stop",
    "kv_transfer_params",
    "return_token_ids",
)


def junk_body(rng: random.Random) -> bytes:
    """A request body: mostly a plausible request with some fields of the wrong type, else anything at all."""
    roll = rng.random()
    if roll < 0.6:
        body = {"model": "m", "prompt": "hello", "stream": rng.random() < 0.5}
        for key in rng.sample(FIELDS, rng.randint(1, 4)):
            body[key] = junk_value(rng)
        if rng.random() < 0.3:
            content = [{"type": "text", "text": junk_value(rng)}, junk_value(rng)]
            body["messages"] = [{"role": junk_value(rng), "content": content}, junk_value(rng)]
        text = json.dumps(body)
    elif roll < 0.75:
        text = json.dumps(junk_value(rng))
    elif roll < 0.85:
        depth = rng.choice([63, 64, 65, 200, 1100])
        text = '{"model": "m", "prompt": "x", "a": ' + "[" * depth + "]" * depth + "}"
    else:
        raw = bytes(rng.randint(0, 255) for _ in range(rng.randint(0, 60)))
        return rng.choice([raw, b'{"model": "m", "prompt": "' + raw + b'"}', b'{"model": "m"'])
    data = text.encode()
    if rng.random() < 0.1:  # cut anywhere
        data = data[: rng.randint(0, len(data))]
    return data


def junk_headers(rng: random.Random) -> list[bytes]:
    headers = []
    for name in rng.sample([b"Authorization", b"X-Session-Id", b"Accept", b"X-Request-Id", b"User-Agent"], 2):
        value = rng.choice([b"\xff\xfe", b"Bearer \xc3\x28", b"text/event-stream", "\u00e9".encode("latin-1"), b""])
        headers.append(name + b": " + value)
    return headers


async def answer_status(url: str, path: str, body: bytes, headers: list[bytes], method: str = "POST") -> int:
    head = post_head(path, body, b"Connection: close", *headers).replace(b"POST ", method.encode() + b" ", 1)
    reader, writer = await raw_request(url, head, body)
    try:
        status_line = await asyncio.wait_for(reader.readline(), 10)
        await asyncio.wait_for(reader.read(), 10)  # the whole answer, streams included
    finally:
        writer.close()
    return int(status_line.split()[1])


class Errors(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_generated_malformed_requests_never_get_a_5xx_from_the_router():
    rng = random.Random(SEED)
    failed_handlers = Errors()
    logging.getLogger("aiohttp.server").addHandler(failed_handlers)

    async def main():
        engines = [TolerantEngine("a"), TolerantEngine("b"), TolerantEngine("c")]
        ups = []
        for i, engine in enumerate(engines):
            ups.append(upstream(engine.name, 0, sent=i))
            ups[-1].record.url = await engine.start()
        bad = []
        try:
            for policy in ("cache_aware", "session"):
                router = bare_router(ups, policy)
                router.spec = router.spec.with_api_key("open-sesame-0123456789" if policy == "session" else None)
                async with router_listening(router) as url:
                    for _ in range(CASES // 2):
                        path, body, headers = rng.choice(PATHS), junk_body(rng), junk_headers(rng)
                        method = "POST" if rng.random() < 0.7 else rng.choice(METHODS)
                        off_surface = rng.random() < 0.25
                        if off_surface:
                            path = rng.choice(OFF_SURFACE)
                        if router.spec.client_keys and rng.random() < 0.8:
                            headers = [h for h in headers if not h.startswith(b"Authorization")]
                            headers.append(b"Authorization: Bearer open-sesame-0123456789")
                        reached = sum(len(e.paths) for e in engines)
                        status = await answer_status(url, path, body, headers, method)
                        if status >= 500:
                            bad.append((status, method, path, body[:200], headers))
                        own_route = method in ("GET", "HEAD") and path in ("/health", "/metrics", "/v1/models")
                        if off_surface and not own_route:
                            if status not in (400, 401, 404, 405) or sum(len(e.paths) for e in engines) != reached:
                                bad.append((status, method, path, "off the surface", headers))
                    async with aiohttp.ClientSession() as client:
                        good = {"model": "m", "prompt": "hello", "max_tokens": 3}
                        headers = {"Authorization": "Bearer open-sesame-0123456789"} if router.spec.client_keys else {}
                        async with client.post(f"{url}/v1/completions", json=good, headers=headers) as r:
                            assert r.status == 200 and (await r.json())["choices"][0]["text"] == "ok"
                    assert router.counters.inflight == 0 and all(u.inflight == 0 for u in ups)
        finally:
            for engine in engines:
                await engine.runner.cleanup()
        return bad

    try:
        bad = asyncio.run(main())
    finally:
        logging.getLogger("aiohttp.server").removeHandler(failed_handlers)
    assert not bad, f"{len(bad)} requests got a 5xx or reached an engine off the surface, e.g. {bad[:3]}"
    assert not failed_handlers.records, [
        r.getMessage() + str(r.exc_info and r.exc_info[1]) for r in failed_handlers.records[:3]
    ]


async def partial_request(url: str, rng: random.Random, body: bytes) -> tuple[str, int | None]:
    """One generated slow or partial request: (what it did, the status it got or None when the router closed it
    without an answer). A request dribbled within the bounds is answered; the rest are closed within them."""
    head = post_head("/v1/completions", body, b"Connection: close")
    whole = head + b"\r\n" + body
    kind = rng.choice(["head-cut-close", "head-cut-silent", "body-cut-close", "body-cut-silent", "dribbled"])
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        if kind.startswith("head-cut"):
            writer.write(head[: rng.randint(0, len(head) - 1)])
        elif kind.startswith("body-cut"):
            writer.write(whole[: len(head) + 2 + rng.randint(0, len(body) - 1)])
        else:  # the whole request, a few bytes at a time: slow but within the bounds
            for i in range(0, len(whole), max(1, len(whole) // 8)):
                writer.write(whole[i : i + max(1, len(whole) // 8)])
                await asyncio.sleep(rng.uniform(0.01, 0.1))
        if kind.endswith("close"):
            writer.close()
            return kind, None
        answer = await asyncio.wait_for(reader.read(), 15)  # answered, or closed by the router within its bounds
        return kind, int(answer.split()[1]) if answer.startswith(b"HTTP/1.1 ") else None
    except ConnectionError:
        return kind, None
    finally:
        writer.close()


def test_generated_slow_and_partial_requests_are_answered_or_closed_within_the_bounds():
    rng = random.Random(SEED)
    failed_handlers = Errors()
    logging.getLogger("aiohttp.server").addHandler(failed_handlers)

    async def main():
        engine = TolerantEngine("a")
        up = upstream("a", 0, sent=0)
        up.record.url = await engine.start()
        router = bare_router([up], "cache_aware")
        router.spec.admission = replace(router.spec.admission, client_idle_timeout_s=1.0, client_body_timeout_s=1.0)
        try:
            async with router_listening(router) as url:
                bodies = [json.dumps({"model": "m", "prompt": "hello", "max_tokens": 3}).encode()]
                bodies += [junk_body(rng) or b"{}" for _ in range(5)]
                began = asyncio.get_running_loop().time()
                results = await asyncio.gather(*(partial_request(url, rng, rng.choice(bodies)) for _ in range(120)))
                took = asyncio.get_running_loop().time() - began
                deadline = asyncio.get_running_loop().time() + 15
                while router.frontend.connections.open and asyncio.get_running_loop().time() < deadline:
                    await asyncio.sleep(0.05)
                left = router.frontend.connections.open, router.counters.inflight, router.frontend.bodies.taken
                async with aiohttp.ClientSession() as client:
                    good = {"model": "m", "prompt": "hello", "max_tokens": 3}
                    async with client.post(f"{url}/v1/completions", json=good) as r:
                        assert r.status == 200
        finally:
            await engine.runner.cleanup()
        return results, took, left

    try:
        results, took, left = asyncio.run(main())
    finally:
        logging.getLogger("aiohttp.server").removeHandler(failed_handlers)
    bad = [(kind, status) for kind, status in results if status is not None and status >= 500]
    bad += [(kind, status) for kind, status in results if kind == "dribbled" and status is None]
    assert not bad, bad[:5]
    assert any(kind == "dribbled" for kind, _ in results) and any(kind.endswith("silent") for kind, _ in results)
    assert took < 15 and left == (0, 0, 0), (took, left)
    assert not failed_handlers.records, [r.getMessage() for r in failed_handlers.records[:3]]
