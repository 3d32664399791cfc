"""The exp_dir lock (flagscale/cluster/lock.py): a second holder is refused at once with the first one named; a
holder that died leaves the lock free."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from flagscale.cluster.lock import ExpDirBusy, ExpDirLock
from tests.conftest import REPO, wait_for

HOLD = """
import sys, time
from flagscale.cluster.lock import ExpDirLock
lock = ExpDirLock(sys.argv[1], "run").acquire()
print("held", flush=True)
time.sleep(600)
"""


def holder(exp_dir) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(exp_dir)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_holder_is_refused_at_once_naming_the_first(tmp_path):
    proc = holder(tmp_path)
    try:
        started = time.monotonic()
        with pytest.raises(ExpDirBusy) as refused:
            ExpDirLock(tmp_path, "stop").acquire()
        assert time.monotonic() - started < 1
        message = str(refused.value)
        assert f"pid {proc.pid}" in message and "action=run" in message and str(tmp_path) in message
        assert time.strftime("%Y-%m-%d") in message
    finally:
        proc.kill()
        proc.wait()


def test_a_holder_that_died_leaves_the_lock_free(tmp_path):
    proc = holder(tmp_path)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    with ExpDirLock(tmp_path, "run") as lock:
        assert lock.path.exists()
    # and released again once the holder is done
    wait_for(lambda: ExpDirLock(tmp_path, "stop").acquire().release() is None, 5, "the lock to be free")


def test_an_attached_run_is_named_with_how_to_stop_it(tmp_path):
    with ExpDirLock(tmp_path, "run") as lock:
        lock.describe(foreground=True)
        code = (
            "import sys\nfrom flagscale.cluster.lock import ExpDirLock\n"
            "try:\n    ExpDirLock(sys.argv[1], 'stop').acquire()\nexcept Exception as exc:\n    print(exc)"
        )
        out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=REPO, capture_output=True, text=True)
    assert f"pid {os.getpid()}" in out.stdout and "foreground=true" in out.stdout
    assert f"kill -INT {os.getpid()}" in out.stdout, out.stdout + out.stderr


def test_the_lock_is_not_inherited_by_processes_the_holder_starts(tmp_path):
    with ExpDirLock(tmp_path, "run"):
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        ExpDirLock(tmp_path, "run").acquire().release()
    finally:
        child.kill()
        child.wait()
