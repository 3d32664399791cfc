"""A node's LoRA adapters, planned: `lora:` and vLLM's spellings in engine_args as one setting
(config/lora.py's node_lora), every adapter checked against what its directory holds (read before planning:
Facts.adapters) and against the node's model and rank bound, and the engine's flags for them (EngineKind.lora_args).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flagscale.config.lora import ADAPTER_CONFIG, AdapterFiles, LoraConfig, node_lora, same_base
from flagscale.config.schema import NodeConfig
from flagscale.engines.base import EngineKind
from flagscale.errors import ConfigError


@dataclass(frozen=True)
class LoraPlan:
    """The adapters every replica of a node loads (name -> directory) and the engine's flags that allow them."""

    adapters: dict[str, str] = field(default_factory=dict)
    max_loras: int = 1  # adapters one replica runs in a batch at once
    engine_args: dict[str, Any] = field(default_factory=dict)


def plan_lora(
    node: NodeConfig, args: dict[str, Any], kind: EngineKind, adapters: dict[str, AdapterFiles], where: str
) -> tuple[dict[str, Any], LoraPlan | None]:
    """The engine args without vLLM's LoRA spellings, and the node's LoraPlan (None: no LoRA). `args["model"]`: the
    model as checked (EngineKind.check_model); `adapters`: Facts.adapters; `where`: the node's place in the config."""
    lora, args = node_lora(node.lora, args, f"{where}.engine_args")
    if lora is None:
        return args, None
    engine_args = kind.lora_args(lora, f"{where}.lora")
    rank_limit = lora.max_lora_rank or kind.lora_defaults["max_lora_rank"]
    served = set(kind.served_names(args, node.serve_id))
    planned = {}
    for name, path in lora.adapters.items():
        key = _key(node, lora, name, where)
        if name in served:
            raise ConfigError(f"adapter {name!r} has the name the node's base model is served by", key)
        files = adapters.get(path)
        if files is None:
            raise ConfigError(f"adapter {name!r}: {path} was not read before planning (Facts.adapters)", key)
        check_adapter(name, files, args["model"], rank_limit, lora.max_lora_rank is None, key)
        planned[name] = files.path
    max_loras = lora.max_loras or kind.lora_defaults["max_loras"]
    return args, LoraPlan(planned, max_loras, engine_args)


def _key(node: NodeConfig, lora: LoraConfig, name: str, where: str) -> str:
    if node.lora is not None and name in node.lora.adapters:
        return f"{where}.lora.adapters.{name}"
    return f"{where}.engine_args.lora_modules"


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
