"""One host's share of a replica's ranks as processes: the RemoteRanks actor that runs them on a host other than the
server's, the ranks' worker processes (found by their titles and cores), and the interface their collectives bind.

The ranks' process runs under engine_proc, which ends it when the actor's process goes; Ray ends the actor when the
replica that created it goes (replica/ranks.py)."""

from __future__ import annotations

import dataclasses
import socket
import subprocess
from pathlib import Path

import psutil

from flagscale import engines
from flagscale.adaptors import ray
from flagscale.engines.base import HostShare
from flagscale.replica.cores import CoreClaim
from flagscale.replica.cpu_layout import affinity, process_tree
from flagscale.replica.process import cause_from_log, engine_env, start_watched, terminate_engine


def worker_pids(
    kind: engines.EngineKind, root: int, tp: int, pp: int, share: HostShare | None = None
) -> dict[int, int]:
    """global rank -> pid of the worker processes under `root`, as `kind` knows them by their titles. CPU ranks
    are known by their cores first (a data-parallel engine's workers may all have one title), then by title."""
    by_cores = {frozenset(cpus): rank for rank, cpus in zip(share.ranks, share.rank_cpus)} if share else {}
    found = {}
    for pid in process_tree(root):
        try:
            process = psutil.Process(pid)
            title = " ".join(process.cmdline())
            parent = process.parent()
            parent_title = " ".join(parent.cmdline()) if parent else ""
        except psutil.Error:
            continue
        rank = kind.worker_rank(title, tp, pp, parent_title)
        if rank is None:
            continue
        cores = affinity(pid)
        found[by_cores.get(frozenset(cores or ()), rank)] = pid
    return found


def interface_of(ip: str) -> str | None:
    """The network interface that has `ip` (multi-host collectives bind it), or None."""
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == ip for a in addresses):
            return name
    return None


class RemoteRanks:
    """A Ray actor on one of the replica's other hosts (in that host's bundle): runs the host's headless ranks."""

    def __init__(
        self, engine: str, argv: list[str], share: HostShare, cores_per_rank: int, log_path: str, env: dict[str, str]
    ):
        self.kind = engines.get(engine)
        self.env = env
        self.argv = argv
        self.share = share  # the replica's split (node rank, nnodes, ranks, master); start fills in the host's part
        self.cores_per_rank = cores_per_rank
        self.log_path = Path(log_path)
        self.claim: CoreClaim | None = None
        self.proc: subprocess.Popen | None = None

    def start(self) -> HostShare:
        """Starts the ranks on what this host gave them; returns the host's share as started."""
        host = ray.util.get_node_ip_address()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        ranks = len(self.share.ranks)
        rank_cpus: tuple[tuple[int, ...], ...] = ()
        assigned = ray.get_runtime_context().get_accelerator_ids().get(self.share.device_resource, [])
        gpus = tuple(str(device) for device in assigned)  # this host's devices of the replica's family
        if not gpus:
            self.claim = CoreClaim.take(ranks * self.cores_per_rank)
            rank_cpus = self.claim.per_rank(ranks)
        self.share = dataclasses.replace(
            self.share, host=host, rank_cpus=rank_cpus, gpus=gpus, interface=interface_of(host)
        )
        launch = self.kind.headless_launch(self.argv, self.share)
        # the node's envs and secret engine args, as the replica's server gets them, are not written to the log
        self.proc = start_watched(launch.argv, {**engine_env(self.env), **launch.env}, launch.env, self.log_path)
        return self.share

    def exit_code(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def log_excerpt(self) -> str:
        return cause_from_log(self.log_path)

    def workers(self, tp: int, pp: int) -> dict[int, int]:
        return worker_pids(self.kind, self.proc.pid, tp, pp, self.share) if self.proc else {}

    def stop(self) -> None:
        if self.proc is not None:
            terminate_engine(self.proc)
        if self.claim is not None:
            self.claim.release()
