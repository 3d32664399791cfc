"""An engine server's processes as the replica runs them: their env, their process group (started under
engine_proc, stopped as one), and their log (where it is written, and why the server died, read from it).
The replica's own server (replica/engine.py) and the ranks it runs on other hosts (replica/host_ranks.py) share these.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil

from flagscale.errors import error_excerpt
from flagscale.secrets import mask_argv, mask_env

NODE_LOG_DIR = "ray-node-logs"  # EngineSpec.log_dir: under the replica's node's Ray session logs (runner.type: ray)


def cause_from_log(path: Path) -> str:
    """The lines of an engine log that say why the server died (its error and what follows), or "(no log)"."""
    try:
        return error_excerpt(path.read_text(errors="replace"), after=2, fallback=10)
    except OSError:
        return "(no log)"


class LogWatch:
    """Reads a log as it grows, from its start, and says whether a line holding one of `needles` is in it (a line
    written in two parts is still found: a partial last line is read again with what follows it)."""

    def __init__(self, path: Path, needles: tuple[str, ...]) -> None:
        self._path, self._needles = path, needles
        self._offset, self._partial = 0, ""

    def found(self) -> str | None:
        """The first line not read before that holds a needle, or None."""
        if not self._needles:
            return None
        try:
            with open(self._path, "rb") as log:
                log.seek(self._offset)
                chunk = log.read()
        except OSError:
            return None
        self._offset += len(chunk)
        *lines, self._partial = (self._partial + chunk.decode(errors="replace")).split("\n")
        return next((line.strip() for line in (*lines, self._partial) if any(n in line for n in self._needles)), None)


def engine_env(user_env: dict[str, str]) -> dict[str, str]:
    """The replica's env minus the thread caps Ray puts on actors (OMP_NUM_THREADS=num_cpus): the engine sizes
    its own CPU threads, exactly as when it runs alone. The user's envs win over both."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS",)}
    return {**env, **user_env}


def spawn_engine(argv: list[str], log, env: dict[str, str]) -> subprocess.Popen:
    """The engine_proc wrapper as the leader of a process group of its own, which its engine server and that
    server's children (engine core, workers) join: `terminate_engine` can then kill all of them at once. A new
    group, not a new session: `stop` finds the run's processes by their session (docs/design.md)."""
    return subprocess.Popen(
        argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, process_group=0
    )


def start_watched(argv: list[str], env: dict[str, str], shown_env: dict[str, str], log_path: Path) -> subprocess.Popen:
    """`argv` under engine_proc, which keeps it from outliving the replica if the replica is killed outright, as the
    leader of a process group of its own (spawn_engine), its output appended to `log_path`. The command line is
    written to the log first with `shown_env` only: `env` (the full env, secrets included) is not shown."""
    wrapped = [sys.executable, "-m", "flagscale.replica.engine_proc", *argv]
    with open(log_path, "ab") as log:
        shown = " ".join(f"{k}={v}" for k, v in mask_env(shown_env).items())
        log.write(f"$ {shown} {' '.join(mask_argv(wrapped))}\n".encode())
        log.flush()
        return spawn_engine(wrapped, log, env)


def terminate_engine(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM to the wrapper, which forwards it to the server (one SIGTERM: a second one would make uvicorn skip
    its graceful shutdown); then, after the wrapper's exit or `grace_s`, SIGKILL to whatever is left of its
    process group. (The group's id stays taken while any member lives, so it cannot name another's group.)"""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:  # the whole group is gone already
        pass
    proc.wait(5)


def listens_on(pid: int, port: int) -> bool:
    """Whether the process `pid` or one of its descendants holds a listening TCP socket on `port`: the server
    answering there is the one this replica started, not something that took the port first (it would get the
    key with every request). A process that holds the listening socket is the only one the port's connections
    reach (another could share it only with SO_REUSEPORT, and only as the same user)."""
    try:
        root = psutil.Process(pid)
        family = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return False
    for process in family:
        try:
            sockets = process.net_connections(kind="tcp")
        except psutil.Error:  # exited meanwhile, or not ours to inspect
            continue
        if any(s.status == psutil.CONN_LISTEN and s.laddr and s.laddr.port == port for s in sockets):
            return True
    return False
