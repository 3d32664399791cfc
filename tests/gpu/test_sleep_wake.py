"""On a GPU host: idle replicas asleep (resources.sleep_delay_s, vLLM's sleep mode). Two models share one GPU,
each replica with `sleep_delay_s: 12`: idle, both fall asleep and give their GPU memory back (nvidia-smi); a
request wakes its own model only and is answered; concurrent requests for a sleeping model share one wake; the
other model then wakes for its request while the first falls asleep again: the two time-share the GPU. The demo
model (tiny random-weight Llama) with CUDA graphs off keeps the deployment to well under a minute."""

from __future__ import annotations

import urllib.request
from concurrent.futures import ThreadPoolExecutor

import checks  # benchmarks/gpu/checks.py (tests/gpu/conftest.py puts it on the path)
import pytest

from tests.conftest import wait_for
from tests.gpu.test_placement import ENGINE, Deployment, deployed_nodes

GPU_SAFE_ENV = checks.GPU_SAFE_ENV

pytestmark = pytest.mark.skipif(checks.gpu_count() == 0, reason="needs a GPU (nvidia-smi lists none)")
SLEEP_S = 12  # long enough for `status` (a CLI process) to see a woken replica awake


def node(name: str) -> dict:
    return {
        "serve_id": name,
        "engine": "vllm",
        "engine_args": {**ENGINE, "served_model_name": name, "gpu_memory_utilization": 0.3},
        "resources": {"num_replicas": 1, "num_gpus": 0.5, "sleep_delay_s": SLEEP_S},
    }


@pytest.fixture(scope="module")
def two_models(tmp_path_factory):
    with deployed_nodes(tmp_path_factory.mktemp("sleep"), [node("a"), node("b")]) as deployment:
        yield deployment


def _asleep(deployment: Deployment) -> dict[str, bool]:
    return {r["serve_id"]: r["asleep"] for r in deployment.status()["replicas"] if r["state"] == "READY"}


def _gpu_used_mb() -> float:
    return sum(app["used_mb"] for app in checks.gpu_apps())


def _wakes(port: int, model: str) -> float:
    """Wakes of `model`'s replicas the router processes counted (flagscale_router_replica_wakes_total)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as resp:
        lines = resp.read().decode().splitlines()
    wakes = [line for line in lines if line.startswith("flagscale_router_replica_wakes_total{")]
    return sum(float(line.rsplit(" ", 1)[1]) for line in wakes if f'model="{model}"' in line)


def test_idle_replicas_fall_asleep_and_give_their_gpu_memory_back(two_models):
    awake_mb = _gpu_used_mb()
    wait_for(lambda: _asleep(two_models) == {"a": True, "b": True}, 120, "both replicas asleep in status")
    asleep_mb = wait_for(lambda: (mb := _gpu_used_mb()) < awake_mb * 0.5 and mb, 60, "GPU memory given back")
    print(f"GPU memory: {awake_mb:.0f} MiB awake, {asleep_mb:.0f} MiB asleep")


def test_a_request_wakes_its_own_model_only_and_is_answered(two_models):
    wait_for(lambda: _asleep(two_models) == {"a": True, "b": True}, 120, "both replicas asleep")
    before = _wakes(two_models.port, "a")
    assert two_models.complete("a", timeout_s=120)
    assert _wakes(two_models.port, "a") == before + 1
    wait_for(lambda: _asleep(two_models) == {"a": False, "b": True}, 30, "a awake, b still asleep")


def test_concurrent_requests_for_a_sleeping_model_share_one_wake(two_models):
    wait_for(lambda: _asleep(two_models)["b"], 120, "b asleep")
    before = _wakes(two_models.port, "b")
    with ThreadPoolExecutor(8) as pool:
        texts = list(pool.map(lambda _: two_models.complete("b", timeout_s=120), range(8)))
    assert all(texts)
    assert _wakes(two_models.port, "b") == before + 1


def test_the_two_models_time_share_the_gpu(two_models):
    """Traffic moves from one model to the other: the one left idle falls asleep, the other wakes."""
    for model, other in (("a", "b"), ("b", "a"), ("a", "b")):
        wait_for(lambda: _asleep(two_models) == {"a": True, "b": True}, 120, "both asleep")  # noqa: B023
        assert two_models.complete(model, timeout_s=120)
        states = wait_for(lambda: (now := _asleep(two_models))[model] is False and now, 30, f"{model} awake")  # noqa: B023
        assert states[other] is True
