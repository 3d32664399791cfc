"""auto_tune's arithmetic and records: memory pruning, goodput from recorded benchmark passes, ranking, and
history.csv written and read back. Pure logic."""

from __future__ import annotations

import json

import psutil

from flagscale.config.schema import BenchConfig
from flagscale.tune import history
from flagscale.tune.prune import (
    GIB,
    ModelShape,
    cpu_engine_bytes,
    kv_bytes_per_token,
    memory_problem,
    model_shape,
    shared_ram_problem,
)
from flagscale.tune.report import best_of, rank
from flagscale.tune.trial import goodput_of, latency_columns, scaled_load, slo_misses


def test_kv_bytes_per_token_from_config_json(tmp_path):
    cfg = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096}
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "torch_dtype": "bfloat16"}))
    shape = model_shape(str(tmp_path), dtype="auto", kv_cache_dtype=None)
    assert shape == ModelShape(layers=32, kv_heads=8, head_dim=128, dtype_bytes=2)
    assert kv_bytes_per_token(shape) == 2 * 32 * 8 * 128 * 2  # 128 KiB: Llama-3-8B's
    assert model_shape(str(tmp_path), dtype="float32", kv_cache_dtype="fp8").dtype_bytes == 1
    assert model_shape(str(tmp_path / "missing"), None, None) is None


def test_memory_problem_weights_plus_kv_per_device():
    per_token = 128 * 1024
    common = dict(kv_token_bytes=per_token, max_model_len=4096, utilization=0.9, device_bytes=80 * GIB, device="gpu")
    # 16 GiB of weights + 256 x 4096 tokens x 128 KiB = 128 GiB of KV: 144 GiB on one 72 GiB budget does not fit ...
    problem = memory_problem(weight_bytes=16 * GIB, max_num_seqs=256, devices_per_replica=1, **common)
    assert problem is not None
    assert "weights 16.00 GiB + KV cache 128.00 GiB" in problem and "256 x max_model_len 4096" in problem
    assert "gives 72.00 GiB" in problem
    # ... over TP 2 it is 72 GiB per device: fits exactly; fewer sequences fit on one.
    assert memory_problem(weight_bytes=16 * GIB, max_num_seqs=256, devices_per_replica=2, **common) is None
    assert memory_problem(weight_bytes=16 * GIB, max_num_seqs=64, devices_per_replica=1, **common) is None


def test_cpu_replicas_share_the_ram():
    assert shared_ram_problem(2, 0.4) is None
    assert "3 CPU replicas x gpu_memory_utilization 0.4 = 1.20" in shared_ram_problem(3, 0.4)


def bench_row(concurrency: int, req_s: float, ttft_p99: float, tpot_p99: float, failed: int = 0) -> dict:
    """A pass as flagscale.actions.bench.report_row gives it."""

    def stats(p99: float) -> dict:
        return {"mean": p99 / 2, "p50": p99 / 2, "p90": p99 * 0.9, "p99": p99}

    return {
        "concurrency": concurrency,
        "completed": 16 - failed,
        "failed": failed,
        "duration_s": 16 / req_s,
        "output_tok_s": req_s * 16,
        "req_s": req_s,
        "goodput_req_s": None,
        "ttft_ms": stats(ttft_p99),
        "tpot_ms": stats(tpot_p99),
        "itl_ms": stats(tpot_p99),
        "e2el_ms": stats(ttft_p99 + 16 * tpot_p99),
    }


SLO = {"ttft_ms": {"p99": 500}, "tpot_ms": {"p99": 50}}


def test_goodput_is_the_highest_level_meeting_the_slo_and_climbing_stops_at_the_first_miss():
    rows = [
        bench_row(1, 1.0, 100, 20),
        bench_row(2, 1.8, 200, 30),
        bench_row(4, 3.0, 900, 40),
        bench_row(8, 5, 100, 20),
    ]
    outcome = goodput_of(rows, SLO)
    assert outcome.goodput == 1.8 and outcome.row["concurrency"] == 2 and outcome.slo_met
    assert slo_misses(rows[2], SLO) == ["ttft_ms p99 900.0 > 500"]


def test_failed_requests_count_as_a_miss_and_no_slo_takes_the_top_level():
    rows = [bench_row(1, 1.0, 100, 20), bench_row(2, 1.8, 200, 30, failed=1)]
    assert goodput_of(rows, SLO).goodput == 1.0
    assert goodput_of(rows[:1], None).goodput == 1.0
    top = [bench_row(1, 1.0, 100, 20), bench_row(4, 3.0, 900, 40)]
    assert goodput_of(top, None).goodput == 3.0 and goodput_of(top, None).row["concurrency"] == 4


