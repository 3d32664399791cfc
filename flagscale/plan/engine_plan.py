"""One engine deployment (a node, or a pool of a disaggregated one) -> its EnginePlan: the engine args checked by
the engine kind (vLLM's own parser turns them into argv), one placement decision on the target (cluster.placement.
reserve), the GPU checks that decision needs, the argv of the hosts experiment.node_args names, a pinned pool's host.
"""

from __future__ import annotations

import dataclasses
import math

from flagscale import devices, engines
from flagscale.cluster.gpu_memory import check_gpu_share, check_kv_cache_fit, check_weights_fit
from flagscale.cluster.placement import Reservation, reserve
from flagscale.config.lora import ENGINE_LORA_ARGS
from flagscale.config.replicas import ReplicaSettings, replica_settings
from flagscale.config.routing import RoutingSpec
from flagscale.config.schema import NodeConfig
from flagscale.errors import ConfigError
from flagscale.plan.engine_args import checked_engine_args, engine_args_of, served_names
from flagscale.plan.inputs import PlanInputs
from flagscale.plan.lora import LoraPlan, plan_lora
from flagscale.plan.pools import Pool
from flagscale.plan.sleep import sleep_args
from flagscale.plan.types import EnginePlan


def plan_engine(pool: Pool, group: str, inputs: PlanInputs, node_args_ips: dict[str, str]) -> EnginePlan:
    """The pool's EnginePlan (`group`: its node's serve_id; `node_args_ips`: node_args_ips(inputs))."""
    node, where = pool.node, f"{pool.where}.engine_args"
    kind = engines.get(node.engine)
    kind.check_available(f"{pool.where}.engine" if node.engine else pool.where)
    args = checked_engine_args(node, inputs.config, where)
    model = args.get("model")
    args["model"] = kind.check_model(model, where)
    args, lora = plan_lora(node, args, kind, inputs.facts.adapters, pool.where)
    args.update(lora.engine_args if lora else {})
    names = args["served_model_name"] = served_names(node, args)
    sleep_delay_s = node.resources.sleep_delay_s
    args.update(sleep_args(kind, sleep_delay_s, inputs.on_cpu, pool.role, pool.where, args))
    parallel = kind.parallel(args, where)
    experts = inputs.facts.experts_of(model)
    expert_parallel = kind.expert_parallel(args, parallel, inputs.on_cpu, experts, where)
    argv = kind.argv(kind.map_common_args(args), where)
    secrets = kind.secret_env(args, where)
    strategy = inputs.config.experiment.runner.placement_strategy
    res_where = f"{pool.where}.resources"
    reservation = reserve(node.resources, parallel, inputs.target, strategy, res_where, where, expert_parallel)
    kind.check_parallel(parallel, reservation.device != "gpu", where)
    family = _family_runs(kind, reservation, res_where)
    if expert_parallel:
        kind.expert_parallel(args, parallel, reservation.device != "gpu", experts, where)
        _check_expert_parallel_gpus(node.resources.num_gpus, parallel, reservation.ranks_per_host, res_where)
    host_argv = _host_argv(node, names, reservation, inputs, node_args_ips, lora)
    scaling = replica_settings(node.resources, reservation.ray_actor_options, reservation.auto_replicas)
    scaling = _seeded(scaling, inputs.facts.tuned.get(node.serve_id) if pool.role is None else None)
    utilization = args.get("gpu_memory_utilization", kind.default_gpu_memory_utilization)
    if reservation.device == "gpu":
        _check_gpu_fit(pool, reservation, parallel, scaling.most_replicas, utilization, inputs, model, argv)
    engine = EnginePlan(
        serve_id=node.serve_id,
        model=args["model"],
        model_names=names,
        argv=[*argv, *reservation.extra_argv],
        device=reservation.device,
        devices_per_replica=math.prod(parallel),
        parallel=parallel,
        expert_parallel=expert_parallel,
        host_argv=host_argv,
        chip=reservation.chip,
        placement_bundles=reservation.placement_bundles,
        placement_strategy=reservation.placement_strategy,
        ranks_per_host=reservation.ranks_per_host,
        routing=RoutingSpec.of_node(node),
        role=pool.role,
        group=group,
        gpu_memory_utilization=utilization if reservation.device == "gpu" else None,
        secret_env=secrets,
        engine=kind.name,
        sleep_delay_s=sleep_delay_s,
        kv_events=_kv_events(kind, RoutingSpec.of_node(node), parallel, reservation, pool.where),
        lora=lora,
        family=family.name,
        family_env=family.engine_env(kind.name, _user_env(inputs, family.name, node.resources.accelerator)),
        **vars(scaling),
    )
    return _pinned(engine, pool, inputs) if pool.host is not None else engine


