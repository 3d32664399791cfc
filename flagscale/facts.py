"""What planning needs to know about the target, gathered once before it: this machine's GPUs and cores, and what
the run's launcher reads (flagscale/launchers/: the hostfile and the IPs of the hosts the config names, an existing
Ray cluster's nodes), whether the endpoint's port is taken. `build_plan` is then a pure function of the config and
these facts (dryrun and tests can hand it any)."""

from __future__ import annotations

import dataclasses
import os

from flagscale import launchers
from flagscale.config.load import ConfigSources
from flagscale.config.schema import ServeConfig
from flagscale.devices import local_gpus
from flagscale.launchers.base import TargetFacts

DEFAULT_PORT = 8000

__all__ = ["DEFAULT_PORT", "TargetFacts", "endpoint_port", "gather"]


def endpoint_port(config: ServeConfig) -> int:
    """deploy.port, else FlagScale's meaning of the first engine node's engine_args.port, else 8000."""
    port = config.experiment.runner.deploy.port
    if port is not None:
        return port
    cli_args = config.experiment.runner.cli_args
    engine_ports = ({**cli_args, **n.merged_engine_args()}.get("port") for n in config.serve if n.is_engine)
    return next((p for p in engine_ports if isinstance(p, int)), DEFAULT_PORT)


def gather(config: ServeConfig, sources: ConfigSources, check_port: bool = True) -> TargetFacts:
    """Every probe planning depends on (nvidia-smi, DNS, the Ray cluster's GCS, the endpoint's port), once."""
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
