"""OmegaConf resolvers usable in configs: `${demo_model:}` is the path of the embedded demo model."""

from __future__ import annotations

from omegaconf import OmegaConf


def _demo_model(seed: int | None = None) -> str:
    from flagscale.demo_model import DEMO_SEED, ensure_demo_model

    return str(ensure_demo_model(DEMO_SEED if seed is None else int(seed)))


def register_resolvers() -> None:
    if not OmegaConf.has_resolver("demo_model"):
        OmegaConf.register_new_resolver("demo_model", _demo_model)