def _seeded(scaling: ReplicaSettings, seeds: dict[str, float] | None) -> ReplicaSettings:
    """An SLO node's planner seeded with what auto_tune measured of one replica of it (Facts.tuned), until it has
    fitted its own figures (flagscale/planner/capacity.py)."""
    if not seeds or not scaling.autoscaling or "slo" not in scaling.autoscaling:
        return scaling
    autoscaling = {**scaling.autoscaling, "slo": {**scaling.autoscaling["slo"], "seeds": seeds}}
    return dataclasses.replace(scaling, autoscaling=autoscaling)


def _check_gpu_fit(
    pool: Pool, reservation: Reservation, parallel, most_replicas, utilization, inputs, model, argv
) -> None:
    """Replicas sharing a GPU fit its memory together, and the weights (and a KV cache sized in the engine args)
    fit the ranks' share of it."""
    share = (pool.node.serve_id, reservation.ray_actor_options.get("num_gpus", 0), math.prod(parallel))
    check_gpu_share(*share, most_replicas, utilization, f"{pool.where}.resources")
    weights, (tp, pp) = inputs.facts.weights_of(model), parallel[:2]
    check_weights_fit(weights, tp, pp, utilization, inputs.target, f"{pool.where}.engine_args")
    kind = engines.get(pool.node.engine)
    if kv_cache_bytes := kind.kv_cache_bytes(argv):
        key = f"{pool.where}.engine_args.{kind.kv_size_args[0]}"
        check_kv_cache_fit(kv_cache_bytes, weights, tp, pp, utilization, inputs.target, key)


def _kv_events(
    kind: engines.EngineKind,
    routing: RoutingSpec,
    parallel: tuple[int, int, int],
    reservation: Reservation,
    where: str,
) -> bool:
    """Whether the node's replicas publish KV-cache events (docs/routing.md): unless its routing_options say
    `kv_events: false`, where the engine kind publishes, colocated; a replica of several data-parallel engines
    publishes a stream per rank on ports its replica reserves on its host, so only when its ranks all run there.
    A disaggregated node's prefill and decode replicas publish alike (each pool routed on its own). Whatever the
    node's policy: switching it to cache_aware in place then needs no restart of the engines.
    `kv_events: true` where that cannot be is the config's error."""
    wanted = getattr(routing.settings, "kv_events", "auto")
    if not wanted:
        return False
    why = None
    if not kind.capabilities.kv_events:
        why = f"{kind.display} publishes no KV-cache events"
    elif parallel[2] > 1 and reservation.placement_bundles:  # other hosts' ranks: on ports nobody reserved there
        why = "a replica of data-parallel engines over several hosts is routed on the approximate table"
    if why and wanted is True:
        raise ConfigError(f"routing_options.kv_events: true, but {why} (set it to auto or false)", where)
    return why is None


def _family_runs(kind, reservation: Reservation, where: str) -> devices.DeviceFamily:
    """The device family the replicas run on (this machine's: NVIDIA with GPUs, else CPU), refusing an engine kind
    it does not run."""
    family = devices.get(reservation.family or ("nvidia" if reservation.device == "gpu" else "cpu"))
    if kind.name not in family.engines:
        runs = ", ".join(f"{name} ({support.how})" for name, support in family.engines.items())
        raise ConfigError(
            f"engine {kind.name} does not run on {family.title}s ({family.name}); there: {runs} (docs/chips.md)",
            where,
        )
    return family


