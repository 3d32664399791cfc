"""On a GPU host: the SLO planner sizing a node's replicas awake (`slo` with `sleep_delay_s`, docs/autoscaling.md).
One node, min 0 / max 2, two replicas on one GPU (half each): `run` starts both, idle they sleep (vLLM's sleep
mode, its own sleep-state gauge says so) and the planner wants none awake; a request wakes one of those same
replicas and is answered, the planner then wants one awake, and no third replica is ever started."""

from __future__ import annotations

import urllib.request

import checks  # benchmarks/gpu/checks.py (tests/gpu/conftest.py puts it on the path)
import pytest

from flagscale.engines.metrics import by_replica
from tests.conftest import wait_for
from tests.gpu.test_placement import ENGINE, Deployment, deployed_nodes

pytestmark = pytest.mark.skipif(checks.gpu_count() == 0, reason="needs a GPU (nvidia-smi lists none)")
MODEL = "planned"
MOST = 2
RESOURCES = {
    "min_replicas": 0,
    "max_replicas": MOST,
    "num_gpus": 0.5,
    "upscale_delay_s": 0,
    "downscale_delay_s": 5,
    "sleep_delay_s": 5,
    "slo": {"ttft_ms": 5000, "itl_ms": 1000},
}


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    node = {
        "serve_id": MODEL,
        "engine": "vllm",
        "engine_args": {**ENGINE, "served_model_name": MODEL, "gpu_memory_utilization": 0.3},
        "resources": RESOURCES,
    }
    with deployed_nodes(tmp_path_factory.mktemp("planned"), [node]) as deployment:
        yield deployment


def _engines_asleep(port: int) -> dict[str, bool]:
    """Each replica's engine, asleep or not, by vLLM's own `vllm:engine_sleep_state{sleep_state="awake"}`
    (through the router's /metrics, which labels each engine's series with its replica)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    return {r: v == 0 for r, v in by_replica(text, "vllm:engine_sleep_state", sleep_state="awake").items()}


def _idle_and_asleep(deployment: Deployment, started: list[str]) -> dict | None:
    report = deployment.status()
    ready = sorted(r["replica_id"] for r in report["replicas"] if r["serve_id"] == MODEL and r["state"] == "READY")
    assert ready == started, ready  # the replicas started at `run`, all along
    asleep = _engines_asleep(deployment.port)
    record = report["planner"].get(MODEL, {})
    # the planner's record counts sleeping replicas from their pushed stats: a window behind the engines' gauge
    counted = record.get("target") == 0 and record.get("asleep") == len(started)
    return report if counted and sorted(asleep) == started and all(asleep.values()) else None


def test_run_starts_max_replicas_they_sleep_and_a_request_wakes_one_of_them(planned):
    def all_ready():
        ready = sorted(r["replica_id"] for r in planned.ready())
        return ready if len(ready) == MOST else None

    started = wait_for(all_ready, 120, f"the {MOST} replicas started at run, READY")
    report = wait_for(lambda: _idle_and_asleep(planned, started), 240, "both engines asleep, the planner at 0 awake")
    assert report["planner"][MODEL]["sleeps"]
    assert planned.complete(MODEL, timeout_s=120)
    woken = wait_for(
        lambda: [r for r, asleep in _engines_asleep(planned.port).items() if not asleep] or None, 60, "one awake"
    )
    assert len(woken) == 1 and woken[0] in started, woken
    wait_for(lambda: planned.status()["planner"][MODEL]["target"] >= 1 or None, 120, "the planner wanting one awake")
    assert sorted(r["replica_id"] for r in planned.ready()) == started  # woken, not started
