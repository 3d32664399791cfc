"""`action=status`: application, deployments, replicas (host, pids, URL), endpoint and models, collected into a
StatusReport (flagscale/actions/status_report.py) and shown as tables (status_table.py) or JSON (output=json).

Exit code 0 only when the application is RUNNING, every deployment HEALTHY and the endpoint answers /health.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from typing import Any

from rich.console import Console

from flagscale import engines, launchers
from flagscale.actions.context import ActionContext
from flagscale.actions.invocation import RUN_PY, Invocation
from flagscale.actions.runner_log import route_serve_logger
from flagscale.actions.status_report import (
    DeploymentStatus,
    HostRow,
    ReplicaRow,
    RouterTotals,
    Scaling,
    StatusReport,
)
from flagscale.actions.status_table import render
from flagscale.adaptors import ray, serve
from flagscale.cluster import bounded
from flagscale.cluster.ray_compat import serve_details
from flagscale.cluster.ray_node import cluster_alive
from flagscale.cluster.state import RunState
from flagscale.engines.base import EngineKind
from flagscale.engines.metrics import engine_metrics
from flagscale.errors import ConfigError
from flagscale.net import health_problem
from flagscale.plan import ROUTER_DEPLOYMENT
from flagscale.replica import registry, runtime_adapters
from flagscale.replica.slo_policy import planner_records
from flagscale.router import keyring, peers

# The most a status may take (FLAGSCALE_STATUS_TIMEOUT_S sets another); past it, status says which step did not
# answer and exits 3.
STATUS_TIMEOUT_S = 90.0
ROUTER_ANSWER_S = 15.0  # a router process's answer to `stats`; past it, its last report in the KV store


def _timeout_s() -> float:
    return bounded.seconds_from_env(bounded.STATUS_BOUND_ENV, STATUS_TIMEOUT_S)


def _quiet(step: str) -> None:
    del step


def collect(state: RunState, api_key: str | None = None, note: bounded.Note = _quiet) -> StatusReport:
    """The run's report. `note(step)` is told what it waits for next (status bounds the whole, bounded.within)."""
    route_serve_logger()
    launcher = launchers.of_state(state)
    note(f"attaching to the run's Ray cluster at {state.ray_address}")
    launcher.connect(state)
    note("asking Serve's controller for the application's status")
    app = serve.status().applications.get(state.app_name)
    report = StatusReport(
        app=state.app_name,
        endpoint=state.endpoint,
        models=state.models,
        phase=state.phase,
        ray_address=state.ray_address,
        status=app.status.value if app else "NOT_DEPLOYED",
        message=app.message if app else "",
    )
    if app:
        report.deployments = _deployments(state, app, note)
    note("reading the replica registry from the cluster's KV store")
    report.replicas = [_replica_row(r) for r in registry.list_replicas(state.app_name)]
    # the engines' own key (flagscale/router/keyring.py); the client key for a deployment made before there was one
    engine_key = keyring.engine_key_if_made(state.exp_dir) or api_key
    for replica in report.replicas:
        note(f"reading the engine metrics of {replica.url}")
        replica.engine = engine_load(engines.get(replica.engine_kind), replica.url, api_key=engine_key)
    note("reading the SLO planners' decisions from the cluster's KV store")
    report.planner = planner_records(state.app_name)
    report.runtime_adapters = runtime_adapters.read_all(state.app_name)
    note("asking the router for its counters")
    router = _router_stats(state)
    routed = router.pop("replicas", {})
    report.router = RouterTotals.of(router) if router else None
    for replica in report.replicas:
        entry = routed.get(replica.replica_id, {})
        replica.requests_served = entry.get("served")
        replica.heartbeat_age_s = entry.get("heartbeat_age_s")
        if (replica.heartbeat_age_s or 0) > registry.STALE_AFTER_S:
            replica.state = "STALE"
        # The router's view: policy, in-flight, circuit state, prefix-table blocks / sessions (docs/routing.md).
        shown = ("serve_id", "url", "served", "heartbeat_age_s")
        replica.router = {k: v for k, v in entry.items() if k not in shown} or None
    note(f"checking {state.endpoint}/health")
    report.http_health = health_problem(state.endpoint, timeout_s=3, api_key=api_key) or "ok"
    note("listing the cluster's hosts")
    hosts = launcher.hosts(state, [asdict(r) for r in report.replicas])
    if hosts is not None:
        report.hosts = [HostRow(**h) for h in hosts]
    report.healthy = serving(report)
    return report


