"""Rotating the API key (issue 56, item 6): which client keys a router accepts and until when (keyring.py), what
an update hands the router before and after it is done (actions/key_rotation.py), a new key reaching a running
router in place, and an engine's 401 never reaching a client (the key it refused was the router's)."""

from __future__ import annotations

import asyncio
import json
import stat
import time
from types import SimpleNamespace

import aiohttp
from rich.console import Console

from flagscale.actions import key_rotation
from flagscale.config.load import ConfigSources, load_config
from flagscale.plan import build_plan
from flagscale.router import keyring, peers
from flagscale.router.keyring import AcceptedKey, accepts, client_digest, current_keys, rotated
from flagscale.router.verdict import Verdict, judge
from flagscale.serve.app import engine_spec, router_spec
from tests.conftest import bare_router, router_listening
from tests.unit.fakes import FakeEngine, events, streamed_text, through_router

SECRET = "s" * 64
OLD, NEW = "old-key-0123456789abcdef", "new-key-0123456789abcdef"


def bearer(key: str) -> str:
    return f"Bearer {key}"


# ---- keyring: pure ----


def test_a_rotation_keeps_the_replaced_key_until_its_end_and_no_longer():
    old, new = client_digest(SECRET, OLD), client_digest(SECRET, NEW)
    running = current_keys(SECRET, OLD)
    assert running == (AcceptedKey(old),)
    keys = rotated(running, new, now=100.0, retire_by=160.0)
    assert keys == (AcceptedKey(new), AcceptedKey(old, 160.0))
    assert accepts(keys, SECRET, bearer(NEW), 150.0) and accepts(keys, SECRET, bearer(OLD), 159.9)
    assert not accepts(keys, SECRET, bearer(OLD), 160.0) and accepts(keys, SECRET, bearer(NEW), 1e12)
    # a later step only brings an end nearer, never further
    assert rotated(keys, new, now=120.0, retire_by=130.0) == (AcceptedKey(new), AcceptedKey(old, 130.0))
    assert rotated(keys, new, now=120.0, retire_by=900.0) == keys
    # an ended key is dropped; going back to the replaced key makes the current one the replaced one
    assert rotated(keys, new, now=170.0, retire_by=230.0) == (AcceptedKey(new),)
    assert rotated(keys, old, now=120.0, retire_by=180.0) == (AcceptedKey(old), AcceptedKey(new, 180.0))


def test_no_key_accepts_nothing_more_and_at_most_a_few_replaced_keys_are_kept():
    assert rotated(current_keys(SECRET, OLD), None, now=0.0, retire_by=60.0) == ()  # keyless: every request passes
    assert current_keys(SECRET, None) == ()
    keys: tuple = ()
    for i in range(6):
        keys = rotated(keys, client_digest(SECRET, f"key-{i}-0123456789abcdef"), now=float(i), retire_by=100.0)
    assert len(keys) == 1 + keyring.MAX_RETIRING and keys[1].digest == client_digest(SECRET, "key-4-0123456789abcdef")


def test_a_key_is_accepted_only_whole_as_a_bearer_token_under_this_deployments_secret():
    keys = current_keys(SECRET, NEW)
    for wrong in ("", NEW, f"bearer {NEW}", f"Bearer  {NEW}", bearer(NEW + "x"), bearer(NEW[:-1]), "Bearer \udcff"):
        assert not accepts(keys, SECRET, wrong, 0.0), wrong
    assert not accepts(keys, "t" * 64, bearer(NEW), 0.0)
    assert NEW not in json.dumps([k.__dict__ for k in keys])  # what Serve's status shows: a digest, not the key
    assert keyring.keys_from_json(json.loads(json.dumps([k.__dict__ for k in keys]))) == keys


def test_an_engines_401_is_the_replicas_fault_never_the_clients():
    assert judge(401, True) is Verdict.KEY_REFUSED and judge(401, False) is Verdict.KEY_REFUSED
    assert judge(400, True) is Verdict.OK and judge(403, True) is Verdict.OK


# ---- what run hands the router ----


def plan_of(tmp_path, key: str | None, grace: float = 30.0):
    return SimpleNamespace(
        exp_dir=str(tmp_path), api_key=key, startup_timeout_s=600.0, old_key_grace_s=grace, app_name="a"
    )


def test_an_update_keeps_the_old_key_until_its_own_bound_then_old_key_grace_s_after_it_is_done(tmp_path):
    secret = peers.secret_of(tmp_path)
    running = current_keys(secret, OLD)
    now = time.time()
    during = key_rotation.during_update(plan_of(tmp_path, NEW), running, now=now)
    bound = now + 600.0 + key_rotation.UPDATE_MARGIN_S + 30.0
    assert during == (AcceptedKey(client_digest(secret, NEW)), AcceptedKey(client_digest(secret, OLD), bound))
    handed = []
    final = key_rotation.finish(plan_of(tmp_path, NEW), during, handed.append, Console(file=None, quiet=True))
    assert handed == [final] and final[1].until is not None and final[1].until <= time.time() + 30.0
    assert final[0] == during[0]
    # the same key again, or a key first set: nothing to retire, nothing handed again
    same = key_rotation.during_update(plan_of(tmp_path, NEW), final[:1], now=time.time())
    assert same == final[:1] and key_rotation.finish(plan_of(tmp_path, NEW), same, handed.append, Console()) == same
    assert len(handed) == 1


