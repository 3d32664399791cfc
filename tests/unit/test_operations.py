"""The endpoint's /metrics (every replica's series, labelled, plus the router's own) and its API key, on real
sockets against fake engines; and the key's config (never printed, an unset api_key_env refused)."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from flagscale.config.load import ConfigSources, load_config
from flagscale.errors import ConfigError
from flagscale.plan import build_plan
from flagscale.router.metrics import merge_replica_metrics
from tests.conftest import bare_router, router_listening, serve
from tests.unit.fakes import started_upstreams

ENGINE_METRICS = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} %d
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="m"} 12.0
# HELP vllm:e2e_request_latency_seconds Histogram of e2e request latency in seconds.
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_bucket{engine="0",le="1.0",model_name="m"} 1.0
vllm:e2e_request_latency_seconds_bucket{engine="0",le="+Inf",model_name="m"} 1.0
vllm:e2e_request_latency_seconds_count{engine="0",model_name="m"} 1.0
vllm:e2e_request_latency_seconds_sum{engine="0",model_name="m"} 0.5
"""


def test_replica_series_are_merged_by_family_with_replica_labels():
    text = merge_replica_metrics(
        [
            ({"serve_id": "s", "replica": "a", "role": "colocated", "host": "10.0.0.1"}, ENGINE_METRICS % 3),
            ({"serve_id": "s", "replica": "b", "role": "colocated", "host": "10.0.0.2"}, ENGINE_METRICS % 5),
        ]
    )
    families = {f.name: f for f in text_string_to_metric_families(text)}  # a strict parser: one block per family
    running = {s.labels["replica"]: s.value for s in families["vllm:num_requests_running"].samples}
    assert running == {"a": 3, "b": 5}
    assert {s.labels["host"] for s in families["vllm:e2e_request_latency_seconds"].samples} == {"10.0.0.1", "10.0.0.2"}
    assert text.count("# TYPE vllm:num_requests_running gauge") == 1


class FakeEngine:
    def __init__(self, name: str, running: int, answer_metrics: bool = True):
        self.name, self.running, self.answer_metrics = name, running, answer_metrics
        self.authorization: list[str | None] = []

    async def start(self) -> str:
        async def metrics(request):
            if not self.answer_metrics:
                await asyncio.sleep(2)
            return web.Response(text=ENGINE_METRICS % self.running)

        async def complete(request):
            self.authorization.append(request.headers.get("Authorization"))
            return web.json_response({"choices": [{"text": "ok"}]})

        app = web.Application()
        app.router.add_get("/metrics", metrics)
        app.router.add_post("/v1/completions", complete)
        self.runner, port = await serve(app)
        return f"http://127.0.0.1:{port}"


async def with_router(engines, api_key=None, protect_metrics=None, calls=()):
    router = bare_router(await started_upstreams(engines), "least_load")
    router.spec = router.spec.with_api_key(api_key)
    if protect_metrics is not None:
        router.spec.protect_metrics = protect_metrics
    results = []
    try:
        async with router_listening(router) as url, aiohttp.ClientSession() as client:
            for method, path, headers in calls:
                body = {"model": "m", "prompt": "x"} if method == "POST" else None
                async with client.request(method, f"{url}{path}", json=body, headers=headers) as r:
                    results.append((r.status, await r.text()))
    finally:
        for engine in engines:
            await engine.runner.cleanup()
    return results, router


def test_metrics_show_every_replica_and_the_router_and_skip_a_silent_one(monkeypatch):
    monkeypatch.setattr("flagscale.router.frontend.SCRAPE_TIMEOUT_S", 0.5)
    engines = [FakeEngine("a", 1), FakeEngine("b", 2), FakeEngine("silent", 9, answer_metrics=False)]
    calls = [("POST", "/v1/completions", {}), ("GET", "/metrics", {})]
    (completion, (status, text)), _ = asyncio.run(with_router(engines, calls=calls))
    assert completion[0] == 200 and status == 200
    families = {f.name: f for f in text_string_to_metric_families(text)}
    running = {s.labels["replica"]: s.value for s in families["vllm:num_requests_running"].samples}
    assert running == {"a": 1, "b": 2}  # the silent replica is left out ...
    assert families["flagscale_router_metrics_scrape_failures"].samples[0].value == 1  # ... and counted
    (served,) = [s for s in families["flagscale_router_requests"].samples if s.name.endswith("_total")]
    assert {k: v for k, v in served.labels.items() if k != "router_process"} == {"model": "m", "status": "200"}
    assert served.labels["router_process"] and served.value == 1  # which router process counted it
    assert "flagscale_router_time_to_first_byte_seconds" in families


def test_api_key_is_required_everywhere_but_health_and_reaches_the_engines():
    engine = FakeEngine("a", 1)
    good = {"Authorization": "Bearer open-sesame-0123456789"}
    calls = [
        ("POST", "/v1/completions", {}),
        ("POST", "/v1/completions", {"Authorization": "Bearer wrong"}),
        ("POST", "/v1/completions", good),
        ("GET", "/health", {}),
        ("GET", "/metrics", {}),  # protected by default: Prometheus sends the key as a bearer token
        ("GET", "/metrics", good),
    ]
    results, _ = asyncio.run(with_router([engine], api_key="open-sesame-0123456789", calls=calls))
    statuses = [status for status, _ in results]
    assert statuses == [401, 401, 200, 200, 401, 200]
    assert '"code": "invalid_api_key"' in results[0][1] and "open-sesame-0123456789" not in results[0][1]
    assert engine.authorization == [
        "Bearer open-sesame-0123456789"
    ]  # only the good one reached the engine, with the key
    opted_out, _ = asyncio.run(
        with_router(
            [FakeEngine("b", 1)],
            api_key="open-sesame-0123456789",
            protect_metrics=False,
            calls=[("GET", "/metrics", {})],
        )
    )
    assert opted_out[0][0] == 200


def config_with(deploy: dict, demo_model_path) -> dict:
    return {
        "experiment": {
            "exp_name": "t",
            "exp_dir": "/tmp/t",
            "runner": {"deploy": {"port": 8123, **deploy}},
        },
        "serve": [{"serve_id": "m", "engine": "vllm", "engine_args": {"model": str(demo_model_path)}}],
        "action": "run",
    }


def test_api_key_env_must_be_set_and_the_key_is_never_printed(demo_model_path, monkeypatch, capsys):
    sources = ConfigSources(main="conf/serve.yaml", serve="conf/serve/m.yaml")
    monkeypatch.delenv("FS_TEST_KEY", raising=False)
    config = load_config(config_with({"api_key_env": "FS_TEST_KEY"}, demo_model_path), sources)
    with pytest.raises(ConfigError) as info:
        build_plan(config, sources, check_port=False)
    assert "deploy.api_key_env" in str(info.value) and "FS_TEST_KEY" in str(info.value)
    monkeypatch.setenv("FS_TEST_KEY", "open-sesame-0123456789")
    plan = build_plan(config, sources, check_port=False)
    assert plan.api_key == "open-sesame-0123456789" and "open-sesame-0123456789" not in repr(plan)
    with pytest.raises(ConfigError, match="not both"):
        load_config(
            config_with({"api_key": "a-0123456789abcdef", "api_key_env": "FS_TEST_KEY"}, demo_model_path), sources
        )

    from rich.console import Console

    from flagscale.actions.dryrun import dryrun

    inline = load_config(config_with({"api_key": "open-sesame-0123456789"}, demo_model_path), sources)
    dryrun(inline, build_plan(inline, sources, check_port=False), Console(width=200))
    assert "open-sesame-0123456789" not in capsys.readouterr().out
