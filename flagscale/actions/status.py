"""`action=status`: application, deployments, replicas (host, pids, URL), endpoint and models.

Exit code 0 only when the application is RUNNING, every deployment HEALTHY and the endpoint answers /health.
"""

from __future__ import annotations

import json
import time
from typing import Any

from rich.console import Console
from rich.table import Table

from flagscale import engines
from flagscale.cluster.ray_node import cluster_alive, connect
from flagscale.cluster.state import RunState
from flagscale.engines.base import EngineKind
from flagscale.net import health_problem
from flagscale.plan import ROUTER_DEPLOYMENT
from flagscale.serve import registry


def collect(state: RunState, api_key: str | None = None) -> dict[str, Any]:
    from ray import serve

    connect(state)
    app = serve.status().applications.get(state.app_name)
    report: dict[str, Any] = {
        "app": state.app_name,
        "endpoint": state.endpoint,
        "models": state.models,
        "phase": state.phase,
        "ray_address": state.ray_address,
        "status": app.status.value if app else "NOT_DEPLOYED",
        "message": app.message if app else "",
        "deployments": {},
        "replicas": [],
    }
    if app:
        for name, dep in app.deployments.items():
            report["deployments"][name] = {
                "status": dep.status.value,
                "replicas": {str(k.value if hasattr(k, "value") else k): v for k, v in dep.replica_states.items()},
                "message": dep.message,
            }
        for name, scaling in _scaling(state.app_name).items():
            report["deployments"].get(name, {})["scaling"] = scaling
    for record in registry.list_replicas(state.app_name, include_stale=True):
        report["replicas"].append(
            {
                "serve_id": record.serve_id,
                "replica_id": record.replica_id,
                "engine_kind": record.engine,
                "role": record.role or "colocated",
                "host": record.node_ip,
                "node_id": record.node_id[:12],
                "pid": record.pid,
                "engine_pid": record.engine_pid,
                "url": record.url,
                "heartbeat_age_s": round(time.time() - record.updated_at, 1),
                "state": "STALE" if record.stale else "READY",
                "worker_cpus": record.worker_cpus,  # cores the CPU layout gave the engine's workers; [] = not pinned
                "gpus": record.gpus,  # GPU ids Ray gave the replica; [] = none
                "log": record.log_path,
            }
        )
    for replica in report["replicas"]:
        replica["engine"] = engine_load(engines.get(replica["engine_kind"]), replica["url"], api_key=api_key)
    router = _router_stats(state)
    routed = router.pop("replicas", {})
    report["router"] = router or None  # totals: in-flight, requests moved to another replica, streams resumed
    for replica in report["replicas"]:
        entry = routed.get(replica["replica_id"], {})
        replica["requests_served"] = entry.get("served")
        # The router's view: policy, in-flight, circuit state, prefix-table blocks / sessions (docs/routing.md).
        replica["router"] = {k: v for k, v in entry.items() if k not in ("serve_id", "url", "served")} or None
    report["http_health"] = health_problem(state.endpoint, timeout_s=3) or "ok"
    if any(h.remote for h in state.hosts):
        report["hosts"] = _hosts(state, report["replicas"])
    elif state.extra.get("cluster") == "ray":
        report["hosts"] = _ray_cluster_nodes(report["replicas"])
    report["healthy"] = (
        all(h["ray_node"] == "alive" for h in report.get("hosts", []))
        and report["status"] == "RUNNING"
        and all(d["status"] == "HEALTHY" for d in report["deployments"].values())
        and report["http_health"] == "ok"
    )
    return report


def engine_load(
    kind: EngineKind, url: str, timeout_s: float = 2.0, api_key: str | None = None
) -> dict[str, float] | None:
    """The engine's own view, from its /metrics as its kind reads them: requests running and waiting, KV-cache
    usage (0..1), and for an engine that pulls KV caches (decode), its transfers and their failures."""
    from flagscale.serve.metrics import engine_metrics

    try:
        return kind.status_load(engine_metrics(url, timeout_s, api_key))
    except (OSError, ValueError):
        return None


