"""Planning is a pure function of the config and the facts gathered before it: given the facts, it probes nothing
(no DNS, no nvidia-smi, no port) and reads neither checkpoint sizes nor the key's variable, so dryrun and these tests
can plan for hosts and GPUs this machine does not have."""

from __future__ import annotations

import socket

import pytest

from flagscale.cluster.hostfile import parse_hostfile
from flagscale.config.load import ConfigSources, load_config
from flagscale.devices import Gpu
from flagscale.errors import ConfigError
from flagscale.facts import Facts, TargetFacts
from flagscale.facts import gather as gather_facts
from flagscale.launchers.ssh import named_hosts
from flagscale.plan import build_plan, plan_of

SOURCES = ConfigSources(main="conf/serve.yaml", serve="conf/serve/nodes.yaml")


def config(demo_model_path, hostfile=None, deploy=None, **experiment):
    cfg = {
        "experiment": {
            "exp_name": "t",
            "exp_dir": "/tmp/t",
            "runner": {"hostfile": str(hostfile) if hostfile else None, "deploy": {"port": 8123, **(deploy or {})}},
            **experiment,
        },
        "serve": [{"serve_id": "m", "engine_args": {"model": str(demo_model_path), "max_model_len": 256}}],
    }
    return load_config(cfg, SOURCES)


@pytest.fixture
def no_probes(monkeypatch):
    """Any name lookup or GPU query during planning fails the test."""

    def refuse(*args, **kwargs):
        raise AssertionError(f"planning probed the network: {args}")

    monkeypatch.setattr(socket, "gethostbyname", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr("flagscale.facts.local_gpus", refuse)


def test_hosts_named_by_the_config_come_from_the_facts(demo_model_path, tmp_path, no_probes):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("gpu-a slots=8 type=gpu\ngpu-b slots=8 type=gpu\n")
    cfg = config(demo_model_path, hostfile, node_args={"gpu-b": {"engine_args": {"max_num_seqs": 2}}})
    assert named_hosts(cfg) == {"gpu-b"}
    facts = TargetFacts(hostfile=parse_hostfile(hostfile), host_ips={"gpu-b": "10.9.0.2"})
    engine = build_plan(cfg, SOURCES, target_facts=facts).engines[0]
    assert list(engine.host_argv) == ["10.9.0.2"]


def test_this_machines_gpus_and_port_come_from_the_facts(demo_model_path, no_probes):
    cfg = config(demo_model_path)
    h100 = [Gpu(0, "NVIDIA H100 80GB HBM3", 81559)]
    plan = build_plan(cfg, SOURCES, target_facts=TargetFacts(gpus=h100, cpus=64))
    assert plan.engines[0].device == "gpu" and plan.head_num_cpus == 64
    with pytest.raises(ConfigError, match="port 8123 on 127.0.0.1 is already in use"):
        build_plan(cfg, SOURCES, target_facts=TargetFacts(port_taken="port 8123 on 127.0.0.1 is already in use"))


def test_checkpoint_sizes_the_key_and_exp_dir_come_from_the_facts(demo_model_path, monkeypatch, no_probes):
    model = str(demo_model_path)
    keyed = config(demo_model_path, deploy={"api_key_env": "FS_TEST_FACTS_KEY"})
    monkeypatch.setenv("FS_TEST_FACTS_KEY", "open-sesame-0123456789")
    facts = gather_facts(keyed, SOURCES, target=TargetFacts())
    assert facts.api_key == "open-sesame-0123456789" and list(facts.weight_bytes) == [model]
    monkeypatch.delenv("FS_TEST_FACTS_KEY")  # planning reads the key from the facts, not the environment
    h100 = TargetFacts(gpus=[Gpu(0, "NVIDIA H100 80GB HBM3", 81559)], cpus=8)
    plan = plan_of(keyed, SOURCES, Facts(h100, api_key="given", exp_dir="/given"))
    assert plan.api_key == "given" and plan.exp_dir == "/given"
    huge = Facts(h100, api_key=None, exp_dir="/given", weight_bytes={model: 1024**4})
    with pytest.raises(ConfigError, match="the weights do not fit: 1024.0 GiB"):
        plan_of(config(demo_model_path), SOURCES, huge)


def test_a_kv_cache_sized_in_the_engine_args_must_fit_the_replicas_share_with_the_weights(demo_model_path, no_probes):
    h100 = TargetFacts(gpus=[Gpu(0, "NVIDIA H100 80GB HBM3", 81559)], cpus=8)

    def planned(kv_cache: str) -> None:
        cfg = config(demo_model_path)
        cfg.serve[0].engine_args.update(gpu_memory_utilization=0.1, kv_cache_memory_bytes=kv_cache)
        plan_of(cfg, SOURCES, Facts(h100, api_key=None, exp_dir="/given", weight_bytes={}))

    planned("4G")  # 4 GiB of 0.1 x 79.6 GiB: fits
    with pytest.raises(ConfigError, match=r"the KV cache does not fit: 10\.0 GiB of KV cache > gpu_memory_util") as err:
        planned("10G")  # the engine would take more than its share of the GPU
    assert "serve[0](m).engine_args.kv_cache_memory_bytes" in str(err.value), err.value


def test_dryrun_says_how_replicas_sharing_a_gpu_start(demo_model_path, no_probes):
    h100 = TargetFacts(gpus=[Gpu(0, "NVIDIA H100 80GB HBM3", 81559)], cpus=8)

    def notes(**engine_args) -> list[str]:
        cfg = config(demo_model_path)
        cfg.serve[0].engine_args.update(gpu_memory_utilization=0.2, **engine_args)
        cfg.serve[0].resources.num_replicas, cfg.serve[0].resources.num_gpus = 4, 0.25
        plan = plan_of(cfg, SOURCES, Facts(h100, api_key=None, exp_dir="/given", weight_bytes={}))
        return [note for note in plan.notes if "sharing a GPU" in note]

    assert notes() == [
        "serve 'm': replicas sharing a GPU (num_gpus 0.25) start one after another, each sizing its KV cache from "
        "the memory it finds free; kv_cache_memory_bytes in engine_args starts them together"
    ]
    assert notes(kv_cache_memory_bytes="4G") == [
        "serve 'm': replicas sharing a GPU (num_gpus 0.25) start together: their KV cache has a size of its own"
    ]