def _user_env(inputs: PlanInputs, family: str, accelerator: str | None) -> dict[str, str]:
    """The envs the user gave the hosts a node runs on (a plugin they chose there wins over the family's)."""
    env = inputs.config.experiment.env_for(None, (family, accelerator))
    hostfile = inputs.target.hostfile
    for entry in hostfile.matching(accelerator) if hostfile else []:
        env.update(inputs.config.experiment.env_for(entry.host, (family, entry.chip)))
    return env


def _check_expert_parallel_gpus(
    num_gpus: float | None, parallel: tuple[int, int, int], ranks_per_host: int, where: str
) -> None:
    """An expert-parallel replica runs one rank per GPU: resources.num_gpus, if set, is the GPUs of its ranks on a
    host (all DP x TP x PP of them on one host; its share when it spans hosts)."""
    if num_gpus is None or num_gpus == ranks_per_host:
        return
    tp, pp, dp = parallel
    raise ConfigError(
        f"num_gpus={num_gpus:g}, but an expert-parallel replica runs DP x TP x PP = {dp} x {tp} x {pp} ranks, "
        f"{ranks_per_host} per host, one GPU each: leave num_gpus unset or set it to {ranks_per_host}",
        f"{where}.num_gpus",
    )


def _pinned(engine: EnginePlan, pool: Pool, inputs: PlanInputs) -> EnginePlan:
    """A pool pinned to a hostfile host: its replicas reserve a sliver of Ray's `node:<ip>` resource there."""
    if inputs.target.hostfile is None:
        raise ConfigError(f"pinning a pool to host {pool.host!r} needs runner.hostfile", pool.host_where)
    ip = _ip_of(pool.host, inputs, pool.host_where)
    options = dict(engine.ray_actor_options)
    options["resources"] = {**options.get("resources", {}), f"node:{ip}": 0.001}
    return dataclasses.replace(engine, ray_actor_options=options, pinned_host=pool.host)


def _ip_of(host: str, inputs: PlanInputs, where: str) -> str:
    """The node IP of a hostfile host the config names (facts.host_ips: resolved as `ray start` does)."""
    hostfile = inputs.target.hostfile
    known = {entry.host for entry in hostfile.hosts}
    if host not in known:
        raise ConfigError(f"host {host!r} is not in {hostfile.path} (hosts: {', '.join(sorted(known))})", where)
    return inputs.target.host_ips[host]


def node_args_ips(inputs: PlanInputs) -> dict[str, str]:
    """experiment.node_args' hosts -> their node IPs, each checked to be a hostfile host (once for every node)."""
    node_args = inputs.config.experiment.node_args
    if not node_args:
        return {}
    where = f"{inputs.sources.main}: experiment.node_args"
    if inputs.target.hostfile is None:
        raise ConfigError("per-host engine args need runner.hostfile (without one, use the node's engine_args)", where)
    return {host: _ip_of(host, inputs, f"{where}.{host}") for host in node_args}


def _host_argv(
    node: NodeConfig,
    names: list[str],
    reservation: Reservation,
    inputs: PlanInputs,
    ips: dict[str, str],
    lora: LoraPlan | None,
) -> dict[str, list[str]]:
    """experiment.node_args.<host>.engine_args: the argv of this node's replicas placed on that host, by node IP."""
    kind = engines.get(node.engine)
    out = {}
    for host, extra in inputs.config.experiment.node_args.items():
        host_where = f"{inputs.sources.main}: experiment.node_args.{host}.engine_args"
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
        args = {**engine_args_of(node, inputs.config), **extra.engine_args}
        args = {key: value for key, value in args.items() if key not in ENGINE_LORA_ARGS} | (
            lora.engine_args if lora else {}
        )
        kind.check_unsafe_args(args, node.allow_engine_args, host_where)
        args["model"] = kind.check_model(args.get("model"), host_where)
        args["served_model_name"] = names
        # The replica finds its argv by its node IP (facts.host_ips: resolved as `ray start` does).
        out[ips[host]] = [*kind.argv(kind.map_common_args(args), host_where), *reservation.extra_argv]
    return out
