"""Issue 19's router hardening, on real sockets against small fake engines: a client that hangs up closes the
engine's request (vLLM then aborts it), malformed bodies get a 4xx naming the problem, each replica gets at most
its max_ongoing_requests (the rest wait in a bounded queue, then 503 + Retry-After), bodies over the cap get 413,
a request that an engine died on is retried only once more, and client kv_transfer_params never reach engines."""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import replace

import aiohttp
import pytest
from aiohttp import web

from flagscale.config.routing import RoutingSpec
from flagscale.config.schema import DeployConfig
from flagscale.router.policies import RequestInfo, make_policy
from flagscale.router.policies.cache_aware import CacheAware, prompt_text
from tests.conftest import bare_router, router_listening, serve
from tests.unit.fakes import FakeEngine, dropping_replica, events, healthy_replica, post_head, raw_request, upstream
from tests.unit.fakes import through_router as stream_through_router


class HangingEngine:
    """Takes a request and generates "forever" (streamed: two chunks, then nothing), watching its connection:
    `closed` is set when the router closes it, as vLLM's server notices a disconnect and aborts the request."""

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.closed = asyncio.Event()

    async def start(self) -> str:
        async def complete(request: web.Request):
            body = await request.json()
            response = None
            if body.get("stream"):
                response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
                await response.prepare(request)
                for i in range(2):
                    chunk = {"id": "c", "choices": [{"index": 0, "text": f"t{i}", "finish_reason": None}]}
                    await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            self.started.set()
            for _ in range(200):  # 10 s at most
                if request.transport is None or request.transport.is_closing():
                    self.closed.set()
                    break
                await asyncio.sleep(0.05)
            return response or web.json_response({"choices": [{"text": "done"}]})

        app = web.Application()
        app.router.add_post("/v1/completions", complete)
        self.runner, port = await serve(app)
        return f"http://127.0.0.1:{port}"


@pytest.mark.parametrize("streamed", [False, True], ids=["non-streamed", "streamed"])
def test_a_client_that_hangs_up_closes_the_engines_request(streamed):
    async def main():
        engine = HangingEngine()
        up = upstream("a", 0, sent=0)
        up.record.url = await engine.start()
        router = bare_router([up], "least_load")
        try:
            async with router_listening(router) as url:
                body = json.dumps({"model": "m", "prompt": "x", "max_tokens": 400, "stream": streamed}).encode()
                reader, writer = await raw_request(url, post_head("/v1/completions", body), body)
                await asyncio.wait_for(engine.started.wait(), 10)
                if streamed:  # the client has its first tokens, then leaves
                    assert b"t0" in await asyncio.wait_for(reader.readuntil(b"t0"), 10)
                writer.close()
                await asyncio.wait_for(engine.closed.wait(), 5)
                await asyncio.sleep(0.2)
                assert router.counters.inflight == 0 and up.inflight == 0
        finally:
            await engine.runner.cleanup()

    asyncio.run(main())


def test_a_client_that_reads_slowly_holds_back_the_engine_not_the_routers_memory():
    """The router stops reading a replica's stream while its client's buffer is full (upstream_http), so the
    replica's own writes wait: a client that stalls costs the router one buffer, not the whole answer."""
    total = 64 * 1024 * 1024  # far beyond the sockets' buffers between the engine and the client

    async def main():
        finished = asyncio.Event()
        written = got = 0
        event = b"data: " + b"x" * 65530 + b"\n\n"

        async def big(request):
            nonlocal written
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            while written < total:
                await response.write(event)
                written += len(event)
            await response.write_eof()
            finished.set()
            return response

        app = web.Application()
        app.router.add_post("/v1/embeddings", big)
        runner, port = await serve(app)
        up = upstream("a", port, sent=0)
        try:
            async with router_listening(bare_router([up], "least_load")) as url:
                body = json.dumps({"model": "m"}).encode()
                reader, writer = await raw_request(url, post_head("/v1/embeddings", body), body)
                await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
                deadline = asyncio.get_running_loop().time() + 10
                while written < 4 * 1024 * 1024 and asyncio.get_running_loop().time() < deadline:
                    await asyncio.sleep(0.05)
                await asyncio.sleep(1.0)  # unthrottled, loopback would carry all 64 MiB in far less
                assert not finished.is_set() and written < total // 4, written
                tail = b""
                while tail != b"0\r\n\r\n":  # the end of the chunked answer
                    chunk = await asyncio.wait_for(reader.read(1 << 20), 30)
                    assert chunk, "the router closed the connection before the answer's end"
                    got += chunk.count(b"x")
                    tail = (tail + chunk)[-5:]
                assert finished.is_set() and got == written // len(event) * 65530
                writer.close()
        finally:
            await runner.cleanup()

    asyncio.run(main())


