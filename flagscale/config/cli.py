"""What happens to the command line before Hydra sees it.

- Malformed YAML is caught first, so the user gets one line naming file, line and column instead of
  Hydra's traceback (the main config and the group files its defaults select).
- Hydra does not write its `.hydra/` copy of the config and overrides under the exp_dir: an override such as
  `experiment.runner.deploy.api_key=...` would land there in clear (`hydra.output_subdir=null`).
- Plain `key=value` overrides become `++key=value` (set or add): a FlagScale config that lacks a key
  such as `output` or `experiment.bench` still accepts it. Typos are not lost: the typed schema
  rejects unknown keys with a did-you-mean. Config-group choices (`serve=7b`) stay as they are.
- Ids typed after `serve_id=` and `replica=` stay text: Hydra would read a replica id's prefix such as `1e523`
  as a number (here infinity), so an unquoted one is quoted for it.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from flagscale.errors import ConfigError


def _option(argv: list[str], long: str, short: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg in (long, short) and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(long + "="):
            return arg.split("=", 1)[1]
    return None


def _load(path: Path):
    try:
        return yaml.safe_load(path.read_text())
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        raise ConfigError(f"malformed YAML: {exc.problem or exc}", where) from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"malformed YAML: {exc}", str(path)) from None


def config_dir_of(argv: list[str], default_dir: Path) -> Path:
    return Path(_option(argv, "--config-path", "-cp") or default_dir)


def upsert_overrides(argv: list[str], config_dir: Path) -> list[str]:
    out = []
    for arg in argv:
        key = arg.split("=", 1)[0]
        is_plain_override = "=" in arg and not arg.startswith(("-", "+", "~")) and not key.startswith("hydra.")
        if is_plain_override and not (config_dir / key).is_dir():
            arg = "++" + arg
        out.append(arg)
    return out


ID_KEYS = ("serve_id", "replica")


def ids_as_text(argv: list[str]) -> list[str]:
    """`replica=1e523` as `replica='1e523'`: an id is never a number, whatever Hydra's grammar would make of it."""
    out = []
    for arg in argv:
        key, _, value = arg.partition("=")
        quoted = value[:1] in ("'", '"') or "'" in value
        if key.lstrip("+") in ID_KEYS and value and not quoted:
            arg = f"{key}='{value}'"
        out.append(arg)
    return out


def without_hydra_config_copy(argv: list[str]) -> list[str]:
    """argv plus `hydra.output_subdir=null`, unless the command line sets it itself."""
    if any(arg.lstrip("+").startswith("hydra.output_subdir=") for arg in argv):
        return argv
    return [*argv, "hydra.output_subdir=null"]


def check_yaml_files(argv: list[str], default_dir: Path, default_name: str) -> None:
    config_dir = config_dir_of(argv, default_dir)
    name = _option(argv, "--config-name", "-cn") or default_name
    main = config_dir / (name if name.endswith(".yaml") else f"{name}.yaml")
    if not main.exists():
        return  # Hydra reports a missing config itself, with the search path
    data = _load(main)
    overrides = dict(a.split("=", 1) for a in argv if "=" in a and not a.startswith("-"))
    defaults = data.get("defaults", []) if isinstance(data, dict) else []
    for entry in defaults:
        if isinstance(entry, dict):
            for group, choice in entry.items():
                choice = overrides.get(group, choice)
                group_file = config_dir / str(group) / f"{choice}.yaml"
                if isinstance(choice, str) and group_file.exists():
                    _load(group_file)
