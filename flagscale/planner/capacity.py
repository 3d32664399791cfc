"""What one replica sustains within a latency bound, learnt online from the latency it shows at the load it
carries.

Two figures, the larger stands once the fit (or the seed) says anything:
- proven: the most tokens/s per replica seen carried with the window's latency within the bound (auto_tune's
  measured figure, the seed, until then). Windows over the bound at a load below it lower it: the work changed.
  Alone it says nothing (a light load within the bound is no estimate), so it only keeps the fit from sinking
  below what was seen.
- fitted: the queueing shape, for loads not seen yet. A replica's latency L at load x (tokens/s per replica) is
  floor / (1 - x / cap): flat at light load (floor: its unloaded latency), steep as x nears cap. One sample (x, L)
  with L clearly above the floor gives cap = x / (1 - floor / L); the load it sustains within the bound B is then
  cap x (1 - floor / B). Only samples clearly loaded (L past 1.5 x floor) fit; each moves the estimate part of the
  way (an exponential average, from the seed where there is one), so one noisy window does not swing it.
Each window over the bound moves `proven` only part of the way down, as a sample moves the fit. On one H200
(2026-12-02, docs/benchmarks.md) one window of a spike the replicas could not carry replaced a seed of 25,715
tokens/s with 2,590 in both figures at once, and the pool kept three replicas awake through a fall that needed one.
The fit alone undercounts a batching engine: its time to first token leaves the floor at the first concurrent
requests (a prompt waits for the running batch's step), then stays flat far beyond, so the shape reads a light
load as near saturation: each window's estimate tracks the load it was made from. On two H200s (2026-12-01,
docs/benchmarks.md) a 1B model's pool stayed at 4 replicas through a fall to half of one replica's load, this
the first of the causes read from the code.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CapacityCurve:
    bound_ms: float  # the SLO's latency at its percentile
    seed: float | None = None  # tokens/s one replica sustains within the bound, known beforehand
    floor_ms: float | None = None  # the lowest latency seen: the unloaded latency, forgotten slowly upwards
    fitted: float | None = None  # tokens/s one replica sustains within the bound, by the queueing shape
    proven: float | None = None  # the most tokens/s per replica seen within the bound (the seed until then)
    weight: float = 0.1  # how far one sample moves the fit
    samples: int = 0

    def __post_init__(self) -> None:
        if self.proven is None:
            self.proven = self.seed

    def update(self, load: float, latency_ms: float | None) -> None:
        """One window: `load` tokens/s per replica, `latency_ms` the SLO's percentile over it (None: none
        finished)."""
        if latency_ms is None or load <= 0:
            return
        if self.floor_ms is None or latency_ms < self.floor_ms:
            self.floor_ms = latency_ms
        elif latency_ms < 1.5 * self.floor_ms:
            self.floor_ms += 0.02 * (latency_ms - self.floor_ms)
        if latency_ms <= self.bound_ms:
            self.proven = max(self.proven or 0.0, load)
        if latency_ms < 1.5 * self.floor_ms:
            return
        saturation = load / (1.0 - self.floor_ms / latency_ms)
        estimate = max(0.0, saturation * (1.0 - self.floor_ms / self.bound_ms))
        if latency_ms > self.bound_ms and self.proven is not None and load <= self.proven:
            # over the bound below what it carried before: the work got heavier, or the window was an outlier
            self.proven += self.weight * (estimate - self.proven)
        start = self.fitted if self.fitted is not None else self.seed
        self.fitted = estimate if start is None else start + self.weight * (estimate - start)
        self.samples += 1

    def sustainable(self) -> float | None:
        """Tokens/s one replica carries within the bound: the fit (else the seed), or what it was seen to carry
        within the bound where that is more; None while neither the fit nor the seed is known."""
        estimate = self.fitted if self.fitted is not None else self.seed
        return None if estimate is None else max(estimate, self.proven or 0.0)

    def unreachable(self) -> bool:
        """The replica's unloaded latency is already past the bound: no count of replicas meets it."""
        return self.floor_ms is not None and self.floor_ms > self.bound_ms
