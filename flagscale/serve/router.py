"""The OpenAI-compatible entry point: a lean byte-streaming router in front of the engines' own servers.

It runs inside a Ray Serve replica (so Serve places, health-checks and restarts it) but serves HTTP
itself with aiohttp on its own event loop thread. Per request it reads the body, asks the requested
`model`'s routing policy (flagscale/serve/routing.py: cache_aware, least_load, session, round_robin) for the
order to try its replicas in, and streams the upstream response back chunk by chunk: the request goes to the
replica through the router's own HTTP/1.1 client (upstream_http), whose connection writes each piece of a
streamed answer on to the client as it arrives (_Exchange.relay_piece), with no task woken per piece.

A request whose replica fails it moves to another replica (docs/routing.md), each at most once and at most
`max_migrations` times: a refused connection (nothing was sent; not counted), a dropped connection or a 5xx
before the client got anything (sent again as it was), a completions or chat stream broken off part-way
(resumed from the tokens the client has: flagscale/serve/resume.py). A 4xx is the client's problem: passed on.
After an engine dies during a request (dropped connection, stream broken off) it is retried at most once more:
it may be what killed the engine.
Failures feed each replica's circuit breaker (routing.CircuitBreaker): BREAKER_FAILURES in a row, or one refused
connection, open it; the replica is skipped for COOLDOWN_S, then one probe (the next request, or the router's
own /health probe every refresh) closes it again or reopens it.

Admission: each replica is sent at most its deployment's max_ongoing_requests at once; further requests wait in a
bounded FIFO queue per model (length and time), beyond it 503 with Retry-After. Bodies over max_body_bytes get
413; the body is parsed once (orjson), the fields the router reads are checked (400 naming the field), and
client-supplied kv_transfer_params are dropped. A client that hangs up cancels its handler (aiohttp's
handler_cancellation), which closes the upstream connection: vLLM aborts the request.
"""

from __future__ import annotations

import asyncio
import bisect
import hmac
import itertools
import json
import logging
import os
import threading
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from flagscale import engines
from flagscale.config.routing import DEFAULT_MAX_ONGOING_REQUESTS, Admission
from flagscale.serve import registry, router_peers
from flagscale.serve.cpu_layout import RouterPinning
from flagscale.serve.metrics import SCRAPE_TIMEOUT_S, RouterMetrics, merge_replica_metrics
from flagscale.serve.resume import CHAT, COMPLETIONS, ClientStream, error_event
from flagscale.serve.resume import dumps as _dumps
from flagscale.serve.resume import loads as _loads
from flagscale.serve.routing import (  # noqa: F401 - LOAD_SLACK, rank_replicas: re-exported
    COOLDOWN_S,
    LOAD_SLACK,
    Policy,
    RequestInfo,
    RoutingSpec,
    Upstream,
    make_policy,
    rank_replicas,
)
from flagscale.serve.upstream_http import ConnectFailed, Disconnected, UpstreamClient

log = logging.getLogger("flagscale.router")

# Headers not passed on (either way). "expect": the router has the whole body before it sends the request.
HOP_BY_HOP = frozenset("connection keep-alive transfer-encoding content-length host upgrade te trailer expect".split())
# Idle upstream connections are closed before vLLM's server closes them (uvicorn keep-alive, 5 s by default:
# VLLM_HTTP_TIMEOUT_KEEP_ALIVE), so the router does not send a request on a connection being closed.
UPSTREAM_KEEPALIVE_S = 4.0
HEALTH_PROBE_TIMEOUT_S = 2.0
UPSTREAM_CONNECT_TIMEOUT_S = 5.0
# A client's unsent bytes beyond which its replica is not read until the client takes them (uvloop's and
# asyncio's default high-water mark for a transport, at which aiohttp's writer waits too).
CLIENT_BUFFER_BYTES = 64 * 1024
# Deeper request bodies are refused: vLLM's server parses with Python's json, whose recursion gives out near 1000
# levels (a 500 there would count against the replica), and no OpenAI request nests anywhere near this.
MAX_JSON_DEPTH = 64
RETRY_AFTER_S = 1  # what a 503 for a full queue tells the client
RETRIES_AFTER_ENGINE_DEATH = 1  # a request during which an engine died is sent to at most this many more replicas
# The router's aiohttp server: a client that hangs up cancels its handler (and so the request upstream).
RUNNER_OPTIONS = {"access_log": None, "handle_signals": False, "handler_cancellation": True}
_DEFAULT_ADMISSION = Admission()


@dataclass
class RouterSpec:
    app: str
    host: str
    port: int
    models: dict[str, str]  # served model name -> serve_id
    refresh_s: float = registry.ROUTER_REFRESH_S
    graph_route: str | None = None  # deployment graph entry (POST, JSON in/out), served by the graph driver
    pin_cpus: bool = True  # stay off the cores of engine workers on this host (flagscale/serve/cpu_layout.py)
    routing: dict[str, RoutingSpec] = field(default_factory=dict)  # served model name -> its node's routing
    # Disaggregated models: served model name -> how its prefill replica is picked (docs/disaggregation.md).
    prefill_routing: dict[str, RoutingSpec] = field(default_factory=dict)
    api_key: str | None = field(default=None, repr=False)  # deploy.api_key: required on every route but /health
    protect_metrics: bool = True  # deploy.protect_metrics: /metrics needs the key too
    max_ongoing: dict[str, int] = field(default_factory=dict)  # serve_id -> requests one replica is sent at once
    max_body_bytes: int = _DEFAULT_ADMISSION.max_body_bytes
    max_queued_requests: int = _DEFAULT_ADMISSION.max_queued_requests  # per model
    queue_timeout_s: float = _DEFAULT_ADMISSION.queue_timeout_s
    # served model names whose engine gives no token ids (capabilities.resume_from_tokens): a stream of theirs moves
    # to another replica only before its first byte
    no_resume: list[str] = field(default_factory=list)
    # deploy.router_processes > 1 (each process a Router): share load, metrics, drains and routing hints with the
    # others (flagscale/serve/router_peers.py; needs Ray's GCS). Off only where no Ray runs (benchmarks, tests).
    share_with_peers: bool = True

    # What a running router takes in place (Serve's user_config -> Router.reconfigure). Where it listens, and the
    # API key (Serve shows user_configs in its status), are fixed for the router replica's life.
    RECONFIGURABLE = (
        "models",
        "refresh_s",
        "graph_route",
        "routing",
        "prefill_routing",
        "protect_metrics",
        "max_ongoing",
        "max_body_bytes",
        "max_queued_requests",
        "queue_timeout_s",
        "no_resume",
    )

    def user_config(self) -> dict[str, Any]:
        return {key: value for key, value in asdict(self).items() if key in self.RECONFIGURABLE}

    def reconfigured(self, config: dict[str, Any]) -> RouterSpec:
        config = dict(config)
        for key in ("routing", "prefill_routing"):
            config[key] = {model: RoutingSpec(**spec) for model, spec in config.get(key, {}).items()}
        return replace(self, **config)


