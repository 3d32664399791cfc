"""The planner's inputs and outputs: plain data, the same in the real deployment and in the simulator."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

PREFILL, DECODE = "prefill", "decode"  # a disaggregated node's pools; None: a colocated node (both)
# A sleeping replica's time to serve again, as the planner of a node that sleeps looks ahead while one sleeps:
# vLLM woke a 1B model in 0.13 s on an H200 (docs/benchmarks.md), an 8B one moves 16 GB back from host memory
# (about a second); the router learns a raised target at its next registry read.
WAKE_S = 2.0


@dataclass(frozen=True)
class Slo:
    """The latency a pool must keep at `percentile`: time to first token and inter-token latency, ms."""

    ttft_ms: float | None = None
    itl_ms: float | None = None
    percentile: float = 90.0


@dataclass(frozen=True)
class PlannerSettings:
    """One pool's planner. `role`: PREFILL sizes on TTFT and prompt tokens, DECODE on ITL, KV cache and output
    tokens, None (colocated) on both. `start_s`: how long a new replica takes to serve (the forecast looks this
    far ahead, plus the upscale delay; `wake_s` instead while one of the pool's replicas sleeps). `seed_*_tps`:
    one replica's sustainable tokens/s where known beforehand (auto_tune's results), until the planner has fitted
    its own, and a floor under the fit until a window breaks the SLO below it (capacity.py)."""

    slo: Slo
    min_replicas: int
    max_replicas: int
    role: str | None = None
    upscale_delay_s: float = 30.0
    downscale_delay_s: float = 600.0
    start_s: float = 60.0
    wake_s: float | None = None  # a sleeping replica's time to serve again; None: the pool's replicas never sleep
    seed_prompt_tps: float | None = None
    seed_output_tps: float | None = None
    headroom: float = 0.85  # size so each replica runs at this share of what it sustains within the SLO
    release_below: float = 0.6  # remove a replica only when the rest would run below this share
    kv_high: float = 0.9  # KV cache usage past which a decode pool grows whatever its latency
    # a colocated pool's load is prompt tokens + this x output tokens (what one output token costs a replica, in
    # prompt tokens), where the observation brings no measured figure
    output_token_cost: float = 4.0


def planned_awake(settings: PlannerSettings, sleep_delay_s: float) -> PlannerSettings:
    """The planner of a node whose replicas sleep (resources.sleep_delay_s): sized in replicas awake, none of which
    need be (a sleeping replica holds nothing its minimum is for), one asleep a wake away (WAKE_S). Fewer awake
    once the wish has lasted `sleep_delay_s`, not downscale_delay_s: such a node never removes a replica (what
    that delay guards: a start to undo it), it lets one idle into sleep, a wake to undo."""
    return replace(settings, min_replicas=0, wake_s=WAKE_S, downscale_delay_s=sleep_delay_s)


@dataclass(frozen=True)
class Observation:
    """One pool at one tick, over the last metrics window. Latencies are the SLO's percentile (None: no request
    finished in the window); rates are the pool's totals per second; `kv_usage` the replicas' mean (0..1)."""

    time_s: float
    replicas: int  # replicas serving now
    ttft_ms: float | None = None
    itl_ms: float | None = None
    queue: float = 0.0  # requests waiting inside the engines
    running: float = 0.0
    kv_usage: float = 0.0
    prompt_tps: float = 0.0
    output_tps: float = 0.0
    arrival_rps: float = 0.0
    held: int = 0  # requests the router holds because the pool has no replica
    output_token_cost: float | None = None  # measured: an output token's cost in prompt tokens (colocated load)
    # of `replicas`, those asleep (resources.sleep_delay_s): started, holding no device memory, a wake away. A pool
    # whose replicas sleep is sized in replicas kept awake
    asleep: int = 0

    @property
    def awake(self) -> int:
        return max(0, self.replicas - self.asleep)


@dataclass(frozen=True)
class Decision:
    """What the planner wants now: `target` (within min/max, after delays), `desired` (what the load needs
    before the delays), and why, in words; `forecast` and `measured` as `status` shows them."""

    time_s: float
    current: int
    desired: int
    target: int
    reason: str
    measured: dict[str, float] = field(default_factory=dict)
    forecast: dict[str, float] = field(default_factory=dict)

    @property
    def changed(self) -> bool:
        return self.target != self.current
