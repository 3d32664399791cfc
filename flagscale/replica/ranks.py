"""The ranks of one engine replica whose TP x PP x DP is above 1, across the hosts it spans: this host's share,
the other hosts' RemoteRanks actors, their health, and the `ranks` of the replica's registry record.

One host: the replica's server runs every rank (vLLM's multiprocessing executor), each CPU rank on cores of its
own (replica/cores.py). Several hosts (a placement group, one bundle per host: replica/bundles.py): the replica's
host runs the API server and ranks 0..k-1 (rank_layout.py: the split); each other bundle gets a small Ray actor
(host_ranks.py: RemoteRanks) on its host that starts that host's headless ranks under engine_proc, so they die
with the actor, and the actor dies with the replica that owns it. The replica's health check asks every actor
whether its ranks still run (docs/parallelism.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from flagscale import engines
from flagscale.adaptors import ray, ray_scheduling
from flagscale.devices import DeviceFamily
from flagscale.engines.base import HostShare
from flagscale.replica.bundles import HostPart, actor_options, placement_hosts
from flagscale.replica.cores import CoreClaim, RankStartError
from flagscale.replica.host_ranks import RemoteRanks, interface_of, worker_pids
from flagscale.replica.rank_layout import dp_split, rank_indexes, split_ranks

REMOTE_CALL_TIMEOUT_S = 30.0  # one call to a host's RemoteRanks actor
REMOTE_START_TIMEOUT_S = 120.0  # a host's RemoteRanks actor scheduled and its ranks' process started


@dataclass
class RemoteHost:
    """One other host of the replica: its bundle, the share the replica gave it, its actor and log."""

    part: HostPart
    share: HostShare  # as decided here; `started`: as the actor started it (its IP, cores, GPUs)
    actor: object
    log_path: str
    started: HostShare | None = None


class ReplicaRanks:
    """The ranks of one replica (world > 1): the share of its own host, and the other hosts' RemoteRanks."""

    def __init__(
        self,
        engine: str,
        parallel: tuple[int, int, int],
        host: str,
        cpus_reserved: float,
        expert_parallel: bool = False,
        family: DeviceFamily | None = None,
    ):
        self.engine = engine
        # every host's share names the devices' family: Ray's resource for them and the variable that shows them
        self.device_fields = (
            {
                "visible_env": family.visible_env,
                "device_resource": family.ray_resource,
                "interface_env": family.collective.interface_env,
            }
            if family is not None and family.ray_resource and family.visible_env
            else {}
        )
        self.parallel = parallel
        self.expert_parallel = expert_parallel
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
        master = (self.host, master_port()) if nnodes > 1 else None  # DP spread over hosts: the DP RPC port
        dp_local, dp_start = dp_split(self.parallel, nnodes, 0)
        self.local = HostShare(
            host=self.host,
            node_rank=0,
            nnodes=nnodes,
            ranks=local_ranks,
            rank_cpus=rank_cpus,
            gpus=tuple(gpus),
            master=master,
            interface=interface_of(self.host) if nnodes > 1 else None,
            dp_local=dp_local,
            dp_start=dp_start,
            **self.device_fields,
        )
        if nnodes > 1:
            self._start_remote(parts[1:], per_host[1:], master, argv, cores_per_rank, log_path, env, note)
        return self.local

    def _start_remote(self, parts, per_host, master, argv, cores_per_rank, log_path: Path, env, note) -> None:
        group = ray.util.get_current_placement_group()
        actor_class = ray.remote(RemoteRanks)
        for node_rank, (part, ranks) in enumerate(zip(parts, per_host, strict=True), start=1):
            nnodes = len(parts) + 1
            dp_local, dp_start = dp_split(self.parallel, nnodes, node_rank)
            share = HostShare(
                part.host,
                node_rank,
                nnodes,
                ranks,
                master=master,
                dp_local=dp_local,
                dp_start=dp_start,
                **self.device_fields,
            )
            host_log = str(log_path.with_name(f"{log_path.stem}-node{node_rank}{log_path.suffix}"))
            actor = actor_class.options(
                **actor_options(part.resources),
                scheduling_strategy=ray_scheduling.PlacementGroupSchedulingStrategy(
                    group, placement_group_bundle_index=part.bundle
                ),
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
        """The registry record's `ranks`: rank, worker pid, host, cores, GPUs, DP rank (and EP rank)."""
        shares = []
        if self.local is not None:
            shares.append((self.local, worker_pids(engines.get(self.engine), server_pid, self.tp, self.pp, self.local)))
        for remote in self.remote:
            try:
                pids = ray.get(remote.actor.workers.remote(self.tp, self.pp), timeout=REMOTE_CALL_TIMEOUT_S)
            except ray.exceptions.RayError:
                pids = {}
            shares.append((remote.started or remote.share, pids))
        return [
            {**record, **rank_indexes(record["rank"], self.parallel, self.expert_parallel)}
            for share, pids in shares
            for record in _rank_records(share, pids)
        ]

    def cores(self) -> list[int]:
        return list(self.claim.cores) if self.claim else []

    def stop(self) -> None:
        """Stops the other hosts' ranks (bounded), then lets go of this host's cores."""
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


def _rank_records(share: HostShare, pids: dict[int, int]) -> list[dict]:
    return [
        {
            "rank": rank,
            "pid": pids.get(rank),
            "host": share.host,
            "cpus": list(share.rank_cpus[index]) if share.rank_cpus else [],
            "gpus": [share.gpus[index]] if index < len(share.gpus) else [],
        }
        for index, rank in enumerate(share.ranks)
    ]
