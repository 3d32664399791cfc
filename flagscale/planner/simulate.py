"""A simulated cluster for the planner: the same Planner as the real deployment, driven tick by tick by pools of
simulated replicas, so a day on 64 GPUs replays in seconds (benchmarks/slo_planner.py, docs/autoscaling.md).

A replica is a fluid server: a request costs prompt / prefill_tps + output / decode_tps replica-seconds (a
prefill pool pays the first part, a decode pool the second); work beyond what the serving replicas do in a tick
waits as backlog. Its latency at utilization u is (floor + join x min(1, u / 0.05)) / (1 - u) for TTFT (a
batching engine's prompt waits for the running batch's step as soon as requests run together: its TTFT leaves the
floor at the first few, then stays flat far beyond; join 0 is the plain queueing shape) and floor / (1 - 0.8 u) for
ITL (the batch slows each step less than it queues prompts), plus the backlog's wait on TTFT; one request's latency
spreads log-normally around the window's median. A replica asked for serves `start_s` later; one let go costs its GPUs
`drain_s` longer. Requests that find no replica are held until one serves; past `hold_s` they fail (a 503).

A pool whose replicas sleep (`sleeps`: resources.sleep_delay_s with an SLO, docs/autoscaling.md) keeps the replicas
it let go: after their drain they sleep, paying nothing (their GPU is free for other models' replicas, which is
what sleep is for), and a rising target wakes them (`wake_s`) before it starts new ones. Such a pool may begin
with replicas `asleep` (the deployment starts max_replicas and lets the unwanted ones sleep).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from flagscale.planner.trace import Tick
from flagscale.planner.types import DECODE, PREFILL, Observation

ITL_SLOPE = 0.8  # ITL at utilization u: floor / (1 - ITL_SLOPE x u)
JOIN_UTILIZATION = 0.05  # the utilization at which a prompt always finds a batch running (TTFT: + join)


@dataclass(frozen=True)
class ReplicaModel:
    prefill_tps: float = 20000.0  # prompt tokens/s one replica computes, saturated
    decode_tps: float = 3000.0  # output tokens/s one replica streams, saturated
    ttft_floor_ms: float = 80.0  # unloaded, at the SLO's percentile
    itl_floor_ms: float = 15.0
    ttft_join_ms: float = 80.0  # what a prompt waits for the running batch, at the TTFT percentile
    start_s: float = 60.0
    drain_s: float = 30.0
    gpus: int = 1
    spread: float = 0.4  # log-normal sigma of one request's latency around the window's median
    hold_s: float = 90.0  # a request held at zero replicas fails past this
    wake_s: float = 1.0  # a sleeping replica's time to serve again (weights back from host memory)


def met_share(percentile_ms: float, bound_ms: float | None, percentile: float, spread: float) -> float:
    """The share of requests under `bound_ms` when the window's `percentile` is `percentile_ms`."""
    if bound_ms is None:
        return 1.0
    z = _z(percentile / 100.0)
    median = max(percentile_ms, 1e-9) / math.exp(z * spread)
    return 0.5 * (1.0 + math.erf(math.log(bound_ms / median) / (spread * math.sqrt(2.0))))


def _z(p: float) -> float:
    """The standard normal quantile (bisection on erf: called once per tick, exact enough)."""
    low, high = -8.0, 8.0
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if 0.5 * (1 + math.erf(mid / math.sqrt(2))) < p else (low, mid)
    return (low + high) / 2


@dataclass
class SimPool:
    """One pool's simulated replicas and its backlog."""

    role: str | None
    model: ReplicaModel
    serving: int
    starting: list[float] = field(default_factory=list)  # when each starting replica serves
    draining: list[float] = field(default_factory=list)  # when each replica let go frees its GPUs
    backlog: float = 0.0  # replica-seconds of work waiting
    held: list[tuple[float, int]] = field(default_factory=list)  # (since, requests) with no replica to take them
    sleeps: bool = False  # replicas let go sleep, kept (see the module's doc)
    asleep: int = 0
    waking: list[float] = field(default_factory=list)  # when each replica being woken serves

    def target(self) -> int:
        return self.serving + len(self.starting) + len(self.waking)

    def set_target(self, now: float, target: int) -> None:
        while self.target() < target:
            if self.draining and self.sleeps:  # about to sleep: serves on
                self.draining.pop()
                self.serving += 1
            elif self.asleep:
                self.asleep -= 1
                self.waking.append(now + self.model.wake_s)
            else:
                self.starting.append(now + self.model.start_s)
        while self.target() > target and (self.starting or self.waking):
            if self.starting:
                self.starting.pop()
            else:
                self.waking.pop()
                self.asleep += 1
        while self.target() > target:
            self.serving -= 1
            self.draining.append(now + self.model.drain_s)

    def advance(self, now: float) -> None:
        self.serving += sum(1 for ready in self.starting + self.waking if ready <= now)
        self.starting = [ready for ready in self.starting if ready > now]
        self.waking = [ready for ready in self.waking if ready > now]
        if self.sleeps:
            self.asleep += sum(1 for end in self.draining if end <= now)
        self.draining = [end for end in self.draining if end > now]

    def replicas_paid(self) -> int:
        return self.serving + len(self.starting) + len(self.waking) + len(self.draining)

    def work(self, prompt: float, output: float) -> float:
        prefill = 0.0 if self.role == DECODE else prompt / self.model.prefill_tps
        return prefill + (0.0 if self.role == PREFILL else output / self.model.decode_tps)


