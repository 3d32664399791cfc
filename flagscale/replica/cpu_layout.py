"""Keep a CPU engine's compute cores to itself (`experiment.runner.deploy.cpu_affinity: auto`).

vLLM's CPU backend binds each model worker to chosen cores (VLLM_CPU_OMP_THREADS_BIND) and leaves the
worker's parent, the engine-core process that schedules batches, and the API server free to run anywhere.
The worker and the engine core both busy-wait (spin, yielding) on the shared-memory queue between them,
so a process that lands on a core with one of them fights a spinner. On a small host the API server, the
router and the clients then lose a lottery that changes from run to run: measured on 2 cores, the same
deployment swung between ~2,000 and ~5,000 output tok/s at concurrency 16 (docs/benchmarks.md).

The layout applied here: the engine core joins its worker's cores (the two alternate, each yielding to
the other; where the engine core runs the worker itself, it is the worker), and everything else of the engine
(API server, watchdog) gets the host's remaining cores;
the router, when it runs on the same host, stays off the workers' cores too. Nothing changes when no
worker is bound to a strict subset of the cores (GPU engines, or a worker bound to every core).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import psutil

log = logging.getLogger(__name__)


@dataclass
class EngineLayout:
    worker_cpus: list[int]
    frontend_cpus: list[int]
    engine_core_pids: list[int]
    frontend_pids: list[int]


def parent_pids() -> dict[int, int]:
    """pid -> ppid of every live process (zombies left out), read once."""
    procs = psutil.process_iter(["ppid", "status"])
    return {p.pid: p.info["ppid"] for p in procs if p.info["status"] not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)}


def process_tree(root: int, parents: dict[int, int] | None = None) -> list[int]:
    """`root` and all its descendants, parents before children (`parents`: pid -> ppid, default: read now)."""
    if parents is None:
        parents = parent_pids()
    children: dict[int, list[int]] = {}
    for pid, ppid in parents.items():
        children.setdefault(ppid, []).append(pid)
    tree, todo = [], [root]
    while todo:
        pid = todo.pop(0)
        tree.append(pid)
        todo.extend(sorted(children.get(pid, [])))
    return tree


def affinity(pid: int) -> set[int] | None:
    try:
        return os.sched_getaffinity(pid)
    except (ProcessLookupError, PermissionError):
        return None


def set_process_affinity(pid: int, cpus: set[int]) -> None:
    """sched_setaffinity is per thread: apply it to every thread of `pid` (threads started later inherit it)."""
    try:
        threads = [t.id for t in psutil.Process(pid).threads()]
    except psutil.Error:
        return
    for tid in threads:
        try:
            os.sched_setaffinity(tid, cpus)
        except (ProcessLookupError, PermissionError):
            continue


def plan_engine_layout(root: int) -> EngineLayout | None:
    """Which processes of the engine started as `root` go where; None when nothing should move."""
    parents = parent_pids()
    tree = process_tree(root, parents)
    host_cpus = affinity(root)
    if not host_cpus:
        return None
    cpus = {pid: affinity(pid) for pid in tree}
    workers = [pid for pid in tree if cpus[pid] is not None and cpus[pid] < host_cpus]
    if not workers:
        return None
    worker_cpus = set().union(*(cpus[pid] for pid in workers))
    frontend_cpus = host_cpus - worker_cpus
    if not frontend_cpus:
        return None
    # The engine core is a worker's parent, unless that parent is the server `root` started: then the worker *is*
    # the engine core (vLLM with VLLM_ENABLE_V1_MULTIPROCESSING=0 runs a single-rank worker in the engine core).
    server = {pid for pid in tree if parents.get(pid) == root}
    engine_cores = sorted(({parents[pid] for pid in workers} & set(tree)) - {root, *server, *workers})
    frontend = [pid for pid in tree if pid not in workers and pid not in engine_cores]
    return EngineLayout(sorted(worker_cpus), sorted(frontend_cpus), engine_cores, frontend)


def pin_engine(root: int) -> EngineLayout | None:
    layout = plan_engine_layout(root)
    if layout is None:
        return None
    for pid in layout.engine_core_pids:
        set_process_affinity(pid, set(layout.worker_cpus))
    for pid in layout.frontend_pids:
        set_process_affinity(pid, set(layout.frontend_cpus))
    log.info(
        "CPU layout: workers on %s; engine core(s) %s joined them; API server and the rest on %s",
        layout.worker_cpus,
        layout.engine_core_pids,
        layout.frontend_cpus,
    )
    return layout


class RouterPinning:
    """Keeps the router's process off the cores of engine workers on its own host."""

    def __init__(self, node_id: str):
        self.node_id = node_id
        self.host_cpus = affinity(os.getpid()) or set()
        self.applied: set[int] | None = None

    def update(self, records) -> None:
        busy = set().union(*(set(r.worker_cpus) for r in records if r.node_id == self.node_id and r.worker_cpus))
        wanted = (self.host_cpus - busy) or self.host_cpus
        if wanted != self.applied:
            set_process_affinity(os.getpid(), wanted)
            self.applied = wanted
            log.info("router on CPUs %s (engine workers on this host: %s)", sorted(wanted), sorted(busy) or "none")
