"""The engine kinds, one module each, behind one interface (flagscale/engines/base.py: EngineKind).

A new engine is a module here that defines `KIND = <its EngineKind>` and a line in ENGINES; nothing else in the
project names an engine. A kind states its tables (common_args, ignored_args, ...); the loops over them
(map_common_args, load, secret_env) are written once in base.py. docs/engines.md says what each supports. Beside
the kinds: metrics.py (an engine server's /metrics, histogram buckets included), vllm_args.py / vllm_auth.py /
vllm_headless.py / vllm_ranks.py / vllm_kv_events.py (vLLM's argv, key middleware, headless ranks, each rank's env
and argv, KV-event publishing), llama_cpp_build.py (llama-server built here).

It may import only the basics (errors, net, devices, paths): every floor above imports it.
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

__all__ = [
    "Capabilities",
    "DEFAULT_ENGINE",
    "ENGINES",
    "EngineKind",
    "ServerLaunch",
    "checked_env",
    "dropped_request_headers",
    "get",
]


def get(name: str | None) -> EngineKind:
    """The engine kind `name` (None: the default). Unknown names are refused by the schema before this."""
    module = ENGINES[name or DEFAULT_ENGINE]
    return importlib.import_module(module).KIND


def dropped_request_headers() -> frozenset[str]:
    """Request headers (lower case) the router drops before passing a request to any engine: the union over the
    kinds (one router serves models of several kinds)."""
    return frozenset(header for name in ENGINES for header in get(name).dropped_request_headers)


def checked_env(name: str, value: str) -> None:
    """Checks an experiment.envs variable that an engine kind reads (ValueError naming it); others pass."""
    for kind in ENGINES:
        check = get(kind).env_checks.get(name)
        if check is not None:
            check(value)
