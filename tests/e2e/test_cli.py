"""The installed `flagscale` command for real, from a directory outside the checkout: its help and errors, then one
real `flagscale serve demo` (FlagScale's --port, --model-path and --engine-args on the way) -> a completion ->
the CPU layout of vLLM's default process tree -> `--status` -> `--stop`. Every example's dryrun is tests/e2e/test_examples.py."""

from __future__ import annotations

import contextlib
import json
import os
import urllib.request

import psutil
import pytest

from flagscale.cluster.processes import session_members
from tests.conftest import flagscale_command, run_flagscale, wait_for
from tests.e2e.cpu_layout_check import wait_for_cpu_layout

PORT = 19391


def test_the_console_script_is_installed():
    assert flagscale_command()[0].endswith("flagscale"), "no flagscale script beside this Python: run `make setup`"


def test_help_and_errors(tmp_path):
    help_ = run_flagscale("--help", cwd=tmp_path, timeout=60)
    assert help_.returncode == 0 and "serve" in help_.stdout and "run" in help_.stdout, help_.output
    serve_help = run_flagscale("serve", "--help", cwd=tmp_path, timeout=60)
    for flag in ("--stop", "--test", "--tune", "--status", "--logs", "--dryrun", "--bench", "--port", "--model-path"):
        assert flag in serve_help.stdout, flag
    unknown = run_flagscale("serve", "no_such_model", cwd=tmp_path, timeout=60)
    assert unknown.returncode == 2 and "serve no_such_model: no example of that name" in unknown.stderr, unknown.output
    bad_json = run_flagscale("serve", "demo", "--engine-args", "{oops", cwd=tmp_path, timeout=60)
    assert bad_json.returncode == 2 and "--engine-args: not valid JSON" in bad_json.stderr, bad_json.output


@pytest.fixture(scope="module")
def served(tmp_path_factory, demo_model_path):
    cwd = tmp_path_factory.mktemp("cli")
    common = ("--port", str(PORT), f"experiment.exp_dir={cwd / 'exp'}")
    result = run_flagscale(
        "serve",
        "demo",
        "--model-path",
        str(demo_model_path),
        "--engine-args",
        json.dumps({"max_num_seqs": 4, "served_model_name": "cli-demo"}),
        *common,
        cwd=cwd,
        timeout=900,
    )
    try:
        yield {"cwd": cwd, "common": common, "run": result}
    finally:
        if (cwd / "exp" / "state.json").exists():  # a test failed before the stop test ran
            run_flagscale("serve", "demo", "--stop", *common, cwd=cwd, timeout=300)


def test_serve_demo_serves_with_the_flags_applied(served):
    assert served["run"].returncode == 0, served["run"].output

    def models():
        with urllib.request.urlopen(f"http://127.0.0.1:{PORT}/v1/models", timeout=10) as resp:
            return [m["id"] for m in json.load(resp)["data"]]

    assert wait_for(models, 60, "/v1/models") == ["cli-demo"]
    body = json.dumps({"model": "cli-demo", "prompt": "hello", "max_tokens": 4}).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{PORT}/v1/completions", body, {"content-type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as resp:
        assert json.load(resp)["choices"][0]["text"] is not None


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="vLLM binds its CPU worker to a subset only with 2+ cores")
def test_cpu_engine_keeps_its_cores(served):
    """The demo runs vLLM's default process tree (its model worker in a process of its own): with
    `cpu_affinity: auto` (the default) the engine core is on its worker's cores, the API server and router off them."""
    assert served["run"].returncode == 0, served["run"].output

    def replicas() -> list[dict]:
        status = run_flagscale(
            "serve", "demo", "--status", "output=json", *served["common"], cwd=served["cwd"], timeout=120
        )
        assert status.returncode == 0, status.output
        return json.loads(status.stdout)["replicas"]

    state = json.loads((served["cwd"] / "exp" / "state.json").read_text())
    wait_for_cpu_layout(replicas, [h["session"] for h in state["hosts"]])


def serve_controller(cwd) -> psutil.Process | None:
    """The run's Serve controller: the Ray worker titled ray::ServeController in the session of the run's Ray node."""
    session = json.loads((cwd / "exp" / "state.json").read_text())["hosts"][0]["session"]
    for process in psutil.process_iter(["cmdline"]):
        title = (process.info["cmdline"] or [""])[0]
        with contextlib.suppress(ProcessLookupError):
            if title.startswith("ray::ServeController") and os.getsid(process.pid) == session:
                return process
    return None


def test_status_then_stop(served):
    # A Serve controller that answers nothing (stopped with SIGSTOP): status gives up at its bound (here 20 s),
    # names the step, and exits 3 without the exit handler that would wait on the call left behind.
    controller = wait_for(lambda: serve_controller(served["cwd"]), 60, "the run's Serve controller")
    controller.suspend()
    try:
        late = run_flagscale(
            "serve", "demo", "--status", "output=json", *served["common"], cwd=served["cwd"], timeout=180,
            env={"FLAGSCALE_STATUS_TIMEOUT_S": "20"},
        )  # fmt: skip
    finally:
        controller.resume()
    assert late.returncode == 3, late.output
    report = json.loads(late.stdout)
    assert report["status"] == "NO_ANSWER" and not report["healthy"], report
    assert report["waiting_for"] == "asking Serve's controller for the application's status", report
    assert f"status: no answer within 20 s while {report['waiting_for']}" in late.stderr, late.output

    def healthy() -> dict:
        status = run_flagscale(
            "serve", "demo", "--status", "output=json", *served["common"], cwd=served["cwd"], timeout=120
        )
        assert status.returncode == 0, status.output
        return json.loads(status.stdout)

    report = wait_for(healthy, 300, "a healthy status once the controller runs again")
    assert report["healthy"] is True, report

    # A stop whose controller answers nothing: its Serve part gives up at its bound (here 12 s), names the step,
    # and still stops the run's Ray nodes (the suspended controller with them); the state file stays for a second
    # stop, which finds nothing left to drain and ends the run.
    controller = wait_for(lambda: serve_controller(served["cwd"]), 60, "the run's Serve controller")
    session = json.loads((served["cwd"] / "exp" / "state.json").read_text())["hosts"][0]["session"]
    controller.suspend()
    stuck = run_flagscale(
        "serve", "demo", "--stop", *served["common"], cwd=served["cwd"], timeout=300,
        env={"FLAGSCALE_STOP_SERVE_TIMEOUT_S": "12"},
    )  # fmt: skip
    assert stuck.returncode == 1, stuck.output
    assert "stopping the Serve application: no answer within 12 s while " in stuck.output, stuck.output

    def gone(process: psutil.Process) -> bool:
        with contextlib.suppress(psutil.NoSuchProcess):
            return process.status() == psutil.STATUS_ZOMBIE
        return True

    wait_for(lambda: gone(controller), 60, "the suspended controller to be stopped with its node")
    wait_for(lambda: not session_members(session, None), 60, f"no process left in the run's Ray session {session}")
    stopped = run_flagscale("serve", "demo", "--stop", *served["common"], cwd=served["cwd"], timeout=300)
    assert stopped.returncode == 0, stopped.output
    assert not (served["cwd"] / "exp" / "state.json").exists()
