"""`experiment.auto_tuner:`: FlagScale's auto-tuner (action=auto_tune): its search space, bounds and SLOs."""

from __future__ import annotations

import difflib
from typing import Any, Literal

from pydantic import (
    Field,
    PositiveInt,
    field_validator,
)

from flagscale.config.fields import Strict

# SLO metrics and percentiles of action=auto_tune: what vLLM's serving benchmark reports (flagscale/actions/bench.py).
SLO_METRICS = ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms")
SLO_STATISTICS = ("mean", "p50", "p90", "p99")


class TunerControl(Strict):
    """How long the search may take, and what is left serving at its end (FlagScale's keys and defaults)."""

    interval: float = Field(10, ge=0, description="Seconds of rest between one trial's end and the next one's start.")
    run_best: bool = Field(True, description="Leave the best candidate serving at the end (else stop everything).")
    max_time_per_task: float = Field(
        3000, gt=0, description="Bound on one trial: deploy, wait healthy, load; past it the trial fails."
    )
    max_time: float | None = Field(None, gt=0, description="Bound on the whole search; no new trial starts past it.")


class TunerPerformance(Strict):
    """How trials rank without an SLO (FlagScale's keys and defaults); with `slo`, goodput per device ranks."""

    metric: str = Field(
        "itl",
        min_length=1,
        description="A history.csv column, or FlagScale's names: itl, ttft, tpot (topt), e2e_latency "
        "(mean ms), request_throughput, token_throughput.",
    )
    order: Literal["ascend", "descend"] = Field("ascend", description="ascend: smallest first.")


class AutoTunerConfig(Strict):
    """action=auto_tune (docs/auto-tune.md): one engine node's candidates, each deployed and loaded for real."""

    space: dict[str, Any] = Field(
        default_factory=dict,
        description="Dimension -> values to try: tensor_model_parallel_size, pipeline_model_parallel_size, "
        "instance (replicas), or any engine arg; or per engine (space.<engine>.<dim>).",
    )
    engines: list[str] | None = Field(None, description="The engines whose space.<engine> block is searched.")
    control: TunerControl = Field(default_factory=TunerControl, description="Bounds and the end: see below.")
    performance: TunerPerformance = Field(
        default_factory=TunerPerformance, description="Ranking without an SLO: see below."
    )
    cards: int | None = Field(
        None, ge=1, description="Devices the search may use: TP x PP x instance above it is skipped."
    )
    slo: dict[str, dict[str, float]] | None = Field(
        None,
        description="Latency limits, e.g. {ttft_ms: {p99: 500}, tpot_ms: {p99: 50}}; metrics "
        f"{', '.join(SLO_METRICS)}; statistics {', '.join(SLO_STATISTICS)}. A trial's goodput: the request "
        "throughput at the highest concurrency that meets every limit.",
    )
    concurrency: list[PositiveInt] | None = Field(
        None,
        min_length=1,
        description="Concurrency levels each trial climbs (default: experiment.bench.concurrency when set, else "
        "1, 2, 4, 8, 16).",
    )
    concurrency_per_device: bool = Field(
        False,
        description="Each level (and num_prompts) times the candidate's devices, so every device of every candidate "
        "sees the same load: for comparing layouts over different device counts (instance x TP).",
    )
    serve_id: str | None = Field(None, description="The engine node to tune (required with several engine nodes).")

    @field_validator("slo")
    @classmethod
    def _known_slo(cls, slo: dict[str, dict[str, float]] | None) -> dict[str, dict[str, float]] | None:
        for metric, limits in (slo or {}).items():
            for name, known in ((metric, SLO_METRICS), *((s, SLO_STATISTICS) for s in limits)):
                if name not in known:
                    close = difflib.get_close_matches(name, known, n=1, cutoff=0.5)
                    hint = f"did you mean '{close[0]}'? " if close else ""
                    raise ValueError(f"unknown SLO key '{name}' ({hint}known: {', '.join(known)})")
            for statistic, limit in limits.items():
                if limit <= 0:
                    raise ValueError(f"slo.{metric}.{statistic} must be positive, got {limit!r}")
        return slo
