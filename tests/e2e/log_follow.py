"""`action=logs` output read back, and `action=logs follow=true` running in the background as from a terminal."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

from tests.conftest import REPO

# A suite run as a background job (`cmd &` in a non-interactive shell) hands its children SIGINT ignored, and a
# Python started so never raises KeyboardInterrupt: the follower is exec'd with SIGINT at its default, as a
# terminal gives it, so that Ctrl-C is tested wherever the suite runs.
AS_FROM_A_TERMINAL = (
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execv(sys.argv[1], sys.argv[1:])"
)


def sections(stdout: str) -> dict[str, str]:
    """{header line: the text under it} of `action=logs` output."""
    found: dict[str, str] = {}
    header = None
    for line in stdout.splitlines():
        if line.startswith("==> ") and line.endswith(" <=="):
            header = line
            found[header] = ""
        elif header is not None:
            found[header] += line + "\n"
    return found


def header(replica: dict) -> str:
    """The header `action=logs` prints above a replica's log (a replica as `action=status output=json` lists it)."""
    return (
        f"==> serve_id {replica['serve_id']}, replica {replica['replica_id']}, host {replica['host']}: "
        f"{replica['log']} <=="
    )


class Follow:
    """`action=logs follow=true ...` running in the background; its output collected as it comes."""

    def __init__(self, conf, *overrides: str):
        argv = [str(REPO / "run.py"), "--config-path", str(conf), "--config-name", "serve"]
        argv += ["action=logs", "follow=true", *overrides]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200"}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", AS_FROM_A_TERMINAL, sys.executable, *argv],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.out: list[str] = []
        self.err: list[str] = []
        self._readers = [
            threading.Thread(target=lambda: self.out.extend(self.proc.stdout), daemon=True),
            threading.Thread(target=lambda: self.err.extend(self.proc.stderr), daemon=True),
        ]
        for reader in self._readers:
            reader.start()

    @property
    def stdout(self) -> str:
        return "".join(self.out)

    @property
    def stderr(self) -> str:
        return "".join(self.err)

    @property
    def started(self) -> bool:
        return "Ctrl-C" in self.stderr  # its "following ... (Ctrl-C ends it)" line

    def wait(self, timeout: float) -> int:
        code = self.proc.wait(timeout=timeout)
        for reader in self._readers:
            reader.join(timeout=10)
        return code

    def interrupt(self, timeout: float = 90) -> int:
        """Ctrl-C, and its exit code; a follower still running `timeout` s later fails with its threads' stacks."""
        self.proc.send_signal(signal.SIGINT)
        try:
            return self.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"not exited {timeout} s after Ctrl-C:\n{stacks(self.proc.pid)}\n{self.stderr}"
            ) from None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def stacks(pid: int) -> str:
    """Every thread's stack in process `pid` (py-spy, native frames included)."""
    argv = [str(Path(sys.executable).with_name("py-spy")), "dump", "--native", "--pid", str(pid)]
    try:
        dump = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"(py-spy dump failed: {exc})"
    return dump.stdout + dump.stderr
