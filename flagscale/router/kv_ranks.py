"""The data-parallel ranks of a replica, as routing on the engines' KV events sees them (docs/routing.md, "A replica
of several data-parallel engines").

vLLM's server of DP engines (`data_parallel_size` > 1: one API server, an engine core per rank, each with a KV
cache of its own) publishes a KV-event stream per rank, on the record's ports plus the rank (`kv_events.ranks`).
The router follows each rank's stream into an index of its own (a *part* of the replica), routes to the replica
as a whole (its depth: its deepest rank's), then picks a rank within it and pins the request there with the
`X-data-parallel-rank` header, which vLLM's server passes to its engine client in place of its own DP balancer.

Pure logic: a record's parts, the choice of a rank, the statistics of a replica's ranks together.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

RANK_HEADER = "X-data-parallel-rank"  # vLLM's server reads it (case-insensitively) on completions and chat


def part_id(replica_id: str, rank: int) -> str:
    """The index id of one DP rank of a replica (a replica of one engine is indexed under its own id)."""
    return f"{replica_id}/dp{rank}"


def parts(replica_id: str, info: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(index id, the kv_events info of that rank's stream) per rank, in rank order: one, under the replica's own
    id, for a single engine (or a record from before ranks were listed)."""
    ranks = info.get("ranks") or []
    if len(ranks) <= 1:
        return [(replica_id, info)]
    return [(part_id(replica_id, rank), {**info, **ends}) for rank, ends in enumerate(ranks)]


@dataclass
class RankLoad:
    """What this router process pinned to one rank: requests in flight there, and sent there in all."""

    inflight: int = 0
    sent: int = 0


def pick_rank(
    depths: list[float],
    loads: list[RankLoad],
    block_tokens: int,
    prompt_tokens: int,
    balance_abs_threshold: int,
    cache_threshold: float,
) -> int:
    """The rank a request goes to, as cache_aware picks a replica: the one holding most of its prompt (`depths`,
    in blocks, the CPU tier weighted), unless its in-flight requests exceed the least busy rank's by more than
    `balance_abs_threshold`, or it holds less than `cache_threshold` of the prompt: then the least busy rank
    (fewest sent on a tie). Equally deep ranks: the less busy one."""
    ranks = range(len(depths))
    least_busy = min(ranks, key=lambda r: (loads[r].inflight, loads[r].sent))
    deepest = max(ranks, key=lambda r: (depths[r], -loads[r].inflight, -loads[r].sent))
    if depths[deepest] <= 0 or loads[deepest].inflight > loads[least_busy].inflight + balance_abs_threshold:
        return least_busy
    if depths[deepest] * block_tokens < cache_threshold * prompt_tokens:
        return least_busy
    return deepest


def with_headers(headers: dict[str, str], extra: dict[str, str]) -> dict[str, str]:
    """`headers` with `extra` set, replacing any of the same name in another case (a client's own rank header)."""
    if not extra:
        return headers
    names = {name.lower() for name in extra}
    return {**{k: v for k, v in headers.items() if k.lower() not in names}, **extra}


SUMMED = ("blocks", "events_per_s", "replays", "gaps", "lost", "restarts", "evicted", "memory_bytes")


def ranks_stats(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """One replica's index over its ranks: counts summed, its last sequence per rank, live when every rank is
    (its state the worst rank's), and each rank's own (`ranks`)."""
    states = [stats["state"] for stats in per_rank]
    state = next((s for s in ("syncing", "silent") if s in states), "live")
    summed = {key: round(sum(stats[key] for stats in per_rank), 2) for key in SUMMED}
    return {
        **summed,
        "last_seq": [stats["last_seq"] for stats in per_rank],
        "live": all(stats["live"] for stats in per_rank),
        "state": state,
        "ranks": per_rank,
    }
