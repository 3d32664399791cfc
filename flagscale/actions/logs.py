"""`action=logs`: the runner's log and each engine replica's log, each under a header naming it, without hunting in
exp_dir; `serve_id=` / `replica=` narrow it down, `follow=true` keeps printing new lines until Ctrl-C or until the
deployment is stopped.

Which replicas: a running deployment's come from the replica registry (as `status` lists them), plus the engine logs
in <exp_dir>/serve_logs/ written since the run started that the registry does not hold (a replica still starting,
or one that is gone); a stopped deployment's from the engine-<serve_id>-<replica>.log files left there.

Every log is read through its host's CommandRunner (cluster/runner.py) with plain argvs (`wc -c` for its size, `dd`
for a byte range): this machine's when the file is readable here, else the SSH runner of the hostfile host the replica
ran on (or its launcher's runner on the Ray node). Each read knows the byte offset it read up to, so `follow` asks
each log only for what came after.
"""

from __future__ import annotations

import time
from pathlib import Path

from rich.console import Console

from flagscale import launchers
from flagscale.actions.context import ActionContext
from flagscale.actions.log_reading import Follower, Printer, Readers
from flagscale.actions.log_sources import (
    LogSource,
    discover,
    new_engine_logs,
    running_state_of,
    select,
    serve_id_matches,
)
from flagscale.actions.runner_log import LOG_DIR
from flagscale.cluster import ssh
from flagscale.cluster.state import RunState
from flagscale.errors import FlagScaleError

POLL_S = 1.0  # follow: how often each log is asked for new lines
ALIVE_EVERY_S = 3.0  # follow: how often the deployment is checked (stopped: follow ends) and new engine logs looked for


def logs(
    exp_dir: str,
    console: Console,
    serve_id: str | None = None,
    replica: str | None = None,
    follow: bool = False,
    lines: int = 50,
) -> int:
    """Print the selected logs' last `lines` lines; with follow, then their new lines until Ctrl-C or the stop."""
    try:
        printer = Printer()
        state = running_state_of(exp_dir)
        sources = discover(exp_dir, state, printer.note)
        if not sources:
            what = "nothing is running" if state is None else "the deployment has written no logs yet"
            console.print(f"{what} for exp_dir {exp_dir}, and there are no logs under {Path(exp_dir) / LOG_DIR}")
            return 1
        filtered = serve_id is not None or replica is not None
        chosen = select(sources, serve_id, replica) if filtered else sources
        readers = Readers(
            ssh.SshSettings(**(state.extra.get("ssh", {}) if state else {})),
            node_runner=launchers.of_state(state).node_runner(state) if state else None,
        )
        try:
            return _show(exp_dir, state, chosen, readers, printer, lines, follow, replica is None, serve_id)
        finally:
            readers.close()
    except KeyboardInterrupt:
        return 0


def _show(
    exp_dir: str,
    state: RunState | None,
    chosen: list[LogSource],
    readers: Readers,
    printer: Printer,
    lines: int,
    follow: bool,
    watch_new: bool,
    serve_id: str | None,
) -> int:
    keep_partial = follow and state is not None  # a line being written is printed once it is whole
    followers = [Follower(s) for s in chosen]
    for f in followers:
        text = _poll(readers, f, lines, keep_partial)
        printer.header(f.source)
        if f.offset is None:
            printer.note(f"  cannot read it: {f.problem}")
        elif text:
            printer.text(f.source, text)
        elif f.offset == 0:
            printer.note("  (empty)")
    if not any(f.offset is not None for f in followers):
        return 1
    if not follow:
        return 0
    if state is None:
        printer.note(f"nothing is running for exp_dir {exp_dir}: these logs are complete, nothing to follow")
        return 0
    return _follow(exp_dir, state, printer, readers, followers, watch_new, serve_id)


def _poll(readers: Readers, f: Follower, lines: int, keep_partial: bool) -> str:
    """What is new in f's log ('' when nothing is, or when it could not be read: then f.problem says why). The first
    read of a log (f.offset None) gives its last `lines` lines. keep_partial: a last line without its newline yet
    is held back until it is whole."""
    try:
        chunk = readers.read(f.source, f.offset, lines)
    except (FlagScaleError, OSError, ValueError) as exc:
        f.problem = str(exc)
        return ""
    f.problem = None
    if chunk.truncated:  # rotated or truncated: start over from its beginning at the next poll
        f.offset, f.partial = 0, ""
        f.problem = f"{f.source.path} was truncated; reading it again from its start"
        return ""
    f.offset = chunk.offset
    text = f.partial + chunk.text
    if not keep_partial:
        f.partial = ""
        return text
    whole, newline, f.partial = text.rpartition("\n")
    return whole + newline


def _follow(
    exp_dir: str,
    state: RunState,
    printer: Printer,
    readers: Readers,
    followers: list[Follower],
    watch_new: bool,
    serve_id: str | None,
) -> int:
    """Poll every log for new lines until Ctrl-C (KeyboardInterrupt, caught by the caller) or until the deployment
    is stopped (checked every ALIVE_EVERY_S). watch_new (no replica= filter): engine logs that appear in the log dir
    meanwhile (new replicas) are followed from their first line."""
    log_dir = Path(exp_dir) / LOG_DIR
    printer.note(f"following {len(followers)} log(s) until the deployment stops; Ctrl-C to stop earlier")
    next_check = time.monotonic() + ALIVE_EVERY_S
    while True:
        time.sleep(POLL_S)
        stopped = time.monotonic() >= next_check and running_state_of(exp_dir) is None
        for f in followers:
            before = f.problem
            text = _poll(readers, f, 0, keep_partial=not stopped)
            printer.text(f.source, text)
            if f.problem and f.problem != before:
                printer.note(f"{f.source.name}: {f.problem}")
        if stopped:
            printer.note(f"the deployment of exp_dir {exp_dir} is stopped; no more lines will come")
            return 0
        if time.monotonic() < next_check:
            continue
        next_check = time.monotonic() + ALIVE_EVERY_S
        if watch_new:
            known = {f.source.path for f in followers}
            for source in new_engine_logs(state, log_dir):
                if source.path not in known and (serve_id is None or serve_id_matches(source, serve_id)):
                    printer.note(f"new engine log: {source.name}")
                    followers.append(Follower(source, offset=0))


def act(ctx: ActionContext) -> int:
    c = ctx.config
    return logs(ctx.exp_dir, ctx.console, c.serve_id, c.replica, c.follow, c.lines)