_Upstream = Upstream  # the name the tests and older code use


@dataclass
class _Table:
    by_model: dict[str, list[_Upstream]] = field(default_factory=dict)  # replicas that answer (colocated or decode)
    prefill_by_model: dict[str, list[_Upstream]] = field(default_factory=dict)  # prefill pools
    by_replica: dict[str, _Upstream] = field(default_factory=dict)


# What a prefill replica is asked for: compute the prompt's KV cache, keep it for a decode replica to pull.
REMOTE_DECODE = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def upstream_session():
    """The router's aiohttp client for its own calls to the replicas: health probes, /metrics, /v1/models,
    prefill (the requests it relays go through upstream_http). Call inside its event loop."""
    import aiohttp

    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, keepalive_timeout=UPSTREAM_KEEPALIVE_S),
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=5),
        auto_decompress=False,
    )


def _error(status: int, message: str, kind: str, headers: dict | None = None):
    from aiohttp import web

    body = {"error": {"message": message, "type": kind, "code": status}}
    return web.json_response(body, status=status, headers=headers)


class _BadRequest(Exception):
    """The request cannot be routed as it is: the client gets `status` and this message."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status

    def response(self):
        kind = "RequestEntityTooLargeError" if self.status == 413 else "BadRequestError"
        return _error(self.status, str(self), kind)


def _nests_deeper(value: Any, levels: int) -> bool:
    if isinstance(value, dict):
        value = value.values()
    elif not isinstance(value, list):
        return False
    if levels == 0:
        return True
    return any(_nests_deeper(item, levels - 1) for item in value if isinstance(item, (dict, list)))


def parse_body(body: bytes) -> Any:
    """A request body as JSON, or _BadRequest naming what is wrong with it (not UTF-8, not JSON, an integer
    beyond 64 bits, nested deeper than MAX_JSON_DEPTH)."""
    try:
        value = _loads(body)
    except ValueError as exc:  # orjson's JSONDecodeError says what and where
        raise _BadRequest(f"request body is not valid JSON: {exc}") from None
    # only a body with that many brackets can nest that deep: most never pay for the walk
    if body.count(b"{") + body.count(b"[") > MAX_JSON_DEPTH and _nests_deeper(value, MAX_JSON_DEPTH):
        raise _BadRequest(f"request body nests deeper than {MAX_JSON_DEPTH} levels")
    return value


# The fields the router itself reads, and the JSON types it can read them as (null: absent).
_ROUTED_FIELDS = (
    ("model", str, "a string"),
    ("stream", bool, "true or false"),
    ("stream_options", dict, "an object"),
    ("messages", list, "a list"),
)


def check_payload(payload: Any) -> None:
    """_BadRequest unless the body is an object whose fields the router reads have a type it can read; the rest
    of the request is the engine's to check."""
    if not isinstance(payload, dict):
        raise _BadRequest(f"request body must be a JSON object, not {type(payload).__name__}")
    for key, kind, described in _ROUTED_FIELDS:
        value = payload.get(key)
        if value is not None and not isinstance(value, kind):
            raise _BadRequest(f"`{key}` must be {described}, not {_dumps(value)[:100].decode(errors='replace')}")


async def read_body(request, limit: int) -> bytes:
    """The request's body, or _BadRequest(413) as soon as it is over `limit` bytes (before reading it all when
    Content-Length says so)."""

    def too_large() -> _BadRequest:
        return _BadRequest(f"request body is over the limit of {limit} bytes (deploy.max_body_bytes)", 413)

    if request.content_length is not None and request.content_length > limit:
        raise too_large()
    chunks, size = [], 0
    async for chunk in request.content.iter_any():
        size += len(chunk)
        if size > limit:
            raise too_large()
        chunks.append(chunk)
    return b"".join(chunks)


class _Overloaded(Exception):
    """Every replica of the model has max_ongoing_requests in flight and the queue is full, or the request waited
    its queue_timeout_s."""


