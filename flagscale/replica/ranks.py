"""The ranks of one engine replica whose TP x PP x DP is above 1: which host runs which ranks, the cores each rank
gets on a CPU host, the processes of the ranks on other hosts, and the `ranks` of the replica's registry record.

One host: the replica's server runs every rank (vLLM's multiprocessing executor), each CPU rank on cores of its
own. Several hosts (a placement group, one bundle per host: cluster/placement.py): the replica's host runs the API
server and ranks 0..k-1; each other bundle gets a small Ray actor (RemoteRanks) on its host that starts that host's
headless ranks under engine_proc, so they die with the actor, and the actor dies with the replica that owns it.
The replica's health check asks every actor whether its ranks still run (docs/parallelism.md).
"""

from __future__ import annotations

import fcntl
import math
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil

from flagscale import engines
from flagscale.cluster.tempdirs import ensure_private_dir
from flagscale.engines.base import HostShare
from flagscale.replica.cpu_layout import affinity, process_tree
from flagscale.replica.process import cause_from_log, engine_env, spawn_engine, terminate_engine
from flagscale.replica.startup_lock import lock_dir

CORE_WAIT_S = 60.0  # a replica being replaced may still hold its cores this long (its drain and exit)
REMOTE_CALL_TIMEOUT_S = 30.0  # one call to a host's RemoteRanks actor
REMOTE_START_TIMEOUT_S = 120.0  # a host's RemoteRanks actor scheduled and its ranks' process started


class RankStartError(RuntimeError):
    pass


def split_ranks(world: int, nnodes: int) -> list[tuple[int, ...]]:
    """Global ranks per node rank: vLLM's multi-node executor runs world/nnodes consecutive ranks on each host."""
    if world % nnodes:
        raise ValueError(f"{world} ranks do not split evenly over {nnodes} hosts")
    per = world // nnodes
    return [tuple(range(node * per, (node + 1) * per)) for node in range(nnodes)]


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


def core_lock_path(core: int) -> Path:
    return lock_dir() / f"core-{core}.lock"