# Serve's deployment states in which the deployment serves as it should: a scale up or down is autoscaling at
# work (its replicas still serve; the table shows the state and Serve's message, e.g. replicas not yet scheduled)
SERVING_STATES = ("HEALTHY", "UPSCALING", "DOWNSCALING")


def serving(report: StatusReport) -> bool:
    """What status's exit code says (0: yes): every host alive, the app RUNNING, every deployment serving, the
    endpoint's /health ok."""
    return (
        all(h.ray_node == "alive" for h in report.hosts or [])
        and report.status == "RUNNING"
        and all(d.status in SERVING_STATES for d in report.deployments.values())
        and report.http_health == "ok"
    )


def _deployments(state: RunState, app, note: bounded.Note) -> dict[str, DeploymentStatus]:
    """Serve's deployments of the application: status, replicas per state, message, and replica settings."""
    deployments = {
        name: DeploymentStatus(
            status=dep.status.value,
            replicas={str(k.value if hasattr(k, "value") else k): v for k, v in dep.replica_states.items()},
            message=dep.message,
        )
        for name, dep in app.deployments.items()
    }
    note("asking Serve's controller for the deployments' replica settings")
    for name, scaling in _scaling(state.app_name).items():
        if name in deployments:
            deployments[name].scaling = scaling
    return deployments


def _replica_row(record) -> ReplicaRow:
    """One replica's row as its registry record has it."""
    return ReplicaRow(
        serve_id=record.serve_id,
        replica_id=record.replica_id,
        engine_kind=record.engine,
        role=record.role or "colocated",
        host=record.node_ip,
        node_id=record.node_id[:12],
        pid=record.pid,
        engine_pid=record.engine_pid,
        url=record.url,
        heartbeat_age_s=None,  # (the router's view, below: hosts' wall clocks are not compared)
        state="READY",
        worker_cpus=record.worker_cpus,
        gpus=record.gpus,
        family=getattr(record, "family", ""),
        ranks=record.ranks,
        log=record.log_path,
        asleep=record.asleep,
        kv_events=_kv_endpoints(record.kv_events or {}),
        models=record.models,
        adapter_errors=record.adapter_errors,
    )


def _kv_endpoints(info: dict) -> str:
    """Where a replica's engine publishes its KV events: its endpoint, or each data-parallel rank's ("" none)."""
    ranks = info.get("ranks") or []
    if len(ranks) > 1:
        return " ".join(rank["endpoint"] for rank in ranks)
    return info.get("endpoint", "")


def engine_load(
    kind: EngineKind, url: str, timeout_s: float = 2.0, api_key: str | None = None
) -> dict[str, float] | None:
    """The engine's own view, from its /metrics as its kind reads them: requests running and waiting, KV-cache
    usage (0..1), and for an engine that pulls KV caches (decode), its transfers and their failures."""
    try:
        return kind.status_load(engine_metrics(url, timeout_s, api_key))
    except (OSError, ValueError):
        return None