def _hosts(state: RunState, replicas: list[dict]) -> list[dict]:
    """Multi-host: one row per hostfile host, with its Ray node's state as the GCS sees it."""
    import ray

    nodes = {n["NodeID"]: n for n in ray.nodes()}
    rows = []
    for record in state.hosts:
        if not record.remote:
            continue
        node = nodes.get(record.node_id or "")
        on_it = [r for r in replicas if record.node_id and record.node_id.startswith(r["node_id"])]
        rows.append(
            {
                "host": record.host,
                "role": record.role,
                "chip": record.chip,
                "slots": record.slots,
                "ray_node": "alive" if node and node.get("Alive") else "dead",
                "node_id": (record.node_id or "")[:12],
                "session": record.session,
                "replicas": [f"{r['serve_id']}/{r['replica_id']}" for r in on_it],
            }
        )
    return rows


def _ray_cluster_nodes(replicas: list[dict]) -> list[dict]:
    """runner.type: ray: the cluster's nodes from Ray's node table (alive ones, and any that held a replica)."""
    import ray

    from flagscale.cluster.ray_cluster import HEAD_RESOURCE, fmt

    rows = []
    for node in ray.nodes():
        on_it = [r for r in replicas if node["NodeID"].startswith(r["node_id"])]
        if not node.get("Alive") and not on_it:
            continue
        resources = node.get("Resources", {})
        chips = [k.removeprefix("accelerator_type:") for k in resources if k.startswith("accelerator_type:")]
        rows.append(
            {
                "host": node["NodeManagerAddress"],
                "role": "head + router" if HEAD_RESOURCE in resources else "worker",
                "chip": ", ".join(chips) or None,
                "slots": fmt({k: v for k, v in resources.items() if k in ("CPU", "GPU")}),
                "ray_node": "alive" if node.get("Alive") else "dead",
                "node_id": node["NodeID"][:12],
                "session": None,
                "replicas": [f"{r['serve_id']}/{r['replica_id']}" for r in on_it],
            }
        )
    return rows


def _scaling(app_name: str) -> dict[str, dict[str, Any]]:
    """Per deployment: the replica settings Serve applies (num_replicas or autoscaling_config) and its target.

    The same ServeInstanceDetails the dashboard's /api/serve/applications/ serves; read from the controller
    because the dashboard is off."""
    from flagscale.cluster.ray_compat import serve_details

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
        scaling[name] = {
            "target_replicas": dep.target_num_replicas,
            "num_replicas": None if autoscaling else num_replicas,
            "autoscaling": autoscaling,
        }
    return scaling


def _engine_cells(load: dict[str, float] | None) -> tuple[str, str, str]:
    if not load:
        return "-", "-", "-"
    running, waiting = load.get("running"), load.get("waiting")
    usage = load.get("kv_cache_usage")
    pulled = load.get("kv_transfers")
    return (
        f"{running:g}/{waiting:g}" if running is not None and waiting is not None else "-",
        f"{usage:.0%}" if usage is not None else "-",
        f"{pulled:g} ({load['kv_transfer_failures']:g} failed)" if pulled is not None else "-",
    )


def _router_stats(state: RunState) -> dict[str, Any]:
    """The router's totals, and under "replicas" its entry per replica: requests served since it started,
    in-flight, circuit, routing table, requests that failed there and moved on."""
    from ray import serve

    try:
        router = serve.get_deployment_handle(ROUTER_DEPLOYMENT, app_name=state.app_name)
        stats = router.stats.remote().result(timeout_s=10)
    except Exception:
        return {}
    return stats


