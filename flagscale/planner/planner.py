"""One pool's SLO planner: each tick, an observation in, a decision out (target count and why).

How it decides (docs/autoscaling.md):
1. demand: per dimension the pool is sized on (prefill: prompt tokens against TTFT; decode: output tokens against
   ITL; colocated: both bounds against its work, prompt tokens + output tokens weighted by what one costs), the
   tokens/s it carries now plus its engines' queue, and the forecast (forecast.py)
   `start_s + upscale_delay_s` ahead (`wake_s` for start_s while one of the pool's replicas sleeps), whichever
   is more: a replica asked for now serves only then;
2. size: demand / (what one replica sustains within the SLO, capacity.py, x headroom), the largest over the
   dimensions; no capacity known yet: one more replica while the SLO is broken with requests queued;
3. guards: the SLO broken now with requests queued, or the KV cache nearly full (decode), add one when every
   replica asked for is serving; requests held at zero replicas ask for one at once; a pool with no request
   in flight and none forecast (one whose replicas sleep: none in the window) wants zero, any other at least
   one; a pool whose replicas sleep is sized in replicas awake (those asleep are started, a wake away);
4. hysteresis: grow past `headroom`, shrink only when the rest would run below `release_below`, and only after
   the wish has lasted `upscale_delay_s` / `downscale_delay_s` (0 -> n at once); never outside min/max; never
   below the count asked for while a replica of it is still starting (it is judged once it serves).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from flagscale.planner.capacity import CapacityCurve
from flagscale.planner.forecast import Trend, level_tau_s
from flagscale.planner.types import DECODE, PREFILL, Decision, Observation, PlannerSettings

IDLE_RPS = 1e-3  # below this forecast arrival rate, with nothing in flight, a pool is idle
BACKLOG_DRAIN_S = 30.0  # a queue counts as demand that must clear in this long


@dataclass
class Dimension:
    """One thing a pool is sized on: a latency bound against a token rate."""

    name: str  # "ttft" / "itl"
    tokens: str  # "prompt_tps" / "output_tps" / "work_tps" (colocated: prompt + weighted output)
    curve: CapacityCurve
    trend: Trend


def dimensions_of(settings: PlannerSettings) -> list[Dimension]:
    slo, role = settings.slo, settings.role
    tau = level_tau_s(settings.wake_s)
    if role is None:
        seed = work_seed(settings)
        bounds = [("ttft", slo.ttft_ms), ("itl", slo.itl_ms)]
        return [Dimension(name, "work_tps", CapacityCurve(ms, seed), Trend(tau)) for name, ms in bounds if ms]
    found = []
    if slo.ttft_ms is not None and role == PREFILL:
        curve = CapacityCurve(slo.ttft_ms, settings.seed_prompt_tps)
        found.append(Dimension("ttft", "prompt_tps", curve, Trend(tau)))
    if slo.itl_ms is not None and role == DECODE:
        found.append(Dimension("itl", "output_tps", CapacityCurve(slo.itl_ms, settings.seed_output_tps), Trend(tau)))
    return found


def work_seed(settings: PlannerSettings) -> float | None:
    """A colocated replica's seed in the unit of its load (Planner.load): prompt tokens/s + output tokens/s x what
    an output token costs."""
    prompt, output = settings.seed_prompt_tps, settings.seed_output_tps
    if prompt is None:
        return None
    return prompt + settings.output_token_cost * (output or 0.0)


class Planner:
    def __init__(self, settings: PlannerSettings):
        self.settings = settings
        self.dimensions = dimensions_of(settings)
        self.arrivals = Trend(level_tau_s(settings.wake_s))
        self.target: int | None = None
        self.pending: tuple[int, float] | None = None  # (direction, since): a wish the delays hold back
        self.last_reason = "starting"
        self.horizon_s = self.settings.start_s + self.settings.upscale_delay_s

    def lead_s(self, obs: Observation) -> float:
        """How long a replica asked for now takes to serve, after the upscale delay: a wake where one of the pool's
        replicas sleeps (settings.wake_s), else a start."""
        wake = self.settings.wake_s
        ready = wake if wake is not None and obs.asleep > 0 else self.settings.start_s
        return ready + self.settings.upscale_delay_s

    def decide(self, obs: Observation, target_now: int | None = None) -> Decision:
        """The decision at `obs.time_s`. `target_now`: the count last asked for, where something else (Serve)
        keeps it; else the planner's own."""
        settings = self.settings
        current = target_now if target_now is not None else self.target
        current = obs.awake if current is None else current
        self.horizon_s = self.lead_s(obs)
        self._learn(obs)
        desired, why = self._desired(obs, current)
        if desired < current and obs.replicas < current:  # a replica asked for has not served yet: judge it then
            desired, why = current, f"{why}; not below {current} while {current - obs.replicas} still start(s)"
        desired = min(max(desired, settings.min_replicas), settings.max_replicas)
        target, why = self._delayed(obs.time_s, current, desired, why)
        self.target = target
        if target != current:
            self.last_reason = why
        return Decision(obs.time_s, current, desired, target, why, self._measured(obs), self._forecast())

    def load(self, dim: Dimension, obs: Observation) -> float:
        if dim.tokens != "work_tps":
            return getattr(obs, dim.tokens)
        cost = obs.output_token_cost if obs.output_token_cost is not None else self.settings.output_token_cost
        return obs.prompt_tps + cost * obs.output_tps

    def _learn(self, obs: Observation) -> None:
        self.arrivals.update(obs.time_s, obs.arrival_rps)
        for dim in self.dimensions:
            demand = self.load(dim, obs)
            dim.trend.update(obs.time_s, demand)
            if obs.awake > 0:
                dim.curve.update(demand / obs.awake, getattr(obs, f"{dim.name}_ms"))

    def _desired(self, obs: Observation, current: int) -> tuple[int, str]:
        if obs.awake == 0 and current == 0:
            if obs.asleep and (obs.running or obs.queue or obs.arrival_rps > 0):
                return 1, "requests for a pool whose replicas all sleep: keep one awake"
            if obs.held or obs.arrival_rps > 0:
                return 1, f"{obs.held} request(s) held with no replica: start one"
            return 0, "idle at zero" if not obs.asleep else f"idle, {obs.asleep} asleep"
        if self._idle(obs):
            return 0, "idle: nothing in flight and no arrival forecast"
        sized = [self._sized(dim, obs, current) for dim in self.dimensions]
        known = [pair for pair in sized if pair[0] is not None]
        fallback = (current, "; ".join(why for _, why in sized) or "no SLO dimension for this pool")
        count, why = max(known, default=fallback, key=lambda pair: pair[0])
        broken = self._broken(obs)
        if broken and obs.replicas >= current and count <= current:
            return current + 1, broken
        if count == 0:  # not idle (above): a request in flight or arriving needs a replica
            return 1, f"{why}; requests in flight or arriving: at least one"
        return count, why

    def _idle(self, obs: Observation) -> bool:
        busy = obs.queue + obs.running + obs.held + obs.arrival_rps
        if busy > 0:
            return False
        # a pool whose replicas sleep is back in a wake: a quiet window is enough (the forecast's level, an
        # average over 20 s, would take minutes to fall to nothing after the last request)
        return self.settings.wake_s is not None or self.arrivals.forecast(self.horizon_s) < IDLE_RPS

    def _sized(self, dim: Dimension, obs: Observation, current: int) -> tuple[int | None, str]:
        """The count this dimension asks for, with hysteresis: grow past headroom, shrink below release_below;
        None while it cannot tell (no capacity known)."""
        per_replica = dim.curve.sustainable()
        if dim.curve.unreachable():
            floor = dim.curve.floor_ms or 0
            return None, f"{dim.name} {floor:.0f} ms at the lightest load seen > SLO {dim.curve.bound_ms:.0f} ms"
        if not per_replica:
            return None, f"{dim.name}: capacity not fitted yet"
        now = self.load(dim, obs)
        per_request = now / obs.arrival_rps if obs.arrival_rps > 0 else 0.0
        demand = max(now + obs.queue * per_request / BACKLOG_DRAIN_S, dim.trend.forecast(self.horizon_s))
        grow = math.ceil(demand / (per_replica * self.settings.headroom) - 1e-9)
        shrink = math.ceil(demand / (per_replica * self.settings.release_below) - 1e-9)
        count = grow if grow > current else min(shrink, current)
        rate = f"{dim.tokens.split('_')[0]} {demand:.0f} tok/s"
        return count, f"{rate} / {per_replica:.0f} per replica within {dim.name} SLO -> {count}"

    def _broken(self, obs: Observation) -> str:
        """Why the pool needs one more now, whatever the sizing says ('' when it does not)."""
        slo, role = self.settings.slo, self.settings.role
        if obs.queue > 0:
            pct = f"p{slo.percentile:g}"
            if slo.ttft_ms and obs.ttft_ms and obs.ttft_ms > slo.ttft_ms:  # decode: requests wait for a slot
                return f"TTFT {pct} {obs.ttft_ms:.0f} ms > {slo.ttft_ms:.0f} ms, {obs.queue:.0f} queued: +1"
            if slo.itl_ms and role != PREFILL and obs.itl_ms and obs.itl_ms > slo.itl_ms:
                return f"ITL {pct} {obs.itl_ms:.0f} ms > {slo.itl_ms:.0f} ms, {obs.queue:.0f} queued: +1"
        if role != PREFILL and obs.kv_usage >= self.settings.kv_high:
            return f"KV cache {obs.kv_usage:.0%} used: +1"
        return ""

    def _delayed(self, now: float, current: int, desired: int, why: str) -> tuple[int, str]:
        if desired == current:
            self.pending = None
            return current, why
        direction = 1 if desired > current else -1
        if self.pending is None or self.pending[0] != direction:
            self.pending = (direction, now)
        delay = self.settings.upscale_delay_s if direction > 0 else self.settings.downscale_delay_s
        outside = not self.settings.min_replicas <= current <= self.settings.max_replicas
        if current == 0 or outside or now - self.pending[1] >= delay - 1e-6:
            self.pending = None
            return desired, why
        return current, f"{why} (in {delay - (now - self.pending[1]):.0f} s if it lasts)"

    def _measured(self, obs: Observation) -> dict[str, float]:
        seen = {"ttft_ms": obs.ttft_ms, "itl_ms": obs.itl_ms, "queue": obs.queue, "kv_usage": obs.kv_usage}
        seen |= {"prompt_tps": obs.prompt_tps, "output_tps": obs.output_tps, "arrival_rps": obs.arrival_rps}
        return {key: round(value, 3) for key, value in seen.items() if value is not None}

    def _forecast(self) -> dict[str, float]:
        ahead = self.horizon_s
        found = {"horizon_s": ahead, "arrival_rps": round(self.arrivals.forecast(ahead), 3)}
        for dim in self.dimensions:
            found[dim.tokens] = round(dim.trend.forecast(ahead), 1)
            per_replica = dim.curve.sustainable()
            if per_replica:
                found[f"{dim.tokens}_per_replica"] = round(per_replica, 1)
        return found
