"""`action=run`: start Ray (this machine or a hostfile's hosts), deploy the graph, wait until healthy, print the
endpoint and what to type next; on a running deployment, update it in place (flagscale/actions/update_in_place.py).

A start that fails or is interrupted (Ctrl-C, SIGTERM, SIGHUP: flagscale/actions/signals.py) stops what it started."""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

from rich.console import Console

from flagscale import launchers
from flagscale.actions import signals
from flagscale.actions.console import survive_hang_up
from flagscale.actions.context import ActionContext
from flagscale.actions.deploy import check_fits, deploy, wait_until_serving
from flagscale.actions.invocation import RUN_PY, Invocation
from flagscale.actions.runner_log import log_to_file, runner_log_path
from flagscale.actions.teardown import EnvFor, no_envs, teardown
from flagscale.actions.update_in_place import update
from flagscale.adaptors import ray, serve
from flagscale.cluster.ray_node import cluster_alive
from flagscale.cluster.state import RunState
from flagscale.errors import DeployError, FlagScaleError
from flagscale.launchers import connect
from flagscale.paths import private_dir
from flagscale.plan import Plan, open_without_key

log = logging.getLogger(__name__)


def refuse_if_running(
    exp_dir: str, console: Console, env_for: EnvFor = no_envs, invocation: Invocation = RUN_PY
) -> None:
    """A second `run` on the same exp_dir must not start a second copy."""
    state = RunState.load(exp_dir)
    if state is None:
        return
    if cluster_alive(state):
        raise FlagScaleError(
            f"already running (phase {state.phase}) at {state.endpoint} with models {', '.join(state.models)}; "
            f"see `{invocation.command('status')}`, or `{invocation.command('stop')}` first",
            f"{exp_dir}/state.json",
        )
    console.print("[yellow]found a stale state file from an earlier run; cleaning up what is left of it[/]")
    teardown(state, console, env_for=env_for)
    RunState.remove(exp_dir)


def plan_env_for(plan: Plan) -> EnvFor:
    host_envs = launchers.get(plan.launcher).host_envs(plan)
    return lambda host: host_envs.get(host, plan.envs) if host else plan.envs


def run(
    plan: Plan,
    console: Console,
    foreground: bool = False,
    snapshot: dict | None = None,
    invocation: Invocation = RUN_PY,
) -> int:
    """`snapshot`: the validated config (flagscale/update.py), recorded so that a later `run` can update in place.
    `invocation`: how the user called us, for the lines that say what to type next."""
    make_private(plan)
    log_to_file(runner_log_path(plan.exp_dir))
    launcher = launchers.get(plan.launcher)
    state = _starting_state(plan, launcher.auth_token(plan))
    t0 = time.monotonic()
    launcher.check_free(plan)
    warning = open_without_key(plan)
    if warning:
        console.print(f"[bold yellow]warning:[/] {warning}", soft_wrap=True)
    # Ray and Serve imported whole before a signal can cut in: an import a signal interrupts stays half-made, and
    # the teardown needs both.
    ray.load()
    serve.load()
    previous = signals.stop_on_termination()
    try:
        started = launcher.launch(state, plan, console)
        console.print(f"{started} ({time.monotonic() - t0:.1f}s)")
        connect(state)
        check_fits(plan)
        deploy(plan)
        wait_until_serving(plan, console, t0)
        state.phase = "running"
        if snapshot is not None:
            state.extra["config"] = snapshot
        state.save()
    except BaseException as exc:
        return _stop_started(exc, state, plan, console)
    finally:
        signals.restore_handlers(previous)
    _print_ready(plan, console, time.monotonic() - t0, invocation)
    ray.shutdown()
    if foreground:
        return _stay_attached(state, plan, console)
    return 0


def make_private(plan: Plan) -> None:
    """The exp_dir and its log dir, made or narrowed to 0700: Ray opens the directories it makes to every user
    (0777), and its temp dir may be <exp_dir>/ray (cluster/ray_node.py ray_temp_dir); inside a private exp_dir no one
    else reaches them, nor the logs."""
    private_dir(Path(plan.exp_dir))
    private_dir(plan.log_dir)


