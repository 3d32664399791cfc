"""What planning reads, in one value: the config, the files it came from, and the facts gathered before planning
(flagscale/facts.py), with the target the launcher makes of them."""

from __future__ import annotations

from dataclasses import dataclass

from flagscale.cluster.placement import Target
from flagscale.config.load import ConfigSources
from flagscale.config.schema import ServeConfig
from flagscale.facts import Facts
from flagscale.launchers.base import Launcher


@dataclass(frozen=True)
class PlanInputs:
    config: ServeConfig
    sources: ConfigSources
    facts: Facts
    target: Target  # what replicas are placed on (Launcher.target)
    serve_file: str  # the file the `serve` list came from, for errors
    # the target has no GPU: a prefill/decode pool's KV transfer then takes CPU engine args (EngineKind.kv_transfer_args)
    on_cpu: bool

    @classmethod
    def of(cls, config: ServeConfig, sources: ConfigSources, facts: Facts, launcher: Launcher) -> PlanInputs:
        target = launcher.target(facts.target)
        hosts = target.hostfile.hosts if target.hostfile else []
        on_cpu = not any(h.is_gpu for h in hosts) if hosts else target.gpus == 0
        return cls(config, sources, facts, target, sources.file_for(("serve",)), on_cpu)

    def node_where(self, index: int) -> str:
        """Where serve[index] is, for errors."""
        return f"{self.serve_file}: serve[{index}]({self.config.serve[index].serve_id})"
