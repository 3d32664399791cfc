"""Expert parallelism (vLLM's data parallel + --enable-expert-parallel) planned without a GPU: the MoE fact read from
config.json, one replica = DP x TP GPUs on one host or whole DP ranks per host of a hostfile, each host's argv and
env (API server + local DP ranks on the first, --headless with --data-parallel-start-rank on the others), the DP/EP
index of every rank in status, dryrun's plan, and every refusal (CPU, engines without EP, a dense model, GPUs that
do not divide). tests/gpu/test_expert_parallel.py runs it on GPUs."""

from __future__ import annotations

import io
import json

import pytest
from rich.console import Console

import flagscale.facts
from flagscale.actions.dryrun import dryrun
from flagscale.actions.status_report import ReplicaRow
from flagscale.actions.status_table import _rank_table
from flagscale.config.load import ConfigSources, load_config
from flagscale.devices import Gpu
from flagscale.engines import vllm, vllm_args
from flagscale.engines.base import HostShare, ServerLaunch
from flagscale.engines.model_args import model_experts
from flagscale.errors import ConfigError
from flagscale.plan import build_plan
from flagscale.replica import ranks
from flagscale.replica.bundles import HostPart
from flagscale.replica.rank_layout import dp_split, preview, rank_indexes
from flagscale.replica.ranks import ReplicaRanks

SOURCES = ConfigSources(main="conf/serve.yaml", serve="conf/serve/ep.yaml")
KIND = vllm.KIND
WHERE = "conf/serve/ep.yaml: serve[0](moe).engine_args"


@pytest.fixture
def gpus(monkeypatch):
    def install(count: int):
        table = [Gpu(i, "NVIDIA H200", 143771) for i in range(count)]
        monkeypatch.setattr(flagscale.facts, "local_gpus", lambda: table)

    install(2)
    return install


def config(model, engine="vllm", resources=None, runner=None, **engine_args):
    return {
        "experiment": {
            "exp_name": "ep",
            "exp_dir": "/tmp/ep-unit",
            "runner": {"deploy": {"port": 8123}, **(runner or {})},
        },
        "serve": [
            {
                "serve_id": "moe",
                "engine": engine,
                "resources": resources or {},
                "engine_args": {"model": str(model), "max_model_len": 256, **engine_args},
            }
        ],
    }


def plan(*args, **kwargs):
    return build_plan(load_config(config(*args, **kwargs), SOURCES), SOURCES, check_port=False)


def refused(*args, **kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        plan(*args, **kwargs)
    return str(info.value)


def two_hosts(tmp_path, slots: int = 4) -> dict:
    hostfile = tmp_path / "hosts"
    hostfile.write_text(f"127.0.0.2 slots={slots} type=gpu\n127.0.0.3 slots={slots} type=gpu\n")
    return {"hostfile": str(hostfile)}


# ------------------------------------------------------------------------------------------- the MoE fact


def test_the_expert_count_comes_from_config_json_as_vllm_reads_it(tmp_path, moe_model_path, demo_model_path):
    assert model_experts(str(moe_model_path)) == 4
    assert model_experts(str(demo_model_path)) == 0  # a dense Llama
    for name, body in {
        "deepseek": {"n_routed_experts": 256, "num_experts_per_tok": 8},
        "qwen-moe": {"num_experts": 128},
        "vl": {"text_config": {"num_experts": 64}},  # multimodal: the language model's config
        "dbrx": {"ffn_config": {"moe_num_experts": 16}},
    }.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(body))
        assert model_experts(str(tmp_path / name)) > 1, name
    assert model_experts(str(tmp_path / "missing")) is None
    assert model_experts("org/not-cached-here") is None  # a hub id this machine has no config.json of
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    assert model_experts(str(tmp_path / "m.gguf")) is None


# --------------------------------------------------------------------------------------- one host: DP x TP


def test_dp2_with_ep_on_one_host_reserves_dp_x_tp_gpus(gpus, moe_model_path):
    (engine,) = plan(moe_model_path, data_parallel_size=2, enable_expert_parallel=True).engines
    assert engine.expert_parallel and engine.parallel == (1, 1, 2) and engine.devices_per_replica == 2
    assert engine.ray_actor_options["num_gpus"] == 2 and engine.placement_bundles is None
    assert "--enable-expert-parallel" in engine.argv
    assert engine.argv[engine.argv.index("--data-parallel-size") + 1] == "2"
    gpus(4)
    (tp2,) = plan(moe_model_path, data_parallel_size=2, tensor_parallel_size=2, enable_expert_parallel=True).engines
    assert tp2.devices_per_replica == 4 and tp2.ray_actor_options["num_gpus"] == 4
    (dense_dp,) = plan(moe_model_path, data_parallel_size=2).engines  # DP without EP stays as it was
    assert not dense_dp.expert_parallel


