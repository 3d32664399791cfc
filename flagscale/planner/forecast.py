"""The load predictor: a level and a trend, each an exponentially weighted average over minutes (Holt's linear
method with time constants instead of per-step factors, so uneven ticks weigh right). The forecast `h` seconds
ahead is level + trend x h, never below zero. Explained in one line by `describe`."""

from __future__ import annotations

import math
from dataclasses import dataclass

LEVEL_TAU_S = 20.0
# A pool whose replicas sleep adds one in a wake (seconds), not a start: a level that lags costs it a replica held
# awake through a fall, a noisy one only a wake. On the fitted simulator of the one-H200 run (2026-12-02,
# docs/benchmarks.md) 10 s let the spike's replicas go 6 s sooner, three at once: 50 % of static max's
# replica-seconds against 55 %, the same attainment.
WAKE_LEVEL_TAU_S = 10.0


def level_tau_s(wake_s: float | None) -> float:
    """How long the level of a pool's load averages over: shorter where a replica asked for is a wake away."""
    return LEVEL_TAU_S if wake_s is None else WAKE_LEVEL_TAU_S


@dataclass
class Trend:
    level_tau_s: float = LEVEL_TAU_S  # the level follows the signal over about this long
    trend_tau_s: float = 60.0  # the slope over about this long
    level: float | None = None
    slope: float = 0.0  # per second
    last_s: float | None = None

    def update(self, time_s: float, value: float) -> None:
        if self.level is None or self.last_s is None:
            self.level, self.last_s = value, time_s
            return
        dt = max(time_s - self.last_s, 1e-6)
        alpha = 1.0 - math.exp(-dt / self.level_tau_s)
        beta = 1.0 - math.exp(-dt / self.trend_tau_s)
        predicted = self.level + self.slope * dt
        level = predicted + alpha * (value - predicted)
        self.slope += beta * ((level - self.level) / dt - self.slope)
        self.level, self.last_s = level, time_s

    def forecast(self, ahead_s: float) -> float:
        if self.level is None:
            return 0.0
        return max(0.0, self.level + max(self.slope, -self.level / max(ahead_s, 1e-6)) * ahead_s)

    def describe(self, ahead_s: float, unit: str) -> str:
        return f"{self.level or 0:.3g} {unit} {self.slope * 60:+.2g}/min -> {self.forecast(ahead_s):.3g} in {ahead_s:.0f} s"
