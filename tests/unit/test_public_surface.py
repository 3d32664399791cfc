"""The router's public surface and what one client can do to the replicas (issue 34, items 1-5), on real sockets
against small fake engines: only the engines' public paths reach them (everything else 404s at the router), only
GET /health (and GET /metrics when open) skip the key, a client's wrong request never counts against a replica,
a request during which an engine died goes to at most one more replica, and client kv_transfer_params never
reach an engine."""

from __future__ import annotations

import asyncio
import json
import logging

import aiohttp
import pytest
from aiohttp import web

from flagscale.config.routing import RoutingSpec
from flagscale.router.policies import make_policy
from tests.conftest import bare_router, router_listening, serve
from tests.unit.fakes import FakeEngine, raw_request, started_upstreams, through_pd_router, upstream
from tests.unit.fakes import through_router as stream_through_router

KEY = {"Authorization": "Bearer open-sesame-0123456789"}
# vLLM's dead engine core, as its server answers every request after it (vllm/v1/engine/exceptions.py)
ENGINE_DEAD = {
    "error": {
        "message": "EngineCore encountered an issue. See stack trace (above) for the root cause.",
        "type": "InternalServerError",
        "param": None,
        "code": 500,
    }
}


class RecordingEngine:
    """Answers any method on any path (so whatever the router lets through is seen): `seen` has (method, path,
    body). `status(method, path, body)` picks the answer's status (200 by default); /health answers `health`."""

    def __init__(self, name: str, status=None, health: int = 200, body=None) -> None:
        self.name, self.status, self.health, self.body = name, status, health, body
        self.seen: list[tuple[str, str, dict | None]] = []

    async def start(self) -> str:
        async def handle(request: web.Request):
            if request.path == "/health":
                return web.Response(status=self.health)
            raw = await request.read()
            body = json.loads(raw) if raw else None
            self.seen.append((request.method, request.path_qs, body))
            status = self.status(request.method, request.path, body) if self.status else 200
            answer = self.body if status >= 500 and self.body else {"error": {"message": "no"}}
            return web.json_response({"choices": [{"text": "ok"}]} if status < 400 else answer, status=status)

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", handle)
        self.runner, port = await serve(app)
        return f"http://127.0.0.1:{port}"


async def with_router(engines, calls, api_key=None, protect_metrics=True, max_migrations=2):
    """A bare router over `engines` (tried in this order); `calls`: (method, path, json body or None, headers).
    Returns the (status, body text) of each, and the router."""
    router = bare_router(await started_upstreams(engines), "least_load")
    router.spec = router.spec.with_api_key(api_key)
    router.spec.protect_metrics = protect_metrics
    router.spec.routing["m"] = RoutingSpec.of("least_load", max_migrations=max_migrations)
    router.replicas.policies["m"] = make_policy(router.spec.routing["m"])
    results = []
    try:
        async with router_listening(router) as url, aiohttp.ClientSession() as client:
            for method, path, body, headers in calls:
                async with client.request(method, url + path, json=body, headers=headers) as resp:
                    results.append((resp.status, await resp.text()))
    finally:
        for engine in engines:
            await engine.runner.cleanup()
    return results, router


# ---- item 2: the public surface is an allowlist ----

NOT_PUBLIC = [
    ("GET", "/load"),  # vLLM's server load
    ("GET", "/kv_event_sources"),
    ("POST", "/collective_rpc"),
    ("POST", "/reset_prefix_cache"),
    ("POST", "/sleep"),
    ("POST", "/wake_up"),  # vLLM's sleep mode: only the router wakes a replica (router/wake.py)
    ("GET", "/is_sleeping"),
    ("POST", "/scale_elastic_ep"),
    ("POST", "/start_profile"),
    ("POST", "/v1/load_lora_adapter"),
    ("GET", "/server_info"),
    ("POST", "/pause"),
    ("GET", "/slots"),  # llama.cpp: other users' prompts
    ("POST", "/props"),
    ("POST", "/lora-adapters"),
    ("GET", "/tools"),
    ("GET", "/docs"),
    ("GET", "/ping"),
    ("POST", "/v1/completions/render"),
    ("GET", "/v1/stream"),
    ("POST", "/v1/completions/"),
    ("POST", "/V1/completions"),
    ("GET", "/"),
]
PUBLIC = [
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/embeddings"),
    ("POST", "/v1/responses"),
    ("GET", "/v1/responses/resp_123abc"),
    ("POST", "/v1/responses/resp_123abc/cancel"),
    ("POST", "/v1/audio/transcriptions"),
    ("POST", "/v1/messages"),
    ("POST", "/invocations"),
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
    ("GET", "/version"),
]


