"""On a GPU host where SGLang is installed (in this environment, or in FLAGSCALE_SGLANG_PATH: the GPU image takes
sglang 0.5.17, benchmarks/gpu/sglang_pack.sh; issue 32): an SGLang replica of the demo model serves through the
router, holds the GPUs it reserved (one, or two at TP=2, each rank's scheduler on its own), every GPU process has
NVLink multicast off, and stop leaves no process on any GPU.
"""

from __future__ import annotations

import checks  # benchmarks/gpu/checks.py (tests/gpu/conftest.py puts it on the path)
import pytest

from flagscale.engines import sglang
from flagscale.net import free_port
from tests.conftest import run_cli, wait_for, write_config
from tests.gpu.test_placement import Deployment, assert_env_everywhere, assert_stop_leaves_no_gpu_process

pytestmark = [
    pytest.mark.skipif(checks.gpu_count() == 0, reason="needs a GPU (nvidia-smi lists none)"),
    pytest.mark.skipif(sglang.installed() is None, reason="needs SGLang (here or in FLAGSCALE_SGLANG_PATH)"),
]
ENGINE = {
    "model": "${demo_model:}",
    "served_model_name": "demo",
    "max_model_len": 512,
    "max_num_seqs": 16,
    "gpu_memory_utilization": 0.15,
}


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.skipif(checks.gpu_count() < 2, reason="2 GPUs"))])
def test_an_sglang_replica_serves_on_its_gpus_and_leaves_none_behind(tmp_path, tp):
    port = free_port()
    node = {
        "serve_id": "demo",
        "engine": "sglang",
        "engine_args": {**ENGINE, "tensor_parallel_size": tp},
        "resources": {"num_replicas": 1},
    }
    envs = dict(checks.GPU_SAFE_ENV)
    if sglang.search_path():
        envs[sglang.PATH_ENV] = ":".join(sglang.search_path())
    conf = write_config(tmp_path / "conf", [node], tmp_path / "exp", port, experiment={"envs": envs})
    deployment = Deployment(conf, port)
    try:
        result = run_cli(conf, "action=run", timeout=900)
        assert result.returncode == 0, result.output[-4000:]
        assert deployment.complete()

        def placed() -> dict:
            found = checks.placement(deployment.status(), devices_per_replica=tp)
            assert found["problems"] == [], found
            return found

        found = wait_for(placed, 120, "status and nvidia-smi to agree on the replica's GPUs")
        (replica,) = found["replicas"]
        assert len(replica["smi_gpus"]) == tp, found
        assert assert_env_everywhere(), "SGLang is on no GPU"
    finally:
        assert_stop_leaves_no_gpu_process(deployment)
