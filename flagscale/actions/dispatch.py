"""From Hydra's config to one action: load and validate the config, take the exp_dir's lock where the action's spec
asks for it (flagscale/actions/__init__.py: ACTIONS), run it; a FlagScaleError becomes one line and its exit code."""

from __future__ import annotations

import importlib
import os
import sys

from omegaconf import DictConfig
from rich.console import Console
from rich.markup import escape

from flagscale.actions import ACTIONS
from flagscale.actions.context import ActionContext
from flagscale.actions.invocation import RUN_PY, Invocation
from flagscale.actions.runner_log import keep_library_lines_off_the_console
from flagscale.cluster import bounded
from flagscale.cluster.lock import ExpDirLock
from flagscale.cluster.state import resolve_exp_dir
from flagscale.config.load import hydra_sources, load_config
from flagscale.errors import FlagScaleError


def dispatch(cfg: DictConfig, invocation: Invocation = RUN_PY) -> int:
    keep_library_lines_off_the_console()
    console = Console(highlight=False)
    try:
        sources = hydra_sources()
        config = load_config(cfg, sources)
        bounded.check_env_bounds()
        exp_dir = resolve_exp_dir(config.experiment.exp_dir)
        return act(ActionContext(config, sources, exp_dir, console, invocation))
    except FlagScaleError as exc:
        return report_error(exc)


def act(ctx: ActionContext) -> int:
    spec = ACTIONS[ctx.action]
    module = importlib.import_module(spec.module)
    if not spec.locks_exp_dir or (spec.needs_exp_dir and not os.path.isdir(ctx.exp_dir)):
        return module.act(ctx)
    with ExpDirLock(ctx.exp_dir, ctx.action) as lock:
        if spec.attaches and ctx.config.foreground:
            lock.describe(foreground=True)
        return module.act(ctx)


def report_error(exc: FlagScaleError) -> int:
    Console(stderr=True, highlight=False, soft_wrap=True).print(f"[red]error:[/] {escape(str(exc))}")
    return exc.exit_code


def main_exit(code: int) -> None:
    if bounded.left_behind():  # a Ray call that never answered: no exit handler may wait for it
        bounded.exit_now(code)
    sys.stdout.flush()
    sys.exit(code)
