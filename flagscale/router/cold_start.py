"""Scale from zero (docs/autoscaling.md): a request for a model whose node has scaled to zero replicas
(`min_replicas: 0`) is held here, not answered 503, until a replica serves.

Holding a request tells Serve at once: the router sends the node's deployment one `wake` call through Serve's own
handle (EngineReplica.wake). With no replica to take it, the handle queues the call and reports it to Serve's
controller straight away, and Serve's autoscaler starts a replica for a deployment at zero with a request waiting,
whatever its policy (0 -> 1 bypasses the delays). The held requests go on as soon as the registry lists the new
replica. Bounded twice: at most `MAX_HELD_PER_MODEL` held per model (more get a 503 at once), each for at most
twice the node's measured start time + `MARGIN_S` (a start on a busy host takes longer; the planner's record,
slo_policy.py; a node never measured: the deployment's startup bound), then one 503 with Retry-After.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web

from flagscale.router.client_request import error_response

if TYPE_CHECKING:
    from flagscale.router.replicas import Replicas
    from flagscale.router.spec import RouterSpec

log = logging.getLogger("flagscale.router")
MAX_HELD_PER_MODEL = 256
MARGIN_S = 30.0  # beyond twice the measured start time
POLL_S = 0.5  # how often a held request looks at the registry again
REWAKE_S = 10.0  # a wake older than this is sent again (the first may have been lost with a failed start)


class ColdStart:
    """`handles`: serve_id -> the engine deployment's Serve handle; `start_s`: serve_id -> its measured start time
    (None: never measured), a blocking read (run in a worker thread)."""

    def __init__(self, handles: dict[str, Any], start_s: Callable[[str], float | None]):
        self._handles, self._start_s = handles, start_s
        self.held: dict[str, int] = {}
        self.timeouts = 0
        self._woken: dict[str, float] = {}  # serve_id -> when its last wake was sent (monotonic)
        self._calls: dict[str, Any] = {}  # serve_id -> its last wake's response (kept until the next)

    async def bound_s(self, serve_id: str, fallback_s: float) -> float:
        try:
            measured = await asyncio.get_running_loop().run_in_executor(None, self._start_s, serve_id)
        except Exception as exc:  # the GCS did not answer: the deployment's bound
            log.warning("could not read the start time of %r: %r", serve_id, exc)
            measured = None
        return min(2 * measured + MARGIN_S, fallback_s) if measured else fallback_s

    async def hold_for(
        self, spec: RouterSpec, model: str, replicas: Replicas, refresh: Callable[[], Awaitable[None]]
    ) -> web.Response | None:
        """Hold a request for `model` until the pool that serves it (a disaggregated node's: its decode pool) has a
        replica (bounded): None then, else the 503 the client gets."""
        serve_id = spec.zero_pools.get(model, {}).get("decode", spec.models[model])
        ready = lambda: bool(replicas.pool(model))  # noqa: E731
        return await self.hold(model, serve_id, spec.scale_from_zero[model], ready, refresh)

    async def waits_for_pools(self, spec: RouterSpec, model: str, replicas: Replicas) -> bool:
        """A disaggregated model's pools at zero replicas: a prefill pool is asked for a replica (the decode pool
        computes the prompts itself meanwhile: decode-only); True when the request must wait for its decode pool,
        before any prefill (whose KV blocks would otherwise wait for a decode replica's start)."""
        pools = spec.zero_pools.get(model, {})
        if "prefill" in pools and not replicas.pool(model, prefill=True):
            await self.wake(pools["prefill"])
        return "decode" in pools and not replicas.pool(model)

    async def hold(
        self,
        model: str,
        serve_id: str,
        fallback_s: float,
        ready: Callable[[], bool],
        refresh: Callable[[], Awaitable[None]],
    ) -> web.Response | None:
        """Wait (bounded) until `ready()`; None then, else the 503 the client gets."""
        if self.held.get(model, 0) >= MAX_HELD_PER_MODEL:
            message = f"{MAX_HELD_PER_MODEL} requests for {model!r} already wait for its first replica to start"
            return self._refused(message)
        bound = await self.bound_s(serve_id, fallback_s)
        self.held[model] = self.held.get(model, 0) + 1
        try:
            deadline = time.monotonic() + bound
            while time.monotonic() < deadline:
                await self.wake(serve_id)
                await refresh()
                if ready():
                    return None
                await asyncio.sleep(POLL_S)
        finally:
            self.held[model] -= 1
        self.timeouts += 1
        return self._refused(f"no replica of {model!r} started within {bound:.0f} s (twice its start time + margin)")

    async def wake(self, serve_id: str) -> None:
        """Ask Serve for a replica of `serve_id` (at most once every REWAKE_S): its handle queues the call."""
        now = time.monotonic()
        handle = self._handles.get(serve_id)
        if handle is None or now - self._woken.get(serve_id, -math.inf) < REWAKE_S:
            return
        self._woken[serve_id] = now
        log.info("a request waits for %r at zero replicas: asking Serve for one", serve_id)
        try:  # the handle's call is queued by Serve, never awaited here: the registry says when a replica serves
            self._calls[serve_id] = await asyncio.get_running_loop().run_in_executor(None, handle.wake.remote)
        except Exception as exc:
            log.warning("could not ask Serve for a replica of %r: %r", serve_id, exc)

    @staticmethod
    def _refused(message: str) -> web.Response:
        headers = {"Retry-After": str(math.ceil(REWAKE_S))}
        return error_response(503, message, "ServiceUnavailableError", headers=headers)
