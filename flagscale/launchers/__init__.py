"""The launchers: where a run's Ray cluster comes from, one module each, behind one interface
(flagscale/launchers/base.py: Launcher).

- local (local.py): this machine alone, a one-host cluster started here;
- ssh (ssh.py): the hosts of runner.hostfile, or of the Slurm allocation this runs in (cluster/slurm.py reads it:
  `runner.hostfile: slurm`), started over SSH;
- ray (ray.py): an existing Ray cluster (`runner.type: ray`); nothing is started or stopped but the
  deployment.

Each launcher lives in the module of its registry name (the name a run's state records). A new launcher is a
module here that defines `LAUNCHER = <its Launcher>` and a line in LAUNCHERS; nothing else in the
project asks which launcher a run has. Launchers may import flagscale/cluster/ (what every launcher shares: runners,
SSH, Ray nodes, the state file, placement), the replica and the basics; never planning, serving or the actions.
"""

from __future__ import annotations

import importlib

from flagscale.cluster.state import RunState
from flagscale.errors import ConfigError
from flagscale.launchers.base import Launcher, TargetFacts

# name (recorded in the run's state) -> the module that defines it; the first that claims experiment.runner runs it
LAUNCHERS = {
    "local": "flagscale.launchers.local",
    "ssh": "flagscale.launchers.ssh",
    "ray": "flagscale.launchers.ray",
}
# runner.type values FlagScale has that no launcher here serves, and what to do instead
UNSUPPORTED = {
    "cloud": "runner.type: cloud (FlagScale's Kubernetes LeaderWorkerSet runner) is not supported; on Kubernetes, run "
    "a KubeRay RayCluster and deploy onto it with runner.type: ray and runner.address (docs/clusters.md)",
}

__all__ = ["LAUNCHERS", "Launcher", "TargetFacts", "cluster_kind", "connect", "get", "of_state", "select"]


def get(name: str) -> Launcher:
    return importlib.import_module(LAUNCHERS[name]).LAUNCHER


def select(runner, where: str) -> Launcher:
    """The launcher experiment.runner selects, after it checked the runner's keys (`where`: the config file)."""
    if runner.type in UNSUPPORTED:
        raise ConfigError(UNSUPPORTED[runner.type], f"{where}: experiment.runner.type")
    chosen = next(launcher for launcher in map(get, LAUNCHERS) if launcher.claims(runner))
    chosen.check_runner(runner, where)
    return chosen


def cluster_kind(runner, where: str) -> str:
    """The name of the launcher experiment.runner selects: "local", "ssh" or "ray"."""
    return select(runner, where).name


def of_state(state: RunState) -> Launcher:
    """The launcher that started the run the state records. State files written before every launcher recorded
    its name (only "ray" did) are the SSH launcher's when they hold SSH settings, else this machine's."""
    name = state.extra.get("cluster") or ("ssh" if "ssh" in state.extra else "local")
    return get(name)


def connect(state: RunState) -> None:
    """Attach this process as a Ray driver to the cluster of the run the state records."""
    of_state(state).connect(state)