class CoreClaim:
    """Cores held for a replica's ranks on this host, one flock per core (in this user's private lock directory,
    shared by every replica on the host); the kernel drops them when the holder dies."""

    def __init__(self, cores: list[int], fds: list[int]):
        self.cores = cores
        self._fds = fds

    @classmethod
    def take(cls, count: int, timeout_s: float = CORE_WAIT_S, note: Callable[[str], None] = lambda _: None):
        """`count` cores of this process's allowed ones that no other replica holds, lowest first; waits up to
        `timeout_s` for them, then RankStartError naming what is held."""
        allowed = sorted(os.sched_getaffinity(0))
        if count > len(allowed):
            raise RankStartError(f"the ranks need {count} cores, but this host allows {len(allowed)}: {allowed}")
        ensure_private_dir(str(lock_dir()))
        deadline = time.monotonic() + timeout_s
        said = False
        while True:
            cores, fds = [], []
            for core in allowed:
                fd = os.open(core_lock_path(core), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    os.close(fd)
                    continue
                cores.append(core)
                fds.append(fd)
                if len(cores) == count:
                    return cls(cores, fds)
            for fd in fds:
                os.close(fd)
            if time.monotonic() > deadline:
                raise RankStartError(
                    f"the ranks need {count} cores of {allowed}, but only {cores} were not held by other "
                    f"replicas' ranks after {timeout_s:.0f}s (locks: {lock_dir()}/core-*.lock)"
                )
            if not said:
                note(f"waiting for {count} cores not held by another replica's ranks (up to {timeout_s:.0f}s)")
                said = True
            time.sleep(0.5)

    def per_rank(self, ranks: int) -> tuple[tuple[int, ...], ...]:
        """The cores split into `ranks` equal consecutive groups."""
        size = len(self.cores) // ranks
        return tuple(tuple(self.cores[i * size : (i + 1) * size]) for i in range(ranks))

    def release(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = []


@dataclass(frozen=True)
class HostPart:
    """One bundle of the replica's placement group: the host it landed on and what it reserves there."""

    bundle: int
    host: str
    resources: dict[str, float]


def placement_hosts() -> list[HostPart] | None:
    """The replica's placement group's bundles in order, with their hosts; None when it has none (one host)."""
    import ray

    group = ray.util.get_current_placement_group()
    if group is None:
        return None
    table = ray.util.placement_group_table(group)
    ips = {node["NodeID"]: node["NodeManagerAddress"] for node in ray.nodes()}
    return [
        HostPart(int(index), ips[table["bundles_to_node_id"][index]], dict(resources))
        for index, resources in sorted(table["bundles"].items(), key=lambda item: int(item[0]))
    ]


def actor_options(resources: dict[str, float]) -> dict:
    """Ray actor options that take a whole bundle's resources."""
    options: dict = {"num_cpus": resources.get("CPU", 0), "num_gpus": resources.get("GPU", 0)}
    custom = {k: v for k, v in resources.items() if k not in ("CPU", "GPU", "memory")}
    if custom:
        options["resources"] = custom
    if resources.get("memory"):
        options["memory"] = resources["memory"]
    return options


def spawn(argv: list[str], env: dict[str, str], log_path: Path, unshown_env: dict[str, str]) -> subprocess.Popen:
    """`argv` under engine_proc's watch, its own process group; `env` is written to the log, `unshown_env` (the
    node's envs and secret engine args, as the replica's server gets them) is not."""
    with open(log_path, "ab") as log:
        shown = " ".join(f"{k}={v}" for k, v in env.items())
        log.write(f"$ {shown} {' '.join(argv)}\n".encode())
        log.flush()
        return spawn_engine(argv, log, {**engine_env(unshown_env), **env})


class RemoteRanks:
    """A Ray actor on one of the replica's other hosts (in that host's bundle): runs the host's headless ranks.

    The ranks' process runs under engine_proc, which ends it when this actor's process goes; Ray ends this actor
    when the replica that created it goes."""

    def __init__(
        self, engine: str, argv: list[str], share: dict, cores_per_rank: int, log_path: str, env: dict[str, str]
    ):
        self.kind = engines.get(engine)
        self.env = env
        self.argv = argv
        self.share = share
        self.cores_per_rank = cores_per_rank
        self.log_path = Path(log_path)
        self.claim: CoreClaim | None = None
        self.proc: subprocess.Popen | None = None
        self.host_share: HostShare | None = None

    def start(self) -> dict:
        """Starts the ranks; returns {"host", "pid", "rank_cpus"}."""
        import ray

        host = ray.util.get_node_ip_address()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        ranks = len(self.share["ranks"])
        rank_cpus: tuple[tuple[int, ...], ...] = ()
        gpus = tuple(str(gpu) for gpu in ray.get_gpu_ids())
        if not gpus:
            self.claim = CoreClaim.take(ranks * self.cores_per_rank)
            rank_cpus = self.claim.per_rank(ranks)
        share = HostShare(
            host=host,
            node_rank=self.share["node_rank"],
            nnodes=self.share["nnodes"],
            ranks=tuple(self.share["ranks"]),
            rank_cpus=rank_cpus,
            gpus=gpus,
            master=tuple(self.share["master"]),
            interface=interface_of(host),
        )
        self.host_share = share
        launch = self.kind.headless_launch(self.argv, share)
        argv = [sys.executable, "-m", "flagscale.replica.engine_proc", *launch.argv]
        self.proc = spawn(argv, launch.env, self.log_path, self.env)
        return {"host": host, "pid": self.proc.pid, "rank_cpus": [list(c) for c in rank_cpus], "gpus": list(gpus)}

    def exit_code(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def log_excerpt(self) -> str:
        return cause_from_log(self.log_path)

    def workers(self, tp: int, pp: int) -> dict[int, int]:
        return worker_pids(self.kind, self.proc.pid, tp, pp, self.host_share) if self.proc else {}

    def stop(self) -> None:
        if self.proc is not None:
            terminate_engine(self.proc)
        if self.claim is not None:
            self.claim.release()


@dataclass
class RemoteHost:
    part: HostPart
    share: dict
    actor: object
    log_path: str
    started: dict | None = None


class ReplicaRanks:
    """The ranks of one replica (world > 1): the share of its own host, and the other hosts' RemoteRanks."""

    def __init__(self, engine: str, parallel: tuple[int, int, int], host: str, cpus_reserved: float):
        self.engine = engine
        self.tp, self.pp, self.dp = parallel
        self.world = self.tp * self.pp * self.dp
        self.host = host
        self.cpus_reserved = cpus_reserved
        self.claim: CoreClaim | None = None
        self.remote: list[RemoteHost] = []
        self.local: HostShare | None = None

    def start(
        self,
        argv: list[str],
        gpus: list[str],
        master_port: Callable[[], int],
        log_path: Path,
        env: dict[str, str],
        note: Callable[[str], None],
    ) -> HostShare:
        """Places the ranks, starts the other hosts' ranks, and returns this host's share (node rank 0)."""
        parts = placement_hosts() or []
        nnodes = max(1, len(parts))
        per_host = split_ranks(self.world, nnodes)
        local_ranks = per_host[0]
        cores_per_rank = max(1, int(self.cpus_reserved) // len(local_ranks))
        rank_cpus: tuple[tuple[int, ...], ...] = ()
        if not gpus:
            self.claim = CoreClaim.take(len(local_ranks) * cores_per_rank, note=note)
            rank_cpus = self.claim.per_rank(len(local_ranks))
        master = (self.host, master_port()) if nnodes > 1 else None
        self.local = HostShare(
            host=self.host,
            node_rank=0,
            nnodes=nnodes,
            ranks=local_ranks,
            rank_cpus=rank_cpus,
            gpus=tuple(gpus),
            master=master,
            interface=interface_of(self.host) if nnodes > 1 else None,
        )
        if nnodes > 1:
            self._start_remote(parts[1:], per_host[1:], master, argv, cores_per_rank, log_path, env, note)
        return self.local

    def _start_remote(self, parts, per_host, master, argv, cores_per_rank, log_path: Path, env, note) -> None:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        group = ray.util.get_current_placement_group()
        actor_class = ray.remote(RemoteRanks)
        for node_rank, (part, ranks) in enumerate(zip(parts, per_host, strict=True), start=1):
            share = {"node_rank": node_rank, "nnodes": len(parts) + 1, "ranks": list(ranks), "master": list(master)}
            host_log = str(log_path.with_name(f"{log_path.stem}-node{node_rank}{log_path.suffix}"))
            actor = actor_class.options(
                **actor_options(part.resources),
                scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=part.bundle),
            ).remote(self.engine, argv, share, cores_per_rank, host_log, env)
            self.remote.append(RemoteHost(part, share, actor, host_log))
            note(f"node rank {node_rank} (ranks {list(ranks)}) on {part.host}: log {host_log}")
        for remote in self.remote:
            try:
                remote.started = ray.get(remote.actor.start.remote(), timeout=REMOTE_START_TIMEOUT_S)
            except ray.exceptions.GetTimeoutError:
                raise RankStartError(
                    f"the ranks on {remote.part.host} did not start within {REMOTE_START_TIMEOUT_S:.0f}s "
                    f"(its RemoteRanks actor in bundle {remote.part.bundle}); log {remote.log_path}"
                ) from None
            except ray.exceptions.RayError as exc:
                raise RankStartError(f"the ranks on {remote.part.host} could not start: {exc}") from None

    def check(self) -> None:
        """RankStartError when the ranks of another host exited or their actor is gone."""
        import ray

        for remote in self.remote:
            try:
                code = ray.get(remote.actor.exit_code.remote(), timeout=REMOTE_CALL_TIMEOUT_S)
            except ray.exceptions.GetTimeoutError:
                raise RankStartError(
                    f"the ranks on {remote.part.host} did not answer within {REMOTE_CALL_TIMEOUT_S:.0f}s"
                ) from None
            except ray.exceptions.RayError as exc:
                raise RankStartError(f"the ranks' actor on {remote.part.host} is gone: {exc}") from None
            if code is not None:
                try:
                    why = ray.get(remote.actor.log_excerpt.remote(), timeout=REMOTE_CALL_TIMEOUT_S)
                except ray.exceptions.RayError:
                    why = "(log unreadable)"
                raise RankStartError(
                    f"the ranks on {remote.part.host} exited with code {code}; log {remote.log_path}:\n{why}"
                )

    def records(self, server_pid: int) -> list[dict]:
        """The registry record's `ranks`: rank, worker pid, host, cores, GPUs."""
        import ray

        out = []
        shares = [(self.local, worker_pids(engines.get(self.engine), server_pid, self.tp, self.pp, self.local))]
        for remote in self.remote:
            try:
                pids = ray.get(remote.actor.workers.remote(self.tp, self.pp), timeout=REMOTE_CALL_TIMEOUT_S)
            except ray.exceptions.RayError:
                pids = {}
            started = remote.started or {}
            share = HostShare(
                host=started.get("host", remote.part.host),
                node_rank=remote.share["node_rank"],
                nnodes=remote.share["nnodes"],
                ranks=tuple(remote.share["ranks"]),
                rank_cpus=tuple(tuple(c) for c in started.get("rank_cpus", [])),
                gpus=tuple(started.get("gpus", [])),
            )
            shares.append((share, pids))
        for share, pids in shares:
            if share is None:
                continue
            for index, rank in enumerate(share.ranks):
                out.append(
                    {
                        "rank": rank,
                        "pid": pids.get(rank),
                        "host": share.host,
                        "cpus": list(share.rank_cpus[index]) if share.rank_cpus else [],
                        "gpus": [share.gpus[index]] if index < len(share.gpus) else [],
                    }
                )
        return out

    def cores(self) -> list[int]:
        return list(self.claim.cores) if self.claim else []

    def stop(self) -> None:
        """Stops the other hosts' ranks (bounded), then lets go of this host's cores."""
        import ray

        for remote in self.remote:
            try:
                ray.get(remote.actor.stop.remote(), timeout=REMOTE_CALL_TIMEOUT_S)
            except ray.exceptions.RayError:
                pass
            try:
                ray.kill(remote.actor)
            except Exception:
                pass
        self.remote = []
        if self.claim is not None:
            self.claim.release()
            self.claim = None


@dataclass(frozen=True)
class PlannedHost:
    """dryrun: one host of one replica, as the plan expects it (Ray picks the actual hosts at start)."""

    replica: int
    host: str
    share: HostShare
    devices: str  # "GPUs 0-7" / "1 core per rank, taken at start"


def preview(
    parallel: tuple[int, int, int], on_gpu: bool, ranks_per_host: int, hosts: list[tuple[str, int]], replicas: int
) -> list[PlannedHost]:
    """Where each replica's ranks would go: replicas take hosts with free slots first-fit, in the hostfile's order
    (`hosts`: (name, slots)); the master port is 0 here (a free one is picked at start)."""
    world = math.prod(parallel)
    nnodes = max(1, world // max(1, ranks_per_host))
    per_host = split_ranks(world, nnodes)
    free = dict(hosts)
    out = []
    for replica in range(replicas):
        chosen = [name for name, _ in hosts if free[name] >= ranks_per_host][:nnodes]
        if len(chosen) < nnodes:
            break
        for node_rank, (name, ranks) in enumerate(zip(chosen, per_host, strict=True)):
            first = dict(hosts)[name] - free[name]  # devices of a host are taken in order
            free[name] -= ranks_per_host
            share = HostShare(
                host=name,
                node_rank=node_rank,
                nnodes=nnodes,
                ranks=ranks,
                gpus=tuple(str(first + i) for i in range(len(ranks))) if on_gpu else (),
                master=(chosen[0], 0) if nnodes > 1 else None,
                interface="<its interface>" if nnodes > 1 else None,
            )
            devices = f"GPUs {first}-{first + len(ranks) - 1}" if on_gpu else "a core per rank, taken at start"
            out.append(PlannedHost(replica, name, share, devices))
    return out
