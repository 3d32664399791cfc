"""SIGTERM while a plain `run` starts (issue 56): at each point of a start - the Ray head just up (the driver
attaching to it), Serve deploying, the engine starting - the run stops exactly what it started, leaves no state file
and exits 143, nothing of its Ray session left. A second SIGTERM, a Ctrl-C and a SIGHUP during that teardown are
noted, not obeyed. While it starts, nothing under its exp_dir can be read or entered by another user (`runuser -u
nobody`), Ray's own directories (0777) included: the exp_dir is short, so Ray's temp dir is <exp_dir>/ray."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from flagscale.cluster.processes import session_members
from flagscale.net import port_open
from tests.conftest import (
    REPO,
    default_sigint,
    end_run_process,
    llama_cpp_node,
    note_state_sessions,
    wait_for,
    write_config,
)

PORT = 18655


def _engine_log_exists(exp_dir: Path, _output: str) -> bool:
    return any((exp_dir / "serve_logs").glob("engine-*.log"))


# When to send SIGTERM: a condition on the exp_dir and the run's output so far.
POINTS = {
    "ray head up": lambda exp_dir, output: "Ray head up at" in output,
    "deploying": lambda exp_dir, output: "deploying [" in output,
    "engine starting": _engine_log_exists,
}


@pytest.fixture
def short_exp_dir():
    """An exp_dir short enough for Ray's temp dir to be <exp_dir>/ray, under a directory every user may enter (as a
    working directory often is): only the exp_dir's own mode keeps others out."""
    base = Path(tempfile.mkdtemp(prefix="fs", dir="/tmp"))
    base.chmod(0o755)
    yield base / "e"
    shutil.rmtree(base, ignore_errors=True)


def open_to_nobody(exp_dir: Path) -> list[str]:
    """The paths under exp_dir (itself included) that user nobody can read, or enter when a directory."""
    paths = [str(exp_dir)]
    for root, dirs, files in os.walk(exp_dir):
        paths += [os.path.join(root, name) for name in dirs + files]
    check = 'for p; do if [ -d "$p" ]; then test -x "$p" && echo "$p"; else test -r "$p" && echo "$p"; fi; done'
    done = subprocess.run(
        ["runuser", "-u", "nobody", "--", "sh", "-c", check, "sh", *paths], capture_output=True, text=True, timeout=120
    )
    return done.stdout.split()


def private_files(exp_dir: Path) -> list[str]:
    """The run's own files and every regular file under exp_dir that others may read or write (umask 077)."""
    wide = []
    for root, _dirs, files in os.walk(exp_dir):
        for name in files:
            path = os.path.join(root, name)
            mode = os.lstat(path).st_mode
            if os.path.isfile(path) and not os.path.islink(path) and mode & 0o077:
                wide.append(f"{path} {oct(mode & 0o777)}")
    return wide


@pytest.mark.parametrize("point", list(POINTS))
def test_sigterm_while_a_run_starts_stops_everything_it_started(tmp_path, short_exp_dir, point):
    can_check_users = os.geteuid() == 0 and shutil.which("runuser") is not None
    exp_dir = short_exp_dir
    conf = write_config(tmp_path / "conf", [llama_cpp_node("sig")], exp_dir, PORT)
    out_path = tmp_path / "run.out"
    with open(out_path, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, str(REPO / "run.py"), "--config-path", str(conf), "--config-name", "serve"],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            preexec_fn=default_sigint,
        )
    sessions: set[int] = set()

    def reached() -> bool:
        note_state_sessions(exp_dir, sessions)
        return POINTS[point](exp_dir, out_path.read_text()) or proc.poll() is not None

    try:
        wait_for(reached, 600, f"the start to reach '{point}'", interval=0.1)
        assert proc.poll() is None, out_path.read_text()
        if can_check_users:  # while it starts: Ray's dirs (0777) are there, inside the exp_dir
            assert not open_to_nobody(exp_dir), open_to_nobody(exp_dir)
            assert not private_files(exp_dir), private_files(exp_dir)
        proc.send_signal(signal.SIGTERM)
        if point == "deploying":  # signals during the teardown: noted, not a second teardown nor an end to it
            wait_for(lambda: "stopping what was started" in out_path.read_text(), 60, "the teardown to begin")
            for again in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                proc.send_signal(again)
                time.sleep(0.5)
        proc.wait(timeout=300)
    finally:
        end_run_process(proc, conf, exp_dir)
    output = out_path.read_text()
    assert sessions, output
    left = wait_for(
        lambda: not [p for s in sessions for p in session_members(s)], 60, "no process of the run's Ray session"
    )
    assert left and proc.returncode == 128 + signal.SIGTERM, output
    assert "stopped everything this run started" in output and "Aborted" not in output, output
    assert not (exp_dir / "state.json").exists() and not port_open("127.0.0.1", PORT)
    if point == "deploying":
        assert output.count("already stopping what was started") == 3, output
    if can_check_users:
        assert not open_to_nobody(exp_dir) and not private_files(exp_dir), private_files(exp_dir)


ATTACH_ON_A_THREAD = """
import os, signal, sys, tempfile, threading, time
import ray
from flagscale.cluster.driver_signals import keeping_signal_handlers

got = []
signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))
temp_dir = sys.argv[1]

def attach():  # as a teardown attaches: on a bounded worker thread (cluster/bounded.py)
    with keeping_signal_handlers():
        ray.init(num_cpus=1, include_dashboard=False, _temp_dir=temp_dir, logging_level="ERROR")

thread = threading.Thread(target=attach)
thread.start()
thread.join()
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(5)  # absl's handler would have aborted the process 3 s after the signal
print("handled by the run" if got == [signal.SIGTERM] else f"not handled: {got}", flush=True)
ray.shutdown()
"""


def test_a_driver_attached_on_a_thread_keeps_the_runs_sigterm(tmp_path):
    """Ray's core worker would install absl's failure-signal handler process-wide, from whichever thread attaches:
    a SIGTERM then aborts the process 3 s later (exit 134), whatever Python handler the run has."""
    temp_dir = tempfile.mkdtemp(prefix="fsd", dir="/tmp")  # short: Ray's socket paths
    try:
        done = subprocess.run(
            [sys.executable, "-c", ATTACH_ON_A_THREAD, temp_dir], capture_output=True, text=True, timeout=180, cwd=REPO
        )
    finally:
        stop_processes_of(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)
    # what is tested: the run's handler got the signal and nothing aborted the process. (Its exit status after that
    # is ray.shutdown's: on a busy machine the local cluster's GCS may be gone before the driver disconnects, and
    # the core worker then exits 1.)
    assert "handled by the run" in done.stdout, (done.returncode, done.stdout, done.stderr)
    assert done.returncode not in (128 + signal.SIGABRT, -signal.SIGABRT), (done.returncode, done.stderr)
    assert "SIGTERM received" not in done.stderr, done.stderr


def stop_processes_of(temp_dir: str) -> None:
    """The Ray processes the test's driver started (their command lines name its own temp dir), if any are left."""
    import psutil

    mine = [p for p in psutil.process_iter(["cmdline"]) if temp_dir in " ".join(p.info["cmdline"] or ())]
    for proc in mine:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(mine, timeout=30)
