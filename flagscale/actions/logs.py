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

import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from rich.console import Console

from flagscale import launchers
from flagscale.actions.context import ActionContext
from flagscale.actions.runner_log import LOG_DIR, RUNNER_LOG
from flagscale.cluster import ssh
from flagscale.cluster.node_logs import EngineLog, engine_logs_here
from flagscale.cluster.ray_node import cluster_alive
from flagscale.cluster.runner import CommandRunner, runner_for
from flagscale.cluster.state import HostRecord, RunState
from flagscale.errors import ClusterError, ConfigError, FlagScaleError
from flagscale.replica import registry

POLL_S = 1.0  # follow: how often each log is asked for new lines
ALIVE_EVERY_S = 3.0  # follow: how often the deployment is checked (stopped: follow ends) and new engine logs looked for
READ_TIMEOUT_S = 30.0  # one read of one log, on its host
MAX_READ_BYTES = 1 << 20  # follow: at most this much of one log per poll (a burst is caught up over the next polls)
TAIL_WINDOW_BYTES = 4 << 20  # the last lines are looked for in the file's last 4 MiB

TAIL_FIRST_BYTES = 64 << 10  # the first look for the last lines; grown 4x at a time up to TAIL_WINDOW_BYTES


@dataclass(frozen=True)
class LogSource:
    """One log file: the runner's (serve_id None) or an engine replica's."""

    path: str
    serve_id: str | None = None
    replica_id: str | None = None
    host: str = "localhost"  # where the file is: the replica's node IP, or the hostfile host's name
    ssh_host: str | None = None  # the hostfile host to read it over SSH when it is not readable here
    role: str = ""
    unlisted: bool = False  # a running deployment's engine log that its registry does not list (starting, or gone)
    node_id: str | None = None  # the Ray node it is on (its launcher may read it there: Launcher.node_runner)

    @property
    def name(self) -> str:
        return f"{self.serve_id}/{self.replica_id}" if self.serve_id else "runner"

    def header(self) -> str:
        if self.serve_id is None:
            return f"==> runner log ({self.host}): {self.path} <=="
        role = f" ({self.role})" if self.role else ""
        note = " [not in the registry: starting, or gone]" if self.unlisted else ""
        return f"==> serve_id {self.serve_id}{role}, replica {self.replica_id}, host {self.host}: {self.path}{note} <=="


def parse_engine_log_name(name: str) -> tuple[str, str] | None:
    """engine-<serve_id>-<replica>.log -> (serve_id, replica). A serve_id may hold '-'; Serve's replica ids do not."""
    if not (name.startswith("engine-") and name.endswith(".log")):
        return None
    serve_id, sep, replica = name[len("engine-") : -len(".log")].rpartition("-")
    if not (sep and serve_id and replica):
        return None
    return serve_id, replica


def engine_log_files(log_dir: Path, since: float | None = None) -> list[LogSource]:
    """The engine logs in log_dir (modified at or after `since`, when given), oldest first."""
    return log_sources(engine_logs_here(log_dir), since)


def log_sources(engine_logs: list[EngineLog], since: float | None = None) -> list[LogSource]:
    """Engine logs as sources to read (modified at or after `since`, when given: unlisted), oldest first."""
    found = []
    for log in engine_logs:
        parsed = parse_engine_log_name(os.path.basename(log.path))
        if parsed and (since is None or log.mtime >= since):
            unlisted = since is not None
            found.append((log.mtime, LogSource(log.path, *parsed, log.host, unlisted=unlisted, node_id=log.node_id)))
    return [source for _, source in sorted(found, key=lambda item: item[0])]


def registry_sources(state: RunState, records) -> list[LogSource]:
    """The registry's replicas (ReplicaRecord), each with the hostfile host it runs on (multi-host: SSH reads)."""
    by_node = {h.node_id: h for h in state.hosts if h.node_id}
    by_ip = {h.node_ip: h for h in state.hosts if h.node_ip}
    sources = []
    for r in sorted(records, key=lambda r: (r.serve_id, r.replica_id)):
        host: HostRecord | None = by_node.get(r.node_id) or by_ip.get(r.node_ip)
        remote = host is not None and host.remote
        shown = f"{r.node_ip} ({host.host})" if remote and host.host != r.node_ip else r.node_ip
        sources.append(
            LogSource(
                r.log_path,
                r.serve_id,
                r.replica_id,
                shown,
                host.host if remote else None,
                r.role or "",
                node_id=r.node_id,
            )
        )
    return sources


