"""A plain `run` (not foreground) stopped by SIGTERM or SIGHUP while it starts tears down what it started, as
Ctrl-C does, leaves no state file and exits non-zero; a full disk while state.json or history.csv is written is one
clear error, with what was started stopped. Real processes and signals; the launcher is a stand-in that starts
nothing (its launch records that it ran and waits)."""

from __future__ import annotations

import errno
import signal
import subprocess
import sys
import textwrap

import pytest
from rich.console import Console

from flagscale.cluster import state as state_module
from flagscale.cluster.state import RunState
from flagscale.errors import FlagScaleError, WriteError
from tests.conftest import default_sigint, wait_for

SCRIPT = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path

    from rich.console import Console

    from flagscale.actions import run as run_action
    from flagscale.config.load import ConfigSources, load_config
    from flagscale.plan import build_plan

    exp_dir, model = sys.argv[1], sys.argv[2]
    config = {
        "experiment": {
            "exp_name": "t", "exp_dir": exp_dir, "task": {"type": "serve"},
            "runner": {"hostfile": None, "deploy": {"port": 18997}},
        },
        "serve": [{"serve_id": "m", "engine_args": {"model": model, "max_model_len": 64}}],
        "action": "run",
    }
    plan = build_plan(load_config(config, ConfigSources()), ConfigSources(), check_port=False)

    real = run_action.launchers.get(plan.launcher)

    class StandIn:
        def __getattr__(self, name): return getattr(real, name)
        def auth_token(self, plan): return None
        def check_free(self, plan): pass
        def host_envs(self, plan): return {}
        def launch(self, state, plan, console):
            state.save()  # phase "starting", as a launcher records what it started
            Path(exp_dir, "started").touch()
            time.sleep(120)

    run_action.launchers.get = lambda name: StandIn()
    def teardown(state, console, drain_timeout_s=0, env_for=None):
        Path(exp_dir, "tearing-down").touch()
        time.sleep(float(sys.argv[3]))  # a teardown that takes a while: the test may signal again meanwhile
        Path(exp_dir, "torn-down").write_text(RunStateFile.read_text())
        return []
    RunStateFile = Path(exp_dir, "state.json")
    run_action.teardown = teardown
    sys.exit(run_action.run(plan, Console()))
    """
)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_and_sighup_tear_down_what_run_started(tmp_path, demo_model_path, signum):
    exp_dir = tmp_path / "exp"
    proc = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, str(exp_dir), str(demo_model_path), "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        wait_for(lambda: (exp_dir / "started").exists() or proc.poll() is not None, 60, "the stand-in launch")
        assert proc.poll() is None, proc.communicate()[0]
        proc.send_signal(signum)
        output, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signum, output
    assert '"phase": "starting"' in (exp_dir / "torn-down").read_text()  # teardown saw what was started
    assert not RunState.path(exp_dir).exists()  # no state left "starting"
    assert "Traceback" not in output and signal.Signals(signum).name in output, output


def test_a_second_sigterm_or_a_ctrl_c_during_the_teardown_is_noted_and_the_teardown_finishes(tmp_path, demo_model_path):
    exp_dir = tmp_path / "exp"
    proc = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, str(exp_dir), str(demo_model_path), "4"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=default_sigint,
    )
    try:
        wait_for(lambda: (exp_dir / "started").exists() or proc.poll() is not None, 60, "the stand-in launch")
        proc.send_signal(signal.SIGTERM)
        wait_for(lambda: (exp_dir / "tearing-down").exists() or proc.poll() is not None, 30, "the teardown to begin")
        for again in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            proc.send_signal(again)
        output, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM, output
    assert (exp_dir / "torn-down").exists() and not RunState.path(exp_dir).exists(), output
    assert output.count("already stopping what was started") == 3, output
    assert "stopped everything this run started" in output and "Traceback" not in output, output


def test_ray_init_does_not_take_the_runs_handlers(tmp_path):
    """`ray.init` under keeping_signal_handlers sets no SIGTERM handler of Ray's, is not cut short by a SIGTERM, and
    that SIGTERM reaches the run's handler after it. (absl's handler, below Python, needs a real driver:
    tests/e2e/test_run_signals.py.)"""
    code = textwrap.dedent(
        """
        import os, signal, sys
        import ray._private.utils
        from flagscale.cluster.driver_signals import keeping_signal_handlers

        got = []
        signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))
        with keeping_signal_handlers():
            ray._private.utils.set_sigterm_handler(lambda signum, frame: sys.exit(15))  # what ray.init does
            os.kill(os.getpid(), signal.SIGTERM)  # held: ray.init is not cut short, the run gets it after
            assert not got
        print("handled by the run" if got == [signal.SIGTERM] else f"not handled: {got}")
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "handled by the run", done.stdout + done.stderr


