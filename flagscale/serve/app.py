"""The Ray Serve application built from a plan: one deployment per engine node, plus the router ingress."""

from __future__ import annotations

import hashlib
import math
from dataclasses import asdict
from typing import TYPE_CHECKING

from flagscale import launchers
from flagscale.adaptors import ray, serve
from flagscale.cluster.ray_compat import with_version
from flagscale.config.routing import DEFAULT_MAX_ONGOING_REQUESTS
from flagscale.plan import ROUTER_DEPLOYMENT, EnginePlan, Plan
from flagscale.replica.autoscaling import with_engine_load_policy
from flagscale.replica.engine import EngineReplica, EngineSpec
from flagscale.replica.registry import version_of
from flagscale.router import keyring, own_port, peers
from flagscale.router.keyring import AcceptedKey
from flagscale.router.router import Router
from flagscale.router.spec import GRAPH_MAX_ONGOING, LoraNode, RouterSpec
from flagscale.serve.graph import GRAPH_DRIVER_DEPLOYMENT, CustomNode, GraphDriver, NodeSpec

if TYPE_CHECKING:
    from ray.serve import Application

HEALTH_CHECK_PERIOD_S = 5
HEALTH_CHECK_TIMEOUT_S = 30
# Requests reach engines and routers over their own HTTP servers, never through Serve, so Serve counts none in flight
# on these replicas: its graceful shutdown only sleeps one wait loop (default 2 s) before their own drain (the
# engine replica's __del__, the router's drain at stop) runs. Graph nodes take requests through Serve: its default.
NOT_SERVED_THROUGH_SERVE = {"graceful_shutdown_wait_loop_s": 0.2}


def build_app(
    plan: Plan, no_spare: frozenset[str] = frozenset(), client_keys: tuple[AcceptedKey, ...] | None = None
) -> Application:
    """Every deployment gets a version derived from what its replicas are built from, so redeploying (an in-place
    update) restarts only the replicas whose spec changed. Engine replicas are replaced one at a time, the new one
    healthy before the old one drains (Serve's surge), except for the nodes in `no_spare` (no room for a spare
    replica: the old one stops first). `client_keys`: the keys the router accepts (an update's rotation,
    flagscale/actions/key_rotation.py); None: the plan's key alone."""
    engines = []
    for engine in plan.engines:
        scaling = engine.serve_scaling(default_max_ongoing=DEFAULT_MAX_ONGOING_REQUESTS)
        sleep_delay_s = engine.sleep_delay_s if engine.planned_awake else None
        scaling = with_engine_load_policy(scaling, engine.slo, engine.role, sleep_delay_s=sleep_delay_s)
        deployment = serve.deployment(
            EngineReplica,
            name=engine.serve_id,
            ray_actor_options=engine.ray_actor_options,
            health_check_period_s=HEALTH_CHECK_PERIOD_S,
            health_check_timeout_s=HEALTH_CHECK_TIMEOUT_S,
            graceful_shutdown_timeout_s=plan.drain_timeout_s,
            **NOT_SERVED_THROUGH_SERVE,
            **scaling,
            **_placement_group(engine),
            **_one_at_a_time(engine.initial_replicas, spare=engine.serve_id not in no_spare),
            # LoRA adapters: loaded by each replica before it is READY, and changed in place (EngineReplica.reconfigure)
            **({"user_config": {"adapters": engine.adapters}} if engine.lora else {}),
        )
        spec = engine_spec(plan, engine)
        engines.append(with_version(deployment, engine_version(spec.version, scaling)).bind(spec))
    spec = router_spec(plan, client_keys)
    router = serve.deployment(
        Router,
        name=ROUTER_DEPLOYMENT,
        # deploy.router_processes: all on the head, sharing the port (flagscale/router/peers.py); changing
        # the count is a scale of this deployment, not a restart of its replicas
        num_replicas=plan.router_processes,
        # multi-host: on the head host, where deploy.host is; an existing Ray cluster: on its head node
        ray_actor_options={
            "num_cpus": 0,
            **_resources(launchers.get(plan.launcher).router_resources()),
            # who else may listen on the port: routers of this deployment only (flagscale/router/own_port.py)
            "runtime_env": _router_runtime_env(plan),
        },
        health_check_period_s=HEALTH_CHECK_PERIOD_S,
        **NOT_SERVED_THROUGH_SERVE,
        # The rest of its spec reaches a running router through reconfigure(): an update never restarts it
        user_config=spec.user_config(),
    )
    # (a new API key reaches it in its user_config, in place: flagscale/router/keyring.py)
    router = with_version(router, version_of([plan.app_name, plan.host, plan.port, plan.pin_cpus]))
    graph = {"graph": build_graph_driver(plan)} if plan.graph else {}
    return router.bind(spec, *engines, **graph)


