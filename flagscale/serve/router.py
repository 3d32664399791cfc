"""The OpenAI-compatible entry point: a lean byte-streaming router in front of the engines' own servers.

It runs inside a Ray Serve replica (so Serve places, health-checks and restarts it) but serves HTTP
itself with aiohttp on its own event loop thread. Per request it reads the body, picks a replica of
the requested `model` (see `rank_replicas`), and streams the upstream
response back chunk by chunk. A replica that refuses connections is set aside for a few seconds and
the request goes to the next one, as long as no byte was sent to the client yet.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field

from flagscale.serve import registry
from flagscale.serve.cpu_layout import RouterPinning

log = logging.getLogger("flagscale.router")

HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host", "upgrade", "te", "trailer"}
COOLDOWN_S = 5.0
LOAD_SLACK = 1  # in-flight requests a replica may be above the least busy one and still count as "as free"


@dataclass
class RouterSpec:
    app: str
    host: str
    port: int
    models: dict[str, str]  # served model name -> serve_id
    refresh_s: float = 2.0
    graph_route: str | None = None  # deployment graph entry (POST, JSON in/out), served by the graph driver
    pin_cpus: bool = True  # stay off the cores of engine workers on this host (flagscale/serve/cpu_layout.py)


@dataclass
class _Upstream:
    record: registry.ReplicaRecord
    inflight: int = 0
    sent: int = 0  # requests routed here, counted when picked (served only counts once headers are back)
    served: int = 0
    down_until: float = 0.0


@dataclass
class _Table:
    by_model: dict[str, list[_Upstream]] = field(default_factory=dict)
    by_replica: dict[str, _Upstream] = field(default_factory=dict)


def rank_replicas(upstreams: list[_Upstream], turn: int, now: float) -> list[_Upstream]:
    """The order to try a model's replicas in.

    Replicas at most LOAD_SLACK in-flight requests above the least busy one come first, fewest requests
    sent first, so equal replicas get equal shares even when one of them runs a little faster (pure
    least-in-flight hands the faster one every freed slot). Busier replicas follow, least busy first.
    Ties rotate with `turn`; replicas in their cool-down after a refused connection are left out."""
    ups = [u for u in upstreams if u.down_until <= now]
    if len(ups) > 1:
        ups = ups[turn % len(ups) :] + ups[: turn % len(ups)]
        free_enough = min(u.inflight for u in ups) + LOAD_SLACK
        ups.sort(key=lambda u: (0, u.sent) if u.inflight <= free_enough else (1, u.inflight))  # stable sort
    return ups


def _error(status: int, message: str, kind: str):
    from aiohttp import web

    body = {"error": {"message": message, "type": kind, "code": status}}
    return web.json_response(body, status=status)


class Router:
    def __init__(self, spec: RouterSpec, *engines, graph=None):
        self.spec = spec
        self._engines = engines  # handles keep the engine deployments part of this application
        self._graph = graph  # DeploymentHandle of the graph driver, when the config has custom nodes
        self._table = _Table()
        self._pinning = None
        if spec.pin_cpus:
            import ray

            self._pinning = RouterPinning(ray.get_runtime_context().get_node_id())
        self._rr = itertools.count()
        self._inflight = 0
        self._draining = False
        self._started = threading.Event()
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._serve_forever, name="flagscale-router", daemon=True)
        self._thread.start()
        if not self._started.wait(30):
            raise RuntimeError(f"router did not start listening on {spec.host}:{spec.port} within 30s")
        if self._failure is not None:
            raise RuntimeError(f"router cannot listen on {spec.host}:{spec.port}: {self._failure}")

    # ---- event loop thread -------------------------------------------------------------------

    def _serve_forever(self) -> None:
        try:
            import uvloop

            loop = uvloop.new_event_loop()
        except ImportError:
            loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        self._loop = loop
        try:
            loop.run_until_complete(self._start())
        except BaseException as exc:  # port in use, bad host...
            self._failure = exc
            self._started.set()
            return
        self._started.set()
        loop.run_forever()

    async def _start(self) -> None:
        import aiohttp
        from aiohttp import web

        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=5),
            auto_decompress=False,
        )
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        if self._graph is not None and self.spec.graph_route:
            app.router.add_post(self.spec.graph_route, self._run_graph)
        app.router.add_route("*", "/{tail:.*}", self._proxy)
        runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await runner.setup()
        site = web.TCPSite(runner, self.spec.host, self.spec.port, backlog=1024, reuse_address=True)
        await site.start()
        await self._refresh()
        asyncio.get_running_loop().create_task(self._refresh_forever())

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(self.spec.refresh_s)
            try:
                await self._refresh()
            except Exception as exc:  # GCS hiccup: keep the last table
                log.warning("replica refresh failed: %s", exc)

    async def _refresh(self) -> None:
        records = await asyncio.get_running_loop().run_in_executor(None, registry.list_replicas, self.spec.app)
        old = self._table.by_replica
        table = _Table()
        for record in records:
            upstream = old.get(record.replica_id)
            if upstream is None or upstream.record.url != record.url:
                upstream = _Upstream(record)
            else:
                upstream.record = record
            table.by_replica[record.replica_id] = upstream
            for model in record.models:
                table.by_model.setdefault(model, []).append(upstream)
        self._table = table
        if self._pinning is not None:
            self._pinning.update(records)

    def _candidates(self, model: str) -> list[_Upstream]:
        return rank_replicas(self._table.by_model.get(model, []), next(self._rr), time.monotonic())

    async def _health(self, request):
        from aiohttp import web

        missing = [m for m in self.spec.models if not self._table.by_model.get(m)]
        if self._draining:
            return web.Response(status=503, text="draining\n")
        if missing:
            return web.Response(status=503, text=f"no ready replica for: {', '.join(missing)}\n")
        return web.Response(text="ok\n")

    async def _models(self, request):
        from aiohttp import web

        data = []
        for serve_id in dict.fromkeys(self.spec.models.values()):
            names = [m for m, sid in self.spec.models.items() if sid == serve_id]
            ups = self._candidates(names[0])
            entries = None
            for upstream in ups[:2]:
                try:
                    async with self._session.get(upstream.record.url + "/v1/models") as resp:
                        entries = (await resp.json())["data"]
                        break
                except Exception:
                    upstream.down_until = time.monotonic() + COOLDOWN_S
            if entries is None:
                entries = [{"id": n, "object": "model", "owned_by": "flagscale", "created": 0} for n in names]
            data.extend(entries)
        return web.json_response({"object": "list", "data": data})

    async def _proxy(self, request):

        if self._draining:
            return _error(503, "server is shutting down", "ServiceUnavailableError")
        body = await request.read()
        model = None
        if body:
            try:
                model = json.loads(body).get("model")
            except (ValueError, AttributeError):
                return _error(400, "request body is not a JSON object", "BadRequestError")
        if model is None and len(set(self.spec.models.values())) == 1:
            model = next(iter(self.spec.models))
        if model not in self.spec.models:
            known = ", ".join(self.spec.models)
            return _error(404, f"model {model!r} is not served here; models: {known}", "NotFoundError")
        candidates = self._candidates(model)
        if not candidates:
            return _error(503, f"no ready replica for model {model!r}", "ServiceUnavailableError")
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        self._inflight += 1
        try:
            for upstream in candidates:
                try:
                    return await self._forward(request, upstream, body, headers)
                except _Unreachable:
                    upstream.down_until = time.monotonic() + COOLDOWN_S
            return _error(503, f"every replica of {model!r} refused the connection", "ServiceUnavailableError")
        finally:
            self._inflight -= 1

    async def _run_graph(self, request):
        """The graph's entry: JSON body -> graph driver -> the sink's output as JSON (`?trace=1`: with timings)."""
        from aiohttp import web

        if self._draining:
            return _error(503, "server is shutting down", "ServiceUnavailableError")
        try:
            payload = json.loads(await request.read() or b"{}")
        except ValueError:
            return _error(400, "request body is not JSON", "BadRequestError")
        with_trace = request.query.get("trace", "").lower() in ("1", "true", "yes")
        self._inflight += 1
        try:
            reply = await self._graph.run.remote(payload, with_trace)
        except Exception as exc:
            log.exception("graph request failed")
            return _error(500, f"graph driver failed: {exc}", "InternalServerError")
        finally:
            self._inflight -= 1
        status = reply.pop("status")
        if status != 200:
            return _error(status, reply["error"], "BadRequestError" if status == 400 else "GraphNodeError")
        try:
            return web.json_response(reply if with_trace else reply["result"])
        except TypeError as exc:
            return _error(500, f"the sink's output is not JSON serializable: {exc}", "InternalServerError")

    async def _forward(self, request, upstream: _Upstream, body: bytes, headers: dict):
        import aiohttp
        from aiohttp import web

        url = upstream.record.url + str(request.rel_url)
        upstream.inflight += 1
        upstream.sent += 1
        try:
            try:
                upstream_resp = await self._session.request(request.method, url, data=body, headers=headers)
            except (aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError) as exc:
                raise _Unreachable(str(exc)) from exc
            upstream.served += 1
            async with upstream_resp:
                out_headers = {k: v for k, v in upstream_resp.headers.items() if k.lower() not in HOP_BY_HOP}
                if "text/event-stream" not in upstream_resp.headers.get("Content-Type", ""):
                    return web.Response(status=upstream_resp.status, body=await upstream_resp.read(), headers=out_headers)
                response = web.StreamResponse(status=upstream_resp.status, headers=out_headers)
                await response.prepare(request)
                async for chunk in upstream_resp.content.iter_any():
                    await response.write(chunk)
                await response.write_eof()
                return response
        finally:
            upstream.inflight -= 1

    # ---- Serve-side methods (called through deployment handles) ------------------------------

    def check_health(self) -> None:
        if not self._thread.is_alive():
            raise RuntimeError("router event loop thread died")

    async def drain(self, timeout_s: float) -> int:
        """Refuse new requests and wait (bounded) for in-flight ones; returns how many were still running."""
        self._draining = True
        deadline = time.monotonic() + timeout_s
        while self._inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        return self._inflight

    def stats(self) -> dict:
        counts: dict[str, dict] = defaultdict(dict)
        for upstream in self._table.by_replica.values():
            counts[upstream.record.replica_id] = {
                "serve_id": upstream.record.serve_id,
                "url": upstream.record.url,
                "served": upstream.served,
                "inflight": upstream.inflight,
            }
        return {"inflight": self._inflight, "replicas": dict(counts)}


class _Unreachable(Exception):
    pass
