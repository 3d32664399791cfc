"""Where engine replicas on a Ray cluster the run did not start (runner.type: ray) write their logs: under the
node's Ray session log dir, so that Ray's own log API (ray.util.state.list_logs / get_log) lists them too. Read
on the node itself (the replica when it starts, a Ray task pinned to the node when `logs` lists them)."""

from __future__ import annotations

import os

from flagscale.cluster.ray_compat import node_logs_dir

ENGINE_LOG_SUBDIR = "flagscale"


def engine_log_dir(app: str) -> str:
    """Where this node's engine replicas of `app` write their logs."""
    return os.path.join(node_logs_dir(), ENGINE_LOG_SUBDIR, app)
