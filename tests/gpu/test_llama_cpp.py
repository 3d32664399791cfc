"""On a GPU host with the CUDA llama-server (`make llama-cpp` builds it where nvidia-smi lists GPUs and nvcc is
there; issue 36): a llama.cpp replica reserves a GPU, puts the demo model's layers on it (llama-server's log says
so), its process is on that GPU only and has NVLink multicast off, `status` shows the GPU, and stop leaves no
process on any GPU. On two GPUs: a llama.cpp node and a vLLM node of one deployment each get a GPU of their own.
"""

from __future__ import annotations

import re

import checks  # benchmarks/gpu/checks.py (tests/gpu/conftest.py puts it on the path)
import pytest

from flagscale.engines import llama_cpp_build
from tests.conftest import llama_cpp_node, wait_for, write_config
from tests.gpu.test_placement import (
    ENGINE,
    Deployment,
    assert_env_everywhere,
    assert_stop_leaves_no_gpu_process,
)

pytestmark = [
    pytest.mark.skipif(checks.gpu_count() == 0, reason="needs a GPU (nvidia-smi lists none)"),
    pytest.mark.skipif(
        not (llama_cpp_build.is_built() and llama_cpp_build.variant().backend == "cuda"),
        reason="needs the CUDA llama-server (make llama-cpp on this GPU host)",
    ),
]


def test_a_llama_cpp_replica_puts_its_layers_on_its_gpu_and_leaves_none_behind(tmp_path):
    from flagscale.net import free_port
    from tests.conftest import run_cli

    port = free_port()
    node = llama_cpp_node("demo", num_gpus=1)
    del node["engine_args_specific"]  # the test's CPU default (n_gpu_layers 0): here the kind's own default
    node["engine_args"]["served_model_name"] = "demo"
    node["engine_args"]["log_verbosity"] = 4  # llama-server logs "offloaded N/M layers to GPU" from level 4 up
    conf = write_config(tmp_path / "conf", [node], tmp_path / "exp", port, experiment={"envs": checks.GPU_SAFE_ENV})
    deployment = Deployment(conf, port)
    try:
        result = run_cli(conf, "action=run", timeout=600)
        assert result.returncode == 0, result.output[-4000:]
        assert deployment.complete()
        (replica,) = deployment.ready()
        assert len(replica["gpus"]) == 1, replica
        log = open(replica["log"]).read()
        offloaded = re.search(r"offloaded (\d+)/(\d+) layers to GPU", log)
        assert offloaded and offloaded.group(1) == offloaded.group(2), log[-3000:]

        def placed() -> dict:
            found = checks.placement(deployment.status(), devices_per_replica=1)
            assert found["problems"] == [], found
            return found

        wait_for(placed, 120, "status and nvidia-smi to agree on the replica's GPU")
        apps = assert_env_everywhere()
        assert apps, "llama-server is on no GPU"
    finally:
        assert_stop_leaves_no_gpu_process(deployment)


@pytest.mark.skipif(checks.gpu_count() < 2, reason="needs 2 GPUs")
def test_a_llama_cpp_node_and_a_vllm_node_each_get_a_gpu_of_their_own(tmp_path):
    from flagscale.net import free_port
    from tests.conftest import run_cli

    port = free_port()
    llama = llama_cpp_node("gguf", num_gpus=1)
    del llama["engine_args_specific"]
    llama["engine_args"]["served_model_name"] = "gguf"
    vllm = {
        "serve_id": "demo",
        "engine": "vllm",
        "engine_args": ENGINE,
        "resources": {"num_replicas": 1, "num_gpus": 1},
    }
    conf = write_config(
        tmp_path / "conf", [llama, vllm], tmp_path / "exp", port, experiment={"envs": checks.GPU_SAFE_ENV}
    )
    deployment = Deployment(conf, port)
    try:
        result = run_cli(conf, "action=run", timeout=900)
        assert result.returncode == 0, result.output[-4000:]
        assert deployment.complete()  # the vLLM node's model, "demo"

        def placed() -> dict:
            found = checks.placement(deployment.status(), devices_per_replica=1)
            assert found["problems"] == [] and len(found["replicas"]) == 2, found
            return found

        found = wait_for(placed, 120, "status and nvidia-smi to agree on both replicas' GPUs")
        first, second = (set(r["smi_gpus"]) for r in found["replicas"])
        assert first and second and not first & second, found
        assert_env_everywhere()
    finally:
        assert_stop_leaves_no_gpu_process(deployment)