def _starting_state(plan: Plan, token_path: str | None) -> RunState:
    return RunState(
        app_name=plan.app_name,
        exp_dir=plan.exp_dir,
        endpoint=plan.endpoint,
        ray_address="",
        token_path=token_path,
        models=plan.model_ids,
        started_at=time.time(),
        runner_pid=os.getpid(),
        # cmds.after_stop: recorded at start, so any later teardown (stop, Ctrl-C, failed start) runs it on each host.
        # Without env values: stop gives them from its config (teardown.EnvFor).
        extra={"after_stop": {"snippet": plan.after_stop}} if plan.after_stop else {},
    )


def _stop_started(exc: BaseException, state: RunState, plan: Plan, console: Console) -> int:
    """A start that failed or was interrupted (Ctrl-C, SIGTERM, SIGHUP): stop what it started, remove the state
    file, then the error again (a FlagScaleError as it was, anything else as a DeployError) or the exit code of
    the signal (signals.exit_code)."""
    signals.note_further_signals()
    if isinstance(exc, signals.Terminated):
        survive_hang_up(console)
        console.print(f"[yellow]{exc} received; stopping what was started[/]")
    elif isinstance(exc, KeyboardInterrupt):
        console.print("[yellow]interrupted; stopping what was started[/]")
    log.error("run failed", exc_info=exc)
    teardown(state, console, drain_timeout_s=0, env_for=plan_env_for(plan))
    RunState.remove(plan.exp_dir)
    console.print("stopped everything this run started")
    if isinstance(exc, FlagScaleError):
        raise exc
    if isinstance(exc, KeyboardInterrupt):
        return signals.exit_code(exc)
    raise DeployError(str(exc)) from exc


def _print_ready(plan: Plan, console: Console, elapsed: float, invocation: Invocation = RUN_PY) -> None:
    """The summary: where it serves, and the command lines that come next, one per line (80 columns)."""
    console.print(f"[green]serving[/] in {elapsed:.1f}s")
    console.print(f"  endpoint : {plan.endpoint}/v1", soft_wrap=True)
    console.print("             (OpenAI API: /v1/models, /v1/completions, /v1/chat/completions)")
    if plan.endpoint_moved:
        console.print(f"             {plan.endpoint_moved}", soft_wrap=True)
    console.print(f"  models   : {', '.join(plan.model_ids)}", soft_wrap=True)
    if plan.graph:
        console.print(f"  graph    : POST {plan.endpoint}{plan.graph.route}  (sink: {plan.graph.sink})", soft_wrap=True)
    console.print(f"  logs     : {plan.log_dir}", soft_wrap=True)
    for action in ("status", "stop"):
        console.print(f"  {action:<9}: {invocation.command(action)}", soft_wrap=True, markup=False)


def _stay_attached(state: RunState, plan: Plan, console: Console) -> int:
    stop = threading.Event()
    signals.call_on_stop_signals(stop.set)
    console.print("foreground: press Ctrl-C to stop")
    while not stop.wait(1.0):
        if not cluster_alive(state):
            console.print("[red]the Ray cluster went away[/]")
            break
    signals.note_further_signals()  # let the teardown finish
    problems = teardown(state, console, plan.drain_timeout_s, plan_env_for(plan))
    RunState.remove(plan.exp_dir)
    console.print("stopped" if not problems else "stopped with problems:\n  " + "\n  ".join(problems))
    return 0 if not problems else 1


def running_state(exp_dir: str) -> RunState | None:
    """The state of a deployment that is up and serving from this exp_dir, else None."""
    state = RunState.load(exp_dir)
    return state if state is not None and state.phase == "running" and cluster_alive(state) else None


def act(ctx: ActionContext) -> int:
    ctx.print_notices()
    running = running_state(ctx.exp_dir)
    if running is not None:
        plan = ctx.plan(check_port=False)  # the port is the running router's
        return update(running, plan, ctx.snapshot(plan), ctx.console, ctx.sources.main, ctx.invocation)
    refuse_if_running(ctx.exp_dir, ctx.console, ctx.config.experiment.env_for, ctx.invocation)
    plan = ctx.plan()
    return run(plan, ctx.console, ctx.config.foreground, ctx.snapshot(plan), ctx.invocation)