def _serve_id_matches(source: LogSource, serve_id: str) -> bool:
    # A disaggregated node <id> is served by two pools, <id>-prefill and <id>-decode.
    return source.serve_id in (serve_id, f"{serve_id}-prefill", f"{serve_id}-decode")


def select(sources: list[LogSource], serve_id: str | None = None, replica: str | None = None) -> list[LogSource]:
    """The engine logs that serve_id / replica name (a replica: its id, or a prefix of one id only). An unknown or
    ambiguous one is a ConfigError listing the valid choices."""
    engines = [s for s in sources if s.serve_id is not None]
    if serve_id is not None:
        chosen = [s for s in engines if _serve_id_matches(s, serve_id)]
        if not chosen:
            known = sorted({s.serve_id for s in engines if s.serve_id})
            raise ConfigError(
                f"no engine replica of serve_id '{serve_id}'; "
                + (f"serve_ids with logs: {', '.join(known)}" if known else "there are no engine logs"),
                "serve_id",
            )
        engines = chosen
    if replica is None:
        return engines
    exact = [s for s in engines if s.replica_id == replica]
    matches = exact or [s for s in engines if s.replica_id and s.replica_id.startswith(replica)]
    if len(matches) == 1:
        return matches
    listing = ", ".join(s.name for s in engines) or "none"
    scope = f" of serve_id '{serve_id}'" if serve_id is not None else ""
    if not matches:
        raise ConfigError(f"no engine replica{scope} matches '{replica}'; replicas: {listing}", "replica")
    raise ConfigError(
        f"'{replica}' matches {len(matches)} replicas ({', '.join(s.name for s in matches)}); give more of the id",
        "replica",
    )


@dataclass
class Chunk:
    offset: int  # the byte offset read up to
    text: str
    truncated: bool = False  # the file is shorter than the offset asked for: it was truncated or replaced


def size_argv(path: str) -> list[str]:
    """The file's size in bytes, as `wc -c` prints it (the first word)."""
    return ["wc", "-c", "--", path]


def bytes_argv(path: str, start: int, count: int) -> list[str]:
    """`count` bytes of the file from byte `start` (fewer where it ends)."""
    return [
        "dd",
        f"if={path}",
        "bs=1M",
        "iflag=skip_bytes,count_bytes",
        f"skip={start}",
        f"count={count}",
        "status=none",
    ]


def last_lines(text: str, count: int) -> str:
    """The last `count` lines of text, as `tail -n` gives them."""
    if count <= 0 or not text:
        return ""
    ends_whole = text.endswith("\n")
    kept = (text[:-1] if ends_whole else text).split("\n")[-count:]
    return "\n".join(kept) + ("\n" if ends_whole else "")


@dataclass
class Follower:
    """One log being read: where it stands, and the line it is part-way through (printed once it is whole)."""

    source: LogSource
    offset: int | None = None
    partial: str = ""
    problem: str | None = None  # the last read failure, printed once
    gone: bool = False  # printed "not readable" once; stays quiet until it reads again


