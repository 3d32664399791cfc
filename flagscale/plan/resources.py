"""What the planned replicas ask of the target as a whole: the GPUs they reserve (and share), the logical CPUs the
head's Ray node must declare for them, and how many router processes the endpoint gets."""

from __future__ import annotations

import math

from flagscale.cluster.gpu_memory import check_gpu_demand, check_shared_gpus_across_nodes
from flagscale.cluster.placement import Target
from flagscale.config.graph import CustomNodePlan, GraphPlan
from flagscale.launchers.base import CpuDemand
from flagscale.plan.types import EnginePlan


def check_gpus(engine_plans: list[EnginePlan], graph: GraphPlan | None, target: Target, serve_file: str) -> None:
    """The GPUs every replica asks for exist on the target; replicas sharing a GPU fit its memory together."""
    groups = [*engine_plans, *(graph.nodes if graph else [])]
    check_gpu_demand(
        [(g.serve_id, g.initial_replicas, g.ray_actor_options.get("num_gpus", 0)) for g in groups], target, serve_file
    )
    if target.hostfile is None:
        check_shared_gpus_across_nodes(
            [
                (e.serve_id, e.ray_actor_options.get("num_gpus", 0), e.gpu_memory_utilization, e.initial_replicas)
                for e in engine_plans
                if e.gpu_memory_utilization is not None
            ],
            serve_file,
        )


def cpu_demand(engine_plans: list[EnginePlan], replica_groups: list[EnginePlan | CustomNodePlan]) -> CpuDemand:
    """The logical CPUs the replicas reserve at start, and the room they may need later."""
    required_cpus = sum(e.initial_replicas * e.ray_actor_options["num_cpus"] for e in replica_groups)
    # Room for the most replicas autoscaling may start, and for one spare engine replica: an in-place update
    # starts each new replica before the old one drains (flagscale/serve/app.py).
    most_cpus = sum(e.most_replicas * e.ray_actor_options["num_cpus"] for e in replica_groups)
    spare_cpus = max((e.ray_actor_options["num_cpus"] for e in engine_plans), default=0)
    room = int(-(-(most_cpus + spare_cpus) // 1))
    terms = " + ".join(
        f"{e.serve_id}: {e.initial_replicas} x {e.ray_actor_options['num_cpus']:g}" for e in replica_groups
    )
    return CpuDemand(required_cpus, room, terms)


def default_router_processes(engine_plans: list[EnginePlan], head_cpus: int) -> int:
    """One router process relays ~20k streamed tokens/s (one core, ~50 us each: docs/benchmarks.md), about one
    GPU's worth of a small model: one per GPU the engines may use, at least one, at most a quarter of the head's
    cores."""
    gpus = sum(e.most_replicas * e.ray_actor_options.get("num_gpus", 0) for e in engine_plans)
    return max(1, min(math.ceil(gpus), head_cpus // 4))
