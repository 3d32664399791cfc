"""Every engine node of `serve`, planned: each node's deployments (one, or a prefill and a decode pool), with the
serve_ids and the served model names checked unique, and what dryrun notes about them."""

from __future__ import annotations

import json
from dataclasses import dataclass

from flagscale import devices
from flagscale.config.schema import NodeConfig
from flagscale.errors import ConfigError
from flagscale.plan.engine_plan import node_args_ips, plan_engine
from flagscale.plan.inputs import PlanInputs
from flagscale.plan.pools import pools_of
from flagscale.plan.sleep import sleep_note
from flagscale.plan.types import EnginePlan


@dataclass(frozen=True)
class EngineNodes:
    deployments: list[tuple[EnginePlan, NodeConfig]]  # every engine deployment, with the node it comes from
    notes: list[str]  # for dryrun
    serve_index: dict[str, int]  # serve_id -> its index in `serve` (custom nodes too)

    @property
    def plans(self) -> list[EnginePlan]:
        return [engine for engine, _node in self.deployments]


def plan_engine_nodes(inputs: PlanInputs) -> EngineNodes:
    ips = node_args_ips(inputs)
    serve_index: dict[str, int] = {}
    served_by: dict[str, str] = {}  # served model name -> the serve_id of the node that serves it
    deployments: list[tuple[EnginePlan, NodeConfig]] = []
    notes: list[str] = []
    for index, node in enumerate(inputs.config.serve):
        if node.serve_id in serve_index:
            raise ConfigError(
                f"duplicate serve_id '{node.serve_id}' (also serve[{serve_index[node.serve_id]}])",
                f"{inputs.serve_file}: serve[{index}]",
            )
        serve_index[node.serve_id] = index
        if not node.is_engine:
            continue  # custom nodes: config.graph.build_graph_plan
        where = inputs.node_where(index)
        pools = pools_of(node, inputs.config, where, inputs.sources.main, inputs.on_cpu)
        engine_plans = [plan_engine(pool, node.serve_id, inputs, ips) for pool in pools]
        check_pools_across_families(engine_plans, f"{where}.disaggregation")
        for engine in engine_plans:
            deployments.append((engine, node))
            notes += _notes(engine, node) + sleep_note(engine.serve_id, engine.sleep_delay_s, engine.kind)
        for name in [*engine_plans[0].model_names, *engine_plans[0].adapters]:
            if name in served_by:
                raise ConfigError(
                    f"served model name '{name}' is used by both '{served_by[name]}' and '{node.serve_id}'", where
                )
            served_by[name] = node.serve_id
    return EngineNodes(deployments, notes, serve_index)


def check_pools_across_families(engine_plans: list[EnginePlan], where: str) -> None:
    """Prefill on one device family and decode on another: planned when both move KV caches with the connector the
    node uses (NIXL between NVIDIA and AMD), refused otherwise, naming both families and what each has."""
    if len(engine_plans) != 2 or engine_plans[0].family == engine_plans[1].family:
        return
    prefill, decode = (devices.get(engine.family) for engine in engine_plans)
    connector = _kv_connector(engine_plans[0].argv)
    if connector in prefill.kv_connectors and connector in decode.kv_connectors:
        return
    have = "; ".join(f"{f.name}: {', '.join(sorted(f.kv_connectors)) or 'none declared'}" for f in (prefill, decode))
    raise ConfigError(
        f"prefill on {prefill.title}s ({prefill.name}) and decode on {decode.title}s ({decode.name}) cannot pass KV "
        f"caches with {connector or 'no kv_connector'}: a connector both families run is needed ({have})",
        where,
    )


def _kv_connector(argv: list[str]) -> str | None:
    for index, arg in enumerate(argv):
        value = argv[index + 1] if arg == "--kv-transfer-config" and index + 1 < len(argv) else None
        if arg.startswith("--kv-transfer-config="):
            value = arg.partition("=")[2]
        if value:
            try:
                return json.loads(value).get("kv_connector")
            except (ValueError, AttributeError):
                return None
    return None


def _notes(engine: EnginePlan, node: NodeConfig) -> list[str]:
    """What dryrun says about a deployment: what `num_replicas: auto` came to, where a pool's replicas go."""
    notes = []
    if engine.num_replicas is not None and node.resources.num_replicas == "auto":
        notes.append(
            f"serve '{engine.serve_id}': num_replicas auto -> {engine.num_replicas} "
            f"({engine.devices_per_replica} {engine.device} device(s) per replica)"
        )
    if engine.lora:
        notes.append(
            f"serve '{node.serve_id}': LoRA adapters {', '.join(engine.adapters) or '(none yet)'}, each a model; "
            f"max_loras {engine.lora.max_loras} per replica"
        )
    notes += _shared_gpu_start(engine)
    if engine.role:
        where = f"on host {engine.pinned_host}" if engine.pinned_host else "placed by Ray"
        where += engine.kind.pool_note(engine.device, engine.argv)
        notes.append(
            f"serve '{node.serve_id}': {engine.role} pool '{engine.serve_id}', "
            f"{engine.describe_replicas()} replica(s), {where}, routing {engine.routing.policy}"
        )
    return notes


def _shared_gpu_start(engine: EnginePlan) -> list[str]:
    """How replicas that share a GPU start (replica/startup_lock.py): in turn, or together where their KV cache has
    a size of its own."""
    share = engine.ray_actor_options.get("num_gpus", 0)
    if engine.device != "gpu" or not 0 < share < 1 or engine.most_replicas < 2:
        return []
    head = f"serve '{engine.serve_id}': replicas sharing a GPU (num_gpus {share:g})"
    if not engine.kind.measures_device_at_start(engine.argv):
        return [f"{head} start together: their KV cache has a size of its own"]
    sized = engine.kind.kv_size_args
    instead = f"; {sized[0]} in engine_args starts them together" if sized else ""
    return [f"{head} start one after another, each sizing its KV cache from the memory it finds free{instead}"]
