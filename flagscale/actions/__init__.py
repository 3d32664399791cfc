"""CLI actions. Each is thin: it reads the plan or the state file and calls the layers below."""

from __future__ import annotations

import logging
import os
import sys

from omegaconf import DictConfig
from rich.console import Console

from flagscale.config.load import hydra_sources, load_config
from flagscale.errors import FlagScaleError

log = logging.getLogger(__name__)


def dispatch(cfg: DictConfig) -> int:
    console = Console(highlight=False)
    try:
        return _dispatch(cfg, console)
    except FlagScaleError as exc:
        return report_error(exc)


def report_error(exc: FlagScaleError) -> int:
    from rich.markup import escape

    Console(stderr=True, highlight=False, soft_wrap=True).print(f"[red]error:[/] {escape(str(exc))}")
    return exc.exit_code


def plan_key(config, sources) -> str | None:
    """deploy.api_key / api_key_env, resolved for a client action (test, bench); one clear error if unset."""
    from flagscale.errors import ConfigError

    try:
        return config.experiment.runner.deploy.resolved_api_key()
    except ValueError as exc:
        raise ConfigError(str(exc), f"{sources.main}: experiment.runner.deploy.api_key_env") from None


def _dispatch(cfg: DictConfig, console: Console) -> int:
    from flagscale.cluster.state import resolve_exp_dir

    sources = hydra_sources()
    config = load_config(cfg, sources)
    exp_dir = resolve_exp_dir(config.experiment.exp_dir)
    # `stop` of an exp_dir that does not exist has nothing to stop, and must not create it.
    if config.action in LOCKED_ACTIONS and (config.action != "stop" or os.path.isdir(exp_dir)):
        from flagscale.cluster.lock import ExpDirLock

        with ExpDirLock(exp_dir, config.action) as lock:
            if config.action == "run" and config.foreground:
                lock.describe(foreground=True)
            return _act(config, sources, exp_dir, console)
    return _act(config, sources, exp_dir, console)


# Actions that change what runs from an exp_dir hold its lock (flagscale/cluster/lock.py) for their whole life;
# the others only read the state file and never wait for one.
LOCKED_ACTIONS = ("run", "test", "stop")


def _act(config, sources, exp_dir: str, console: Console) -> int:
    action = config.action
    if action == "stop":
        from flagscale.actions.stop import stop

        return stop(exp_dir, console, config.experiment.runner.deploy.drain_timeout_s, config.experiment.env_for)
    if action == "status":
        from flagscale.actions.status import status

        try:  # engines require the key on /metrics too; without it status still reports, minus the engines' load
            api_key = config.experiment.runner.deploy.resolved_api_key()
        except ValueError:
            api_key = None
        return status(exp_dir, console, config.output, api_key)
    if action == "logs":
        from flagscale.actions.logs import logs

        return logs(exp_dir, console, config.serve_id, config.replica, config.follow, config.lines)
    if action == "bench":
        from flagscale.actions.bench import bench

        api_key = plan_key(config, sources)
        if api_key:  # vLLM's benchmark sends OPENAI_API_KEY as the bearer token
            os.environ["OPENAI_API_KEY"] = api_key
        return bench(config, exp_dir, console)

    if action == "auto_tune":
        from flagscale.actions.auto_tune import auto_tune

        api_key = plan_key(config, sources)
        if api_key:  # vLLM's benchmark sends OPENAI_API_KEY as the bearer token
            os.environ["OPENAI_API_KEY"] = api_key
        return auto_tune(config, sources, exp_dir, console)

    from flagscale.plan import build_plan

    for notice in config.notices:
        console.print(f"[yellow]notice:[/] {notice}", soft_wrap=True)
    from flagscale.update import snapshot

    api_key = plan_key(config, sources)
    running = running_state(exp_dir)
    if action == "dryrun":
        from flagscale.actions.dryrun import dryrun

        plan = build_plan(config, sources, check_port=False)
        running_config = running.extra.get("config") if running is not None else None
        code = dryrun(config, plan, console, running_config, snapshot(config, api_key, plan.graph))
        if config.experiment.auto_tuner is not None:  # what action=auto_tune would run and skip
            from flagscale.actions.auto_tune import auto_tune_dryrun

            code = auto_tune_dryrun(config, sources, exp_dir, console) or code
        return code
    from flagscale.actions.run import refuse_if_running, run

    if action == "test":
        from flagscale.actions.smoke import smoke_test
        from flagscale.cluster.state import RunState

        if running is None:
            refuse_if_running(exp_dir, console, config.experiment.env_for)
            with console.status("validating the config ..."):
                plan = build_plan(config, sources)
            code = run(plan, console, snapshot=snapshot(config, api_key, plan.graph))
            if code != 0:
                return code
        state = RunState.load(exp_dir)
        assert state is not None
        return smoke_test(state, console, api_key)

    if running is not None:
        from flagscale.actions.run import update

        with console.status("validating the config ..."):
            plan = build_plan(config, sources, check_port=False)  # the port is the running router's
        return update(running, plan, snapshot(config, api_key, plan.graph), console, sources.main)
    refuse_if_running(exp_dir, console, config.experiment.env_for)
    with console.status("validating the config ..."):
        plan = build_plan(config, sources)
    return run(plan, console, foreground=config.foreground, snapshot=snapshot(config, api_key, plan.graph))


def running_state(exp_dir: str):
    """The state of a deployment that is up and serving from this exp_dir, else None."""
    from flagscale.cluster.ray_node import cluster_alive
    from flagscale.cluster.state import RunState

    state = RunState.load(exp_dir)
    return state if state is not None and state.phase == "running" and cluster_alive(state) else None


def main_exit(code: int) -> None:
    sys.stdout.flush()
    sys.exit(code)