def test_flagscale_spelling_in_engine_args_specific_asks_for_ep_too(gpus, moe_model_path):
    cfg = config(moe_model_path, data_parallel_size=2)
    cfg["serve"][0]["engine_args_specific"] = {"vllm": {"enable_expert_parallel": True}}
    (engine,) = build_plan(load_config(cfg, SOURCES), SOURCES, check_port=False).engines
    assert engine.expert_parallel and "--enable-expert-parallel" in engine.argv


def test_one_host_ranks_run_under_the_api_server_with_the_gpus_ray_granted():
    share = HostShare("10.0.0.1", 0, 1, (0, 1), gpus=("2", "3"))
    launch = KIND.bind_ranks(ServerLaunch(["python", "-m", "x", "--data-parallel-size", "2"]), share)
    assert launch.env == {"CUDA_VISIBLE_DEVICES": "2,3"}
    assert "--data-parallel-size-local" not in launch.argv and "--nnodes" not in launch.argv
    assert dp_split((1, 1, 2), 1, 0) == (0, 0)


# ------------------------------------------------------------------------------ over hosts: whole DP ranks


def test_dp4_tp2_over_two_4_gpu_hosts_is_two_dp_ranks_per_host(gpus, tmp_path, moe_model_path):
    args = {"data_parallel_size": 4, "tensor_parallel_size": 2, "enable_expert_parallel": True}
    (engine,) = plan(moe_model_path, runner=two_hosts(tmp_path), **args).engines
    assert engine.ranks_per_host == 4 and len(engine.placement_bundles) == 2
    assert engine.ray_actor_options["num_gpus"] == 4
    planned = preview(engine.parallel, True, engine.ranks_per_host, [("h0", 4), ("h1", 4)], 1)
    assert [(p.host, p.share.ranks, p.share.gpus, p.share.dp_local, p.share.dp_start) for p in planned] == [
        ("h0", (0, 1, 2, 3), ("0", "1", "2", "3"), 2, 0),
        ("h1", (4, 5, 6, 7), ("0", "1", "2", "3"), 2, 2),
    ]
    assert all(p.share.master == ("h0", 0) for p in planned)


def test_each_hosts_argv_is_vllms_multi_node_data_parallel():
    master = ("10.0.0.1", 13345)
    first = HostShare("10.0.0.1", 0, 2, (0, 1, 2, 3), gpus=("0", "1", "2", "3"), master=master, interface="ib0")
    first = HostShare(**{**vars(first), "dp_local": 2, "dp_start": 0})
    second = HostShare("10.0.0.2", 1, 2, (4, 5, 6, 7), gpus=("4", "5", "6", "7"), master=master, interface="ens5")
    second = HostShare(**{**vars(second), "dp_local": 2, "dp_start": 2})
    argv = ["--model", "m", "--data-parallel-size", "4", "--tensor-parallel-size", "2", "--enable-expert-parallel"]
    server = KIND.bind_ranks(KIND.launch(argv, "10.0.0.1", 8001, None, None), first)
    at = server.argv.index("--data-parallel-size-local")
    tail = ["2", "--data-parallel-address", "10.0.0.1", "--data-parallel-rpc-port", "13345"]
    assert server.argv[at + 1 : at + 6] == tail
    assert "--data-parallel-start-rank" not in server.argv  # on the API server's host it would mean hybrid LB
    assert "--nnodes" not in server.argv and "--headless" not in server.argv
    assert server.argv[2] == "vllm.entrypoints.openai.api_server"
    assert server.env == {
        "CUDA_VISIBLE_DEVICES": "0,1,2,3",
        "VLLM_HOST_IP": "10.0.0.1",
        "GLOO_SOCKET_IFNAME": "ib0",
        "NCCL_SOCKET_IFNAME": "ib0",
    }
    headless = KIND.headless_launch(argv, second)
    assert headless.argv[1:3] == ["-m", "flagscale.engines.vllm_headless"] and headless.argv[-1] == "--headless"
    assert "--port" not in headless.argv and "--nnodes" not in headless.argv
    assert headless.env["CUDA_VISIBLE_DEVICES"] == "4,5,6,7" and headless.env["VLLM_HOST_IP"] == "10.0.0.2"
    # the installed vLLM's own `vllm serve` parser reads every flag as meant
    parsed = vllm_args.parsed(headless.argv[3:])
    assert (parsed.data_parallel_size, parsed.data_parallel_size_local, parsed.data_parallel_start_rank) == (4, 2, 2)
    assert (parsed.data_parallel_address, parsed.data_parallel_rpc_port) == ("10.0.0.1", 13345)
    assert parsed.headless and parsed.enable_expert_parallel and parsed.tensor_parallel_size == 2
    parsed = vllm_args.parsed(server.argv[3:])
    assert parsed.data_parallel_size_local == 2 and parsed.data_parallel_start_rank is None and not parsed.headless


