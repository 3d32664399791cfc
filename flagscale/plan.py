"""From the validated config to a plan: engine nodes, replicas, resources, argv, endpoint. `dryrun` prints it.

Every check that needs more than the schema (engine args via vLLM, model paths, names, devices, port) runs
here, before anything is started.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flagscale import engines, launchers
from flagscale.cluster.placement import (
    ClusterPlan,
    Reservation,
    Target,
    check_gpu_demand,
    check_gpu_share,
    check_shared_gpus_across_nodes,
    check_weights_fit,
    reserve,
)
from flagscale.cluster.state import resolve_exp_dir
from flagscale.config.graph import CustomNodePlan, GraphPlan, build_graph_plan
from flagscale.config.load import ConfigSources, resolve_api_key
from flagscale.config.replicas import ReplicaSettings, replica_settings
from flagscale.config.routing import Admission, RoutingSpec
from flagscale.config.schema import Disaggregation, NodeConfig, PoolConfig, Resources, ServeConfig
from flagscale.engines.base import EngineKind
from flagscale.errors import ConfigError
from flagscale.facts import TargetFacts, endpoint_port
from flagscale.facts import gather as gather_facts
from flagscale.launchers.base import CpuDemand
from flagscale.net import is_loopback

ROUTER_DEPLOYMENT = "router"


@dataclass(frozen=True)
class EnginePlan(ReplicaSettings):
    """One engine node, planned once: its argv and where its replicas go (cluster.placement.reserve)."""

    serve_id: str
    model: str
    model_names: list[str]
    argv: list[str]
    device: str  # "cpu", "gpu", or a hostfile chip type
    devices_per_replica: int
    parallel: tuple[int, int, int] = (1, 1, 1)  # TP, PP, DP
    host_argv: dict[str, list[str]] = field(default_factory=dict)  # node IP -> argv (experiment.node_args)
    chip: str | None = None  # hostfile chip type the replicas run on (multi-host)
    placement_bundles: list[dict[str, float]] | None = None  # set when TP x PP spans hosts
    placement_strategy: str | None = None
    ranks_per_host: int = 1  # the engine ranks each host of a replica runs (placement.Reservation)
    routing: RoutingSpec = field(default_factory=RoutingSpec)  # how the router picks a replica (node `routing`)
    role: str | None = None  # "prefill" / "decode": a pool of a disaggregated node (docs/disaggregation.md)
    group: str = ""  # the node's serve_id (a pool's serve_id is <node>-<role>); set by _engine_plan
    pinned_host: str | None = None  # the hostfile host a pool is pinned to (disaggregation.<role>.host)
    gpu_memory_utilization: float | None = None  # GPU engines: what each replica promises vLLM of its GPU
    # secret engine args (hf_token) as the env vars that carry them to the server, never in argv
    secret_env: dict[str, str] = field(default_factory=dict, repr=False)
    engine: str = engines.DEFAULT_ENGINE  # the engine kind (flagscale/engines/)

    @property
    def kind(self) -> EngineKind:
        return engines.get(self.engine)


@dataclass
class Plan:
    app_name: str
    exp_dir: str
    host: str
    port: int
    engines: list[EnginePlan]
    head_num_cpus: int
    envs: dict[str, str]
    before_start: str | None
    after_stop: str | None
    startup_timeout_s: float
    schedule_timeout_s: float
    drain_timeout_s: float
    pin_cpus: bool = True  # deploy.cpu_affinity == "auto"
    ray_port: int | None = None  # runner.ray_port; None: a port free on the head's host when the run starts
    notes: list[str] = field(default_factory=list)
    api_key: str | None = field(default=None, repr=False)  # deploy.api_key / api_key_env, resolved
    protect_metrics: bool = False
    admission: Admission = field(default_factory=Admission)  # the router's body cap and queue bounds (deploy.*)
    router_processes: int = 1  # deploy.router_processes, or default_router_processes
    graph: GraphPlan | None = None  # custom nodes and the graph's HTTP entry, when the config has any
    launcher: str = "local"  # where the Ray cluster comes from (flagscale/launchers/: LAUNCHERS)
    # the launcher's part of the plan, read by the launcher only:
    cluster: ClusterPlan | None = None  # hosts of the hostfile, when runner.hostfile is set
    ray_cluster: Any = None  # an existing Ray cluster's ClusterFacts (runner.type: ray), read before planning
    placement: Any = None  # ray_cluster only: where each replica would go (ray_cluster.Placement)
    # where the launcher moved deploy.host to, and why (a Ray cluster: loopback -> the head's address); None: as set
    endpoint_moved: str | None = None

    @property
    def model_ids(self) -> list[str]:
        return list(dict.fromkeys(name for engine in self.engines for name in engine.model_names))

    @property
    def endpoint(self) -> str:
        return f"http://{launchers.get(self.launcher).endpoint_host(self)}:{self.port}"

    @property
    def log_dir(self) -> Path:
        return Path(self.exp_dir) / "serve_logs"


def open_without_key(plan: Plan) -> str | None:
    """The warning for a deployment that listens beyond loopback with no API key (what listens where), or None:
    anyone who reaches those addresses can use the models, and the engines' own admin paths."""
    if plan.api_key:
        return None
    launcher = launchers.get(plan.launcher)
    listening = []
    if not is_loopback(plan.host):
        listening.append(f"the router on {plan.host}:{plan.port}")
    if plan.engines and not is_loopback(launcher.engine_bind_host):
        hosts = launcher.engine_hosts(plan)
        where = f" ({', '.join(hosts)})" if hosts else ""
        listening.append(f"every engine server on its node's address{where}, on a port of its own")
    if not listening:
        return None
    return (
        f"no API key, and {' and '.join(listening)} listen beyond loopback: anyone who can reach those addresses "
        "can use them without a key; set experiment.runner.deploy.api_key_env (docs/operations.md)"
    )


