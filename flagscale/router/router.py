"""The OpenAI-compatible entry point: a lean byte-streaming router in front of the engines' own servers.

It runs inside a Ray Serve replica (so Serve places, health-checks and restarts it) but serves HTTP itself with
aiohttp on its own event loop thread. `Router` is that replica: its life (the thread, Serve's reconfigure, drain,
stats, health) and the state its parts share. The parts, one module each:

- frontend.py: the HTTP face (routes, API key, each request's way in: body checks, model, policy);
- admission.py: at most max_ongoing_requests per replica, a bounded queue beyond (503 with Retry-After);
- failover.py: the replicas in the policy's order (policies/), every retry and resume decision; verdict.py: what
  an answer says of its replica;
- exchange.py + upstream_http.py + resume.py: the relay of a streamed answer, piece by piece from the replica's
  connection to the client's, with no task woken per piece;
- pd.py: the prefill step of disaggregated models;
- replicas.py + circuit_breaker.py: the replicas as read from the registry, their load and circuits;
- kv_events.py + kv_index.py + kv_keys.py: the engines' own KV events, for the cache_aware policies routing on them;
- peers.py: what the router processes of one deployment share (reports, drains, routing hints);
- state.py: the process's counters and its clients to the replicas;
- metrics.py: /metrics (planner_metrics.py: the SLO planners' series);
- cold_start.py: requests for a model at zero replicas, held (bounded) while Serve starts one.

Each part is handed the few collaborators it uses (the current spec, the replicas and policies, the counters, ...),
never the Router.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from typing import Any

import aiohttp
from aiohttp import web

from flagscale.adaptors import ray
from flagscale.config.routing import DEFAULT_MAX_ONGOING_REQUESTS, RoutingSpec
from flagscale.replica import registry, runtime_adapters
from flagscale.replica.cpu_layout import RouterPinning
from flagscale.replica.registry import ReplicaRecord
from flagscale.replica.slo_policy import recorded_start_s
from flagscale.router import own_port, peers
from flagscale.router.adapter_admin import AdapterAdmin
from flagscale.router.admission import AdmissionQueue
from flagscale.router.cold_start import ColdStart
from flagscale.router.failover import Failover
from flagscale.router.frontend import Frontend
from flagscale.router.lora import AdapterRouting
from flagscale.router.metrics import RouterMetrics
from flagscale.router.pd import Prefill
from flagscale.router.policies import Policy, make_policy
from flagscale.router.replicas import Replicas, Upstream, give_up_on_frozen, probe_half_open
from flagscale.router.spec import RouterSpec
from flagscale.router.state import Clients, Counters
from flagscale.router.upstream_http import UpstreamClient
from flagscale.router.wake import AwakeTargets, Waker

try:  # the router's event loop: uvloop where installed (requirements/base.txt), asyncio's otherwise
    import uvloop
except ImportError:  # pragma: no cover
    uvloop = None

log = logging.getLogger("flagscale.router")

# Idle upstream connections are closed before vLLM's server closes them (uvicorn keep-alive, 5 s by default:
# VLLM_HTTP_TIMEOUT_KEEP_ALIVE), so the router does not send a request on a connection being closed.
UPSTREAM_KEEPALIVE_S = 4.0
UPSTREAM_CONNECT_TIMEOUT_S = 5.0
# A request that finds no replica of its model has the registry read again at once (refresh_on_miss); a read that
# began at most this long before it asked counts as fresh, so requests for a model without replicas cost a few
# reads a second.
MISS_REFRESH_GAP_S = 0.25
MISS_REFRESH_TIMEOUT_S = 2.0  # the most a registry read may take (a GCS that does not answer: 503 then)


def upstream_session(read_timeout_s: float = 900.0) -> aiohttp.ClientSession:
    """The router's aiohttp client for its own calls to the replicas: health probes, /metrics, /v1/models,
    prefill (the requests it relays go through upstream_http). Every call has a bound: its own, else a replica
    silent for `read_timeout_s` (deploy.upstream_first_byte_timeout_s) fails it. Call inside its event loop."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, keepalive_timeout=UPSTREAM_KEEPALIVE_S),
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=UPSTREAM_CONNECT_TIMEOUT_S, sock_read=read_timeout_s),
        auto_decompress=False,
    )


