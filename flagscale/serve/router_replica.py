"""The router deployment's Serve replica: it starts one router process (flagscale/serve/router_process.py) and
passes on to it what Serve and the actions ask - an update's spec, stats, drain - while Serve places it,
health-checks it and restarts it.

A replica and its process live and die together: the replica's health check fails once its process has exited
(Serve then starts both again), and the process exits when the replica's end of their socket pair closes, which
happens however the replica ends (its __del__ stops the process first when Serve shuts it down gracefully).
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from dataclasses import asdict
from pathlib import Path
from typing import Any

import flagscale
from flagscale.serve.router import RouterSpec
from flagscale.serve.router_process import STARTUP_TIMEOUT_S, StartMessage

log = logging.getLogger("flagscale.router")

CONTROL_TIMEOUT_S = 30.0  # a reconfigure (with its replica-table refresh) or a stats call
STOP_TIMEOUT_S = 10.0  # SIGTERM to exit, then SIGKILL


class _UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("router-process", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(self._path)
        self.sock = sock


class RouterReplica:
    def __init__(self, spec: RouterSpec, *engines, graph=None):
        self.spec = spec
        self._engines = engines  # handles keep the engine deployments part of this application
        self._dir = tempfile.mkdtemp(prefix="flagscale-router-")  # mode 0700: the control socket is this user's
        self._control = os.path.join(self._dir, "control.sock")
        self._graph_server = _GraphServer(graph, os.path.join(self._dir, "graph.sock")) if graph else None
        self._proc: subprocess.Popen | None = None
        self._link: socket.socket | None = None
        try:
            self._start_process()
        except BaseException:
            self._stop_process()
            raise

    def _start_process(self) -> None:
        from flagscale.cluster import ray_compat

        start = StartMessage(
            spec=asdict(self.spec),
            control_socket=self._control,
            graph_socket=self._graph_server.path if self._graph_server else None,
            gcs_address=ray_compat.gcs_address(),  # the replica registry is there
            pin_node_id=_node_id() if self.spec.pin_cpus else None,
        )
        ours, theirs = socket.socketpair()
        self._link = ours
        env = dict(os.environ)
        # the flagscale package may be a runtime env's py_modules, which a plain python does not see
        package_root = str(Path(flagscale.__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
        argv = [sys.executable, "-m", "flagscale.serve.router_process", "--fd", str(theirs.fileno())]
        self._proc = subprocess.Popen(argv, pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, env=env)
        theirs.close()
        ours.sendall(json.dumps(asdict(start)).encode() + b"\n")
        ours.settimeout(STARTUP_TIMEOUT_S + 10)
        where = f"{self.spec.host}:{self.spec.port}"
        try:
            line = ours.makefile("rb").readline()
        except TimeoutError:
            raise RuntimeError(
                f"router process {self._proc.pid} did not start listening on {where} "
                f"within {STARTUP_TIMEOUT_S + 10:.0f}s"
            ) from None
        answer = json.loads(line) if line else {}
        if "pid" not in answer:
            code = self._proc.wait(STOP_TIMEOUT_S)
            cause = answer.get("error") or f"it exited with code {code} (its output is in this replica's log)"
            raise RuntimeError(f"router cannot listen on {where}: {cause}")
        ours.settimeout(None)
        log.info("router process %d listening on %s", self._proc.pid, where)

    def _call(self, method: str, path: str, body: Any = None, timeout: float = CONTROL_TIMEOUT_S) -> Any:
        conn = _UnixHTTPConnection(self._control, timeout)
        try:
            data = json.dumps(body).encode() if body is not None else None
            conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            text = resp.read()
        finally:
            conn.close()
        if resp.status != 200:
            raise RuntimeError(f"router process {self._proc.pid}: {method} {path}: {resp.status} {text.decode()}")
        return json.loads(text)

    # ---- what Serve and the actions call --------------------------------------------------------

    def reconfigure(self, config: dict[str, Any]) -> None:
        """An update's router spec (Serve's user_config): applied by the process in place."""
        self.spec = self.spec.reconfigured(config)
        self._call("POST", "/reconfigure", config)

    def check_health(self) -> None:
        code = self._proc.poll()
        if code is not None:
            raise RuntimeError(f"router process {self._proc.pid} exited with code {code}")

    async def drain(self, timeout_s: float) -> int:
        """Every router process of the deployment stops taking requests; waits (bounded) for those in flight and
        returns how many were left."""
        answer = await asyncio.to_thread(self._call, "POST", "/drain", {"timeout_s": timeout_s}, timeout_s + 10)
        return answer["left"]

    def stats(self) -> dict:
        return self._call("GET", "/stats")

    def __del__(self) -> None:
        self._stop_process()

    def _stop_process(self) -> None:
        proc, self._proc = getattr(self, "_proc", None), None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        link, self._link = getattr(self, "_link", None), None
        if link is not None:
            link.close()
        if getattr(self, "_graph_server", None) is not None:
            self._graph_server.stop()
        if getattr(self, "_dir", None):
            shutil.rmtree(self._dir, ignore_errors=True)


def _node_id() -> str:
    import ray

    return ray.get_runtime_context().get_node_id()


class _GraphServer:
    """POST /run on a Unix socket, for the router process: the graph driver's reply to the body (JSON), with the
    timings when ?trace=1. On a loop thread of its own, as Ray handles are awaited from any loop."""

    def __init__(self, driver, path: str) -> None:
        self.driver = driver
        self.path = path
        self._loop = asyncio.new_event_loop()
        self._runner = None
        started = threading.Event()
        threading.Thread(target=self._serve, args=(started,), name="flagscale-graph-entry", daemon=True).start()
        if not started.wait(30):
            raise RuntimeError(f"the graph entry did not start listening on {path} within 30s")

    def _serve(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._listen())
        started.set()
        self._loop.run_forever()

    async def _listen(self) -> None:
        from aiohttp import web

        app = web.Application(client_max_size=1 << 30)  # the router process bounds bodies (max_body_bytes)
        app.router.add_post("/run", self._run)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.UnixSite(self._runner, self.path).start()

    async def _run(self, request):
        from aiohttp import web

        from flagscale.serve.resume import dumps, loads

        payload = loads(await request.read())
        try:
            reply = await self.driver.run.remote(payload, request.query.get("trace") == "1")
        except Exception as exc:
            return web.Response(status=502, text=str(exc))
        try:
            body = dumps(reply)
        except TypeError as exc:
            reply = {"status": 500, "kind": "InternalServerError"}
            reply["error"] = f"the sink's output is not JSON serializable: {exc}"
            body = dumps(reply)
        return web.Response(body=body, content_type="application/json")

    def stop(self) -> None:
        if self._runner is not None:
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)
