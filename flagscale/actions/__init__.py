"""The CLI actions (`action=NAME`), one module each, named in this registry.

A new action is a module here with `act(ctx: ActionContext) -> int` (flagscale/actions/context.py) and one line in
ACTIONS; flagscale/actions/dispatch.py loads the config, takes the exp_dir's lock where the action's spec asks for
it, and calls `act`. This file is data only (it imports nothing of the project), so the schema can read the names
from it.

Beside the actions: run's parts (deploy.py: deploy and wait until serving; update_in_place.py: `run` on a running
deployment; key_rotation.py: the client keys an update hands the router; signals.py: SIGTERM/SIGHUP/Ctrl-C while it starts or stays attached; teardown.py: stop what a run
started), status's (status_report.py: the typed report; status_table.py: its tables; status_planner.py: the SLO planner table), logs' (log_sources.py: which
logs; log_reading.py: reading them on their hosts), and what every action shares (context.py: what `act` is handed; invocation.py: how the user called us,
to say what to type next; console.py: a console that survives a hang-up; runner_log.py: library chatter off the
console, into exp_dir/serve_logs/runner.log).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ActionSpec:
    module: str  # defines act(ctx) -> exit code
    summary: str  # one line for --help
    # Holds exp_dir's lock (flagscale/cluster/lock.py) for its whole life: it changes what runs from the exp_dir.
    # The others only read the state file and never wait for one.
    locks_exp_dir: bool = False
    # Has nothing to do in an exp_dir that does not exist, and must not create it (so takes no lock there).
    needs_exp_dir: bool = False
    # With foreground=true it stays attached to what it started: its lock record says so (who holds the exp_dir).
    attaches: bool = False


ACTIONS: dict[str, ActionSpec] = {
    "run": ActionSpec(
        "flagscale.actions.run",
        "start the deployment and wait until it serves, or update it",
        locks_exp_dir=True,
        attaches=True,
    ),
    "stop": ActionSpec(
        "flagscale.actions.stop", "drain, then stop exactly what run started", locks_exp_dir=True, needs_exp_dir=True
    ),
    "status": ActionSpec("flagscale.actions.status", "deployments, replicas, GPUs and load; exit 0 only if serving"),
    "logs": ActionSpec("flagscale.actions.logs", "the runner's and the engine replicas' logs (follow=true to tail)"),
    "dryrun": ActionSpec("flagscale.actions.dryrun", "the resolved config and the plan; nothing starts"),
    "bench": ActionSpec("flagscale.actions.bench", "the serving benchmark against the running deployment"),
    "test": ActionSpec("flagscale.actions.smoke", "run if needed, then one completion per model", locks_exp_dir=True),
    # auto_tune takes the lock itself, after checking the space (flagscale/actions/auto_tune.py).
    "auto_tune": ActionSpec("flagscale.actions.auto_tune", "search the auto_tuner space on the real target"),
}
