"""`action=logs` without Ray: which logs serve_id= / replica= pick (and the errors that list the valid ones), reading a
log's last lines and then only what follows through the runner's argv, and follow ending when the deployment stops."""

from __future__ import annotations

import io
import socket
import threading
import time
from pathlib import Path

import pytest
from rich.console import Console

from flagscale.actions import log_reading as reading
from flagscale.actions import log_sources
from flagscale.actions import logs as lg
from flagscale.cluster.runner import LocalRunner, SshRunner
from flagscale.cluster.state import HostRecord, RunState
from flagscale.config.load import load_config
from flagscale.errors import ClusterError, ConfigError
from flagscale.net import free_port
from tests.conftest import replica_record, wait_for


def engine(serve_id: str, replica: str) -> log_sources.LogSource:
    return log_sources.LogSource(f"/x/engine-{serve_id}-{replica}.log", serve_id, replica)


SOURCES = [
    log_sources.LogSource("/x/runner.log"),
    engine("alpha", "ab12cd34"),
    engine("alpha", "ab99zz00"),
    engine("beta", "q1w2e3r4"),
    engine("pd-prefill", "pp000001"),
    engine("pd-decode", "dd000001"),
]


def names(sources) -> list[str]:
    return [s.name for s in sources]


@pytest.mark.parametrize(
    "name, parsed",
    [
        ("engine-demo-ab12cd34.log", ("demo", "ab12cd34")),
        ("engine-demo-decode-rqs9noia.log", ("demo-decode", "rqs9noia")),  # a pool's serve_id holds a '-'
        ("engine-a-b-c-x.log", ("a-b-c", "x")),
        ("engine-demo.log", None),
        ("runner.log", None),
        ("engine-demo-ab12cd34.log.1", None),
    ],
)
def test_engine_log_names(name, parsed):
    assert log_sources.parse_engine_log_name(name) == parsed


def test_no_filter_is_every_engine_and_serve_id_is_one_nodes():
    assert names(log_sources.select(SOURCES)) == names(SOURCES[1:])
    assert names(log_sources.select(SOURCES, serve_id="alpha")) == ["alpha/ab12cd34", "alpha/ab99zz00"]
    # a disaggregated node's serve_id names both its pools; a pool's own serve_id just that pool
    assert names(log_sources.select(SOURCES, serve_id="pd")) == ["pd-prefill/pp000001", "pd-decode/dd000001"]
    assert names(log_sources.select(SOURCES, serve_id="pd-decode")) == ["pd-decode/dd000001"]


def test_replica_by_id_or_unique_prefix():
    assert names(log_sources.select(SOURCES, replica="q1w2e3r4")) == ["beta/q1w2e3r4"]
    assert names(log_sources.select(SOURCES, replica="ab1")) == ["alpha/ab12cd34"]
    assert names(log_sources.select(SOURCES, serve_id="alpha", replica="ab9")) == ["alpha/ab99zz00"]


def test_unknown_serve_id_lists_the_valid_ones():
    with pytest.raises(ConfigError) as err:
        log_sources.select(SOURCES, serve_id="gamma")
    assert "no engine replica of serve_id 'gamma'" in str(err.value)
    assert "alpha, beta, pd-decode, pd-prefill" in str(err.value)
    assert err.value.exit_code != 0
    with pytest.raises(ConfigError, match="there are no engine logs"):
        log_sources.select(SOURCES[:1], serve_id="alpha")


def test_unknown_or_ambiguous_replica_lists_the_replicas():
    with pytest.raises(ConfigError) as err:
        log_sources.select(SOURCES, replica="zz")
    assert "matches 'zz'" in str(err.value) and "alpha/ab12cd34" in str(err.value) and "beta/q1w2e3r4" in str(err.value)
    with pytest.raises(ConfigError) as err:  # a prefix of two ids
        log_sources.select(SOURCES, replica="ab")
    assert "matches 2 replicas (alpha/ab12cd34, alpha/ab99zz00)" in str(err.value)
    with pytest.raises(ConfigError, match="of serve_id 'beta' matches 'ab1'"):  # the replica is of another node
        log_sources.select(SOURCES, serve_id="beta", replica="ab1")


def test_an_exact_id_wins_over_a_longer_one_it_prefixes():
    sources = [engine("a", "abc"), engine("a", "abcd")]
    assert names(log_sources.select(sources, replica="abc")) == ["a/abc"]