class StrictEngine:
    """Answers every well-formed completion; refuses with 400 what vLLM's own validation refuses."""

    def __init__(self) -> None:
        self.bodies: list[dict] = []

    async def start(self) -> str:
        async def complete(request: web.Request):
            try:
                body = await request.json()
                for message in body.get("messages") or ():
                    for part in message.get("content") if isinstance(message.get("content"), list) else ():
                        assert isinstance(part.get("text", ""), str), "text of a content part must be a string"
            except (ValueError, AttributeError, AssertionError, TypeError) as exc:
                return web.json_response({"error": {"message": str(exc)}}, status=400)
            self.bodies.append(body)
            return web.json_response({"choices": [{"text": "ok"}]})

        app = web.Application()
        app.router.add_post("/v1/completions", complete)
        app.router.add_post("/v1/chat/completions", complete)
        self.runner, port = await serve(app)
        return f"http://127.0.0.1:{port}"


MALFORMED = [
    (b'{"model": []}', "`model` must be a string"),
    (b'{"model": "m", "prompt": "x", "stream": true, "stream_options": "x"}', "`stream_options` must be an object"),
    (b"[" * 5000 + b"]" * 5000, "depth limit exceeded"),
    (b'{"model": "m", "prompt": "x", "a": ' + b"[" * 100 + b"]" * 100 + b"}", "nests deeper than 64"),
    (b'{"model": "m", "prompt": "\xff\xfe"}', "not valid JSON"),
    (b'["model", "m"]', "must be a JSON object, not list"),
    (b'"m"', "must be a JSON object, not str"),
    (b'{"model": "m", "prompt": "x", "stream": "yes"}', "`stream` must be true or false"),
    (b'{"model": "m", "messages": "hi"}', "`messages` must be a list"),
    (b'{"model": "m", "prompt": "x"', "not valid JSON"),
]


@pytest.mark.parametrize(("body", "problem"), MALFORMED, ids=[p for _, p in MALFORMED])
def test_a_malformed_body_gets_a_400_naming_the_problem_and_the_router_keeps_serving(body, problem):
    async def main():
        engine = StrictEngine()
        up = upstream("a", 0, sent=0)
        up.record.url = await engine.start()
        try:
            async with router_listening(bare_router([up], "cache_aware")) as url, aiohttp.ClientSession() as client:
                async with client.post(f"{url}/v1/completions", data=body) as r:
                    status, answer = r.status, await r.json()
                async with client.post(f"{url}/v1/completions", json={"model": "m", "prompt": "x"}) as r:
                    assert r.status == 200
        finally:
            await engine.runner.cleanup()
        assert status == 400 and problem in answer["error"]["message"], answer
        assert len(engine.bodies) == 1  # only the good one reached the engine

    asyncio.run(main())


