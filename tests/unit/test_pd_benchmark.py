"""benchmarks/pd.py's reading of a PD run on GPUs: which transport UCX picked for the KV reads (UCX_PROTO_INFO
tables in an engine's log) and what the measured rate may be called. No server."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "benchmarks"), str(REPO / "benchmarks" / "gpu")]

import checks  # noqa: E402  (benchmarks/gpu/checks.py)
import pd  # noqa: E402  (benchmarks/pd.py)

PROTO_INFO = """\
[1795780822.05] [vm:9147 :0]   +---------------------------------+-----------------------------+
[1795780822.05] [vm:9147 :0]   | remote memory read by ucp_get*(multi) into cuda/GPU0 from cuda/dev[2] |
[1795780822.05] [vm:9147 :0]   +--------+-------------+----------------+
[1795780822.05] [vm:9147 :0]   | 0..inf | zero-copy   | {transport}                                  |
[1795780822.05] [vm:9147 :0]   | tagged message by ucp_tag_send* from host memory |
[1795780822.05] [vm:9147 :0]   | 0..8k | short   | tcp/lo                                  |
"""


def test_the_transport_of_gpu_to_gpu_reads_is_read_and_host_tables_are_not(tmp_path):
    log = tmp_path / "engine-demo-decode.log"
    log.write_text("vLLM says hello | not a table\n" + PROTO_INFO.format(transport="cuda_ipc/cuda"))
    assert checks.ucx_kv_reads([log])["gpu_read_transports"] == {"cuda_ipc": 1}  # tcp/lo was for host memory
    log.write_text(PROTO_INFO.format(transport="tcp/lo"))
    assert checks.ucx_kv_reads([log])["gpu_read_transports"] == {"tcp": 1}
    assert checks.ucx_kv_reads([tmp_path / "missing.log"])["gpu_read_transports"] == {}


def test_a_slow_rate_over_cuda_ipc_is_bounded_by_the_step_not_a_fallback():
    shape = {"mb": 128.0, "ms": 23.4, "descriptors": 256.0}
    assert set(pd.kv_verdict({"cuda_ipc": 2}, 5.7, shape, step_ms=12.0)) == {"rate_bound"}
    assert pd.kv_verdict({"cuda_ipc": 2}, 50.0, {**shape, "ms": 2.6}, step_ms=12.0) == {}
    assert set(pd.kv_verdict({"cuda_ipc": 2}, 1.0, {**shape, "ms": 128.0}, step_ms=12.0)) == {"fell_back"}
    assert set(pd.kv_verdict({"cuda_ipc": 1, "tcp": 1}, 50.0, shape, step_ms=12.0)) == {"fell_back"}
    assert set(pd.kv_verdict({}, 50.0, shape, step_ms=12.0)) == {"fell_back"}
    assert set(pd.kv_verdict({"cuda_ipc": 1}, None, {**shape, "ms": None}, step_ms=12.0)) == {"fell_back"}


def test_pool_sizes_reach_the_disaggregated_pools_and_the_colocated_node_alike(tmp_path):
    """2P2D on 4 GPUs against 4 colocated replicas (issue 32, item 1): both systems get P + D engines, each with
    a whole GPU, the pools their own counts."""
    import argparse

    args = argparse.Namespace(
        max_model_len=2048,
        max_num_seqs=16,
        gpu_memory_utilization=0.4,
        cuda_graphs=False,
        block_size=None,
        num_gpus=1.0,
        prefill_replicas=3,
        decode_replicas=1,
    )
    pd_system = pd.PDOrchestrator("B", 8401, tmp_path, tmp_path / "model", args, disaggregated=True)
    assert pd_system.engines == 4
    for role, count in (("prefill", 3), ("decode", 1)):
        assert f"++serve.0.disaggregation.{role}.resources.num_replicas={count}" in pd_system.overrides
        assert f"++serve.0.disaggregation.{role}.resources.num_gpus=1.0" in pd_system.overrides
    colocated = pd.PDOrchestrator("A", 8400, tmp_path, tmp_path / "model", args, disaggregated=False)
    assert colocated.engines == 4 and "serve.0.resources.num_replicas=4" in colocated.overrides
    assert not any("disaggregation" in o for o in colocated.overrides)
    assert pd.system_labels(args) == {
        "A": "colocated (4 replicas)",
        "B": "PD 3P1D, project router",
        "C": "PD 3P1D, vllm-router",
    }


def test_a_pool_of_no_engines_is_refused_naming_the_option(monkeypatch, capsys):
    import pytest

    monkeypatch.setattr(sys, "argv", ["pd.py", "--decode-replicas", "0"])
    with pytest.raises(SystemExit) as exited:
        pd.parse_args()
    assert exited.value.code == 2
    assert "--prefill-replicas and --decode-replicas: at least 1 each" in capsys.readouterr().err
