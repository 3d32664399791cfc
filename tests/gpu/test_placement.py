"""On a GPU host: a TP=2 replica holds two distinct GPUs, one rank on each; two TP=1 replicas never share a GPU
unless num_gpus < 1 asks for it; `status` shows each replica's GPUs and each rank's; every process on a GPU has
NVLink multicast off; a replica whose engine process is killed is replaced and serves again; stop leaves no
process on any GPU (nvidia-smi). The demo model (tiny random-weight Llama) with CUDA graphs off keeps each
deployment to well under a minute.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import checks  # benchmarks/gpu/checks.py (tests/gpu/conftest.py puts it on the path)
import pytest

from flagscale.net import free_port
from tests.conftest import run_cli, wait_for, write_config

GPUS = checks.gpu_count()
pytestmark = pytest.mark.skipif(GPUS == 0, reason="needs a GPU (nvidia-smi lists none)")
two_gpus = pytest.mark.skipif(GPUS < 2, reason="needs 2 GPUs")
ENGINE = {
    "model": "${demo_model:}",
    "served_model_name": "demo",
    "max_model_len": 512,
    "max_num_seqs": 16,
    "enforce_eager": True,
    "dtype": "bfloat16",
    "gpu_memory_utilization": 0.15,
}


@dataclass
class Deployment:
    conf: Path
    port: int

    def status(self) -> dict:
        result = run_cli(self.conf, "action=status", "output=json", timeout=180)
        assert result.returncode == 0, result.output[-3000:]
        return json.loads(result.stdout[result.stdout.index("{") :])

    def ready(self) -> list[dict]:
        return [r for r in self.status()["replicas"] if r["state"] == "READY"]

    def complete(self, model: str = "demo", timeout_s: float = 60) -> str:
        body = json.dumps({"model": model, "prompt": "hello", "max_tokens": 8, "ignore_eos": True}).encode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/v1/completions", data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            return json.load(resp)["choices"][0]["text"]

    def stop(self) -> None:
        result = run_cli(self.conf, "action=stop", timeout=300)
        assert result.returncode == 0, result.output[-3000:]


@contextlib.contextmanager
def deployed(root: Path, engine_args: dict, resources: dict, node_extra: dict | None = None, envs: dict | None = None):
    """One node `demo` deployed (NVLink multicast off in experiment.envs, plus `envs`), stopped after."""
    node = {
        "serve_id": "demo",
        "engine": "vllm",
        "engine_args": engine_args,
        "resources": resources,
        **(node_extra or {}),
    }
    with deployed_nodes(root, [node], envs) as deployment:
        yield deployment


@contextlib.contextmanager
def deployed_nodes(root: Path, nodes: list[dict], envs: dict | None = None):
    """`nodes` deployed on a free port (NVLink multicast off in experiment.envs, plus `envs`), stopped after."""
    port = free_port()
    envs = {**checks.GPU_SAFE_ENV, **(envs or {})}
    conf = write_config(root / "conf", nodes, root / "exp", port, experiment={"envs": envs})
    deployment = Deployment(conf, port)
    try:
        result = run_cli(conf, "action=run", timeout=900)
        assert result.returncode == 0, result.output[-4000:]
        yield deployment
    finally:
        with contextlib.suppress(Exception):
            deployment.stop()


def assert_stop_leaves_no_gpu_process(deployment: Deployment) -> None:
    deployment.stop()
    assert checks.wait_no_gpu_apps(60) == []


def assert_env_everywhere() -> list[dict]:
    apps = checks.gpu_apps()
    report = checks.env_check({}, [app["pid"] for app in apps])
    assert checks.env_problems(report) == [], report
    return apps


# ------------------------------------------------------------------------------------------------ TP=2: 2 GPUs


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    with deployed(tmp_path_factory.mktemp("tp2"), {**ENGINE, "tensor_parallel_size": 2}, {"num_replicas": 1}) as d:
        yield d


@two_gpus
def test_tp2_replica_holds_two_distinct_gpus_one_rank_each(tp2):
    assert tp2.complete()
    report = tp2.status()
    found = checks.placement(report, devices_per_replica=2)
    assert found["problems"] == [], found
    (replica,) = found["replicas"]
    assert len(set(replica["status_gpus"])) == 2
    assert sorted(tuple(r["smi_gpus"]) for r in replica["ranks"]) == sorted((g,) for g in replica["status_gpus"])


@two_gpus
def test_status_table_shows_replica_and_rank_gpus(tp2):
    result = run_cli(tp2.conf, "action=status", timeout=180, columns=240)
    assert result.returncode == 0, result.output[-3000:]
    assert re.search(r"gpu \d\|\d", result.stdout), result.stdout  # the replica row: rank 0's GPU | rank 1's
    wide = run_cli(tp2.conf, "action=status", "output=wide", timeout=180, columns=240)
    assert wide.returncode == 0, wide.output[-3000:]
    assert "engine ranks" in wide.stdout, wide.stdout  # one row per rank: its pid and its GPU


@two_gpus
def test_tp2_every_gpu_process_has_multicast_off(tp2):
    apps = assert_env_everywhere()
    assert len({app["pid"] for app in apps}) >= 2  # a worker per rank at least


@two_gpus
def test_tp2_stop_leaves_no_process_on_any_gpu(tp2):
    assert_stop_leaves_no_gpu_process(tp2)


# ------------------------------------------------------------- vLLM's data_parallel_size 2 inside one replica


@two_gpus
def test_dp2_inside_one_replica_names_each_rank_by_the_gpu_its_worker_is_on(tmp_path):
    """A dense model's DP engines run apart: their workers' titles lack _DP, their engine cores' have it."""
    with deployed(tmp_path, {**ENGINE, "data_parallel_size": 2}, {"num_replicas": 1}) as dp2:
        assert dp2.complete()

        def placed() -> dict:  # the replica records its ranks' pids once their workers are up
            found = checks.placement(dp2.status(), devices_per_replica=2)
            assert found["problems"] == [], found
            return found

        (replica,) = wait_for(placed, 120, "status to name both DP ranks on their GPUs")["replicas"]
        assert [r["smi_gpus"] for r in replica["ranks"]] == [[g] for g in replica["status_gpus"]], replica
        assert_stop_leaves_no_gpu_process(dp2)