@dataclass
class PoolWindow:
    """What one pool showed over one tick."""

    utilization: float
    wait_s: float  # the backlog's wait for a request arriving now
    ttft_ms: float
    itl_ms: float
    failed: int
    held_wait_s: float  # the longest wait of the held requests served this tick (0: none)
    queue: float


def run_pool_tick(pool: SimPool, tick: Tick, dt: float) -> PoolWindow:
    """Serve one tick's arrivals (and what was held or queued) on the pool's serving replicas."""
    model, now = pool.model, tick.time_s
    failed = sum(count for since, count in pool.held if now - since > model.hold_s)
    pool.held = [(since, count) for since, count in pool.held if now - since <= model.hold_s]
    work = pool.work(tick.prompt_tokens, tick.output_tokens)
    per_request = work / tick.requests if tick.requests else 0.0
    held_wait = 0.0
    if pool.serving == 0:
        if tick.requests:
            pool.held.append((now, tick.requests))
        return PoolWindow(0.0, 0.0, 0.0, 0.0, failed, 0.0, 0.0)
    if pool.held:
        held_wait = now - min(since for since, _ in pool.held)
        pool.backlog += per_request * sum(count for _, count in pool.held)
        pool.held = []
    capacity = pool.serving * dt
    pool.backlog += work
    served = min(pool.backlog, capacity)
    pool.backlog -= served
    utilization = min(served / capacity, 0.95)
    wait_s = pool.backlog / pool.serving
    itl = model.itl_floor_ms / (1.0 - ITL_SLOPE * utilization)
    first = itl if pool.role == DECODE else ttft_ms(model, utilization)  # decode: its first step
    ttft = first + 1000.0 * wait_s
    queue = pool.backlog / per_request if per_request else 0.0
    return PoolWindow(served / capacity, wait_s, ttft, itl, failed, held_wait, queue)


def ttft_ms(model: ReplicaModel, utilization: float) -> float:
    """A replica's time to first token at `utilization`, before any backlog (the window's percentile)."""
    joined = model.ttft_join_ms * min(1.0, utilization / JOIN_UTILIZATION)
    return (model.ttft_floor_ms + joined) / (1.0 - utilization)


def observation(pool: SimPool, tick: Tick, window: PoolWindow, dt: float) -> Observation:
    """What the pool's engines and router would report for the tick."""
    model, rate = pool.model, tick.requests / dt
    work = pool.work(tick.prompt_tokens, tick.output_tokens)
    prefill_share = (0.0 if pool.role == DECODE else tick.prompt_tokens / model.prefill_tps) / work if work else 0
    done = window.utilization * pool.serving  # replica-seconds of work per second
    e2e_s = window.ttft_ms / 1000 + (tick.output_tokens / max(tick.requests, 1)) * window.itl_ms / 1000
    asleep = pool.asleep + len(pool.waking)  # started, not serving: Serve counts them, the planner sees them asleep
    return Observation(
        time_s=tick.time_s,
        replicas=pool.serving + asleep,
        asleep=asleep,
        ttft_ms=window.ttft_ms if pool.serving and tick.requests else None,
        itl_ms=window.itl_ms if pool.serving and tick.requests else None,
        queue=window.queue,
        running=rate * e2e_s,
        kv_usage=(
            min(1.0, 0.85 * window.utilization + (0.1 if window.queue else 0.0)) if pool.role != PREFILL else 0.0
        ),
        prompt_tps=done * prefill_share * model.prefill_tps,
        output_tps=done * (1 - prefill_share) * model.decode_tps if pool.role != PREFILL else 0.0,
        arrival_rps=rate,
        held=sum(count for _, count in pool.held),
        output_token_cost=model.prefill_tps / model.decode_tps,
    )
