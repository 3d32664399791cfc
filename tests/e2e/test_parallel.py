"""Parallel engines end to end on this machine (docs/parallelism.md): one TP=2 vLLM (CPU) replica through the
orchestrator, from the config alone, and the plans and refusals of big and impossible splits (dryrun, nothing
started). One deployment, shared in order: both ranks run on cores of their own -> status lists them -> greedy
answers -> stop leaves no rank -> plain vLLM TP=2 with the same binding answers the same.
(TP=2 over two hosts: tests/e2e/test_multihost.py::test_one_engine_over_two_hosts.)"""

from __future__ import annotations

import json
import os
import shutil

import openai
import psutil
import pytest

from flagscale.replica.cpu_layout import affinity, process_tree
from tests.conftest import REPO, STATUS_WAIT_S, demo_engine_args, run_cli, status_cli, wait_for, write_config
from tests.e2e.plain_vllm import answers, plain_answers

PORT = 19211
CONFIGS = REPO.parent / "shared" / "flagscale-configs"
two_cores = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="TP=2 on CPU needs 2 cores")


def workers_of(pid: int) -> dict[str, int]:
    """vLLM worker process title -> pid, under the engine process `pid`."""
    found = {}
    for child in process_tree(pid):
        try:
            title = " ".join(psutil.Process(child).cmdline()).strip()
        except psutil.Error:
            continue
        if title.startswith("VLLM::Worker_TP"):
            found[title] = child
    return found


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp2")
    nodes = [
        {
            "serve_id": "tp2",
            "engine": "vllm",
            "engine_args": demo_engine_args(served_model_name="tp2", tensor_parallel_size=2),
        }
    ]
    conf = write_config(root / "conf", nodes, root / "exp", PORT)
    run = run_cli(conf, timeout=900)
    yield {"conf": conf, "exp_dir": root / "exp", "run": run, "root": root}
    if (root / "exp" / "state.json").exists():
        run_cli(conf, "action=stop", timeout=300)


