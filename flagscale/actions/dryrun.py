"""`action=dryrun`: the resolved config and the plan, nothing started."""

from __future__ import annotations

import yaml
from rich.console import Console
from rich.table import Table

from flagscale.config.schema import ServeConfig
from flagscale.engines.vllm_args import parsed
from flagscale.plan import Plan
from flagscale.update import MASK, SECRET_NAME, masked_config

# Engine args worth showing with their defaults even when the config does not set them.
SHOWN_ENGINE_ARGS = (
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "data_parallel_size",
    "quantization",
    "max_model_len",
    "max_num_seqs",
    "max_num_batched_tokens",
    "enable_chunked_prefill",
    "gpu_memory_utilization",
    "enforce_eager",
    "dtype",
    "served_model_name",
)


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
        ns = vars(parsed(engine.argv))
        args = {k: ns.get(k) for k in SHOWN_ENGINE_ARGS}
        args.update({k: ns.get(k) for k in _set_keys(engine.argv)})
        replicas = f"{engine.describe_replicas()}\nrouting: {engine.routing.policy}"
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
        from pathlib import Path

        from flagscale.actions.graph_view import describe, draw

        console.print("[bold]graph[/]")
        console.print("\n".join(describe(plan)), markup=False)
        console.print(f"graph picture: {draw(plan, Path(plan.exp_dir) / 'graph.png')}")
    console.print(f"endpoint: {plan.endpoint}/v1   models: {', '.join(dict.fromkeys(plan.model_ids))}")
    console.print(f"router: {plan.router_processes} process(es) sharing the endpoint's port")
    if plan.ray_cluster is not None:
        _print_ray_cluster(plan, console)
    elif plan.cluster is None:
        console.print(f"Ray head: local, {plan.head_num_cpus} logical CPUs   exp_dir: {plan.exp_dir}")
    else:
        _print_hosts(plan, console)
    for note in plan.notes:
        console.print(f"[yellow]note:[/] {note}")
    if running_config is not None and snapshot is not None:
        _print_update(running_config, snapshot, console)
    console.print("dryrun: nothing was started")
    return 0


def _print_update(running_config: dict, snapshot: dict, console: Console) -> None:
    from flagscale.update import diff

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
    command each host runs (serve/ranks.py, the engine kind's bind_ranks / headless_launch)."""
    import math
    import shlex
    import sys

    from flagscale.serve.ranks import preview

    if plan.ray_cluster is not None:
        hosts = [("a node of the Ray cluster", engine.devices_per_replica * engine.initial_replicas)]
    elif plan.cluster is not None:
        hosts = [(h.host, h.slots) for h in plan.cluster.hostfile.by_chip()[engine.chip]]
    else:
        hosts = [("this machine", engine.devices_per_replica * engine.initial_replicas)]
    tp, pp, dp = engine.parallel
    on_gpu = engine.device == "gpu"
    planned = preview(engine.parallel, on_gpu, engine.ranks_per_host, hosts, engine.initial_replicas)
    nnodes = planned[0].share.nnodes if planned else 1
    console.print(
        f"[bold]ranks of '{engine.serve_id}'[/]: TP {tp} x PP {pp} x DP {dp} = {math.prod(engine.parallel)} per "
        f"replica, {engine.ranks_per_host} per host over {nnodes} host(s), vLLM's mp executor"
        + (" (placement group: one bundle per host)" if nnodes > 1 else "")
    )
    kind = engine.kind

    def shown(argv: list[str]) -> str:
        argv = ["python" if a == sys.executable else a for a in argv]
        text = shlex.join(argv).replace("--port 0", "--port <free port>")
        return text.replace("--master-port 0", "--master-port <free port>")

    for host in planned:
        share = host.share
        ranks = f"{share.ranks[0]}-{share.ranks[-1]}" if len(share.ranks) > 1 else str(share.ranks[0])
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
        env = " ".join(f"{k}={v}" for k, v in launch.env.items())
        console.print(f"    $ {env + ' ' if env else ''}{shown(launch.argv)}", markup=False, soft_wrap=True)
    if len(planned) < nnodes * engine.initial_replicas:
        console.print(f"  (the hosts' free slots hold {len(planned) // max(1, nnodes)} such replica(s))")


def _set_keys(argv: list[str]) -> list[str]:
    return [a[2:].replace("-", "_").removeprefix("no_") for a in argv if a.startswith("--")]


def _print_hosts(plan: Plan, console: Console) -> None:
    cluster = plan.cluster
    table = Table(title=f"hosts ({cluster.hostfile.path}, over SSH)", title_justify="left")
    for column in ("host", "role", "chip", "slots"):
        table.add_column(column)
    for entry in cluster.hostfile.hosts:
        role = "head + router" if entry is cluster.hostfile.head else "worker"
        table.add_row(entry.host, role, entry.chip or "-", str(entry.slots))
    console.print(table)
    for chip, line in cluster.demand.items():
        console.print(f"fits {chip}: {line}", markup=False)
    console.print(f"exp_dir: {plan.exp_dir}")


def _print_ray_cluster(plan: Plan, console: Console) -> None:
    from flagscale.cluster.ray_cluster import describe

    facts = plan.ray_cluster
    console.print(
        f"Ray cluster at {facts.address} (runner.type: ray; nothing is started or stopped but the deployment):"
    )
    for line in describe(facts):
        console.print(f"  node {line}", markup=False)
    console.print(f"router: on the head node {facts.head.ip}")
    console.print("replicas would go (first fit on what the nodes have free):")
    for line in plan.placement.lines():
        console.print(f"  {line}", markup=False)
    console.print(f"exp_dir: {plan.exp_dir}")
