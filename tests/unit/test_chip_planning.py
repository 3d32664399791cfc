"""Planning per device family (docs/chips.md): a hostfile's type= names each host's family; a node's replicas reserve
devices of their family (NPU for Ascend, GPU for NVIDIA/AMD/MetaX, a core-counted slot for CPUs), get the family's
plugin env, and are refused before start when their family lacks the devices, runs no such engine, or, across
families, shares no KV connector with the other pool."""

from __future__ import annotations

import pytest

from flagscale.config.load import ConfigSources, load_config
from flagscale.errors import ConfigError
from flagscale.plan import build_plan

SOURCES = ConfigSources(main="conf/serve.yaml", serve="conf/serve/nodes.yaml")


def config(model, hostfile, nodes, envs=None) -> dict:
    return {
        "experiment": {
            "exp_name": "t",
            "exp_dir": "/tmp/t-chips",
            "runner": {"hostfile": str(hostfile), "num_cpus": 4, "deploy": {"port": 8123}},
            "envs": envs or {},
        },
        "serve": [
            {
                "serve_id": serve_id,
                "engine": "vllm",
                "engine_args": {"model": str(model), "max_model_len": 256},
                **extra,
            }
            for serve_id, extra in nodes
        ],
        "action": "run",
    }


def plan(cfg):
    return build_plan(load_config(cfg, SOURCES), SOURCES, check_port=False)


def error(cfg) -> str:
    with pytest.raises(ConfigError) as info:
        plan(cfg)
    return str(info.value)


@pytest.fixture
def hostfile(tmp_path):
    path = tmp_path / "hostfile"
    path.write_text("127.0.0.2 slots=4 type=cpu\n127.0.0.3 slots=2 type=ascend\n127.0.0.4 slots=2 type=910B\n")
    return path


def test_ascend_replicas_reserve_npus_and_get_the_plugin(demo_model_path, hostfile):
    nodes = [
        ("npu", {"resources": {"num_replicas": 2, "accelerator": "ascend"}}),
        ("c", {"resources": {"accelerator": "cpu"}}),
    ]
    built = plan(config(demo_model_path, hostfile, nodes))
    npu, cpu = built.engines
    assert npu.family == "ascend" and npu.ray_actor_options["resources"] == {"NPU": 1.0}
    assert npu.family_env == {"VLLM_PLUGINS": "ascend"}
    assert cpu.family == "cpu" and cpu.ray_actor_options["resources"] == {"cpu": 1.0, "accelerator_type:cpu": 0.001}
    assert cpu.family_env == {}
    # by model of chip: only the 910B host
    one = plan(config(demo_model_path, hostfile, [("npu", {"resources": {"accelerator": "910B"}})]))
    assert one.engines[0].ray_actor_options["resources"] == {"NPU": 1.0, "accelerator_type:910B": 0.001}


def test_envs_per_chip_type_and_the_users_plugin_wins(demo_model_path, hostfile):
    envs = {"A": "1", "device_type_specific": {"ascend": {"VLLM_PLUGINS": "fl"}, "910B": {"B": "2"}}}
    built = plan(config(demo_model_path, hostfile, [("npu", {"resources": {"accelerator": "ascend"}})], envs))
    assert built.engines[0].family_env == {}  # vllm-plugin-FL, chosen for the family in experiment.envs
    host_envs = built.cluster.host_envs
    assert host_envs["127.0.0.2"] == {"A": "1"}
    assert host_envs["127.0.0.3"] == {"A": "1", "VLLM_PLUGINS": "fl"}
    assert host_envs["127.0.0.4"] == {"A": "1", "VLLM_PLUGINS": "fl", "B": "2"}


def test_nvidia_hosts_of_several_gpus_keep_multicast_off_in_every_process(demo_model_path, tmp_path):
    path = tmp_path / "gpus"
    path.write_text("127.0.0.2 slots=8 type=A100\n127.0.0.3 slots=1 type=A100\n")
    built = plan(config(demo_model_path, path, [("g", {"resources": {"num_replicas": 1}})]))
    off = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
    assert built.cluster.host_envs["127.0.0.2"] == off and built.cluster.host_envs["127.0.0.3"] == {}
    assert built.engines[0].family == "nvidia" and built.engines[0].ray_actor_options["num_gpus"] == 1


def test_more_npus_than_the_ascend_hosts_have_is_refused_naming_hosts_and_family(demo_model_path, hostfile):
    message = error(
        config(demo_model_path, hostfile, [("npu", {"resources": {"num_replicas": 5, "accelerator": "ascend"}})])
    )
    assert "127.0.0.3: 2 + 127.0.0.4: 2 = 4 ascend device(s)" in message and "= 5 device(s)" in message


def test_an_engine_the_family_does_not_run_and_num_gpus_on_npus_are_refused(demo_model_path, hostfile, tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    cfg = config(demo_model_path, hostfile, [("npu", {"resources": {"accelerator": "ascend"}})])
    cfg["serve"][0].update(engine="llama_cpp", engine_args={"model": str(gguf)})
    assert "engine llama_cpp does not run on Ascend NPUs (ascend)" in error(cfg)
    cfg = config(demo_model_path, hostfile, [("npu", {"resources": {"accelerator": "ascend", "num_gpus": 1}})])
    assert "num_gpus=1, but the hosts it runs on have Ascend NPUs (ascend)" in error(cfg)


def test_a_type_naming_no_family_is_refused_at_its_line(demo_model_path, tmp_path):
    path = tmp_path / "hostfile"
    path.write_text("127.0.0.2 slots=1 type=cpu\n127.0.0.3 slots=1 type=tpu-v5\n")
    message = error(config(demo_model_path, path, [("m", {})]))
    assert f"{path}:2" in message and "type=tpu-v5 names no device family" in message


def pd(prefill: str, decode: str) -> dict:
    return {
        "disaggregation": {
            "prefill": {"resources": {"num_replicas": 1, "accelerator": prefill}},
            "decode": {"resources": {"num_replicas": 1, "accelerator": decode}},
        }
    }


def test_prefill_and_decode_across_families_need_a_connector_both_run(demo_model_path, tmp_path):
    path = tmp_path / "hostfile"
    path.write_text("127.0.0.2 slots=1 type=ascend\n127.0.0.3 slots=1 type=H100\n127.0.0.4 slots=1 type=MI300X\n")
    message = error(config(demo_model_path, path, [("m", pd("ascend", "H100"))]))
    assert "prefill on Ascend NPUs (ascend) and decode on NVIDIA GPUs (nvidia) cannot pass KV caches" in message
    assert "ascend: LLMDataDistCMgrConnector, MooncakeConnectorV1" in message
    built = plan(config(demo_model_path, path, [("m", pd("H100", "MI300X"))]))
    assert [(e.role, e.family) for e in built.engines] == [("prefill", "nvidia"), ("decode", "amd")]


def test_nodes_naming_one_family_differently_share_its_devices(demo_model_path, hostfile):
    nodes = [
        ("a", {"resources": {"num_replicas": 2, "accelerator": "910B"}}),
        ("b", {"resources": {"num_replicas": 3, "accelerator": "ascend"}}),
    ]
    message = error(config(demo_model_path, hostfile, nodes))
    assert "a: 2 + b: 3 = 5 ascend device(s)" in message and "127.0.0.3: 2 + 127.0.0.4: 2 = 4" in message
