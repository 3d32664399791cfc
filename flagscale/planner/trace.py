"""A seeded bursty day of load, per tick: Poisson arrivals whose rate steps and ramps (idle nights, a morning
ramp to several replicas' worth, a plateau with noise, a spike, an afternoon, an evening fall, idle again), and
prompt/output lengths drawn from log-normal distributions whose means move over the day (long prompts and short
answers in the morning, chat-like long answers in the evening), so a disaggregated node's pools need different
counts at different hours. The same seed gives the same trace."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

DAY_S = 86400.0


@dataclass(frozen=True)
class Phase:
    """From `start_h` (hour of the day) the rate moves linearly from `rate` to `to_rate` by the next phase."""

    start_h: float
    rate: float  # requests/s, as a share of the trace's peak
    to_rate: float
    prompt_mean: float  # tokens
    output_mean: float
    label: str = ""


# rates as a share of `peak_rps`; the spike at 14:00 for 10 minutes
DAY = (
    Phase(0.0, 0.0, 0.0, 1000, 250, "idle night"),
    Phase(6.0, 0.02, 0.7, 2000, 150, "morning ramp"),
    Phase(9.0, 0.7, 0.8, 2000, 150, "plateau"),
    Phase(14.0, 1.0, 1.0, 800, 300, "spike"),
    Phase(14.0 + 1 / 6, 0.6, 0.6, 800, 400, "afternoon"),
    Phase(18.0, 0.6, 0.05, 500, 600, "evening fall"),
    Phase(22.0, 0.0, 0.0, 500, 600, "idle"),
)


@dataclass(frozen=True)
class Tick:
    time_s: float
    requests: int
    prompt_tokens: float  # summed over the tick's requests
    output_tokens: float


def phase_at(hour: float, phases: tuple[Phase, ...] = DAY) -> tuple[Phase, float]:
    """The phase holding `hour` and how far through it (0..1)."""
    index = max(i for i, phase in enumerate(phases) if phase.start_h <= hour)
    phase = phases[index]
    end = phases[index + 1].start_h if index + 1 < len(phases) else 24.0
    return phase, (hour - phase.start_h) / max(end - phase.start_h, 1e-9)


def rate_at(time_s: float, peak_rps: float, phases: tuple[Phase, ...] = DAY) -> float:
    phase, through = phase_at((time_s % DAY_S) / 3600.0, phases)
    return peak_rps * (phase.rate + (phase.to_rate - phase.rate) * through)


def poisson(rng: random.Random, mean: float) -> int:
    if mean <= 0:
        return 0
    if mean > 50:  # the normal approximation: exact enough there, and as fast at any mean
        return max(0, round(rng.gauss(mean, math.sqrt(mean))))
    limit, count, product = math.exp(-mean), 0, rng.random()
    while product > limit:
        count += 1
        product *= rng.random()
    return count


def lognormal_sum(rng: random.Random, count: int, mean: float, sigma: float = 0.8) -> float:
    """The sum of `count` log-normal lengths of the given mean (more than 30: their normal approximation)."""
    if count == 0:
        return 0.0
    mu = math.log(mean) - sigma**2 / 2
    if count <= 30:
        return sum(rng.lognormvariate(mu, sigma) for _ in range(count))
    variance = (math.exp(sigma**2) - 1) * mean**2
    return max(0.0, rng.gauss(count * mean, math.sqrt(count * variance)))


def bursty_day(seed: int, peak_rps: float, tick_s: float = 5.0, noise: float = 0.15) -> list[Tick]:
    """One day of ticks. `noise`: the rate's minute-to-minute wobble (a share of it)."""
    rng = random.Random(seed)
    ticks, wobble = [], 1.0
    for step in range(int(DAY_S / tick_s)):
        time_s = step * tick_s
        if step % int(60 / tick_s) == 0:
            wobble = max(0.0, 1.0 + rng.gauss(0.0, noise))
        phase, _ = phase_at(time_s / 3600.0)
        count = poisson(rng, rate_at(time_s, peak_rps) * wobble * tick_s)
        prompt = lognormal_sum(rng, count, phase.prompt_mean)
        ticks.append(Tick(time_s, count, prompt, lognormal_sum(rng, count, phase.output_mean)))
    return ticks


def events(phases: tuple[Phase, ...] = DAY) -> dict[str, float]:
    """The trace's marked moments (seconds): where reaction times are measured from."""
    return {phase.label: phase.start_h * 3600.0 for phase in phases if phase.label in ("morning ramp", "spike")}
