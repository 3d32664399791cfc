"""What one engine node hands its engine: runner.cli_args, then its engine_args, then engine_args_specific.<engine>;
refused where it turns on an engine arg the node has not opted into; and the model names clients use for it."""

from __future__ import annotations

from typing import Any

from flagscale import engines
from flagscale.config.schema import NodeConfig, ServeConfig


def engine_args_of(node: NodeConfig, config: ServeConfig) -> dict[str, Any]:
    """What one engine node hands to vLLM: runner.cli_args, then engine_args, then engine_args_specific.<engine>."""
    return {**config.experiment.runner.cli_args, **node.merged_engine_args()}


def checked_engine_args(node: NodeConfig, config: ServeConfig, where: str) -> dict[str, Any]:
    """engine_args_of, refused (naming the key) where it turns on an engine arg the node has not opted into
    (EngineKind.unsafe_args, allow_engine_args)."""
    args = engine_args_of(node, config)
    engines.get(node.engine).check_unsafe_args(args, node.allow_engine_args, where)
    return args


def served_names(node: NodeConfig, engine_args: dict[str, Any]) -> list[str]:
    """The `model` names clients use for this node: served_model_name, else its serve_id."""
    return engines.get(node.engine).served_names(engine_args, node.serve_id)
