"""Deploying a plan's application on a connected Ray cluster and waiting until it serves: shared by a fresh `run`
and an update in place (flagscale/actions/update_in_place.py)."""

from __future__ import annotations

import time

from rich.console import Console

from flagscale.actions.runner_log import route_serve_logger
from flagscale.adaptors import ray, serve
from flagscale.cluster.ray_compat import SERVE_WAITING_FOR_RESOURCES, deploy_app
from flagscale.errors import DeployError, error_excerpt
from flagscale.net import health_ok
from flagscale.plan import Plan
from flagscale.replica import registry, runtime_adapters
from flagscale.rollout import fmt

FATAL_AT_START = ("EngineStartError", "RouterListenError")  # (flagscale/replica/engine.py, router/router.py)


def need(options: dict) -> dict:
    """The resources one replica asks Ray for (its ray_actor_options), zeros left out."""
    wanted = {"CPU": options.get("num_cpus", 0), "GPU": options.get("num_gpus", 0), **options.get("resources", {})}
    return {k: v for k, v in wanted.items() if v}


def check_fits(plan: Plan) -> None:
    """Every replica must fit on some node of the cluster; otherwise Serve would wait forever."""
    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    groups = [*plan.engines, *(plan.graph.nodes if plan.graph else [])]
    for group in groups:
        wanted = need(group.ray_actor_options)
        if not any(all(node.get(k, 0) >= v for k, v in wanted.items()) for node in nodes):
            largest = max(nodes, key=lambda n: n.get("CPU", 0)) if nodes else {}
            offer = {k: v for k, v in largest.items() if not k.startswith(("node:", "memory", "object_store"))}
            raise DeployError(
                f"a replica of '{group.serve_id}' needs {fmt(wanted)}, but no node offers that (largest: {fmt(offer)})",
                f"serve_id {group.serve_id}",
            )


def deploy(
    plan: Plan, no_spare: frozenset[str] = frozenset(), client_keys: tuple | None = None
) -> dict[str, dict[str, str]]:
    """`client_keys`: the keys the router accepts (flagscale/router/keyring.py); None: the plan's key alone.
    Returns the adapter sets given at run time (router's admin call) that the config's sets now replace."""
    from flagscale.serve.app import build_app  # reason: the application's code (router, replicas) imports in ~0.7 s

    route_serve_logger()
    serve.start(proxy_location="Disabled", http_options={"host": "127.0.0.1"})
    registry.clear_stopping(plan.app_name)  # (left by a stop that died half-way: this deployment is not stopping)
    replaced = runtime_adapters.clear(plan.app_name)  # the config is the deployment's truth again
    deploy_app(build_app(plan, no_spare, client_keys), plan.app_name)
    return replaced


def wait_until_serving(plan: Plan, console: Console, t0: float) -> None:
    """Until the application runs, every engine replica of the planned version is in the router's registry (and
    no other), and the endpoint answers. What each deployment is doing: on a terminal beside a spinner, elsewhere
    (a pipe, CI's log) as a plain line each time it changes."""
    deadline = time.monotonic() + plan.startup_timeout_s
    pending_since: dict[str, float] = {}
    shown = ""
    with console.status("deploying ...") as spinner:
        while True:
            now = time.monotonic()
            if now > deadline:
                raise DeployError(
                    f"not healthy within startup_timeout_s={plan.startup_timeout_s:g}s; logs in {plan.log_dir}",
                    "experiment.runner.deploy.startup_timeout_s",
                )
            app = serve.status().applications.get(plan.app_name)
            if app is not None:
                for name, dep in app.deployments.items():
                    _check_deployment(plan, name, dep, pending_since, now)
                if app.status == "RUNNING" and _runs(plan, app.deployments) and health_ok(plan.endpoint, timeout_s=2):
                    return
                if app.status == "DEPLOY_FAILED":
                    raise DeployError(cause(app.message), f"application {plan.app_name}")
                summary = ", ".join(
                    f"{name}: {_value(dep.status)} ({_replicas(dep.replica_states)})"
                    for name, dep in app.deployments.items()
                )
                spinner.update(f"deploying [{now - t0:.0f}s] {summary}")
                if not console.is_terminal and summary != shown:
                    console.print(f"deploying [{now - t0:.0f}s] {summary}", markup=False, soft_wrap=True)
                    shown = summary
            time.sleep(1.0)


def _check_deployment(plan: Plan, name: str, dep, pending_since: dict[str, float], now: float) -> None:
    """A deployment that cannot become healthy raises DeployError: failed, unhealthy, a fatal error at start, or
    replicas Serve could not place within schedule_timeout_s."""
    # An engine whose server exited during start-up, or a router that cannot have its port, will not do better
    # on Serve's retries.
    message = dep.message or ""
    if dep.status in ("DEPLOY_FAILED", "UNHEALTHY") or any(e in message for e in FATAL_AT_START):
        raise DeployError(cause(dep.message), f"deployment {name}")
    if SERVE_WAITING_FOR_RESOURCES in message:
        pending_since.setdefault(name, now)
        if now - pending_since[name] > plan.schedule_timeout_s:
            raise DeployError(f"replicas cannot be scheduled: {dep.message}", f"deployment {name}")
    else:
        pending_since.pop(name, None)


def _runs(plan: Plan, deployments: dict) -> bool:
    """Whether the router's registry lists, for each engine node, only replicas of the planned version (an update
    is not done while an old one is listed) and as many as planned: at least one when autoscaling, unless Serve
    has the node at zero (`deployments`: Serve's, by name), which starts on its next request."""
    from flagscale.serve.app import engine_spec  # reason: as build_app above: only a deploy needs it

    listed = registry.list_replicas(plan.app_name)
    for engine in plan.engines:
        versions = [r.version for r in listed if r.serve_id == engine.serve_id]
        if engine.num_replicas is not None:
            expected = engine.num_replicas
        else:
            expected = max(1, len(versions)) if versions or _has_replicas(deployments.get(engine.serve_id)) else 0
        if len(versions) != expected or (versions and set(versions) != {engine_spec(plan, engine).version}):
            return False
    return True


def _has_replicas(deployment) -> bool:
    """Whether Serve has any replica of `deployment` in any state (None: not known yet, so it may)."""
    return deployment is None or any(count > 0 for count in deployment.replica_states.values())


def _value(status) -> str:
    """A Serve status as it reads (HEALTHY, not DeploymentStatus.HEALTHY)."""
    return str(getattr(status, "value", status))


def _replicas(states: dict) -> str:
    return " ".join(f"{k.lower()}={v}" for k, v in states.items()) or "none yet"


def cause(message: str) -> str:
    """Serve wraps the replica's exception in a long traceback; keep the line(s) that say why."""
    return error_excerpt(message or "", after=11, fallback=20) or "no message from Ray Serve"
