"""`action=stop`: drain, delete the application, stop exactly the Ray nodes the run started. Idempotent."""

from __future__ import annotations

from rich.console import Console

from flagscale.actions.teardown import teardown
from flagscale.cluster.state import RunState
from flagscale.net import port_open


def stop(exp_dir: str, console: Console, drain_timeout_s: float) -> int:
    state = RunState.load(exp_dir)
    if state is None:
        console.print(f"nothing is running for exp_dir {exp_dir}")
        return 0
    problems = teardown(state, console, drain_timeout_s)
    host, _, port = state.endpoint.rpartition(":")
    if port_open(host.removeprefix("http://"), int(port)):
        problems.append(f"port {port} still accepts connections")
    if problems:
        console.print("[red]stop finished with problems:[/]\n  " + "\n  ".join(problems))
        return 1
    RunState.remove(exp_dir)
    console.print(f"stopped '{state.app_name}'")
    return 0
