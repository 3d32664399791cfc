"""A trace replayed on simulated pools (simulate.py) under one scaling system: the SLO planner, request-count
autoscaling as Serve does it (replicas = in-flight requests / target_ongoing_requests, with the same delays), or
a static count. Reports what the benchmark compares: SLO attainment, goodput, GPU-hours, failed requests, every
change with its reason, and the reaction to the trace's ramp and spike."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from flagscale.planner.planner import Planner
from flagscale.planner.simulate import ReplicaModel, SimPool, met_share, observation, run_pool_tick
from flagscale.planner.trace import Tick
from flagscale.planner.types import DECODE, PREFILL, Decision, Observation, PlannerSettings


class Static:
    def __init__(self, count: int):
        self.count = count

    def decide(self, obs: Observation) -> Decision:
        return Decision(obs.time_s, self.count, self.count, self.count, "static")


class RequestCount:
    """Serve's default policy on the engines' in-flight requests (flagscale/replica/autoscaling.py), with its
    delays: the wish must last upscale_delay_s / downscale_delay_s; 0 -> n at once when requests wait."""

    def __init__(self, settings: PlannerSettings, target_ongoing: float):
        self.settings, self.target_ongoing = settings, target_ongoing
        self.target: int | None = None
        self.pending: tuple[int, float] | None = None

    def decide(self, obs: Observation) -> Decision:
        current = obs.replicas if self.target is None else self.target
        ongoing = obs.running + obs.queue + obs.held
        desired = math.ceil(ongoing / self.target_ongoing - 1e-9)
        desired = min(max(desired, self.settings.min_replicas), self.settings.max_replicas)
        target = current
        if desired != current:
            direction = 1 if desired > current else -1
            if self.pending is None or self.pending[0] != direction:
                self.pending = (direction, obs.time_s)
            delay = self.settings.upscale_delay_s if direction > 0 else self.settings.downscale_delay_s
            if current == 0 or obs.time_s - self.pending[1] >= delay:
                target, self.pending = desired, None
        else:
            self.pending = None
        self.target = target
        return Decision(obs.time_s, current, desired, target, f"{ongoing:.1f} in flight / {self.target_ongoing:g}")


@dataclass
class Result:
    system: str
    requests: int = 0
    met: float = 0.0
    failed: int = 0
    gpu_s: float = 0.0
    duration_s: float = 0.0
    changes: list[tuple[float, str, int, int, str]] = field(default_factory=list)  # time, pool, from, to, why
    timeline: list[tuple[float, float, int]] = field(default_factory=list)  # time, req/s, replicas asked for
    pools: list[dict[str, int]] = field(default_factory=list)  # beside each timeline point: per pool
    reaction_s: dict[str, float | None] = field(default_factory=dict)

    @property
    def attainment(self) -> float:
        return self.met / self.requests if self.requests else 1.0

    def at_hour(self, hour: float) -> dict[str, int]:
        """The replicas each pool asked for at that hour of the trace."""
        index = min(range(len(self.timeline)), key=lambda i: abs(self.timeline[i][0] - hour * 3600.0))
        return self.pools[index]

    def summary(self) -> dict[str, float | int | str | None]:
        hours = self.gpu_s / 3600.0
        goodput = self.met / self.duration_s if self.duration_s else 0.0
        return {
            "system": self.system,
            "requests": self.requests,
            "slo_attainment": round(self.attainment, 4),
            "goodput_rps": round(goodput, 3),
            "gpu_hours": round(hours, 1),
            "goodput_per_gpu_hour": round(self.met / hours, 1) if hours else 0.0,
            "failed": self.failed,
            "changes": len(self.changes),
            **{f"reaction_{name}_s": value for name, value in self.reaction_s.items()},
        }


def replay(system: str, ticks: list[Tick], pools: dict[str | None, tuple[SimPool, object]], slo, dt: float) -> Result:
    """Replay `ticks` on `pools` (role -> (its simulated replicas, its scaler: anything with decide(obs)))."""
    result = Result(system, duration_s=len(ticks) * dt)
    model: ReplicaModel = next(iter(pools.values()))[0].model
    for tick in ticks:
        windows = {}
        for role, (pool, _) in pools.items():
            pool.advance(tick.time_s)
            windows[role] = run_pool_tick(pool, tick, dt)
        result.requests += tick.requests
        result.failed += max(window.failed for window in windows.values())
        if all(pool.serving for pool, _ in pools.values()) and tick.requests:
            result.met += tick.requests * _tick_share(windows, slo, model)
        asked: dict[str, int] = {}
        for role, (pool, scaler) in pools.items():
            decision = scaler.decide(observation(pool, tick, windows[role], dt))
            if decision.target != pool.target():
                result.changes.append((tick.time_s, role or "all", pool.target(), decision.target, decision.reason))
            pool.set_target(tick.time_s, decision.target)
            asked[role or "all"] = pool.target()
            result.gpu_s += pool.replicas_paid() * model.gpus * dt
        if int(tick.time_s) % 60 == 0:
            result.timeline.append((tick.time_s, tick.requests / dt, sum(asked.values())))
            result.pools.append(asked)
    return result


def _tick_share(windows: dict, slo, model: ReplicaModel) -> float:
    """The share of the tick's requests that meet both bounds: TTFT from the prefill side (and a decode pool's
    wait for a slot), ITL from the decode side. (Requests held at zero replicas are never credited.)"""
    first = windows.get(PREFILL) or windows.get(None)
    last = windows.get(DECODE) or windows.get(None)
    ttft = first.ttft_ms + (1000.0 * last.wait_s if last is not first else 0.0)
    ttft_met = met_share(ttft, slo.ttft_ms, slo.percentile, model.spread)
    return ttft_met * met_share(last.itl_ms, slo.itl_ms, slo.percentile, model.spread)


def reactions(result: Result, marks: dict[str, float]) -> None:
    """Seconds from each marked moment to the first change up after it."""
    for name, start in marks.items():
        ups = [time_s for time_s, _, before, after, _ in result.changes if time_s >= start and after > before]
        result.reaction_s[name.replace(" ", "_")] = round(ups[0] - start, 1) if ups else None


def planner_pools(settings: dict[str | None, PlannerSettings], model: ReplicaModel, start: dict[str | None, int]):
    return {role: (SimPool(role, model, start[role]), Planner(s)) for role, s in settings.items()}
