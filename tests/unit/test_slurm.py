"""`runner.hostfile: slurm`: the allocation's environment -> hosts, slots, chip types and CPUs (no Slurm needed: the
variables are what sbatch/salloc set); a dryrun through the real CLI inside a made-up allocation."""

from __future__ import annotations

import pytest

from flagscale.cluster.slurm import allocation_hostfile, expand_counts, expand_hostlist, gpus_per_node
from flagscale.errors import ConfigError
from tests.conftest import demo_engine_args, run_cli, write_config


@pytest.mark.parametrize(
    "hostlist, hosts",
    [
        ("node1", ["node1"]),
        ("gpu[01-03,07],login1", ["gpu01", "gpu02", "gpu03", "gpu07", "login1"]),
        ("a[8-10]", ["a8", "a9", "a10"]),
        ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
        ("x[1,3]-ib", ["x1-ib", "x3-ib"]),
        (" c1 , c2 ", ["c1", "c2"]),
    ],
)
def test_hostlists_expand_as_slurm_writes_them(hostlist, hosts):
    assert expand_hostlist(hostlist) == hosts


@pytest.mark.parametrize(
    "hostlist, message",
    [
        ("n[1-3", "unbalanced '['"),
        ("n1]", "unbalanced ']'"),
        ("n[3-1]", "runs backwards"),
        ("n[a-b]", "bad range"),
        ("", "no host"),
    ],
)
def test_bad_hostlists_name_the_variable(hostlist, message):
    with pytest.raises(ConfigError) as info:
        expand_hostlist(hostlist)
    assert "SLURM_JOB_NODELIST" in str(info.value) and message in str(info.value)


def test_cpu_counts_repeat_and_must_match_the_nodes():
    assert expand_counts("72(x2),36", 3, "SLURM_JOB_CPUS_PER_NODE") == [72, 72, 36]
    with pytest.raises(ConfigError, match="gives 2 node"):
        expand_counts("8(x2)", 3, "SLURM_JOB_CPUS_PER_NODE")
    with pytest.raises(ConfigError, match="72x2"):
        expand_counts("72x2", 2, "SLURM_JOB_CPUS_PER_NODE")


@pytest.mark.parametrize(
    "env, expected",
    [
        ({"SLURM_GPUS_PER_NODE": "4"}, (4, None)),
        ({"SLURM_GPUS_PER_NODE": "a100:8"}, (8, "a100")),
        ({"SLURM_GPUS_PER_NODE": "gpu:h100:8"}, (8, "h100")),
        ({"SLURM_GPUS_PER_NODE": "gpu:2"}, (2, None)),
        ({"SLURM_GPUS_ON_NODE": "2"}, (2, None)),
        ({"SLURM_JOB_GPUS": "0,1,2"}, (3, None)),
        ({}, (0, None)),
    ],
)
def test_gpus_per_node(env, expected):
    assert gpus_per_node(env) == expected


def test_a_gpu_allocation_gives_gpu_hosts_and_the_job_cpus():
    env = {
        "SLURM_JOB_ID": "77",
        "SLURM_JOB_NODELIST": "g[1-2]",
        "SLURM_JOB_CPUS_PER_NODE": "32,16",
        "SLURM_GPUS_PER_NODE": "h100:8",
    }
    hostfile = allocation_hostfile(env, None, "serve.yaml: experiment.runner.head")
    assert [(h.host, h.slots, h.chip, h.is_gpu) for h in hostfile.hosts] == [
        ("g1", 8, "h100", True),
        ("g2", 8, "h100", True),
    ]
    assert hostfile.head.host == "g1" and hostfile.num_cpus == 16 and "slurm job 77" in hostfile.path
    assert allocation_hostfile(env, "g2", "x").head.host == "g2"
    # A GRES type naming another GPU family's chip types the hosts so (AMD's); one naming none stays untyped.
    amd = allocation_hostfile({**env, "SLURM_GPUS_PER_NODE": "mi300x:8"}, None, "x")
    assert {(h.chip, h.family.name, h.is_gpu) for h in amd.hosts} == {("mi300x", "amd", True)}
    other = allocation_hostfile({**env, "SLURM_GPUS_PER_NODE": "tesla9:8"}, None, "x")
    assert {(h.chip, h.is_gpu) for h in other.hosts} == {(None, True)}


def test_a_cpu_allocation_gives_cpu_hosts_with_a_slot_per_cpu():
    env = {"SLURM_JOB_NODELIST": "c[1-2]", "SLURM_JOB_CPUS_PER_NODE": "4(x2)"}
    hostfile = allocation_hostfile(env, None, "x")
    assert [(h.host, h.slots, h.chip) for h in hostfile.hosts] == [("c1", 4, "cpu"), ("c2", 4, "cpu")]


@pytest.mark.parametrize(
    "env, head, culprit, message",
    [
        ({}, None, "experiment.runner.hostfile", "SLURM_JOB_NODELIST is not set"),
        (
            {"SLURM_JOB_NODELIST": "c1,c1", "SLURM_JOB_CPUS_PER_NODE": "1(x2)"},
            None,
            "SLURM_JOB_NODELIST",
            "more than once",
        ),
        ({"SLURM_JOB_NODELIST": "c1"}, None, "SLURM_JOB_NODELIST", "neither GPUs"),
        (
            {"SLURM_JOB_NODELIST": "c1", "SLURM_JOB_CPUS_PER_NODE": "2"},
            "c9",
            "serve.yaml: experiment.runner.head",
            "not a node",
        ),
        ({"SLURM_JOB_NODELIST": "c1", "SLURM_GPUS_PER_NODE": "a:b:c:4"}, None, "SLURM_GPUS_PER_NODE", "a:b:c:4"),
    ],
)
def test_allocation_mistakes_name_the_variable(env, head, culprit, message):
    with pytest.raises(ConfigError) as info:
        allocation_hostfile(env, head, "serve.yaml: experiment.runner.head")
    assert str(info.value).startswith(culprit) or culprit in str(info.value)
    assert message in str(info.value)


def test_dryrun_inside_an_allocation_plans_its_nodes(tmp_path, monkeypatch):
    nodes = [{"serve_id": "m", "engine": "vllm", "engine_args": demo_engine_args(), "resources": {"num_replicas": 3}}]
    runner = {"hostfile": "slurm", "deploy": {"host": "0.0.0.0", "port": 18990}}
    conf = write_config(tmp_path / "conf", nodes, tmp_path / "exp", 18990, experiment={"runner": runner})
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "cn[07-08]")
    monkeypatch.setenv("SLURM_JOB_CPUS_PER_NODE", "2(x2)")
    result = run_cli(conf, "action=dryrun", timeout=300)
    assert result.returncode == 0, result.output
    assert "slurm job 4242: cn[07-08]" in result.stdout and "cn07" in result.stdout and "cn08" in result.stdout
    assert "offers cn07: 2 + cn08: 2 = 4 cpu device(s) of type=cpu" in result.stdout
    monkeypatch.setenv("SLURM_JOB_CPUS_PER_NODE", "1(x2)")  # 3 one-core replicas do not fit in 2 CPUs
    result = run_cli(conf, "action=dryrun", timeout=300)
    assert result.returncode != 0 and "experiment.runner.hostfile" in result.output, result.output
