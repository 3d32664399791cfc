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
