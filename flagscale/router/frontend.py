"""The router's HTTP face (aiohttp): the routes, the API key in front of them, and each request's way in.

GET /health, GET /metrics (every replica's series merged, then the router processes'), GET /v1/models, the
graph's route, and the engines' public paths (surface.py: an allowlist; any other path answers 404 here) proxied:
the body read within deploy.max_body_bytes and checked (client_request.py), the model's policy and its routing
picked, client-supplied kv_transfer_params dropped, then the request is carried to a replica (failover.py). A
client that hangs up cancels its handler (aiohttp's handler_cancellation), which closes the upstream connection:
the engine aborts the request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import aiohttp
from aiohttp import web

from flagscale import engines
from flagscale.config.routing import RoutingSpec
from flagscale.router import adapter_admin
from flagscale.router.admission import RETRY_AFTER_S
from flagscale.router.client_request import (
    HOP_BY_HOP,
    BadRequest,
    check_payload,
    error_response,
    read_payload,
)
from flagscale.router.exchange import Exchange
from flagscale.router.failover import Failover
from flagscale.router.guard import (
    BodyBudget,
    ConnectionCap,
    GuardedSite,
    KeyCheck,
    host_allowed,
    open_file_share,
    own_names,
)
from flagscale.router.keyring import accepts
from flagscale.router.metrics import SCRAPE_TIMEOUT_S, RouterMetrics, merge_replica_metrics
from flagscale.router.peers import PeerLink
from flagscale.router.planner_metrics import planner_series
from flagscale.router.policies import RequestInfo, rank_replicas
from flagscale.router.replicas import Replicas, Upstream
from flagscale.router.resume import CHAT, COMPLETIONS, ClientStream, dumps
from flagscale.router.spec import RouterSpec
from flagscale.router.state import Clients, Counters
from flagscale.router.surface import Surface

log = logging.getLogger("flagscale.router")

# The router's aiohttp server: a client that hangs up cancels its handler (and so the request upstream).
RUNNER_OPTIONS = {"access_log": None, "handle_signals": False, "handler_cancellation": True}
MODELS_TIMEOUT_S = 5.0  # GET /v1/models: the most one replica's list may take (then the next, then the router's own)

# Request headers never passed to an engine: hop-by-hop ones, and those an engine kind asks the router to drop.
NOT_PASSED_ON = HOP_BY_HOP | engines.dropped_request_headers()


class Frontend:
    """The router's HTTP surface. `spec` gives the router's current spec; `replicas`, the table and policies;
    `counters`, the requests in flight and the drain; `metrics`, the router's series; `clients`, the session its
    own calls to the replicas go through; `peers`, the other router processes' series; `failover`, where a
    request goes once in; `graph`, the graph driver's handle (None without custom nodes)."""

    def __init__(
        self,
        spec: Callable[[], RouterSpec],
        replicas: Replicas,
        counters: Counters,
        metrics: RouterMetrics,
        clients: Clients,
        peers: PeerLink,
        failover: Failover,
        graph: Any = None,
    ) -> None:
        self._spec, self._replicas, self._counters, self._metrics = spec, replicas, counters, metrics
        self._clients, self._peers, self._failover = clients, peers, failover
        self.graph = graph
        self._surface: Surface | None = None
        self.graph_inflight = 0  # graph requests in flight through this process (bounded: spec.graph_max_ongoing)
        self.keys = KeyCheck()
        self.bodies = BodyBudget()
        self.connections: ConnectionCap | None = None  # set by listen
        self._names: tuple[tuple[str, tuple[str, ...]], frozenset[str]] | None = None
        self.admin: adapter_admin.AdapterAdmin | None = None  # /admin/adapters (the engine key), set by the Router

    @property
    def surface(self) -> Surface:
        """The public surface of the router's current spec (built again when an update changed the spec)."""
        surface, spec = self._surface, self._spec()
        if surface is None or surface.spec is not spec:
            surface = self._surface = Surface(spec)
        return surface

    async def listen(self, host: str, port: int, **site_options) -> web.AppRunner:
        """Serves the app on host:port: idle connections and slow heads closed after client_idle_timeout_s, at most
        max_client_connections (bounded by the open-file limit) open at once. Returns the runner (cleanup stops it)."""
        bounds = self._spec().admission
        runner = web.AppRunner(self.app(), keepalive_timeout=bounds.client_idle_timeout_s, **RUNNER_OPTIONS)
        await runner.setup()
        self.connections = ConnectionCap(open_file_share(bounds.max_client_connections))
        await GuardedSite(runner, host, port, self.connections, **site_options).start()
        return runner

    def app(self) -> web.Application:
        """The HTTP surface: /health, /metrics, /v1/models, the graph's route, the engines' public paths proxied
        (the rest is 404: proxy, surface.py); the API key checked in front of all of it."""
        # (bodies are read by read_payload, bounded by spec.admission, which an update may change)
        app = web.Application(middlewares=[self._require_key])
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/v1/models", self.models)
        if self.admin is not None:
            app.router.add_route("*", adapter_admin.PATH, self.admin.handle)
        app.router.add_route("*", "/{tail:.*}", self.proxy)  # the graph's route too: it may change
        return app

    @web.middleware
    async def _require_key(self, request: web.Request, handler):
        """deploy.api_key: `Authorization: Bearer <key>` on every request but GET /health (and GET /metrics unless
        protect_metrics), 401 in OpenAI's shape otherwise (later and later for an address that keeps failing). Any
        other method on those paths needs the key too. Without a key: only Host headers guard.host_allowed takes."""
        spec = self._spec()
        if request.path.startswith("/admin/"):
            return await adapter_admin.engine_key_only(request, spec, self.keys, handler)
        if not spec.client_keys:
            if not host_allowed(request.headers.get("Host"), self._own_names(spec)):
                message = "this router has no API key and answers only its own host names (deploy.allowed_hosts)"
                return error_response(421, message, "MisdirectedRequestError")
            return await handler(request)
        open_path = request.method == "GET" and (
            request.path == "/health" or (request.path == "/metrics" and not spec.protect_metrics)
        )
        if not open_path:
            address = request.remote or ""
            if not self._key_accepted(request, spec):
                delay = self.keys.failure_delay(address)
                if delay:
                    await asyncio.sleep(delay)
                body = {"error": {"message": "Incorrect API key provided.", "type": "invalid_request_error"}}
                body["error"]["code"] = "invalid_api_key"
                return web.json_response(body, status=401)
            self.keys.succeeded(address)
        return await handler(request)

    def _own_names(self, spec: RouterSpec) -> frozenset[str]:
        wanted = (spec.host, spec.admission.allowed_hosts)
        if self._names is None or self._names[0] != wanted:
            self._names = (wanted, own_names(*wanted))
        return self._names[1]

    def _key_accepted(self, request: web.Request | None, spec: RouterSpec) -> bool:
        """Whether the request carries a client key the router accepts now (keyring.py)."""
        header = request.headers.get("Authorization", "") if request is not None else ""
        return accepts(spec.client_keys, spec.peer_secret, header, time.time())

    def upstream_headers(self, headers: dict) -> dict:
        """Headers of a request to an engine: the client's, with the engine key in place of the client's own."""
        key = self._spec().engine_key
        if key:
            headers = {k: v for k, v in headers.items() if k.lower() != "authorization"}
            headers["Authorization"] = f"Bearer {key}"
        return headers

    # ---- the router's own routes ------------------------------------------------------------------------

    async def metrics(self, request: web.Request) -> web.Response:
        """Every engine replica's own series, labelled by replica, then the router's (flagscale/router/metrics.py)."""
        timeout = aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT_S)
        session = self._clients.session

        async def scrape(upstream: Upstream):
            record = upstream.record
            labels = {
                "serve_id": record.serve_id,
                "replica": record.replica_id,
                "role": record.role or "colocated",
                "host": record.node_ip,
            }
            try:
                headers = self.upstream_headers({})  # engines require the key on /metrics too
                async with session.get(record.url + "/metrics", timeout=timeout, headers=headers) as resp:
                    if resp.status == 200:
                        return labels, await resp.text()
            except (TimeoutError, aiohttp.ClientError):
                pass
            self._metrics.scrape_failures.inc()
            return None

        scraped = await asyncio.gather(*(scrape(u) for u in list(self._replicas.table.by_replica.values())))
        routers = self._peers.router_series()
        text = merge_replica_metrics([s for s in scraped if s is not None]) + merge_replica_metrics(routers)
        text += await planner_series(self._spec().app, self._failover.cold_start)
        return web.Response(body=text.encode(), headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    async def health(self, request: web.Request | None) -> web.Response:
        """ok, or why not: with the key (or without one configured), which models lack a replica; without it,
        only "unhealthy" (the models' names are not the public's)."""
        spec = self._spec()
        # a model at zero replicas that starts one on its next request is ready (flagscale/router/cold_start.py)
        prefill_at_zero = {m for m, pools in spec.zero_pools.items() if "prefill" in pools}
        missing = self._replicas.missing(spec.models, spec.scale_from_zero, prefill_at_zero)
        if self._counters.draining:
            return web.Response(status=503, text="draining\n")
        if missing:
            told = not spec.client_keys or self._key_accepted(request, spec)
            return web.Response(
                status=503, text=f"no ready replica for: {', '.join(missing)}\n" if told else "unhealthy\n"
            )
        return web.Response(text="ok\n")

    async def models(self, request: web.Request) -> web.Response:
        spec = self._spec()
        models, session, data = spec.models, self._clients.session, []
        timeout = aiohttp.ClientTimeout(total=MODELS_TIMEOUT_S)
        for serve_id in dict.fromkeys(models.values()):
            names = [m for m, sid in models.items() if sid == serve_id]
            ups = rank_replicas(self._replicas.pool(names[0]), 0, time.monotonic())
            entries = None
            for upstream in ups[:2]:
                try:
                    headers = self.upstream_headers({})
                    url = upstream.record.url + "/v1/models"
                    async with session.get(url, headers=headers, timeout=timeout) as resp:
                        entries = (await resp.json())["data"]
                        break
                except Exception:
                    upstream.breaker.failure(time.monotonic())
            if entries is None:
                entries = [{"id": n, "object": "model", "owned_by": "flagscale", "created": 0} for n in names]
                for entry in entries:  # a LoRA adapter's base model
                    entry.update({"parent": spec.adapters[entry["id"]]} if entry["id"] in spec.adapters else {})
            data.extend(entries)
        return web.json_response({"object": "list", "data": data})

    # ---- the proxied requests ---------------------------------------------------------------------------

    async def proxy(self, request: web.Request) -> web.StreamResponse:
        spec, surface, path = self._spec(), self.surface, request.path
        if self.graph is not None and request.method == "POST" and path == spec.graph_route:
            return await self.run_graph(request)
        if path in surface.own:  # the router's own route, asked with another method
            allowed = surface.own[path]
            message = f"{request.method} {path}: only {allowed}"
            return error_response(405, message, "MethodNotAllowedError", headers={"Allow": allowed})
        served = surface.served(path)
        if served is None:  # not on the public surface: no engine sees it (docs/operations.md)
            return error_response(404, f"{path} is not served here", "NotFoundError")
        if self._counters.draining:
            return error_response(503, "server is shutting down", "ServiceUnavailableError")
        try:
            body, payload = await read_payload(request, spec.admission, self.bodies)
            check_payload(payload)
        except BadRequest as exc:
            return exc.response()
        model = payload.get("model")
        if model is None and len(set(spec.models.values())) == 1:
            model = next(iter(spec.models))
        if model not in spec.models:
            known = ", ".join(spec.models)
            return error_response(404, f"model {model!r} is not served here; models: {known}", "NotFoundError")
        inference = served.get(surface.engine_of[model])
        if inference is None:
            return error_response(404, f"{path} is not served for model {model!r}", "NotFoundError")
        if surface.strip(model, payload):  # where a decode engine pulls KV from is the router's to say
            body = dumps(payload)
        exchange = self._exchange(request, model, payload, body)
        exchange.inference = inference
        query = request.rel_url.raw_query_string
        exchange.target = f"{path}?{query}" if query else path  # the path checked above, as it was checked
        self._counters.inflight += 1
        self._metrics.inflight.inc()
        status = 499  # the client went away (the handler was cancelled)
        try:
            await self._replicas.kv_events.prepare(exchange.info, exchange.policy)  # a long prompt's KV keys
            response = await self._failover.route(exchange, payload)
            status = response.status
            return response
        finally:
            self._counters.inflight -= 1
            self._metrics.inflight.dec()
            self._observe(exchange, status)

    def _exchange(self, request: web.Request, model: str, payload: dict, body: bytes) -> Exchange:
        spec = self._spec()
        info = RequestInfo(model, payload, {k.lower(): v for k, v in request.headers.items()})
        stream = None
        if request.method == "POST" and request.path in (COMPLETIONS, CHAT) and payload.get("stream") is True:
            stream = ClientStream(request.path, payload, engine_resumes=model not in spec.no_resume)
        routing = spec.routing.get(model, RoutingSpec()).settings
        policy = self._replicas.policy(model)
        exchange = Exchange(request, model, policy, info, body, stream, routing.max_migrations)
        exchange.headers = self.upstream_headers(
            {k: v for k, v in request.headers.items() if k.lower() not in NOT_PASSED_ON}
        )
        return exchange

    def _observe(self, exchange: Exchange, status: int) -> None:
        m, model = self._metrics, exchange.model
        m.requests.labels(model, str(status)).inc()
        m.e2e.labels(model).observe(time.monotonic() - exchange.started)
        if exchange.first_byte_at is not None:
            m.ttft.labels(model).observe(exchange.first_byte_at - exchange.started)
        m.bytes.labels(model).inc(exchange.sent_bytes)
        if exchange.moves:
            m.moved.labels(model).inc(exchange.moves)
        if exchange.stream is not None and exchange.stream.generated:
            m.tokens.labels(model).inc(len(exchange.stream.generated))
        if exchange.stream is not None and exchange.stream.resumed:
            m.resumed.labels(model).inc(exchange.stream.resumed)
        if exchange.key_refusals:
            m.key_refusals.labels(model).inc(exchange.key_refusals)

    async def run_graph(self, request: web.Request) -> web.Response:
        """The graph's entry: JSON body -> graph driver -> the sink's output as JSON (`?trace=1`: with timings)."""
        spec = self._spec()
        if self._counters.draining:
            return error_response(503, "server is shutting down", "ServiceUnavailableError")
        try:
            _, payload = await read_payload(request, spec.admission, self.bodies)
        except BadRequest as exc:
            return exc.response()
        with_trace = request.query.get("trace", "").lower() in ("1", "true", "yes")
        if self.graph_inflight >= spec.share(spec.graph_max_ongoing):
            return error_response(
                503,
                f"the graph has {spec.graph_max_ongoing} requests in flight (its driver's max_ongoing_requests)",
                "ServiceUnavailableError",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        self._counters.inflight += 1
        self.graph_inflight += 1
        try:
            reply = await self.graph.run.remote(payload, with_trace)
        except Exception as exc:
            log.exception("graph request failed")
            return error_response(500, f"graph driver failed: {exc}", "InternalServerError")
        finally:
            self._counters.inflight -= 1
            self.graph_inflight -= 1
        status = reply.pop("status")
        if status != 200:
            return error_response(status, reply["error"], "BadRequestError" if status == 400 else "GraphNodeError")
        try:
            return web.json_response(reply if with_trace else reply["result"])
        except TypeError as exc:
            return error_response(500, f"the sink's output is not JSON serializable: {exc}", "InternalServerError")