def default_router_processes(engines: list[EnginePlan], head_cpus: int) -> int:
    """One router process relays ~20k streamed tokens/s (one core, ~50 us each: docs/benchmarks.md), about one
    GPU's worth of a small model: one per GPU the engines may use, at least one, at most a quarter of the head's
    cores."""
    gpus = sum(e.most_replicas * e.ray_actor_options.get("num_gpus", 0) for e in engines)
    return max(1, min(math.ceil(gpus), head_cpus // 4))


def engine_args_of(node: NodeConfig, config: ServeConfig) -> dict[str, Any]:
    """What one engine node hands to vLLM: runner.cli_args, then engine_args, then engine_args_specific.<engine>."""
    return {**config.experiment.runner.cli_args, **node.merged_engine_args()}


def checked_engine_args(node: NodeConfig, config: ServeConfig, where: str) -> dict[str, Any]:
    """engine_args_of, refused (naming the key) where it turns on an engine arg the node has not opted into
    (EngineKind.unsafe_args, allow_engine_args)."""
    args = engine_args_of(node, config)
    engines.get(node.engine).check_unsafe_args(args, node.allow_engine_args, where)
    return args


def served_names(node: NodeConfig, engine_args: dict[str, Any]) -> list[str]:
    """The `model` names clients use for this node: served_model_name, else its serve_id."""
    return engines.get(node.engine).served_names(engine_args, node.serve_id)


PD_ROLES = ("prefill", "decode")
# FlagScale's prefill_decode_strategy -> the routing policy that picks the prefill replica (None: the node's).
PD_STRATEGY_POLICY = {"robin": "round_robin", "random": "random", "slo": None}
AUTOSCALING_FIELDS = ("min_replicas", "max_replicas", "target_ongoing_requests", "upscale_delay_s", "downscale_delay_s")


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


def engine_pools(
    node: NodeConfig, config: ServeConfig, where: str, on_cpu: bool = False
) -> list[tuple[str | None, NodeConfig]]:
    """The engine deployments of a node: the node itself (colocated), or its prefill and decode pools, each a
    node of its own (serve_id <node>-<role>, the pool's engine args, resources and KV transfer config)."""
    pd = disaggregation_of(node, config)
    if pd is None:
        return [(None, node)]
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
        pools.append((role, node.model_copy(update=update)))
    return pools


def _pin_to_host(engine: EnginePlan, host: str, config: ServeConfig, target: Target, where: str) -> EnginePlan:
    """A pool pinned to a hostfile host: its replicas reserve a sliver of Ray's `node:<ip>` resource there."""
    import dataclasses

    if target.hostfile is None:
        raise ConfigError(f"pinning a pool to host {host!r} needs runner.hostfile", where)
    known = {entry.host for entry in target.hostfile.hosts}
    if host not in known:
        raise ConfigError(f"host {host!r} is not in {target.hostfile.path} (hosts: {', '.join(sorted(known))})", where)
    ip = target.host_ips[host]
    options = dict(engine.ray_actor_options)
    options["resources"] = {**options.get("resources", {}), f"node:{ip}": 0.001}
    return dataclasses.replace(engine, ray_actor_options=options, pinned_host=host)


def _engine_plans(
    node: NodeConfig, index: int, config: ServeConfig, target: Target, sources: ConfigSources
) -> list[EnginePlan]:
    """One engine node -> its engine deployments (one, or a prefill and a decode pool)."""
    node_where = f"{sources.file_for(('serve',))}: serve[{index}]({node.serve_id})"
    plans = []
    hosts = target.hostfile.hosts if target.hostfile else []
    on_cpu = not any(h.is_gpu for h in hosts) if hosts else target.gpus == 0
    for role, pool_node in engine_pools(node, config, node_where, on_cpu):
        engine = _engine_plan(pool_node, index, config, target, sources, role=role, group=node.serve_id)
        pd = disaggregation_of(node, config)
        host = getattr(pd, role).host if role else None
        if host is not None:
            pool_where = f"{node_where}.disaggregation.{role}.host"
            if node.disaggregation is None:  # from FlagScale's deploy keys
                pool_where = f"{sources.main}: experiment.runner.deploy.{role}_address"
            engine = _pin_to_host(engine, host, config, target, pool_where)
        plans.append(engine)
    return plans


def _engine_plan(
    node: NodeConfig,
    index: int,
    config: ServeConfig,
    target: Target,
    sources: ConfigSources,
    role: str | None = None,
    group: str | None = None,
) -> EnginePlan:
    """engine args -> vLLM's argv (checked by its parser), and one placement decision on `target`."""
    node_where = f"{sources.file_for(('serve',))}: serve[{index}]({group or node.serve_id})"
    if role:
        node_where += f".disaggregation.{role}"
    where = f"{node_where}.engine_args"
    kind = engines.get(node.engine)
    kind.check_available(f"{node_where}.engine" if node.engine else node_where)
    args = checked_engine_args(node, config, where)
    args["model"] = kind.check_model(args.get("model"), where)
    names = args["served_model_name"] = served_names(node, args)
    argv = kind.argv(kind.map_common_args(args), where)
    secrets = kind.secret_env(args, where)
    parallel = kind.parallel(args, where)
    reservation = reserve(
        node.resources, parallel, target, config.experiment.runner.placement_strategy, f"{node_where}.resources", where
    )
    kind.check_parallel(parallel, reservation.device != "gpu", where)
    host_argv = _host_argv(node, config, names, reservation, target, sources)
    scaling = replica_settings(node.resources, reservation.ray_actor_options, reservation.auto_replicas)
    utilization = args.get("gpu_memory_utilization", kind.default_gpu_memory_utilization)
    if reservation.device == "gpu":
        share = (node.serve_id, reservation.ray_actor_options.get("num_gpus", 0), math.prod(parallel))
        check_gpu_share(*share, scaling.most_replicas, utilization, f"{node_where}.resources")
        check_weights_fit(model_weight_bytes(args["model"]), parallel[0], parallel[1], utilization, target, where)
    return EnginePlan(
        serve_id=node.serve_id,
        model=args["model"],
        model_names=names,
        argv=[*argv, *reservation.extra_argv],
        device=reservation.device,
        devices_per_replica=parallel[0] * parallel[1] * parallel[2],
        parallel=parallel,
        host_argv=host_argv,
        chip=reservation.chip,
        placement_bundles=reservation.placement_bundles,
        placement_strategy=reservation.placement_strategy,
        ranks_per_host=reservation.ranks_per_host,
        routing=RoutingSpec.of_node(node),
        role=role,
        group=group or node.serve_id,
        gpu_memory_utilization=utilization if reservation.device == "gpu" else None,
        secret_env=secrets,
        engine=kind.name,
        **vars(scaling),
    )


def model_weight_bytes(model: str) -> int | None:
    """Size of a local checkpoint's weights: the safetensors index's total, else the weight files'; a single-file
    checkpoint's (GGUF) size; None for a hub id."""
    path = Path(model)
    if path.is_file():
        return path.stat().st_size
    if not path.is_dir():
        return None
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            total = json.loads(index.read_text()).get("metadata", {}).get("total_size")
        except (OSError, ValueError):
            total = None
        if isinstance(total, int):
            return total
    for pattern in ("*.safetensors", "*.bin", "*.pt"):
        files = list(path.glob(pattern))
        if files:
            return sum(f.stat().st_size for f in files)
    return None


def _host_argv(
    node: NodeConfig,
    config: ServeConfig,
    names: list[str],
    reservation: Reservation,
    target: Target,
    sources: ConfigSources,
) -> dict[str, list[str]]:
    """experiment.node_args.<host>.engine_args: the argv of this node's replicas placed on that host, by node IP."""
    node_args = config.experiment.node_args
    if not node_args:
        return {}
    where = f"{sources.main}: experiment.node_args"
    hostfile = target.hostfile
    if hostfile is None:
        raise ConfigError("per-host engine args need runner.hostfile (without one, use the node's engine_args)", where)
    kind = engines.get(node.engine)
    known = {entry.host for entry in hostfile.hosts}
    out = {}
    for host, extra in node_args.items():
        host_where = f"{where}.{host}.engine_args"
        if host not in known:
            raise ConfigError(
                f"host {host!r} is not in {hostfile.path} (hosts: {', '.join(sorted(known))})", f"{where}.{host}"
            )
        secret = sorted(set(extra.engine_args) & set(kind.secret_args))
        if secret:
            raise ConfigError(
                f"{', '.join(secret)} cannot differ per host; set it in the node's engine_args", host_where
            )
        sizing = sorted(set(extra.engine_args) & set(kind.sizing_args))
        if sizing:
            raise ConfigError(
                f"{', '.join(sizing)} sizes every replica's reservation and cannot differ per host; "
                "set it in the node's engine_args",
                host_where,
            )
        if not extra.engine_args:
            continue
        args = {**engine_args_of(node, config), **extra.engine_args}
        kind.check_unsafe_args(args, node.allow_engine_args, host_where)
        args["model"] = kind.check_model(args.get("model"), host_where)
        args["served_model_name"] = names
        # The replica finds its argv by its node IP (facts.host_ips: resolved as `ray start` does).
        out[target.host_ips[host]] = [
            *kind.argv(kind.map_common_args(args), host_where),
            *reservation.extra_argv,
        ]
    return out


def _cpu_sum(engines: list[EnginePlan | CustomNodePlan]) -> str:
    return " + ".join(f"{e.serve_id}: {e.initial_replicas} x {e.ray_actor_options['num_cpus']:g}" for e in engines)


def _refuse_unsupported(config: ServeConfig, sources: ConfigSources) -> None:
    """FlagScale features whose keys are understood but that this project does not serve yet."""
    serve_file = sources.file_for(("serve",))
    for index, node in enumerate(config.serve):
        if not node.is_engine and node.resources.num_replicas == "auto":
            raise ConfigError(
                "num_replicas: auto counts devices for engine replicas; give a custom node a number",
                f"{serve_file}: serve[{index}]({node.serve_id}).resources.num_replicas",
            )


def build_plan(
    config: ServeConfig,
    sources: ConfigSources = ConfigSources(),
    check_port: bool = True,
    target_facts: TargetFacts | None = None,
) -> Plan:
    """The plan: a pure function of the config and the target's facts (gathered here unless given)."""
    _refuse_unsupported(config, sources)
    if target_facts is None:
        target_facts = gather_facts(config, sources, check_port)
    return _plan(config, sources, target_facts)


def _engine_pools(config: ServeConfig, sources: ConfigSources, target: Target):
    """Every engine node's plan (a disaggregated node: its pools), with the ids and served names checked unique:
    (engine plans, each with its node, notes for dryrun, serve_id -> index in serve)."""
    serve_file = sources.file_for(("serve",))
    seen_ids: dict[str, int] = {}
    seen_names: dict[str, str] = {}
    engines: list[EnginePlan] = []
    notes: list[str] = []
    on_hosts: list[tuple[EnginePlan, NodeConfig]] = []
    for index, node in enumerate(config.serve):
        if node.serve_id in seen_ids:
            raise ConfigError(
                f"duplicate serve_id '{node.serve_id}' (also serve[{seen_ids[node.serve_id]}])",
                f"{serve_file}: serve[{index}]",
            )
        seen_ids[node.serve_id] = index
        if not node.is_engine:
            continue  # custom nodes: build_graph_plan below
        pools = _engine_plans(node, index, config, target, sources)
        for engine in pools:
            on_hosts.append((engine, node))
            if engine.num_replicas is not None and node.resources.num_replicas == "auto":
                notes.append(
                    f"serve '{engine.serve_id}': num_replicas auto -> {engine.num_replicas} "
                    f"({engine.devices_per_replica} {engine.device} device(s) per replica)"
                )
            if engine.role:
                where = f"on host {engine.pinned_host}" if engine.pinned_host else "placed by Ray"
                where += engine.kind.pool_note(engine.device, engine.argv)
                notes.append(
                    f"serve '{node.serve_id}': {engine.role} pool '{engine.serve_id}', "
                    f"{engine.describe_replicas()} replica(s), {where}, routing {engine.routing.policy}"
                )
        for name in pools[0].model_names:
            if name in seen_names:
                raise ConfigError(
                    f"served model name '{name}' is used by both '{seen_names[name]}' and '{node.serve_id}'",
                    f"{serve_file}: serve[{index}]({node.serve_id})",
                )
            seen_names[name] = node.serve_id
        engines.extend(pools)
    return engines, on_hosts, notes, seen_ids


def _check_gpus(engines: list[EnginePlan], graph: GraphPlan | None, target: Target, serve_file: str) -> None:
    """The GPUs every replica asks for exist on the target; replicas sharing a GPU fit its memory together."""
    groups = [*engines, *(graph.nodes if graph else [])]
    check_gpu_demand(
        [(g.serve_id, g.initial_replicas, g.ray_actor_options.get("num_gpus", 0)) for g in groups], target, serve_file
    )
    if target.hostfile is None:
        check_shared_gpus_across_nodes(
            [
                (e.serve_id, e.ray_actor_options.get("num_gpus", 0), e.gpu_memory_utilization, e.initial_replicas)
                for e in engines
                if e.gpu_memory_utilization is not None
            ],
            serve_file,
        )


def _cpu_demand(engines: list[EnginePlan], replica_groups: list) -> CpuDemand:
    """The logical CPUs the replicas reserve at start, and the room they may need later."""
    required_cpus = sum(e.initial_replicas * e.ray_actor_options["num_cpus"] for e in replica_groups)
    # Room for the most replicas autoscaling may start, and for one spare engine replica: an in-place update
    # starts each new replica before the old one drains (flagscale/serve/app.py).
    most_cpus = sum(e.most_replicas * e.ray_actor_options["num_cpus"] for e in replica_groups)
    spare_cpus = max((e.ray_actor_options["num_cpus"] for e in engines), default=0)
    room = int(-(-(most_cpus + spare_cpus) // 1))
    return CpuDemand(required_cpus, room, _cpu_sum(replica_groups))


def _api_key(config: ServeConfig, sources: ConfigSources, engines: list[EnginePlan]) -> str | None:
    """The deployment's key, resolved once and checked by every engine kind that serves behind it."""
    api_key = resolve_api_key(config, sources)
    if api_key is not None:
        entry = "api_key_env" if config.experiment.runner.deploy.api_key_env else "api_key"
        for kind in {engine.kind.name: engine.kind for engine in engines}.values():
            kind.check_api_key(api_key, f"{sources.main}: experiment.runner.deploy.{entry}")
    return api_key


def _moved(host: str, router_host: str, because: str) -> str | None:
    return f"deploy.host {host} is served at {router_host}: {because}" if router_host != host else None


def _plan(config: ServeConfig, sources: ConfigSources, target_facts: TargetFacts) -> Plan:
    serve_file = sources.file_for(("serve",))
    cpus = target_facts.cpus
    launcher = launchers.select(config.experiment.runner, sources.main)
    target = launcher.target(target_facts)
    engines, on_hosts, notes, seen_ids = _engine_pools(config, sources, target)

    runner = config.experiment.runner
    deploy = runner.deploy
    port = endpoint_port(config)
    router_host = launcher.router_host(deploy.host, target_facts, f"{sources.main}: experiment.runner.deploy.host")
    if target_facts.port_taken:
        raise ConfigError(target_facts.port_taken, f"{sources.main}: experiment.runner.deploy.port")

    graph = build_graph_plan(config, sources, {e.group: e.model_names[0] for e in engines})
    _check_gpus(engines, graph, target, serve_file)
    if graph is not None:
        launcher.check_custom_nodes(
            target_facts,
            graph.nodes,
            lambda serve_id: f"{serve_file}: serve[{seen_ids[serve_id]}]({serve_id}).resources",
        )
    replica_groups = [*engines, *(graph.nodes if graph else [])]
    cluster = launcher.plan_hosts(config, sources, target_facts, on_hosts)
    demand = _cpu_demand(engines, replica_groups)
    head_cpus, head_notes = launcher.head_cpus(
        runner, target_facts, demand, f"{sources.main}: experiment.runner.num_cpus"
    )
    placement = launcher.place(target_facts, config.experiment.exp_name, replica_groups, f"{serve_file}: serve")
    notes += head_notes

    exp_dir = resolve_exp_dir(config.experiment.exp_dir)
    api_key = _api_key(config, sources, engines)
    return Plan(
        app_name=config.experiment.exp_name,
        exp_dir=exp_dir,
        host=router_host,
        port=port,
        engines=engines,
        head_num_cpus=head_cpus,
        envs=config.experiment.env_for(),
        before_start=config.experiment.cmds.before_start,
        after_stop=config.experiment.cmds.after_stop,
        startup_timeout_s=deploy.startup_timeout_s,
        schedule_timeout_s=deploy.schedule_timeout_s,
        drain_timeout_s=deploy.drain_timeout_s,
        pin_cpus=deploy.cpu_affinity == "auto",
        ray_port=runner.ray_port,
        notes=notes,
        api_key=api_key,
        protect_metrics=deploy.protect_metrics,
        admission=Admission.of(deploy),
        router_processes=deploy.router_processes or default_router_processes(engines, cpus),
        graph=graph,
        launcher=launcher.name,
        cluster=cluster,
        ray_cluster=target_facts.ray_cluster,
        placement=placement,
        endpoint_moved=_moved(deploy.host, router_host, launcher.router_host_moved_because),
    )