def test_no_level_meets_the_slo_reports_how_close_the_lowest_came():
    outcome = goodput_of([bench_row(1, 1.0, 750, 20)], SLO)
    assert outcome.goodput == 0 and not outcome.slo_met
    assert outcome.closest_ratio == 1.5 and outcome.row["concurrency"] == 1


def row(name: str, status: str = "done", **numbers) -> dict:
    return {"instance": name, "status": status, **numbers}


def test_rank_by_goodput_per_device_then_the_closest_miss():
    rows = [
        row("a", goodput=2.0, goodput_per_device=1.0),
        row("b", goodput=3.0, goodput_per_device=1.5),
        row("c", goodput=0.0, goodput_per_device=0.0, slo_ratio=1.2),
        row("d", goodput=0.0, goodput_per_device=0.0, slo_ratio=3.0),
        row("e", status="failed", reason="boom"),
        row("f", status="skipped", reason="memory"),
    ]
    ranked = rank(rows, SLO, "itl", "ascend")
    assert [r["instance"] for r in ranked] == ["b", "a", "c", "d"]
    assert best_of(ranked, SLO)["instance"] == "b"
    misses = rank(rows[2:], SLO, "itl", "ascend")
    assert best_of(misses, SLO) is None and misses[0]["instance"] == "c"  # the closest one is reported


def test_rank_without_slo_uses_flagscales_metric_and_order():
    rows = [row("a", itl_mean_ms=9.0, request_throughput=1.0), row("b", itl_mean_ms=5.0, request_throughput=0.5)]
    assert [r["instance"] for r in rank(rows, None, "itl", "ascend")] == ["b", "a"]
    assert [r["instance"] for r in rank(rows, None, "request_throughput", "descend")] == ["a", "b"]


def test_history_round_trip(tmp_path):
    path = tmp_path / "auto_tuner" / "history.csv"
    measured = {"instance": 2, "max_num_seqs": 4, "status": "done", "goodput": 1.5, "devices": 2}
    measured.update(latency_columns(bench_row(2, 1.5, 120.5, 30.25)))
    skipped = {"instance": 4, "max_num_seqs": 4, "status": "skipped", "reason": "memory: a, b", "goodput": None}
    history.write(path, ["instance", "max_num_seqs"], [measured, skipped])
    header = path.read_text().splitlines()[0].split(",")
    assert header[:3] == ["instance", "max_num_seqs", "status"]
    assert {"ttft_p50_ms", "ttft_p99_ms", "tpot_p99_ms", "itl_p50_ms", "itl_p99_ms", "goodput", "reason"} <= set(header)
    back = history.read(path)
    assert back[0]["ttft_p99_ms"] == 120.5 and back[0]["instance"] == 2 and back[0]["status"] == "done"
    assert back[1]["reason"] == "memory: a, b" and back[1]["goodput"] is None
    assert not path.with_suffix(".csv.tmp").exists()


def test_trial_key_changes_with_what_a_trial_measures():
    workload = {"input_len": 32, "output_len": 16, "levels": [1, 2]}
    key = history.trial_key({"instance": 1}, "m", workload, SLO)
    assert key == history.trial_key({"instance": 1}, "m", dict(workload), SLO)
    assert key != history.trial_key({"instance": 2}, "m", workload, SLO)
    assert key != history.trial_key({"instance": 1}, "m", {**workload, "levels": [1, 2, 4]}, SLO)
    assert key != history.trial_key({"instance": 1}, "m", workload, None)


def test_replicas_sharing_a_gpu_count_their_share_of_it():
    from types import SimpleNamespace

    from flagscale.tune.search import devices_of

    def engine(device, per_replica, replicas, gpus):
        return SimpleNamespace(
            device=device,
            devices_per_replica=per_replica,
            initial_replicas=replicas,
            ray_actor_options={"num_gpus": gpus},
        )

    assert devices_of(engine("gpu", 1, 2, 0.5)) == 1.0  # two half-GPU replicas: one GPU
    assert devices_of(engine("gpu", 2, 2, 2)) == 4  # TP 2 x 2 replicas
    assert devices_of(engine("cpu", 1, 2, 0)) == 2


SECRET = "s3cret-value-9f8e"


