"""`status`'s tables: the default holds what an operator scans first and fits 80 columns; `output=wide` adds the
rest (pids, URLs, heartbeat, the router's view of each replica, KV transfers, each rank). Reads the typed report
(flagscale/actions/status_report.py)."""

from __future__ import annotations

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from flagscale.actions.status_planner import planner_table
from flagscale.actions.status_report import HostRow, ReplicaRow, RouterProcess, RouterTotals, StatusReport

LOAD_LEGEND = "load: requests running+waiting, KV cache used"


def render(console: Console, report: StatusReport, wide: bool = False) -> None:
    colour = "green" if report.healthy else "red"
    console.print(
        f"[bold]{report.app}[/]: [{colour}]{report.status}[/]  {report.endpoint}/v1  /health: {report.http_health}"
    )
    console.print(f"models: {', '.join(report.models)}")
    _deployments(console, report)
    if report.planner:
        columns = ["pool", "SLO", "measured", "forecast", "replicas", "last change"]
        console.print(planner_table(report.planner, _table("SLO planner", columns)))
    console.print(_replica_table(report.replicas, wide))
    for r in report.replicas:  # a LoRA adapter a replica could not load: it is not READY for that adapter
        for name, why in r.adapter_errors.items():
            console.print(f"[red]{escape(f'{r.replica_id}: adapter {name!r} not loaded: {why}')}[/]")
    for serve_id, adapters in sorted(report.runtime_adapters.items()):
        given = ", ".join(sorted(adapters)) or "none"
        console.print(
            f"'{serve_id}': adapters given at run time (POST /admin/adapters): {given}; `run` again replaces them with "
            "the config's",
            markup=False,
        )
    console.print(f"[dim]({LOAD_LEGEND})[/]")
    ranks = [(r, rank) for r in report.replicas for rank in r.ranks or ()]
    if wide and ranks:
        console.print(_rank_table(ranks))
    if report.router:
        _router(console, report.router, wide)
    if report.hosts is not None:
        console.print(_host_table(report.hosts))
    if not wide:
        console.print("[dim](output=wide: every column; output=json: for machines)[/]")


def _deployments(console: Console, report: StatusReport) -> None:
    table = _table("deployments", ["deployment", "status", "replicas"])
    problems = []
    for name, dep in report.deployments.items():
        replicas = " ".join(f"{k.lower()}={v}" for k, v in dep.replicas.items())
        autoscaling = dep.scaling.autoscaling if dep.scaling else None
        if autoscaling:
            replicas += (
                f" (autoscale {autoscaling['min_replicas']}..{autoscaling['max_replicas']}, "
                f"target {dep.scaling.target_replicas})"
            )
        table.add_row(name, dep.status, replicas)
        if dep.status != "HEALTHY" and dep.message:  # Serve's why, below the table: it can be long
            problems.append(f"{name}: {dep.message}")
    console.print(table)
    for line in problems:
        console.print(f"[red]{escape(line)}[/]")


def _router(console: Console, router: RouterTotals, wide: bool) -> None:
    console.print(
        f"router: {len(router.processes) or 1} process(es), {router.inflight} in flight; "
        f"{router.moved} requests failed over ({router.resumed} streams resumed)"
    )
    if router.decode_only:
        console.print(
            f"[yellow]router: {router.decode_only} disaggregated requests decoded without prefill (decode-only: "
            "no prefill replica could take them)[/]"
        )
    if len(router.processes) > 1 or wide:
        console.print(_router_table(router.processes))


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


def _cores(cpus: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5"."""
    spans: list[list[int]] = []
    for cpu in sorted(cpus):
        if spans and cpu == spans[-1][1] + 1:
            spans[-1][1] = cpu
        else:
            spans.append([cpu, cpu])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in spans)


def _devices(replica: ReplicaRow) -> str:
    """What the replica computes on: its devices (NVIDIA's as `gpu`, other families by name), else its bound cores
    (one set per rank, `|` between ranks)."""
    ranks = replica.ranks or []
    label = "gpu" if replica.family in ("", "nvidia", "cpu") else replica.family
    if ranks and any(rank.get("gpus") for rank in ranks):
        return f"{label} " + "|".join(",".join(map(str, rank.get("gpus") or [])) for rank in ranks)
    if ranks and any(rank.get("cpus") for rank in ranks):
        return "cpu " + "|".join(_cores(rank.get("cpus") or []) for rank in ranks)
    if replica.gpus:
        return f"{label} " + ",".join(replica.gpus)
    if replica.worker_cpus:
        return "cpu " + _cores(replica.worker_cpus)
    return "cpu"