class FakeActor:
    """RemoteRanks as ranks.py reaches it through Ray: options(...).remote(...) -> a handle whose start answers."""

    made: list = []

    @classmethod
    def options(cls, **options):
        return cls

    @classmethod
    def remote(cls, engine, argv, share, cores_per_rank, log, env):
        handle = type("Handle", (), {})()
        handle.start = type("Call", (), {"remote": staticmethod(lambda: share)})
        cls.made.append((share, argv, env))
        return handle


class FakeRay:
    class util:
        @staticmethod
        def get_current_placement_group():
            return "group"

    @staticmethod
    def remote(cls):
        return FakeActor

    @staticmethod
    def get(value, timeout=None):
        return value


def test_the_replica_gives_each_host_its_dp_ranks_and_the_master_port(monkeypatch, tmp_path):
    parts = [HostPart(0, "10.0.0.1", {"GPU": 4.0}), HostPart(1, "10.0.0.2", {"GPU": 4.0})]
    monkeypatch.setattr(ranks, "placement_hosts", lambda: parts)
    monkeypatch.setattr(ranks, "ray", FakeRay)
    monkeypatch.setattr(ranks.ray_scheduling, "PlacementGroupSchedulingStrategy", lambda *a, **k: None, raising=False)
    monkeypatch.setattr(ranks, "interface_of", lambda ip: "eth0")
    FakeActor.made = []
    replica = ReplicaRanks("vllm", (2, 1, 4), "10.0.0.1", 1.0, expert_parallel=True)
    env = {"NCCL_NVLS_ENABLE": "0"}
    local = replica.start(["--model", "m"], ["0", "1", "2", "3"], lambda: 13345, tmp_path / "e.log", env, print)
    assert (local.ranks, local.dp_local, local.dp_start, local.master) == ((0, 1, 2, 3), 2, 0, ("10.0.0.1", 13345))
    ((remote, argv, remote_env),) = FakeActor.made
    assert (remote.host, remote.node_rank, remote.ranks) == ("10.0.0.2", 1, (4, 5, 6, 7))
    assert (remote.dp_local, remote.dp_start, remote.master) == (2, 2, ("10.0.0.1", 13345))
    assert remote_env == env  # the node's envs (NVLink multicast off) reach the other host's ranks too


# --------------------------------------------------------------------------------------------- status


def test_every_rank_record_names_its_dp_and_ep_index(monkeypatch):
    assert rank_indexes(5, (2, 1, 4), True) == {"dp": 2, "ep": 5}
    assert rank_indexes(3, (2, 2, 2), True) == {"dp": 0, "ep": 1}  # PP stage 1, TP 1: EP within the stage
    assert rank_indexes(3, (1, 1, 4), False) == {"dp": 3}
    monkeypatch.setattr(ranks, "worker_pids", lambda *args: {0: 100, 1: 101})
    replica = ReplicaRanks("vllm", (1, 1, 2), "10.0.0.1", 1.0, expert_parallel=True)
    replica.local = HostShare("10.0.0.1", 0, 1, (0, 1), gpus=("0", "1"))
    records = replica.records(server_pid=1)
    assert [(r["rank"], r["dp"], r["ep"], r["gpus"], r["pid"]) for r in records] == [
        (0, 0, 0, ["0"], 100),
        (1, 1, 1, ["1"], 101),
    ]
    row = ReplicaRow("moe", "r1", "vllm", "colocated", "10.0.0.1", "n", 1, 2, "http://10.0.0.1:1", 0.0, "READY")
    out = io.StringIO()
    Console(file=out, width=200).print(_rank_table([(row, r) for r in records]))
    header, *rows = [line.split() for line in out.getvalue().splitlines()[1:] if line.strip() and "─" not in line]
    assert header[:5] == ["node", "replica", "rank", "dp", "ep"]
    assert [row[:7] for row in rows] == [
        ["moe", "r1", "0", "0", "0", "100", "10.0.0.1"],
        ["moe", "r1", "1", "1", "1", "101", "10.0.0.1"],
    ]


# ----------------------------------------------------------------------------------------------- dryrun