def engine_version(spec_version: str, scaling: dict) -> str:
    """An engine deployment's version: its spec's, and whether it autoscales. Serve (2.60) starts a replica's
    custom autoscaling metrics only when the replica starts with an autoscaling config
    (ReplicaMetricsManager.enable_custom_autoscaling_metrics; a later reconfigure does not start them), so a
    replica updated in place from a fixed count to autoscaling would never report its engine's load, and the node
    would never grow. Turning autoscaling on or off therefore replaces the replicas; changing its bounds does not."""
    return version_of([spec_version, "autoscaled"]) if "autoscaling_config" in scaling else spec_version


def engine_spec(plan: Plan, engine: EnginePlan) -> EngineSpec:
    launcher = launchers.get(plan.launcher)
    return EngineSpec(
        app=plan.app_name,
        serve_id=engine.serve_id,
        model_names=engine.model_names,
        argv=engine.argv,
        host_argv=engine.host_argv,
        # Multi-host: the router on the head reaches engines at their node IP ("node-ip" = not loopback).
        bind_host=launcher.engine_bind_host,
        log_dir=launcher.engine_log_dir(plan),
        # secret engine args (hf_token) travel in the env, as does the engine key (the engine kind's launch puts it
        # where its server reads it): never in argv. The deployment's own key, not the clients': a new client key
        # replaces no engine (flagscale/router/keyring.py)
        env={
            **_block_hash_seed(plan, engine),
            **engine.family_env,
            **launcher.engine_env(plan),
            **engine.secret_env,
            **_sleep_env(engine),
        },
        family=engine.family,
        api_key=keyring.engine_key(plan.exp_dir) if plan.api_key else None,
        engine=engine.engine,
        parallel=engine.parallel,
        expert_parallel=engine.expert_parallel,
        kv_events=engine.kv_events,
        startup_timeout_s=plan.startup_timeout_s,
        pin_cpus=plan.pin_cpus,
        role=engine.role,
        drain_timeout_s=plan.drain_timeout_s,
        sleep_delay_s=engine.sleep_delay_s,
    )


def _block_hash_seed(plan: Plan, engine: EnginePlan) -> dict[str, str]:
    """For engines publishing KV-cache events: one prefix-cache hash seed for every engine of the deployment, which
    their records tell the router (engines/vllm_kv_events.py). Without PYTHONHASHSEED, vLLM 0.26 (the GPU recipe's)
    draws the first block's parent at random in each engine, and no router could key a block as it does. Derived
    from the deployment's secret: the same across updates and restarts, not guessable from outside (the seed also
    sets the engine's Python string hashing). A PYTHONHASHSEED of the user's (experiment.envs) wins."""
    if not engine.kv_events:
        return {}
    digest = hashlib.sha256(f"{peers.secret_of(plan.exp_dir)}:block-hash-seed".encode()).digest()
    return {"PYTHONHASHSEED": str(int.from_bytes(digest[:4], "big"))}


def _sleep_env(engine: EnginePlan) -> dict[str, str]:
    """What the engine's server needs for its sleep routes (plan/sleep.py), when the node's replicas sleep."""
    mode = engine.kind.sleep_mode
    return dict(mode.env) if engine.sleep_delay_s is not None and mode is not None else {}


def _one_at_a_time(replicas: int, spare: bool) -> dict:
    replicas = max(1, replicas)
    return {
        "rolling_update_percentage": 1 / replicas,
        "max_surge_percent": math.ceil(100 / replicas) if spare else 0,
    }


def deployment_name(plan: Plan) -> str:
    """What tells this deployment's router processes from another's on the same port: its app and exp_dir."""
    return f"{plan.app_name}@{plan.exp_dir}"


def _router_runtime_env(plan: Plan) -> dict:
    """The job's runtime env (on an existing cluster: py_modules with the flagscale package), plus the deployment's
    name: Serve gives a deployment that has a runtime_env of its own nothing of the job's (but its working_dir)."""
    job = dict(ray.get_runtime_context().runtime_env or {}) if ray.is_initialized() else {}
    return {**job, "env_vars": {**job.get("env_vars", {}), own_port.DEPLOYMENT_ENV: deployment_name(plan)}}


