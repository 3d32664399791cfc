"""On a 2-GPU host: prefill/decode disaggregation between the two GPUs (issue 32, item 4).

One node, one prefill and one decode replica of the demo model, a whole GPU each, KV moved by vLLM's
NixlConnector. A request's KV goes from the prefill GPU to the decode GPU: the two replicas hold different GPUs,
the decode replica's engine counts the transfer (status: `engine.kv_transfers`, from vLLM's
`vllm:nixl_xfer_time_seconds`), and UCX read the prefill engine's GPU memory with `cuda_ipc` (its
UCX_PROTO_INFO table in the decode engine's log), not through the host. Every GPU process has NVLink multicast
off; stop leaves no process on a GPU.

On a 4-GPU host (issue 32, item 3): FlagScale's own xpyd config (../shared/flagscale-configs or FLAGSCALE_CONFIGS:
qwen2_5-disagg-xpyd, `prefill_decode_disaggregation: true`, `prefill_num: 2`, `decode_num: 2`) runs as it is, with
only what cannot hold on a test host overridden: the model path (a random-weight model of Qwen2.5-7B's shape), its
placeholder hostfile and conda `before_start`, the exp_dir, and NVLink multicast off.
"""

from __future__ import annotations

import json
import os
import shutil
import urllib.request
from pathlib import Path

import checks  # benchmarks/gpu/checks.py (tests/gpu/conftest.py puts it on the path)
import pytest

from tests.conftest import REPO, run_cli, wait_for
from tests.gpu.test_placement import (
    ENGINE,
    Deployment,
    assert_env_everywhere,
    assert_stop_leaves_no_gpu_process,
    deployed,
)

pytestmark = pytest.mark.skipif(checks.gpu_count() < 2, reason="needs 2 GPUs")
CONFIGS = Path(os.environ.get("FLAGSCALE_CONFIGS") or REPO.parent / "shared" / "flagscale-configs")
XPYD = CONFIGS / "qwen2_5-disagg-xpyd"


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


needs_xpyd = pytest.mark.skipif(
    not XPYD.is_dir(), reason=f"FlagScale's configs are not at {CONFIGS} (FLAGSCALE_CONFIGS)"
)


class Xpyd:
    """FlagScale's xpyd config, copied, with only what cannot hold on a test host overridden (module docstring)."""

    def __init__(self, tmp_path: Path, *extra: str):
        pytest.importorskip("nixl", reason="NIXL is carried separately (benchmarks/gpu/README.md)")
        import model as bench_model  # benchmarks/gpu/model.py

        self.conf = shutil.copytree(XPYD, tmp_path / "xpyd")
        weights = bench_model.ensure_model("7b")
        self.overrides = [
            f"serve.0.engine_args.model={weights}",
            f"experiment.exp_dir={tmp_path / 'exp'}",
            "experiment.runner.hostfile=null",  # x.x.x.x placeholders: this host alone
            "experiment.cmds.before_start=null",  # `source /root/miniconda3/bin/activate ...`: no conda here
            *(f"++experiment.envs.{key}={value}" for key, value in checks.GPU_SAFE_ENV.items()),
            *extra,
        ]

    def cli(self, *args: str, timeout: float = 300):
        return run_cli(self.conf, *args, *self.overrides, name="serve_disagg_xpyd", timeout=timeout)

    def serves_across(self, prefill: int, decode: int) -> None:
        """Run it; `prefill` + `decode` replicas READY on as many distinct GPUs; a completion on the config's own
        port whose KV a decode engine counts; multicast off everywhere; stop leaves no process on a GPU."""
        roles = sorted(["prefill"] * prefill + ["decode"] * decode)

        def ready() -> dict:
            result = self.cli("action=status", "output=json")
            assert result.returncode == 0, result.output[-3000:]
            report = json.loads(result.stdout[result.stdout.index("{") :])
            assert sorted(r["role"] for r in report["replicas"] if r["state"] == "READY") == roles, report["replicas"]
            return report

        try:
            started = self.cli("action=run", timeout=1200)
            assert started.returncode == 0, started.output[-4000:]
            report = wait_for(ready, 300, f"{prefill} prefill and {decode} decode replicas ready")

            def placed() -> dict:
                found = checks.placement(ready(), devices_per_replica=1)
                assert found["problems"] == [], found
                assert len({g for r in found["replicas"] for g in r["status_gpus"]}) == len(roles), found
                return found

            wait_for(placed, 120, f"status and nvidia-smi to agree on {len(roles)} replicas on as many GPUs")
            before = sum(r["engine"].get("kv_transfers") or 0 for r in report["replicas"] if r["role"] == "decode")
            port = 10001  # the config's own
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=30) as resp:
                name = json.load(resp)["data"][0]["id"]
            body = json.dumps({"model": name, "prompt": "hello " * 200, "max_tokens": 16, "ignore_eos": True})
            request = urllib.request.Request(
                f"http://127.0.0.1:{port}/v1/completions",
                data=body.encode(),
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(request, timeout=120) as resp:
                assert json.load(resp)["usage"]["completion_tokens"] == 16

            def counted() -> bool:
                now = ready()
                return (
                    sum(r["engine"].get("kv_transfers") or 0 for r in now["replicas"] if r["role"] == "decode") > before
                )

            wait_for(counted, 60, "a decode engine to count the request's KV transfer")
            assert_env_everywhere()
        finally:
            stopped = self.cli("action=stop")
            assert stopped.returncode == 0, stopped.output[-3000:]
            assert checks.wait_no_gpu_apps(60) == []


@pytest.mark.skipif(checks.gpu_count() < 4, reason="needs 4 GPUs")
@needs_xpyd
def test_flagscale_xpyd_config_runs_as_it_is_on_four_gpus(tmp_path):
    Xpyd(tmp_path).serves_across(prefill=2, decode=2)


@pytest.mark.skipif(checks.gpu_count() != 2, reason="the 2-GPU form of the xpyd check")
@needs_xpyd
def test_flagscale_xpyd_config_on_two_gpus_refused_as_it_is_then_serves_1p1d(tmp_path):
    """Its 2 prefill + 2 decode replicas want a whole GPU each: on 2 GPUs `run` refuses before anything starts,
    naming the GPUs; with only `prefill_num` and `decode_num` set to 1 it serves, one GPU per pool."""
    xpyd = Xpyd(tmp_path)
    refused = xpyd.cli("action=run", timeout=300)
    assert refused.returncode != 0 and "GPU(s), but this machine has 2" in refused.output, refused.output[-3000:]
    assert checks.wait_no_gpu_apps(0) == []  # nothing was started
    counts = ["experiment.runner.deploy.prefill_num=1", "experiment.runner.deploy.decode_num=1"]
    Xpyd(tmp_path / "1p1d", *counts).serves_across(prefill=1, decode=1)
