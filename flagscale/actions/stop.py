"""`action=stop`: drain, delete the application, stop exactly the Ray nodes the run started. Idempotent."""

from __future__ import annotations

import time

from rich.console import Console
from rich.markup import escape

from flagscale.actions.context import ActionContext
from flagscale.actions.runner_log import log_to_file, runner_log_path
from flagscale.actions.teardown import EnvFor, no_envs, teardown
from flagscale.cluster.ray_node import stop_nodes
from flagscale.cluster.state import NewerStateFormat, RunState, StateFileError
from flagscale.net import port_open


def stop(exp_dir: str, console: Console, drain_timeout_s: float, env_for: EnvFor = no_envs) -> int:
    try:
        state = RunState.load(exp_dir)
        host, port = state.endpoint_address if state is not None else ("", 0)
    except StateFileError as exc:
        return _stop_from_unreadable_state(exp_dir, console, exc)
    if state is None:
        console.print(f"nothing is running for exp_dir {exp_dir}")
        return 0
    log_path = runner_log_path(exp_dir)
    if log_path.parent.is_dir():  # the libraries' chatter while stopping goes beside the run's own lines
        log_to_file(log_path)
    problems = teardown(state, console, drain_timeout_s, env_for)
    if port_open(host, port):
        problems.append(f"port {port} still accepts connections")
    if problems:
        console.print("[red]stop finished with problems:[/]\n  " + "\n  ".join(problems))
        return 1
    RunState.remove(exp_dir)
    console.print(f"stopped '{state.app_name}'")
    return 0


def _stop_from_unreadable_state(exp_dir: str, console: Console, error: StateFileError) -> int:
    """Stop the Ray sessions an unreadable state file still names (no drain: the application's name and address may
    be what is lost), then move the file aside so that a later run starts clean. A newer format is left alone."""
    path = RunState.path(exp_dir)
    if isinstance(error, NewerStateFormat):
        raise error
    console.print(f"[yellow]{escape(str(error))}[/]", soft_wrap=True)
    hosts, ssh_settings = RunState.recorded_hosts(exp_dir)
    if not hosts:
        console.print(
            f"[red]it names no Ray session to stop.[/] Check that nothing the run started is left (`ps -eo "
            f"pid,sess,args`: its Ray processes name the exp_dir's temp dir in --temp-dir), then remove {escape(str(path))}",
            soft_wrap=True,
        )
        return 1
    partial = RunState(app_name="?", exp_dir=exp_dir, endpoint="", ray_address="", token_path=None, hosts=hosts)
    partial.extra["ssh"] = ssh_settings
    console.print(f"stopping the {len(hosts)} Ray session(s) it still names ...")
    problems = stop_nodes(partial)
    if problems:
        console.print("[red]stop finished with problems:[/]\n  " + "\n  ".join(escape(p) for p in problems))
        return 1
    aside = path.with_name(f"state.json.unreadable-{time.strftime('%Y%m%d-%H%M%S')}")
    path.rename(aside)
    console.print(f"stopped the recorded sessions; the unreadable file is kept as {escape(str(aside))}")
    return 0


def act(ctx: ActionContext) -> int:
    deploy = ctx.config.experiment.runner.deploy
    return stop(ctx.exp_dir, ctx.console, deploy.drain_timeout_s, ctx.config.experiment.env_for)
