"""A node's LoRA adapters, planned: `lora:` and vLLM's spellings in engine_args as one setting
(config/lora.py's node_lora), every adapter checked against what its directory holds (read before planning:
Facts.adapters) and against the node's model and rank bound, and the engine's flags for them (EngineKind.lora_args).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from flagscale.config.lora import AdapterFiles, LoraConfig, check_adapter, node_lora
from flagscale.config.schema import NodeConfig
from flagscale.engines.base import EngineKind
from flagscale.errors import ConfigError


@dataclass(frozen=True)
class LoraPlan:
    """The adapters every replica of a node loads (name -> directory) and the engine's flags that allow them."""

    adapters: dict[str, str] = field(default_factory=dict)
    max_loras: int = 1  # adapters one replica runs in a batch at once
    engine_args: dict[str, Any] = field(default_factory=dict)
    # what an adapter added at run time (the router's admin call) is checked against: the node's model as the
    # engine loads it, the rank bound, and whether that bound is the engine's default
    model: str = ""
    max_lora_rank: int = 0
    default_rank_limit: bool = True


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
    return args, LoraPlan(planned, max_loras, engine_args, args["model"], rank_limit, lora.max_lora_rank is None)


def _key(node: NodeConfig, lora: LoraConfig, name: str, where: str) -> str:
    if node.lora is not None and name in node.lora.adapters:
        return f"{where}.lora.adapters.{name}"
    return f"{where}.engine_args.lora_modules"
