"""cmds.after_stop: run after the Ray nodes are stopped on each host that ran before_start; a failure is reported
(host and exit code), never a reason for `stop` to fail."""

from __future__ import annotations

import io
import time
from pathlib import Path

from rich.console import Console

from flagscale.actions import teardown as td
from flagscale.actions.stop import stop
from flagscale.cluster import ssh
from flagscale.cluster.state import HostRecord, RunState
from flagscale.errors import ClusterError
from flagscale.net import free_port


def state_with(tmp_path, snippet, hosts=None, envs=None, host_envs=None, ssh_settings=None) -> RunState:
    extra = {"after_stop": {"snippet": snippet, "envs": envs or {}, "host_envs": host_envs or {}}}
    if ssh_settings is not None:
        extra["ssh"] = ssh_settings
    return RunState(
        app_name="t",
        exp_dir=str(tmp_path / "exp"),
        endpoint=f"http://127.0.0.1:{free_port()}",
        ray_address=f"127.0.0.1:{free_port()}",
        token_path=None,
        hosts=hosts or [HostRecord(host="localhost", role="head")],
        extra=extra,
    )


def log_text(state: RunState) -> str:
    return (Path(state.exp_dir) / "serve_logs" / "after_stop.log").read_text()


def test_snippet_that_succeeds_runs_with_the_runs_envs(tmp_path):
    marker = tmp_path / "marker"
    state = state_with(tmp_path, f'echo "$WORD" > {marker}; echo said it', envs={"WORD": "hello"})
    assert td.run_after_stop(state) == []
    assert marker.read_text() == "hello\n"
    assert "=== localhost" in log_text(state) and "exit code 0" in log_text(state) and "said it" in log_text(state)


def test_envs_come_from_the_caller_not_the_state_file(tmp_path):
    """The state file records no env values (they may be secrets): stop passes its config's (issue 19)."""
    marker = tmp_path / "marker"
    state = state_with(tmp_path, f'echo "$HF_TOKEN" > {marker}')
    state.extra["after_stop"] = {"snippet": state.extra["after_stop"]["snippet"]}
    assert td.run_after_stop(state, env_for=lambda host: {"HF_TOKEN": "from-config"}) == []
    assert marker.read_text() == "from-config\n"


def test_failing_snippet_is_one_line_naming_host_and_code(tmp_path):
    state = state_with(tmp_path, "echo cleaning up; exit 3")
    lines = td.run_after_stop(state)
    assert len(lines) == 1
    assert lines[0].startswith("localhost: cmds.after_stop failed with exit code 3")
    assert "after_stop.log" in lines[0]
    assert "cleaning up" in log_text(state) and "exit code 3" in log_text(state)


def test_snippet_past_its_timeout_is_killed_and_reported(tmp_path):
    marker = tmp_path / "late"
    state = state_with(tmp_path, f"sleep 30; touch {marker}")
    t0 = time.monotonic()
    lines = td.run_after_stop(state, timeout_s=0.5)
    assert time.monotonic() - t0 < 10
    assert len(lines) == 1 and "localhost" in lines[0] and "timed out after 0.5s" in lines[0]
    assert not marker.exists()


def test_nothing_recorded_nothing_run(tmp_path):
    state = state_with(tmp_path, None)
    assert td.after_stop_hosts(state) == [] and td.run_after_stop(state) == []
    state.extra = {}
    assert td.run_after_stop(state) == []


def test_remote_hosts_over_ssh_each_reported_by_name(tmp_path, monkeypatch):
    hosts = [HostRecord(host=h, role="head" if h == "h1" else "worker", remote=True) for h in ("h1", "h2", "h3")]
    hosts.append(HostRecord(host="localhost", role="driver"))  # the driver node never ran before_start
    host_envs = {"h1": {"A": "1"}, "h2": {"A": "2"}, "h3": {"A": "3"}}
    state = state_with(
        tmp_path, "cleanup", hosts=hosts, envs={"A": "0"}, host_envs=host_envs, ssh_settings={"port": 2222}
    )
    calls = {}

    class Client:
        def __init__(self, host):
            self.host = host

        def close(self):
            pass

    def connect(host, settings):
        assert settings.port == 2222
        if host == "h2":
            raise ClusterError("SSH to h2:2222 timed out after 10s", host)
        return Client(host)

    def run(client, argv, env=None, timeout_s=None):
        calls[client.host] = (argv, env, timeout_s)
        return ssh.Result(3 if client.host == "h1" else 0, "out\n", "")

    monkeypatch.setattr(td.ssh, "connect", connect)
    monkeypatch.setattr(td.ssh, "run", run)
    lines = td.run_after_stop(state, timeout_s=120)
    assert sorted(calls) == ["h1", "h3"]
    argv, env, timeout_s = calls["h1"]
    assert argv == ["timeout", "-k", "5", "120", "bash", "-c", "cleanup"] and env == {"A": "1"} and timeout_s > 120
    assert len(lines) == 2
    assert lines[0].startswith("h1: cmds.after_stop failed with exit code 3")
    assert lines[1].startswith("h2: cmds.after_stop not run: host unreachable (SSH to h2:2222 timed out")
    assert "=== h3" in log_text(state) and "=== localhost" not in log_text(state)


def test_stop_reports_a_failing_after_stop_and_still_completes(tmp_path):
    state = state_with(tmp_path, "exit 3", hosts=[HostRecord(host="localhost", role="head", session=None)])
    state.save()
    out = io.StringIO()
    code = stop(state.exp_dir, Console(file=out, width=200, highlight=False), 0)
    assert code == 0, out.getvalue()
    assert "localhost: cmds.after_stop failed with exit code 3" in out.getvalue()
    assert RunState.load(state.exp_dir) is None