def test_a_full_disk_while_state_json_is_written_is_one_clear_error_and_stops_what_was_started(
    tmp_path, demo_model_path, monkeypatch
):
    from flagscale.actions import run as run_action
    from flagscale.config.load import ConfigSources, load_config
    from flagscale.plan import build_plan

    exp_dir = tmp_path / "exp"
    config = {
        "experiment": {
            "exp_name": "t",
            "exp_dir": str(exp_dir),
            "task": {"type": "serve"},
            "runner": {"hostfile": None, "deploy": {"port": 18996}},
        },
        "serve": [{"serve_id": "m", "engine_args": {"model": str(demo_model_path), "max_model_len": 64}}],
        "action": "run",
    }
    plan = build_plan(load_config(config, ConfigSources()), ConfigSources(), check_port=False)
    torn_down = []
    real = run_action.launchers.get(plan.launcher)

    class StandIn:
        def __getattr__(self, name):
            return getattr(real, name)

        def auth_token(self, plan):
            return None

        def check_free(self, plan):
            pass

        def host_envs(self, plan):
            return {}

        def launch(self, state, plan, console):
            state.save()
            return "started"

    def full_disk(f, text):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(run_action.launchers, "get", lambda name: StandIn())
    monkeypatch.setattr(run_action, "teardown", lambda state, *a, **k: torn_down.append(state.phase) or [])
    for step in ("connect", "check_fits", "deploy", "wait_until_serving"):
        monkeypatch.setattr(run_action, step, lambda *a, **k: None)
    # the first save (phase "starting") is written; the one that records "running" finds the disk full
    monkeypatch.setattr(
        run_action, "wait_until_serving", lambda *a: monkeypatch.setattr(state_module, "_write_file", full_disk)
    )
    with pytest.raises(WriteError) as error:
        run_action.run(plan, Console(file=open("/dev/null", "w")))
    assert isinstance(error.value, FlagScaleError)
    assert str(RunState.path(exp_dir)) in str(error.value) and "the disk is full" in str(error.value)
    assert torn_down and not RunState.path(exp_dir).exists()
    assert not list(exp_dir.glob("*.tmp"))


def test_a_full_disk_while_history_csv_is_written_is_one_clear_error(tmp_path, monkeypatch):
    from flagscale.tune import history

    path = tmp_path / "auto_tuner" / "history.csv"
    history.write(path, ["instance"], [{"instance": 1, "status": "done"}])
    before = path.read_text()

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(history, "write_private", full_disk)
    with pytest.raises(WriteError, match="the disk is full") as error:
        history.write(path, ["instance"], [{"instance": 2, "status": "done"}])
    assert str(path) in str(error.value)
    assert path.read_text() == before and not path.with_suffix(".csv.tmp").exists()


def test_after_a_hang_up_a_console_that_cannot_write_does_not_stop_the_teardown():
    from flagscale.actions.console import WritesOrNot

    class HungUp:
        def write(self, text):
            raise OSError(errno.EIO, "Input/output error")

        def flush(self):
            raise OSError(errno.EIO, "Input/output error")

    console = Console(file=WritesOrNot(HungUp()))
    console.print("stopping what was started")  # no OSError
