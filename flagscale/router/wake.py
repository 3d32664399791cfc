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

A node whose SLO planner sizes the replicas kept awake (`slo` with `sleep_delay_s`, flagscale/replica/slo_policy.py)
has its requests sent to the planner's target count of replicas, awake ones first (AwakeTargets, kept_awake): the
others get a request only when those have no free slot, so they idle into sleep; when the target rises, the
sleeping replicas it now takes in are woken at once (wake_wanted) rather than by their first request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection, Iterable

import aiohttp

from flagscale import engines
from flagscale.replica.slo_policy import planner_records
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


def kept_awake(upstreams: list[Upstream], wanted: int | None) -> list[Upstream]:
    """The replicas a node's requests go to first when its planner wants `wanted` awake (None: all of them): awake
    ones first, then by id, so the set holds still while the others idle into sleep; at least one."""
    if wanted is None or wanted >= len(upstreams):
        return upstreams
    return sorted(upstreams, key=lambda u: (asleep(u), u.replica_id))[: max(1, wanted)]


def prefer_awake(
    pick: Callable[[list[Upstream]], object], upstreams: list[Upstream], wanted: int | None = None
) -> object:
    """`pick` (the policy's choice among replicas) over the awake replicas of kept_awake(upstreams, wanted) first,
    then over those, the awake replicas, and all: the first that leaves a replica to try with a free slot."""
    kept = kept_awake(upstreams, wanted)
    pools: list[list[Upstream]] = []
    for tier in (kept, upstreams) if kept is not upstreams else (upstreams,):
        awake = [u for u in tier if not asleep(u)]
        if awake and len(awake) < len(tier):
            pools.append(awake)
        pools.append(tier)
    for pool in pools[:-1]:  # the last is `upstreams`
        choice = pick(pool)
        if isinstance(choice, Upstream):
            return choice
    return pick(upstreams)


class AwakeTargets:
    """How many replicas each node planned in awake replicas (`serve_ids()`) wants awake: its planner's target,
    read from the planners' records at each registry read of the router (refresh)."""

    def __init__(self, app: Callable[[], str], serve_ids: Callable[[], Collection[str]]) -> None:
        self._app, self._serve_ids = app, serve_ids
        self.wanted: dict[str, int] = {}  # serve_id -> replicas its planner wants awake

    async def refresh(self) -> None:
        planned = self._serve_ids()
        if not planned:
            self.wanted = {}
            return
        try:
            records = await asyncio.get_running_loop().run_in_executor(None, planner_records, self._app())
        except Exception as exc:  # no answer from the GCS: the last targets stand until the next read
            log.debug("no SLO planner records: %r", exc)
            return
        self.wanted = {serve_id: int(r["target"]) for serve_id, r in records.items() if serve_id in planned}

    def of(self, upstreams: list[Upstream]) -> int | None:
        """The target of the node these replicas (one model's) belong to; None: not planned in awake replicas."""
        return self.wanted.get(upstreams[0].record.serve_id) if upstreams else None


class Waker:
    """Wakes sleeping replicas: `session` gives the router's HTTP session, `api_key` the key the engines require
    (RouterSpec.engine_key); `targets`, the replicas planned nodes want awake (none: no node is)."""

    def __init__(
        self,
        session: Callable[[], aiohttp.ClientSession | None],
        api_key: Callable[[], str | None],
        metrics: RouterMetrics,
        targets: AwakeTargets | None = None,
    ) -> None:
        self._session, self._api_key, self._metrics = session, api_key, metrics
        self.targets = targets or AwakeTargets(lambda: "", lambda: ())
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

    def wake_wanted(self, upstreams: Iterable[Upstream]) -> None:
        """Wake the sleeping replicas each planned node's target takes in (those with a wake route; one that wakes
        by itself does so for its first request)."""
        by_node: dict[str, list[Upstream]] = {}
        for upstream in upstreams:
            by_node.setdefault(upstream.record.serve_id, []).append(upstream)
        for serve_id, target in self.targets.wanted.items():
            for upstream in kept_awake(by_node.get(serve_id, []), target)[:target]:
                mode = engines.get(upstream.record.engine).sleep_mode
                if asleep(upstream) and mode and mode.wake_path and upstream.replica_id not in self._waking:
                    wake = asyncio.ensure_future(self.ready(upstream))
                    wake.add_done_callback(_log_failure)

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
