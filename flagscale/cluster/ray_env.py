"""The environment of the Ray processes a run starts (every node, worker and replica, on every host)."""

from __future__ import annotations

import os
from pathlib import Path


def project_root() -> str:
    """The directory that holds the flagscale package: on PYTHONPATH of every Ray process, here and remote."""
    return str(Path(__file__).resolve().parents[2])


# Defaults for the Ray processes of a run (the user's envs override them):
# - Ray starts workers at nice 15, and the vLLM server a replica starts inherits it: under any CPU contention
#   the engine then loses to everything else on the host. The engine is the point of the cluster: nice 0.
# - Serve's controller loop runs every 0.1 s; on a box where the engine wants every core that steady CPU
#   shows up as engine latency. 0.5 s still reacts to a failed health check within a second.
SERVE_DEFAULTS = {"RAY_worker_niceness": "0", "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5"}


def worker_env(envs: dict[str, str]) -> dict[str, str]:
    """Env every Ray process of the run gets: the defaults, the user's envs and an importable flagscale package."""
    pythonpath = os.pathsep.join(p for p in (project_root(), os.environ.get("PYTHONPATH")) if p)
    return {**SERVE_DEFAULTS, **envs, "PYTHONPATH": pythonpath}
