"""CPU layout of a CPU engine, on a real process tree shaped like vLLM's:
watchdog -> API server -> engine core -> worker (the worker binds itself to core 0), or, with
VLLM_ENABLE_V1_MULTIPROCESSING=0, watchdog -> API server -> engine core running the worker (binding itself)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from flagscale.replica.cpu_layout import affinity, pin_engine, plan_engine_layout, process_tree
from tests.conftest import wait_for

pytestmark = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs at least 2 usable CPUs")

CHAIN = """
import os, subprocess, sys, time
depth = int(sys.argv[1])
bind_worker = sys.argv[2] == "bind"
if depth == 0:
    if bind_worker:
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    time.sleep(120)
else:
    child = subprocess.Popen([sys.executable, __file__, str(depth - 1), sys.argv[2]])
    child.wait()
"""


def start_chain(tmp_path, bind: bool, length: int = 4) -> tuple[subprocess.Popen, list[int]]:
    script = tmp_path / "chain.py"
    script.write_text(CHAIN)
    root = subprocess.Popen([sys.executable, str(script), str(length - 1), "bind" if bind else "free"])

    def chain_up() -> list[int]:
        tree = process_tree(root.pid)
        assert len(tree) == length and (not bind or len(affinity(tree[-1]) or ()) == 1), tree
        return tree

    try:
        return root, wait_for(chain_up, 30, "the process chain to come up", interval=0.1)
    except AssertionError:
        root.kill()
        raise


def stop_chain(tree: list[int]) -> None:
    for pid in reversed(tree):
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass


def test_engine_core_joins_the_worker_and_the_frontend_leaves_its_cores(tmp_path):
    root, tree = start_chain(tmp_path, bind=True)
    watchdog, api_server, engine_core, worker = tree
    try:
        host = affinity(watchdog)
        worker_cpus = affinity(worker)
        layout = pin_engine(root.pid)
        assert layout is not None
        assert layout.engine_core_pids == [engine_core]
        assert set(layout.frontend_pids) == {watchdog, api_server}
        assert affinity(engine_core) == worker_cpus
        assert affinity(api_server) == affinity(watchdog) == host - worker_cpus
        assert affinity(worker) == worker_cpus
    finally:
        stop_chain(tree)
        root.wait()


def test_an_engine_core_running_its_worker_keeps_the_api_server_off_its_cores(tmp_path):
    root, tree = start_chain(tmp_path, bind=True, length=3)
    watchdog, api_server, engine_core = tree
    try:
        host = affinity(watchdog)
        worker_cpus = affinity(engine_core)
        layout = pin_engine(root.pid)
        assert layout is not None
        assert layout.engine_core_pids == []
        assert set(layout.frontend_pids) == {watchdog, api_server}
        assert affinity(api_server) == affinity(watchdog) == host - worker_cpus
        assert affinity(engine_core) == worker_cpus
    finally:
        stop_chain(tree)
        root.wait()


def test_nothing_moves_when_no_worker_is_bound(tmp_path):
    root, tree = start_chain(tmp_path, bind=False)
    try:
        before = [affinity(pid) for pid in tree]
        assert plan_engine_layout(root.pid) is None
        assert pin_engine(root.pid) is None
        assert [affinity(pid) for pid in tree] == before
    finally:
        stop_chain(tree)
        root.wait()
