"""The one typed schema of an experiment config. Field docs here are the reference for docs/config.md."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    Field,
    PrivateAttr,
    field_validator,
)

from flagscale.actions import ACTIONS
from flagscale.config.experiment import (
    BenchConfig,
    CmdsConfig,
    DeployConfig,
    ExperimentConfig,
    NodeArgs,
    ProfileConfig,
    RunnerConfig,
    TaskConfig,
)
from flagscale.config.fields import ENGINES, SAFE_ID, Backend, Strict, launcher_key
from flagscale.config.lora import LoraConfig
from flagscale.config.node import (
    UNSAFE_ARGS,
    Disaggregation,
    NodeConfig,
    PoolConfig,
    Resources,
    RoutingOptions,
    RoutingPolicy,
    check_routing_options,
)
from flagscale.config.tuner import SLO_METRICS, SLO_STATISTICS, AutoTunerConfig, TunerControl, TunerPerformance

__all__ = [
    "ENGINES",
    "SAFE_ID",
    "SLO_METRICS",
    "SLO_STATISTICS",
    "UNSAFE_ARGS",
    "AutoTunerConfig",
    "Backend",
    "BenchConfig",
    "CmdsConfig",
    "DeployConfig",
    "Disaggregation",
    "ExperimentConfig",
    "LoraConfig",
    "NodeArgs",
    "NodeConfig",
    "PoolConfig",
    "ProfileConfig",
    "Resources",
    "RoutingOptions",
    "RoutingPolicy",
    "RunnerConfig",
    "ServeConfig",
    "Strict",
    "TaskConfig",
    "TunerControl",
    "TunerPerformance",
    "check_routing_options",
    "launcher_key",
]


class ServeConfig(Strict):
    """The whole resolved config: what `run.py --config-name serve` composes."""

    experiment: ExperimentConfig = Field(description="The experiment: see below.")
    serve: list[NodeConfig] = Field(min_length=1, description="The graph's nodes, at least one: see below.")
    action: str = Field("run", description=f"One of {', '.join(ACTIONS)}.")
    foreground: bool = Field(False, description="Keep `run` attached; Ctrl-C stops everything.")
    output: Literal["table", "wide", "json"] = Field(
        "table",
        description="`status` output: table (what an operator scans first, 80 columns), wide (every column), json.",
    )
    serve_id: str | None = Field(
        None,
        description="`logs`: only this node's engine replicas (a disaggregated node's: both of its pools; or one "
        "pool, `<node>-prefill` / `<node>-decode`).",
    )
    replica: str | None = Field(
        None, description="`logs`: only this engine replica: its id, or a prefix of it that names one replica."
    )
    follow: bool = Field(
        False, description="`logs`: keep printing new lines (like tail -f) until Ctrl-C or until the deployment stops."
    )
    lines: int = Field(50, ge=0, description="`logs`: how many of each log's last lines to print.")
    _notices: list[str] = PrivateAttr(default_factory=list)

    @property
    def notices(self) -> list[str]:
        """What loading mapped or ignored (flagscale/config/compat.py); `run` and `dryrun` print them."""
        return self._notices

    @field_validator("action")
    @classmethod
    def _action(cls, action: str) -> str:
        if action not in ACTIONS:
            raise ValueError(f"unknown action {action!r}; one of: {', '.join(ACTIONS)}")
        return action

    @field_validator("serve_id", "replica", mode="before")
    @classmethod
    def _id_text(cls, value: Any) -> Any:
        """An id typed on the command line: Hydra reads `replica=4` as a number; a digit-only prefix is fine."""
        if isinstance(value, int) and not isinstance(value, bool):
            return str(value)
        if value is not None and not isinstance(value, str):
            raise ValueError(f"{value!r} is not an id; quote it for Hydra, e.g. replica=\"'1e5'\"")
        return value
