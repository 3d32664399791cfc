"""`action=run`: start Ray (this machine or a hostfile's hosts), deploy the graph, wait until healthy, print the endpoint."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from pathlib import Path

from rich.console import Console

from flagscale import launchers
from flagscale.actions.context import ActionContext
from flagscale.actions.teardown import EnvFor, no_envs, teardown
from flagscale.cluster.ray_compat import (
    SERVE_WAITING_FOR_RESOURCES,
    deploy_app,
    free_resources_per_node,
    running_replicas,
)
from flagscale.cluster.ray_node import cluster_alive
from flagscale.cluster.state import RunState
from flagscale.errors import ConfigError, DeployError, FlagScaleError, error_excerpt
from flagscale.launchers import connect
from flagscale.net import health_ok
from flagscale.plan import Plan, open_without_key
from flagscale.replica import registry
from flagscale.rollout import Rollout, fmt, stuck_at
from flagscale.update import changed_nodes, diff, replaced_nodes, replicas_running

log = logging.getLogger(__name__)


def refuse_if_running(exp_dir: str, console: Console, env_for: EnvFor = no_envs) -> None:
    """A second `run` on the same exp_dir must not start a second copy."""
    state = RunState.load(exp_dir)
    if state is None:
        return
    if cluster_alive(state):
        raise FlagScaleError(
            f"already running (phase {state.phase}) at {state.endpoint} with models {', '.join(state.models)}; "
            "see action=status, or action=stop first",
            f"{exp_dir}/state.json",
        )
    console.print("[yellow]found a stale state file from an earlier run; cleaning up what is left of it[/]")
    teardown(state, console, env_for=env_for)
    RunState.remove(exp_dir)


def plan_env_for(plan: Plan) -> EnvFor:
    host_envs = launchers.get(plan.launcher).host_envs(plan)
    return lambda host: host_envs.get(host, plan.envs) if host else plan.envs


def run(plan: Plan, console: Console, foreground: bool = False, snapshot: dict | None = None) -> int:
    """`snapshot`: the validated config (flagscale/update.py), recorded so that a later `run` can update in place."""
    plan.log_dir.mkdir(parents=True, exist_ok=True)
    _log_to_file(plan.log_dir / "runner.log")
    launcher = launchers.get(plan.launcher)
    state = RunState(
        app_name=plan.app_name,
        exp_dir=plan.exp_dir,
        endpoint=plan.endpoint,
        ray_address="",
        token_path=launcher.auth_token(plan),
        models=plan.model_ids,
        started_at=time.time(),
        runner_pid=os.getpid(),
        # cmds.after_stop: recorded at start, so any later teardown (stop, Ctrl-C, failed start) runs it on each host.
        # Without env values: stop gives them from its config (teardown.EnvFor).
        extra={"after_stop": {"snippet": plan.after_stop}} if plan.after_stop else {},
    )
    t0 = time.monotonic()
    launcher.check_free(plan)
    warning = open_without_key(plan)
    if warning:
        console.print(f"[bold yellow]warning:[/] {warning}", soft_wrap=True)
    previous = _stop_on_termination()
    try:
        started = launcher.launch(state, plan, console)
        console.print(f"{started} ({time.monotonic() - t0:.1f}s)")
        connect(state)
        check_fits(plan)
        _deploy(plan, console)
        _wait_until_serving(plan, console, t0)
        state.phase = "running"
        if snapshot is not None:
            state.extra["config"] = snapshot
        state.save()
    except BaseException as exc:
        return _stop_started(exc, state, plan, console)
    finally:
        _restore_handlers(previous)
    _print_ready(plan, console, time.monotonic() - t0)
    import ray

    ray.shutdown()
    if foreground:
        return _stay_attached(state, plan, console)
    return 0


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP during a run's start: handled as Ctrl-C is (what was started is stopped)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


TERMINATING = (signal.SIGTERM, signal.SIGHUP)


def _raise_terminated(signum: int, _frame) -> None:
    raise Terminated(signum)


def _stop_on_termination() -> dict:
    """SIGTERM and SIGHUP raise Terminated while the run starts; the handlers they had, to restore. (Only the main
    thread may install handlers: elsewhere nothing changes.)"""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {signum: signal.signal(signum, _raise_terminated) for signum in TERMINATING}


def _restore_handlers(previous: dict) -> None:
    for signum, handler in previous.items():
        signal.signal(signum, handler)


class _WritesOrNot:
    """A console's file whose write errors (EIO from a terminal that hung up) are dropped."""

    def __init__(self, file):
        self._file = file

    def write(self, text: str) -> int:
        try:
            return self._file.write(text)
        except OSError:
            return len(text)

    def flush(self) -> None:
        try:
            self._file.flush()
        except OSError:
            pass

    def __getattr__(self, name: str):
        return getattr(self._file, name)