# ------------------------------------------------------------------------------ 2 replicas x TP=1, whole GPUs


@pytest.fixture(scope="module")
def two_replicas(tmp_path_factory):
    with deployed(tmp_path_factory.mktemp("dp2"), ENGINE, {"num_replicas": 2}) as d:
        yield d


@two_gpus
def test_two_replicas_never_share_a_gpu(two_replicas):
    found = checks.placement(two_replicas.status(), devices_per_replica=1)
    assert found["problems"] == [], found
    gpus = [tuple(r["status_gpus"]) for r in found["replicas"]]
    assert len(gpus) == 2 and len(set(gpus)) == 2, found
    assert_env_everywhere()


@two_gpus
def test_replica_whose_engine_process_is_killed_is_replaced(two_replicas):
    before = two_replicas.ready()
    victim = before[0]
    on_gpu = {app["pid"] for app in checks.gpu_apps()} & checks.tree(victim["engine_pid"])
    assert on_gpu, f"no process of replica {victim['replica_id']} is on a GPU"
    for pid in on_gpu:  # the engine's GPU process (vLLM's engine core / worker): the rank
        os.kill(pid, signal.SIGKILL)

    def replaced():
        ready = two_replicas.ready()
        ids = {r["replica_id"] for r in ready}
        return len(ready) == 2 and victim["replica_id"] not in ids and ready

    wait_for(replaced, 300, "the killed replica replaced by a new READY one", interval=3)
    found = wait_for(
        lambda: (lambda f: f if not f["problems"] else None)(checks.placement(two_replicas.status(), 1)),
        120,
        "the new replica on its own GPU",
        interval=3,
    )
    assert len({tuple(r["status_gpus"]) for r in found["replicas"]}) == 2, found
    wait_for(two_replicas.complete, 60, "a completion after the replacement")


@two_gpus
def test_two_replicas_stop_leaves_no_process_on_any_gpu(two_replicas):
    assert_stop_leaves_no_gpu_process(two_replicas)


# ------------------------------------------------------------------------- num_gpus 0.5: sharing asked for


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    resources = {"num_replicas": 2, "num_gpus": 0.5}
    with deployed(tmp_path_factory.mktemp("share"), ENGINE, resources) as d:
        yield d


def test_half_gpu_replicas_share_one_gpu_when_asked(shared):
    assert shared.complete()
    found = checks.placement(shared.status(), devices_per_replica=1, whole_gpus=False)
    assert found["problems"] == [], found
    gpus = [tuple(r["status_gpus"]) for r in found["replicas"]]
    # Each holds one GPU (Ray's fraction of it); whether Ray packs both onto one GPU is Ray's choice.
    assert len(gpus) == 2 and all(len(g) == 1 for g in gpus), found
    print(f"num_gpus 0.5 x 2 replicas: GPUs {gpus} ({'shared' if len(set(gpus)) == 1 else 'one each'})")
    assert_env_everywhere()
    assert_stop_leaves_no_gpu_process(shared)
