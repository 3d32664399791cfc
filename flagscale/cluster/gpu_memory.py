"""GPU memory, checked before anything starts: replicas sharing a GPU fit its memory together, an engine's
weights (and a KV cache sized in its args) fit its share of each GPU, and this machine has the GPUs the replicas
reserve."""

from __future__ import annotations

import math

from flagscale.cluster.placement import Target
from flagscale.errors import ConfigError

# The most gpu_memory_utilization that replicas sharing one GPU may ask for together (the rest is CUDA context and
# allocator slack outside any one engine's accounting); a replica's own default is its engine kind's.
MAX_SHARED_GPU_MEMORY_UTILIZATION = 0.95
GIB = 1024**3


def check_gpu_share(
    serve_id: str, gpus_per_replica: float, devices: int, replicas: int, utilization: float, where: str
) -> None:
    """Replicas with a fraction of a GPU: the fraction must divide a GPU, and the replicas that share one must not
    promise vLLM more than the GPU's memory together."""
    if gpus_per_replica <= 0 or gpus_per_replica == int(gpus_per_replica):
        return
    if gpus_per_replica > 1:
        raise ConfigError(f"num_gpus={gpus_per_replica:g}: a replica takes whole GPUs or a fraction 1/k of one", where)
    per_gpu = round(1 / gpus_per_replica)
    if abs(per_gpu * gpus_per_replica - 1) > 1e-6:
        raise ConfigError(
            f"num_gpus={gpus_per_replica:g} does not divide a GPU: use 1/k (0.5, 0.25, 0.2, ...) so "
            "that k replicas share one",
            where,
        )
    if devices > 1:
        raise ConfigError(
            f"num_gpus={gpus_per_replica:g} with TP x PP x DP = {devices}: a replica that spans GPUs needs whole GPUs",
            where,
        )
    sharing = min(replicas, per_gpu)
    if sharing * utilization > MAX_SHARED_GPU_MEMORY_UTILIZATION:
        raise ConfigError(
            f"'{serve_id}': {sharing} replica(s) share a GPU (num_gpus={gpus_per_replica:g}) x gpu_memory_utilization "
            f"{utilization:g} = {sharing * utilization:.2f} of its memory > {MAX_SHARED_GPU_MEMORY_UTILIZATION}; "
            f"set gpu_memory_utilization <= {MAX_SHARED_GPU_MEMORY_UTILIZATION / sharing:.2f}",
            where,
        )


def check_shared_gpus_across_nodes(shares: list[tuple[str, float, float, int]], where: str) -> None:
    """Replicas of different nodes with fractions of a GPU may be packed onto one GPU by Ray: the mix that fits one
    GPU (fractions summing to at most 1) and promises vLLM the most memory must still fit. `shares`: per node,
    (serve_id, num_gpus per replica, gpu_memory_utilization, replicas)."""
    fractional = [(sid, f, u, n) for sid, f, u, n in shares if 0 < f < 1]
    if len({sid for sid, *_ in fractional}) < 2:
        return  # one node's own sharing is check_gpu_share's
    units = math.lcm(*(round(1 / f) for _, f, _, _ in fractional))
    # best[c] = (most utilization within c units of one GPU, the replicas giving it)
    best: list[tuple[float, list[str]]] = [(0.0, [])] * (units + 1)
    for sid, f, u, n in fractional:
        size = round(units * f)
        for _ in range(min(n, round(1 / f))):  # bounded knapsack: this node's replicas one by one
            for c in range(units, size - 1, -1):
                candidate = best[c - size][0] + u
                if candidate > best[c][0] + 1e-12:
                    best[c] = (candidate, best[c - size][1] + [sid])
    total, mix = best[units]
    if total > MAX_SHARED_GPU_MEMORY_UTILIZATION and len(set(mix)) > 1:
        terms = " + ".join(
            f"{sid} ({next(f for s, f, _, _ in fractional if s == sid):g} GPU, "
            f"utilization {next(u for s, _, u, _ in fractional if s == sid):g})"
            for sid in mix
        )
        raise ConfigError(
            f"replicas of different nodes may share one GPU: {terms} = {total:.2f} of its memory > "
            f"{MAX_SHARED_GPU_MEMORY_UTILIZATION}; lower their gpu_memory_utilization (each at most "
            f"{MAX_SHARED_GPU_MEMORY_UTILIZATION} x its num_gpus always fits)",
            where,
        )


def check_weights_fit(
    weight_bytes: int | None, tp: int, pp: int, utilization: float, target: Target, where: str
) -> None:
    """The checkpoint's weights, split over TP x PP GPUs, must fit the GPU memory the config gives each engine."""
    if weight_bytes is None or not target.gpu_memory_mib:
        return
    per_gpu = weight_bytes / (tp * pp)
    if per_gpu > _budget(utilization, target):
        raise ConfigError(
            f"the weights do not fit: {weight_bytes / GIB:.1f} GiB / (TP {tp} x PP {pp}) = {per_gpu / GIB:.1f} GiB per "
            f"GPU > {_share(utilization, target)}",
            where,
        )


def check_kv_cache_fit(
    kv_cache_bytes: int, weight_bytes: int | None, tp: int, pp: int, utilization: float, target: Target, where: str
) -> None:
    """A KV cache sized in the engine args (bytes per GPU) must fit the engine's share of each GPU beside its part
    of the weights: the engine takes it whatever gpu_memory_utilization says, which the replicas sharing the GPU
    were fitted by."""
    if not target.gpu_memory_mib:
        return
    per_gpu = (weight_bytes or 0) / (tp * pp)
    if per_gpu + kv_cache_bytes > _budget(utilization, target):
        weights = f"the weights' {per_gpu / GIB:.1f} GiB per GPU + " if weight_bytes else ""
        raise ConfigError(
            f"the KV cache does not fit: {weights}{kv_cache_bytes / GIB:.1f} GiB of KV cache > "
            f"{_share(utilization, target)}; raise gpu_memory_utilization or make the cache smaller",
            where,
        )


def _budget(utilization: float, target: Target) -> float:
    return utilization * target.gpu_memory_mib * 1024**2


def _share(utilization: float, target: Target) -> str:
    gib = target.gpu_memory_mib / 1024
    return f"gpu_memory_utilization {utilization:g} x {gib:.1f} GiB = {_budget(utilization, target) / GIB:.1f} GiB"


def check_gpu_demand(demand: list[tuple[str, int, float]], target: Target, where: str) -> None:
    """This machine: the GPUs every engine's replicas reserve together (Serve would leave the rest pending)."""
    if target.hostfile is not None or target.ray is not None or target.gpus == 0:
        return  # a Ray cluster's GPUs are counted per node by its placement (ray_existing.place)
    total = sum(replicas * gpus for _, replicas, gpus in demand if gpus)
    if total > target.gpus + 1e-9:
        terms = " + ".join(f"{serve_id}: {replicas} x {gpus:g}" for serve_id, replicas, gpus in demand if gpus)
        raise ConfigError(f"the replicas reserve {terms} = {total:g} GPU(s), but this machine has {target.gpus}", where)
