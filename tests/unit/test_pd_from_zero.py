"""Scale from zero for a disaggregated model (docs/autoscaling.md): which pools the router is told may be at zero,
and, on real sockets against fake engines, what it does when one is: a prefill pool at zero is asked for a replica
while the decode pool computes the prompts itself; a request for a decode pool at zero waits for its replica before
any prefill; /health stays ok for both."""

from __future__ import annotations

import asyncio
import json

import aiohttp

from flagscale.config.load import ConfigSources, load_config
from flagscale.plan import build_plan
from flagscale.router import cold_start
from flagscale.router.replicas import ReplicaTable
from tests.conftest import router_listening
from tests.unit.fakes import FakeEngine, FakeHandle, FakePrefill, greedy, pd_router, text_of, tokenize

SOURCES = ConfigSources(main="conf/serve.yaml", serve="conf/serve/nodes.yaml")
BODY = {"model": "m", "prompt": "hello", "max_tokens": 4}
SCALING = {"min_replicas": 0, "max_replicas": 2, "downscale_delay_s": 60}


async def posted(router, engines) -> tuple[int, bytes]:
    """BODY through `router` (status, raw answer); the fake engines stopped after."""
    try:
        async with router_listening(router) as url, aiohttp.ClientSession() as client:
            async with client.post(f"{url}/v1/completions", json=BODY) as resp:
                return resp.status, await resp.read()
    finally:
        for engine in engines:
            await engine.runner.cleanup()


def test_the_router_is_told_which_pools_may_be_at_zero(demo_model_path, tmp_path):
    from flagscale.serve.app import router_spec

    node = {
        "serve_id": "m",
        "engine": "vllm",
        "engine_args": {"model": str(demo_model_path), "max_model_len": 256, "served_model_name": "m"},
        "disaggregation": {"prefill": {"resources": SCALING}, "decode": {"resources": {"num_replicas": 1}}},
    }
    experiment = {"exp_name": "t", "exp_dir": str(tmp_path / "e"), "runner": {"deploy": {"port": 18997}}}
    cfg = {"experiment": experiment, "serve": [node]}
    plan = build_plan(load_config(cfg, SOURCES), SOURCES, check_port=False)
    spec = router_spec(plan)
    prefill_id = next(e.serve_id for e in plan.engines if e.role == "prefill")
    assert spec.zero_pools == {"m": {"prefill": prefill_id}} and spec.scale_from_zero == {}

    node["disaggregation"]["decode"]["resources"] = SCALING
    plan = build_plan(load_config(cfg, SOURCES), SOURCES, check_port=False)
    spec = router_spec(plan)
    decode_id = next(e.serve_id for e in plan.engines if e.role == "decode")
    assert spec.zero_pools == {"m": {"prefill": prefill_id, "decode": decode_id}}
    assert set(spec.scale_from_zero) == {"m"}
    assert spec.reconfigured(spec.user_config()).zero_pools == spec.zero_pools  # through Serve's user_config


def test_a_prefill_pool_at_zero_is_woken_while_the_decode_pool_serves_alone():
    decode, handle = FakeEngine("d0"), FakeHandle()

    async def scenario():
        router, _ = await pd_router([], [decode])
        router.spec.zero_pools = {"m": {"prefill": "m-prefill"}}
        router.failover.cold_start = cold_start.ColdStart({"m-prefill": handle}, lambda serve_id: None)
        health = await router.frontend.health(None)
        return (health, *await posted(router, [decode]))

    health, status, answer = asyncio.run(scenario())
    assert health.status == 200 and health.text == "ok\n"
    assert status == 200 and json.loads(answer)["choices"][0]["text"] == text_of(greedy(tokenize("hello"), 4))
    ((_, decoded),) = decode.bodies
    assert "kv_transfer_params" not in decoded  # decode-only: the decode replica computed the prompt
    assert handle.wakes == 1


def test_a_request_waits_for_a_decode_pool_at_zero_before_any_prefill(monkeypatch):
    monkeypatch.setattr(cold_start, "POLL_S", 0.01)
    prefill, decode, handle = FakePrefill("p0"), FakeEngine("d0"), FakeHandle()
    prefills_when_decode_joined = []

    async def scenario():
        router, decodes = await pd_router([prefill], [decode])
        router.replicas.table.by_model = {"m": []}
        router.spec.scale_from_zero = {"m": 5.0}
        router.spec.zero_pools = {"m": {"decode": "m-decode"}}
        router.failover.cold_start = cold_start.ColdStart({"m-decode": handle}, lambda serve_id: None)
        health = await router.frontend.health(None)
        reads = []

        async def refresh():  # the registry read: the decode replica is listed from the third read on
            reads.append(1)
            if len(reads) == 3:
                prefills_when_decode_joined.append(len(prefill.bodies))
                router.replicas.table = ReplicaTable(
                    by_model={"m": decodes},
                    by_replica={u.record.replica_id: u for u in decodes},
                    prefill_by_model=router.replicas.table.prefill_by_model,
                )

        router.failover._refresh = refresh
        return (health, *await posted(router, [prefill, decode]))

    health, status, answer = asyncio.run(scenario())
    assert health.status == 200, health.text
    assert status == 200 and answer, answer
    assert handle.wakes == 1 and prefills_when_decode_joined == [0]
    ((_, decoded),) = decode.bodies
    assert decoded["kv_transfer_params"] == {"from": "p0"}  # prefilled once the decode replica was there