def test_registry_replicas_on_a_remote_host_are_read_over_its_ssh_runner(tmp_path):
    state = RunState(
        app_name="a",
        exp_dir=str(tmp_path),
        endpoint="",
        ray_address="",
        token_path=None,
        hosts=[
            HostRecord(host="localhost", role="driver", node_id="n-local", node_ip="10.0.0.1"),
            HostRecord(host="gpu-2", role="worker", node_id="n-remote", node_ip="10.0.0.2", remote=True),
        ],
    )
    here = replica_record("r-here", "http://10.0.0.1:1")
    here.node_id, here.node_ip, here.log_path = "n-local", "10.0.0.1", str(tmp_path / "engine-s-r-here.log")
    there = replica_record("r-there", "http://10.0.0.2:1")
    there.node_id, there.node_ip, there.log_path, there.role = "n-remote", "10.0.0.2", "/far/engine.log", "decode"
    local, remote = log_sources.registry_sources(state, [there, here])
    assert (local.replica_id, local.ssh_host, local.host) == ("r-here", None, "10.0.0.1")
    assert (remote.replica_id, remote.ssh_host, remote.host) == ("r-there", "gpu-2", "10.0.0.2 (gpu-2)")
    assert "serve_id s (decode), replica r-there, host 10.0.0.2 (gpu-2): /far/engine.log" in remote.header()
    readers = reading.Readers()
    assert isinstance(readers.runner(local), LocalRunner)
    runner = readers.runner(remote)  # not readable here: that host's runner (SSH, connected on first use)
    assert isinstance(runner, SshRunner) and runner.host == "gpu-2"
    (tmp_path / "far").mkdir()
    readable = log_sources.LogSource(str(tmp_path / "engine-s-r-here.log"), "s", "x", ssh_host="gpu-2")
    Path(readable.path).write_text("x\n")
    assert isinstance(readers.runner(readable), LocalRunner)  # a shared file system: read it here


def test_read_gives_the_last_lines_then_only_what_follows(tmp_path, monkeypatch):
    path = tmp_path / "engine-s-r.log"
    path.write_text("".join(f"line {i}\n" for i in range(1, 101)))
    source, readers = log_sources.LogSource(str(path), "s", "r"), reading.Readers()
    first = readers.read(source, None, 3)
    assert first.text == "line 98\nline 99\nline 100\n" and first.offset == path.stat().st_size
    with path.open("a") as f:
        f.write("line 101\nhalf")
    later = readers.read(source, first.offset, 0)
    assert later.text == "line 101\nhalf" and later.offset == path.stat().st_size
    assert readers.read(source, later.offset, 0).text == ""
    monkeypatch.setattr(reading, "MAX_READ_BYTES", 4)  # a burst comes in bounded pieces
    piece = readers.read(source, first.offset, 0)
    assert piece.text == "line" and piece.offset == first.offset + 4
    path.write_text("new\n")  # truncated (rotated, rewritten)
    assert readers.read(source, later.offset, 0).truncated
    with pytest.raises(ClusterError, match="cannot read"):
        readers.read(log_sources.LogSource(str(tmp_path / "missing.log"), "s", "m"), None, 3)


def test_ids_typed_as_numbers_on_the_command_line():
    base = {"experiment": {"exp_name": "t", "exp_dir": "/tmp/t"}, "serve": [{"serve_id": "a", "engine_args": {}}]}
    config = load_config({**base, "action": "logs", "replica": 4, "serve_id": 7, "lines": 5, "follow": True})
    assert (config.replica, config.serve_id, config.lines, config.follow) == ("4", "7", 5, True)
    with pytest.raises(ConfigError, match="quote it"):
        load_config({**base, "action": "logs", "replica": 1e5})
    with pytest.raises(ConfigError):
        load_config({**base, "action": "logs", "lines": -1})


# ---- the action on an exp_dir, nothing running -----------------------------------------------------------------


def stopped_exp_dir(tmp_path) -> Path:
    logs = tmp_path / "exp" / "serve_logs"
    logs.mkdir(parents=True)
    (logs / "runner.log").write_text("runner started\nrunner done\n")
    (logs / "engine-alpha-ab12cd34.log").write_text("".join(f"alpha {i}\n" for i in range(100)))
    (logs / "engine-beta-q1w2e3r4.log").write_text("beta up\nbeta [bold]down[/]\n")
    return tmp_path / "exp"


def run_logs(exp_dir: Path, capsys, **kwargs) -> tuple[int, str, str]:
    code = lg.logs(str(exp_dir), Console(), **kwargs)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_a_stopped_deployments_logs_are_still_shown(tmp_path, capsys):
    exp_dir = stopped_exp_dir(tmp_path)
    code, out, _ = run_logs(exp_dir, capsys, lines=2)
    assert code == 0
    assert f"==> runner log (localhost): {exp_dir}/serve_logs/runner.log <==\nrunner started\nrunner done\n" in out
    alpha = f"==> serve_id alpha, replica ab12cd34, host localhost: {exp_dir}/serve_logs/engine-alpha-ab12cd34.log <=="
    assert f"{alpha}\nalpha 98\nalpha 99\n" in out and "alpha 97" not in out
    assert "beta [bold]down[/]" in out  # printed as written, not as markup

    code, out, _ = run_logs(exp_dir, capsys, serve_id="beta")
    assert code == 0 and "beta up" in out and "alpha" not in out and "runner" not in out
    code, out, _ = run_logs(exp_dir, capsys, replica="ab1", lines=1)
    assert code == 0 and "alpha 99" in out and "beta" not in out
    code, out, err = run_logs(exp_dir, capsys, follow=True, lines=1)
    assert code == 0 and "alpha 99" in out and "nothing to follow" in err


