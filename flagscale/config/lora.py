"""A node's LoRA adapters (docs/config.md, docs/routing.md): `lora:` beside its engine args, and vLLM's own spellings
in engine_args (enable_lora, lora_modules, max_loras, max_lora_rank, max_cpu_loras) taken as the same settings;
what an adapter's directory says of itself (adapter_config.json), read once before planning (flagscale/facts.py);
and whether its base is the node's model."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError, model_validator

from flagscale.config.fields import SAFE_ID, Strict
from flagscale.errors import ConfigError

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
# vLLM's engine args that say the same as `lora:` (its `--enable-lora`, `--lora-modules name=path ...`, ...)
ENGINE_LORA_ARGS = ("enable_lora", "lora_modules", "max_loras", "max_lora_rank", "max_cpu_loras")


class LoraConfig(Strict):
    """LoRA adapters of one base model, each served as a model clients name in `model` (its `parent`: the node's
    model), on every replica of the node."""

    adapters: dict[str, str] = Field(
        default_factory=dict,
        description="Adapter name (the `model` clients ask for) -> its directory (PEFT's adapter_config.json + "
        "adapter_model.safetensors), checked before start: its base must be the node's model, its rank at most "
        "max_lora_rank. The engine arg `lora_modules` (name=path, ...) says the same.",
    )
    max_loras: int | None = Field(
        None,
        ge=1,
        description="Adapters one replica runs in a batch at once (the engine's default: 1); the router keeps "
        "each adapter on few replicas, at most this many per replica (docs/routing.md).",
    )
    max_lora_rank: int | None = Field(
        None,
        ge=1,
        description="The largest adapter rank a replica takes (the engine's default: 16; one of 1, 8, 16, 32, "
        "64, 128, 256, 320, 512).",
    )
    max_cpu_loras: int | None = Field(
        None, ge=1, description="Adapters a replica keeps loaded in host memory (the engine's default: max_loras)."
    )

    @model_validator(mode="after")
    def _names(self) -> LoraConfig:
        for name, path in self.adapters.items():
            if not SAFE_ID.fullmatch(name):
                raise ValueError(
                    f"adapter name {name!r} is not a safe name: use letters, digits, '.', '_' and '-', starting "
                    "with a letter or digit (clients name it in `model`, and it labels metrics)"
                )
            if not isinstance(path, str) or not path:
                raise ValueError(f"adapters.{name}: give the adapter's directory")
        if self.max_cpu_loras is not None and self.max_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras})")
        return self


def lora_modules(value: Any, where: str) -> dict[str, str]:
    """vLLM's `lora_modules` (a list of `name=path`, of {"name", "path"} objects or their JSON) -> name -> path."""
    items = [value] if isinstance(value, (str, dict)) else value
    if not isinstance(items, list):
        raise ConfigError("lora_modules: give a list of name=path (or {name: ..., path: ...})", where)
    modules = {}
    for item in items:
        if isinstance(item, str) and item.lstrip().startswith("{"):
            try:
                item = json.loads(item)
            except ValueError as exc:
                raise ConfigError(f"lora_modules entry {item!r} is not JSON: {exc}", where) from None
        if isinstance(item, dict) and isinstance(item.get("name"), str) and isinstance(item.get("path"), str):
            name, path = item["name"], item["path"]
        elif isinstance(item, str) and "=" in item:
            name, _, path = item.partition("=")
        else:
            raise ConfigError(f"lora_modules entry {item!r}: give name=path (or {{name: ..., path: ...}})", where)
        if name in modules:
            raise ConfigError(f"lora_modules names adapter {name!r} twice", where)
        modules[name] = path
    return modules


def node_lora(lora: LoraConfig | None, args: dict[str, Any], where: str) -> tuple[LoraConfig | None, dict[str, Any]]:
    """The node's LoRA settings from `lora:` and vLLM's spellings in its engine args (`where`: the engine_args' key;
    one setting given both ways must agree), and the engine args without those spellings."""
    spelled = {key: args[key] for key in ENGINE_LORA_ARGS if key in args}
    rest = {key: value for key, value in args.items() if key not in ENGINE_LORA_ARGS}
    if not spelled:
        return lora, rest
    if spelled.get("enable_lora") is False:
        if lora is not None or len(spelled) > 1:
            raise ConfigError(
                "enable_lora is false, but the node sets LoRA adapters or settings", f"{where}.enable_lora"
            )
        return None, rest
    settings: dict[str, Any] = {
        key: spelled[key] for key in ("max_loras", "max_lora_rank", "max_cpu_loras") if key in spelled
    }
    if "lora_modules" in spelled:
        settings["adapters"] = lora_modules(spelled["lora_modules"], f"{where}.lora_modules")
    if lora is not None:
        for key, value in settings.items():
            own = getattr(lora, key)
            if key == "adapters":
                clash = sorted(name for name in value if name in own and own[name] != value[name])
                if clash:
                    raise ConfigError(
                        f"adapter {clash[0]!r} has another path in lora.adapters", f"{where}.lora_modules"
                    )
                settings[key] = {**own, **value}
            elif own is not None and own != value:
                raise ConfigError(f"{key} is {value} here and {own} in the node's lora", f"{where}.{key}")
        settings = {**lora.model_dump(exclude_unset=True), **settings}
    try:
        return LoraConfig(**settings), rest
    except ValidationError as exc:
        error = exc.errors()[0]
        key = ".".join(str(part) for part in error["loc"])
        raise ConfigError(error["msg"].removeprefix("Value error, "), f"{where}.{key}" if key else where) from None


