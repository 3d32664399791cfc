"""On a GPU host with 2 (4) GPUs: one replica of vLLM's data parallel + expert parallel (a tiny random-shape Mixtral,
8 experts, `load_format: dummy`) holds DP distinct GPUs, one rank on each, as `status` names them (host, GPU, DP and
EP index) and nvidia-smi shows; every rank's process has NVLink multicast off; a rank killed takes the replica
down and Serve replaces it, serving again; stop leaves no process on any GPU.

  python3 -m pytest tests/gpu/test_expert_parallel.py -q -p no:cacheprovider      # on a GPU machine
"""

from __future__ import annotations

import os
import signal

import checks  # benchmarks/gpu/checks.py (tests/gpu/conftest.py puts it on the path)
import pytest

from tests.conftest import run_cli, wait_for, write_moe_model
from tests.gpu.test_placement import assert_env_everywhere, assert_stop_leaves_no_gpu_process, deployed

GPUS = checks.gpu_count()
pytestmark = pytest.mark.skipif(GPUS < 2, reason="expert parallel needs 2 GPUs (nvidia-smi lists fewer)")
four_gpus = pytest.mark.skipif(GPUS < 4, reason="needs 4 GPUs")


def moe_engine(model, dp: int) -> dict:
    return {
        "model": str(model),
        "served_model_name": "demo",
        "load_format": "dummy",  # random weights: config.json and the tokenizer are all it reads
        "data_parallel_size": dp,
        "tensor_parallel_size": 1,
        "enable_expert_parallel": True,
        "max_model_len": 512,
        "max_num_seqs": 16,
        "enforce_eager": True,
        "dtype": "bfloat16",
        "gpu_memory_utilization": 0.15,
    }


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    from flagscale.demo_model import ensure_demo_model

    return write_moe_model(tmp_path_factory.mktemp("moe") / "tiny-mixtral", ensure_demo_model(), experts=8)


def placed_ranks(deployment, dp: int) -> dict:
    """The READY replica's ranks as status and nvidia-smi show them, once its workers are up (bounded)."""

    def placed():
        found = checks.placement(deployment.status(), devices_per_replica=dp)
        return found if not found["problems"] and found["replicas"] else None

    (replica,) = wait_for(placed, 180, f"status to name all {dp} DP ranks on their GPUs", interval=3)["replicas"]
    return replica


def status_ranks(deployment) -> list[dict]:
    (replica,) = [r for r in deployment.status()["replicas"] if r["state"] == "READY"]
    return replica["ranks"]


@pytest.fixture(scope="module")
def dp2(tmp_path_factory, moe_model):
    with deployed(tmp_path_factory.mktemp("ep2"), moe_engine(moe_model, 2), {"num_replicas": 1}) as d:
        yield d


def test_dp2_ep_holds_two_gpus_one_rank_each_with_its_dp_and_ep_index(dp2):
    assert dp2.complete()
    replica = placed_ranks(dp2, 2)
    assert [r["smi_gpus"] for r in replica["ranks"]] == [[g] for g in replica["status_gpus"]], replica
    ranks = status_ranks(dp2)
    assert [(r["rank"], r["dp"], r["ep"]) for r in ranks] == [(0, 0, 0), (1, 1, 1)], ranks
    assert len({r["host"] for r in ranks}) == 1
    wide = run_cli(dp2.conf, "action=status", "output=wide", timeout=180, columns=240)
    assert wide.returncode == 0 and "engine ranks" in wide.stdout and " ep " in wide.stdout, wide.output[-3000:]


def test_dp2_ep_every_rank_has_nvlink_multicast_off(dp2):
    apps = assert_env_everywhere()
    assert len({app["pid"] for app in apps}) >= 2  # a worker per DP rank at least


def test_dp2_ep_rank_killed_takes_the_replica_down_and_serve_replaces_it(dp2):
    (before,) = dp2.ready()
    victim = next(r for r in status_ranks(dp2) if r["dp"] == 1)
    os.kill(victim["pid"], signal.SIGKILL)  # DP rank 1's worker: its GPU process

    def replaced():
        ready = dp2.ready()
        return ready if len(ready) == 1 and ready[0]["replica_id"] != before["replica_id"] else None

    wait_for(replaced, 400, "the replica whose rank was killed replaced by a new READY one", interval=3)
    placed_ranks(dp2, 2)
    wait_for(dp2.complete, 60, "a completion after the replacement")


def test_dp2_ep_stop_leaves_no_process_on_any_gpu(dp2):
    assert_stop_leaves_no_gpu_process(dp2)


@four_gpus
def test_dp4_ep_on_four_gpus(tmp_path, moe_model):
    with deployed(tmp_path, moe_engine(moe_model, 4), {"num_replicas": 1}) as dp4:
        assert dp4.complete()
        replica = placed_ranks(dp4, 4)
        assert len(set(replica["status_gpus"])) == 4
        assert [(r["dp"], r["ep"]) for r in status_ranks(dp4)] == [(d, d) for d in range(4)]
        assert_env_everywhere()
        assert_stop_leaves_no_gpu_process(dp4)
