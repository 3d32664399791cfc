"""Admission: each replica is sent at most its deployment's max_ongoing_requests at once; further requests wait
in a bounded FIFO queue per (pool, model), bounded in length and time (deploy.max_queued_requests,
queue_timeout_s), beyond which the client gets 503 with Retry-After."""

from __future__ import annotations

import asyncio
import bisect
import itertools
import time
from collections.abc import Callable

from aiohttp import web

from flagscale.router.client_request import error_response
from flagscale.router.policies import Policy, RequestInfo
from flagscale.router.replicas import Upstream
from flagscale.router.spec import RouterSpec

FULL = "every replica it may take is at max_ongoing_requests"
RETRY_AFTER_S = 1  # what a 503 for a full queue tells the client


class Overloaded(Exception):
    """Every replica of the model has max_ongoing_requests in flight and the queue is full, or the request waited
    its queue_timeout_s."""


def overloaded_message(model: str, reason: str) -> str:
    """Why a request that Overloaded turned away (`reason`: the exception's) got no replica."""
    return f"every replica of {model!r} is at its max_ongoing_requests and {reason}"


def overloaded_answer(model: str, reason: str) -> web.Response:
    """The 503 with Retry-After for a request that Overloaded turned away."""
    message = overloaded_message(model, reason)
    return error_response(503, message, "ServiceUnavailableError", headers={"Retry-After": str(RETRY_AFTER_S)})


def first_untried(policy: Policy, upstreams: list[Upstream], info: RequestInfo, tried: set[str]) -> Upstream | None:
    """The policy's first choice among the replicas not tried yet (each gets a request at most once) that have a
    free slot (fewer than max_ongoing_requests in flight), taking the replica's half-open probe if its circuit is
    half open. None when no replica is left to try; FULL when some are, but all of them are at their limit."""
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
    return FULL if full else None


def pool_key(upstream: Upstream, model: str) -> tuple[str, str]:
    return ("prefill" if upstream.record.role == "prefill" else "serve", model)


class AdmissionQueue:
    """The requests waiting for a replica with a free slot, per (pool, model): (ticket, future), oldest first."""

    def __init__(self) -> None:
        self.waiting: dict[tuple[str, str], list[tuple[int, asyncio.Future]]] = {}
        self._tickets = itertools.count()

    async def admitted(self, key: tuple[str, str], pick: Callable[[], Upstream | str | None], spec: RouterSpec):
        """pick()'s replica (or None: no replica left to try). While every replica it could take has
        max_ongoing_requests in flight (pick() gives FULL), the request waits its turn behind earlier ones,
        bounded by spec.admission's max_queued_requests and queue_timeout_s (then Overloaded)."""
        waiters = self.waiting.get(key)
        upstream = FULL if waiters else pick()  # requests already waiting go first
        if upstream is not FULL:
            return upstream
        if waiters is None:
            waiters = self.waiting[key] = []
        if len(waiters) >= spec.share(spec.admission.max_queued_requests):
            raise Overloaded(f"{len(waiters)} requests are already waiting here (deploy.max_queued_requests)")
        loop = asyncio.get_running_loop()
        ticket, deadline = next(self._tickets), loop.time() + spec.admission.queue_timeout_s
        while True:
            entry = (ticket, loop.create_future())
            bisect.insort(waiters, entry, key=lambda e: e[0])  # a request woken in vain keeps its place
            try:
                async with asyncio.timeout_at(deadline):
                    await entry[1]
            except TimeoutError:
                raise Overloaded(
                    f"no replica had a free slot within {spec.admission.queue_timeout_s:g}s (deploy.queue_timeout_s)"
                ) from None
            finally:
                if entry in waiters:
                    waiters.remove(entry)
                if not waiters and self.waiting.get(key) is waiters:
                    del self.waiting[key]
            upstream = pick()
            if upstream is not FULL:
                return upstream
            waiters = self.waiting.setdefault(key, waiters)

    def wake(self, key: tuple[str, str], everyone: bool = False) -> None:
        """A slot may be free in this pool: the oldest waiter (or every one) looks again."""
        waiters = self.waiting.get(key)
        while waiters:
            _, future = waiters.pop(0)
            if not future.done():
                future.set_result(None)
                if not everyone:
                    return

    def slot_freed(self, upstream: Upstream) -> None:
        """A request to `upstream` ended: the oldest waiter of each of its pools looks again."""
        if self.waiting:
            for model in upstream.record.models:
                self.wake(pool_key(upstream, model))
