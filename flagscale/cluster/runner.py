"""Commands on a host, this machine or one reached over SSH, behind one interface (after SkyPilot's
`sky/utils/command_runner.py`): run an argv, start a detached session and learn its id, copy a file, make a
directory, stop a session, close.

Every argv stays a list up to the last step: a local one goes to exec as it is, a remote one crosses SSH as
one shlex-quoted string (ssh.remote_command). A session is a new process session (setsid) whose id, the
leader's PID, names every process started under it and nothing else on that host (cluster/processes.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from flagscale.cluster import ssh
from flagscale.cluster.processes import read_process, session_members, stop_session
from flagscale.cluster.ray_env import project_root
from flagscale.cluster.tempdirs import UnsafeDirectory, ensure_dir_in_private_parent
from flagscale.errors import ClusterError

# The minimal wrapper around a remote session's argv: print our session id and the leader's start time in clock
# ticks (/proc/<pid>/stat field 22, the PID-reuse guard), run argv with its output in a log, print the log (so a
# failure's stderr comes back), exit with argv's code. argv arrives as positional parameters.
LAUNCHER = (
    'echo "$$ $(awk \'{sub(/^.*\\) /, ""); print $20}\' /proc/$$/stat 2>/dev/null)"; '
    'log=$1; shift; "$@" >"$log" 2>&1 </dev/null; code=$?; cat "$log"; exit "$code"'
)
STOP_TIMEOUT_S = 60
LOG_TAIL_LINES = 12

Result = ssh.Result


class CommandTimeout(ClusterError):
    """A command ran past its bound; it was ended on its host where that is possible. `output`: what it printed."""

    def __init__(self, message: str, where: str | None = None, output: str = ""):
        super().__init__(message, where)
        self.message = message
        self.output = output


@dataclass
class Session:
    """A detached session started by a runner: its id and the leader's start ticks are known before it finishes."""

    id: int
    start_ticks: int | None
    _wait: Callable[[], Result]

    def wait(self) -> Result:
        """Wait for the session's leader (argv) to exit, within the bound given at start; CommandTimeout past it.
        Result.stdout holds the tail of its output."""
        return self._wait()


