"""What planning needs to know from outside the config, gathered once before it: the target (this machine's GPUs and
cores, and what the run's launcher reads, flagscale/launchers/: the hostfile and the IPs of the hosts the config
names, an existing Ray cluster's nodes), whether the endpoint's port is taken, and what this machine's files and
environment say (the API key an env var holds, the exp_dir's resolved spelling, the checkpoints' sizes).
Planning (flagscale/plan/) then reads these instead of the world (dryrun and tests can hand it any)."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from flagscale import launchers
from flagscale.cluster.state import resolve_exp_dir
from flagscale.config.load import ConfigSources, resolve_api_key
from flagscale.config.lora import AdapterFiles, adapter_paths, read_adapter
from flagscale.config.schema import ServeConfig
from flagscale.devices import local_gpus
from flagscale.engines.model_args import model_experts
from flagscale.launchers.base import TargetFacts
from flagscale.planner.seeds import seeds_in

DEFAULT_PORT = 8000

__all__ = ["DEFAULT_PORT", "Facts", "TargetFacts", "endpoint_port", "gather", "model_experts", "model_weight_bytes"]


@dataclasses.dataclass(frozen=True)
class Facts:
    """Everything planning reads besides the config."""

    target: TargetFacts
    api_key: str | None  # deploy.api_key, or the value of the variable deploy.api_key_env names
    exp_dir: str  # experiment.exp_dir, absolute, `~` expanded, links resolved (cluster.state.resolve_exp_dir)
    # each `model` engine arg the config names, as written -> its local checkpoint's weight bytes (None: a hub id)
    weight_bytes: dict[str, int | None] = dataclasses.field(default_factory=dict)

    # each `model` engine arg the config names -> its routed experts from config.json (0: a dense model; None: unknown,
    # a hub id not cached here)
    experts: dict[str, int | None] = dataclasses.field(default_factory=dict)
    # each LoRA adapter directory the config names, as written -> what it holds (flagscale/config/lora.py)
    adapters: dict[str, AdapterFiles] = dataclasses.field(default_factory=dict)
    # the node auto_tune tuned in this exp_dir -> what one replica of its best trial sustained (history.planner_seeds)
    tuned: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)

    def experts_of(self, model: object) -> int | None:
        """The routed experts of the model a `model` engine arg names, as the config wrote it; None: unknown."""
        return self.experts.get(model) if isinstance(model, str) else None

    def weights_of(self, model: object) -> int | None:
        """The weight bytes of the checkpoint a `model` engine arg names, as the config wrote it; None: unknown."""
        return self.weight_bytes.get(model) if isinstance(model, str) else None


def endpoint_port(config: ServeConfig) -> int:
    """deploy.port, else FlagScale's meaning of the first engine node's engine_args.port, else 8000."""
    port = config.experiment.runner.deploy.port
    if port is not None:
        return port
    cli_args = config.experiment.runner.cli_args
    engine_ports = ({**cli_args, **n.merged_engine_args()}.get("port") for n in config.serve if n.is_engine)
    return next((p for p in engine_ports if isinstance(p, int)), DEFAULT_PORT)


def gather(
    config: ServeConfig, sources: ConfigSources, check_port: bool = True, target: TargetFacts | None = None
) -> Facts:
    """Every probe and read planning depends on, once; `target`: the target's facts when already known."""
    engine_nodes = [node for node in config.serve if node.is_engine]
    return Facts(
        target=target if target is not None else gather_target(config, sources, check_port),
        api_key=resolve_api_key(config, sources),
        exp_dir=resolve_exp_dir(config.experiment.exp_dir),
        weight_bytes={model: model_weight_bytes(os.path.expanduser(model)) for model in models_named(config)},
        experts={model: model_experts(os.path.expanduser(model)) for model in models_named(config)},
        adapters={path: read_adapter(path) for path in adapter_paths(engine_nodes, config.experiment.runner.cli_args)},
        tuned=tuned_rates(config, resolve_exp_dir(config.experiment.exp_dir)),
    )


def tuned_rates(config: ServeConfig, exp_dir: str) -> dict[str, dict[str, float]]:
    """auto_tune's measured rates for the node it tunes (its `serve_id`, else the only engine node), from the
    exp_dir's history.csv: the SLO planner's seeds (docs/autoscaling.md). {} where no search finished a trial."""
    tuner = config.experiment.auto_tuner
    engine_ids = [node.serve_id for node in config.serve if node.is_engine]
    serve_id = (
        tuner.serve_id if tuner is not None and tuner.serve_id else (engine_ids[0] if len(engine_ids) == 1 else None)
    )
    if serve_id is None:
        return {}
    seeds = seeds_in(exp_dir)
    return {serve_id: seeds} if seeds else {}


def gather_target(config: ServeConfig, sources: ConfigSources, check_port: bool = True) -> TargetFacts:
    """The target's probes (nvidia-smi, DNS, the Ray cluster's GCS, the endpoint's port), through the launcher."""
    launcher = launchers.select(config.experiment.runner, sources.main)
    facts = launcher.gather(config, sources)
    port_taken = None
    if check_port:
        port_taken = launcher.port_taken(facts, config.experiment.runner.deploy.host, endpoint_port(config))
    return dataclasses.replace(
        facts,
        gpus=local_gpus() if launcher.probes_local_gpus else [],
        cpus=os.cpu_count() or 1,
        port_taken=port_taken,
    )


def models_named(config: ServeConfig) -> set[str]:
    """Every `model` engine arg the config sets, wherever an engine node's args may take it from: runner.cli_args,
    engine_args, engine_args_specific, a disaggregated node's pools."""
    sources = [config.experiment.runner.cli_args]
    for node in config.serve:
        if not node.is_engine:
            continue
        sources += [node.engine_args, *node.engine_args_specific.values()]
        if node.disaggregation is not None:
            sources += [node.disaggregation.prefill.engine_args, node.disaggregation.decode.engine_args]
    return {args["model"] for args in sources if isinstance(args.get("model"), str)}


def model_weight_bytes(model: str) -> int | None:
    """Size of a local checkpoint's weights: the safetensors index's total, else the weight files'; a single-file
    checkpoint's (GGUF) size; None for a hub id."""
    path = Path(model)
    if path.is_file():
        return path.stat().st_size
    if not path.is_dir():
        return None
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            total = json.loads(index.read_text()).get("metadata", {}).get("total_size")
        except (OSError, ValueError):
            total = None
        if isinstance(total, int):
            return total
    for pattern in ("*.safetensors", "*.bin", "*.pt"):
        files = list(path.glob(pattern))
        if files:
            return sum(f.stat().st_size for f in files)
    return None