def _stop_started(exc: BaseException, state: RunState, plan: Plan, console: Console) -> int:
    """A start that failed or was interrupted (Ctrl-C, SIGTERM, SIGHUP): stop what it started, remove the state
    file, then the error again (a FlagScaleError as it was, anything else as a DeployError) or the exit code of
    the signal (130 for Ctrl-C, 128 + its number for the others)."""
    if threading.current_thread() is threading.main_thread():
        for signum in TERMINATING:  # a second one must not cut the teardown short
            signal.signal(signum, signal.SIG_IGN)
    if isinstance(exc, Terminated):
        console.file = _WritesOrNot(console.file)  # after a hang-up the terminal may refuse writes: tear down anyway
        console.print(f"[yellow]{exc} received; stopping what was started[/]")
    elif isinstance(exc, KeyboardInterrupt):
        console.print("[yellow]interrupted; stopping what was started[/]")
    log.error("run failed", exc_info=exc)
    teardown(state, console, drain_timeout_s=0, env_for=plan_env_for(plan))
    RunState.remove(plan.exp_dir)
    console.print("stopped everything this run started")
    if isinstance(exc, FlagScaleError):
        raise exc
    if isinstance(exc, Terminated):
        return 128 + exc.signum
    if isinstance(exc, KeyboardInterrupt):
        return 130
    raise DeployError(str(exc)) from exc


def update(state: RunState, plan: Plan, snapshot: dict, console: Console, config_file: str) -> int:
    """`run` on a running deployment: apply what changed (flagscale/update.py) by redeploying the application;
    Serve replaces only the replicas whose spec changed, each new one healthy before the old one drains."""
    running = state.extra.get("config")
    if running is None:
        raise FlagScaleError(
            "this deployment was started without a record of its config (an earlier version of the runner), so "
            "it cannot be updated in place; action=stop, then run",
            f"{state.exp_dir}/state.json",
        )
    changes = diff(running, snapshot)
    if not changes:
        console.print(f"already running this config at {state.endpoint}: nothing to change")
        return 0
    fixed = [c for c in changes if not c.in_place]
    if fixed:
        raise ConfigError(
            "cannot be changed while the deployment runs (its cluster was started with it): "
            + "; ".join(c.describe() for c in fixed)
            + ". Nothing was changed; action=stop, then run",
            f"{config_file}: {fixed[0].path}",
        )
    console.print(f"updating in place ({len(changes)} change(s)):")
    for change in changes:
        console.print(f"  {change.describe()}", markup=False)
    t0 = time.monotonic()
    connect(state)
    check_fits(plan)
    replaced = replaced_nodes(changes)
    no_spare = _spares(plan, replaced, console, running)
    _refuse_if_stuck(plan, changed_nodes(changes), replaced, no_spare)
    _deploy(plan, console, no_spare)
    # Recorded at once: Serve now works toward this config, and a later `run` must diff against it.
    state.extra["config"] = snapshot
    state.models = plan.model_ids
    state.save()
    try:
        _wait_until_serving(plan, console, t0)
    except FlagScaleError as exc:
        raise DeployError(
            f"the update did not complete: {exc}. Replicas that were not replaced keep serving (action=status); "
            "run again with a fixed config, or action=stop"
        ) from None
    finally:
        import ray

        ray.shutdown()
    console.print(f"[green]updated[/] in {time.monotonic() - t0:.1f}s; serving at {plan.endpoint}/v1")
    return 0


