"""Checks of engine args that engines serving Hugging Face models share (vLLM, SGLang)."""

from __future__ import annotations

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
