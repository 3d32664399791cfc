"""config + facts -> Plan. `build_plan` gathers the facts (flagscale/facts.py), then `plan_of` plans over them:
the engine deployments, the custom nodes' graph, the checks of the whole (GPUs, the launcher's hosts and head CPUs),
the endpoint. Every check that needs more than the schema runs here, before anything is started.

`plan_of` reads nothing of the outside world itself, with one exception it cannot shed cheaply: the engine kinds'
own checks of an engine node look at this machine, since only the engine knows them (EngineKind.check_available:
the engine is installed; check_model: a local model path, or the offline hub cache; argv and check_parallel:
vLLM's own argument parser, built once per process, and its version).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from flagscale import devices, launchers
from flagscale.cluster.placement import ClusterPlan
from flagscale.config.graph import GraphPlan, build_graph_plan
from flagscale.config.load import ConfigSources
from flagscale.config.routing import Admission
from flagscale.config.schema import ServeConfig
from flagscale.errors import ConfigError
from flagscale.facts import Facts, TargetFacts, endpoint_port
from flagscale.facts import gather as gather_facts
from flagscale.launchers.base import Launcher
from flagscale.plan.engine_nodes import EngineNodes, plan_engine_nodes
from flagscale.plan.inputs import PlanInputs
from flagscale.plan.resources import check_gpus, cpu_demand, default_router_processes
from flagscale.plan.types import EnginePlan, Plan


@dataclass(frozen=True)
class TargetShare:
    """What the launcher makes of the planned replicas on its target (Plan.cluster, head_num_cpus, placement)."""

    cluster: ClusterPlan | None  # the hostfile's hosts, when the launcher starts Ray on them
    head_num_cpus: int
    notes: list[str]  # the launcher's, for dryrun
    placement: Any  # an existing Ray cluster: where each replica would go


def build_plan(
    config: ServeConfig,
    sources: ConfigSources = ConfigSources(),
    check_port: bool = True,
    target_facts: TargetFacts | None = None,
) -> Plan:
    """The plan of a validated config: its facts gathered (the target's, unless given), then planned over."""
    _refuse_unsupported(config, sources)
    return plan_of(config, sources, gather_facts(config, sources, check_port, target_facts))


def plan_of(config: ServeConfig, sources: ConfigSources, facts: Facts) -> Plan:
    """The plan, from the config and the facts gathered before it (see the module's docstring for what the engine
    kinds still read)."""
    launcher = launchers.select(config.experiment.runner, sources.main)
    inputs = PlanInputs.of(config, sources, facts, launcher)
    engine_nodes = plan_engine_nodes(inputs)
    deploy = config.experiment.runner.deploy
    router_host = launcher.router_host(deploy.host, facts.target, f"{sources.main}: experiment.runner.deploy.host")
    if facts.target.port_taken:
        raise ConfigError(facts.target.port_taken, f"{sources.main}: experiment.runner.deploy.port")
    engine_plans = engine_nodes.plans
    graph = build_graph_plan(config, sources, {e.group: e.model_names[0] for e in engine_plans})
    check_gpus(engine_plans, graph, inputs.target, inputs.serve_file)
    if graph is not None:
        launcher.check_custom_nodes(
            facts.target,
            graph.nodes,
            lambda serve_id: f"{inputs.serve_file}: serve[{engine_nodes.serve_index[serve_id]}]({serve_id}).resources",
        )
    share = _target_share(launcher, inputs, engine_nodes, graph)
    _check_api_key(facts.api_key, config, sources, engine_plans)
    return Plan(
        app_name=config.experiment.exp_name,
        exp_dir=facts.exp_dir,
        host=router_host,
        port=endpoint_port(config),
        engines=engine_plans,
        head_num_cpus=share.head_num_cpus,
        envs=_this_machine_env(config, facts),
        before_start=config.experiment.cmds.before_start,
        after_stop=config.experiment.cmds.after_stop,
        startup_timeout_s=deploy.startup_timeout_s,
        schedule_timeout_s=deploy.schedule_timeout_s,
        drain_timeout_s=deploy.drain_timeout_s,
        pin_cpus=deploy.cpu_affinity == "auto",
        ray_port=config.experiment.runner.ray_port,
        notes=engine_nodes.notes + share.notes,
        api_key=facts.api_key,
        old_key_grace_s=deploy.old_key_grace_s,
        protect_metrics=deploy.protect_metrics,
        admission=Admission.of(deploy),
        router_processes=deploy.router_processes or default_router_processes(engine_plans, facts.target.cpus),
        graph=graph,
        launcher=launcher.name,
        cluster=share.cluster,
        ray_cluster=facts.target.ray_cluster,
        placement=share.placement,
        endpoint_moved=_moved(deploy.host, router_host, launcher.router_host_moved_because),
    )


def _target_share(
    launcher: Launcher, inputs: PlanInputs, engine_nodes: EngineNodes, graph: GraphPlan | None
) -> TargetShare:
    config, sources, facts = inputs.config, inputs.sources, inputs.facts.target
    engine_plans = engine_nodes.plans
    replica_groups = [*engine_plans, *(graph.nodes if graph else [])]
    cluster = launcher.plan_hosts(config, sources, facts, engine_nodes.deployments)
    demand = cpu_demand(engine_plans, replica_groups)
    where = f"{sources.main}: experiment.runner.num_cpus"
    head_cpus, notes = launcher.head_cpus(config.experiment.runner, facts, demand, where)
    placement = launcher.place(facts, config.experiment.exp_name, replica_groups, f"{inputs.serve_file}: serve")
    return TargetShare(cluster, head_cpus, notes, placement)


def _moved(host: str, router_host: str, because: str) -> str | None:
    return f"deploy.host {host} is served at {router_host}: {because}" if router_host != host else None


def _check_api_key(
    api_key: str | None, config: ServeConfig, sources: ConfigSources, engine_plans: list[EnginePlan]
) -> None:
    """The deployment's key, checked by every engine kind that serves behind it."""
    if api_key is None:
        return
    entry = "api_key_env" if config.experiment.runner.deploy.api_key_env else "api_key"
    for kind in {engine.kind.name: engine.kind for engine in engine_plans}.values():
        kind.check_api_key(api_key, f"{sources.main}: experiment.runner.deploy.{entry}")


def _refuse_unsupported(config: ServeConfig, sources: ConfigSources) -> None:
    """FlagScale features whose keys are understood but that this project does not serve yet."""
    serve_file = sources.file_for(("serve",))
    for index, node in enumerate(config.serve):
        if not node.is_engine and node.resources.num_replicas == "auto":
            raise ConfigError(
                "num_replicas: auto counts devices for engine replicas; give a custom node a number",
                f"{serve_file}: serve[{index}]({node.serve_id}).resources.num_replicas",
            )


def _this_machine_env(config: ServeConfig, facts: Facts) -> dict[str, str]:
    """experiment.envs for this machine's processes: what its GPUs' family needs in every process (multicast off on
    more than one NVIDIA GPU), then the envs, device_type_specific for its family (nvidia, or cpu without GPUs)."""
    gpus = len(facts.target.gpus)
    family = devices.get("nvidia" if gpus else "cpu")
    return {**family.process_env(gpus), **config.experiment.env_for(None, (family.name,))}
