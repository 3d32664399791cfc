"""Failures after start: the cause from Ray/vLLM is printed, what was started is stopped, exit != 0."""

from __future__ import annotations

import subprocess
import sys

from flagscale.cluster.processes import session_members
from tests.conftest import REPO, demo_engine_args, llama_cpp_node, note_state_sessions, run_cli, wait_for, write_config

PORT = 18611


def start_run(conf) -> subprocess.Popen:
    """`run` as a process this test watches while it starts (its output: stdout, stderr merged)."""
    argv = [sys.executable, str(REPO / "run.py"), "--config-path", str(conf), "--config-name", "serve"]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)


def run_and_expect_failure(tmp_path, nodes):
    exp_dir = tmp_path / "exp"
    conf = write_config(tmp_path / "conf", nodes, exp_dir, PORT)
    result = run_cli(conf, timeout=600)
    assert result.returncode != 0, result.output
    assert "stopped everything this run started" in result.output
    assert not (exp_dir / "state.json").exists()
    return result.output, exp_dir


def test_engine_that_fails_to_start_reports_vllms_cause(tmp_path):
    nodes = [{"serve_id": "broken", "engine": "vllm", "engine_args": demo_engine_args(max_model_len=4096)}]
    out, exp_dir = run_and_expect_failure(tmp_path, nodes)
    assert "deployment broken" in out
    assert "max_model_len (4096) is greater than the derived max_model_len" in out
    # Serve may have started a second attempt before the run stopped it: the failed one's log holds the cause.
    logs = list((exp_dir / "serve_logs").glob("engine-broken-*.log"))
    assert any("max_model_len" in log.read_text() for log in logs), logs


def test_replica_that_no_node_can_hold_is_reported_with_the_arithmetic(tmp_path):
    nodes = [
        {
            "serve_id": "pinned",
            "engine": "vllm",
            "engine_args": demo_engine_args(),
            "resources": {"accelerator": "chipB"},
        }
    ]
    out, exp_dir = run_and_expect_failure(tmp_path, nodes)
    assert "a replica of 'pinned' needs" in out and "accelerator_type:chipB" in out and "CPU:2" in out
    head_log = (exp_dir / "serve_logs" / "ray-head.log").read_text()
    assert "Ray runtime started" in head_log


def test_failed_run_leaves_no_process(tmp_path):
    nodes = [
        {
            "serve_id": "pinned",
            "engine": "vllm",
            "engine_args": demo_engine_args(),
            "resources": {"accelerator": "chipB"},
        }
    ]
    exp_dir = tmp_path / "exp"
    conf = write_config(tmp_path / "conf", nodes, exp_dir, PORT)
    # Watch the state file the run writes as soon as it launches Ray, to learn the session it must stop.
    proc = start_run(conf)
    sessions: set[int] = set()

    def exited_noting_sessions() -> bool:
        note_state_sessions(exp_dir, sessions)
        return proc.poll() is not None

    wait_for(exited_noting_sessions, 300, "the failing run to exit")
    out = proc.communicate(timeout=60)[0]
    assert proc.returncode != 0, out
    assert sessions, "the run should have recorded the Ray session it started"
    assert not [p for s in sessions for p in session_members(s)]


def test_a_second_deployment_on_the_port_is_refused_when_the_router_binds(tmp_path):
    """The run checks the port before it starts anything; a listener that comes after that check (another
    deployment's router, which shares the port with SO_REUSEPORT) is found by the router right after it binds."""
    exp_dir = tmp_path / "exp"
    conf = write_config(tmp_path / "conf", [llama_cpp_node("demo")], exp_dir, PORT)
    # The other deployment: a socket on the same port with SO_REUSEPORT, opened once the run has checked the port
    # and launched Ray (its state file), before Serve starts the router. Its process is started first and waits
    # for the word, so that binding is a step of microseconds, not a Python start on a busy machine.
    listen = (
        "import socket, sys, time\n"
        "sys.stdin.readline()\n"
        "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)\n"
        f"s.bind(('127.0.0.1', {PORT})); s.listen(); print('listening', flush=True); time.sleep(600)\n"
    )
    other = subprocess.Popen([sys.executable, "-c", listen], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    run = start_run(conf)
    try:
        wait_for(lambda: (exp_dir / "state.json").exists() or run.poll() is not None, 300, "the run to launch Ray")
        assert run.poll() is None, run.communicate(timeout=60)[0]
        other.stdin.write("bind\n")
        other.stdin.flush()
        assert other.stdout.readline().strip() == "listening"
        out = run.communicate(timeout=600)[0]
        assert run.returncode != 0, out
        assert f"port {PORT} is served by another deployment too" in out and f"pid {other.pid}" in out, out
        assert "stopped everything this run started" in out
    finally:
        other.kill()
        other.wait(30)
        if run.poll() is None:
            run.kill()