@dataclass(frozen=True)
class AdapterFiles:
    """What an adapter's directory holds, read once before planning: its config, or what is wrong with it (`problem`,
    naming the file and key)."""

    path: str  # `~` expanded
    config: dict[str, Any] | None = None
    problem: str | None = None


def read_adapter(path: str) -> AdapterFiles:
    full = os.path.expanduser(path)
    directory = Path(full)
    if not directory.is_dir():
        return AdapterFiles(full, problem=f"{full} is no directory")
    config_file = directory / ADAPTER_CONFIG
    try:
        config = json.loads(config_file.read_text())
    except FileNotFoundError:
        return AdapterFiles(full, problem=f"{config_file} is missing (a PEFT LoRA adapter has one)")
    except (OSError, ValueError) as exc:
        return AdapterFiles(full, problem=f"{config_file} cannot be read as JSON: {exc}")
    if not isinstance(config, dict):
        return AdapterFiles(full, problem=f"{config_file} is not a JSON object")
    if not any((directory / name).is_file() for name in ADAPTER_WEIGHTS):
        return AdapterFiles(full, config, f"{directory} has no weights ({' or '.join(ADAPTER_WEIGHTS)})")
    return AdapterFiles(full, config)


def adapter_paths(nodes: list[Any], cli_args: dict[str, Any]) -> set[str]:
    """Every adapter directory the engine nodes name, in `lora:` or in the engine arg lora_modules (their own, or
    runner.cli_args'), as written."""
    paths: set[str] = set()
    for node in nodes:
        if node.lora is not None:
            paths.update(node.lora.adapters.values())
        for args in (cli_args, node.engine_args, *node.engine_args_specific.values()):
            if "lora_modules" in args:
                try:
                    paths.update(lora_modules(args["lora_modules"], "").values())
                except ConfigError:
                    pass  # planning says what is wrong with it, where
    return paths


_HUB_CACHE_DIR = re.compile(r"models--([^/]+)--([^/]+)/snapshots/[^/]+/?$")
_HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")


def model_ids(model: str) -> tuple[set[str], str]:
    """The full names one model goes by, lower-cased (a local directory's resolved path; a hub id `org/name`, also
    read back from the hub cache's `models--org--name/snapshots/x`), and its short name (the last part)."""
    expanded = os.path.expanduser(model.rstrip("/"))
    local = os.path.isdir(expanded)
    full = {model.rstrip("/").lower()}
    if local:
        full.add(os.path.realpath(expanded).lower())
    cached = _HUB_CACHE_DIR.search(os.path.realpath(expanded) if local else model)
    if cached:
        full.add(f"{cached.group(1)}/{cached.group(2)}".lower())
    return full, (cached.group(2) if cached else expanded.rpartition("/")[2]).lower()


def _hub_id(name: str) -> bool:
    return bool(_HUB_ID.fullmatch(name.rstrip("/"))) and not os.path.isdir(os.path.expanduser(name))


def same_base(adapter_base: str, model: str) -> bool:
    """Is an adapter's base_model_name_or_path the node's model? The same path (resolved) or hub id; else, unless
    both are hub ids (which then differ), the same short name: `meta-llama/Llama-3.1-8B` is `/models/Llama-3.1-8B`,
    a local copy of it."""
    (base_full, base_short), (model_full, model_short) = model_ids(adapter_base), model_ids(model)
    if base_full & model_full:
        return True
    return not (_hub_id(adapter_base) and _hub_id(model)) and base_short == model_short


def check_adapter(name: str, files: AdapterFiles, model: str, rank_limit: int, default_limit: bool, key: str) -> None:
    """One adapter against its directory's files, the node's model and the rank bound: a ConfigError naming the
    adapter, the file and the key that is wrong."""
    if files.problem:
        raise ConfigError(f"LoRA adapter {name!r}: {files.problem}", key)
    config = files.config or {}
    config_file = Path(files.path) / ADAPTER_CONFIG
    peft_type = config.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise ConfigError(f"LoRA adapter {name!r}: {config_file}: peft_type is {peft_type!r}, not LORA", key)
    base = config.get("base_model_name_or_path")
    if isinstance(base, str) and base and not same_base(base, model):
        raise ConfigError(
            f"LoRA adapter {name!r}: {config_file}: base_model_name_or_path is {base!r}, not this node's model "
            f"{model!r}",
            key,
        )
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ConfigError(f"LoRA adapter {name!r}: {config_file}: r is {rank!r}, not a positive rank", key)
    if rank > rank_limit:
        bound = f"the engine's default max_lora_rank {rank_limit}" if default_limit else f"max_lora_rank {rank_limit}"
        raise ConfigError(
            f"LoRA adapter {name!r}: {config_file}: r is {rank}, above {bound}; set lora.max_lora_rank to at "
            f"least {rank}",
            key,
        )
