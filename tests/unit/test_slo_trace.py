"""benchmarks/slo_trace.py: the pure parts of the SLO planner's real-load benchmark (issue 51): the step trace at a
time scale, its split over benchmark workers, the calibration's sustainable point, the least replica-seconds a
trace allows, and the targets as ratios."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import slo_trace  # noqa: E402


def test_steps_at_a_time_scale_are_the_same_steps_each_shorter():
    full, short = slo_trace.steps(2.0), slo_trace.steps(2.0, time_scale=0.4)
    assert [s["rps"] for s in full] == [s["rps"] for s in short]
    assert sum(s["seconds"] for s in full) == pytest.approx(290)
    assert sum(s["seconds"] for s in short) == pytest.approx(116)
    assert all(b["start_s"] == pytest.approx(a["start_s"] * 0.4) for a, b in zip(full, short, strict=True))
    spike = next(s for s in short if s["segment"] == "spike")
    assert spike["rps"] == pytest.approx(6.0) and spike["seconds"] == pytest.approx(8.0)


def test_a_step_is_split_into_streams_no_faster_than_a_worker_sends():
    step = {"rps": 150.0, "seconds": 6.0}
    split = slo_trace.parts(step, 20.0)
    assert len(split) == 8 and all(p["rps"] == pytest.approx(18.75) for p in split)
    assert sum(p["prompts"] for p in split) == pytest.approx(900, abs=8)
    assert [p["part"] for p in split] == list(range(8))
    assert len(slo_trace.parts(step, None)) == 1
    assert len(slo_trace.parts({"rps": 40.0, "seconds": 1.0}, 20.0)) == 2  # exactly two workers' worth
    assert slo_trace.parts({"rps": 0.0, "seconds": 10.0}, 20.0) == []
    assert slo_trace.parts({"rps": 0.01, "seconds": 1.0}, None)[0]["prompts"] == 1


def test_the_workers_a_trace_needs_count_a_step_and_the_one_finishing_before_it():
    # 2026-12-01, one H200: --rate 361 made the spike 44 parts after a plateau's 24, on 32 workers
    assert slo_trace.workers_needed(slo_trace.steps(361.0), 25.0) == 44 + 24
    assert slo_trace.workers_needed(slo_trace.steps(75.175), 25.0) == 10 + 5  # the two-GPU runs: room to spare
    assert slo_trace.workers_needed(slo_trace.steps(2.0), None) == 2
    assert slo_trace.workers_needed([], 25.0) == 0


def test_streams_split_evenly_within_a_workers_bound():
    assert slo_trace.split_streams(200, 64) == [50, 50, 50, 50]
    assert slo_trace.split_streams(130, 64) == [44, 43, 43]
    assert slo_trace.split_streams(8, 64) == [8]


def request(ttft_s: float, itl_s: float, n: int = 4, error: str = "") -> dict:
    return {"ttft_s": ttft_s, "itl_s": [itl_s] * n, "error": error}


def test_a_request_meets_the_slo_on_ttft_and_mean_itl_without_error():
    assert slo_trace.met(request(0.4, 0.04), 500, 50)
    assert not slo_trace.met(request(0.6, 0.04), 500, 50)
    assert not slo_trace.met(request(0.4, 0.06), 500, 50)
    assert not slo_trace.met(request(0.1, 0.01, error="boom"), 500, 50)
    assert slo_trace.met({"ttft_s": 0.1, "itl_s": [], "error": ""}, 500, 50)


def test_attainment_is_told_per_segment_of_the_trace():
    rows = [request(0.1, 0.01) | {"segment": "ramp"}, request(0.9, 0.01) | {"segment": "spike"}]
    rows += [request(0.1, 0.01) | {"segment": "spike"}, request(0.1, 0.01, error="503") | {"segment": "fall"}]
    assert slo_trace.attainment_by_segment(rows, 500, 50) == {"ramp": 1.0, "spike": 0.5, "fall": 0.0}


def test_a_ladder_pass_gives_rate_by_littles_law():
    rows = [request(0.2, 0.02, n=9)] * 10  # 0.2 + 9 x 0.02 = 0.38 s a request, 10 tokens
    p = slo_trace.ladder_pass(38, rows, 500, 50)
    assert p["rate"] == pytest.approx(100.0) and p["output_tps"] == pytest.approx(1000.0)
    assert p["attainment"] == 1.0
    assert slo_trace.ladder_pass(8, [], 500, 50)["rate"] == 0.0


def test_the_sustainable_point_is_the_last_pass_before_the_first_miss():
    ladder = [{"concurrency": c, "attainment": a} for c, a in ((32, 1.0), (64, 0.95), (128, 0.5), (256, 0.97))]
    assert slo_trace.sustainable(ladder, 0.9)["concurrency"] == 64  # a later pass that meets it again does not count
    assert slo_trace.sustainable([{"concurrency": 8, "attainment": 0.2}], 0.9) is None


def test_least_replica_seconds_count_one_replica_per_rate_within_bounds():
    plan = [{"rps": 0.0, "seconds": 10}, {"rps": 1.0, "seconds": 10}, {"rps": 1.5, "seconds": 10},
            {"rps": 6.0, "seconds": 10}]  # fmt: skip
    assert slo_trace.least_replica_s(plan, 1.0, 1, 2) == 10 + 10 + 20 + 20
    assert slo_trace.least_replica_s(plan, 1.0, 0, 3) == 0 + 10 + 20 + 30
    # the trace itself at 1..2: its time above one replica's rate is what static max's share cannot go under
    full = slo_trace.steps(1.0)
    share = slo_trace.least_replica_s(full, 1.0, 1, 2) / (2 * 290)
    assert 0.7 < share < 0.8


def row(system: str, attainment: float, replica_s: float, good: float, failed: int = 0) -> dict:
    return {"system": system, "attainment": attainment, "replica_s": replica_s,
            "goodput_per_replica_s": good / replica_s, "failed": failed}  # fmt: skip


def test_target_lines_state_each_ratio_and_whether_it_is_met():
    rows = [row("slo", 0.95, 150, 150), row("request_count", 0.90, 200, 140), row("static_max", 0.97, 260, 170)]
    lines = slo_trace.target_lines(rows)
    assert lines[0].startswith("- slo vs request_count: goodput per replica-s 1.43x") and lines[0].endswith("met")
    assert "attainment -2.0 points" in lines[1] and "replica-s 58 %" in lines[1] and lines[1].endswith(": met")
    assert lines[2] == "- failed requests: {'slo': 0, 'request_count': 0, 'static_max': 0} (target 0)"
    worse = slo_trace.target_lines([row("slo", 0.85, 150, 150), row("request_count", 0.90, 200, 100)])
    assert worse[0].endswith("not met")  # 2x the goodput per replica-s, but a lower attainment
    assert len(slo_trace.target_lines([row("static_min", 0.9, 100, 90)])) == 1
    both = slo_trace.target_lines([*rows, row("slo_sleep", 0.96, 100, 160)])  # each planner system judged
    assert both[2].startswith("- slo_sleep vs request_count: goodput per replica-s 2.29x") and len(both) == 5
    assert "replica-s 38 % of static max's" in both[3]


def test_a_pass_over_balanced_replicas_counts_as_one_replicas_share():
    p = slo_trace.per_replica({"concurrency": 512, "rate": 120.0, "output_tps": 15000.0, "attainment": 0.95}, 2)
    assert (p["concurrency"], p["rate"], p["output_tps"], p["replicas"]) == (256, 60.0, 7500.0, 2)
    assert p["attainment"] == 0.95


def test_the_calibration_runs_first_on_static_min_else_static_max_else_its_own_deployment():
    every = ["slo", "request_count", "static_max", "static_min"]
    assert slo_trace.calibration_order(every, True) == ["static_min", "slo", "request_count", "static_max"]
    assert slo_trace.calibration_order(every[:3], True) == ["static_max", "slo", "request_count"]
    assert slo_trace.calibration_order(["slo"], True) == ["calibrate", "slo"]
    assert slo_trace.calibration_order(every[:3], False) == every[:3]


def test_the_step_trace_simulated_plans_the_sleeping_pool_below_static_max_within_five_points():
    import slo_steps_sim  # noqa: PLC0415  (benchmarks/slo_steps_sim.py: the planner on this trace, simulated)

    results = {r.system: r for r in slo_steps_sim.simulate(slo_steps_sim.arguments([]))}
    planned, static = results["slo_sleep"], results["static_max"]
    assert planned.gpu_s <= 0.6 * static.gpu_s
    assert planned.attainment >= static.attainment - 0.05
    assert [change[3] for change in planned.changes][-1] == 0  # idle at the end: none awake
