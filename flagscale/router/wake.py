"""Waking a sleeping replica for a request (resources.sleep_delay_s; flagscale/replica/sleep.py puts it to sleep).

A replica's registry record says `asleep` and how many times it went to sleep (`sleeps`). The router takes a
replica for asleep until it has woken that sleep itself (Upstream.woken: the `sleeps` it answered), so it need not
wait for the record to say so. Requests go to awake replicas with a free slot first (prefer_awake); one that takes
a sleeping replica waits for its wake: POST to the engine's wake route, bounded (WAKE_TIMEOUT_S), tried
WAKE_ATTEMPTS times, one wake shared by every request that waits for it, counted and timed in /metrics.

A request the router sent just as the replica went to sleep is held by the engine (new requests wait for the
wake), not failed: at each registry read the router wakes every replica the record says asleep that holds
requests of its own (wake_held). An engine that sleeps by itself (llama.cpp) has no wake route: the request it is
sent wakes it, so the router only counts the wake (its time is in that request's time to first token).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable

import aiohttp

from flagscale import engines
from flagscale.router.metrics import RouterMetrics
from flagscale.router.replicas import Upstream

log = logging.getLogger("flagscale.router")

WAKE_TIMEOUT_S = 60.0  # one wake: the weights come back from host memory (an 8B model: seconds)
WAKE_ATTEMPTS = 2


class WakeFailed(Exception):
    pass


def asleep(upstream: Upstream) -> bool:
    record = upstream.record
    return record.asleep and upstream.woken != record.sleeps


def prefer_awake(pick: Callable[[list[Upstream]], object], upstreams: list[Upstream]) -> object:
    """`pick` (the policy's choice among replicas) over the awake replicas first; over all of them when no awake
    one is left to try or has a free slot."""
    awake = [u for u in upstreams if not asleep(u)]
    if not awake or len(awake) == len(upstreams):
        return pick(upstreams)
    choice = pick(awake)
    return choice if isinstance(choice, Upstream) else pick(upstreams)


class Waker:
    """Wakes sleeping replicas: `session` gives the router's HTTP session, `api_key` the key the engines require (RouterSpec.engine_key)."""

    def __init__(
        self,
        session: Callable[[], aiohttp.ClientSession | None],
        api_key: Callable[[], str | None],
        metrics: RouterMetrics,
    ) -> None:
        self._session, self._api_key, self._metrics = session, api_key, metrics
        self._waking: dict[str, asyncio.Future] = {}

    async def ready(self, upstream: Upstream) -> None:
        """Returns once `upstream` is awake (at once when it is); WakeFailed when it could not be woken."""
        if not asleep(upstream):
            return
        key = upstream.replica_id
        wake = self._waking.get(key)
        if wake is None:
            wake = self._waking[key] = asyncio.ensure_future(self._wake(upstream))
            wake.add_done_callback(lambda _: self._waking.pop(key, None))
        await asyncio.shield(wake)  # a client that leaves does not cancel the wake the others wait for

    def wake_held(self, upstreams: Iterable[Upstream]) -> None:
        """Wake the replicas the registry says asleep that hold requests of this router (sent as they fell asleep)."""
        for upstream in upstreams:
            if upstream.inflight > 0 and asleep(upstream) and upstream.replica_id not in self._waking:
                wake = asyncio.ensure_future(self.ready(upstream))
                wake.add_done_callback(_log_failure)

    async def _wake(self, upstream: Upstream) -> None:
        record = upstream.record
        sleeps, model = record.sleeps, record.models[0] if record.models else record.serve_id
        mode = engines.get(record.engine).sleep_mode
        if mode is None:
            raise WakeFailed(f"replica {record.replica_id}: its engine has no sleep mode")
        if mode.wake_path is None:  # the engine wakes for the request itself
            upstream.woken = sleeps
            self._metrics.wakes.labels(model).inc()
            return
        key = self._api_key()
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        began, failure = time.monotonic(), ""
        for _attempt in range(WAKE_ATTEMPTS):
            try:
                timeout = aiohttp.ClientTimeout(total=WAKE_TIMEOUT_S)
                async with self._session().post(record.url + mode.wake_path, headers=headers, timeout=timeout) as resp:
                    await resp.read()
                    if resp.status == 200:
                        break
                    failure = f"its wake route answered {resp.status}"
            except (TimeoutError, aiohttp.ClientError) as exc:
                failure = f"its wake route did not answer within {WAKE_TIMEOUT_S:g}s ({exc!r})"
        else:
            self._metrics.wake_failures.labels(model).inc()
            raise WakeFailed(f"replica {record.replica_id} of {record.serve_id!r} could not be woken: {failure}")
        upstream.woken = sleeps
        seconds = time.monotonic() - began
        self._metrics.wakes.labels(model).inc()
        self._metrics.wake_seconds.labels(model).observe(seconds)
        log.info("woke replica %s of %r in %.2fs", record.replica_id, record.serve_id, seconds)


def _log_failure(wake: asyncio.Future) -> None:
    if not wake.cancelled() and wake.exception() is not None:
        log.warning("%s", wake.exception())
