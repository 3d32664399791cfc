"""benchmarks/slo_load.py's options: replicas that share a GPU (--gpus-per-replica) reserve their share and fit in
it together; what it reads of a deployment (replica counts, the planner's target and changes)."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import slo_load  # noqa: E402


def test_replicas_sharing_a_gpu_reserve_their_share_and_fit_in_it():
    args = slo_load.arguments(["--gpu", "--gpus-per-replica", "0.5", "--max-replicas", "4"])
    assert slo_load.resources("static_max", args) == {"num_cpus": 1, "num_gpus": 0.5, "num_replicas": 4}
    assert slo_load.resources("slo", args)["num_gpus"] == 0.5
    two, three = slo_load.gpu_engine_args(0.5), slo_load.gpu_engine_args(1 / 3)
    assert 2 * two["gpu_memory_utilization"] <= 0.8 and 3 * three["gpu_memory_utilization"] <= 0.8
    assert slo_load.gpu_engine_args(1.0) == slo_load.GPU_ENGINE_ARGS  # a whole GPU: as before
    assert "num_gpus" not in slo_load.resources("slo", slo_load.arguments([]))  # CPU: no GPU asked


def test_random_weights_are_drawn_by_the_engine_when_asked(tmp_path):
    import yaml

    def engine_args(argv: list[str], work: str) -> dict:
        args = slo_load.arguments(argv)
        args.model_dir = tmp_path / "model"
        deployment = slo_load.Deployment("static_max", args, tmp_path / work)
        return yaml.safe_load((deployment.conf / "serve" / "nodes.yaml").read_text())[0]["engine_args"]

    quarter = engine_args(["--gpu", "--size", "8b", "--dummy-weights", "--gpus-per-replica", "0.25"], "dummy")
    assert quarter["load_format"] == "dummy" and quarter["gpu_memory_utilization"] == 0.2
    assert "load_format" not in engine_args(["--gpu"], "written")
    sized = engine_args(["--gpu", "--gpus-per-replica", "0.25", "--kv-cache-gib", "10"], "sized")
    assert sized["kv_cache_memory_bytes"] == 10 * 2**30 and "kv_cache_memory_bytes" not in quarter


@pytest.mark.parametrize("argv", [["--gpu", "--kv-cache-gib", "0"], ["--kv-cache-gib", "4"]])
def test_a_kv_cache_size_is_a_gpu_replicas_and_over_zero(argv, capsys):
    with pytest.raises(SystemExit):
        slo_load.arguments(argv)
    assert "--kv-cache-gib" in capsys.readouterr().err


@pytest.mark.parametrize("share", ["0", "1.5", "-0.5"])
def test_a_share_that_is_not_part_of_one_gpu_is_refused(share, capsys):
    with pytest.raises(SystemExit):
        slo_load.arguments(["--gpu", "--gpus-per-replica", share])
    assert "--gpus-per-replica" in capsys.readouterr().err


def test_a_rate_the_benchmark_workers_cannot_send_on_time_is_refused_before_anything_starts(capsys):
    with pytest.raises(SystemExit):
        slo_load.arguments(["--gpu", "--rate", "361", "--time-scale", "1"])
    assert "need 68 benchmark workers" in capsys.readouterr().err
    assert slo_load.arguments(["--gpu", "--rate", "361", "--workers", "68"]).workers == 68
    assert slo_load.arguments(["--gpu", "--rate", "75.175"]).rate == 75.175  # the two-GPU runs' rate


def test_the_planner_with_sleep_runs_on_gpus_only_and_sleeps_after_the_scaled_delay(capsys):
    args = slo_load.arguments(["--gpu", "--time-scale", "0.4"])
    assert "slo_sleep" in args.systems
    resources = slo_load.resources("slo_sleep", args)
    assert resources["sleep_delay_s"] == 2.0 and resources["slo"] == slo_load.resources("slo", args)["slo"]
    assert "slo_sleep" not in slo_load.arguments([]).systems  # CPU default
    with pytest.raises(SystemExit):
        slo_load.arguments(["--systems", "slo_sleep"])
    assert "vLLM sleeps on GPUs only" in capsys.readouterr().err


def test_replicas_are_counted_awake_unless_their_engine_says_it_sleeps():
    text = "\n".join([
        'vllm:num_requests_running{engine="0",model_name="demo",replica="a"} 0.0',
        'vllm:num_requests_running{engine="0",model_name="demo",replica="b"} 3.0',
        'vllm:num_requests_running{engine="0",model_name="demo",replica="c"} 0.0',
        'vllm:engine_sleep_state{engine="0",model_name="demo",sleep_state="awake",replica="a"} 0.0',
        'vllm:engine_sleep_state{engine="0",model_name="demo",sleep_state="weights_offloaded",replica="a"} 1.0',
        'vllm:engine_sleep_state{engine="0",model_name="demo",sleep_state="awake",replica="b"} 1.0',
    ])  # fmt: skip
    assert slo_load.replica_counts(text) == (2, 3, None)  # c: an engine without the gauge counts awake
    planned = text + '\nflagscale_router_planner_target_replicas{serve_id="demo"} 1\n'
    assert slo_load.replica_counts(planned) == (2, 3, 1)  # the SLO planner's target beside them


def test_a_sized_kv_cache_must_hold_what_one_replica_runs_at_the_calibrated_point(capsys):
    shape = ["--gpu", "--size", "8b", "--gpus-per-replica", "0.25", "--max-replicas", "4", "--time-scale", "1"]
    given = ["--rate", "25.112", "--target", "128"]  # 128 streams of 512 + 128 tokens: 81,920 tokens, 10 GiB
    with pytest.raises(SystemExit):
        slo_load.arguments([*shape, *given, "--kv-cache-gib", "10"])
    assert "--kv-cache-gib 10 holds 81,920 tokens of the 8b shape" in capsys.readouterr().err
    assert slo_load.arguments([*shape, *given, "--kv-cache-gib", "14"]).kv_cache_gib == 14
    assert slo_load.kv_cache_too_small(slo_load.arguments([*shape, "--kv-cache-gib", "10"])) is None  # calibrates


def test_what_the_planner_sees_is_read_from_the_routers_metrics():
    from flagscale.router.planner_metrics import planner_text

    record = {"target": 1, "desired": 2, "measured": {"itl_ms": 41.5}, "forecast": {"work_tps": 9000.0}}
    text = planner_text({"demo": record}, {}, 0)
    assert slo_load.planner_figures(text) == {"desired": 2, "measured": {"itl_ms": 41.5}, "forecast": {"work_tps": 9e3}}
    assert slo_load.planner_figures('vllm:num_requests_running{replica="a"} 0\n') == {}


def test_replica_seconds_are_split_by_the_trace_segment_they_were_spent_in():
    plan = [{"segment": "idle", "start_s": 0.0, "seconds": 20.0}, {"segment": "ramp", "start_s": 20.0, "seconds": 10}]
    counts = [(0.0, 4, 4, 0), (15.0, 0, 4, 0), (25.0, 2, 4, 2), (30.0, 2, 4, 2)]
    assert slo_load.replica_s_by_segment(counts, plan) == {"idle": 60.0, "ramp": 10.0}


def test_the_planners_changes_are_read_from_the_controller_log_the_deployment_kept(tmp_path):
    serve = tmp_path / "exp" / "serve_logs" / "ray" / "serve"
    serve.mkdir(parents=True)
    change = "INFO 2026-12-01 00:18:50,153 controller 27212 -- SLO planner zero: 1 -> 0: idle: nothing in flight"
    (serve / "controller_27212.log").write_text(f"INFO other\n{change}\n{change}\n")
    deployment = types.SimpleNamespace(exp_dir=tmp_path / "exp")
    assert slo_load.planner_changes(deployment) == [change]
