"""CLI actions. Each is thin: it reads the plan or the state file and calls the layers below."""

from __future__ import annotations

import logging
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


def _dispatch(cfg: DictConfig, console: Console) -> int:
    from pathlib import Path

    sources = hydra_sources()
    config = load_config(cfg, sources)
    exp_dir = str(Path(config.experiment.exp_dir).expanduser().resolve())
    action = config.action
    if action == "stop":
        from flagscale.actions.stop import stop

        return stop(exp_dir, console, config.experiment.runner.deploy.drain_timeout_s)
    if action == "status":
        from flagscale.actions.status import status

        return status(exp_dir, console, config.output)
    if action == "bench":
        from flagscale.actions.bench import bench

        return bench(config, exp_dir, console)

    from flagscale.plan import build_plan

    if action == "dryrun":
        from flagscale.actions.dryrun import dryrun

        return dryrun(config, build_plan(config, sources, check_port=False), console)
    from flagscale.actions.run import refuse_if_running, run

    refuse_if_running(exp_dir, console)
    with console.status("validating the config ..."):
        plan = build_plan(config, sources)
    return run(plan, console, foreground=config.foreground)


def main_exit(code: int) -> None:
    sys.stdout.flush()
    sys.exit(code)
