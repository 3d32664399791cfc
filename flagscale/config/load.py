"""From a resolved OmegaConf config to the typed schema, with FlagScale's old spellings and readable errors."""

from __future__ import annotations

import difflib
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from pydantic import BaseModel, ValidationError

from flagscale.adaptors import hydra_config
from flagscale.config import compat
from flagscale.config.schema import ServeConfig
from flagscale.errors import ConfigError


@dataclass(frozen=True)
class ConfigSources:
    """Which files the config came from, so errors can name the one at fault."""

    main: str = "<config>"
    serve: str | None = None

    def file_for(self, loc: tuple[Any, ...]) -> str:
        if loc and loc[0] == "serve" and self.serve:
            return self.serve
        return self.main


def hydra_sources() -> ConfigSources:
    """Name the config files of the running Hydra job (main config and the chosen `serve` module)."""
    try:
        hc = hydra_config.HydraConfig.get()
    except Exception:
        return ConfigSources()
    config_dir = next((s.path for s in hc.runtime.config_sources if s.provider == "main" and s.schema == "file"), None)
    name = hc.job.config_name or "config"
    main = str(Path(config_dir) / f"{name}.yaml") if config_dir else f"{name}.yaml"
    choice = hc.runtime.choices.get("serve")
    serve = str(Path(config_dir) / "serve" / f"{choice}.yaml") if config_dir and choice else None
    return ConfigSources(main=_relative(main), serve=_relative(serve) if serve else None)


def _relative(path: str) -> str:
    try:
        return str(Path(path).resolve().relative_to(Path.cwd()))
    except ValueError:
        return path


def to_container(cfg: DictConfig | dict, sources: ConfigSources = ConfigSources()) -> dict[str, Any]:
    if isinstance(cfg, dict):
        return cfg
    try:
        data = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or "?"
        raise ConfigError(f"cannot resolve {key}: {exc.msg if hasattr(exc, 'msg') else exc}", sources.main) from None
    data.pop("hydra", None)
    return data


def load_config(cfg: DictConfig | dict, sources: ConfigSources = ConfigSources()) -> ServeConfig:
    """Build and validate the typed config. Raises ConfigError naming file and key."""
    data = to_container(cfg, sources)
    if not isinstance(data, dict):
        raise ConfigError("the config must be a mapping", sources.main)
    if isinstance(data.get("serve"), dict):
        raise ConfigError(
            "`serve` must be a list of nodes (- serve_id: ...); got a mapping", sources.serve or sources.main
        )
    notices = compat.normalize(data, sources.main, sources.serve or sources.main)
    try:
        config = ServeConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(*_describe(exc.errors()[0], data, sources)) from None
    config.notices.extend(notices + compat.ignored(config))
    return config


def resolve_api_key(config: ServeConfig, sources: ConfigSources = ConfigSources()) -> str | None:
    """The key clients must send (deploy.api_key, or the variable api_key_env names), or None: the one place it is
    read. An api_key_env naming an unset variable is one clear error that names the key."""
    try:
        return config.experiment.runner.deploy.resolved_api_key()
    except ValueError as exc:
        raise ConfigError(str(exc), f"{sources.main}: experiment.runner.deploy.api_key_env") from None


def _describe(error: dict[str, Any], data: dict[str, Any], sources: ConfigSources) -> tuple[str, str]:
    loc = tuple(error["loc"])
    where = f"{sources.file_for(loc)}: {_key(loc, data)}"
    if error["type"] == "extra_forbidden":
        parent, unknown = loc[:-1], str(loc[-1])
        known = _field_names(ServeConfig, parent)
        close = difflib.get_close_matches(unknown, known, n=1, cutoff=0.6)
        hint = f" (did you mean '{close[0]}'?)" if close else f" (known keys: {', '.join(sorted(known))})"
        return f"unknown key '{unknown}'{hint}", f"{sources.file_for(loc)}: {_key(parent, data) or '<top>'}"
    if error["type"] == "missing":
        return f"required key '{loc[-1]}' is missing", f"{sources.file_for(loc)}: {_key(loc[:-1], data) or '<top>'}"
    message = error["msg"].removeprefix("Value error, ")
    if error["type"] not in ("value_error", "assertion_error") and "input" in error:
        message += f" (got {error['input']!r})"
    return message, where


def _key(loc: tuple[Any, ...], data: dict[str, Any]) -> str:
    """Dotted key path; list items of `serve` are named by their serve_id when they have one."""
    parts: list[str] = []
    node: Any = data
    for item in loc:
        if isinstance(item, int):
            serve_id = node[item].get("serve_id") if isinstance(node, list) and isinstance(node[item], dict) else None
            parts[-1] += f"[{item}]" + (f"({serve_id})" if serve_id else "")
            node = node[item] if isinstance(node, list) and item < len(node) else None
        else:
            parts.append(str(item))
            node = node.get(item) if isinstance(node, dict) else None
    return ".".join(parts)


def _field_names(model: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    current: Any = model
    for item in loc:
        current = _unwrap(current)
        if isinstance(item, int):
            continue
        if isinstance(current, type) and issubclass(current, BaseModel) and item in current.model_fields:
            current = current.model_fields[item].annotation
        else:
            return []
    current = _unwrap(current)
    if isinstance(current, type) and issubclass(current, BaseModel):
        return list(current.model_fields)
    return []


def _unwrap(annotation: Any) -> Any:
    """Optional[X] -> X, list[X] -> X."""
    while True:
        origin = typing.get_origin(annotation)
        if origin in (typing.Union, types.UnionType):
            args = [a for a in typing.get_args(annotation) if a is not type(None)]
            annotation = args[0] if len(args) == 1 else annotation
            if len(args) != 1:
                return annotation
        elif origin is list:
            annotation = typing.get_args(annotation)[0]
        else:
            return annotation