def test_a_grace_of_zero_refuses_the_old_key_once_the_update_is_done(tmp_path):
    secret = peers.secret_of(tmp_path)
    during = key_rotation.during_update(plan_of(tmp_path, NEW, grace=0), current_keys(secret, OLD), now=time.time())
    final = key_rotation.finish(plan_of(tmp_path, NEW, grace=0), during, lambda _keys: None, Console(quiet=True))
    assert not accepts(final, secret, bearer(OLD), time.time()) and accepts(final, secret, bearer(NEW), time.time())


def real_plan(tmp_path, demo_model_path, key: str | None):
    deploy = {"port": 8123, "old_key_grace_s": 45, **({"api_key": key} if key else {})}
    config = {
        "experiment": {"exp_name": "t", "exp_dir": str(tmp_path), "runner": {"deploy": deploy}},
        "serve": [{"serve_id": "m", "engine": "vllm", "engine_args": {"model": str(demo_model_path)}}],
        "action": "run",
    }
    sources = ConfigSources(main="conf/serve.yaml", serve="conf/serve/m.yaml")
    return build_plan(load_config(config, sources), sources, check_port=False)


def test_the_engines_get_the_deployments_own_key_which_a_new_client_key_does_not_change(tmp_path, demo_model_path):
    with_old, with_new = real_plan(tmp_path, demo_model_path, OLD), real_plan(tmp_path, demo_model_path, NEW)
    assert with_new.old_key_grace_s == 45
    old_engine, new_engine = engine_spec(with_old, with_old.engines[0]), engine_spec(with_new, with_new.engines[0])
    assert old_engine.api_key == new_engine.api_key == keyring.engine_key(tmp_path)
    assert old_engine.version == new_engine.version  # a new client key replaces no engine
    assert stat.S_IMODE((tmp_path / keyring.ENGINE_KEY_FILE).stat().st_mode) == 0o600
    keyless = real_plan(tmp_path, demo_model_path, None)
    assert engine_spec(keyless, keyless.engines[0]).api_key is None
    spec = router_spec(with_new)
    assert spec.engine_key == keyring.engine_key(tmp_path)
    assert accepts(spec.client_keys, spec.peer_secret, bearer(NEW), time.time())
    assert not accepts(spec.client_keys, spec.peer_secret, bearer(OLD), time.time())
    assert NEW not in json.dumps(spec.user_config(), default=str) and "engine_key" not in spec.user_config()


# ---- the router ----


def test_a_new_key_reaches_a_running_router_in_place_and_the_old_one_ends_when_told():
    async def main():
        router = bare_router([], "least_load")
        router.spec.peer_secret = SECRET
        router.spec = router.spec.with_api_key(OLD)
        statuses = []
        async with router_listening(router) as url, aiohttp.ClientSession() as client:

            async def status(key):
                async with client.get(f"{url}/v1/models", headers={"Authorization": bearer(key)}) as resp:
                    return resp.status

            statuses.append((await status(OLD), await status(NEW)))
            config = router.spec.user_config()
            config["client_keys"] = [
                k.__dict__ for k in rotated(router.spec.client_keys, client_digest(SECRET, NEW), 0, 1e12)
            ]
            router.reconfigure(json.loads(json.dumps(config)))  # as Serve hands it: JSON
            statuses.append((await status(OLD), await status(NEW)))
            config["client_keys"][1]["until"] = time.time()
            router.reconfigure(config)
            statuses.append((await status(OLD), await status(NEW)))
        return statuses

    assert asyncio.run(main()) == [(200, 401), (200, 200), (401, 200)]


def test_an_engine_that_refuses_the_routers_key_hands_the_request_on_and_its_401_reaches_no_client():
    body = {"model": "m", "prompt": "hello there", "max_tokens": 12, "stream": True}
    status, raw, router = asyncio.run(
        through_router([FakeEngine("a", status=401), FakeEngine("b")], "/v1/completions", body)
    )
    assert status == 200 and events(raw)[-1] == "[DONE]"
    metrics = router.metrics.key_refusals.labels("m")._value.get()
    assert metrics == 1

    # mid-stream: the replica that should go on with it refuses the key too; the next one finishes it
    engines = [FakeEngine("a", die_after=4), FakeEngine("b", status=401), FakeEngine("c")]
    status, raw, _ = asyncio.run(through_router(engines, "/v1/completions", body, max_migrations=3))
    whole = asyncio.run(through_router([FakeEngine("d")], "/v1/completions", body))[1]
    assert status == 200 and streamed_text(raw) == streamed_text(whole) and events(raw)[-1] == "[DONE]"

    # no replica takes the router's key: a 502 that says so, not the engine's 401
    plain = {"model": "m", "prompt": "hello there", "max_tokens": 4}
    status, raw, _ = asyncio.run(
        through_router([FakeEngine("a", status=401), FakeEngine("b", status=401)], "/v1/completions", plain)
    )
    assert status == 502 and b"refused the router's engine key" in raw