@dataclass
class Readers:
    """One CommandRunner per host, opened on first use (an SSH connection kept for follow's polls)."""

    settings: ssh.SshSettings = field(default_factory=ssh.SshSettings)
    # (node id, host) -> the runner of a Ray node (the run's Launcher.node_runner): logs read there, not here or over SSH
    node_runner: Callable[[str, str], CommandRunner] | None = None
    _runners: dict[str, CommandRunner] = field(default_factory=dict)

    def runner(self, source: LogSource) -> CommandRunner:
        if source.node_id and self.node_runner:
            if source.node_id not in self._runners:
                self._runners[source.node_id] = self.node_runner(source.node_id, source.host)
            return self._runners[source.node_id]
        remote = source.ssh_host is not None and not os.access(source.path, os.R_OK)
        key = source.ssh_host if remote else "localhost"
        if key not in self._runners:
            self._runners[key] = runner_for(key, remote, self.settings)
        return self._runners[key]

    def read(self, source: LogSource, offset: int | None, lines: int) -> Chunk:
        """The last `lines` lines of the log as it is now (offset None), else what follows `offset`, at most
        MAX_READ_BYTES; Chunk.offset is where the text ends. A file shorter than `offset` is truncated."""
        runner = self.runner(source)
        size = int(self._run(runner, source.path, size_argv(source.path)).split()[0])
        if offset is None:
            return Chunk(size, self._tail(runner, source.path, size, lines))
        if size < offset:
            return Chunk(size, "", truncated=True)
        end = min(size, offset + MAX_READ_BYTES)
        text = self._run(runner, source.path, bytes_argv(source.path, offset, end - offset)) if end > offset else ""
        return Chunk(end, text)

    def _tail(self, runner: CommandRunner, path: str, size: int, lines: int) -> str:
        """The last `lines` lines before byte `size`, looked for in a window from the end that grows until it holds
        them (or is TAIL_WINDOW_BYTES, or the whole file): a long log's last lines without reading all of it."""
        window = TAIL_FIRST_BYTES
        while True:
            start = max(0, size - min(window, TAIL_WINDOW_BYTES))
            text = self._run(runner, path, bytes_argv(path, start, size - start)) if size > start else ""
            if text.count("\n") > lines or start == 0 or window >= TAIL_WINDOW_BYTES:
                return last_lines(text, lines)
            window *= 4

    @staticmethod
    def _run(runner: CommandRunner, path: str, argv: list[str]) -> str:
        result = runner.run(argv, timeout_s=READ_TIMEOUT_S)
        if result.code != 0:
            why = (result.stderr or result.stdout).strip().splitlines()
            raise ClusterError(f"cannot read {path}: {why[-1] if why else f'exit code {result.code}'}")
        return result.stdout

    def close(self) -> None:
        for runner in self._runners.values():
            runner.close()
        self._runners.clear()


class Printer:
    """Writes logs' text under their headers (stdout); a header again whenever the text comes from another log, as
    tail -f does. Notes (follow's progress, read problems) go to stderr, so the logs can be piped."""

    def __init__(self, out=None, notes: Console | None = None):
        self.out = out or sys.stdout
        self.notes = notes or Console(stderr=True, highlight=False, soft_wrap=True)
        self.current: LogSource | None = None

    def header(self, source: LogSource) -> None:
        if self.current is not None:
            self.out.write("\n")
        self.out.write(source.header() + "\n")
        self.out.flush()
        self.current = source

    def text(self, source: LogSource, text: str) -> None:
        if not text:
            return
        if self.current != source:
            self.header(source)
        self.out.write(text if text.endswith("\n") else text + "\n")
        self.out.flush()

    def note(self, message: str) -> None:
        self.out.flush()
        self.notes.print(message, markup=False, style="yellow", soft_wrap=True)


def _running(exp_dir: str) -> RunState | None:
    state = RunState.load(exp_dir)
    return state if state is not None and cluster_alive(state) else None


def discover(exp_dir: str, state: RunState | None, note: Callable[[str], None]) -> list[LogSource]:
    """The runner log (when present) and every engine log: the registry's and the log dir's (see the module doc)."""
    log_dir = Path(exp_dir) / LOG_DIR
    runner_log = log_dir / RUNNER_LOG
    sources = [LogSource(str(runner_log))] if runner_log.is_file() else []
    if state is None:
        return sources + engine_log_files(log_dir)
    launcher = launchers.of_state(state)
    try:
        with launcher.reading_registry(state):
            live = registry_sources(state, registry.list_replicas(state.app_name, include_stale=True))
            known = {s.replica_id for s in live}
            extra = [s for s in new_engine_logs(state, log_dir) if s.replica_id not in known]
    except Exception as exc:  # noqa: BLE001 - the log files are still worth showing
        note(f"cannot read the replica registry ({exc}); showing the engine logs under {log_dir}")
        return sources + [replace(s, unlisted=False) for s in engine_log_files(log_dir, since=state.started_at)]
    return sources + live + extra


def new_engine_logs(state: RunState, log_dir: Path) -> list[LogSource]:
    """The run's engine logs wherever its launcher keeps them, modified since the run started, oldest first."""
    return log_sources(launchers.of_state(state).engine_logs(state, str(log_dir)), state.started_at)


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
        state = _running(exp_dir)
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
        stopped = time.monotonic() >= next_check and _running(exp_dir) is None
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
                if source.path not in known and (serve_id is None or _serve_id_matches(source, serve_id)):
                    printer.note(f"new engine log: {source.name}")
                    followers.append(Follower(source, offset=0))


def act(ctx: ActionContext) -> int:
    c = ctx.config
    return logs(ctx.exp_dir, ctx.console, c.serve_id, c.replica, c.follow, c.lines)
