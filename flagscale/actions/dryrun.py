"""`action=dryrun`: the resolved config and the plan, nothing started."""

from __future__ import annotations

import math
import shlex
import sys
from pathlib import Path

import yaml
from rich.console import Console
from rich.table import Table

from flagscale import launchers
from flagscale.actions.auto_tune import auto_tune_dryrun
from flagscale.actions.context import ActionContext
from flagscale.actions.graph_view import describe, draw
from flagscale.actions.run import running_state
from flagscale.config.schema import ServeConfig
from flagscale.plan import Plan, open_without_key
from flagscale.replica.rank_layout import preview, rank_indexes
from flagscale.secrets import mask_argv, mask_env
from flagscale.update import MASK, SECRET_NAME, diff, masked_config


def dryrun(
    config: ServeConfig,
    plan: Plan,
    console: Console,
    running_config: dict | None = None,
    snapshot: dict | None = None,
) -> int:
    """`running_config`: the config of a deployment running from this exp_dir; what `run` would change in it is
    shown last."""
    console.print("[bold]resolved config[/]")
    console.print(yaml.safe_dump(masked_config(config), sort_keys=False).rstrip(), markup=False)
    table = Table(title="plan", title_justify="left")
    for column in ("node", "replicas", "per replica", "devices", "engine args (after defaults)"):
        table.add_column(column)
    for engine in plan.engines:
        args = engine.kind.shown_args(engine.argv)
        replicas = _replicas_cell(engine)
        resources = ", ".join(f"{k}={v}" for k, v in engine.ray_actor_options.items())
        name = f"{engine.serve_id}\n({engine.role} pool of {engine.group})" if engine.role else engine.serve_id
        if engine.pinned_host:
            name += f"\non {engine.pinned_host}"
        table.add_row(
            name,
            replicas,
            resources,
            f"{engine.devices_per_replica} {engine.device}",
            "\n".join(f"{k}={MASK if SECRET_NAME.search(k) and v is not None else v}" for k, v in args.items()),
        )
    for node in plan.graph.nodes if plan.graph else []:
        replicas = node.describe_replicas()
        resources = ", ".join(f"{k}={v}" for k, v in node.ray_actor_options.items())
        table.add_row(node.serve_id, replicas, resources, "-", f"custom: {node.class_name}")
    console.print(table)
    for engine in plan.engines:
        if engine.devices_per_replica > 1:
            _print_ranks(plan, engine, console)
    if plan.graph:
        console.print("[bold]graph[/]")
        console.print("\n".join(describe(plan)), markup=False)
        console.print(f"graph picture: {draw(plan, Path(plan.exp_dir) / 'graph.png')}")
    console.print(f"endpoint: {plan.endpoint}/v1   models: {', '.join(dict.fromkeys(plan.model_ids))}")
    console.print(f"router: {plan.router_processes} process(es) sharing the endpoint's port")
    _print_exposure(plan, console)
    for item in launchers.get(plan.launcher).describe(plan):
        console.print(item, markup=False)
    for note in plan.notes:
        console.print(f"[yellow]note:[/] {note}")
    if running_config is not None and snapshot is not None:
        _print_update(running_config, snapshot, console)
    console.print("dryrun: nothing was started")
    return 0


def _replicas_cell(engine) -> str:
    """The plan table's replicas column: how many, routed how, and what an idle replica does."""
    cell = f"{engine.describe_replicas()}\nrouting: {engine.routing.policy}"
    if engine.kv_events:  # the engines publish their KV-cache events (docs/routing.md)
        cell += "\n(KV events)"
    if engine.planned_awake:
        cell += "\nidle: sleeps; all max_replicas started at run, the SLO planner sizes the replicas awake"
    elif (engine.autoscaling or {}).get("min_replicas") == 0:
        on_cpu = engine.device == "cpu"
        can = engine.kind.capabilities.sleep_on_cpu if on_cpu else engine.kind.capabilities.sleep_on_gpu
        where = " on CPU" if on_cpu else ""
        why = "with resources.sleep_delay_s it sleeps first" if can else f"{engine.kind.display}{where} cannot sleep"
        cell += f"\nidle: stops at zero, starts on the next request ({why})"
    return cell


def _print_exposure(plan: Plan, console: Console) -> None:
    """Where the endpoint moved, and a warning when anything listens beyond loopback without a key (run says the
    same)."""
    if plan.endpoint_moved:
        console.print(f"[yellow]note:[/] {plan.endpoint_moved}", soft_wrap=True)
    warning = open_without_key(plan)
    if warning:
        console.print(f"[bold yellow]warning:[/] {warning}", soft_wrap=True)


