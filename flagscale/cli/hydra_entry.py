"""The one Hydra entry: `python run.py ...` and `flagscale ...` both end here with a Hydra command line.

Before Hydra sees it, the command line goes through flagscale.config.cli (malformed YAML named by file and line,
`++` for plain overrides, no `.hydra/` copy of the config)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from flagscale.actions.dispatch import dispatch, main_exit, report_error
from flagscale.actions.invocation import RUN_PY, Invocation
from flagscale.cli.resources import conf_dir
from flagscale.config.cli import (
    check_yaml_files,
    config_dir_of,
    ids_as_text,
    upsert_overrides,
    without_hydra_config_copy,
)
from flagscale.config.resolvers import register_resolvers
from flagscale.errors import FlagScaleError

CONFIG_DIR = conf_dir()
PRIVATE_UMASK = 0o077
register_resolvers()
# How the user called us (main's argument): Hydra's entry takes the config only.
_invocation = RUN_PY


# Hydra names the job after the file that declares the entry; `run` keeps the name run.py always gave it.
@hydra.main(config_path=str(CONFIG_DIR), config_name="serve", version_base=None)
def _hydra_main(cfg: DictConfig) -> None:
    main_exit(dispatch(cfg, _invocation))


def absolute_config_path(argv: list[str], base_dir: Path) -> list[str]:
    """`--config-path`/`-cp` made absolute against `base_dir`: Hydra reads a relative one against the file that
    declares the entry, which is this module now and was run.py's directory before."""
    out = list(argv)
    for i, arg in enumerate(out):
        if arg in ("--config-path", "-cp") and i + 1 < len(out):
            out[i + 1] = str((base_dir / out[i + 1]).resolve())
        elif arg.startswith(("--config-path=", "-cp=")):
            flag, value = arg.split("=", 1)
            out[i] = f"{flag}={(base_dir / value).resolve()}"
    return out


def main(argv: list[str] | None = None, base_dir: Path | None = None, invocation: Invocation = RUN_PY) -> None:
    """Run Hydra on `argv` (default: sys.argv[1:]); exits with the action's code. A relative --config-path is read
    against `base_dir` (default: the working directory). `invocation`: how the user called us (`python run.py`
    unless said), for the lines that say what to type next."""
    global _invocation
    _invocation = invocation
    # What any action writes (the exp_dir, its logs, Ray's logs and the engines', inherited by every process it
    # starts) is the user's alone; Ray's own directories, which it opens to all, sit inside the private exp_dir.
    os.umask(PRIVATE_UMASK)
    argv = absolute_config_path(list(sys.argv[1:] if argv is None else argv), base_dir or Path.cwd())
    try:
        check_yaml_files(argv, CONFIG_DIR, "serve")
    except FlagScaleError as exc:
        main_exit(report_error(exc))
    argv = without_hydra_config_copy(ids_as_text(upsert_overrides(argv, config_dir_of(argv, CONFIG_DIR))))
    if not any(arg.lstrip("+").startswith("hydra.job.name=") for arg in argv):
        argv.append("hydra.job.name=run")
    sys.argv[1:] = argv
    _hydra_main()
