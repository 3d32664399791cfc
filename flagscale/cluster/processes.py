"""Track and stop exactly the processes we started, by session id, never by name.

Every process tree this project starts on a host is launched as the leader of a new session
(`setsid`). Ray's daemons, workers and the vLLM servers they spawn inherit that session, so the
session id recorded at launch names all of them and nothing else on the host.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from dataclasses import dataclass

import psutil

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
GONE = (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)


@dataclass(frozen=True)
class ProcessInfo:
    pid: int
    ppid: int
    session: int
    start_ticks: int  # clock ticks from boot to the process's start (/proc/<pid>/stat field 22): guards PID reuse


def read_process(pid: int) -> ProcessInfo | None:
    """The live process `pid` (None when it does not exist or is a zombie)."""
    try:
        proc = psutil.Process(pid)
        with proc.oneshot():
            if proc.status() in GONE:
                return None
            # create_time() is boot time + start ticks; the difference is immune to wall-clock changes.
            ticks = round((proc.create_time() - psutil.boot_time()) * CLOCK_TICKS)
            return ProcessInfo(pid=pid, ppid=proc.ppid(), session=os.getsid(pid), start_ticks=ticks)
    except (psutil.Error, ProcessLookupError):
        return None


def leader_pid_reused(session: int, leader_start_ticks: int | None) -> bool:
    """True when a process that started at another time than the recorded leader now holds the session's PID.
    The kernel hands a PID out again only once no process is left in the session it names, so then that
    session has ended and whatever runs under this id is someone else's."""
    if leader_start_ticks is None:
        return False
    leader = read_process(session)
    return leader is not None and leader.start_ticks != leader_start_ticks


def session_members(session: int, leader_start_ticks: int | None = None) -> list[int]:
    """Live processes of `session`; none when its leader's PID was reused (given the leader's recorded start)."""
    if leader_pid_reused(session, leader_start_ticks):
        return []
    members = []
    for pid in psutil.pids():
        try:
            if os.getsid(pid) == session and psutil.Process(pid).status() not in GONE:
                members.append(pid)
        except (psutil.Error, ProcessLookupError):
            continue
    return sorted(members)


def signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


# A Ray node's daemons, in the order `ray stop` ends them: the raylet first (its agents fate-share with it), the GCS
# last. Sent SIGTERM all at once, the raylet, the GCS and the runtime env agent each wait out the whole grace period.
FIRST, LAST = ("raylet",), ("gcs_server",)


def stop_session(session: int, leader_start_ticks: int | None, grace_s: float = 10.0) -> list[int]:
    """SIGTERM the leader if it still runs (`ray start` usually exited once its daemons were up), then everyone
    left in the session, a Ray node's raylet first and its GCS last, then SIGKILL after the grace period. Returns
    the PIDs that had to be killed.

    `leader_start_ticks`: the leader's `ProcessInfo.start_ticks` as recorded at launch (None: unknown, no
    guard). When the leader's PID now belongs to a process started at another time, the session has ended
    and nothing is signalled."""
    if leader_pid_reused(session, leader_start_ticks):
        return []
    deadline = time.monotonic() + grace_s
    if read_process(session) is not None:
        signal_all([session], signal.SIGTERM)
        _wait_gone(lambda: read_process(session) is None, deadline - time.monotonic())

    def members() -> list[int]:
        return session_members(session, leader_start_ticks)

    first, rest, last = _in_stop_order(members())
    for bucket, share in ((first, 1 / 3), (rest, 1 / 2), (last, 1.0)):
        signal_all(bucket, signal.SIGTERM)
        alive = set(bucket)
        _wait_gone(lambda alive=alive: not alive & set(members()), share * (deadline - time.monotonic()))
    signal_all(members(), signal.SIGTERM)  # any started meanwhile (a worker the raylet was spawning)
    _wait_gone(lambda: not members(), deadline - time.monotonic())
    left = members()
    signal_all(left, signal.SIGKILL)
    # a killed process is gone once the kernel has torn it down: quick, but a starved machine takes seconds to
    # unmap an engine's gigabytes; returned as soon as none is left
    _wait_gone(lambda: not members(), 30)
    return left


def _in_stop_order(pids: list[int]) -> tuple[list[int], list[int], list[int]]:
    """(raylets, everything else, GCS servers) of `pids`, by process name: these are our own session's processes."""
    first, rest, last = [], [], []
    for pid in pids:
        try:
            name = psutil.Process(pid).name()
        except psutil.Error:
            continue
        (first if name in FIRST else last if name in LAST else rest).append(pid)
    return first, rest, last


def _wait_gone(done, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if done():
            return
        time.sleep(0.1)


def main(argv: list[str]) -> int:
    """`python -m flagscale.cluster.processes stop <session> [<leader_start_ticks>]`: what `stop` runs on a remote
    host over SSH (the ticks, when the launch recorded them, guard against a reused leader PID).
    Prints one JSON line {"killed": [...], "left": [...]}; exit 0 when nothing of the session is left."""
    if len(argv) not in (2, 3) or argv[0] != "stop" or not all(a.isdigit() for a in argv[1:]):
        print("usage: python -m flagscale.cluster.processes stop <session-id> [<leader-start-ticks>]", file=sys.stderr)
        return 2
    session = int(argv[1])
    ticks = int(argv[2]) if len(argv) == 3 else None
    killed = stop_session(session, ticks)
    left = session_members(session, ticks)
    print(json.dumps({"killed": killed, "left": left}))
    return 0 if not left else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