class Router:
    def __init__(self, spec: RouterSpec, *engines, graph=None):
        self.spec = spec
        self._engines = engines  # handles keep the engine deployments part of this application
        self._graph = graph  # DeploymentHandle of the graph driver, when the config has custom nodes
        self._init_state()
        self._pinning = None
        self._started_at = time.time()
        if spec.pin_cpus:
            import ray

            self._pinning = RouterPinning(ray.get_runtime_context().get_node_id())
        self._started = threading.Event()
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._serve_forever, name="flagscale-router", daemon=True)
        self._thread.start()
        if not self._started.wait(30):
            raise RuntimeError(f"router did not start listening on {spec.host}:{spec.port} within 30s")
        if self._failure is not None:
            raise RuntimeError(f"router cannot listen on {spec.host}:{spec.port}: {self._failure}")

    def reconfigure(self, config: dict[str, Any]) -> None:
        """Serve calls this after __init__ and on every update whose router spec changed (models added or
        removed, routing policies): applied on the router's event loop, keeping the policies (and their prefix
        tables) of models whose routing did not change."""
        spec = self.spec.reconfigured(config)
        loop = getattr(self, "_loop", None)
        if loop is None or not loop.is_running():
            self._apply_spec(spec)
            return
        done = asyncio.run_coroutine_threadsafe(self._apply_spec_and_refresh(spec), loop)
        done.result(timeout=30)

    async def _apply_spec_and_refresh(self, spec: RouterSpec) -> None:
        self._apply_spec(spec)
        await self._refresh()

    def _apply_spec(self, spec: RouterSpec) -> None:
        old = self.spec
        self.spec = spec
        for upstream in self._table.by_replica.values():
            upstream.max_ongoing = self._max_ongoing(upstream)
        for policies, old_routing, routing, models, pools in (
            (self._policies, old.routing, spec.routing, spec.models, self._table.by_model),
            (
                self._prefill_policies,
                old.prefill_routing,
                spec.prefill_routing,
                spec.prefill_routing,
                self._table.prefill_by_model,
            ),
        ):
            for model in list(policies):
                if model not in models or old_routing.get(model) != routing.get(model):
                    del policies[model]
            for model in models:
                if model not in policies:
                    policies[model] = make_policy(routing.get(model, RoutingSpec()))
                    for upstream in pools.get(model, []):
                        policies[model].on_replica_joined(upstream)

    def _init_state(self) -> None:
        """The request path's state (the unit tests build a Router with this only: no Ray, no thread)."""
        self._table = _Table()
        self._policies: dict[str, Policy] = {
            model: make_policy(self.spec.routing.get(model, RoutingSpec())) for model in self.spec.models
        }
        self._prefill_policies: dict[str, Policy] = {
            model: make_policy(spec) for model, spec in self.spec.prefill_routing.items()
        }
        self.metrics = RouterMetrics()
        # the relayed requests' client (upstream_http); self._session, aiohttp's, does the router's own calls
        self._upstream = UpstreamClient(UPSTREAM_KEEPALIVE_S, UPSTREAM_CONNECT_TIMEOUT_S)
        self._inflight = 0
        self._moved = 0  # requests moved to another replica after theirs failed them
        self._resumed = 0  # of them, streams resumed mid-way
        self._draining = False
        # Requests waiting for a replica with a free slot, per (pool, model): (ticket, future), oldest first.
        self._waiting: dict[tuple[str, str], list[tuple[int, asyncio.Future]]] = {}
        self._tickets = itertools.count()
        self._process = router_peers.this_process()
        self._peer_reports: list[router_peers.PeerReport] = []  # the other processes' last reports
        self._hints = None  # the datagram endpoint routing hints come in on (router_peers.RoutingHints)

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
        from aiohttp import web

        self._session = upstream_session()
        runner = web.AppRunner(self.web_app(), **RUNNER_OPTIONS)
        await runner.setup()
        # every router process of the deployment listens on the same port; the kernel spreads connections
        site = web.TCPSite(runner, self.spec.host, self.spec.port, backlog=1024, reuse_address=True, reuse_port=True)
        await site.start()
        await self._refresh()
        loop = asyncio.get_running_loop()
        if self.spec.share_with_peers:
            self._hints = await router_peers.RoutingHints.open(self._learn_hint)
            await self._publish()
            loop.create_task(self._watch_drain())
        loop.create_task(self._refresh_forever())

    def web_app(self):
        """The HTTP surface: /health, /metrics, /v1/models, the graph's route, everything else proxied; the API
        key checked in front of all of it."""
        from aiohttp import web

        # (bodies are read by read_body, bounded by spec.max_body_bytes, which an update may change)
        app = web.Application(middlewares=[self._require_key])
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v1/models", self._models)
        app.router.add_route("*", "/{tail:.*}", self._proxy)  # the graph's route too: it may change
        return app

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(self.spec.refresh_s)
            try:
                await self._refresh()
            except Exception as exc:  # GCS hiccup: keep the last table
                log.warning("replica refresh failed: %s", exc)
            await self._probe_half_open()
            if self.spec.share_with_peers:
                await self._publish()

    # ---- the other router processes of the deployment (router_peers.py) -------------------------------

    async def _publish(self) -> None:
        """This process's report out, the others' in (and so where their routing hints go)."""
        report = router_peers.PeerReport(
            process=self._process,
            pid=os.getpid(),
            started_at=self._started_at,
            updated_at=0.0,
            stats=self._collect_stats(),
            metrics=self.metrics.text().decode(),
            hints_port=self._hints.port if self._hints else 0,
        )
        app = self.spec.app
        try:
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(None, router_peers.publish, app, report)
            reports = await loop.run_in_executor(None, router_peers.reports, app)
        except Exception as exc:  # GCS hiccup: the next refresh tries again
            log.warning("publishing the router's report failed: %s", exc)
            return
        self._peer_reports = [r for r in reports if r.process != self._process]
        if self._hints is not None:
            self._hints.peers = [r.hints_port for r in self._peer_reports if r.hints_port]

    async def _watch_drain(self) -> None:
        """Another process was asked to drain the deployment (stop): this one drains too (it looks every refresh:
        the one asked waits until every process has reported draining), then reports every DRAIN_POLL_S so that
        the one asked sees when nothing is in flight anywhere."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(router_peers.DRAIN_POLL_S if self._draining else self.spec.refresh_s)
            if not self._draining:
                try:
                    asked = await loop.run_in_executor(
                        None, router_peers.drain_requested, self.spec.app, self._started_at
                    )
                except Exception:
                    continue
                self._draining = asked
            if self._draining:
                await self._publish()

    def _send_hint(self, pool: str, model: str, upstream: Upstream, info: RequestInfo) -> None:
        """Tell the other processes where this prompt went, so their cache-aware tables learn it too."""
        keys = info.memo.get("prefix_keys")
        if keys and self._hints is not None and self._hints.peers:
            self._hints.send(pool, model, upstream.replica_id, keys)

    def _learn_hint(self, pool: str, model: str, replica_id: str, keys: list[bytes]) -> None:
        policies = self._prefill_policies if pool == "prefill" else self._policies
        policy = policies.get(model)
        if policy is not None:
            policy.learn(replica_id, keys)

    async def _probe_half_open(self) -> None:
        """Replicas whose circuit cool-down is over get one /health probe, so an idle router readmits them too."""
        now = time.monotonic()
        probes = [u for u in self._table.by_replica.values() if u.breaker.state(now) == "half_open"]
        if probes:
            await asyncio.gather(*(self._probe(u) for u in probes))

    async def _probe(self, upstream: Upstream) -> None:
        import aiohttp

        if not upstream.breaker.begin(time.monotonic()):
            return
        try:
            timeout = aiohttp.ClientTimeout(total=HEALTH_PROBE_TIMEOUT_S)
            async with self._session.get(upstream.record.url + "/health", timeout=timeout) as resp:
                healthy = resp.status == 200
        except Exception:
            healthy = False
        if healthy:
            upstream.breaker.success()
        else:
            upstream.breaker.failure(time.monotonic())

    async def _refresh(self) -> None:
        records = await asyncio.get_running_loop().run_in_executor(None, registry.list_replicas, self.spec.app)
        old = self._table.by_replica
        old_by_model = self._table.by_model
        table = _Table()
        for record in records:
            upstream = old.get(record.replica_id)
            if upstream is None or upstream.record.url != record.url:
                upstream = _Upstream(record)
            else:
                upstream.record = record
            upstream.max_ongoing = self._max_ongoing(upstream)
            table.by_replica[record.replica_id] = upstream
            pools = table.prefill_by_model if record.role == "prefill" else table.by_model
            for model in record.models:
                pools.setdefault(model, []).append(upstream)
        old_prefill = self._table.prefill_by_model
        self._table = table
        self._update_policies(self._policies, old_by_model, table.by_model)
        self._update_policies(self._prefill_policies, old_prefill, table.prefill_by_model)
        if self._pinning is not None:
            self._pinning.update(records)
        for key in list(self._waiting):  # replicas may have joined, limits changed: every waiter looks again
            self._wake(key, everyone=True)

    def _max_ongoing(self, upstream: Upstream) -> int:
        return self.spec.max_ongoing.get(upstream.record.serve_id, DEFAULT_MAX_ONGOING_REQUESTS)

    # ---- admission: a bounded queue in front of replicas at their max_ongoing_requests ------------

    @staticmethod
    def _pool_key(upstream: Upstream, model: str) -> tuple[str, str]:
        return ("prefill" if upstream.record.role == "prefill" else "serve", model)

    async def _admitted(self, key: tuple[str, str], pick):
        """pick()'s replica (or None: no replica left to try). While every replica it could take has
        max_ongoing_requests in flight (pick() gives _FULL), the request waits its turn behind earlier ones,
        bounded by max_queued_requests and queue_timeout_s (then _Overloaded)."""
        waiters = self._waiting.get(key)
        upstream = _FULL if waiters else pick()  # requests already waiting go first
        if upstream is not _FULL:
            return upstream
        if waiters is None:
            waiters = self._waiting[key] = []
        if len(waiters) >= self.spec.max_queued_requests:
            raise _Overloaded(f"{len(waiters)} requests are already waiting (deploy.max_queued_requests)")
        loop = asyncio.get_running_loop()
        ticket, deadline = next(self._tickets), loop.time() + self.spec.queue_timeout_s
        while True:
            entry = (ticket, loop.create_future())
            bisect.insort(waiters, entry, key=lambda e: e[0])  # a request woken in vain keeps its place
            try:
                async with asyncio.timeout_at(deadline):
                    await entry[1]
            except TimeoutError:
                raise _Overloaded(
                    f"no replica had a free slot within {self.spec.queue_timeout_s:g}s (deploy.queue_timeout_s)"
                ) from None
            finally:
                if entry in waiters:
                    waiters.remove(entry)
                if not waiters and self._waiting.get(key) is waiters:
                    del self._waiting[key]
            upstream = pick()
            if upstream is not _FULL:
                return upstream
            waiters = self._waiting.setdefault(key, waiters)

    def _wake(self, key: tuple[str, str], everyone: bool = False) -> None:
        """A slot may be free in this pool: the oldest waiter (or every one) looks again."""
        waiters = self._waiting.get(key)
        while waiters:
            _, future = waiters.pop(0)
            if not future.done():
                future.set_result(None)
                if not everyone:
                    return

    def _slot_freed(self, upstream: Upstream) -> None:
        if self._waiting:
            for model in upstream.record.models:
                self._wake(self._pool_key(upstream, model))

    @staticmethod
    def _update_policies(
        policies: dict[str, Policy], old: dict[str, list[Upstream]], new: dict[str, list[Upstream]]
    ) -> None:
        """Tell each model's policy which replicas left and joined (a replica at a new URL: both)."""
        for model, policy in policies.items():
            before = {id(u): u for u in old.get(model, [])}
            after = {id(u): u for u in new.get(model, [])}
            for key in before.keys() - after.keys():
                policy.on_replica_left(before[key].replica_id)
            for key in after.keys() - before.keys():
                policy.on_replica_joined(after[key])

    @property
    def _require_key(self):
        from aiohttp import web

        @web.middleware
        async def require_key(request, handler):
            """deploy.api_key: `Authorization: Bearer <key>` on every route but /health (and /metrics unless
            protect_metrics), 401 in OpenAI's shape otherwise."""
            key = self.spec.api_key
            open_paths = ("/health",) if self.spec.protect_metrics else ("/health", "/metrics")
            if key and request.path not in open_paths:
                given = request.headers.get("Authorization", "")
                # (aiohttp keeps header bytes that are not UTF-8 as surrogates)
                if not hmac.compare_digest(given.encode(errors="surrogateescape"), f"Bearer {key}".encode()):
                    body = {"error": {"message": "Incorrect API key provided.", "type": "invalid_request_error"}}
                    body["error"]["code"] = "invalid_api_key"
                    return web.json_response(body, status=401)
            return await handler(request)

        return require_key

    def _upstream_headers(self, headers: dict) -> dict:
        """Headers of a request to an engine: the client's, with the deployment's key (engines require it too)."""
        if self.spec.api_key:
            headers = {k: v for k, v in headers.items() if k.lower() != "authorization"}
            headers["Authorization"] = f"Bearer {self.spec.api_key}"
        return headers

    async def _metrics(self, request):
        """Every engine replica's own series, labelled by replica, then the router's (flagscale/serve/metrics.py)."""
        import aiohttp
        from aiohttp import web

        timeout = aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT_S)

        async def scrape(upstream: Upstream):
            record = upstream.record
            labels = {
                "serve_id": record.serve_id,
                "replica": record.replica_id,
                "role": record.role or "colocated",
                "host": record.node_ip,
            }
            try:
                headers = self._upstream_headers({})  # engines require the key on /metrics too (serve/engine_auth.py)
                async with self._session.get(record.url + "/metrics", timeout=timeout, headers=headers) as resp:
                    if resp.status == 200:
                        return labels, await resp.text()
            except (TimeoutError, aiohttp.ClientError):
                pass
            self.metrics.scrape_failures.inc()
            return None

        scraped = await asyncio.gather(*(scrape(u) for u in list(self._table.by_replica.values())))
        # every router process's own series, labelled by process (the others' as of their last report)
        routers = [({"router_process": self._process}, self.metrics.text().decode())]
        routers += [({"router_process": r.process}, r.metrics) for r in self._peer_reports if not r.stale]
        text = merge_replica_metrics([s for s in scraped if s is not None]) + merge_replica_metrics(routers)
        return web.Response(body=text.encode(), headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    async def _health(self, request):
        from aiohttp import web

        missing = [m for m in self.spec.models if not self._table.by_model.get(m)]
        missing += [f"{m} (prefill)" for m in self._prefill_policies if not self._table.prefill_by_model.get(m)]
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
            ups = rank_replicas(self._table.by_model.get(names[0], []), 0, time.monotonic())
            entries = None
            for upstream in ups[:2]:
                try:
                    headers = self._upstream_headers({})
                    async with self._session.get(upstream.record.url + "/v1/models", headers=headers) as resp:
                        entries = (await resp.json())["data"]
                        break
                except Exception:
                    upstream.breaker.failure(time.monotonic())
            if entries is None:
                entries = [{"id": n, "object": "model", "owned_by": "flagscale", "created": 0} for n in names]
            data.extend(entries)
        return web.json_response({"object": "list", "data": data})

    async def _proxy(self, request):
        if self._graph is not None and request.method == "POST" and request.path == self.spec.graph_route:
            return await self._run_graph(request)
        if self._draining:
            return _error(503, "server is shutting down", "ServiceUnavailableError")
        try:
            body = await read_body(request, self.spec.max_body_bytes)
            payload = parse_body(body) if body else {}
            check_payload(payload)
        except _BadRequest as exc:
            return exc.response()
        if "kv_transfer_params" in payload:  # where a decode engine pulls KV from is the router's to say
            del payload["kv_transfer_params"]
            body = _dumps(payload)
        model = payload.get("model")
        if model is None and len(set(self.spec.models.values())) == 1:
            model = next(iter(self.spec.models))
        if model not in self.spec.models:
            known = ", ".join(self.spec.models)
            return _error(404, f"model {model!r} is not served here; models: {known}", "NotFoundError")
        policy = self._policies[model]
        info = RequestInfo(model, payload, {k.lower(): v for k, v in request.headers.items()})
        stream = None
        if request.method == "POST" and request.path in (COMPLETIONS, CHAT) and payload.get("stream") is True:
            stream = ClientStream(request.path, payload, engine_resumes=model not in self.spec.no_resume)
        routing = self.spec.routing.get(model, RoutingSpec())
        exchange = _Exchange(request, model, policy, info, body, stream, routing.max_migrations)
        exchange.headers = self._upstream_headers(
            {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        )
        self._inflight += 1
        self.metrics.inflight.inc()
        status = 499  # the client went away (the handler was cancelled)
        try:
            response = await self._route(exchange, payload)
            status = response.status
            return response
        finally:
            self._inflight -= 1
            self.metrics.inflight.dec()
            self._observe(exchange, status)

    def _observe(self, exchange: _Exchange, status: int) -> None:
        m, model = self.metrics, exchange.model
        m.requests.labels(model, str(status)).inc()
        m.e2e.labels(model).observe(time.monotonic() - exchange.started)
        if exchange.first_byte_at is not None:
            m.ttft.labels(model).observe(exchange.first_byte_at - exchange.started)
        m.bytes.labels(model).inc(exchange.sent_bytes)
        if exchange.moves:
            m.moved.labels(model).inc(exchange.moves)
        if exchange.stream is not None and exchange.stream.resumed:
            m.resumed.labels(model).inc(exchange.stream.resumed)

    async def _route(self, exchange: _Exchange, payload: dict):
        """Prefill (disaggregated models), then replicas in the policy's order until one answers, bounded."""
        model, request = exchange.model, exchange.http
        if model in self._prefill_policies and request.method == "POST" and request.path in (COMPLETIONS, CHAT):
            kv = await self._prefill(exchange, payload)
            if not isinstance(kv, dict):
                return kv  # the prefill pool's answer (a 4xx) or why none could take the prompt
            exchange.with_kv(payload, kv)
        while True:
            try:
                upstream = await self._admitted(("serve", model), lambda: self._pick(exchange))
            except _Overloaded as exc:
                return await self._overloaded(exchange, str(exc))
            if upstream is None:
                return await self._give_up(exchange)
            try:
                return await self._forward(exchange, upstream)
            except _Unreachable:  # nothing was sent: the next replica may take it
                upstream.breaker.trip(time.monotonic())
                exchange.unreachable += 1
            except _Failed as exc:  # the replica failed the request: another one takes it over, bounded
                exchange.failure = str(exc)
                if exc.engine_died:
                    exchange.engine_deaths += 1
                    if exchange.engine_deaths > RETRIES_AFTER_ENGINE_DEATH:
                        exchange.failure += (
                            "; an engine already died during this request before, and the request may be what "
                            "kills them: it is not sent to another replica"
                        )
                        log.warning("%s", exchange.failure)
                        return await self._give_up(exchange)
                if exchange.moves >= exchange.max_moves:
                    return await self._give_up(exchange)
                exchange.moves += 1
                exchange.without_kv()  # another decode replica computes the prompt itself
                upstream.migrations += 1
                self._moved += 1
                log.warning(
                    "%s; moving the request to another replica (%d of at most %d)",
                    exc,
                    exchange.moves,
                    exchange.max_moves,
                )

    async def _overloaded(self, exchange: _Exchange, reason: str):
        """503 with Retry-After (a stream already begun, waiting to go on elsewhere: a closing error event)."""
        message = f"every replica of {exchange.model!r} is at its max_ongoing_requests and {reason}"
        if exchange.response is not None:
            exchange.failure = message
            return await self._give_up(exchange)
        return _error(503, message, "ServiceUnavailableError", headers={"Retry-After": str(RETRY_AFTER_S)})

    def _pick(self, exchange: _Exchange) -> Upstream | None:
        return _first_untried(
            exchange.policy, self._table.by_model.get(exchange.model, []), exchange.info, exchange.tried
        )

    async def _prefill(self, exchange: _Exchange, payload: dict):
        """A disaggregated model's first step: a prefill replica computes the prompt's KV cache and answers with
        the kv_transfer_params a decode replica pulls it with. Returns them, or the answer for the client: a
        prefill replica's 4xx as is, or why no prefill replica could take the prompt (each tried at most once)."""
        import aiohttp
        from aiohttp import web

        body = {k: v for k, v in payload.items() if k != "stream_options"}
        body.update(stream=False, max_tokens=1, kv_transfer_params=REMOTE_DECODE)
        if "max_completion_tokens" in body:
            body["max_completion_tokens"] = 1
        data = json.dumps(body).encode()
        policy = self._prefill_policies[exchange.model]
        pool = self._table.prefill_by_model.get(exchange.model, [])
        tried: set[str] = set()
        failure = ""
        while True:
            try:
                upstream = await self._admitted(
                    ("prefill", exchange.model), lambda: _first_untried(policy, pool, exchange.info, tried)
                )
            except _Overloaded as exc:
                return await self._overloaded(exchange, f"(prefill) {exc}")
            if upstream is None:
                reason = f"{failure}; " if failure else ""
                message = f"{reason}no prefill replica of {exchange.model!r} could take the prompt"
                return _error(503, message, "ServiceUnavailableError")
            name = f"prefill replica {upstream.record.replica_id} of {upstream.record.serve_id!r}"
            ok = None
            policy.before_request(upstream, exchange.info)
            self._send_hint("prefill", exchange.model, upstream, exchange.info)
            upstream.inflight += 1
            upstream.sent += 1
            try:
                url = upstream.record.url + exchange.http.path
                async with self._session.post(url, data=data, headers=exchange.headers) as resp:
                    answer = await resp.read()
                ok = resp.status < 500
                if not ok:
                    failure = f"{name} answered {resp.status}"
            except aiohttp.ClientConnectorError:
                ok = False
                upstream.breaker.trip(time.monotonic())
                continue
            except aiohttp.ClientError as exc:
                ok = False
                failure = f"{name} failed ({exc!r})"
            finally:
                upstream.inflight -= 1
                self._slot_freed(upstream)
                if ok is None and upstream.breaker.probing:
                    upstream.breaker.probing = False
                policy.after_request(upstream, exchange.info, bool(ok))
            if not ok:  # nothing reached the client: the next prefill replica takes the prompt
                upstream.breaker.failure(time.monotonic())
                upstream.migrations += 1
                self._moved += 1
                continue
            upstream.breaker.success()
            upstream.served += 1
            if resp.status >= 400:  # the client's problem: it would fail on decode too
                headers = {k: v for k, v in resp.headers.items() if k.lower() not in HOP_BY_HOP}
                return web.Response(status=resp.status, body=answer, headers=headers)
            try:
                kv = json.loads(answer).get("kv_transfer_params")
            except (ValueError, AttributeError):
                kv = None
            if not kv:
                return _error(502, f"{name} answered without kv_transfer_params", "BadGatewayError")
            return kv

    async def _give_up(self, exchange: _Exchange):
        """No replica is left to try: the last answer, an error, or (stream begun) a closing error event."""
        model = exchange.model
        if exchange.response is not None:
            message = f"{exchange.failure}; no other replica of {model!r} could take the stream over"
            await exchange.write(error_event(message))
            await exchange.response.write_eof()
            return exchange.response
        if exchange.last_answer is not None:
            return exchange.last_answer
        if exchange.failure:
            return _error(502, f"{exchange.failure}; no other replica of {model!r} could take it", "BadGatewayError")
        if exchange.unreachable:
            return _error(503, f"no replica of {model!r} could be reached", "ServiceUnavailableError")
        return _error(503, f"no ready replica for model {model!r}", "ServiceUnavailableError")

    async def _run_graph(self, request):
        """The graph's entry: JSON body -> graph driver -> the sink's output as JSON (`?trace=1`: with timings)."""
        from aiohttp import web

        if self._draining:
            return _error(503, "server is shutting down", "ServiceUnavailableError")
        try:
            payload = parse_body(await read_body(request, self.spec.max_body_bytes) or b"{}")
        except _BadRequest as exc:
            return exc.response()
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

    async def _forward(self, exchange: _Exchange, upstream: Upstream):
        """Send the request to one replica and relay its answer. Raises _Unreachable (nothing was sent) or
        _Failed (the replica failed before the client got its answer, or mid-stream where the stream can go
        on elsewhere); a stream that cannot go on ends with an error event."""
        from aiohttp import web

        stream = exchange.stream
        if stream is not None and stream.sent_events:
            path, data = stream.resume_request()
        else:
            path = str(exchange.http.rel_url)
            data = stream.first_request(exchange.body) if stream is not None else exchange.body
        name = f"replica {upstream.record.replica_id} of {upstream.record.serve_id!r}"
        breaker = upstream.breaker
        ok = None  # what the replica's answer says of it: True, False, or None (unknown: nothing recorded)
        exchange.policy.before_request(upstream, exchange.info)
        self._send_hint("serve", exchange.model, upstream, exchange.info)
        upstream.inflight += 1
        upstream.sent += 1
        answer = None
        try:
            try:
                answer = await self._upstream.request(
                    exchange.http.method,
                    upstream.record.url + path,
                    data,
                    exchange.headers,
                    # no pooled connection it may have closed
                    keep_alive=engines.get(upstream.record.engine).capabilities.keeps_connections,
                )
            except ConnectFailed as exc:  # no connection: nothing sent, the next replica may take it
                ok = False  # the caller trips the circuit
                raise _Unreachable(str(exc)) from exc
            except Disconnected as exc:
                ok = False
                breaker.failure(time.monotonic())
                raise _Failed(f"{name} dropped the connection before answering ({exc})", engine_died=True) from exc
            upstream.served += 1
            ok = answer.status < 500  # a 4xx is the client's problem: passed on, the replica is fine
            if ok:
                breaker.success()
            else:
                breaker.failure(time.monotonic())
            out_headers = {k: v for k, v in answer.headers.items() if k.lower() not in HOP_BY_HOP}
            if not ok or "text/event-stream" not in answer.headers.get("Content-Type", ""):
                try:
                    body = await answer.read()
                except Disconnected as exc:
                    ok = False
                    breaker.failure(time.monotonic())
                    raise _Failed(f"{name} broke off its answer ({exc})", engine_died=True) from exc
                reply = web.Response(status=answer.status, body=body, headers=out_headers)
                if not ok:
                    if exchange.response is None:
                        exchange.last_answer = reply  # returned as is when no other replica can take it
                    raise _Failed(f"{name} answered {answer.status}")
                if exchange.response is not None:  # a stream's continuation was refused (a 4xx)
                    message = f"{name} refused to continue the stream: {body[:500].decode(errors='replace')}"
                    await exchange.write(error_event(message, answer.status, "BadRequestError"))
                    await exchange.response.write_eof()
                    return exchange.response
                exchange.first_byte_at = time.monotonic()
                exchange.sent_bytes += len(body)
                return reply
            if exchange.response is None:
                await exchange.begin_stream(web.StreamResponse(status=answer.status, headers=out_headers))
            try:
                await answer.relay(exchange.relay_piece, exchange.drain)
            except Disconnected as exc:  # the replica broke off mid-stream (a client gone raises in drain)
                ok = False
                breaker.failure(time.monotonic())
                if stream is None:  # not an OpenAI event stream: cut off as it is
                    raise
                return await self._broken_stream(exchange, f"{name} broke off the stream ({exc})")
            if stream is not None and not stream.done:  # the connection closed before the stream's end
                ok = False
                breaker.failure(time.monotonic())
                return await self._broken_stream(exchange, f"{name} closed the stream before its end")
            await exchange.response.write_eof()
            return exchange.response
        finally:
            if answer is not None:
                answer.close()
            upstream.inflight -= 1
            self._slot_freed(upstream)
            if ok is None and breaker.probing:  # cancelled before the replica answered: let another probe
                breaker.probing = False
            exchange.policy.after_request(upstream, exchange.info, bool(ok))

    async def _broken_stream(self, exchange: _Exchange, reason: str):
        """A replica's stream broke off: finish it, hand it to another replica (raise _Failed), or end it with
        an error event."""
        stream, response = exchange.stream, exchange.response
        if stream.finished:  # every token is there: only the end was lost
            if not stream.done:
                await exchange.write(b"data: [DONE]\n\n")
            await response.write_eof()
            return response
        if not stream.sent_events:  # the client has nothing of it yet: send it again as it was
            raise _Failed(reason, engine_died=True)
        if stream.can_resume():
            remaining = stream.remaining_tokens()
            if remaining is not None and remaining <= 0:  # it broke off after its last token
                await exchange.write(stream.finish_events() + b"data: [DONE]\n\n")
                await response.write_eof()
                return response
            if exchange.engine_deaths < RETRIES_AFTER_ENGINE_DEATH:
                self._resumed += 1
            raise _Failed(reason + "; resuming it", engine_died=True)
        await exchange.write(error_event(f"{reason}; this request's stream cannot be resumed elsewhere"))
        await response.write_eof()
        return response

    # ---- Serve-side methods (called through deployment handles) ------------------------------

    def check_health(self) -> None:
        if not self._thread.is_alive():
            raise RuntimeError("router event loop thread died")

    async def drain(self, timeout_s: float) -> int:
        """Refuse new requests and wait (bounded) for in-flight ones, in every router process of the deployment
        (the others see the drain request within DRAIN_POLL_S); returns how many were still running."""
        self._draining = True
        asked_at, deadline = time.time(), time.monotonic() + timeout_s
        sharing = self._hints is not None
        if sharing:
            try:
                await asyncio.to_thread(router_peers.request_drain, self.spec.app, timeout_s)
            except Exception as exc:
                log.warning("could not ask the other router processes to drain: %s", exc)
                sharing = False
        others = 0
        while time.monotonic() < deadline:
            if sharing:
                others = await asyncio.to_thread(self._others_inflight, asked_at)
            if not self._inflight and not others:
                break
            await asyncio.sleep(router_peers.DRAIN_POLL_S)
        return self._inflight + others

    def _others_inflight(self, asked_at: float) -> int:
        """Requests the other processes still hold (one for a process that has not reported draining since)."""
        left = 0
        for report in router_peers.reports(self.spec.app):
            if report.process == self._process:
                continue
            drained = report.updated_at >= asked_at and report.stats.get("draining")
            left += report.stats.get("inflight", 0) if drained else max(1, report.stats.get("inflight", 0))
        return left

    def stats(self) -> dict:
        """Per replica: served, in-flight, circuit, the routing policy's table, summed over every router process
        of the deployment (router_peers.merge_stats; the others' as of their last report, at most refresh_s
        old), and each process's own load under "processes". This process's part is read on its event loop
        thread, which is the one changing the policies' tables."""
        loop = getattr(self, "_loop", None)
        if loop is not None and loop.is_running() and threading.current_thread() is not self._thread:

            async def collect() -> dict:
                return self._collect_stats()

            own = asyncio.run_coroutine_threadsafe(collect(), loop).result(timeout=10)
        else:
            own = self._collect_stats()
        by_process = {self._process: own}
        if self._hints is not None:
            try:
                others = router_peers.reports(self.spec.app)
            except Exception:
                others = self._peer_reports
            by_process.update({r.process: r.stats for r in others if r.process != self._process})
        return router_peers.merge_stats(by_process)

    def _collect_stats(self) -> dict:
        counts: dict[str, dict] = defaultdict(dict)
        for upstream in self._table.by_replica.values():
            entry = {
                "serve_id": upstream.record.serve_id,
                "url": upstream.record.url,
                "served": upstream.served,
                "inflight": upstream.inflight,
                "circuit": upstream.breaker.state(),
                "circuit_opened": upstream.breaker.opened,
                "migrations": upstream.migrations,
            }
            policies = self._prefill_policies if upstream.record.role == "prefill" else self._policies
            for model in upstream.record.models:
                policy = policies.get(model)
                if policy is not None:
                    entry["routing"] = policy.name
                    entry.update(policy.stats(upstream.replica_id))
            counts[upstream.record.replica_id] = entry
        return {
            "pid": os.getpid(),
            "draining": self._draining,
            "inflight": self._inflight,
            "moved": self._moved,
            "resumed": self._resumed,
            "replicas": dict(counts),
        }


@dataclass
class _Exchange:
    """One client request as the router carries it from replica to replica."""

    http: Any  # the client's aiohttp request
    model: str
    policy: Policy
    info: RequestInfo
    body: bytes
    stream: ClientStream | None  # completions and chat streams: relayed event by event
    max_moves: int  # times it may move to another replica after one failed it (routing_options.max_migrations)
    headers: dict = field(default_factory=dict)
    tried: set[str] = field(default_factory=set)  # replica ids: each gets the request at most once
    moves: int = 0
    engine_deaths: int = 0  # replicas whose connection broke off during this request (RETRIES_AFTER_ENGINE_DEATH)
    unreachable: int = 0
    failure: str = ""  # why the last replica that had it failed
    last_answer: Any = None  # the last 5xx answer, returned as is when no replica is left
    response: Any = None  # the client's stream response, once begun
    writer: Any = None  # its aiohttp writer
    client: Any = None  # the client's connection (asyncio transport) the stream is written to
    chunked: bool = True  # its body is framed in chunks
    plain_body: bytes | None = None  # disaggregated: the request without the KV transfer parameters
    started: float = field(default_factory=time.monotonic)
    first_byte_at: float | None = None  # when the client got the first byte of its answer
    sent_bytes: int = 0

    async def begin_stream(self, response) -> None:
        """Sends the client the head of its streamed answer; the body follows through relay_piece and write."""
        self.response = response
        self.writer = await response.prepare(self.http)
        self.client = self.http.transport
        self.chunked = self.http.version >= (1, 1)  # aiohttp frames the body in chunks for HTTP/1.1 clients

    def relay_piece(self, data: bytes) -> bool:
        """A piece of the replica's streamed body, straight from its connection (upstream_http): the events
        for the client (ClientStream.feed) are written to the client's connection here, framed as aiohttp
        frames the rest of the answer. False: the client's buffer is full or the client is gone."""
        out = self.stream.feed(data) if self.stream is not None else data
        transport = self.client
        if transport is None or transport.is_closing():
            return False
        if not out:
            return True
        if self.first_byte_at is None:
            self.first_byte_at = time.monotonic()
        self.sent_bytes += len(out)
        transport.write(b"%x\r\n%b\r\n" % (len(out), out) if self.chunked else out)
        return transport.get_write_buffer_size() <= CLIENT_BUFFER_BYTES

    async def drain(self) -> None:
        """Waits for the client to take what it was sent (relay_piece said it was full)."""
        if self.client is None or self.client.is_closing():
            raise ConnectionResetError("the client went away")
        await self.writer.drain()

    async def write(self, data: bytes) -> None:
        """Bytes of a streamed answer to the client."""
        if self.first_byte_at is None:
            self.first_byte_at = time.monotonic()
        self.sent_bytes += len(data)
        await self.response.write(data)

    def with_kv(self, payload: dict, kv: dict) -> None:
        """A disaggregated request goes to decode with the prefill's KV transfer parameters."""
        self.plain_body = self.body
        with_kv = {**payload, "kv_transfer_params": kv}
        self.body = json.dumps(with_kv).encode()
        if self.stream is not None:
            self.stream.body = with_kv

    def without_kv(self) -> None:
        """Sent again elsewhere: that replica computes the prompt itself (the KV blocks were for the first)."""
        if self.plain_body is not None:
            self.body = self.plain_body
            if self.stream is not None:
                self.stream.body = {k: v for k, v in self.stream.body.items() if k != "kv_transfer_params"}


_FULL = "every replica it may take is at max_ongoing_requests"


def _first_untried(policy: Policy, upstreams: list[Upstream], info: RequestInfo, tried: set[str]) -> Upstream | None:
    """The policy's first choice among the replicas not tried yet (each gets a request at most once) that have a
    free slot (fewer than max_ongoing_requests in flight), taking the replica's half-open probe if its circuit is
    half open. None when no replica is left to try; _FULL when some are, but all of them are at their limit."""
    now = time.monotonic()
    full = False
    for upstream in policy.select(upstreams, info, now):
        if upstream.replica_id in tried:
            continue
        if upstream.inflight >= upstream.max_ongoing:
            full = True
            continue
        if not upstream.breaker.begin(now):  # another request took its half-open probe
            continue
        tried.add(upstream.replica_id)
        return upstream
    return _FULL if full else None


class _Unreachable(Exception):
    """The replica could not be connected to: nothing was sent."""


class _Failed(Exception):
    """The replica had the request and failed it before the client got its answer, or mid-stream where the
    stream can go on elsewhere: another replica may take it over. `engine_died`: the connection broke off (the
    engine's process is likely gone), as opposed to a 5xx answer."""

    def __init__(self, reason: str, engine_died: bool = False):
        super().__init__(reason)
        self.engine_died = engine_died
