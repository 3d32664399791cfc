"""Hostfile parsing, planning against a hostfile, and the argv that crosses SSH."""

from __future__ import annotations

import shlex

import pytest

from flagscale.cluster.hostfile import HEAD_RESOURCE, parse_hostfile
from flagscale.cluster.placement import Target, check_fits, reserve
from flagscale.cluster.ray_node import ray_start_argv, with_before_start
from flagscale.cluster.runner import session_argv
from flagscale.cluster.ssh import remote_command
from flagscale.config.replicas import replica_settings
from flagscale.config.schema import NodeConfig
from flagscale.errors import ConfigError
from flagscale.launchers.ssh import host_node
from flagscale.plan import EnginePlan


def hostfile(tmp_path, text):
    path = tmp_path / "hostfile"
    path.write_text(text)
    return path


def test_parses_hosts_comments_blank_lines_and_head(tmp_path):
    path = hostfile(tmp_path, "# cluster\n\n10.0.0.1 slots=8 type=gpu  # head\n  node-b slots=4 type=gpu\n")
    parsed = parse_hostfile(path)
    assert [(h.host, h.slots, h.chip, h.line) for h in parsed.hosts] == [
        ("10.0.0.1", 8, "gpu", 3),
        ("node-b", 4, "gpu", 4),
    ]
    assert parsed.head.host == "10.0.0.1" and [w.host for w in parsed.workers] == ["node-b"]
    assert parse_hostfile(path, head="node-b").head.host == "node-b"


