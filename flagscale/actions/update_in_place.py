"""`run` on a running deployment: the in-place update policy. What changed (flagscale/update.py) is applied by
redeploying the application; Serve replaces only the replicas whose spec changed, each new one healthy before the old
one drains. Refused before anything changes: a change the running cluster cannot take, a node whose only replica
would be replaced with no room for a spare, and a rollout that would wait forever for room (flagscale/rollout.py). A
new API key reaches the running router in place, the old one kept for deploy.old_key_grace_s (key_rotation.py)."""

from __future__ import annotations

import time

from rich.console import Console

from flagscale.actions import key_rotation
from flagscale.actions.deploy import check_fits, deploy, need, wait_until_serving
from flagscale.actions.invocation import RUN_PY, Invocation
from flagscale.adaptors import ray
from flagscale.cluster.ray_compat import free_resources_per_node, running_replicas
from flagscale.cluster.state import RunState
from flagscale.errors import ConfigError, DeployError, FlagScaleError
from flagscale.launchers import connect
from flagscale.plan import Plan
from flagscale.rollout import Rollout, fmt, stuck_at
from flagscale.update import Change, changed_nodes, diff, replaced_nodes, replicas_running


def stop_then_run(invocation: Invocation) -> str:
    """What to type when an update cannot be made in place, in the form the user called us."""
    return f"`{invocation.command('stop')}`, then `{invocation.command('run')}`"


def update(
    state: RunState,
    plan: Plan,
    snapshot: dict,
    console: Console,
    config_file: str,
    invocation: Invocation = RUN_PY,
) -> int:
    """Apply what changed between the running config (recorded in the state file) and `snapshot`; 0 once the
    deployment serves the new config. `invocation`: how the user called us, for what to type next."""
    changes = _changes(state, snapshot, config_file, invocation)
    if not changes:
        console.print(f"already running this config at {state.endpoint}: nothing to change")
        return 0
    console.print(f"updating in place ({len(changes)} change(s)):")
    for change in changes:
        console.print(f"  {change.describe()}", markup=False)
    t0 = time.monotonic()
    connect(state)
    check_fits(plan)
    running = state.extra["config"]
    replaced = replaced_nodes(changes)
    no_spare = spares(plan, replaced, console, running, invocation)
    refuse_if_stuck(plan, changed_nodes(changes), replaced, no_spare, invocation)
    keys = key_rotation.during_update(plan, key_rotation.running_keys(plan.app_name), time.time())
    for serve_id, adapters in deploy(plan, no_spare, keys).items():
        console.print(
            f"  '{serve_id}': its adapters given at run time ({', '.join(adapters) or 'none'}) are replaced by the "
            "config's",
            markup=False,
        )
    # Recorded at once: Serve now works toward this config, and a later `run` must diff against it.
    state.extra["config"] = snapshot
    state.models = plan.model_ids
    state.save()
    try:
        wait_until_serving(plan, console, t0)

        def redeploy(final: key_rotation.Keys) -> None:
            deploy(plan, no_spare, final)
            wait_until_serving(plan, console, t0)

        key_rotation.finish(plan, keys, redeploy, console)
    except FlagScaleError as exc:
        raise DeployError(
            f"the update did not complete: {exc}. Replicas that were not replaced keep serving "
            f"(`{invocation.command('status')}`); run again with a fixed config, or `{invocation.command('stop')}`"
        ) from None
    finally:
        ray.shutdown()
    console.print(f"[green]updated[/] in {time.monotonic() - t0:.1f}s; serving at {plan.endpoint}/v1")
    return 0


def _changes(state: RunState, snapshot: dict, config_file: str, invocation: Invocation = RUN_PY) -> list[Change]:
    """What changed; a ConfigError when any of it cannot be changed while the deployment runs."""
    running = state.extra.get("config")
    if running is None:
        raise FlagScaleError(
            "this deployment was started without a record of its config (an earlier version of the runner), so "
            f"it cannot be updated in place; {stop_then_run(invocation)}",
            f"{state.exp_dir}/state.json",
        )
    changes = diff(running, snapshot)
    fixed = [c for c in changes if not c.in_place]
    if fixed:
        raise ConfigError(
            "cannot be changed while the deployment runs (its cluster was started with it): "
            + "; ".join(c.describe() for c in fixed)
            + f". Nothing was changed; {stop_then_run(invocation)}",
            f"{config_file}: {fixed[0].path}",
        )
    return changes


def spares(
    plan: Plan, nodes: list[str], console: Console, running: dict, invocation: Invocation = RUN_PY
) -> frozenset[str]:
    """The changed nodes whose replicas are replaced in place (no node has room for a spare): refused for a node
    that runs or will run one replica, which would stop serving (while its one running replica holds what a new
    one needs, a new one cannot even start); said for the others."""
    no_spare = without_room_for_a_spare(plan, nodes)
    for engine in plan.engines:
        if engine.serve_id in no_spare:
            now = replicas_running(running, engine.serve_id) or engine.initial_replicas
            if min(now, engine.initial_replicas) < 2:
                raise DeployError(
                    f"no node has room for a spare replica of '{engine.serve_id}' "
                    f"({fmt(need(engine.ray_actor_options))}): replacing its only replica in place would stop "
                    f"serving it; nothing was changed. Free that much, or {stop_then_run(invocation)}",
                    f"serve_id {engine.serve_id}",
                )
            console.print(
                f"[yellow]no room for a spare replica of '{engine.serve_id}': its replicas are replaced one at a "
                "time, one fewer serving meanwhile[/]"
            )
    return no_spare


def refuse_if_stuck(
    plan: Plan,
    nodes: list[str],
    replaced: list[str],
    no_spare: frozenset[str],
    invocation: Invocation = RUN_PY,
) -> None:
    """Refused before anything changes: an update of a node that Serve would start and then wait on forever, a new
    replica finding no room at some step (flagscale/rollout.py)."""
    free = free_resources_per_node()
    for engine in plan.engines:
        if engine.serve_id not in nodes:
            continue
        old = running_replicas(plan.app_name, engine.serve_id)
        rollout = Rollout(
            free=free,
            old=old,
            need=need(engine.ray_actor_options),
            count=engine.initial_replicas,
            replaced=engine.serve_id in replaced,
            spare=engine.serve_id not in no_spare,
        )
        step = stuck_at(rollout)
        if step:
            raise DeployError(
                f"updating '{engine.serve_id}' in place ({len(old)} -> {engine.initial_replicas} replica(s)) would "
                f"wait forever for room: {step}; nothing was changed. Free that much, or {stop_then_run(invocation)}",
                f"serve_id {engine.serve_id}",
            )


def without_room_for_a_spare(plan: Plan, serve_ids: list[str]) -> frozenset[str]:
    """The changed engine nodes for which no node has the free resources of one more replica."""
    free = list(free_resources_per_node().values())
    tight = set()
    for engine in plan.engines:
        if engine.serve_id in serve_ids:
            wanted = need(engine.ray_actor_options)
            if not any(all(node.get(k, 0) >= v for k, v in wanted.items()) for node in free):
                tight.add(engine.serve_id)
    return frozenset(tight)
