"""`action=status`: application, deployments, replicas (host, pids, URL), endpoint and models.

Exit code 0 only when the application is RUNNING, every deployment HEALTHY and the endpoint answers /health.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from flagscale import engines, launchers
from flagscale.actions.context import ActionContext
from flagscale.cluster import bounded
from flagscale.cluster.ray_compat import serve_details
from flagscale.cluster.ray_node import cluster_alive
from flagscale.cluster.state import RunState
from flagscale.engines.base import EngineKind
from flagscale.engines.metrics import engine_metrics
from flagscale.errors import ConfigError
from flagscale.net import health_problem
from flagscale.plan import ROUTER_DEPLOYMENT
from flagscale.replica import registry
from flagscale.router import peers

# The most a status may take (FLAGSCALE_STATUS_TIMEOUT_S sets another); past it, status says which step did not
# answer and exits 3.
STATUS_TIMEOUT_S = 90.0
ROUTER_ANSWER_S = 15.0  # a router process's answer to `stats`; past it, its last report in the KV store


def _timeout_s() -> float:
    return bounded.seconds_from_env(bounded.STATUS_BOUND_ENV, STATUS_TIMEOUT_S)


def _quiet(step: str) -> None:
    del step


def collect(state: RunState, api_key: str | None = None, note: bounded.Note = _quiet) -> dict[str, Any]:
    """The run's report. `note(step)` is told what it waits for next (status bounds the whole, bounded.within)."""
    from ray import serve

    launcher = launchers.of_state(state)
    note(f"attaching to the run's Ray cluster at {state.ray_address}")
    launcher.connect(state)
    note("asking Serve's controller for the application's status")
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
        note("asking Serve's controller for the deployments' replica settings")
        for name, scaling in _scaling(state.app_name).items():
            report["deployments"].get(name, {})["scaling"] = scaling
    note("reading the replica registry from the cluster's KV store")
    report["replicas"] = [_replica_row(r) for r in registry.list_replicas(state.app_name, include_stale=True)]
    for replica in report["replicas"]:
        note(f"reading the engine metrics of {replica['url']}")
        replica["engine"] = engine_load(engines.get(replica["engine_kind"]), replica["url"], api_key=api_key)
    note("asking the router for its counters")
    router = _router_stats(state)
    routed = router.pop("replicas", {})
    report["router"] = router or None  # totals: in-flight, requests moved to another replica, streams resumed
    for replica in report["replicas"]:
        entry = routed.get(replica["replica_id"], {})
        replica["requests_served"] = entry.get("served")
        # The router's view: policy, in-flight, circuit state, prefix-table blocks / sessions (docs/routing.md).
        replica["router"] = {k: v for k, v in entry.items() if k not in ("serve_id", "url", "served")} or None
    note(f"checking {state.endpoint}/health")
    report["http_health"] = health_problem(state.endpoint, timeout_s=3) or "ok"
    note("listing the cluster's hosts")
    hosts = launcher.hosts(state, report["replicas"])
    if hosts is not None:
        report["hosts"] = hosts
    report["healthy"] = (
        all(h["ray_node"] == "alive" for h in report.get("hosts", []))
        and report["status"] == "RUNNING"
        and all(d["status"] == "HEALTHY" for d in report["deployments"].values())
        and report["http_health"] == "ok"
    )
    return report


def _replica_row(record) -> dict[str, Any]:
    """One replica's row as its registry record has it."""
    return {
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
        "ranks": record.ranks,  # an engine of several processes: each rank's pid, host, cores / GPUs
        "log": record.log_path,
    }


def engine_load(
    kind: EngineKind, url: str, timeout_s: float = 2.0, api_key: str | None = None
) -> dict[str, float] | None:
    """The engine's own view, from its /metrics as its kind reads them: requests running and waiting, KV-cache
    usage (0..1), and for an engine that pulls KV caches (decode), its transfers and their failures."""
    try:
        return kind.status_load(engine_metrics(url, timeout_s, api_key))
    except (OSError, ValueError):
        return None