def status(exp_dir: str, console: Console, output: str = "table", api_key: str | None = None) -> int:
    state = RunState.load(exp_dir)
    if state is None:
        _emit(
            console,
            output,
            {"healthy": False, "status": "NOT_RUNNING", "exp_dir": exp_dir},
            f"nothing is running for exp_dir {exp_dir}",
        )
        return 1
    if not cluster_alive(state):
        _emit(
            console,
            output,
            {"healthy": False, "status": "CLUSTER_GONE", "exp_dir": exp_dir},
            f"the Ray cluster of this run ({state.ray_address}) is gone; `action=stop` cleans up the state",
        )
        return 1
    report = collect(state, api_key)
    import ray

    ray.shutdown()
    if output == "json":
        print(json.dumps(report, indent=2))
    else:
        _render(console, report)
    return 0 if report["healthy"] else 1


def _emit(console: Console, output: str, data: dict, line: str) -> None:
    if output == "json":
        print(json.dumps({**data, "message": line}))
    else:
        console.print(line)


def _render(console: Console, report: dict[str, Any]) -> None:
    colour = "green" if report["healthy"] else "red"
    console.print(
        f"application [bold]{report['app']}[/]: [{colour}]{report['status']}[/]  endpoint {report['endpoint']}/v1"
        f"  (/health: {report['http_health']})"
    )
    console.print(f"models: {', '.join(report['models'])}")
    deployments = Table(title="deployments", title_justify="left")
    for column in ("deployment", "status", "replicas", "message"):
        deployments.add_column(column)
    for name, dep in report["deployments"].items():
        replicas = " ".join(f"{k.lower()}={v}" for k, v in dep["replicas"].items())
        autoscaling = (dep.get("scaling") or {}).get("autoscaling")
        if autoscaling:
            replicas += (
                f" (autoscale {autoscaling['min_replicas']}..{autoscaling['max_replicas']}, "
                f"target {dep['scaling']['target_replicas']})"
            )
        deployments.add_row(name, dep["status"], replicas, (dep["message"] or "")[:120])
    console.print(deployments)
    replicas = Table(title="engine replicas", title_justify="left")
    columns = ("serve_id", "replica", "state", "host", "pid", "engine pid", "url", "heartbeat", "served")
    for column in (
        *columns,
        "in-flight",
        "circuit",
        "moved off",
        "routing table",
        "running/waiting",
        "KV cache",
        "KV pulled",
    ):
        replicas.add_column(column)
    for r in report["replicas"]:
        routing = r.get("router") or {}
        table_size = next((f"{routing[k]} {k}" for k in ("prefix_blocks", "sessions") if k in routing), "-")
        replicas.add_row(
            r["serve_id"] if r["role"] == "colocated" else f"{r['serve_id']} ({r['role']})",
            r["replica_id"],
            r["state"],
            r["host"] + (f" GPU {','.join(r['gpus'])}" if r.get("gpus") else ""),
            str(r["pid"]),
            str(r["engine_pid"]),
            r["url"],
            f"{r['heartbeat_age_s']}s ago",
            str(r.get("requests_served", "-")),
            str(routing.get("inflight", "-")),
            routing.get("circuit", "-"),
            str(routing.get("migrations", "-")),
            table_size,
            *_engine_cells(r.get("engine")),
        )
    console.print(replicas)
    if report.get("router"):
        router = report["router"]
        console.print(
            f"router: {router['inflight']} in flight; {router['moved']} requests moved to another replica "
            f"after theirs failed, {router['resumed']} of them streams resumed mid-way"
        )
    if "hosts" in report:
        hosts = Table(title="hosts", title_justify="left")
        for column in ("host", "role", "chip", "slots", "ray node", "replicas"):
            hosts.add_column(column)
        for h in report["hosts"]:
            colour = "green" if h["ray_node"] == "alive" else "red"
            hosts.add_row(
                h["host"],
                h["role"],
                h["chip"] or "-",
                str(h["slots"]),
                f"[{colour}]{h['ray_node']}[/]",
                ", ".join(h["replicas"]) or "-",
            )
        console.print(hosts)