class RouterListenError(RuntimeError):
    """The router cannot have its port (taken, shared with another deployment, a bad host): Serve's retries
    would not do better, so the run reports it at once (flagscale/actions/deploy.py)."""


class Router:
    """The router's Ray Serve replica: its event loop thread, Serve's calls (reconfigure, drain, stats, health),
    the replica table's refresh, and the parts (frontend, admission, failover, prefill, peers), each handed only
    what it uses of what they share: `spec` (replaced on reconfigure; the parts read the current one), `replicas`
    (the table and the policies), `counters`, `metrics`, `clients`."""

    def __init__(self, spec: RouterSpec, *engines, graph=None):
        self.spec = spec
        self._engines = engines  # handles keep the engine deployments part of this application
        self.graph = graph  # DeploymentHandle of the graph driver, when the config has custom nodes
        self._init_state()
        if spec.pin_cpus:  # (in a Serve replica; the benchmark's routers run without Ray, and never import it)
            self._pinning = RouterPinning(ray.get_runtime_context().get_node_id())
        self._started = threading.Event()
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._serve_forever, name="flagscale-router", daemon=True)
        self._thread.start()
        if not self._started.wait(30):
            raise RuntimeError(f"router did not start listening on {spec.host}:{spec.port} within 30s")
        if self._failure is not None:
            raise RouterListenError(f"router cannot listen on {spec.host}:{spec.port}: {self._failure}")

    def reconfigure(self, config: dict[str, Any]) -> None:
        """Serve calls this after __init__ and on every update whose router spec changed (models added or
        removed, routing policies): applied on the router's event loop, keeping the policies (and their prefix
        tables) of models whose routing did not change."""
        self.configured_spec = self.configured_spec.reconfigured(config)
        spec = self.configured_spec.with_adapter_sets(self._adapter_sets)
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
        self.clients.relay.watch.first_byte_s = spec.admission.upstream_first_byte_timeout_s
        self.clients.relay.watch.idle_s = spec.admission.upstream_idle_timeout_s
        replicas, table = self.replicas, self.replicas.table
        for upstream in table.by_replica.values():
            upstream.max_ongoing = self._max_ongoing(upstream)
        for policies, old_routing, routing, models, pools in (
            (replicas.policies, old.routing, spec.routing, spec.models, table.by_model),
            (
                replicas.prefill_policies,
                old.prefill_routing,
                spec.prefill_routing,
                spec.prefill_routing,
                table.prefill_by_model,
            ),
        ):
            for model in list(policies):
                if model not in models or old_routing.get(model) != routing.get(model):
                    del policies[model]
            for model in models:
                if model not in policies:
                    prefill = pools is table.prefill_by_model
                    policies[model] = (
                        make_policy(routing.get(model, RoutingSpec()))
                        if prefill
                        else self.adapter_routing.policy(model, spec)  # an adapter's is placed (router/lora.py)
                    )
                    for upstream in pools.get(model, []):
                        policies[model].on_replica_joined(upstream)

    def _init_state(self) -> None:
        """The request path's state (the unit tests build a Router with this only: no Ray, no thread)."""
        self.configured_spec = self.spec  # the spec as Serve gives it; `spec` adds the adapter sets given at run time
        self._adapter_sets: dict[str, dict[str, str]] = {}  # (replica/runtime_adapters.py)
        self.metrics = RouterMetrics()
        self.adapter_routing = AdapterRouting(self.metrics.registry)  # LoRA adapters' placement (router/lora.py)
        policies: dict[str, Policy] = {
            model: self.adapter_routing.policy(model, self.spec) for model in self.spec.models
        }
        prefill_policies: dict[str, Policy] = {
            model: make_policy(spec) for model, spec in self.spec.prefill_routing.items()
        }
        self.replicas = Replicas(policies, prefill_policies)
        self.replicas.kv_events.metrics = self.metrics
        self.counters = Counters()
        bounds = self.spec.admission
        self.clients = Clients(
            UpstreamClient(
                UPSTREAM_KEEPALIVE_S,
                UPSTREAM_CONNECT_TIMEOUT_S,
                bounds.upstream_first_byte_timeout_s,
                bounds.upstream_idle_timeout_s,
            )
        )
        self.admission = AdmissionQueue()
        self._pinning = None  # the router processes' cores (RouterPinning), where spec.pin_cpus asks for it
        self._miss_refresh = asyncio.Lock()
        self._read_began = float("-inf")  # when the last registry read that completed began (monotonic)
        spec = self._current_spec
        self.peers = peers.PeerLink(spec, self.replicas, self.counters, self.metrics, self.collect_stats)
        targets = AwakeTargets(lambda: self.spec.app, lambda: self.spec.awake_planned)
        self.waker = Waker(lambda: self.clients.session, lambda: self.spec.engine_key, self.metrics, targets)
        self.prefill = Prefill(spec, self.replicas, self.counters, self.admission, self.clients, self.peers)
        self.failover = Failover(
            spec,
            self.replicas,
            self.counters,
            self.admission,
            self.clients,
            self.peers,
            self.prefill,
            self.refresh_on_miss,
            self.waker,
        )
        handles = {getattr(h, "deployment_name", ""): h for h in getattr(self, "_engines", ())}  # none: tests
        self.failover.cold_start = ColdStart(handles, lambda serve_id: recorded_start_s(self.spec.app, serve_id))
        self.frontend = Frontend(
            spec, self.replicas, self.counters, self.metrics, self.clients, self.peers, self.failover, self.graph
        )
        self.frontend.admin = AdapterAdmin(spec, self._live_records, self._refresh)

    def _current_spec(self) -> RouterSpec:
        """What the parts read the spec through: reconfigure replaces it."""
        return self.spec

    # ---- event loop thread -------------------------------------------------------------------

    def _serve_forever(self) -> None:
        loop = uvloop.new_event_loop() if uvloop is not None else asyncio.new_event_loop()
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
        self.clients.session = upstream_session(self.spec.admission.upstream_first_byte_timeout_s)
        # The replicas are known before the port is bound: the kernel hands a process connections from the moment
        # it listens (a router process Serve starts again takes its share at once).
        await self._refresh()
        # every router process of the deployment listens on the same port; the kernel spreads connections
        runner = await self.frontend.listen(
            self.spec.host, self.spec.port, backlog=1024, reuse_address=True, reuse_port=True
        )
        foreign = own_port.foreign_listeners(self.spec.host, self.spec.port, os.environ.get(own_port.DEPLOYMENT_ENV))
        if foreign:
            await runner.cleanup()
            raise RuntimeError(
                f"port {self.spec.port} is served by another deployment too: {', '.join(foreign)} listens there "
                "(stop it, or give this one another experiment.runner.deploy.port)"
            )
        if self.spec.share_with_peers:
            await self.peers.start_sharing()
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._refresh_forever()), loop.create_task(self._watch_forever())]

    def web_app(self) -> web.Application:
        """The HTTP surface (flagscale/router/frontend.py)."""
        return self.frontend.app()

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(self.spec.refresh_s)
            await self._bounded_refresh("replica refresh")
            await self._probe_half_open()
            if self.spec.share_with_peers:
                await self.peers.publish()

    async def _watch_forever(self) -> None:
        """Every refresh_s: replicas silent on an answer being relayed are checked (replicas.give_up_on_frozen)."""
        while True:
            await asyncio.sleep(self.spec.refresh_s)
            try:
                await give_up_on_frozen(self.replicas.table, self.clients)
            except Exception:  # never let the watch end
                log.exception("checking silent replicas failed")

    async def _probe_half_open(self) -> None:
        """Replicas whose circuit cool-down is over get one /health probe, so an idle router readmits them too."""
        await probe_half_open(list(self.replicas.table.by_replica.values()), self.clients.session)

    async def refresh_on_miss(self) -> None:
        """A request found no replica of its model: read the registry now, not at the next refresh_s tick, so a
        replica that has just joined (one `status` already shows) takes it. One read at a time; one that began at
        most MISS_REFRESH_GAP_S before the ask is taken as it is."""
        asked = time.monotonic()
        async with self._miss_refresh:
            if self._read_began >= asked - MISS_REFRESH_GAP_S:
                return
            await self._bounded_refresh("replica refresh for a request that found no replica")

    async def _bounded_refresh(self, what: str) -> None:
        try:
            await asyncio.wait_for(self._refresh(), MISS_REFRESH_TIMEOUT_S)
        except Exception as exc:  # GCS hiccup or no answer in time: keep the last table
            log.warning("%s failed: %r", what, exc)

    async def _refresh(self) -> None:
        began = time.monotonic()
        records = await asyncio.get_running_loop().run_in_executor(None, registry.list_replicas, self.spec.app)
        self._read_began = max(self._read_began, began)
        stale = self.replicas.update(records, self._max_ongoing, began)
        if stale:  # (so that every reader, `status` and `run` too, sees them gone)
            for record in stale:
                log.warning(
                    "replica %s of %r: no heartbeat for %g s; withdrawn from the registry",
                    record.replica_id,
                    record.serve_id,
                    registry.STALE_AFTER_S,
                )
            await asyncio.get_running_loop().run_in_executor(None, registry.withdraw_stale, self.spec.app, stale)
        self.waker.wake_held(self.replicas.table.by_replica.values())
        await self.waker.targets.refresh()
        self.waker.wake_wanted(self.replicas.table.by_replica.values())
        if self.spec.lora_nodes:
            await self._adopt_adapter_sets()
        if self._pinning is not None:
            self._pinning.update([r for r in records if r not in stale])
        for key in list(self.admission.waiting):  # replicas may have joined, limits changed: every waiter looks again
            self.admission.wake(key, everyone=True)

    async def _adopt_adapter_sets(self) -> None:
        """The adapter sets given at run time (the admin call, in any router process): served as they change."""
        sets = await asyncio.get_running_loop().run_in_executor(None, runtime_adapters.read_all, self.spec.app)
        if sets != self._adapter_sets:
            self._adapter_sets = sets
            self._apply_spec(self.configured_spec.with_adapter_sets(sets))

    def _live_records(self) -> list[ReplicaRecord]:
        return [upstream.record for upstream in list(self.replicas.table.by_replica.values())]

    def _max_ongoing(self, upstream: Upstream) -> int:
        return self.spec.share(self.spec.max_ongoing.get(upstream.record.serve_id, DEFAULT_MAX_ONGOING_REQUESTS))

    # ---- Serve-side methods (called through deployment handles) ------------------------------

    def __del__(self) -> None:
        """Serve stops this router process (a downscale, an update, stop): its report leaves the key-value store
        with it, so the others stop counting it at once rather than when it goes stale."""
        link = getattr(self, "peers", None)
        if link is not None and link.sharing:
            try:
                peers.withdraw(self.spec.app, link.process)
            except Exception as exc:  # noqa: BLE001 - a GCS gone first (stop): stop removes every key anyway
                log.debug("could not withdraw this router's report: %r", exc)

    def check_health(self) -> None:
        if not self._thread.is_alive():
            raise RuntimeError("router event loop thread died")

    async def drain(self, timeout_s: float) -> int:
        """Refuse new requests and wait (bounded) for in-flight ones, in every router process of the deployment
        (peers.PeerLink.drain); returns how many were still running."""
        return await self.peers.drain(timeout_s)

    def stats(self) -> dict:
        """Per replica: served, in-flight, circuit, the routing policy's table, summed over every router process
        of the deployment (peers.merge_stats; the others' as of their last report, at most refresh_s old), and
        each process's own load under "processes". This process's part is read on its event loop thread, which
        is the one changing the policies' tables."""
        loop = getattr(self, "_loop", None)
        if loop is not None and loop.is_running() and threading.current_thread() is not self._thread:

            async def collect() -> dict:
                return self.collect_stats()

            own = asyncio.run_coroutine_threadsafe(collect(), loop).result(timeout=10)
        else:
            own = self.collect_stats()
        return self.peers.stats(own)

    def collect_stats(self) -> dict:
        counters = self.counters
        return {
            "pid": os.getpid(),
            "draining": counters.draining,
            "inflight": counters.inflight,
            "moved": counters.moved,
            "resumed": counters.resumed,
            "decode_only": counters.decode_only,
            "kv_released": counters.kv_released,
            "replicas": self.replicas.stats(),
        }