def test_best_config_keeps_references_never_secret_values(tmp_path, monkeypatch, demo_model_path):
    """auto_tune's best config: the API key as api_key_env, env values as ${oc.env:NAME}, hf_token as a
    reference; no secret value in any file, each file 0600; with the variables set it loads to the same secrets."""
    import stat

    import yaml
    from omegaconf import OmegaConf

    from flagscale.config.load import ConfigSources, load_config
    from flagscale.tune.report import BEST_KEY_ENV, write_best_config

    cfg = {
        "experiment": {
            "exp_name": "t",
            "exp_dir": str(tmp_path / "exp"),
            "task": {"type": "serve"},
            "runner": {"hostfile": None, "deploy": {"port": 8123, "api_key": SECRET}},
            "envs": {"HF_TOKEN": SECRET, "PLAIN": "1", "nodes_envs": {"10.0.0.2": {"WANDB_KEY": SECRET}}},
        },
        "serve": [{"serve_id": "m", "engine_args": {"model": str(demo_model_path), "hf_token": SECRET}}],
        "action": "run",
    }
    config = load_config(cfg, ConfigSources())
    out, env_vars = write_best_config(config, str(tmp_path / "exp"), tmp_path / "auto_tuner" / "best")
    files = [p for p in out.rglob("*") if p.is_file()]
    assert len(files) == 2
    for path in files:
        assert SECRET not in path.read_text(), path
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    assert stat.S_IMODE(out.stat().st_mode) == 0o700
    main = yaml.safe_load((out / "serve.yaml").read_text())
    assert main["experiment"]["runner"]["deploy"] == {"port": 8123, "api_key_env": BEST_KEY_ENV}
    assert main["experiment"]["envs"]["HF_TOKEN"] == "${oc.env:HF_TOKEN}"
    assert main["experiment"]["envs"]["nodes_envs"] == {"10.0.0.2": {"WANDB_KEY": "${oc.env:WANDB_KEY}"}}
    assert yaml.safe_load((out / "serve" / "best.yaml").read_text())[0]["engine_args"]["hf_token"] == (
        "${oc.env:HF_TOKEN}"
    )
    assert set(env_vars) == {BEST_KEY_ENV, "HF_TOKEN", "PLAIN", "WANDB_KEY"}

    for name in env_vars:
        monkeypatch.setenv(name, "1" if name == "PLAIN" else SECRET)
    tree = OmegaConf.load(out / "serve.yaml")
    tree.pop("defaults"), tree.pop("hydra")
    tree.serve = OmegaConf.load(out / "serve" / "best.yaml")
    again = load_config(OmegaConf.to_container(tree, resolve=True), ConfigSources())
    assert again.experiment.runner.deploy.resolved_api_key() == SECRET
    assert again.experiment.env_for()["HF_TOKEN"] == SECRET and again.experiment.env_for()["PLAIN"] == "1"
    assert again.serve[0].engine_args["hf_token"] == SECRET


def test_history_and_logs_are_the_users_alone(tmp_path):
    import stat

    from flagscale.paths import private_file

    path = tmp_path / "auto_tuner" / "history.csv"
    history.write(path, ["instance"], [{"instance": 1, "status": "done"}])
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    log = tmp_path / "auto_tuner" / "tuner.log"
    log.write_text("earlier\n")
    log.chmod(0o644)
    assert stat.S_IMODE(private_file(log).stat().st_mode) == 0o600 and log.read_text() == "earlier\n"


def test_per_device_load_scales_levels_and_prompts_by_the_candidates_devices():
    settings = BenchConfig(num_prompts=256, concurrency=[64, 256])
    assert scaled_load(settings, [64, 256], 1) == (settings, [64, 256])
    four, levels = scaled_load(settings, [64, 256], 4)
    assert levels == [256, 1024] and four.num_prompts == 1024 and settings.num_prompts == 256
    assert scaled_load(settings, [64], 0.5) == (settings, [64])  # replicas sharing one GPU: one device


def test_cpu_engines_get_a_fraction_of_the_smallest_numa_node_capped_by_the_cgroup(tmp_path):
    nodes = tmp_path / "node"
    for index, kib in ((0, 10315512), (1, 20000000)):
        (nodes / f"node{index}").mkdir(parents=True)
        text = f"Node {index} MemTotal:       {kib} kB\nNode {index} MemFree:        100 kB\n"
        (nodes / f"node{index}" / "meminfo").write_text(text)
    (nodes / "possible").write_text("0-1\n")  # (sysfs's other entries are not nodes)
    no_cgroup = tmp_path / "absent"
    assert cpu_engine_bytes(nodes, no_cgroup) == 10315512 * 1024
    limit = tmp_path / "memory.max"
    limit.write_text("max\n")
    assert cpu_engine_bytes(nodes, limit) == 10315512 * 1024
    limit.write_text(f"{4 * GIB}\n")
    assert cpu_engine_bytes(nodes, limit) == 4 * GIB
    assert cpu_engine_bytes(tmp_path / "no-nodes", no_cgroup) == psutil.virtual_memory().total
