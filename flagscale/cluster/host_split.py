"""How many hosts one replica's ranks span when they fit no single host, and which ranks each host then runs:
TP x PP split evenly (vLLM's multi-node executor), or whole data-parallel ranks per host (vLLM's multi-node data
parallel, for expert parallelism). Pure arithmetic over the hosts' slots."""

from __future__ import annotations

from flagscale.errors import ConfigError

__all__ = ["hosts_to_span"]


def hosts_to_span(parallel: tuple[int, int, int], slots: list[int], args_where: str, spread_dp: bool = False) -> int:
    """How many hosts one replica's ranks span: the fewest that vLLM's multi-node executor can split them over
    (the same number of consecutive ranks on each host, so the host count divides TP x PP), each with that many
    free slots. With `spread_dp` (expert parallel), whole data-parallel ranks go to each host instead. A
    ConfigError names the arithmetic when no such split exists."""
    tp, pp, dp = parallel
    world = tp * pp
    if dp > 1 and spread_dp:
        return _hosts_for_dp(parallel, slots, args_where)
    if dp > 1:
        raise ConfigError(
            f"data_parallel_size={dp} with TP x PP = {world} over several hosts: one replica spans hosts only "
            "with TP x PP, or with data parallel for expert parallelism (enable_expert_parallel); run "
            "data-parallel copies as replicas (resources.num_replicas)",
            args_where,
        )
    nnodes, tried = _fewest_hosts(world, 1, slots)
    if nnodes:
        return nnodes
    why = (
        "; ".join(f"{n} hosts need {world // n} slots each" for n in tried)
        or f"no host count from 2 to {len(slots)} divides it (vLLM runs the same number of ranks on each host)"
    )
    raise ConfigError(
        f"TP x PP = {tp} x {pp} = {world} ranks do not split over the hosts (slots {', '.join(map(str, slots))}): "
        f"{why}",
        args_where,
    )


def _hosts_for_dp(parallel: tuple[int, int, int], slots: list[int], args_where: str) -> int:
    """vLLM's multi-node data parallel (`--data-parallel-size-local`): the fewest hosts that take an equal number
    of whole DP ranks (each TP x PP ranks, on one host) each."""
    tp, pp, dp = parallel
    world = tp * pp
    if world > max(slots):
        raise ConfigError(
            f"TP x PP = {tp} x {pp} = {world} GPUs per data-parallel rank, but the largest host has {max(slots)} "
            "slots: each DP rank's TP x PP stays on one host when data parallel spans hosts",
            args_where,
        )
    nnodes, tried = _fewest_hosts(dp, world, slots)
    if nnodes:
        return nnodes
    why = (
        "; ".join(f"{n} hosts need {dp // n} x {world} = {dp // n * world} slots each" for n in tried)
        or f"no host count from 2 to {len(slots)} divides it (each host runs the same number of DP ranks)"
    )
    raise ConfigError(
        f"data_parallel_size={dp} (TP x PP = {world} each) does not split over the hosts (slots "
        f"{', '.join(map(str, slots))}): {why}",
        args_where,
    )


def _fewest_hosts(units: int, unit_slots: int, slots: list[int]) -> tuple[int | None, list[int]]:
    """The fewest hosts (from 2) that take an equal share of `units` (each `unit_slots` slots), each host with room
    for its share; None if none does, with the host counts that divide `units` (for the error)."""
    tried = [n for n in range(2, len(slots) + 1) if units % n == 0]
    for nnodes in tried:
        if sum(1 for free in slots if free >= units // nnodes * unit_slots) >= nnodes:
            return nnodes, tried
    return None, tried