def _spares(plan: Plan, nodes: list[str], console: Console, running: dict) -> frozenset[str]:
    """The changed nodes whose replicas are replaced in place (no node has room for a spare): refused for a node
    that runs or will run one replica, which would stop serving (while its one running replica holds what a new
    one needs, a new one cannot even start); said for the others."""
    no_spare = _without_room_for_a_spare(plan, nodes)
    for engine in plan.engines:
        if engine.serve_id in no_spare:
            now = replicas_running(running, engine.serve_id) or engine.initial_replicas
            if min(now, engine.initial_replicas) < 2:
                raise DeployError(
                    f"no node has room for a spare replica of '{engine.serve_id}' "
                    f"({fmt(_need(engine.ray_actor_options))}): replacing its only replica in place would stop "
                    "serving it; nothing was changed. Free that much, or action=stop, then run",
                    f"serve_id {engine.serve_id}",
                )
            console.print(
                f"[yellow]no room for a spare replica of '{engine.serve_id}': its replicas are replaced one at a "
                "time, one fewer serving meanwhile[/]"
            )
    return no_spare


def _refuse_if_stuck(plan: Plan, nodes: list[str], replaced: list[str], no_spare: frozenset[str]) -> None:
    """Refused before anything changes: an update of a node that Serve would start and then wait on forever, a new
    replica finding no room at some step (flagscale/rollout.py)."""
    free = free_resources_per_node()
    for engine in plan.engines:
        if engine.serve_id not in nodes:
            continue
        old = running_replicas(plan.app_name, engine.serve_id)
        rollout = Rollout(
            free=free,
            old=old,
            need=_need(engine.ray_actor_options),
            count=engine.initial_replicas,
            replaced=engine.serve_id in replaced,
            spare=engine.serve_id not in no_spare,
        )
        step = stuck_at(rollout)
        if step:
            raise DeployError(
                f"updating '{engine.serve_id}' in place ({len(old)} -> {engine.initial_replicas} replica(s)) would "
                f"wait forever for room: {step}; nothing was changed. Free that much, or action=stop, then run",
                f"serve_id {engine.serve_id}",
            )


def _need(options: dict) -> dict:
    need = {"CPU": options.get("num_cpus", 0), "GPU": options.get("num_gpus", 0), **options.get("resources", {})}
    return {k: v for k, v in need.items() if v}


def _without_room_for_a_spare(plan: Plan, serve_ids: list[str]) -> frozenset[str]:
    """The changed engine nodes for which no node has the free resources of one more replica."""
    free = list(free_resources_per_node().values())
    tight = set()
    for engine in plan.engines:
        if engine.serve_id in serve_ids:
            need = _need(engine.ray_actor_options)
            if not any(all(node.get(k, 0) >= v for k, v in need.items()) for node in free):
                tight.add(engine.serve_id)
    return frozenset(tight)


def check_fits(plan: Plan) -> None:
    """Every replica must fit on some node of the cluster; otherwise Serve would wait forever."""
    import ray

    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    groups = [*plan.engines, *(plan.graph.nodes if plan.graph else [])]
    for group in groups:
        need = _need(group.ray_actor_options)
        if not any(all(node.get(k, 0) >= v for k, v in need.items()) for node in nodes):
            largest = max(nodes, key=lambda n: n.get("CPU", 0)) if nodes else {}
            offer = {k: v for k, v in largest.items() if not k.startswith(("node:", "memory", "object_store"))}
            raise DeployError(
                f"a replica of '{group.serve_id}' needs {fmt(need)}, but no node offers that (largest: {fmt(offer)})",
                f"serve_id {group.serve_id}",
            )


def _deploy(plan: Plan, console: Console, no_spare: frozenset[str] = frozenset()) -> None:
    # reason: ray.serve and the application's code take seconds to import; only a deploy needs them
    from ray import serve

    from flagscale.serve.app import build_app  # reason: as above

    serve.start(proxy_location="Disabled", http_options={"host": "127.0.0.1"})
    deploy_app(build_app(plan, no_spare), plan.app_name)


FATAL_AT_START = ("EngineStartError", "RouterListenError")  # (flagscale/replica/engine.py, router/router.py)


def _wait_until_serving(plan: Plan, console: Console, t0: float) -> None:
    """Until the application runs, every engine replica of the planned version is in the router's registry (and
    no other), and the endpoint answers."""
    from ray import serve

    deadline = time.monotonic() + plan.startup_timeout_s
    pending_since: dict[str, float] = {}
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
                    # An engine whose server exited during start-up, or a router that cannot have its port, will
                    # not do better on Serve's retries.
                    message = dep.message or ""
                    if dep.status in ("DEPLOY_FAILED", "UNHEALTHY") or any(e in message for e in FATAL_AT_START):
                        raise DeployError(_cause(dep.message), f"deployment {name}")
                    if SERVE_WAITING_FOR_RESOURCES in (dep.message or ""):
                        pending_since.setdefault(name, now)
                        if now - pending_since[name] > plan.schedule_timeout_s:
                            raise DeployError(f"replicas cannot be scheduled: {dep.message}", f"deployment {name}")
                    else:
                        pending_since.pop(name, None)
                if app.status == "RUNNING" and _runs(plan) and health_ok(plan.endpoint, timeout_s=2):
                    return
                if app.status == "DEPLOY_FAILED":
                    raise DeployError(_cause(app.message), f"application {plan.app_name}")
                summary = ", ".join(
                    f"{name}: {dep.status} ({_replicas(dep.replica_states)})" for name, dep in app.deployments.items()
                )
                spinner.update(f"deploying [{now - t0:.0f}s] {summary}")
            time.sleep(1.0)


