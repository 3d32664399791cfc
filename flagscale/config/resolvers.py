"""OmegaConf resolvers usable in configs: `${demo_model:}` is the path of the embedded demo model,
`${demo_model_gguf:}` the same model as one GGUF file (for engine: llama_cpp), `${demo_lora:NAME}` a rank-8 LoRA
adapter of the demo model named NAME (its weights seeded by the name)."""

from __future__ import annotations

from omegaconf import OmegaConf

from flagscale.demo_model import DEMO_SEED, ensure_demo_lora, ensure_demo_model, ensure_demo_model_gguf


def _seed(seed: int | None) -> int:
    return DEMO_SEED if seed is None else int(seed)


def _demo_model(seed: int | None = None) -> str:
    return str(ensure_demo_model(_seed(seed)))


def _demo_model_gguf(seed: int | None = None) -> str:
    return str(ensure_demo_model_gguf(_seed(seed)))


def _demo_lora(name: str) -> str:
    return str(ensure_demo_lora(str(name)))


def register_resolvers() -> None:
    resolvers = (("demo_model", _demo_model), ("demo_model_gguf", _demo_model_gguf), ("demo_lora", _demo_lora))
    for name, resolver in resolvers:
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, resolver)