def _print_update(running_config: dict, snapshot: dict, console: Console) -> None:
    changes = diff(running_config, snapshot)
    if not changes:
        console.print("running from this exp_dir with this config: `run` would change nothing")
        return
    fixed = [c for c in changes if not c.in_place]
    console.print(f"[bold]running from this exp_dir; `run` would {'refuse' if fixed else 'update it in place'}:[/]")
    for change in changes:
        mark = "  " if change.in_place else "  [not in place] "
        console.print(mark + change.describe(), markup=False)


def _print_ranks(plan: Plan, engine, console: Console) -> None:
    """Each replica's ranks: which host (first fit over the hostfile's hosts, as Ray would) and devices, and the
    command each host runs (replica/ranks.py, the engine kind's bind_ranks / headless_launch)."""
    hosts = launchers.get(plan.launcher).rank_hosts(plan, engine)
    tp, pp, dp = engine.parallel
    on_gpu = engine.device == "gpu"
    planned = preview(engine.parallel, on_gpu, engine.ranks_per_host, hosts, engine.initial_replicas)
    nnodes = planned[0].share.nnodes if planned else 1
    experts = (
        f", expert parallel: EP = DP x TP = {dp * tp} ranks per stage share the experts"
        if engine.expert_parallel
        else ""
    )
    spread = planned[0].share.dp_local if planned else 0
    runner = (
        f"{engine.kind.display}'s multi-node data parallel, {spread} DP rank(s) per host"
        if spread
        else engine.kind.rank_runner
    )
    console.print(
        f"[bold]ranks of '{engine.serve_id}'[/]: TP {tp} x PP {pp} x DP {dp} = {math.prod(engine.parallel)} per "
        f"replica{experts}, {engine.ranks_per_host} per host over {nnodes} host(s), {runner}"
        + (" (placement group: one bundle per host)" if nnodes > 1 else "")
    )
    kind = engine.kind

    def shown(argv: list[str]) -> str:
        argv = mask_argv(["python" if a == sys.executable else a for a in argv])
        text = shlex.join(argv).replace("--port 0", "--port <free port>")
        text = text.replace("--data-parallel-rpc-port 0", "--data-parallel-rpc-port '<free port>'")
        return text.replace("--master-port 0", "--master-port <free port>")

    for host in planned:
        share = host.share
        ranks = f"{share.ranks[0]}-{share.ranks[-1]}" if len(share.ranks) > 1 else str(share.ranks[0])
        if dp > 1:
            ranks += f" ({_group_ranges(share.ranks, engine.parallel, engine.expert_parallel)})"
        if share.node_rank == 0:
            launch = kind.bind_ranks(kind.launch(engine.argv, share.host, 0, None, engine.role), share)
            what = "API server + ranks"
        else:
            launch = kind.headless_launch(engine.argv, share)
            what = "headless ranks"
        console.print(
            f"  replica {host.replica + 1}  node rank {share.node_rank}  {host.host}: {what} {ranks}, {host.devices}",
            markup=False,
        )
        env = " ".join(f"{k}={v}" for k, v in mask_env(launch.env).items())
        console.print(f"    $ {env + ' ' if env else ''}{shown(launch.argv)}", markup=False, soft_wrap=True)
    if len(planned) < nnodes * engine.initial_replicas:
        console.print(f"  (the hosts' free slots hold {len(planned) // max(1, nnodes)} such replica(s))")


def _group_ranges(ranks: tuple[int, ...], parallel: tuple[int, int, int], expert_parallel: bool) -> str:
    """ "DP 2-3, EP 2-3": the DP (and EP) ranks of a host's consecutive global ranks; EP only without PP (with PP
    each stage has its own EP group)."""
    first, last = (rank_indexes(rank, parallel, expert_parallel and parallel[1] == 1) for rank in (ranks[0], ranks[-1]))
    return ", ".join(
        f"{key.upper()} {first[key]}" + (f"-{last[key]}" if last[key] != first[key] else "") for key in first
    )


def act(ctx: ActionContext) -> int:
    ctx.print_notices()
    plan = ctx.plan(check_port=False, quiet=True)
    running = running_state(ctx.exp_dir)
    running_config = running.extra.get("config") if running is not None else None
    code = dryrun(ctx.config, plan, ctx.console, running_config, ctx.snapshot(plan))
    if ctx.config.experiment.auto_tuner is not None:  # what action=auto_tune would run and skip
        code = auto_tune_dryrun(ctx.config, ctx.sources, ctx.exp_dir, ctx.console) or code
    return code
