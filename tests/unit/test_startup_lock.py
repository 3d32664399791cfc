"""Engines sharing a GPU start in turn: the start-up lock, with a real second process holding it."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid

import pytest

from flagscale.replica.startup_lock import gpu_start_lock, lock_path

HOLD = """
import sys, time
from flagscale.replica.startup_lock import gpu_start_lock
with gpu_start_lock([sys.argv[1]], 10):
    print("held", flush=True)
    time.sleep(float(sys.argv[2]))
"""


def hold(gpu: str, seconds: float) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, gpu, str(seconds)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"  # blocks until the child holds the lock
    return proc


def test_second_engine_on_a_gpu_waits_for_the_first_to_start():
    gpu = f"test-{uuid.uuid4().hex[:8]}"
    holder = hold(gpu, 1.5)
    notes: list[str] = []
    t0 = time.monotonic()
    with gpu_start_lock([gpu], 30, notes.append):
        waited = time.monotonic() - t0
    holder.wait(10)
    assert waited >= 0.8, waited  # it could not start while the other held the GPU
    assert notes == [f"waiting for another engine on GPU {gpu} to finish starting"]
    lock_path(gpu).unlink(missing_ok=True)


def test_the_wait_is_bounded_and_names_the_gpu():
    gpu = f"test-{uuid.uuid4().hex[:8]}"
    holder = hold(gpu, 5)
    try:
        with pytest.raises(TimeoutError, match=f"GPU {gpu}: another engine was still starting"):
            with gpu_start_lock([gpu], 0.5):
                pass
    finally:
        holder.kill()
        holder.wait(10)
    with gpu_start_lock([gpu], 5):  # a killed holder releases the lock
        pass
    lock_path(gpu).unlink(missing_ok=True)


def test_no_gpu_no_lock():
    with gpu_start_lock([], 0):
        pass


@pytest.mark.parametrize(
    "engine, argv, measures",
    [
        ("vllm", ["--model", "m", "--gpu-memory-utilization", "0.2"], True),  # KV cache: what it finds free
        ("vllm", ["--model", "m", "--kv-cache-memory-bytes", "10737418240"], False),  # sized: starts at once
        ("vllm", ["--model", "m", "--kv-cache-memory-bytes=10737418240"], False),
        ("llama_cpp", ["--model", "m", "--ctx-size", "4096"], True),  # no such arg: in turn, as before
    ],
)
def test_an_engine_whose_kv_cache_has_a_size_of_its_own_need_not_start_in_turn(engine, argv, measures):
    from flagscale import engines

    assert engines.get(engine).measures_device_at_start(argv) is measures
