"""Which host runs which ranks of a replica: the split of its world over the hosts it spans, and dryrun's preview
of where each replica's ranks would go (pure: Ray picks the actual hosts at start)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from flagscale.engines.base import HostShare


def split_ranks(world: int, nnodes: int) -> list[tuple[int, ...]]:
    """Global ranks per node rank: vLLM's multi-node executor runs world/nnodes consecutive ranks on each host."""
    if world % nnodes:
        raise ValueError(f"{world} ranks do not split evenly over {nnodes} hosts")
    per = world // nnodes
    return [tuple(range(node * per, (node + 1) * per)) for node in range(nnodes)]


def dp_split(parallel: tuple[int, int, int], nnodes: int, node_rank: int) -> tuple[int, int]:
    """(DP ranks on this host, the first one's DP rank) when data parallel spans the hosts (whole DP ranks per
    host: vLLM's --data-parallel-size-local / --data-parallel-start-rank), else (0, 0)."""
    dp = parallel[2]
    if nnodes <= 1 or dp <= 1:
        return (0, 0)
    local = dp // nnodes
    return (local, node_rank * local)


def rank_indexes(rank: int, parallel: tuple[int, int, int], expert_parallel: bool) -> dict[str, int]:
    """A global rank's place in vLLM's groups (rank = dp x TP x PP + pp x TP + tp): its DP rank, and with expert
    parallel its EP rank (the EP group is DP x TP of one pipeline stage: ep = dp x TP + tp)."""
    tp, pp, _dp = parallel
    dp_rank = rank // (tp * pp)
    indexes = {"dp": dp_rank}
    if expert_parallel:
        indexes["ep"] = dp_rank * tp + rank % tp
    return indexes


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
            dp_local, dp_start = dp_split(parallel, nnodes, node_rank)
            share = HostShare(
                host=name,
                node_rank=node_rank,
                nnodes=nnodes,
                ranks=ranks,
                gpus=tuple(str(first + i) for i in range(len(ranks))) if on_gpu else (),
                master=(chosen[0], 0) if nnodes > 1 else None,
                interface="<its interface>" if nnodes > 1 else None,
                dp_local=dp_local,
                dp_start=dp_start,
            )
            devices = f"GPUs {first}-{first + len(ranks) - 1}" if on_gpu else "a core per rank, taken at start"
            out.append(PlannedHost(replica, name, share, devices))
    return out