@pytest.mark.parametrize(
    "text, line, message",
    [
        ("10.0.0.1 slots=2\n10.0.0.2 slots\n", 2, "unexpected 'slots'"),
        ("10.0.0.1\n", 1, "has no slots"),
        ("10.0.0.1 slots=0\n", 1, "slots must be a positive integer, got '0'"),
        ("10.0.0.1 slots=two\n", 1, "slots must be a positive integer, got 'two'"),
        ("10.0.0.1 slots=-1\n", 1, "positive integer"),
        ("a slots=1\n# x\na slots=2\n", 3, "duplicate host 'a' (also on line 1)"),
        ("a slots=1 type=gpu\nb slots=1\n", 2, "give every host a type or none"),
        ("a slots=1\nb slots=1 type=npu\n", 2, "give every host a type or none"),
        ("a slots=1 gpus=2\n", 1, "unexpected 'gpus=2'"),
        ("slots=1\n", 1, "expected `<host> slots=<N>"),
    ],
)
def test_bad_lines_name_file_and_line(tmp_path, text, line, message):
    path = hostfile(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        parse_hostfile(path)
    assert f"{path}:{line}:" in str(info.value)
    assert message in str(info.value)


def test_empty_and_missing_files(tmp_path):
    with pytest.raises(ConfigError, match="lists no host"):
        parse_hostfile(hostfile(tmp_path, "# only a comment\n\n"))
    with pytest.raises(ConfigError, match="does not exist"):
        parse_hostfile(tmp_path / "nope")
    with pytest.raises(ConfigError, match="head 'zzz' is not a host"):
        parse_hostfile(hostfile(tmp_path, "a slots=1\n"), head="zzz")


def test_resources_per_chip_type(tmp_path):
    parsed = parse_hostfile(hostfile(tmp_path, "a slots=8 type=gpu\nb slots=4 type=gpu\n"))
    assert parsed.hosts[0].ray_resources(True) == (8, {"accelerator_type:gpu": 1.0, HEAD_RESOURCE: 1.0})
    chips = parse_hostfile(hostfile(tmp_path, "a slots=16 type=cpu:chipA\n"))
    assert chips.hosts[0].ray_resources(False) == (None, {"cpu:chipA": 16.0, "accelerator_type:cpu:chipA": 1.0})


def engine(serve_id="m", tp=1, replicas=1, accelerator=None):
    node = NodeConfig(
        serve_id=serve_id,
        engine="vllm",
        engine_args={"model": "x", "tensor_parallel_size": tp},
        resources={"num_replicas": replicas, "accelerator": accelerator},
    )
    return node


def place_engine(node, hostfile, strategy, where):
    """The plan of one engine node placed on the hostfile's hosts (cluster.placement.reserve)."""
    tp = node.engine_args["tensor_parallel_size"]
    reservation = reserve(node.resources, (tp, 1, 1), Target.hosts_of(hostfile), strategy, where, where)
    scaling = replica_settings(node.resources, reservation.ray_actor_options, reservation.auto_replicas)
    plan = EnginePlan(
        serve_id=node.serve_id,
        model="x",
        model_names=[node.serve_id],
        argv=["--model", "x", *reservation.extra_argv],
        device=reservation.device,
        devices_per_replica=tp,
        parallel=(tp, 1, 1),
        chip=reservation.chip,
        placement_bundles=reservation.placement_bundles,
        placement_strategy=reservation.placement_strategy,
        ranks_per_host=reservation.ranks_per_host,
        **vars(scaling),
    )
    return plan, node


def test_engine_pinned_to_chip_reserves_its_slots(tmp_path):
    hf = parse_hostfile(hostfile(tmp_path, "a slots=2 type=cpu:chipA\nb slots=1 type=cpu:chipB\n"))
    plan, node = place_engine(engine(tp=2, accelerator="chipA"), hf, "PACK", "here")
    assert plan.ray_actor_options == {
        "num_cpus": 1,
        "resources": {"cpu:chipA": 2.0, "accelerator_type:cpu:chipA": 0.001},
    }
    assert plan.placement_bundles is None
    with pytest.raises(ConfigError, match="no host of that type"):
        place_engine(engine(accelerator="chipC"), hf, "PACK", "here")
    with pytest.raises(ConfigError, match="mixes chip types"):
        place_engine(engine(), hf, "PACK", "here")


def test_tp_larger_than_one_host_uses_a_placement_group(tmp_path):
    hf = parse_hostfile(hostfile(tmp_path, "a slots=2 type=gpu\nb slots=2 type=gpu\n"))
    plan, node = place_engine(engine(tp=4), hf, "SPREAD", "here")
    assert plan.placement_strategy == "SPREAD"
    # one bundle per host with its share of the ranks; the replica starts the other host's (replica/ranks.py)
    share = {"GPU": 2.0, "accelerator_type:gpu": 0.001}
    assert plan.placement_bundles == [{"CPU": 1.0, **share}, share] and plan.ranks_per_host == 2
    assert "--distributed-executor-backend" not in plan.argv
    assert check_fits([(plan, node)], hf, None, "here")["gpu"].endswith("a: 2 + b: 2 = 4 nvidia device(s) of type=gpu")


def test_graph_larger_than_hostfile_is_rejected_with_the_arithmetic(tmp_path):
    hf = parse_hostfile(hostfile(tmp_path, "a slots=2 type=gpu\nb slots=2 type=gpu\n"))
    first = place_engine(engine("m1", tp=2, replicas=2), hf, "PACK", "here")
    second = place_engine(engine("m2", tp=1, replicas=1), hf, "PACK", "here")
    with pytest.raises(ConfigError) as info:
        check_fits([first, second], hf, None, "here")
    assert (
        "m1: 2 replica(s) x 2 (TP 2 x PP 1 x DP 1) + m2: 1 replica(s) x 1 (TP 1 x PP 1 x DP 1) = 5 device(s); "
        f"{hf.path} offers a: 2 + b: 2 = 4 nvidia device(s) of type=gpu"
    ) in str(info.value)


def test_this_machine_is_a_one_host_target():
    node = engine(tp=2)
    cpu = reserve(node.resources, (2, 1, 1), Target.this_machine(gpus=0, cpus=4), "PACK", "res", "args")
    assert (cpu.device, cpu.ray_actor_options, cpu.auto_replicas) == ("cpu", {"num_cpus": 2}, 2)
    gpu = reserve(node.resources, (2, 1, 1), Target.this_machine(gpus=8, cpus=4), "PACK", "res", "args")
    assert (gpu.device, gpu.ray_actor_options, gpu.auto_replicas) == ("gpu", {"num_cpus": 1, "num_gpus": 2}, 4)
    with pytest.raises(
        ConfigError, match="args: TP x PP x DP = 2 x 1 x 1 = 2 CPU devices per replica, but this machine offers 1"
    ):
        reserve(node.resources, (2, 1, 1), Target.this_machine(gpus=0, cpus=1), "PACK", "res", "args")
    no_gpu = NodeConfig(serve_id="g", engine_args={"model": "x"}, resources={"num_gpus": 1})
    with pytest.raises(ConfigError, match="res: num_gpus=1 per replica, but this machine has no GPU"):
        reserve(no_gpu.resources, (1, 1, 1), Target.this_machine(gpus=0, cpus=4), "PACK", "res", "args")


def test_remote_command_quotes_every_word():
    command = remote_command(["echo", "a b", "$(rm -rf /)"], {"X": "1; reboot"})
    words = shlex.split(command)
    assert words[-3:] == ["echo", "a b", "$(rm -rf /)"] and "reboot" not in command  # env values go on stdin


def test_ray_start_argv_for_head_and_worker(tmp_path):
    hf = parse_hostfile(hostfile(tmp_path, "10.0.0.1 slots=1 type=cpu:chipA\n10.0.0.2 slots=2 type=cpu:chipB\n"))
    head = ray_start_argv(host_node(hf.head, hf.head, 6379, 4, "/tmp/fsr-x"))
    assert "--head" in head and head[head.index("--port") + 1] == "6379"
    assert HEAD_RESOURCE in head[head.index("--resources") + 1]
    worker = ray_start_argv(host_node(hf.hosts[1], hf.head, 6379, None, "/tmp/fsr-y"))
    assert worker[worker.index("--address") + 1] == "10.0.0.1:6379" and "--num-cpus" not in worker
    wrapped = session_argv(with_before_start(worker, "echo 'hi'"), "/tmp/fsr-y/ray-start.log")
    assert wrapped[:3] == ["setsid", "-w", "sh"] and wrapped[6] == "/tmp/fsr-y/ray-start.log"
    assert wrapped[7:10] == ["bash", "-c", "umask 077\nset -e\necho 'hi'\nexec \"$@\""]
