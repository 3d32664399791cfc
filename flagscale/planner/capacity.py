"""What one replica sustains within a latency bound, fitted online from the latency it shows at the load it
carries.

The model is the queueing shape: a replica's latency L at load x (tokens/s per replica) is floor / (1 - x / cap):
flat at light load (floor: its unloaded latency), steep as x nears cap (its saturation throughput). One sample
(x, L) with L clearly above the floor gives cap = x / (1 - floor / L); the load it sustains within the bound B is
then cap x (1 - floor / B). Only samples that are clearly loaded (L past 1.5 x floor) fit: near the floor a little
noise in L moves the estimate a lot. Each sample moves the estimate part of the way (an exponential average), so
one noisy window does not swing it. Until a sample has fitted it, the seed (auto_tune's measured figure, where
there is one) stands in.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CapacityCurve:
    bound_ms: float  # the SLO's latency at its percentile
    seed: float | None = None  # tokens/s one replica sustains within the bound, known beforehand
    floor_ms: float | None = None  # the lowest latency seen: the unloaded latency, forgotten slowly upwards
    fitted: float | None = None  # tokens/s one replica sustains within the bound, fitted
    weight: float = 0.1  # how far one sample moves the fit
    samples: int = 0

    def update(self, load: float, latency_ms: float | None) -> None:
        """One window: `load` tokens/s per replica, `latency_ms` the SLO's percentile over it (None: none
        finished)."""
        if latency_ms is None or load <= 0:
            return
        if self.floor_ms is None or latency_ms < self.floor_ms:
            self.floor_ms = latency_ms
        elif latency_ms < 1.5 * self.floor_ms:
            self.floor_ms += 0.02 * (latency_ms - self.floor_ms)
        if latency_ms < 1.5 * self.floor_ms:
            return
        saturation = load / (1.0 - self.floor_ms / latency_ms)
        estimate = max(0.0, saturation * (1.0 - self.floor_ms / self.bound_ms))
        self.fitted = estimate if self.fitted is None else self.fitted + self.weight * (estimate - self.fitted)
        self.samples += 1

    def sustainable(self) -> float | None:
        """Tokens/s one replica carries within the bound: the fit, else the seed; None while neither is known."""
        return self.fitted if self.fitted is not None else self.seed

    def unreachable(self) -> bool:
        """The replica's unloaded latency is already past the bound: no count of replicas meets it."""
        return self.floor_ms is not None and self.floor_ms > self.bound_ms
