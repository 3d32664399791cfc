"""Stopping a session by id, on real processes: what was recorded at launch decides what may be signalled."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from flagscale.cluster.processes import leader_pid_reused, read_process, session_members, stop_session
from tests.conftest import wait_for

# A session leader with one more member: `sh` waits on a background `sleep`.
SESSION = ["sh", "-c", "sleep 60 & wait"]


def start_session() -> subprocess.Popen:
    proc = subprocess.Popen(SESSION, start_new_session=True)
    wait_for(lambda: len(session_members(proc.pid)) == 2, 10, f"session {proc.pid} with its leader and one child")
    return proc


def kill_session(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(5)


def test_start_ticks_are_the_kernels():
    with open(f"/proc/{os.getpid()}/stat", "rb") as f:
        stat = f.read().decode()
    assert read_process(os.getpid()).start_ticks == int(stat[stat.rindex(")") + 2 :].split()[19])


def test_session_whose_leader_pid_now_belongs_to_another_process_is_not_touched():
    # What the state file recorded: the start of a leader that has since exited ...
    earlier = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    recorded_ticks = read_process(earlier.pid).start_ticks
    earlier.kill()
    earlier.wait()
    time.sleep(0.05)  # a few clock ticks: whatever starts now starts at a later tick
    # ... and the process that holds the session's PID now (a PID reused by the kernel is just that).
    other = start_session()
    try:
        assert read_process(other.pid).start_ticks != recorded_ticks
        assert leader_pid_reused(other.pid, recorded_ticks)
        assert session_members(other.pid, recorded_ticks) == []
        assert stop_session(other.pid, recorded_ticks, grace_s=1) == []
        time.sleep(0.3)
        assert other.poll() is None, "the unrelated leader was signalled"
        assert len(session_members(other.pid)) == 2, "members of the unrelated session were signalled"
    finally:
        kill_session(other)


def test_session_whose_leader_is_the_recorded_one_is_stopped():
    proc = start_session()
    try:
        ticks = read_process(proc.pid).start_ticks
        assert not leader_pid_reused(proc.pid, ticks)
        assert stop_session(proc.pid, ticks, grace_s=5) == []  # SIGTERM was enough
        assert session_members(proc.pid) == []
        assert proc.wait(5) is not None
    finally:
        kill_session(proc)


def test_session_whose_leader_exited_is_still_stopped_by_its_members():
    """`ray start` exits once its daemons run: the leader is gone, the session id still names the rest."""
    proc = subprocess.Popen(["sh", "-c", "sleep 60 & read line"], stdin=subprocess.PIPE, start_new_session=True)
    ticks = read_process(proc.pid).start_ticks
    proc.stdin.close()  # the leader exits; its background child stays in the session
    proc.wait(5)
    try:
        wait_for(lambda: len(session_members(proc.pid)) == 1, 10, f"the leftover member of session {proc.pid}")
        stop_session(proc.pid, ticks, grace_s=5)
        assert session_members(proc.pid) == []
    finally:
        for pid in session_members(proc.pid):
            os.kill(pid, signal.SIGKILL)
