"""Stop what a run started: drain the router, delete the Serve app, stop the Ray nodes we launched.

Shared by `stop`, by `run` when start-up fails, and by `run foreground=true` on Ctrl-C.
"""

from __future__ import annotations

import logging
import time

from rich.console import Console

from flagscale.cluster.multihost import stop_hosts
from flagscale.cluster.ray_node import cluster_alive, connect, stop_local_nodes
from flagscale.cluster.state import RunState
from flagscale.plan import ROUTER_DEPLOYMENT

log = logging.getLogger(__name__)


def teardown(state: RunState, console: Console, drain_timeout_s: float = 30.0) -> list[str]:
    """Returns the problems met; an empty list means everything the run started is gone."""
    problems: list[str] = []
    multi_host = "ssh" in state.extra
    # Multi-host: the driver attaches through the local Ray node; before it exists nothing was deployed.
    can_attach = not multi_host or "driver_ip" in state.extra
    if can_attach and cluster_alive(state):
        try:
            _stop_application(state, console, drain_timeout_s)
        except Exception as exc:  # the cluster may be half-dead; the processes still get stopped below
            problems.append(f"stopping the Serve application failed: {exc}")
            log.warning("stopping the Serve application failed: %s", exc)
    import ray

    if ray.is_initialized():
        ray.shutdown()
    if state.started_cluster and multi_host:
        if state.hosts:
            console.print(f"stopping the Ray nodes this run started on {len(state.hosts)} host(s) ...")
        problems += stop_hosts(state)
    elif state.started_cluster:
        console.print("stopping the Ray node(s) this run started ...")
        problems += stop_local_nodes(state)
    return problems


def _stop_application(state: RunState, console: Console, drain_timeout_s: float) -> None:
    from ray import serve

    connect(state)
    apps = serve.status().applications
    if state.app_name in apps:
        try:
            router = serve.get_deployment_handle(ROUTER_DEPLOYMENT, app_name=state.app_name)
            console.print(f"draining in-flight requests (up to {drain_timeout_s:g}s) ...")
            left = router.drain.remote(drain_timeout_s).result(timeout_s=drain_timeout_s + 10)
            if left:
                console.print(f"[yellow]{left} request(s) still running after {drain_timeout_s:g}s; stopping anyway[/]")
        except Exception as exc:
            log.info("drain skipped: %s", exc)
        console.print(f"deleting Serve application '{state.app_name}' ...")
        serve.delete(state.app_name, _blocking=False)
        deadline = time.monotonic() + drain_timeout_s + 60
        while state.app_name in serve.status().applications and time.monotonic() < deadline:
            time.sleep(0.5)
    # No serve.shutdown(): when we started the cluster, stopping its nodes takes Serve down with it;
    # when we joined one, its Serve instance is not ours to stop.
