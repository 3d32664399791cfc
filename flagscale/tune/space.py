"""The auto_tuner space -> candidates: which node is tuned, which dimensions, each candidate as a full config.

Both FlagScale shapes: the flat `space: {dim: [values]}` and the per-engine `space: {vllm: {dim: [values]}}` (with
`engines` naming the blocks to search). FlagScale's dimensions `tensor_model_parallel_size`,
`pipeline_model_parallel_size` and `instance` (replicas) map onto the node's engine args and resources; any other
dimension is a `vllm serve` argument, checked by vLLM's own parser before any trial.
"""

from __future__ import annotations

import difflib
import itertools
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from flagscale.config.schema import ENGINES, NodeConfig, ServeConfig
from flagscale.engines.vllm_args import MANAGED_ARGS, arg_table, to_argv
from flagscale.errors import ConfigError
from flagscale.plan import engine_args_of

INSTANCE = "instance"
# FlagScale's parallel dimensions -> vLLM's engine args.
PARALLEL_DIMS = {
    "tensor_model_parallel_size": "tensor_parallel_size",
    "pipeline_model_parallel_size": "pipeline_parallel_size",
}
FLAGSCALE_DIMS = (*PARALLEL_DIMS, INSTANCE)
# Engine args a candidate may not change: what the model is and how it is reached.
FIXED_ARGS = ("model", "served_model_name", "tokenizer", *MANAGED_ARGS)


@dataclass(frozen=True)
class Space:
    serve_id: str
    node_index: int
    dims: dict[str, list[Any]]  # space key as written -> values, in the config's order
    where: str  # "<file>: experiment.auto_tuner.space" (or space.<engine>)

    def candidates(self) -> list[dict[str, Any]]:
        """The grid, in the order the config lists dimensions and values (the last dimension varies fastest)."""
        keys = list(self.dims)
        return [dict(zip(keys, values, strict=True)) for values in itertools.product(*self.dims.values())]


def read_space(config: ServeConfig, main_file: str) -> Space:
    """The tuned node and its dimensions; one clear error naming the key for anything that cannot be searched."""
    tuner = config.experiment.auto_tuner
    where = f"{main_file}: experiment.auto_tuner"
    if tuner is None:
        raise ConfigError(
            "action=auto_tune needs an experiment.auto_tuner block with a space", f"{main_file}: experiment"
        )
    index, node = _tuned_node(config, tuner.serve_id, where)
    raw = tuner.space
    nested = [key for key, value in raw.items() if isinstance(value, dict)]
    if nested and len(nested) != len(raw):
        flat = sorted(set(raw) - set(nested))
        raise ConfigError(
            f"mixes the per-engine shape ({', '.join(nested)}: {{dim: [values]}}) with flat dimensions "
            f"({', '.join(flat)}); use one",
            f"{where}.space",
        )
    if nested:
        unknown = [key for key in nested if key not in (*ENGINES, "llama_cpp")]
        if unknown:
            close = difflib.get_close_matches(unknown[0], ENGINES, n=1, cutoff=0.6)
            hint = f" (did you mean '{close[0]}'?)" if close else f" (engines: {', '.join(ENGINES)})"
            raise ConfigError(f"unknown engine '{unknown[0]}'{hint}", f"{where}.space")
        engines = tuner.engines if tuner.engines is not None else nested
        for engine in engines:
            if engine not in raw:
                raise ConfigError(f"engines lists '{engine}', but space has no '{engine}' block", f"{where}.engines")
        if node.engine not in engines:
            raise ConfigError(
                f"node '{node.serve_id}' runs {node.engine}, but the space searches {', '.join(engines)}",
                f"{where}.engines" if tuner.engines is not None else f"{where}.space",
            )
        others = [engine for engine in engines if engine != node.engine]
        if others:
            raise ConfigError(
                f"the space searches {', '.join(others)} too, but node '{node.serve_id}' runs {node.engine} "
                "(this project serves vllm only); leave them out of `engines`",
                f"{where}.engines",
            )
        dims_raw, dims_where = raw[node.engine], f"{where}.space.{node.engine}"
    else:
        dims_raw, dims_where = raw, f"{where}.space"
    if not dims_raw:
        raise ConfigError("the space is empty: give at least one dimension with values to try", dims_where)
    dims = {key: _values(key, value, f"{dims_where}.{key}") for key, value in dims_raw.items()}
    _check_keys(dims, dims_where)
    return Space(serve_id=node.serve_id, node_index=index, dims=dims, where=dims_where)