def test_unknown_replica_of_a_stopped_deployment(tmp_path):
    with pytest.raises(ConfigError, match="replicas: alpha/ab12cd34, beta/q1w2e3r4"):
        lg.logs(str(stopped_exp_dir(tmp_path)), Console(), replica="nope")


def test_nothing_running_and_no_logs(tmp_path, capsys):
    code, out, _ = run_logs(tmp_path / "never", capsys)
    assert code == 1 and "nothing is running" in out and "no logs under" in out


# ---- follow: new lines until the deployment stops ----------------------------------------------------------------


def test_follow_prints_new_whole_lines_and_new_replicas_and_ends_when_stopped(tmp_path, monkeypatch):
    monkeypatch.setattr(lg, "POLL_S", 0.05)
    monkeypatch.setattr(lg, "ALIVE_EVERY_S", 0.2)
    exp_dir = stopped_exp_dir(tmp_path)
    log_dir = exp_dir / "serve_logs"
    gcs = socket.create_server(("127.0.0.1", free_port()))  # the "cluster": its GCS port accepts connections
    state = RunState(
        app_name="t",
        exp_dir=str(exp_dir),
        endpoint="",
        ray_address=f"127.0.0.1:{gcs.getsockname()[1]}",
        token_path=None,
        started_at=time.time(),  # after the logs above: those are not new
        phase="running",
    )
    state.save()
    out, notes = io.StringIO(), io.StringIO()
    printer = reading.Printer(out, Console(file=notes))
    beta = log_dir / "engine-beta-q1w2e3r4.log"
    sources = [log_sources.LogSource(str(beta), "beta", "q1w2e3r4")]
    result: list[int] = []
    thread = threading.Thread(
        target=lambda: result.append(
            lg._show(str(exp_dir), state, sources, reading.Readers(), printer, 1, True, True, None)
        )
    )
    thread.start()
    try:
        wait_for(lambda: "beta [bold]down[/]\n" in out.getvalue(), 10, "the last line")
        with beta.open("a") as f:
            f.write("beta again\nbeta half")
            f.flush()
            wait_for(lambda: "beta again\n" in out.getvalue(), 10, "a new line")
            assert "beta half" not in out.getvalue()  # held back until its line is whole
            f.write(" done\n")
        wait_for(lambda: "beta half done\n" in out.getvalue(), 10, "the line made whole")
        (log_dir / "engine-beta-n3wr3p1c.log").write_text("new replica starting\n")
        wait_for(lambda: "new replica starting" in out.getvalue(), 10, "the new replica's log")
        assert "new engine log: beta/n3wr3p1c" in notes.getvalue()
        with beta.open("a") as f:
            f.write("last words")  # no newline: printed once the deployment is gone
        RunState.remove(exp_dir)
        gcs.close()
        thread.join(timeout=10)
        assert not thread.is_alive() and result == [0]
    finally:
        gcs.close()
        RunState.remove(exp_dir)
        thread.join(timeout=10)
    text = out.getvalue()
    assert text.index("beta [bold]down[/]") < text.index("beta again") < text.index("beta half done")
    assert "==> serve_id beta, replica n3wr3p1c" in text and "[not in the registry: starting, or gone]" in text
    assert text.rstrip().endswith("last words")
    assert "is stopped; no more lines will come" in notes.getvalue()


def test_an_unreadable_registry_falls_back_to_this_runs_log_files(tmp_path, monkeypatch):
    exp_dir = stopped_exp_dir(tmp_path)
    state = RunState(
        app_name="t", exp_dir=str(exp_dir), endpoint="", ray_address="", token_path=None, started_at=time.time()
    )
    (exp_dir / "serve_logs" / "engine-alpha-n3wr3p1c.log").write_text("this run's\n")

    def refuse(state):
        raise ClusterError("cannot reach Ray's GCS at x")

    # a run's own cluster: the registry is read without a driver
    monkeypatch.setattr("flagscale.launchers.base.connect_kv", refuse)
    notes: list[str] = []
    found = log_sources.discover(str(exp_dir), state, notes.append)
    assert names(found) == ["runner", "alpha/n3wr3p1c"]  # not the earlier runs' logs
    assert not found[1].unlisted and "cannot read the replica registry" in notes[0]


def test_the_last_lines_of_a_long_log_come_from_a_window_that_grows_until_it_holds_them(tmp_path, monkeypatch):
    path = tmp_path / "engine-s-r.log"
    long_line = "x" * 1000
    path.write_text("".join(f"{i} {long_line}\n" for i in range(300)) + "tail without newline")
    source, readers = log_sources.LogSource(str(path), "s", "r"), reading.Readers()
    monkeypatch.setattr(reading, "TAIL_FIRST_BYTES", 2000)  # two lines' worth: the window grows 4x until 100 fit
    chunk = readers.read(source, None, 100)
    lines = chunk.text.split("\n")
    assert len(lines) == 100 and lines[0] == f"201 {long_line}" and lines[-1] == "tail without newline"
    assert chunk.offset == path.stat().st_size
    assert reading.last_lines("a\nb\nc\n", 2) == "b\nc\n" and reading.last_lines("a\nb", 5) == "a\nb"
    assert reading.last_lines("a\n", 0) == ""
