"""Checks of engine args that engines serving Hugging Face models share (vLLM, SGLang)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from flagscale.adaptors import huggingface_hub
from flagscale.errors import ConfigError


def check_hf_model(model: Any, where: str) -> str:
    """A local Hugging Face model directory (resolved), or a hub id (in the offline cache when HF_HUB_OFFLINE=1)."""
    if not isinstance(model, str) or not model:
        raise ConfigError("engine_args.model is required (a local model directory or a Hugging Face id)", where)
    path = Path(os.path.expanduser(model))
    looks_like_path = model.startswith(("/", ".", "~")) or path.exists()
    if looks_like_path:
        if not path.is_dir():
            raise ConfigError(f"model path {model!r} does not exist or is not a directory", where)
        if not (path / "config.json").exists():
            raise ConfigError(f"model path {model!r} has no config.json (not a Hugging Face model dir)", where)
        return str(path.resolve())
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        if not isinstance(huggingface_hub.try_to_load_from_cache(model, "config.json"), str):
            raise ConfigError(f"model {model!r} is not a local directory and not in the offline HF cache", where)
    return model


def positive_int(args: dict[str, Any], key: str, where: str) -> int:
    value = args.get(key, 1)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{key} must be a positive integer, got {value!r}", where)
    return value


# config.json keys that count a mixture-of-experts model's routed experts, as vLLM reads them
# (vllm/transformers_utils/model_arch_config_convertor.py: get_num_experts): Jamba/Qwen-MoE, DBRX, DeepSeek, Mixtral
EXPERT_COUNT_KEYS = ("num_experts", "moe_num_experts", "n_routed_experts", "num_local_experts")


def model_experts(model: str) -> int | None:
    """The routed experts of a Hugging Face model (a local directory, or a hub id in this machine's cache): the
    first of EXPERT_COUNT_KEYS its config.json sets, at the top or in its text_config / ffn_config; 0 for a dense
    model; None when its config.json cannot be read here."""
    path = Path(model) / "config.json"
    if not path.is_file():
        if model.startswith(("/", ".", "~")) or Path(model).exists() or model.count("/") != 1:
            return None  # a local path without config.json (a GGUF file), or no hub id
        try:
            cached = huggingface_hub.try_to_load_from_cache(model, "config.json")
        except ValueError:  # not a valid hub id after all
            return None
        if not isinstance(cached, str):
            return None
        path = Path(cached)
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    for section in (config, config.get("text_config"), config.get("ffn_config")):
        if not isinstance(section, dict):
            continue
        for key in EXPERT_COUNT_KEYS:
            value = section.get(key)
            if isinstance(value, list):  # some remote-code configs list one count per layer
                value = max(value, default=0)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return 0