def _tuned_node(config: ServeConfig, serve_id: str | None, where: str) -> tuple[int, NodeConfig]:
    engines = [(i, n) for i, n in enumerate(config.serve) if n.is_engine]
    if serve_id is not None:
        found = [(i, n) for i, n in engines if n.serve_id == serve_id]
        if not found:
            names = ", ".join(n.serve_id for _, n in engines) or "none"
            raise ConfigError(f"no engine node '{serve_id}' (engine nodes: {names})", f"{where}.serve_id")
        index, node = found[0]
    elif len(engines) == 1:
        index, node = engines[0]
    elif not engines:
        raise ConfigError("the config has no engine node to tune", where)
    else:
        names = ", ".join(n.serve_id for _, n in engines)
        raise ConfigError(f"the config has several engine nodes ({names}); name the one to tune in serve_id", where)
    if node.disaggregation is not None or config.experiment.runner.deploy.prefill_decode_disaggregation:
        raise ConfigError(
            f"node '{node.serve_id}' is disaggregated (prefill/decode pools); auto_tune tunes plain engine nodes", where
        )
    if node.resources.autoscaling:
        raise ConfigError(
            f"node '{node.serve_id}' autoscales (min_replicas/max_replicas); give it num_replicas to tune it", where
        )
    return index, node


def _values(key: str, value: Any, where: str) -> list[Any]:
    values = value if isinstance(value, list) else [value]
    if not values:
        raise ConfigError(f"dimension '{key}' has no values to try", where)
    if any(v == "auto" for v in values):
        raise ConfigError("'auto' is not searched here: list the values to try", where)
    if len(set(map(repr, values))) != len(values):
        raise ConfigError(f"dimension '{key}' lists a value twice: {values}", where)
    return values


def _check_keys(dims: dict[str, list[Any]], where: str) -> None:
    engine_args = arg_table()
    for key in dims:
        if key in FIXED_ARGS:
            raise ConfigError(
                f"'{key}' cannot be searched: every candidate serves the same model at the same place", where
            )
        if key in FLAGSCALE_DIMS or key in engine_args:
            continue
        close = difflib.get_close_matches(key, [*FLAGSCALE_DIMS, *engine_args], n=1, cutoff=0.7)
        hint = f"did you mean '{close[0]}'?" if close else "not a FlagScale dimension nor a `vllm serve` argument"
        raise ConfigError(f"unknown space key '{key}' ({hint})", where)
    for flagscale, vllm in PARALLEL_DIMS.items():
        if flagscale in dims and vllm in dims:
            raise ConfigError(f"both {flagscale} and {vllm} are given; they are the same dimension, keep one", where)


def engine_arg_name(key: str) -> str:
    return PARALLEL_DIMS.get(key, key)


def candidate_config(config: ServeConfig, space: Space, candidate: dict[str, Any]) -> ServeConfig:
    """The config with the tuned node set to `candidate`; nothing else changes."""
    tuned = config.model_copy(deep=True)
    node = tuned.serve[space.node_index]
    args = dict(node.engine_args)
    specific = {engine: dict(extra) for engine, extra in node.engine_args_specific.items()}
    own = specific.get(node.engine or "", {})
    old_devices = _devices(node, config)
    for key, value in candidate.items():
        if key == INSTANCE:
            try:
                node.resources.num_replicas = value
            except ValidationError as exc:
                raise ConfigError(
                    f"instance {value!r}: {exc.errors()[0]['msg'].removeprefix('Value error, ')}",
                    f"{space.where}.{key}",
                ) from None
            continue
        name = engine_arg_name(key)
        args[name] = value
        if name in own:  # engine_args_specific.<engine> wins over engine_args: the candidate's value goes there too
            own[name] = value
    node.engine_args = args
    node.engine_args_specific = specific
    # A node that reserves exactly TP x PP GPUs per replica keeps doing so for the candidate's TP x PP.
    if node.resources.num_gpus is not None and node.resources.num_gpus == old_devices:
        node.resources.num_gpus = _devices(node, tuned)
    return tuned


def _devices(node: NodeConfig, config: ServeConfig) -> int:
    args = engine_args_of(node, config)
    sizes = [args.get(k, 1) for k in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size")]
    return int(sizes[0] * sizes[1] * sizes[2]) if all(isinstance(s, int) for s in sizes) else 0


def check_values(config: ServeConfig, space: Space) -> None:
    """Every value of every dimension through vLLM's parser, alone over the node's engine args: a value it rejects
    is an error naming the space key, before any trial."""

    node = config.serve[space.node_index]
    base = engine_args_of(node, config)
    for key, values in space.dims.items():
        if key == INSTANCE:
            for value in values:
                if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                    raise ConfigError(
                        f"instance must be a positive number of replicas, got {value!r}", f"{space.where}.{key}"
                    )
            continue
        for value in values:
            to_argv({**base, engine_arg_name(key): value}, f"{space.where}.{key}")


def devices_used(config: ServeConfig, space: Space) -> int:
    """TP x PP x DP x replicas of the tuned node: what goodput is divided by."""
    node = config.serve[space.node_index]
    replicas = node.resources.num_replicas if isinstance(node.resources.num_replicas, int) else 1
    return max(1, _devices(node, config)) * replicas


def describe(candidate: dict[str, Any]) -> str:
    return " ".join(f"{key}={value}" for key, value in candidate.items())
