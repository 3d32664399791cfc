"""GPU planning checks on a fake device table (this machine reports one or two 80 GB GPUs): replicas sharing a GPU,
fractional num_gpus, the GPUs every replica reserves together, and weights that cannot fit. Pure planning: nothing
starts, no GPU needed."""

from __future__ import annotations

import json

import pytest

import flagscale.facts
from flagscale.config.load import ConfigSources, load_config
from flagscale.devices import Gpu
from flagscale.errors import ConfigError
from flagscale.plan import build_plan

SOURCES = ConfigSources(main="conf/serve.yaml", serve="conf/serve/gpu.yaml")
H100_MIB = 81559


@pytest.fixture
def gpus(monkeypatch):
    def install(count: int):
        table = [Gpu(i, "NVIDIA H100 80GB HBM3", H100_MIB) for i in range(count)]
        monkeypatch.setattr(flagscale.facts, "local_gpus", lambda: table)

    install(1)
    return install


@pytest.fixture
def model(tmp_path, demo_model_path):
    """A model dir whose safetensors index says 40 GiB of weights."""
    path = tmp_path / "big-model"
    path.mkdir()
    (path / "config.json").write_text((demo_model_path / "config.json").read_text())
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 40 * 1024**3}}))
    return path


def plan(model_path, resources, **engine_args):
    cfg = {
        "experiment": {"exp_name": "t", "exp_dir": "/tmp/t", "runner": {"deploy": {"port": 8123}}},
        "serve": [
            {
                "serve_id": "llm",
                "engine": "vllm",
                "resources": resources,
                "engine_args": {"model": str(model_path), "max_model_len": 256, **engine_args},
            }
        ],
    }
    return build_plan(load_config(cfg, SOURCES), SOURCES, check_port=False)


def error(*args, **kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        plan(*args, **kwargs)
    return str(info.value)


def test_replicas_sharing_a_gpu_must_fit_its_memory_together(gpus, demo_model_path):
    ok = plan(demo_model_path, {"num_replicas": 4, "num_gpus": 0.25}, gpu_memory_utilization=0.2)
    assert ok.engines[0].ray_actor_options == {"num_cpus": 1, "num_gpus": 0.25} and ok.engines[0].device == "gpu"
    message = error(demo_model_path, {"num_replicas": 4, "num_gpus": 0.25}, gpu_memory_utilization=0.3)
    assert message.startswith("conf/serve/gpu.yaml: serve[0](llm).resources")
    assert "4 replica(s) share a GPU (num_gpus=0.25) x gpu_memory_utilization 0.3 = 1.20" in message
    assert "set gpu_memory_utilization <= 0.24" in message
    # vLLM's default (0.9) counts when the config does not say.
    assert "2 replica(s) share a GPU (num_gpus=0.5) x gpu_memory_utilization 0.9" in error(
        demo_model_path, {"num_replicas": 2, "num_gpus": 0.5}
    )
    # Autoscaling counts the most replicas it may run.
    assert "3 replica(s) share a GPU" in error(
        demo_model_path, {"min_replicas": 1, "max_replicas": 3, "num_gpus": 0.25}, gpu_memory_utilization=0.4
    )


def test_fractions_must_divide_a_gpu_and_not_span_gpus(gpus, demo_model_path):
    assert "num_gpus=0.3 does not divide a GPU" in error(demo_model_path, {"num_gpus": 0.3}, gpu_memory_utilization=0.2)
    assert "num_gpus=1.5: a replica takes whole GPUs" in error(demo_model_path, {"num_gpus": 1.5})
    gpus(2)
    assert "needs whole GPUs" in error(
        demo_model_path, {"num_gpus": 0.5}, tensor_parallel_size=2, gpu_memory_utilization=0.4
    )


def test_replicas_together_must_fit_the_gpus(gpus, demo_model_path):
    message = error(demo_model_path, {"num_replicas": 3, "num_gpus": 0.5}, gpu_memory_utilization=0.4)
    assert "llm: 3 x 0.5 = 1.5 GPU(s), but this machine has 1" in message
    gpus(2)
    assert plan(demo_model_path, {"num_replicas": 3, "num_gpus": 0.5}, gpu_memory_utilization=0.4).engines


def test_weights_that_cannot_fit_are_refused_with_the_arithmetic(gpus, model):
    message = error(model, {}, gpu_memory_utilization=0.3)
    assert message.startswith("conf/serve/gpu.yaml: serve[0](llm).engine_args")
    assert "40.0 GiB / (TP 1 x PP 1) = 40.0 GiB per GPU > gpu_memory_utilization 0.3 x 79.6 GiB = 23.9 GiB" in message
    gpus(2)
    assert plan(model, {}, gpu_memory_utilization=0.3, tensor_parallel_size=2).engines[0].devices_per_replica == 2


def test_no_gpu_checks_on_a_cpu_machine(gpus, model):
    gpus(0)
    assert plan(model, {"num_replicas": 2}, gpu_memory_utilization=0.9).engines[0].device == "cpu"


def test_replicas_of_different_nodes_sharing_a_gpu_must_fit_together(gpus, demo_model_path):
    def two_nodes(a_util: float, b_util: float):
        cfg = {
            "experiment": {"exp_name": "t", "exp_dir": "/tmp/t", "runner": {"deploy": {"port": 8123}}},
            "serve": [
                {
                    "serve_id": name,
                    "engine": "vllm",
                    "resources": {"num_replicas": 1, "num_gpus": 0.5},
                    "engine_args": {
                        "model": str(demo_model_path),
                        "max_model_len": 256,
                        "served_model_name": name,
                        "gpu_memory_utilization": util,
                    },
                }
                for name, util in (("alpha", a_util), ("beta", b_util))
            ],
        }
        return build_plan(load_config(cfg, SOURCES), SOURCES, check_port=False)

    assert len(two_nodes(0.45, 0.45).engines) == 2  # 0.90 of the GPU together: fits
    with pytest.raises(ConfigError) as info:
        two_nodes(0.6, 0.6)  # each fits alone; Ray may put both on the one GPU
    message = str(info.value)
    assert "replicas of different nodes may share one GPU" in message and "= 1.20 of its memory" in message
    assert "alpha (0.5 GPU, utilization 0.6)" in message and "beta (0.5 GPU, utilization 0.6)" in message