def test_only_the_engines_public_paths_reach_an_engine_the_rest_is_404_at_the_router():
    engine = RecordingEngine("a")
    body = {"model": "m", "prompt": "x"}
    calls = [(method, path, body if method == "POST" else None, KEY) for method, path in NOT_PUBLIC + PUBLIC]
    calls.append(("GET", "/v1/completions?stream=false&x=%20y", None, KEY))
    results, _ = asyncio.run(with_router([engine], calls, api_key="open-sesame-0123456789"))
    statuses = {f"{m} {p}": status for (m, p, _, _), (status, _) in zip(calls, results)}
    assert {f"{m} {p}": statuses[f"{m} {p}"] for m, p in NOT_PUBLIC} == {f"{m} {p}": 404 for m, p in NOT_PUBLIC}
    assert {f"{m} {p}": statuses[f"{m} {p}"] for m, p in PUBLIC} == {f"{m} {p}": 200 for m, p in PUBLIC}
    assert [(m, p) for m, p, _ in engine.seen] == [*PUBLIC, ("GET", "/v1/completions?stream=false&x=%20y")]
    assert '"NotFoundError"' in results[0][1]


def test_a_path_outside_the_surface_does_not_reach_the_engine_however_it_is_spelt():
    engine = RecordingEngine("a")

    async def main():
        up = upstream("a", 0, sent=0)
        up.record.url = await engine.start()
        statuses = []
        try:
            async with router_listening(bare_router([up], "least_load")) as url:
                for target in (b"/v1/completions/../../load", b"/v1/%2e%2e/load", b"//load", b"/v1/models/../../load"):
                    reader, writer = await raw_request(url, b"GET " + target + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n")
                    statuses.append(int((await asyncio.wait_for(reader.readline(), 10)).split()[1]))
                    writer.close()
        finally:
            await engine.runner.cleanup()
        return statuses

    assert asyncio.run(main()) == [404, 404, 404, 404]
    assert engine.seen == []


def test_llama_cpp_models_get_llama_cpp_paths_only():
    engine = RecordingEngine("a")
    calls = [("GET", "/version", None, {}), ("POST", "/v1/completions", {"model": "m"}, {})]

    async def main():
        up = upstream("a", 0, sent=0)
        up.record.url = await engine.start()
        router = bare_router([up], "least_load")
        router.spec.engines = {"m": "llama_cpp"}
        out = []
        try:
            async with router_listening(router) as url, aiohttp.ClientSession() as client:
                for method, path, body, headers in calls:
                    async with client.request(method, url + path, json=body, headers=headers) as resp:
                        out.append(resp.status)
        finally:
            await engine.runner.cleanup()
        return out

    assert asyncio.run(main()) == [404, 200]  # llama-server has no /version
    assert [p for _, p, _ in engine.seen] == ["/v1/completions"]


# ---- item 3: only GET /health (and GET /metrics when open) skip the key ----


def test_only_get_health_skips_the_key_other_methods_need_it_and_then_get_405():
    engine = RecordingEngine("a")
    body = {"model": "m", "prompt": "x"}
    calls = [
        ("GET", "/health", None, {}),
        ("POST", "/health", body, {}),
        ("PUT", "/health", body, {}),
        ("DELETE", "/health", None, {}),
        ("OPTIONS", "/health", None, {}),
        ("GET", "/metrics", None, {}),
        ("POST", "/metrics", body, {}),
        ("POST", "/health", body, KEY),
        ("POST", "/metrics", body, KEY),
        ("POST", "/v1/models", body, KEY),
    ]
    results, _ = asyncio.run(with_router([engine], calls, api_key="open-sesame-0123456789"))
    assert [status for status, _ in results] == [200, 401, 401, 401, 401, 401, 401, 405, 405, 405]
    opened, _ = asyncio.run(
        with_router(
            [RecordingEngine("b")],
            [("GET", "/metrics", None, {}), ("POST", "/metrics", body, {}), ("PUT", "/metrics", body, {})],
            api_key="open-sesame-0123456789",
            protect_metrics=False,
        )
    )
    assert [status for status, _ in opened] == [200, 401, 401]
    assert engine.seen == []  # none of it reached an engine


# ---- item 1: a client's wrong request never counts against a replica ----


def test_client_errors_and_5xx_off_the_inference_paths_leave_the_replica_in_rotation():
    """12 wrong requests (400 from the engine) and 12 to a path where the engine does not run the model that it
    fails (500 on /tokenize): each passed on as it is, tried on one replica only, and the replicas' circuits stay
    closed, so the next completions are all served, by both."""

    def status(method, path, body):
        if path == "/tokenize":
            return 500
        return 400 if body.get("bad") else 200

    a, b = RecordingEngine("a", status=status), RecordingEngine("b", status=status)
    bad = {"model": "m", "prompt": "x", "bad": True}
    calls = [("POST", "/v1/completions", bad, KEY), ("POST", "/tokenize", {"model": "m", "prompt": "x"}, KEY)] * 12
    calls += [("POST", "/v1/completions", {"model": "m", "prompt": "x"}, KEY)] * 6
    results, router = asyncio.run(with_router([a, b], calls, api_key="open-sesame-0123456789"))
    assert [s for s, _ in results[:24]] == [400, 500] * 12
    assert [s for s, _ in results[24:]] == [200] * 6
    assert len(a.seen) + len(b.seen) == 30  # each request went to one replica: none was retried on another
    for name, engine in (("a", a), ("b", b)):
        breaker = router.replicas.table.by_replica[name].breaker
        assert breaker.state() == "closed" and breaker.failures == 0 and breaker.opened == 0
        assert any(not body.get("bad") for _, p, body in engine.seen if p == "/v1/completions")


def test_a_5xx_on_an_inference_path_still_counts_and_moves_on():
    a, b = RecordingEngine("a", status=lambda m, p, body: 500), RecordingEngine("b")
    results, router = asyncio.run(with_router([a, b], [("POST", "/v1/completions", {"model": "m"}, {})]))
    assert results[0][0] == 200 and len(a.seen) == len(b.seen) == 1
    assert router.replicas.table.by_replica["a"].breaker.failures == 1


# ---- item 4: a request during which the engine died goes to at most one more replica ----


@pytest.mark.parametrize(
    "body, health, moves_on",
    [
        (ENGINE_DEAD, 200, 1),  # vLLM's engine-dead error
        ({"error": {"message": "Internal Server Error"}}, 503, 1),  # a 500, then the replica's health is bad
        ({"error": {"message": "Internal Server Error"}}, 200, 2),  # a 500 from a replica still healthy
    ],
)
def test_an_engine_that_died_during_the_request_is_retried_at_most_once(body, health, moves_on, caplog):
    engines = [RecordingEngine(n, status=lambda m, p, b: 500, health=health, body=body) for n in "abc"]
    with caplog.at_level(logging.WARNING, logger="flagscale.router"):
        results, router = asyncio.run(
            with_router(engines, [("POST", "/v1/completions", {"model": "m"}, {})], max_migrations=2)
        )
    assert results[0][0] in (500, 502)
    assert [len(e.seen) for e in engines] == [1] * (moves_on + 1) + [0] * (2 - moves_on)
    if moves_on == 1:
        assert "its engine died" in caplog.text and "not sent to another replica" in caplog.text
        assert router.replicas.table.by_replica["a"].breaker.state() == "open"  # its engine is gone: out at once


def test_a_prompt_during_which_prefill_engines_died_goes_to_at_most_one_more_prefill_replica(caplog):
    prefills = [RecordingEngine(n, status=lambda m, p, b: 500, body=ENGINE_DEAD) for n in ("p0", "p1", "p2")]
    decode = FakeEngine("d0")
    body = {"model": "m", "prompt": "hello", "max_tokens": 4}
    with caplog.at_level(logging.WARNING, logger="flagscale.router"):
        status, raw = asyncio.run(through_pd_router(prefills, [decode], "/v1/completions", body))
    assert status == 502 and b"may be what kills them" in raw
    assert [len(p.seen) for p in prefills] == [1, 1, 0] and decode.bodies == []
    assert "its engine died" in caplog.text


# ---- item 5: client kv_transfer_params never reach an engine ----


def kv_free(body: dict) -> bool:
    return "kv_transfer_params" not in body and "kv_transfer_params" not in (body.get("vllm_xargs") or {})


def test_client_kv_transfer_params_are_dropped_everywhere_a_client_can_put_them():
    def failing_first(method, path, body):
        return 500 if body.get("retry") else 200

    a, b = RecordingEngine("a", status=failing_first), RecordingEngine("b")
    sneaky = {"kv_transfer_params": {"do_remote_prefill": True}, "vllm_xargs": {"kv_transfer_params": "x", "n": 1}}
    calls = [
        ("POST", "/v1/completions", {"model": "m", "prompt": "x", **sneaky}, {}),
        ("POST", "/invocations", {"model": "m", "prompt": "x", **sneaky}, {}),
        ("POST", "/v1/chat/completions", {"model": "m", "messages": [], "ec_transfer_params": {}, **sneaky}, {}),
        ("POST", "/v1/completions", {"model": "m", "prompt": "x", "retry": True, **sneaky}, {}),  # a's 500: to b
    ]
    results, _ = asyncio.run(with_router([a, b], calls))
    assert [s for s, _ in results] == [200, 200, 200, 200]
    bodies = [body for _, _, body in a.seen + b.seen]
    assert len(bodies) == 5 and all(kv_free(body) for body in bodies), bodies
    assert all(body["vllm_xargs"] == {"n": 1} for body in bodies)  # the rest of vllm_xargs is the engine's
    assert not any("ec_transfer_params" in body for body in bodies)


def test_client_kv_transfer_params_are_not_in_a_resumed_stream():
    body = {"model": "m", "prompt": "hello", "max_tokens": 12, "stream": True, "temperature": 0}
    body["vllm_xargs"] = {"kv_transfer_params": "x"}
    dying, spare = FakeEngine("dying", die_after=5), FakeEngine("spare")
    status, _, router = asyncio.run(stream_through_router([dying, spare], "/v1/completions", body))
    assert status == 200 and router.counters.resumed == 1
    sent = [b for _, b in dying.bodies + spare.bodies]
    assert len(sent) == 2 and all(kv_free(b) for b in sent), sent


def test_docs_list_each_engines_public_paths():
    """docs/operations.md's table of the paths passed on is each engine kind's public_paths."""
    import re
    from pathlib import Path

    from flagscale import engines

    docs = (Path(__file__).parents[2] / "docs" / "operations.md").read_text()
    for name in ("vllm", "llama_cpp"):
        (row,) = [line for line in docs.splitlines() if line.startswith(f"| {name} | ")]
        listed = re.findall(r"`([^`]+)`", row)
        assert sorted(listed) == sorted(re.sub(r"\{[^}]*\}", "{id}", p) for p in engines.get(name).public_paths)


class HeaderEngine(RecordingEngine):
    """A RecordingEngine that also keeps the headers of each request it is sent."""

    async def start(self) -> str:
        self.headers: list[dict[str, str]] = []

        async def handle(request: web.Request):
            if request.path == "/health":
                return web.Response(status=200)
            self.headers.append({k.lower(): v for k, v in request.headers.items()})
            return web.json_response({"choices": [{"text": "ok"}]})

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", handle)
        self.runner, port = await serve(app)
        return f"http://127.0.0.1:{port}"


def test_headers_an_engine_kind_asks_to_drop_never_reach_an_engine():
    # llama.cpp's X-Conversation-Id keeps a stream generating after its client hung up (issue 34, item 9)
    engine = HeaderEngine("a")
    headers = {**KEY, "X-Conversation-Id": "c1", "X-Other": "kept"}
    calls = [("POST", "/v1/completions", {"model": "m", "prompt": "x"}, headers)]
    results, _ = asyncio.run(with_router([engine], calls, api_key="open-sesame-0123456789"))
    assert results[0][0] == 200
    assert "x-conversation-id" not in engine.headers[0] and engine.headers[0]["x-other"] == "kept"
