"""On a 2-GPU host: prefill/decode disaggregation between the two GPUs (issue 32, item 4).

One node, one prefill and one decode replica of the demo model, a whole GPU each, KV moved by vLLM's
NixlConnector. A request's KV goes from the prefill GPU to the decode GPU: the two replicas hold different GPUs,
the decode replica's engine counts the transfer (status: `engine.kv_transfers`, from vLLM's
`vllm:nixl_xfer_time_seconds`), and UCX read the prefill engine's GPU memory with `cuda_ipc` (its
UCX_PROTO_INFO table in the decode engine's log), not through the host. Every GPU process has NVLink multicast
off; stop leaves no process on a GPU.
"""

from __future__ import annotations

from pathlib import Path

import checks  # benchmarks/gpu/checks.py (tests/gpu/conftest.py puts it on the path)
import pytest

from tests.conftest import wait_for
from tests.gpu.test_placement import (
    ENGINE,
    Deployment,
    assert_env_everywhere,
    assert_stop_leaves_no_gpu_process,
    deployed,
)

pytestmark = pytest.mark.skipif(checks.gpu_count() < 2, reason="needs 2 GPUs")


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    pytest.importorskip("nixl", reason="NIXL is carried separately (benchmarks/gpu/README.md)")
    disaggregation = {"disaggregation": {"kv_connector": "NixlConnector"}}
    resources = {"num_replicas": 1, "num_gpus": 1}  # per pool: one prefill and one decode replica, a GPU each
    with deployed(tmp_path_factory.mktemp("pd"), ENGINE, resources, disaggregation, {"UCX_PROTO_INFO": "y"}) as d:
        yield d


def by_role(deployment: Deployment) -> dict[str, dict]:
    replicas = {r["role"]: r for r in deployment.ready()}
    assert set(replicas) == {"prefill", "decode"}, replicas
    return replicas


def test_prefill_and_decode_hold_different_gpus(pd):
    replicas = wait_for(lambda: by_role(pd), 120, "a ready prefill and a ready decode replica")
    prefill, decode = replicas["prefill"]["gpus"], replicas["decode"]["gpus"]
    assert len(prefill) == len(decode) == 1 and prefill != decode, replicas


def test_a_request_kv_moves_gpu_to_gpu_over_cuda_ipc(pd):
    replicas = wait_for(lambda: by_role(pd), 120, "a ready prefill and a ready decode replica")
    before = replicas["decode"]["engine"].get("kv_transfers") or 0
    assert pd.complete()

    def counted() -> dict | None:
        decode = by_role(pd)["decode"]
        return decode if (decode["engine"].get("kv_transfers") or 0) >= before + 1 else None

    decode = wait_for(counted, 60, "the decode engine to count the request's KV transfer")
    reads = checks.ucx_kv_reads([Path(decode["log"])])
    assert reads["gpu_read_transports"] and set(reads["gpu_read_transports"]) == {"cuda_ipc"}, reads


def test_pd_every_gpu_process_has_multicast_off(pd):
    assert len({app["pid"] for app in assert_env_everywhere()}) >= 2  # an engine per GPU at least


def test_pd_stop_leaves_no_process_on_any_gpu(pd):
    assert_stop_leaves_no_gpu_process(pd)
