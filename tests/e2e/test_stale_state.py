"""A state file whose cluster is gone (machine rebooted, processes killed): every action says so clearly."""

from __future__ import annotations

import json

from flagscale.cluster.state import HostRecord, RunState
from flagscale.net import free_port
from tests.conftest import demo_engine_args, run_cli, status_cli, write_config

PORT = 18951


def stale_run(tmp_path):
    exp_dir = tmp_path / "exp"
    conf = write_config(
        tmp_path / "conf", [{"serve_id": "a", "engine": "vllm", "engine_args": demo_engine_args()}], exp_dir, PORT
    )
    dead = free_port()  # nothing listens there
    RunState(
        app_name="test",
        exp_dir=str(exp_dir),
        endpoint=f"http://127.0.0.1:{PORT}",
        ray_address=f"127.0.0.1:{dead}",
        token_path=None,
        hosts=[HostRecord(host="localhost", role="head", session=None)],
        models=["a"],
        phase="running",
    ).save()
    return conf, exp_dir


def test_status_of_a_gone_cluster(tmp_path):
    conf, _ = stale_run(tmp_path)
    result = status_cli(conf, "output=json")
    assert result.returncode == 1
    report = json.loads(result.stdout[result.stdout.index("{") :])
    assert report["status"] == "CLUSTER_GONE" and not report["healthy"] and "action=stop" in report["message"]


def test_stop_cleans_up_a_gone_cluster(tmp_path):
    conf, exp_dir = stale_run(tmp_path)
    result = run_cli(conf, "action=stop", timeout=120)
    assert result.returncode == 0, result.output
    assert not (exp_dir / "state.json").exists()


def test_bench_with_nothing_running(tmp_path):
    exp_dir = tmp_path / "exp"
    conf = write_config(
        tmp_path / "conf", [{"serve_id": "a", "engine": "vllm", "engine_args": demo_engine_args()}], exp_dir, PORT
    )
    result = run_cli(conf, "action=bench", timeout=120)
    assert result.returncode != 0
    assert "nothing is running" in result.output and str(exp_dir) in result.output