def _runs(plan: Plan) -> bool:
    """Whether the router's registry lists, for each engine node, only replicas of the planned version (an update
    is not done while an old one is listed) and as many as planned (at least one when autoscaling)."""
    from flagscale.serve.app import engine_spec  # reason: imports ray.serve (seconds); only a deploy waits here

    listed = registry.list_replicas(plan.app_name)
    for engine in plan.engines:
        versions = [r.version for r in listed if r.serve_id == engine.serve_id]
        expected = engine.num_replicas if engine.num_replicas is not None else max(1, len(versions))
        if len(versions) != expected or set(versions) != {engine_spec(plan, engine).version}:
            return False
    return True


def _replicas(states: dict) -> str:
    return " ".join(f"{k.lower()}={v}" for k, v in states.items()) or "none yet"


def _cause(message: str) -> str:
    """Serve wraps the replica's exception in a long traceback; keep the line(s) that say why."""
    return error_excerpt(message or "", after=11, fallback=20) or "no message from Ray Serve"


def _print_ready(plan: Plan, console: Console, elapsed: float) -> None:
    console.print(f"[green]serving[/] in {elapsed:.1f}s")
    console.print(f"  endpoint : {plan.endpoint}/v1  (OpenAI API: /v1/models, /v1/completions, /v1/chat/completions)")
    if plan.endpoint_moved:
        console.print(f"             {plan.endpoint_moved}", soft_wrap=True)
    console.print(f"  models   : {', '.join(plan.model_ids)}")
    if plan.graph:
        console.print(f"  graph    : POST {plan.endpoint}{plan.graph.route}  (sink: {plan.graph.sink})")
    console.print(f"  logs     : {plan.log_dir}")
    console.print("  status   : python run.py ... action=status    stop: python run.py ... action=stop")


def _stay_attached(state: RunState, plan: Plan, console: Console) -> int:
    stop = threading.Event()
    # Installed explicitly: a process started in the background inherits SIGINT ignored, and Ctrl-C
    # (or `kill -INT`) must still stop the run; a handler also keeps the signal out of library code.
    for signum in (signal.SIGINT, *TERMINATING):
        signal.signal(signum, lambda *_: stop.set())
    console.print("foreground: press Ctrl-C to stop")
    while not stop.wait(1.0):
        if not cluster_alive(state):
            console.print("[red]the Ray cluster went away[/]")
            break
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # let the teardown finish
    problems = teardown(state, console, plan.drain_timeout_s, plan_env_for(plan))
    RunState.remove(plan.exp_dir)
    console.print("stopped" if not problems else "stopped with problems:\n  " + "\n  ".join(problems))
    return 0 if not problems else 1


def _log_to_file(path: Path) -> None:
    """The runner's own log goes to exp_dir/serve_logs/runner.log, not to the console (that shows the summary)."""
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logger = logging.getLogger("flagscale")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


def running_state(exp_dir: str) -> RunState | None:
    """The state of a deployment that is up and serving from this exp_dir, else None."""
    state = RunState.load(exp_dir)
    return state if state is not None and state.phase == "running" and cluster_alive(state) else None


def act(ctx: ActionContext) -> int:
    ctx.print_notices()
    running = running_state(ctx.exp_dir)
    if running is not None:
        plan = ctx.plan(check_port=False)  # the port is the running router's
        return update(running, plan, ctx.snapshot(plan), ctx.console, ctx.sources.main)
    refuse_if_running(ctx.exp_dir, ctx.console, ctx.config.experiment.env_for)
    plan = ctx.plan()
    return run(plan, ctx.console, foreground=ctx.config.foreground, snapshot=ctx.snapshot(plan))