def _scaling(app_name: str) -> dict[str, dict[str, Any]]:
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
        scaling[name] = {
            "target_replicas": dep.target_num_replicas,
            "num_replicas": None if autoscaling else num_replicas,
            "autoscaling": autoscaling,
        }
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
    from ray import serve

    # Serve's handle warns on stderr each time the router answers its queue-length probe late
    logging.getLogger("ray.serve").setLevel(logging.ERROR)
    router = serve.get_deployment_handle(ROUTER_DEPLOYMENT, app_name=state.app_name)
    return router.stats.remote().result(timeout_s=ROUTER_ANSWER_S)


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
    try:
        report = bounded.within(_timeout_s(), lambda note: collect(state, api_key, note), "status")
    except bounded.NoAnswer as exc:
        if output == "json":  # (the error's line goes to stderr as every error's does)
            _emit(
                console,
                output,
                {"healthy": False, "status": "NO_ANSWER", "exp_dir": exp_dir, "waiting_for": exc.step},
                str(exc),
            )
        raise
    import ray

    if not bounded.left_behind():  # (a call left behind would hold the shutdown)
        ray.shutdown()
    if output == "json":
        print(json.dumps(report, indent=2))
    else:
        _render(console, report, wide=output == "wide")
    return 0 if report["healthy"] else 1


def _emit(console: Console, output: str, data: dict, line: str) -> None:
    if output == "json":
        print(json.dumps({**data, "message": line}))
    else:
        console.print(line)


def _render(console: Console, report: dict[str, Any], wide: bool = False) -> None:
    """The default table holds what an operator scans first and fits 80 columns; `wide` adds the rest (pids, URLs,
    heartbeat, the router's view of each replica, KV transfers, each rank)."""
    colour = "green" if report["healthy"] else "red"
    console.print(
        f"[bold]{report['app']}[/]: [{colour}]{report['status']}[/]  {report['endpoint']}/v1  "
        f"/health: {report['http_health']}"
    )
    console.print(f"models: {', '.join(report['models'])}")
    deployments = _table("deployments", ["deployment", "status", "replicas"])
    problems = []
    for name, dep in report["deployments"].items():
        replicas = " ".join(f"{k.lower()}={v}" for k, v in dep["replicas"].items())
        autoscaling = (dep.get("scaling") or {}).get("autoscaling")
        if autoscaling:
            replicas += (
                f" (autoscale {autoscaling['min_replicas']}..{autoscaling['max_replicas']}, "
                f"target {dep['scaling']['target_replicas']})"
            )
        deployments.add_row(name, dep["status"], replicas)
        if dep["status"] != "HEALTHY" and dep["message"]:  # Serve's why, below the table: it can be long
            problems.append(f"{name}: {dep['message']}")
    console.print(deployments)
    for line in problems:
        console.print(f"[red]{escape(line)}[/]")
    console.print(_replica_table(report["replicas"], wide))
    ranks = [(r, rank) for r in report["replicas"] for rank in r.get("ranks") or ()]
    if wide and ranks:
        console.print(_rank_table(ranks))
    if report.get("router"):
        router = report["router"]
        processes = router.get("processes") or {}
        console.print(
            f"router: {len(processes) or 1} process(es), {router['inflight']} in flight; {router['moved']} requests "
            f"moved to another replica after theirs failed, {router['resumed']} of them streams resumed mid-way"
        )
        if len(processes) > 1 or wide:
            console.print(_router_table(processes))
    if "hosts" in report:
        hosts = _table("hosts", ["host", "role", "chip", "slots", "ray node", "replicas"])
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
    if not wide:
        console.print("[dim](output=wide: every column; output=json: for machines)[/]")


def _table(title: str, columns: list[str]) -> Table:
    """kubectl-like: a header rule, two spaces between columns, long cells folded (never cut)."""
    table = Table(
        title=title,
        title_justify="left",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        show_edge=False,
        collapse_padding=True,
    )
    for column in columns:
        table.add_column(column, overflow="fold")
    return table


def _node(replica: dict) -> str:
    return replica["serve_id"] if replica["role"] == "colocated" else f"{replica['serve_id']} ({replica['role']})"


def _cores(cpus: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5"."""
    spans: list[list[int]] = []
    for cpu in sorted(cpus):
        if spans and cpu == spans[-1][1] + 1:
            spans[-1][1] = cpu
        else:
            spans.append([cpu, cpu])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in spans)


