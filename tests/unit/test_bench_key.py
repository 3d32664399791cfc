"""The API key reaches vLLM's benchmark through its own worker process's environment only: bench and auto_tune
leave OPENAI_API_KEY out of the caller's environment (which every process started later, Ray's too, inherits)."""

from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor

import pytest
from rich.console import Console

from flagscale.actions import auto_tune as auto_tune_action
from flagscale.actions import bench as bench_action
from flagscale.actions.context import ActionContext
from flagscale.config.load import ConfigSources, load_config

KEY = "bench-key-7f3a-0123"


def _key_seen_by_the_benchmark(log_path: str, api_key: str) -> str | None:
    from flagscale.actions import bench

    bench.run_vllm_bench = lambda argv: {"key": os.environ.get("OPENAI_API_KEY")}  # vLLM's stand-in, in the worker
    return bench._run_logged([], log_path, api_key)["key"]


def test_the_benchmark_worker_gets_the_key_in_its_own_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        assert pool.submit(_key_seen_by_the_benchmark, str(tmp_path / "bench.log"), KEY).result(60) == KEY
    assert "OPENAI_API_KEY" not in os.environ


@pytest.mark.parametrize("module", [bench_action, auto_tune_action])
def test_bench_and_auto_tune_leave_the_key_out_of_the_callers_environment(tmp_path, monkeypatch, module):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    seen = {}

    def stand_in(config, *args):
        seen["args"] = args
        return 0

    monkeypatch.setattr(module, module.__name__.rpartition(".")[2], stand_in)
    cfg = {
        "experiment": {
            "exp_name": "t",
            "exp_dir": str(tmp_path),
            "task": {"type": "serve"},
            "runner": {"hostfile": None, "deploy": {"api_key": KEY}},
        },
        "serve": [{"serve_id": "m", "engine_args": {"model": "m"}}],
        "action": "run",
    }
    sources = ConfigSources()
    ctx = ActionContext(load_config(cfg, sources), sources, str(tmp_path), Console(file=open(os.devnull, "w")))
    assert module.act(ctx) == 0 and seen
    assert "OPENAI_API_KEY" not in os.environ


def test_run_and_dryrun_steer_a_key_value_to_api_key_env(tmp_path, monkeypatch):
    import io

    def notices(deploy: dict) -> str:
        cfg = {
            "experiment": {
                "exp_name": "t",
                "exp_dir": str(tmp_path),
                "task": {"type": "serve"},
                "runner": {"hostfile": None, "deploy": deploy},
            },
            "serve": [{"serve_id": "m", "engine_args": {"model": "m"}}],
            "action": "run",
        }
        out = io.StringIO()
        sources = ConfigSources()
        ActionContext(load_config(cfg, sources), sources, str(tmp_path), Console(file=out, width=300)).print_notices()
        return out.getvalue()

    assert "prefer api_key_env" in notices({"api_key": KEY}) and KEY not in notices({"api_key": KEY})
    monkeypatch.setenv("FS_TEST_KEY", KEY)
    assert "api_key_env" not in notices({"api_key_env": "FS_TEST_KEY"})
