"""benchmarks/gpu/bench_gpu.py's `--plain` alternatives to the orchestrator's replicas (issue 31, item 2): what they
start, without starting it. The GPU runs themselves are in docs/benchmarks.md."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "benchmarks"), str(REPO / "benchmarks" / "gpu")]
_saved_env = dict(os.environ)
import bench_gpu  # noqa: E402  (sets the GPU-safe variables in os.environ on import: put back below)

os.environ.clear()
os.environ.update(_saved_env)


def test_vllm_router_fronts_one_plain_server_per_gpu(tmp_path):
    routed = bench_gpu.RoutedPlainServers(tmp_path / "model", [8603, 8604, 8605], 8600, tmp_path, {"max_num_seqs": 4})
    assert [s.env for s in routed.servers] == [{"CUDA_VISIBLE_DEVICES": str(gpu)} for gpu in range(3)]
    assert len({s.log_path for s in routed.servers}) == 3  # a log each
    assert all("--max-num-seqs" in s.argv and "4" in s.argv for s in routed.servers)
    argv = routed.router.argv
    urls = argv[argv.index("--worker-urls") + 1 :]
    assert urls == ["http://127.0.0.1:8603", "http://127.0.0.1:8604", "http://127.0.0.1:8605"]
    assert argv[argv.index("--port") + 1] == "8600" and routed.url == "http://127.0.0.1:8600"
    assert "--policy" not in argv  # vllm-router's own default policy, as a user gets it


@pytest.mark.parametrize("extra", [[], ["--replicas", "4", "--gpus-per-replica", "0.5"]])
@pytest.mark.parametrize("plain", ["dp", "vllm-router"])
def test_an_alternative_needs_whole_gpus_one_per_replica(monkeypatch, capsys, plain, extra):
    monkeypatch.setattr(sys, "argv", ["bench_gpu.py", "--plain", plain, *extra])
    with pytest.raises(SystemExit):
        bench_gpu.parse_args()
    assert "needs --replicas" in capsys.readouterr().err


def test_vllm_routers_cpu_is_labelled_as_its_own_not_as_the_orchestrators_router():
    import subprocess

    import overhead  # benchmarks/overhead.py
    import psutil

    argv = [sys.executable, "-c", "import time; time.sleep(60)", "vllm_router.launch_router", "--worker-urls", "h:1"]
    proc = subprocess.Popen(argv)
    try:
        # until the child has exec'd, its command line is still this test's (a busy machine shows that)
        deadline = time.monotonic() + 30
        while "vllm_router.launch_router" not in psutil.Process(proc.pid).cmdline() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert overhead.process_role(psutil.Process(proc.pid)) == "vllm-router"
    finally:
        proc.kill()
        proc.wait()


def test_the_orchestrator_gets_exactly_the_plain_servers_engine_args(tmp_path):
    """conf/serve/demo.yaml sizes the CPU KV cache in bytes; a benchmark that only set its own keys left that in,
    and vLLM then gave the orchestrator's engine 1 GiB of cache beside plain vLLM's 57 GB (an H200 run)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    engine_args = {"max_model_len": 2048, "max_num_seqs": 1024, "gpu_memory_utilization": 0.4, "dtype": "bfloat16"}
    orch = bench_gpu.Orch("orchestrator", 8601, tmp_path, tmp_path / "model", engine_args)
    wanted = [o for o in orch.overrides if "engine_args" in o]
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        cfg = compose(config_name="serve", overrides=wanted)
    got = OmegaConf.to_container(cfg.serve[0].engine_args)
    assert "kv_cache_memory_bytes" in OmegaConf.load(REPO / "conf" / "serve" / "demo.yaml")[0].engine_args
    assert {k: v for k, v in got.items() if k != "served_model_name"} == {
        "model": str(tmp_path / "model"),
        **engine_args,
    }


def test_expert_parallel_step_compares_vllm_serve_and_one_gpu_replicas(monkeypatch, tmp_path):
    """multi_gpu.sh ep2: plain is `vllm serve` itself with the orchestrator's flags; the replicas drop DP and EP."""
    import overhead

    ep = {"data_parallel_size": 2, "enable_expert_parallel": True}
    serve = overhead.PlainVLLM(tmp_path, 8601, tmp_path, ep, entry="serve")
    assert serve.argv[1:4] == ["-m", "vllm.entrypoints.cli.main", "serve"]
    assert "--enable-expert-parallel" in serve.argv and "--data-parallel-size" in serve.argv
    assert overhead.PlainVLLM(tmp_path, 8601, tmp_path, ep).argv[2] == "vllm.entrypoints.openai.api_server"
    argv = ["bench_gpu.py", "--replicas", "2", "--gpus-per-replica", "1", "--plain-entry", "serve"]
    argv += ["--replica-engine-arg", "data_parallel_size=1", "--replica-engine-arg", "enable_expert_parallel=false"]
    monkeypatch.setattr(sys, "argv", argv)
    args = bench_gpu.parse_args()
    assert args.plain_entry == "serve"
    replica = bench_gpu.parse_engine_args(args.replica_engine_arg)
    assert replica == {"data_parallel_size": 1, "enable_expert_parallel": False}