def alive(pid: int) -> bool:
    """Running, not a zombie waiting for its parent to reap it."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@two_cores
def test_tp2_replica_runs_its_ranks_on_cores_of_their_own(deployment, demo_model_path):
    assert deployment["run"].returncode == 0, deployment["run"].output
    conf = deployment["conf"]

    def ranks_listed():
        result = status_cli(conf, "output=json")
        report = json.loads(result.stdout[result.stdout.index("{") :])
        (replica,) = report["replicas"]
        assert [(r["rank"], r["host"], r["cpus"]) for r in replica["ranks"]] == [
            (0, "127.0.0.1", [0]),
            (1, "127.0.0.1", [1]),
        ], replica["ranks"]
        # the ranks' titles are set by the ranks themselves once they run: a rank just started is still "python"
        workers = workers_of(replica["engine_pid"])
        assert sorted(workers) == ["VLLM::Worker_TP0", "VLLM::Worker_TP1"], workers
        return replica, workers

    replica, workers = wait_for(ranks_listed, STATUS_WAIT_S, "status output=json to list the replica's two ranks")
    assert {r["pid"] for r in replica["ranks"]} == set(workers.values())
    assert affinity(workers["VLLM::Worker_TP0"]) == {0} and affinity(workers["VLLM::Worker_TP1"]) == {1}

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{PORT}/v1", api_key="none", timeout=120, max_retries=0)
    served = answers(client, "tp2")

    stop = run_cli(conf, "action=stop", timeout=300)
    assert stop.returncode == 0, stop.output
    wait_for(lambda: not any(alive(p) for p in workers.values()), 60, "no rank process left")
    reference = plain_answers(demo_model_path, 2, "0|1", deployment["root"] / "plain.log")
    assert served == reference


@pytest.fixture(scope="module")
def dryrun_dir(tmp_path_factory, demo_model_path):
    root = tmp_path_factory.mktemp("parallel-dryrun")
    (root / "gpu-hosts-2x8").write_text("127.0.0.2 slots=8 type=gpu\n127.0.0.3 slots=8 type=gpu\n")
    (root / "gpu-hosts-4x8").write_text("".join(f"127.0.0.{i} slots=8 type=gpu\n" for i in range(2, 6)))
    (root / "cpu-hosts-2x2").write_text("127.0.0.2 slots=2 type=cpu:chipA\n127.0.0.3 slots=2 type=cpu:chipA\n")
    return root


def dryrun(root, name, engine_args, runner=None, resources=None):
    node = {"serve_id": name, "engine": "vllm", "engine_args": demo_engine_args(served_model_name=name, **engine_args)}
    if resources:
        node["resources"] = resources
    experiment = {"runner": {"deploy": {"host": "127.0.0.1", "port": PORT}, **(runner or {})}}
    conf = write_config(root / f"conf-{name}", [node], root / f"exp-{name}", PORT, experiment=experiment)
    result = run_cli(conf, "action=dryrun", timeout=300)
    return result, " ".join(result.output.split())


@pytest.mark.skipif(not CONFIGS.is_dir(), reason=f"{CONFIGS} is not here")
def test_dryrun_of_kimi_k2_shows_ranks_per_host_and_each_hosts_command(tmp_path, dryrun_dir, demo_model_path):
    shutil.copytree(CONFIGS / "kimi_k2-1t-multinode", tmp_path / "kimi")
    result = run_cli(
        tmp_path / "kimi",
        "action=dryrun",
        f"experiment.exp_dir={tmp_path / 'out'}",
        f"serve.0.engine_args.model={demo_model_path}",
        f"experiment.runner.hostfile={dryrun_dir / 'gpu-hosts-2x8'}",
        timeout=300,
    )
    assert result.returncode == 0, result.output
    out = " ".join(result.stdout.split())
    assert "TP 16 x PP 1 x DP 1 = 16 per replica, 8 per host over 2 host(s)" in out
    assert "node rank 0 127.0.0.2: API server + ranks 0-7, GPUs 0-7" in out
    assert "node rank 1 127.0.0.3: headless ranks 8-15, GPUs 0-7" in out
    assert "--nnodes 2 --node-rank 1 --master-addr 127.0.0.2" in out and "vllm_headless" in out


def test_dryrun_of_a_deepseek_shaped_tp8_pp4_over_four_hosts(dryrun_dir):
    runner = {"hostfile": str(dryrun_dir / "gpu-hosts-4x8")}
    result, out = dryrun(dryrun_dir, "ds", {"tensor_parallel_size": 8, "pipeline_parallel_size": 4}, runner)
    assert result.returncode == 0, result.output
    assert "TP 8 x PP 4 x DP 1 = 32 per replica, 8 per host over 4 host(s)" in out
    for node_rank in range(4):
        first = 8 * node_rank
        assert f"node rank {node_rank} 127.0.0.{node_rank + 2}:" in out and f"ranks {first}-{first + 7}" in out
    assert "--pipeline-parallel-size 4" in out and "--nnodes 4 --node-rank 3" in out


def test_splits_that_cannot_run_are_refused_before_start_naming_the_key(dryrun_dir):
    result, out = dryrun(dryrun_dir, "pp", {"pipeline_parallel_size": 2})
    assert result.returncode != 0 and "engine_args.pipeline_parallel_size" in out, out
    assert "dies on the first request" in out

    gpu_hosts = {"hostfile": str(dryrun_dir / "gpu-hosts-2x8")}
    result, out = dryrun(dryrun_dir, "odd", {"tensor_parallel_size": 9}, gpu_hosts)
    assert result.returncode != 0 and "serve[0](odd).engine_args" in out, out
    assert "TP x PP = 9 x 1 = 9 ranks do not split over the hosts (slots 8, 8): no host count from 2 to 2" in out

    result, out = dryrun(
        dryrun_dir, "big", {"tensor_parallel_size": 12}, {"hostfile": str(dryrun_dir / "cpu-hosts-2x2")}
    )
    assert result.returncode != 0 and "serve[0](big).engine_args" in out and "2 hosts need 6 slots each" in out, out

    cores = len(os.sched_getaffinity(0))
    result, out = dryrun(dryrun_dir, "wide", {"tensor_parallel_size": cores + 2})
    assert result.returncode != 0 and f"= {cores + 2} CPU devices per replica, but this machine offers" in out, out

    cpu_hosts = {"hostfile": str(dryrun_dir / "cpu-hosts-2x2"), "num_cpus": 1}
    result, out = dryrun(dryrun_dir, "cores", {"tensor_parallel_size": 2}, cpu_hosts, {"accelerator": "chipA"})
    assert result.returncode != 0 and "'cores' runs 2 CPU ranks per host (one core each)" in out, out
    assert "num_cpus=1" in out
