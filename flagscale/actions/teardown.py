"""Stop what a run started: drain the router, delete the Serve app, stop the Ray nodes we launched, then run
the user's `cmds.after_stop` on each host that ran `cmds.before_start`.

Shared by `stop`, by `run` when start-up fails, and by `run foreground=true` on Ctrl-C.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from flagscale import launchers
from flagscale.actions.runner_log import route_serve_logger
from flagscale.adaptors import ray, serve
from flagscale.cluster import bounded, ssh
from flagscale.cluster.ray_compat import delete_app
from flagscale.cluster.ray_node import cluster_alive
from flagscale.cluster.runner import CommandRunner, CommandTimeout, parallel, runner_for
from flagscale.cluster.state import HostRecord, RunState
from flagscale.errors import ClusterError
from flagscale.plan import ROUTER_DEPLOYMENT
from flagscale.replica import registry, runtime_adapters
from flagscale.router import peers

log = logging.getLogger(__name__)
AFTER_STOP_TIMEOUT_S = 120.0
# What the Serve part of a stop may take beyond the drain (attaching, Serve's answers, the application's removal,
# which waits drain + 60 s itself); past it, the stop names the step that gave no answer and stops the processes.
# FLAGSCALE_STOP_SERVE_TIMEOUT_S sets the whole Serve part instead.
SERVE_STOP_MARGIN_S = 120.0
# A host's env for cmds.after_stop, from the config at hand (None: this machine). The state file records no env
# values (they may be secrets), so whoever tears down gives them: run from its plan, stop from the config.
EnvFor = Callable[[str | None], dict[str, str]]


def no_envs(_host: str | None) -> dict[str, str]:
    return {}


def teardown(state: RunState, console: Console, drain_timeout_s: float = 30.0, env_for: EnvFor = no_envs) -> list[str]:
    """Returns the problems met; an empty list means everything the run started is gone.

    A failing `cmds.after_stop` (run last, see run_after_stop) is printed in yellow and is not among the problems:
    `stop` still removes the state file and exits 0."""
    problems: list[str] = []
    launcher = launchers.of_state(state)
    if launcher.can_attach(state) and cluster_alive(state):
        try:
            bounded.within(
                bounded.seconds_from_env(bounded.STOP_SERVE_BOUND_ENV, drain_timeout_s + SERVE_STOP_MARGIN_S),
                lambda note: _stop_application(state, console, drain_timeout_s, note),
                "stopping the Serve application",
            )
        except bounded.NoAnswer as exc:  # a wedged controller or GCS: the processes still get stopped below
            problems.append(str(exc))
            log.warning("%s", exc)
        except Exception as exc:  # the cluster may be half-dead; the processes still get stopped below
            problems.append(f"stopping the Serve application failed: {exc}")
            log.warning("stopping the Serve application failed: %s", exc)
    if ray.is_initialized() and not bounded.left_behind():  # (a call left behind would hold the shutdown)
        ray.shutdown()
    problems += launcher.stop(state, console)
    hosts = after_stop_hosts(state)
    if hosts:
        console.print(f"running cmds.after_stop on {len(hosts)} host(s) ...")
        # reported, not a problem: what the run started is gone either way
        for line in run_after_stop(state, env_for=env_for):
            console.print(f"[yellow]{escape(line)}[/]")
    return problems


# ---- cmds.after_stop ----------------------------------------------------------------------------


def after_stop_hosts(state: RunState) -> list[HostRecord]:
    """The hosts that ran `before_start` (every Ray node we started, not the multi-host driver node), when the
    run recorded an `after_stop` snippet (state.extra["after_stop"], written by `run` at start)."""
    spec = state.extra.get("after_stop") or {}
    if not spec.get("snippet"):
        return []
    return [r for r in state.hosts if r.role != "driver"]


def run_after_stop(state: RunState, timeout_s: float = AFTER_STOP_TIMEOUT_S, env_for: EnvFor = no_envs) -> list[str]:
    """Run the recorded `cmds.after_stop` snippet on each host that ran `before_start`, all in parallel:
    `bash -c <snippet>` with the run's envs (nodes_envs applied per host), bounded by `timeout_s`; locally as
    a subprocess, on remote hosts over SSH. Every host's output and exit code go to
    <exp_dir>/serve_logs/after_stop.log.

    Returns one line per host where it failed (non-zero exit, timeout, unreachable host), naming the host and
    the exit code. Each host through its CommandRunner (cluster/runner.py), as its Ray node was started. Callers report these lines and carry on: a failing after_stop never makes `stop` fail, and
    the state file is still removed (FlagScale: "its failure is reported, `stop` still completes")."""
    records = after_stop_hosts(state)
    if not records:
        return []
    spec = state.extra["after_stop"]
    snippet = spec["snippet"]
    # State files of earlier versions recorded the envs themselves.
    envs, host_envs = spec.get("envs") or env_for(None), spec.get("host_envs") or {}
    log_path = Path(state.exp_dir) / "serve_logs" / "after_stop.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    settings = ssh.SshSettings(**state.extra.get("ssh", {}))
    lock = threading.Lock()

    def one(record: HostRecord) -> str | None:
        with runner_for(record.host, record.remote, settings) as runner:
            env = (host_envs.get(record.host) or env_for(record.host)) if record.remote else envs
            code, output, failure = _after_stop_on(runner, snippet, env, timeout_s)
        with lock, open(log_path, "a") as out:
            out.write(
                f"=== {record.host} {time.strftime('%Y-%m-%d %H:%M:%S')}: after_stop "
                f"{'exit code ' + str(code) if code is not None else failure}\n{output}"
            )
            if output and not output.endswith("\n"):
                out.write("\n")
        if failure:
            return f"{record.host}: cmds.after_stop {failure}; see {log_path}"
        return None

    results = parallel(records, one)
    return [
        f"{r.host}: cmds.after_stop failed: {v}" if isinstance(v, BaseException) else v
        for r, v in zip(records, results)
        if v
    ]


def _failure(code: int, timeout_s: float) -> str | None:
    if code == 0:
        return None
    if code == 124:  # coreutils `timeout`, used on remote hosts
        return f"timed out after {timeout_s:g}s (exit code 124)"
    return f"failed with exit code {code}"


def _after_stop_on(
    runner: CommandRunner, snippet: str, envs: dict[str, str], timeout_s: float
) -> tuple[int | None, str, str | None]:
    """(exit code or None, output, failure or None). Locally the runner kills the snippet's whole session at the
    bound; on a remote host `timeout` ends it on the host itself and the SSH wait has a margin on top."""
    try:
        runner.open()
    except ClusterError as exc:
        return None, "", f"not run: host unreachable ({str(exc).removeprefix(f'{runner.host}: ')})"
    argv = ["bash", "-c", snippet]
    try:
        if runner.remote:
            result = runner.run(["timeout", "-k", "5", f"{timeout_s:g}", *argv], envs, timeout_s=timeout_s + 15)
        else:
            result = runner.run(argv, envs, timeout_s=timeout_s)
    except CommandTimeout as exc:
        return None, exc.output, f"timed out after {timeout_s:g}s (killed)"
    except (ClusterError, OSError) as exc:
        if not runner.remote:
            raise
        return None, "", f"failed: {exc}"
    return result.code, result.stdout + result.stderr, _failure(result.code, timeout_s)


def _stop_application(state: RunState, console: Console, drain_timeout_s: float, note: bounded.Note) -> None:
    launcher = launchers.of_state(state)
    note(f"attaching to the run's Ray cluster at {state.ray_address}")
    launcher.connect(state)
    with launcher.removing_app(state, console):
        _delete_app(state, console, drain_timeout_s, note)
    # No serve.shutdown(): the run started every Ray node of its cluster, and stopping them takes Serve down; an
    # existing Ray cluster's Serve is shared with its other applications.


def _delete_app(state: RunState, console: Console, drain_timeout_s: float, note: bounded.Note) -> None:
    route_serve_logger()
    note("asking Serve's controller for its applications")
    apps = serve.status().applications
    if state.app_name in apps:
        try:
            note("draining the router")
            router = serve.get_deployment_handle(ROUTER_DEPLOYMENT, app_name=state.app_name)
            console.print(f"draining in-flight requests (up to {drain_timeout_s:g}s) ...")
            left = router.drain.remote(drain_timeout_s).result(timeout_s=drain_timeout_s + 10)
            if left:
                console.print(f"[yellow]{left} request(s) still running after {drain_timeout_s:g}s; stopping anyway[/]")
            registry.mark_stopping(state.app_name)
        except Exception as exc:
            log.info("drain skipped: %s", exc)
        console.print(f"deleting Serve application '{state.app_name}' ...")
        note(f"asking Serve to delete the application '{state.app_name}'")
        delete_app(state.app_name)
        note(f"waiting for Serve to remove the application '{state.app_name}'")
        deadline = time.monotonic() + drain_timeout_s + 60
        while state.app_name in serve.status().applications and time.monotonic() < deadline:
            time.sleep(0.5)
    note(f"removing what '{state.app_name}' left in Ray's key-value store")
    forget_app_keys(state.app_name)


def forget_app_keys(app: str) -> None:
    """What a deployment keeps in Ray's key-value store, gone with it: its replicas' records and stop mark
    (replica/registry.py), its router processes' reports and drain mark (router/peers.py), its adapter sets given
    at run time (replica/runtime_adapters.py). On a cluster the run
    started they would go with the cluster; on an existing cluster (launchers/ray.py) they would stay for good."""
    registry.withdraw_all(app)
    peers.withdraw_all(app)
    runtime_adapters.clear(app)
