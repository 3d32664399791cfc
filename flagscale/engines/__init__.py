"""The engine kinds, one module each, behind one interface (flagscale/engines/base.py: EngineKind).

A new engine is a module here that defines `KIND = <its EngineKind>` and a line in ENGINES; nothing else in the
project names an engine. docs/engines.md says what each supports.
"""

from __future__ import annotations

import importlib

from flagscale.engines.base import Capabilities, EngineKind, ServerLaunch

# config spelling -> the module that defines it (FlagScale's backends: vllm, sglang, llama_cpp)
ENGINES = {
    "vllm": "flagscale.engines.vllm",
    "llama_cpp": "flagscale.engines.llama_cpp",
    "sglang": "flagscale.engines.sglang",
}
DEFAULT_ENGINE = "vllm"

__all__ = ["Capabilities", "DEFAULT_ENGINE", "ENGINES", "EngineKind", "ServerLaunch", "get"]


def get(name: str | None) -> EngineKind:
    """The engine kind `name` (None: the default). Unknown names are refused by the schema before this."""
    module = ENGINES[name or DEFAULT_ENGINE]
    return importlib.import_module(module).KIND
