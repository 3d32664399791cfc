"""flagscale/engines/vllm_server.py: when NIXL's progress thread is turned off, and that a real NIXL agent made
after the change starts without the thread that polls UCX without pause (an idle agent then uses no CPU)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from flagscale.engines.vllm_server import PROGRESS_THREAD_ENV, progress_thread_wanted, without_progress_thread


def test_off_on_cpu_on_on_gpu_unless_the_env_says():
    assert progress_thread_wanted({}, on_cpu=False)
    assert not progress_thread_wanted({}, on_cpu=True)
    assert progress_thread_wanted({PROGRESS_THREAD_ENV: "1"}, on_cpu=True)
    assert not progress_thread_wanted({PROGRESS_THREAD_ENV: "0"}, on_cpu=False)
    with pytest.raises(SystemExit, match=f"{PROGRESS_THREAD_ENV}='yes': give 0 or 1"):
        progress_thread_wanted({PROGRESS_THREAD_ENV: "yes"}, on_cpu=True)


def test_the_default_changes_and_an_explicit_choice_stays():
    class Config:
        def __init__(self, enable_prog_thread=True, num_threads=0):
            self.enable_pthread, self.num_threads = enable_prog_thread, num_threads

    without_progress_thread(Config)
    without_progress_thread(Config)  # once is enough; twice changes nothing
    assert Config(num_threads=4).enable_pthread is False
    assert Config(enable_prog_thread=True).enable_pthread is True
    assert Config(True, 2).enable_pthread is True


PROBE = textwrap.dedent(
    """
    import time, psutil, torch
    from nixl._api import nixl_agent, nixl_agent_config
    from flagscale.engines.vllm_server import without_progress_thread
    without_progress_thread(nixl_agent_config)
    config = nixl_agent_config(num_threads=4, capture_telemetry=True)  # as vLLM's NixlConnector makes it
    assert config.enable_pthread is False, vars(config)
    agent = nixl_agent("probe", config)
    agent.register_memory(torch.zeros(1 << 16))
    me = psutil.Process()
    before, start = sum(me.cpu_times()[:2]), time.monotonic()
    time.sleep(3)
    print("cores", (sum(me.cpu_times()[:2]) - before) / (time.monotonic() - start))
    """
)


def test_a_nixl_agent_made_after_the_change_idles_without_a_busy_thread():
    pytest.importorskip("nixl")
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    cores = float(done.stdout.split("cores", 1)[1])
    # NIXL's own default spins one core for the agent's whole life (1.0 measured here); an idle process can only
    # use less on a busy machine, so this cannot pass by load
    assert cores < 0.3, done.stdout
