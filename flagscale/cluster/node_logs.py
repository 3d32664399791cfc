"""Engine replicas' log files on a node. On a Ray cluster the run did not start (runner.type: ray) they go under the
node's Ray session log dir, so that Ray's own log API (ray.util.state.list_logs / get_log) lists them too; read on
the node itself (the replica when it starts, a Ray task pinned to the node when `logs` lists them). Elsewhere they
are in the exp_dir's serve_logs (engine_logs_here lists either)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from flagscale.cluster.ray_compat import node_logs_dir

ENGINE_LOG_SUBDIR = "flagscale"


def engine_log_dir(app: str) -> str:
    """Where this node's engine replicas of `app` write their logs."""
    return os.path.join(node_logs_dir(), ENGINE_LOG_SUBDIR, app)


@dataclass(frozen=True)
class EngineLog:
    """An engine replica's log file as its launcher finds it (`logs` lists the ones the registry does not)."""

    path: str
    mtime: float
    host: str = "localhost"  # the node's IP where the file is not on this machine
    node_id: str | None = None  # a Ray node to read it on (Launcher.node_runner)


def engine_logs_here(log_dir: str | Path) -> list[EngineLog]:
    """The engine-*.log files under log_dir on this machine."""
    found = []
    for path in Path(log_dir).glob("engine-*.log"):
        try:
            found.append(EngineLog(str(path), path.stat().st_mtime))
        except OSError:
            continue
    return found