def router_spec(plan: Plan, client_keys: tuple[AcceptedKey, ...] | None = None) -> RouterSpec:
    """What the router is told: the models (served name -> node), each model's routing (its node's; a disaggregated
    node's decode pool, and separately its prefill pool's), the graph's route, the keys it accepts (`client_keys`,
    else the plan's key alone) and the one it sends the engines."""
    peer_secret = peers.secret_of(plan.exp_dir)
    models = {name: e.group for e in plan.engines for name in served_models(e)}
    routing = {name: e.routing for e in plan.engines if e.role != "prefill" for name in served_models(e)}
    prefill_routing = {name: e.routing for e in plan.engines if e.role == "prefill" for name in e.model_names}
    return RouterSpec(
        app=plan.app_name,
        host=plan.host,
        port=plan.port,
        models=models,
        graph_route=plan.graph.route if plan.graph else None,
        pin_cpus=plan.pin_cpus,
        routing=routing,
        prefill_routing=prefill_routing,
        client_keys=keyring.current_keys(peer_secret, plan.api_key) if client_keys is None else client_keys,
        engine_key=keyring.engine_key(plan.exp_dir),
        protect_metrics=plan.protect_metrics,
        # requests each replica is sent at once (the router queues the rest): per engine deployment
        max_ongoing={e.serve_id: e.max_ongoing_requests or DEFAULT_MAX_ONGOING_REQUESTS for e in plan.engines},
        admission=plan.admission,
        no_resume=sorted(
            {name for e in plan.engines if not e.kind.capabilities.resume_from_tokens for name in served_models(e)}
        ),
        engines={name: e.engine for e in plan.engines for name in served_models(e)},
        adapters={name: e.model_names[0] for e in plan.engines for name in e.adapters},
        max_loras={e.serve_id: e.lora.max_loras for e in plan.engines if e.lora},
        lora_nodes={e.serve_id: lora_node(e) for e in plan.engines if e.lora and e.role is None},
        # the same for every router process Serve starts for this deployment, in its init args only
        peer_secret=peer_secret,
        processes=plan.router_processes,
        # nodes (a disaggregated node: its decode pool) that may scale to zero: their requests wait (bounded) for a
        # replica to start
        scale_from_zero={
            name: plan.startup_timeout_s
            for e in plan.engines
            if e.role != "prefill" and at_zero(e)
            for name in e.model_names
        },
        zero_pools=zero_pools(plan),
        awake_planned=[e.serve_id for e in plan.engines if e.planned_awake],
    )


def at_zero(engine: EnginePlan) -> bool:
    """May this engine deployment (a node, or a disaggregated node's pool) scale to zero replicas?"""
    return (engine.autoscaling or {}).get("min_replicas") == 0


def zero_pools(plan: Plan) -> dict[str, dict[str, str]]:
    """Disaggregated models -> their pools that may scale to zero (role -> serve_id)."""
    pools: dict[str, dict[str, str]] = {}
    for e in plan.engines:
        if e.role is not None and at_zero(e):
            for name in e.model_names:
                pools.setdefault(name, {})[e.role] = e.serve_id
    return pools


def lora_node(engine: EnginePlan) -> LoraNode:
    """What the router's admin call checks an adapter added to this node against (router/adapter_admin.py)."""
    lora = engine.lora
    return LoraNode(
        engine.model_names[0],
        engine.model_names,
        lora.model,
        lora.max_lora_rank,
        lora.default_rank_limit,
        lora.adapters,
    )


def served_models(engine: EnginePlan) -> list[str]:
    """The models clients name for an engine deployment: its served names, then its LoRA adapters."""
    return [*engine.model_names, *engine.adapters]


def build_graph_driver(plan: Plan) -> Application:
    """One deployment per custom node, and the driver that runs the DAG over their handles."""

    assert plan.graph is not None
    nodes = {}
    for node in plan.graph.nodes:
        deployment = serve.deployment(
            CustomNode,
            name=node.serve_id,
            ray_actor_options=node.ray_actor_options,
            health_check_period_s=HEALTH_CHECK_PERIOD_S,
            graceful_shutdown_timeout_s=plan.drain_timeout_s,
            **node.serve_scaling(),
        )
        clients = {
            param: (plan.endpoint, plan.graph.engine_models[serve_id]) for param, serve_id in node.engine_params.items()
        }
        spec = NodeSpec(node.serve_id, node.module_path, node.class_name, clients, node.module_digest, plan.api_key)
        nodes[node.serve_id] = with_version(deployment, version_of(asdict(spec))).bind(spec)
    driver = serve.deployment(
        GraphDriver,
        name=GRAPH_DRIVER_DEPLOYMENT,
        num_replicas=1,
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=GRAPH_MAX_ONGOING,
        health_check_period_s=HEALTH_CHECK_PERIOD_S,
    )
    return with_version(driver, version_of(asdict(plan.graph))).bind(plan.graph, **nodes)


def _placement_group(engine) -> dict:
    if not engine.placement_bundles:
        return {}
    return {"placement_group_bundles": engine.placement_bundles, "placement_group_strategy": engine.placement_strategy}


def _resources(resources: dict[str, float]) -> dict:
    return {"resources": resources} if resources else {}
