"""Track and stop exactly the processes we started, by session id, never by name.

Every process tree this project starts on a host is launched as the leader of a new session
(`setsid`). Ray's daemons, workers and the vLLM servers they spawn inherit that session, so the
session id recorded at launch names all of them and nothing else on the host.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class ProcessInfo:
    pid: int
    ppid: int
    session: int
    start_ticks: int  # /proc/<pid>/stat field 22: guards against PID reuse


def read_process(pid: int) -> ProcessInfo | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
    except OSError:
        return None
    # comm (field 2) may contain spaces and parens: split after the last ')'.
    fields = stat[stat.rindex(")") + 2 :].split()
    state = fields[0]
    if state in ("Z", "X"):
        return None
    return ProcessInfo(pid=pid, ppid=int(fields[1]), session=int(fields[3]), start_ticks=int(fields[19]))


def live_processes() -> list[ProcessInfo]:
    infos = (read_process(int(entry)) for entry in os.listdir("/proc") if entry.isdigit())
    return [info for info in infos if info is not None]


def session_members(session: int) -> list[int]:
    return sorted(info.pid for info in live_processes() if info.session == session)


def signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def stop_session(session: int, leader_start_ticks: int | None, grace_s: float = 10.0) -> list[int]:
    """SIGTERM the leader (Ray's `--block` launcher cleans up its children), then everyone left in the
    session, then SIGKILL after the grace period. Returns the PIDs that had to be killed."""
    leader = read_process(session)
    if leader is not None and leader_start_ticks is not None and leader.start_ticks != leader_start_ticks:
        leader = None  # PID reused by an unrelated process: leave it alone
    if leader is not None:
        signal_all([session], signal.SIGTERM)
        _wait_gone(lambda: read_process(session) is None, grace_s)
    signal_all(session_members(session), signal.SIGTERM)
    _wait_gone(lambda: not session_members(session), grace_s)
    left = session_members(session)
    signal_all(left, signal.SIGKILL)
    _wait_gone(lambda: not session_members(session), 5)
    return left


def _wait_gone(done, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if done():
            return
        time.sleep(0.1)


def main(argv: list[str]) -> int:
    """`python -m flagscale.cluster.processes stop <session>`: what `stop` runs on a remote host over SSH.
    Prints one JSON line {"killed": [...], "left": [...]}; exit 0 when nothing of the session is left."""
    import json

    if len(argv) != 2 or argv[0] != "stop" or not argv[1].isdigit():
        print("usage: python -m flagscale.cluster.processes stop <session-id>", file=sys.stderr)
        return 2
    session = int(argv[1])
    killed = stop_session(session, None)
    left = session_members(session)
    print(json.dumps({"killed": killed, "left": left}))
    return 0 if not left else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