def test_dryrun_shows_each_hosts_ranks_dp_ep_and_command(gpus, tmp_path, moe_model_path):
    cfg = config(
        moe_model_path,
        runner=two_hosts(tmp_path),
        data_parallel_size=4,
        tensor_parallel_size=2,
        enable_expert_parallel=True,
    )
    loaded = load_config(cfg, SOURCES)
    out = io.StringIO()
    dryrun(loaded, build_plan(loaded, SOURCES, check_port=False), Console(file=out, width=400))
    text = out.getvalue()
    assert "TP 2 x PP 1 x DP 4 = 8 per replica, expert parallel: EP = DP x TP = 8" in text, text
    assert "vLLM's multi-node data parallel, 2 DP rank(s) per host" in text
    assert "node rank 0  127.0.0.2: API server + ranks 0-3 (DP 0-1, EP 0-3), GPUs 0-3" in text
    assert "node rank 1  127.0.0.3: headless ranks 4-7 (DP 2-3, EP 4-7), GPUs 0-3" in text
    assert "--data-parallel-start-rank 2" in text and "--data-parallel-rpc-port '<free port>'" in text


# --------------------------------------------------------------------------------------------- refusals


def test_ep_on_cpu_is_refused_naming_the_measured_failure(gpus, moe_model_path):
    gpus(0)
    message = refused(moe_model_path, data_parallel_size=2, enable_expert_parallel=True)
    assert message.startswith(f"{WHERE}.enable_expert_parallel")
    assert "all_gatherv raises NotImplementedError" in message and "GPUs only" in message
    gpus(2)
    message = refused(moe_model_path, resources={"num_gpus": 0}, data_parallel_size=2, enable_expert_parallel=True)
    assert "enable_expert_parallel on CPU" in message  # a GPU machine, but the replica asks for no GPU


def test_ep_on_engines_without_it_is_refused(gpus, tmp_path):
    from flagscale.engines import llama_cpp, sglang

    for kind in (llama_cpp.KIND, sglang.KIND):
        assert not kind.capabilities.expert_parallel
        with pytest.raises(ConfigError) as info:
            kind.expert_parallel({"enable_expert_parallel": True}, (1, 1, 1), False, 8, WHERE)
        assert str(info.value).startswith(f"{WHERE}.enable_expert_parallel")
        assert f"{kind.display} has no expert parallelism here" in str(info.value) and "engine: vllm" in str(info.value)
        assert kind.expert_parallel({"enable_expert_parallel": False}, (1, 1, 1), False, 8, WHERE) is False
    # planned: llama.cpp's refusal comes before its own argv would turn the key down
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + bytes(60))
    message = refused(gguf, engine="llama_cpp", enable_expert_parallel=True)
    assert "llama.cpp has no expert parallelism here" in message, message


def test_ep_on_a_dense_model_is_refused(gpus, demo_model_path):
    message = refused(demo_model_path, data_parallel_size=2, enable_expert_parallel=True)
    assert message.startswith(f"{WHERE}.enable_expert_parallel")
    assert "is not a mixture of experts" in message and "num_local_experts" in message


def test_gpus_that_do_not_divide_are_refused(gpus, tmp_path, moe_model_path):
    ep = {"enable_expert_parallel": True}
    assert "TP x PP x DP = 1 x 1 x 4 = 4 GPU devices per replica, but this machine offers 2" in refused(
        moe_model_path, data_parallel_size=4, **ep
    )
    message = refused(moe_model_path, resources={"num_gpus": 1}, data_parallel_size=2, **ep)
    assert "resources.num_gpus" in message and "DP x TP x PP = 2 x 1 x 1 ranks, 2 per host" in message
    hosts = two_hosts(tmp_path, slots=4)
    message = refused(moe_model_path, runner=hosts, data_parallel_size=3, tensor_parallel_size=2, **ep)
    assert "data_parallel_size=3 (TP x PP = 2 each) does not split over the hosts (slots 4, 4)" in message
    message = refused(moe_model_path, runner=hosts, data_parallel_size=2, tensor_parallel_size=8, **ep)
    assert "TP x PP = 8 x 1 = 8 GPUs per data-parallel rank, but the largest host has 4 slots" in message
    message = refused(moe_model_path, runner=hosts, data_parallel_size=4, tensor_parallel_size=2)
    assert "data_parallel_size=4 with TP x PP = 2 over several hosts" in message  # without EP: replicas


def test_vllms_own_dp_placement_flags_are_the_replicas(gpus, moe_model_path):
    message = refused(moe_model_path, data_parallel_size=2, data_parallel_address="10.0.0.1")
    assert message.startswith(f"{WHERE}.data_parallel_address") and "give data_parallel_size only" in message