def _hosts_of(replica: ReplicaRow) -> str:
    hosts = list(dict.fromkeys(rank["host"] for rank in replica.ranks or () if rank.get("host")))
    if len(hosts) <= 1:
        return replica.host
    return f"{replica.host} +{len(hosts) - 1}"


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


def _kv_events(r: ReplicaRow) -> str:
    """Which cache knowledge the router routes this replica on: its engine's KV events (the index: blocks, events/s,
    last sequence, replays, live or not) or the approximate table."""
    index = (r.router or {}).get("kv_index")
    if not r.kv_events:
        return "approximate"
    if not index:
        return " ".join(endpoint.rpartition("/")[2] for endpoint in r.kv_events.split())
    state = "live" if index.get("live") else f"[red]{index.get('state', 'not live')}[/]"
    seq = index.get("last_seq", "-")  # a replica of DP ranks: each rank's, and its blocks summed over them
    ranks = f" over {len(seq)} DP ranks" if isinstance(seq, list) else ""
    return (
        f"{state} {index.get('blocks', 0)} blocks{ranks} {index.get('events_per_s', 0):g}/s "
        f"seq {'/'.join(map(str, seq)) if isinstance(seq, list) else seq} replays {index.get('replays', 0)}"
    )


def _kv_pulled(engine: dict[str, float] | None) -> str:
    pulled = (engine or {}).get("kv_transfers")
    return f"{pulled:g} ({engine['kv_transfer_failures']:g} failed)" if pulled is not None else "-"


def _replica_table(replicas: list[ReplicaRow], wide: bool) -> Table:
    columns = ["node", "replica", "engine", "state", "host", "devices", "load"]
    if wide:
        columns += ["pid", "engine pid", "url", "heartbeat", "served", "in-flight", "circuit", "moved off"]
        columns += ["routing table", "KV events", "KV pulled"]
    table = _table("engine replicas", columns)
    for r in replicas:
        state = r.state if r.state == "READY" else f"[red]{r.state}[/]"
        if r.asleep and r.state == "READY":
            state = "[dim]ASLEEP[/]"
        row = [r.node, r.replica_id, r.engine_kind, state, _hosts_of(r), _devices(r), _load(r.engine)]
        if wide:
            row += _wide_cells(r)
        table.add_row(*row)
    return table


def _wide_cells(r: ReplicaRow) -> list[str]:
    routing = r.router or {}
    table_size = next((f"{routing[k]} {k}" for k in ("prefix_blocks", "sessions") if k in routing), "-")
    return [
        str(r.pid),
        str(r.engine_pid),
        r.url,
        f"{r.heartbeat_age_s}s ago" if r.heartbeat_age_s is not None else "-",
        str(r.requests_served if r.requests_served is not None else "-"),
        str(routing.get("inflight", "-")),
        routing.get("circuit", "-"),
        str(routing.get("migrations", "-")),
        table_size,
        _kv_events(r),
        _kv_pulled(r.engine),
    ]


def _router_table(processes: dict[str, RouterProcess]) -> Table:
    """Each router process sharing the endpoint's port, and its load."""
    table = _table("router processes", ["process", "pid", "state", "in-flight", "served", "moved"])
    for name, process in sorted(processes.items()):
        state = "draining" if process.draining else "serving"
        row = [name, str(process.pid if process.pid is not None else "-"), state, str(process.inflight)]
        table.add_row(*row, str(process.served), str(process.moved))
    return table


def _host_table(hosts: list[HostRow]) -> Table:
    table = _table("hosts", ["host", "role", "chip", "slots", "ray node", "replicas"])
    for h in hosts:
        colour = "green" if h.ray_node == "alive" else "red"
        chip = f"{h.chip or '-'} ({h.family})" if h.family and h.family != h.chip else (h.chip or "-")
        slots = f"{h.slots}, {len(h.devices)} listed" if h.devices is not None else str(h.slots)
        table.add_row(h.host, h.role, chip, slots, f"[{colour}]{h.ray_node}[/]", ", ".join(h.replicas) or "-")
    return table


def _rank_table(ranks: list[tuple[ReplicaRow, dict]]) -> Table:
    table = _table("engine ranks", ["node", "replica", "rank", "dp", "ep", "pid", "host", "cores", "gpus"])
    for replica, rank in ranks:
        table.add_row(
            replica.node,
            replica.replica_id,
            str(rank.get("rank", "-")),
            str(rank.get("dp", "-")),
            str(rank.get("ep", "-")),
            str(rank.get("pid", "-")),
            rank.get("host") or replica.host,
            _cores(rank.get("cpus") or []) or "-",
            ",".join(map(str, rank.get("gpus") or [])) or "-",
        )
    return table