class CommandRunner(ABC):
    host: str  # the host as the hostfile names it; "localhost" for this machine
    remote: bool

    def open(self) -> None:
        """Make sure the host can be reached now (SSH: connect); a ClusterError names the host and why."""

    @abstractmethod
    def run(self, argv: list[str], env: dict[str, str] | None = None, timeout_s: float | None = None) -> Result:
        """Run argv to its end (env on top of the host's); CommandTimeout / ClusterError past timeout_s."""

    @abstractmethod
    def start_session(self, argv: list[str], env: dict[str, str], log_path: str, timeout_s: float) -> Session:
        """Start argv as the leader of a new session, its output in log_path on that host; return once its id is
        known. The session's processes outlive this runner."""

    @abstractmethod
    def put_file(self, local: Path, remote: str, mode: int = 0o600) -> None:
        """Copy a small file, created with `mode` before any byte is written (for secrets)."""

    @abstractmethod
    def make_dir(self, path: str) -> None:
        """Create a directory whose parent is private to this user (0700, checked: cluster/tempdirs.py);
        ClusterError naming the culprit when the parent or it belongs to someone else."""

    @abstractmethod
    def stop_session(self, session: int, leader_start_ticks: int | None) -> list[int]:
        """SIGTERM, then SIGKILL, exactly the processes of `session` (nothing when its leader's PID was reused).
        Returns the PIDs still alive afterwards."""

    def close(self) -> None:
        pass

    def __enter__(self) -> CommandRunner:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class LocalRunner(CommandRunner):
    """This machine: subprocesses in new sessions, env on top of os.environ."""

    remote = False

    def __init__(self, host: str = "localhost"):
        self.host = host

    def run(self, argv: list[str], env: dict[str, str] | None = None, timeout_s: float | None = None) -> Result:
        # Output through a file, not a pipe, so a background process argv leaves behind cannot hold the wait open;
        # a new session, so a timeout ends everything argv started.
        with tempfile.TemporaryFile() as out:
            proc = subprocess.Popen(
                argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **(env or {})},
                start_new_session=True,
            )
            try:
                code = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):  # the group may be gone already
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                out.seek(0)
                raise CommandTimeout(
                    f"{argv[0]} did not finish within {timeout_s:g}s (killed)",
                    self.host,
                    out.read().decode(errors="replace"),
                ) from None
            out.seek(0)
            return Result(code, out.read().decode(errors="replace"), "")

    def start_session(self, argv: list[str], env: dict[str, str], log_path: str, timeout_s: float) -> Session:
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as out:
            proc = subprocess.Popen(
                argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **env},
                start_new_session=True,
            )
        info = read_process(proc.pid)

        def wait() -> Result:
            try:
                code = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                raise CommandTimeout(f"did not finish within {timeout_s:.0f}s; see {log_path}", self.host) from None
            return Result(code, _tail(Path(log_path).read_text(errors="replace")), "")

        return Session(proc.pid, info.start_ticks if info else None, wait)

    def put_file(self, local: Path, remote: str, mode: int = 0o600) -> None:
        fd = os.open(remote, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(Path(local).read_bytes())

    def make_dir(self, path: str) -> None:
        try:
            ensure_dir_in_private_parent(path)
        except UnsafeDirectory as exc:
            raise ClusterError(str(exc), self.host) from None

    def stop_session(self, session: int, leader_start_ticks: int | None) -> list[int]:
        stop_session(session, leader_start_ticks)
        return session_members(session, leader_start_ticks)


class SshRunner(CommandRunner):
    """A host over SSH (flagscale.cluster.ssh: ssh config, host keys, ProxyJump); one connection, opened lazily."""

    remote = True

    def __init__(self, host: str, settings: ssh.SshSettings):
        self.host = host
        self.settings = settings
        self._client = None

    @property
    def address(self) -> str:
        """The address the host is reached at (its HostName in the ssh config file, else its name)."""
        return ssh.resolve(self.host, self.settings).hostname

    def open(self) -> None:
        if self._client is None:
            self._client = ssh.connect(self.host, self.settings)

    @property
    def client(self):
        self.open()
        return self._client

    def run(self, argv: list[str], env: dict[str, str] | None = None, timeout_s: float | None = None) -> Result:
        return ssh.run(self.client, argv, env, timeout_s=timeout_s)

    def start_session(self, argv: list[str], env: dict[str, str], log_path: str, timeout_s: float) -> Session:
        stdout, stderr = ssh.start(self.client, session_argv(argv, log_path), env, timeout_s=timeout_s)

        def rest() -> str:
            return stdout.read().decode(errors="replace") + stderr.read().decode(errors="replace")

        try:
            first = stdout.readline().strip()
            words = first.split()
            if not words or not words[0].isdigit():
                raise ClusterError(f"could not start a new session: {(first + chr(10) + rest()).strip()}", self.host)
        except TimeoutError:
            raise CommandTimeout(f"no session id within {timeout_s:g}s", self.host) from None
        ticks = int(words[1]) if len(words) > 1 and words[1].isdigit() else None

        def wait() -> Result:
            try:
                output = rest()
            except TimeoutError:
                raise CommandTimeout(
                    f"did not finish within {timeout_s:.0f}s; see {log_path} there", self.host
                ) from None
            return Result(stdout.channel.recv_exit_status(), _tail(output), "")

        return Session(int(words[0]), ticks, wait)

    def put_file(self, local: Path, remote: str, mode: int = 0o600) -> None:
        ssh.put_file(self.client, Path(local), remote, mode)

    def make_dir(self, path: str) -> None:
        argv = [sys.executable, "-m", "flagscale.cluster.tempdirs", path]
        result = self.run(argv, {"PYTHONPATH": project_root()}, timeout_s=STOP_TIMEOUT_S)
        if result.code != 0:
            raise ClusterError(f"cannot use {path}: {(result.stderr or result.stdout).strip()}", self.host)

    def stop_session(self, session: int, leader_start_ticks: int | None) -> list[int]:
        argv = [sys.executable, "-m", "flagscale.cluster.processes", "stop", str(session)]
        if leader_start_ticks is not None:
            argv.append(str(leader_start_ticks))
        result = self.run(argv, {"PYTHONPATH": project_root()}, timeout_s=STOP_TIMEOUT_S)
        try:
            return list(json.loads(result.stdout.strip().splitlines()[-1])["left"])
        except (IndexError, KeyError, TypeError, ValueError):
            raise ClusterError(
                f"`processes stop {session}` exited with {result.code}: {result.stdout.strip()} "
                f"{result.stderr.strip()}",
                self.host,
            ) from None

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None


def session_argv(argv: list[str], log_path: str) -> list[str]:
    """What a remote session runs: argv as the leader of a new session, wrapped in LAUNCHER."""
    return ["setsid", "-w", "sh", "-c", LAUNCHER, "flagscale-launch", log_path, *argv]


def runner_for(host: str, remote: bool, settings: ssh.SshSettings | None = None) -> CommandRunner:
    """The runner for a host a run recorded: SSH for remote hosts, this machine otherwise."""
    return SshRunner(host, settings or ssh.SshSettings()) if remote else LocalRunner(host)


def parallel(items: list, fn: Callable) -> list:
    """fn over items in threads; each item's result, or the exception it raised, in the items' order."""
    if not items:
        return []
    with ThreadPoolExecutor(max_workers=min(32, len(items))) as pool:
        futures = [pool.submit(fn, item) for item in items]
    return [f.exception() if f.exception() is not None else f.result() for f in futures]


def _tail(text: str) -> str:
    return "\n".join(text.strip().splitlines()[-LOG_TAIL_LINES:])
