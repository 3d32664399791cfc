"""A router process: the Router (flagscale/serve/router.py) serving on its own event loop, in a process that is not
a Ray worker.

The router deployment's Serve replica (flagscale/serve/router_replica.py) starts it and is its only link to Serve:
Serve places, health-checks, reconfigures, drains and restarts the replica, and the replica passes each of these
on. Why a process of its own: in a Serve replica, Ray's threads (the replica's own event loop, metrics pushes,
the core worker's callbacks) take Python's GIL many times a second, and the router's per-chunk work waited
for it: the same router used about twice the CPU per streamed token inside the replica as alone
(docs/benchmarks.md). What the process still needs of Ray - the replica registry, the other router processes'
reports, the drain request - is in the GCS key-value store, which it reads through a GCS client of its own
(ray_compat.connect_kv).

Between the replica and its process (python -m flagscale.serve.router_process --fd N):
- a socket pair, the process's end being fd N: the replica sends one JSON line (StartMessage); the process answers
  one line, {"pid": ...} once it listens or {"error": "..."}; then the process keeps reading, and the end of
  the stream means the replica is gone: the process exits with it.
- the control socket, a Unix socket in a directory only this user can enter, on which the process answers the
  replica's calls: POST /reconfigure (an update's RouterSpec.user_config), GET /stats, POST /drain.
- the graph socket, when the config has custom nodes: the replica serves POST /run there, which calls the graph
  driver (a Serve deployment, reachable only through a Ray handle) and answers with its reply.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import socket
import sys
import threading
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("flagscale.router")

STARTUP_TIMEOUT_S = 60.0  # from the start message to listening (imports, the GCS, the first replica table)


@dataclass
class StartMessage:
    spec: dict[str, Any]  # RouterSpec, asdict (the API key included: it travels on the socket pair only)
    control_socket: str
    graph_socket: str | None = None
    gcs_address: str | None = None  # None: no Ray (a benchmark's stand-in registry, no peers)
    pin_node_id: str | None = None  # the Ray node this runs on, for spec.pin_cpus


class GraphClient:
    """The graph's entry as the Router calls it: the replica's graph socket."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._session = None

    async def __call__(self, payload: Any, with_trace: bool) -> dict[str, Any]:
        import aiohttp

        from flagscale.serve.resume import dumps, loads

        if self._session is None:
            self._session = aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=self.path))
        params = {"trace": "1" if with_trace else "0"}
        async with self._session.post("http://router-replica/run", data=dumps(payload), params=params) as resp:
            if resp.status != 200:
                raise RuntimeError(await resp.text())
            return loads(await resp.read())


def control_app(router):
    from aiohttp import web

    async def reconfigure(request):
        router.reconfigure(await request.json())
        await router.refresh()
        return web.json_response({"ok": True})

    async def stats(request):
        return web.json_response(await router.stats())

    async def drain(request):
        asked = await request.json()
        return web.json_response({"left": await router.drain(float(asked["timeout_s"]))})

    app = web.Application()
    app.router.add_post("/reconfigure", reconfigure)
    app.router.add_get("/stats", stats)
    app.router.add_post("/drain", drain)
    return app


def _exit_with_replica(link: socket.socket) -> None:
    """Block until the replica's end of the socket pair closes (it exited, or was killed), then exit."""
    while True:
        try:
            if not link.recv(4096):
                break
        except OSError:
            break
    log.info("the router replica is gone: router process %d exits", os.getpid())
    os._exit(0)


def _read_line(link: socket.socket) -> bytes:
    data = b""
    while not data.endswith(b"\n"):
        chunk = link.recv(65536)
        if not chunk:
            raise SystemExit("the router replica closed the socket pair before sending the start message")
        data += chunk
    return data


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fd", type=int, required=True, help="this process's end of the socket pair")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    link = socket.socket(fileno=args.fd)
    start = StartMessage(**json.loads(_read_line(link)))

    def answer(message: dict[str, Any]) -> None:
        link.sendall(json.dumps(message).encode() + b"\n")

    try:
        from setproctitle import setproctitle

        setproctitle(f"flagscale::router {start.spec['app']}")
    except ImportError:
        pass

    from aiohttp import web

    from flagscale.serve.router import Router, RouterSpec, new_event_loop

    spec = RouterSpec.from_dict(start.spec)
    if start.gcs_address:
        from flagscale.cluster.ray_compat import connect_kv

        connect_kv(start.gcs_address)
    graph = GraphClient(start.graph_socket) if start.graph_socket else None
    router = Router(spec, graph=graph, pin_node_id=start.pin_node_id)

    runners = []  # (kept: a runner nothing refers to is collected, and its listening socket closed with it)

    async def listen() -> None:
        await router.start()
        runners.append(web.AppRunner(control_app(router), access_log=None))
        await runners[0].setup()
        await web.UnixSite(runners[0], start.control_socket).start()

    loop = new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        loop.run_until_complete(asyncio.wait_for(listen(), STARTUP_TIMEOUT_S))
    except BaseException as exc:  # port in use, bad host, no GCS...
        answer({"error": f"{type(exc).__name__}: {exc}"})
        raise SystemExit(1) from exc
    answer({"pid": os.getpid()})
    threading.Thread(target=_exit_with_replica, args=(link,), name="replica-watch", daemon=True).start()
    loop.add_signal_handler(signal.SIGTERM, loop.stop)
    loop.run_forever()
    log.info("router process %d stopped", os.getpid())


if __name__ == "__main__":
    sys.exit(main())
