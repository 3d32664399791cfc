"""An engine node's deployments: the node itself, or, disaggregated (docs/disaggregation.md), its prefill and decode
pools, each a node of its own with the pool's engine args, resources, routing, KV transfer and pinned host."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from flagscale import engines
from flagscale.config.schema import Disaggregation, NodeConfig, PoolConfig, Resources, ServeConfig
from flagscale.errors import ConfigError
from flagscale.plan.engine_args import engine_args_of, served_names

PD_ROLES = ("prefill", "decode")
# FlagScale's prefill_decode_strategy -> the routing policy that picks the prefill replica (None: the node's).
PD_STRATEGY_POLICY = {"robin": "round_robin", "random": "random", "slo": None}
AUTOSCALING_FIELDS = (
    "min_replicas",
    "max_replicas",
    "target_ongoing_requests",
    "upscale_delay_s",
    "downscale_delay_s",
    "slo",
)


@dataclass(frozen=True)
class Pool:
    """One engine deployment of an engine node: the node itself (role None), or one of its pools as a node."""

    node: NodeConfig  # a pool: serve_id <node>-<role>, the pool's engine args, resources and routing
    where: str  # the node's place in the config, and the pool's (".disaggregation.<role>") for errors
    role: str | None = None  # "prefill" / "decode"
    host: str | None = None  # the hostfile host the pool is pinned to, if any
    host_where: str = ""  # where that pin is set: disaggregation.<role>.host, or deploy.<role>_address


def disaggregation_of(node: NodeConfig, config: ServeConfig) -> Disaggregation | None:
    """The node's own `disaggregation`, else the one FlagScale's deploy.prefill_decode_disaggregation gives every
    engine node: prefill_num / decode_num replicas, pools pinned by prefill_address / decode_address,
    decode_gpu_memory_utilization for the decode engines, prefill_decode_strategy for picking prefill replicas."""
    if node.disaggregation is not None or not node.is_engine:
        return node.disaggregation
    deploy = config.experiment.runner.deploy
    if not deploy.prefill_decode_disaggregation:
        return None
    fixed = node.resources.model_dump(exclude_none=True, exclude=set(AUTOSCALING_FIELDS) | {"num_replicas"})

    def pool(count: int, address: str, engine_args: dict[str, Any]) -> PoolConfig:
        return PoolConfig(
            resources=Resources(**fixed, num_replicas=count),
            host=None if address == "auto" else address,
            engine_args=engine_args,
        )

    decode_args = {}
    if deploy.decode_gpu_memory_utilization is not None:
        decode_args["gpu_memory_utilization"] = deploy.decode_gpu_memory_utilization
    return Disaggregation(
        prefill=pool(deploy.prefill_num, deploy.prefill_address, {}),
        decode=pool(deploy.decode_num, deploy.decode_address, decode_args),
        prefill_routing=PD_STRATEGY_POLICY[deploy.prefill_decode_strategy],
    )


def pools_of(node: NodeConfig, config: ServeConfig, where: str, main_file: str, on_cpu: bool) -> list[Pool]:
    """The engine deployments of a node (`where`: its place in the config; `main_file`: where FlagScale's deploy
    keys are; `on_cpu`: the target has no GPU, which the KV transfer's engine args depend on)."""
    pd = disaggregation_of(node, config)
    if pd is None:
        return [Pool(node, where)]
    kind = engines.get(node.engine)
    if not kind.capabilities.kv_transfer:
        raise ConfigError(
            f"engine {kind.name} cannot move KV caches between replicas: prefill/decode disaggregation needs "
            "engine: vllm (docs/engines.md)",
            where,
        )
    args = engine_args_of(node, config)
    kind.check_kv_transfer(pd, args, where)
    names = served_names(node, args)
    pools = []
    for role in PD_ROLES:
        pool: PoolConfig = getattr(pd, role)
        engine_args = {
            **node.engine_args,
            **pool.engine_args,
            "served_model_name": names,
            **kind.kv_transfer_args(pd, role, on_cpu, {**args, **pool.engine_args}),
        }
        routing = pd.prefill_routing if role == "prefill" and pd.prefill_routing else node.routing
        update = {
            "serve_id": f"{node.serve_id}-{role}",
            "engine_args": engine_args,
            "resources": pool.resources or node.resources,
            "routing": routing,
            "disaggregation": None,
        }
        host_where = f"{where}.disaggregation.{role}.host"
        if node.disaggregation is None:  # from FlagScale's deploy keys
            host_where = f"{main_file}: experiment.runner.deploy.{role}_address"
        pool_node = node.model_copy(update=update)
        pools.append(Pool(pool_node, f"{where}.disaggregation.{role}", role, pool.host, host_where))
    return pools