def _devices(replica: dict) -> str:
    """What the replica computes on: its GPUs, else its bound cores (one set per rank, `|` between ranks)."""
    ranks = replica.get("ranks") or []
    if ranks and any(rank.get("gpus") for rank in ranks):
        return "gpu " + "|".join(",".join(map(str, rank.get("gpus") or [])) for rank in ranks)
    if ranks and any(rank.get("cpus") for rank in ranks):
        return "cpu " + "|".join(_cores(rank.get("cpus") or []) for rank in ranks)
    if replica.get("gpus"):
        return "gpu " + ",".join(replica["gpus"])
    if replica.get("worker_cpus"):
        return "cpu " + _cores(replica["worker_cpus"])
    return "cpu"


def _hosts_of(replica: dict) -> str:
    hosts = list(dict.fromkeys(rank["host"] for rank in replica.get("ranks") or () if rank.get("host")))
    if len(hosts) <= 1:
        return replica["host"]
    return f"{replica['host']} +{len(hosts) - 1}"


def _load(engine: dict[str, float] | None) -> str:
    """Requests running + waiting in the engine, and its KV-cache use."""
    if not engine:
        return "-"
    running, waiting, usage = engine.get("running"), engine.get("waiting"), engine.get("kv_cache_usage")
    cells = []
    if running is not None:
        cells.append(f"{running:g}+{waiting or 0:g}")
    if usage is not None:
        cells.append(f"{usage:.0%}")
    return " ".join(cells) or "-"


def _kv_pulled(engine: dict[str, float] | None) -> str:
    pulled = (engine or {}).get("kv_transfers")
    return f"{pulled:g} ({engine['kv_transfer_failures']:g} failed)" if pulled is not None else "-"


def _replica_table(replicas: list[dict], wide: bool) -> Table:
    columns = ["node", "replica", "engine", "state", "host", "devices", "load"]
    if wide:
        columns += ["pid", "engine pid", "url", "heartbeat", "served", "in-flight", "circuit", "moved off"]
        columns += ["routing table", "KV pulled"]
    table = _table("engine replicas (load: running+waiting requests, KV cache used)", columns)
    for r in replicas:
        state = r["state"] if r["state"] == "READY" else f"[red]{r['state']}[/]"
        row = [_node(r), r["replica_id"], r["engine_kind"], state, _hosts_of(r), _devices(r)]
        row.append(_load(r.get("engine")))
        if wide:
            routing = r.get("router") or {}
            table_size = next((f"{routing[k]} {k}" for k in ("prefix_blocks", "sessions") if k in routing), "-")
            row += [str(r["pid"]), str(r["engine_pid"]), r["url"], f"{r['heartbeat_age_s']}s ago"]
            row += [str(r.get("requests_served", "-")), str(routing.get("inflight", "-"))]
            row += [routing.get("circuit", "-"), str(routing.get("migrations", "-")), table_size]
            row.append(_kv_pulled(r.get("engine")))
        table.add_row(*row)
    return table


def _router_table(processes: dict[str, dict]) -> Table:
    """Each router process sharing the endpoint's port, and its load."""
    table = _table("router processes", ["process", "pid", "state", "in-flight", "served", "moved"])
    for name, process in sorted(processes.items()):
        state = "draining" if process.get("draining") else "serving"
        row = [name, str(process.get("pid", "-")), state, str(process.get("inflight", 0))]
        table.add_row(*row, str(process.get("served", 0)), str(process.get("moved", 0)))
    return table


def _rank_table(ranks: list[tuple[dict, dict]]) -> Table:
    table = _table("engine ranks", ["node", "replica", "rank", "pid", "host", "cores", "gpus"])
    for replica, rank in ranks:
        table.add_row(
            _node(replica),
            replica["replica_id"],
            str(rank.get("rank", "-")),
            str(rank.get("pid", "-")),
            rank.get("host") or replica["host"],
            _cores(rank.get("cpus") or []) or "-",
            ",".join(map(str, rank.get("gpus") or [])) or "-",
        )
    return table


def act(ctx: ActionContext) -> int:
    try:  # engines require the key on /metrics too; without it status still reports, minus the engines' load
        api_key = ctx.api_key
    except ConfigError:
        api_key = None
    return status(ctx.exp_dir, ctx.console, ctx.config.output, api_key)
