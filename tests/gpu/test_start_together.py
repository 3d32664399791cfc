"""On a GPU host: replicas sharing one GPU start in turn (replica/startup_lock.py: vLLM sizes its KV cache from the
memory it finds free at start), unless their KV cache has a size of its own (`kv_cache_memory_bytes`): then they
start together, and each serves."""

from __future__ import annotations

import time

import checks  # benchmarks/gpu/checks.py (tests/gpu/conftest.py puts it on the path)
import pytest

from tests.conftest import run_cli, wait_for
from tests.gpu.test_placement import ENGINE, Deployment, deployed

pytestmark = pytest.mark.skipif(checks.gpu_count() == 0, reason="needs a GPU (nvidia-smi lists none)")
REPLICAS = 4
WAITED = "waiting for another engine on GPU"  # the replica's note in its engine log (startup_lock.gpu_start_lock)


def _waited(deployment: Deployment, replica_id: str) -> bool:
    shown = run_cli(deployment.conf, "action=logs", f"replica={replica_id}", "lines=2000", timeout=120)
    assert shown.returncode == 0, shown.output[-2000:]
    return WAITED in shown.stdout


@pytest.mark.parametrize("sized", [False, True], ids=["measured", "sized"])
def test_replicas_sharing_a_gpu_start_in_turn_unless_their_kv_cache_is_sized(tmp_path, sized):
    engine = {**ENGINE, "gpu_memory_utilization": 0.15}
    if sized:
        engine["kv_cache_memory_bytes"] = 2 * 2**30
    began = time.monotonic()
    with deployed(tmp_path, engine, {"num_replicas": REPLICAS, "num_gpus": 1 / REPLICAS}) as deployment:
        started_s = time.monotonic() - began

        def all_ready():
            ready = sorted(r["replica_id"] for r in deployment.ready())
            return ready if len(ready) == REPLICAS else None

        ready = wait_for(all_ready, 120, f"{REPLICAS} replicas READY on one GPU")
        for _ in range(2 * REPLICAS):
            assert deployment.complete()
        waited = [replica for replica in ready if _waited(deployment, replica)]
        print(f"{'sized' if sized else 'measured'}: run took {started_s:.0f} s; waited for the lock: {waited}")
        assert (waited == []) if sized else (len(waited) >= 1), waited
