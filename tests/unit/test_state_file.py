"""An unreadable or newer state file: one clear error naming the file and what to do, from every action;
`stop` still stops the sessions it names."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from flagscale.cluster.state import STATE_FORMAT, HostRecord, NewerStateFormat, RunState, StateFileError
from tests.conftest import run_cli, write_config


def config(tmp_path):
    exp_dir = tmp_path / "exp"
    conf = write_config(tmp_path / "conf", [{"serve_id": "a", "engine_args": {"model": "/no/model"}}], exp_dir, 18999)
    exp_dir.mkdir(exist_ok=True)
    return conf, exp_dir


def a_state(exp_dir, **fields) -> RunState:
    return RunState(app_name="a", exp_dir=str(exp_dir), endpoint="http://127.0.0.1:1", ray_address="", token_path=None)


def test_round_trip_records_the_format(tmp_path):
    state = a_state(tmp_path)
    state.hosts.append(HostRecord(host="localhost", role="head", session=12))
    state.save()
    assert json.loads(RunState.path(tmp_path).read_text())["format_version"] == STATE_FORMAT
    assert RunState.load(tmp_path) == state


def test_a_file_without_a_format_is_the_first_format(tmp_path):
    data = json.loads(json.dumps(a_state(tmp_path).__dict__))
    data.pop("format_version")
    RunState.path(tmp_path).write_text(json.dumps(data))
    assert RunState.load(tmp_path).app_name == "a"


@pytest.mark.parametrize(
    "text, said",
    [
        ("{not json", "unreadable"),
        ("[]", "not a JSON object"),
        ('{"app_name": "a"}', "exp_dir"),
        (None, "hosts.0.session"),
    ],
)
def test_unreadable_files_name_the_file_and_what_to_do(tmp_path, text, said):
    if text is None:
        state = a_state(tmp_path)
        state.save()
        data = json.loads(RunState.path(tmp_path).read_text())
        data["hosts"] = [{"host": "localhost", "role": "head", "session": "twelve"}]
        text = json.dumps(data)
    RunState.path(tmp_path).write_text(text)
    with pytest.raises(StateFileError) as error:
        RunState.load(tmp_path)
    assert str(RunState.path(tmp_path)) in str(error.value) and said in str(error.value)
    assert "action=stop" in str(error.value)


@pytest.mark.parametrize(
    "endpoint", ["http://127.0.0.1", "http://127.0.0.1:port", "127.0.0.1:8000", "http://:8000", ""]
)
def test_an_endpoint_without_host_and_port_is_one_clear_error(tmp_path, endpoint):
    data = json.loads(json.dumps(a_state(tmp_path).__dict__))
    data["endpoint"] = endpoint  # well-formed JSON of the right types
    RunState.path(tmp_path).write_text(json.dumps(data))
    with pytest.raises(StateFileError) as error:
        _ = RunState.load(tmp_path).endpoint_address
    assert "endpoint" in str(error.value) and str(RunState.path(tmp_path)) in str(error.value)
    assert "action=stop" in str(error.value)
    assert a_state(tmp_path).endpoint_address == ("127.0.0.1", 1)


@pytest.mark.parametrize("endpoint", ["http://127.0.0.1", ""])
def test_cli_status_and_stop_of_an_endpoint_without_a_port_give_no_traceback(tmp_path, endpoint):
    conf, exp_dir = config(tmp_path)
    leader = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
    try:
        data = json.loads(json.dumps(a_state(exp_dir).__dict__))
        data["endpoint"] = endpoint
        data["hosts"] = [{"host": "localhost", "role": "head", "session": leader.pid}]
        RunState.path(exp_dir).write_text(json.dumps(data))
        status = run_cli(conf, "action=status", timeout=120)
        assert status.returncode != 0 and "Traceback" not in status.output, status.output
        stop = run_cli(conf, "action=stop", timeout=120)
        assert stop.returncode == 0 and "Traceback" not in stop.output, stop.output
        assert "endpoint" in stop.output and str(RunState.path(exp_dir)) in stop.output, stop.output
        assert leader.wait(timeout=30) is not None  # the session it names is stopped all the same
    finally:
        if leader.poll() is None:
            leader.kill()
            leader.wait()


def test_a_newer_format_is_refused_with_both_versions(tmp_path):
    state = a_state(tmp_path)
    state.format_version = STATE_FORMAT + 1
    state.save()
    with pytest.raises(NewerStateFormat) as error:
        RunState.load(tmp_path)
    assert f"state format {STATE_FORMAT + 1}" in str(error.value) and f"reads up to {STATE_FORMAT}" in str(error.value)


def test_cli_status_and_run_give_one_error_without_a_traceback(tmp_path):
    conf, exp_dir = config(tmp_path)
    RunState.path(exp_dir).write_text("{not json")
    for action in ("status", "run", "logs"):
        result = run_cli(conf, f"action={action}", timeout=120)
        assert result.returncode != 0, result.output
        assert "Traceback" not in result.output and str(RunState.path(exp_dir)) in result.stderr, result.output


def test_cli_stop_stops_the_sessions_an_unreadable_file_names_and_moves_it_aside(tmp_path):
    conf, exp_dir = config(tmp_path)
    leader = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
    try:
        data = {"hosts": [{"host": "localhost", "role": "head", "session": leader.pid}, {"host": 3}], "phase": 7}
        RunState.path(exp_dir).write_text(json.dumps(data))
        result = run_cli(conf, "action=stop", timeout=120)
        assert result.returncode == 0, result.output
        assert leader.wait(timeout=30) is not None
        assert not RunState.path(exp_dir).exists()
        assert list(exp_dir.glob("state.json.unreadable-*"))
    finally:
        if leader.poll() is None:
            leader.kill()
            leader.wait()


def test_cli_stop_of_a_file_naming_nothing_says_what_to_remove(tmp_path):
    conf, exp_dir = config(tmp_path)
    RunState.path(exp_dir).write_text("{not json")
    result = run_cli(conf, "action=stop", timeout=120)
    assert result.returncode == 1 and "Traceback" not in result.output
    assert f"remove {RunState.path(exp_dir)}" in result.output.replace("\n", ""), result.output
