"""The engine side of the API key and of secrets: the key check in front of a vLLM server (against a real ASGI app),
engine calls from custom nodes carrying the key (against a real HTTP server), secret engine args kept out of argv,
the engine's whole process group stopped, the GPU start lock private to the user."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from fastapi import FastAPI, WebSocket
from fastapi.testclient import TestClient
from starlette.websockets import WebSocketDisconnect

from flagscale.cluster.tempdirs import UnsafeDirectory
from flagscale.engines.vllm_auth import RequireApiKey
from tests.conftest import wait_for

KEY = "engine-secret"
# vLLM's routes that its own --api-key check leaves open (it guards /v1, /v2, /inference, /cohere only)
OPEN_IN_VLLM = ("/invocations", "/tokenize", "/detokenize", "/metrics", "/ping", "/version", "/load")


def vllm_like_app() -> FastAPI:
    app = FastAPI()
    for path in (*OPEN_IN_VLLM, "/v1/completions", "/v1/models", "/health"):
        app.add_api_route(path, lambda: {"ok": True}, methods=["GET", "POST"])

    @app.websocket("/v1/realtime")
    async def realtime(ws: WebSocket):
        await ws.accept()
        await ws.send_text("hello")
        await ws.close()

    return app


@pytest.fixture
def guarded(monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", KEY)
    app = vllm_like_app()
    app.add_middleware(RequireApiKey)  # as vLLM adds a --middleware class: no arguments
    return TestClient(app)


@pytest.mark.parametrize("path", [*OPEN_IN_VLLM, "/v1/completions", "/v1/models", "/nope"])
def test_every_path_but_health_needs_the_key(guarded, path):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"}):
        resp = guarded.post(path, json={}, headers=headers)
        assert resp.status_code == 401, (path, headers)
        assert resp.json()["error"]["code"] == "invalid_api_key"
    assert guarded.get(path, headers={"Authorization": "Bearer " + KEY}).status_code != 401
    assert guarded.options(path).status_code == 401


def test_health_is_open_and_a_websocket_needs_the_key(guarded):
    assert guarded.get("/health").status_code == 200
    with pytest.raises(WebSocketDisconnect):
        with guarded.websocket_connect("/v1/realtime") as ws:
            ws.receive_text()
    with guarded.websocket_connect("/v1/realtime", headers={"Authorization": f"Bearer {KEY}"}) as ws:
        assert ws.receive_text() == "hello"


def test_without_a_key_the_middleware_lets_everything_pass(monkeypatch):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    app = vllm_like_app()
    app.add_middleware(RequireApiKey)
    assert TestClient(app).post("/invocations", json={}).status_code == 200


def test_custom_node_engine_calls_carry_the_key():
    from aiohttp import web

    from flagscale.serve.graph import EngineClient, NodeSpec

    seen: list[str | None] = []

    async def completions(request):
        seen.append(request.headers.get("Authorization"))
        return web.json_response({"choices": [{"text": "ok"}]})

    async def scenario() -> str:
        app = web.Application()
        app.router.add_post("/v1/completions", completions)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        try:
            return await EngineClient(f"http://127.0.0.1:{port}", "demo", api_key=KEY).generate("hi")
        finally:
            await runner.cleanup()

    assert asyncio.run(scenario()) == "ok"
    assert seen == [f"Bearer {KEY}"]
    spec = NodeSpec("n", "/m.py", "C", {"engine": ("http://x", "demo")}, "d", api_key=KEY)
    assert KEY not in repr(spec) and KEY not in repr(EngineClient("http://x", "demo", api_key=KEY))


def test_secret_engine_args_go_to_the_env_not_the_argv(demo_model_path):
    from flagscale.config.load import ConfigSources, load_config
    from flagscale.errors import ConfigError
    from flagscale.plan import build_plan
    from flagscale.serve.app import engine_spec

    sources = ConfigSources(main="conf/serve.yaml", serve="conf/serve/x.yaml")
    cfg = {
        "experiment": {
            "exp_name": "t",
            "exp_dir": "/tmp/t",
            "task": {"type": "serve"},
            "runner": {"hostfile": None, "deploy": {"port": 8123}},
        },
        "serve": [
            {
                "serve_id": "m",
                "engine": "vllm",
                "engine_args": {"model": str(demo_model_path), "max_model_len": 64, "hf_token": "hf_secret"},
            }
        ],
        "action": "run",
    }
    plan = build_plan(load_config(cfg, sources), sources, check_port=False)
    engine = plan.engines[0]
    assert "hf_secret" not in " ".join(engine.argv) and "--hf-token" not in engine.argv
    assert "hf_secret" not in repr(engine) and "hf_secret" not in repr(plan)
    assert engine_spec(plan, engine).env["HF_TOKEN"] == "hf_secret"

    cfg["serve"][0]["engine_args"]["api_key"] = "k"
    with pytest.raises(ConfigError) as info:
        build_plan(load_config(cfg, sources), sources, check_port=False)
    assert "conf/serve/x.yaml: serve[0](m).engine_args.api_key" in str(info.value)
    assert "deploy.api_key_env" in str(info.value)


IGNORES_SIGTERM = (
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(600)"
)


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_terminate_stops_the_server_the_wrapper_started(tmp_path):
    """A server that ignores SIGTERM outlived the engine_proc wrapper, which alone got the SIGKILL."""
    from flagscale.replica.process import spawn_engine, terminate_engine

    argv = [sys.executable, "-m", "flagscale.replica.engine_proc", sys.executable, "-c", IGNORES_SIGTERM]
    with open(tmp_path / "log", "wb") as log:
        proc = spawn_engine(argv, log, dict(os.environ))
    wait_for(lambda: (tmp_path / "log").read_text().startswith("up"), 30, "the server to start")
    server = int(subprocess.check_output(["pgrep", "-P", str(proc.pid)], text=True).split()[0])
    assert os.getsid(server) == os.getsid(0), "a new session would escape stop's session scan"
    try:
        terminate_engine(proc, grace_s=1)
        assert proc.returncode is not None
        wait_for(lambda: not alive(server), 10, "the wrapper's server to be gone")
    finally:
        if alive(server):
            os.kill(server, signal.SIGKILL)


def test_gpu_start_lock_is_private_to_the_user(tmp_path, monkeypatch):
    from flagscale.replica import startup_lock

    monkeypatch.setattr(startup_lock.tempfile, "gettempdir", lambda: str(tmp_path))
    with startup_lock.gpu_start_lock(["0"], 5):
        path = startup_lock.lock_path("0")
        assert path.parent == tmp_path / f"flagscale-{os.getuid()}"
        assert path.stat().st_mode & 0o777 == 0o600
        assert path.parent.stat().st_mode & 0o777 == 0o700


@pytest.mark.parametrize("problem", ["others_write", "other_owner", "link"])
def test_gpu_start_lock_never_uses_a_directory_that_is_not_the_users_alone(tmp_path, monkeypatch, problem):
    """A base of ours that others may write to is refused, naming it; one that is not ours (another user made it
    first, or a link) is left alone: the lock goes to a private directory under the user's own cache instead."""
    from flagscale.replica import startup_lock

    monkeypatch.setattr(startup_lock.tempfile, "gettempdir", lambda: str(tmp_path))
    monkeypatch.setenv("FLAGSCALE_CACHE", str(tmp_path / "cache"))
    directory = tmp_path / f"flagscale-{os.getuid()}"
    if problem == "link":
        (tmp_path / "elsewhere").mkdir(mode=0o700)
        directory.symlink_to(tmp_path / "elsewhere")
    else:
        directory.mkdir()
        directory.chmod(0o777 if problem == "others_write" else 0o700)
        if problem == "other_owner":
            if os.getuid() != 0:
                pytest.skip("only root can give a directory to another user")
            os.chown(directory, 12345, 12345)
    if problem == "others_write":
        with pytest.raises(UnsafeDirectory) as info:
            with startup_lock.gpu_start_lock(["0"], 5):
                pass
        assert str(directory) in str(info.value)
    else:
        with startup_lock.gpu_start_lock(["0"], 5):
            path = startup_lock.lock_path("0")
            assert path.parent == tmp_path / "cache" / "tmp"
            assert path.stat().st_mode & 0o777 == 0o600 and path.parent.stat().st_mode & 0o777 == 0o700
    assert not any(Path(directory).iterdir()) if problem != "link" else not any((tmp_path / "elsewhere").iterdir())
