"""The CPU layout of a running deployment's vLLM engines of vLLM's default process tree (API server -> engine core
-> model worker), read from live processes: `cpu_affinity: auto` puts the engine core on its worker's cores and the
API server and the router off them (docs/design.md)."""

from __future__ import annotations

import os
from collections.abc import Callable

import psutil

from flagscale.cluster.processes import session_members
from flagscale.replica.cpu_layout import affinity, parent_pids, process_tree
from tests.conftest import wait_for


def process_name(pid: int, cmdline: bool = False) -> str:
    try:
        with open(f"/proc/{pid}/{'cmdline' if cmdline else 'comm'}", "rb") as f:
            return f.read().split(b"\0")[0].decode(errors="replace").strip()
    except OSError:
        return ""


def engine_layout(replica: dict, host_cpus: set[int]) -> set[int]:
    """Asserts one replica's layout; returns its worker's cores."""
    parents = parent_pids()
    tree = process_tree(replica["engine_pid"], parents)  # watchdog, API server, ...
    by_name: dict[str, list[int]] = {}
    for pid in tree:
        by_name.setdefault(process_name(pid), []).append(pid)
    # vLLM titles its worker VLLM::Worker; two fresh-clone runs saw every process of one replica keep the title
    # `python` for minutes while it served. Then the worker is the API server's (tree[1]) only grandchild:
    # vLLM's API server starts the engine core, which starts the worker.
    grandchildren = [pid for pid in tree[2:] if parents.get(parents[pid]) == tree[1]]
    workers = by_name.get("VLLM::Worker") or (grandchildren if len(grandchildren) == 1 else [])
    assert workers, (replica, by_name, grandchildren)
    worker = workers[0]
    # the worker's parent: vLLM names it VLLM::EngineCore, but a busy machine once showed it still as "python"
    engine_core = psutil.Process(worker).ppid()
    assert engine_core in tree, (replica, by_name)
    worker_cpus = affinity(worker)
    assert worker_cpus and len(worker_cpus) < len(host_cpus), replica
    assert replica["worker_cpus"] == sorted(worker_cpus), replica
    assert replica["gpus"] == [], replica  # CPU engines hold no GPU
    assert affinity(engine_core) == worker_cpus, replica
    assert not affinity(tree[1]) & worker_cpus, replica
    return worker_cpus


def wait_for_cpu_layout(replicas: Callable[[], list[dict]], sessions: list[int], timeout_s: float = 300) -> None:
    """Every engine replica's layout and the one router process's cores, waited for (bounded) with a fresh status
    and process table on each try, never read once: a busy machine may still be starting, pinning or replacing."""
    host_cpus = os.sched_getaffinity(0)

    def layout_holds() -> bool:
        all_worker_cpus: set[int] = set()
        for replica in replicas():
            all_worker_cpus |= engine_layout(replica, host_cpus)
        routers = [
            pid for s in sessions for pid in session_members(s) if process_name(pid, cmdline=True).endswith(":router")
        ]
        assert len(routers) == 1, routers
        if all_worker_cpus != host_cpus:
            assert affinity(routers[0]) == host_cpus - all_worker_cpus, (routers, all_worker_cpus)
        return True

    wait_for(layout_holds, timeout_s, "every engine replica's CPU layout and the router's cores", interval=2)