def test_what_the_engine_refuses_is_its_4xx_not_a_router_500():
    """A non-string `text` part (chat rendering for prefix hashing), non-UTF-8 header bytes with a key set, an
    integer beyond 64 bits in a resumable stream: the engine decides (vLLM answers 4xx), the router does not fail."""

    async def main():
        engine = StrictEngine()
        up = upstream("a", 0, sent=0)
        up.record.url = await engine.start()
        router = bare_router([up], "session")
        router.spec = router.spec.with_api_key("open-sesame-0123456789")
        chat = json.dumps({"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]})
        good = json.dumps({"model": "m", "prompt": "x"}).encode()
        # a resumable stream's body is re-serialized with orjson, which has no integers beyond 64 bits
        huge_int = b'{"model": "m", "prompt": "x", "stream": true, "seed": 36893488147419103232}'
        statuses = []
        try:
            async with router_listening(router) as url:
                for path, body, headers in [
                    ("/v1/chat/completions", chat.encode(), [b"Authorization: Bearer open-sesame-0123456789"]),
                    ("/v1/completions", good, [b"Authorization: Bearer \xff\xfe"]),
                    (
                        "/v1/completions",
                        good,
                        [b"Authorization: Bearer open-sesame-0123456789", b"X-Session-Id: \xff\xfe\xfd"],
                    ),
                    ("/v1/completions", huge_int, [b"Authorization: Bearer open-sesame-0123456789"]),
                    ("/v1/completions", good, [b"Authorization: Bearer open-sesame-0123456789"]),
                ]:
                    reader, writer = await raw_request(url, post_head(path, body, b"Connection: close", *headers), body)
                    statuses.append(int((await reader.readline()).split()[1]))
                    writer.close()
        finally:
            await engine.runner.cleanup()
        assert statuses[:2] == [400, 401] and statuses[2] in (200, 400) and statuses[3:] == [200, 200], statuses

    asyncio.run(main())


class SlowEngine:
    """Holds every request until `release` is set; records the most it held at once."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.inflight = self.most = self.served = 0

    async def start(self) -> str:
        async def complete(request: web.Request):
            await request.read()
            self.inflight += 1
            self.most = max(self.most, self.inflight)
            try:
                await self.release.wait()
            finally:
                self.inflight -= 1
            self.served += 1
            return web.json_response({"choices": [{"text": "ok"}]})

        app = web.Application()
        app.router.add_post("/v1/completions", complete)
        self.runner, port = await serve(app)
        return f"http://127.0.0.1:{port}"


def test_replicas_get_at_most_max_ongoing_requests_and_the_rest_wait_in_a_bounded_queue():
    async def main():
        engines = [SlowEngine(), SlowEngine()]
        ups = []
        for i, engine in enumerate(engines):
            ups.append(upstream(f"r{i}", 0, sent=i))
            ups[-1].record.url = await engine.start()
        router = bare_router(ups, "least_load")
        router.spec.max_ongoing = {"s": 2}  # replica_record's serve_id
        router.spec.admission = replace(router.spec.admission, max_queued_requests=3)
        for up in ups:
            up.max_ongoing = router._max_ongoing(up)
        try:
            async with router_listening(router) as url, aiohttp.ClientSession() as client:

                async def post():
                    async with client.post(f"{url}/v1/completions", json={"model": "m", "prompt": "x"}) as r:
                        return r.status, r.headers.get("Retry-After"), await r.json()

                held = [asyncio.create_task(post()) for _ in range(4 + 3)]  # 2 replicas x 2, 3 queued
                while sum(e.inflight for e in engines) < 4 or len(router.admission.waiting.get(("serve", "m"), ())) < 3:
                    await asyncio.sleep(0.02)
                status, retry_after, answer = await post()  # the queue is full
                assert status == 503 and retry_after == "1", (status, answer)
                assert "max_queued_requests" in answer["error"]["message"]
                for engine in engines:
                    engine.release.set()
                results = await asyncio.gather(*held)
        finally:
            for engine in engines:
                await engine.runner.cleanup()
        assert [status for status, _, _ in results] == [200] * 7
        assert [e.most for e in engines] == [2, 2] and sum(e.served for e in engines) == 7

    asyncio.run(main())


def test_a_request_waits_in_the_queue_at_most_queue_timeout_s():
    async def main():
        engine = SlowEngine()
        up = upstream("a", 0, sent=0)
        up.record.url = await engine.start()
        router = bare_router([up], "least_load")
        router.spec.admission = replace(router.spec.admission, queue_timeout_s=0.3)
        up.max_ongoing = 1
        try:
            async with router_listening(router) as url, aiohttp.ClientSession() as client:
                first = asyncio.create_task(client.post(f"{url}/v1/completions", json={"model": "m", "prompt": "x"}))
                while engine.inflight < 1:
                    await asyncio.sleep(0.02)
                async with client.post(f"{url}/v1/completions", json={"model": "m", "prompt": "y"}) as r:
                    status, retry_after, answer = r.status, r.headers.get("Retry-After"), await r.json()
                engine.release.set()
                (await first).release()
        finally:
            await engine.runner.cleanup()
        assert status == 503 and retry_after == "1" and "deploy.queue_timeout_s" in answer["error"]["message"]
        assert router.admission.waiting == {}

    asyncio.run(main())


def test_a_body_over_the_cap_gets_413_naming_the_limit():
    async def main():
        seen: list = []
        runner, port = await healthy_replica(seen)
        router = bare_router([upstream("a", port, sent=0)], "least_load")
        router.spec.admission = replace(router.spec.admission, max_body_bytes=2048)
        big = json.dumps({"model": "m", "prompt": "x" * 4096}).encode()

        async def chunked():
            yield big[:1000]
            yield big[1000:]

        answers = []
        try:
            async with router_listening(router) as url, aiohttp.ClientSession() as client:
                for data in (big, chunked()):  # with Content-Length, and chunked without one
                    async with client.post(f"{url}/v1/completions", data=data) as r:
                        answers.append((r.status, (await r.json())["error"]["message"]))
                async with client.post(f"{url}/v1/completions", json={"model": "m", "prompt": "x"}) as r:
                    assert r.status == 200
        finally:
            await runner.cleanup()
        for status, message in answers:
            assert status == 413 and "2048 bytes" in message and "deploy.max_body_bytes" in message
        assert len(seen) == 1

    asyncio.run(main())


def test_only_the_beginning_of_a_long_prompt_is_hashed_for_prefix_routing():
    spec = RoutingSpec.of(max_prefix_chars=1024)
    policy = make_policy(spec)
    assert isinstance(policy, CacheAware)
    huge = {"model": "m", "prompt": "y" * 1_000_000}
    keys = policy._prompt_keys(RequestInfo("m", huge))
    assert len(keys) == 1024 // spec.settings.prefix_block_chars
    chat = {"messages": [{"role": "user", "content": "z" * 5000}] * 1000}
    assert len(prompt_text(chat, 1024)) == 1024
    assert len(prompt_text({"prompt": list(range(100_000))}, 1024)) == 1024


def test_deploy_defaults_protect_metrics_and_bound_the_body_and_queue():
    deploy = DeployConfig()
    assert deploy.protect_metrics is True
    assert deploy.max_body_bytes == 16 * 1024 * 1024 and deploy.max_queued_requests > 0 and deploy.queue_timeout_s > 0


def test_a_request_an_engine_died_on_is_retried_only_once_more(caplog):
    async def main():
        seen: list = []
        servers = [await dropping_replica(seen) for _ in range(3)]
        ups = [upstream(f"dropping{i}", port, sent=i) for i, (_, port) in enumerate(servers)]
        router = bare_router(ups, "least_load")
        router.spec.routing["m"] = RoutingSpec.of("least_load", max_migrations=2)
        try:
            async with router_listening(router) as url, aiohttp.ClientSession() as client:
                async with client.post(f"{url}/v1/completions", json={"model": "m", "prompt": "x"}) as r:
                    status, answer = r.status, await r.json()
        finally:
            for server, _ in servers:
                server.close()
        assert len(seen) == 2, seen  # the first replica and one more: not the third
        assert status == 502 and "may be what kills them" in answer["error"]["message"], answer

    with caplog.at_level(logging.WARNING, logger="flagscale.router"):
        asyncio.run(main())
    assert any("may be what kills them" in record.getMessage() for record in caplog.records)


def test_a_stream_an_engine_died_on_is_resumed_only_once_more():
    body = {"model": "m", "prompt": "hello", "max_tokens": 12, "stream": True, "temperature": 0}
    engines = [FakeEngine(f"dying{i}", die_after=3 + i) for i in range(3)]
    status, raw, router = asyncio.run(stream_through_router(engines, "/v1/completions", body, max_migrations=2))
    assert status == 200
    assert [len(e.bodies) for e in engines] == [1, 1, 0]
    last = [e for e in events(raw) if isinstance(e, dict)][-1]
    assert "may be what kills them" in last["error"]["message"], last
    assert router.collect_stats()["resumed"] == 1


def test_client_kv_transfer_params_never_reach_an_engine():
    async def main():
        seen: list = []
        runner, port = await healthy_replica(seen)
        router = bare_router([upstream("a", port, sent=0)], "least_load")
        body = {"model": "m", "prompt": "x", "kv_transfer_params": {"remote_host": "10.6.6.6", "remote_port": 1}}
        try:
            async with router_listening(router) as url, aiohttp.ClientSession() as client:
                async with client.post(f"{url}/v1/completions", json=body) as r:
                    assert r.status == 200
        finally:
            await runner.cleanup()
        assert seen == [{"model": "m", "prompt": "x"}]

    asyncio.run(main())


def test_a_clients_expect_100_continue_is_answered_by_the_router_not_passed_on():
    """The router has the whole body before it sends the request: an engine asked to say 100 Continue would
    answer twice."""

    async def main():
        heard: list[dict] = []

        async def complete(request):
            heard.append({k.lower(): v for k, v in request.headers.items()})
            await request.read()
            return web.json_response({"choices": [{"text": "ok"}]})

        app = web.Application()
        app.router.add_post("/v1/completions", complete)
        runner, port = await serve(app)
        try:
            async with router_listening(bare_router([upstream("a", port, sent=0)], "least_load")) as url:
                body = json.dumps({"model": "m", "prompt": "x"}).encode()
                reader, writer = await raw_request(url, post_head("/v1/completions", body, b"Expect: 100-continue"))
                assert (await asyncio.wait_for(reader.readline(), 10)).startswith(b"HTTP/1.1 100")
                writer.write(body)
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
                assert head.startswith(b"\r\nHTTP/1.1 200") or head.startswith(b"HTTP/1.1 200"), head
                writer.close()
        finally:
            await runner.cleanup()
        assert heard and "expect" not in heard[0]

    asyncio.run(main())
