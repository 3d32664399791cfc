"""`action=auto_tune`: search the config's auto_tuner space on the real target (flagscale/tune/, docs/auto-tune.md).

It holds the exp_dir's lock for its whole life, as `run` does: each trial starts, updates or stops what runs there.
"""

from __future__ import annotations

from rich.console import Console

from flagscale.actions.context import ActionContext
from flagscale.cluster.lock import ExpDirLock
from flagscale.config.load import ConfigSources
from flagscale.config.schema import ServeConfig
from flagscale.tune.search import dryrun, prepare, run_search


def auto_tune(config: ServeConfig, sources: ConfigSources, exp_dir: str, console: Console) -> int:
    for notice in config.notices:
        console.print(f"[yellow]notice:[/] {notice}", soft_wrap=True)
    with console.status("checking the space and pruning ..."):
        search = prepare(config, sources, exp_dir)
    with ExpDirLock(exp_dir, "auto_tune"):
        return run_search(search, console)


def auto_tune_dryrun(config: ServeConfig, sources: ConfigSources, exp_dir: str, console: Console) -> int:
    """dryrun of a config with an auto_tuner block: the candidates and what pruning skips; nothing starts."""

    return dryrun(prepare(config, sources, exp_dir), console)


def act(ctx: ActionContext) -> int:
    return auto_tune(ctx.config, ctx.sources, ctx.exp_dir, ctx.console)