def _scaling(app_name: str) -> dict[str, Scaling]:
    """Per deployment: the replica settings Serve applies (num_replicas or autoscaling_config) and its target.

    The same ServeInstanceDetails the dashboard's /api/serve/applications/ serves; read from the controller
    because the dashboard is off."""

    try:
        details = serve_details()
    except Exception:
        return {}
    app = details.applications.get(app_name)
    scaling = {}
    for name, dep in (app.deployments if app else {}).items():
        config = dep.deployment_config
        autoscaling = config.autoscaling_config  # unset fields hold Serve's DEFAULT sentinel
        if hasattr(autoscaling, "model_dump"):
            autoscaling = autoscaling.model_dump()
        autoscaling = autoscaling if isinstance(autoscaling, dict) else None
        num_replicas = config.num_replicas if isinstance(config.num_replicas, int) else None
        scaling[name] = Scaling(dep.target_num_replicas, None if autoscaling else num_replicas, autoscaling)
    return scaling


def _router_stats(state: RunState) -> dict[str, Any]:
    """The router's totals, and under "replicas" its entry per replica: requests served since it started,
    in-flight, circuit, routing table, requests that failed there and moved on. Asked of a router process through
    a Serve handle; when none answers within ROUTER_ANSWER_S, summed from the router processes' last reports in the
    cluster's KV store instead (flagscale/router/peers.py): Serve's request routing once waited on a router busy
    with streams for over 90 s (CI, 2026-11-28), and the reports of a busy router can be older than refresh_s."""
    try:
        return bounded.within(ROUTER_ANSWER_S, lambda note: _ask_router(state), "the router")
    except Exception:  # no router answered (in time): what the processes last reported, if anything
        pass
    try:
        found = peers.reports(state.app_name)
    except Exception:  # the KV store did not answer: no router columns
        return {}
    return peers.merge_stats({report.process: report.stats for report in found}) if found else {}


def _ask_router(state: RunState) -> dict[str, Any]:
    # Serve's handle warns on stderr each time the router answers its queue-length probe late
    logging.getLogger("ray.serve").setLevel(logging.ERROR)
    router = serve.get_deployment_handle(ROUTER_DEPLOYMENT, app_name=state.app_name)
    return router.stats.remote().result(timeout_s=ROUTER_ANSWER_S)


def status(
    exp_dir: str,
    console: Console,
    output: str = "table",
    api_key: str | None = None,
    invocation: Invocation = RUN_PY,
) -> int:
    state = RunState.load(exp_dir)
    if state is None:
        _emit(console, output, NotRunning("NOT_RUNNING", exp_dir, f"nothing is running for exp_dir {exp_dir}"))
        return 1
    if not cluster_alive(state):
        line = f"the Ray cluster of this run ({state.ray_address}) is gone; `{invocation.command('stop')}` cleans up the state"
        _emit(console, output, NotRunning("CLUSTER_GONE", exp_dir, line))
        return 1
    try:
        report = bounded.within(_timeout_s(), lambda note: collect(state, api_key, note), "status")
    except bounded.NoAnswer as exc:
        if output == "json":  # (the error's line goes to stderr as every error's does)
            _emit(console, output, NotRunning("NO_ANSWER", exp_dir, str(exc), waiting_for=exc.step))
        raise
    if not bounded.left_behind():  # (a call left behind would hold the shutdown)
        ray.shutdown()
    if output == "json":
        print(json.dumps(report.to_json(), indent=2))
    else:
        render(console, report, wide=output == "wide")
    return 0 if report.healthy else 1


@dataclass
class NotRunning:
    """A status without a report: nothing runs, its cluster is gone, or a step gave no answer."""

    status: str
    exp_dir: str
    message: str
    waiting_for: str | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"healthy": False, "status": self.status, "exp_dir": self.exp_dir}
        if self.waiting_for is not None:
            out["waiting_for"] = self.waiting_for
        return {**out, "message": self.message}


def _emit(console: Console, output: str, result: NotRunning) -> None:
    if output == "json":
        print(json.dumps(result.to_json()))
    else:
        console.print(result.message)


def act(ctx: ActionContext) -> int:
    try:  # engines require the key on /metrics too; without it status still reports, minus the engines' load
        api_key = ctx.api_key
    except ConfigError:
        api_key = None
    return status(ctx.exp_dir, ctx.console, ctx.config.output, api_key, ctx.invocation)
