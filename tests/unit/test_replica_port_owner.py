"""A replica takes its engine for healthy only when the process answering /health on the engine's port is the one
it started (or a child of it): something that took the port first is never declared the engine, nor sent the key.
Real processes and sockets; the replica's Ray parts left out."""

from __future__ import annotations

import subprocess
import sys

import pytest

from flagscale.net import free_port, health_ok
from flagscale.replica import engine as replica_engine
from flagscale.replica.engine import EngineReplica, EngineSpec, EngineStartError
from flagscale.replica.process import LogWatch, listens_on, terminate_engine
from tests.conftest import wait_for

SERVER = """
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer
class Health(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
    def log_message(self, *args):
        pass
HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""
# the engine_proc shape: the server is a child of the process the replica started
WRAPPED = "import subprocess, sys; subprocess.run([sys.executable, '-c', sys.argv[1], sys.argv[2]])"


def spawn(argv: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, *argv], process_group=0, stdin=subprocess.DEVNULL)


@pytest.fixture
def processes():
    started: list[subprocess.Popen] = []
    yield lambda argv: started.append(spawn(argv)) or started[-1]
    for proc in started:
        terminate_engine(proc, grace_s=2)


class BareReplica(EngineReplica):
    def __del__(self):  # the fixture stops the processes; there is no registry to leave
        pass


def replica(tmp_path, proc: subprocess.Popen, port: int) -> EngineReplica:
    spec = EngineSpec(
        app="a", serve_id="s", model_names=["m"], argv=[], bind_host="127.0.0.1", log_dir=str(tmp_path), env={},
        startup_timeout_s=3,
    )  # fmt: skip
    r = object.__new__(BareReplica)
    r.spec, r.proc, r.url, r.ranks = spec, proc, f"http://127.0.0.1:{port}", None
    r.log_path, r._server = tmp_path / "engine.log", "test server"
    return r


def test_the_started_server_or_its_child_is_healthy(tmp_path, processes, monkeypatch):
    port = free_port("127.0.0.1")
    wrapper = processes(["-c", WRAPPED, SERVER, str(port)])
    wait_for(lambda: health_ok(f"http://127.0.0.1:{port}", 1), 30, "the wrapped server")
    assert listens_on(wrapper.pid, port)
    r = replica(tmp_path, wrapper, port)
    r._wait_healthy(10)
    monkeypatch.setattr(replica_engine.registry, "publish", lambda record: None)
    r.record, r._last_healthy = None, 0.0
    r.check_health()


def test_a_server_that_took_the_port_first_is_never_the_engine(tmp_path, processes):
    port = free_port("127.0.0.1")
    processes(["-c", SERVER, str(port)])  # someone else's server, on the port the replica chose
    wait_for(lambda: health_ok(f"http://127.0.0.1:{port}", 1), 30, "the other server")
    engine = processes(["-c", "import time; time.sleep(60)"])  # the started engine, not (yet) listening
    assert not listens_on(engine.pid, port)
    r = replica(tmp_path, engine, port)
    with pytest.raises(EngineStartError, match="not healthy within"):
        r._wait_healthy(2)
    assert "not from the server this replica started" in r.log_path.read_text()

    engine = processes(["-c", "import time; time.sleep(60)"])
    r = replica(tmp_path, engine, port)
    r._last_healthy = 0.0
    with pytest.raises(RuntimeError, match="answered by a process this replica did not start"):
        r.check_health()


def test_a_start_failure_line_in_the_log_fails_the_start_at_once(tmp_path):
    # vLLM's KV handshake listener dies when its port is taken; the server itself lives on and never gets healthy
    script = (
        "import sys, time; print('zmq.error.ZMQError: Address already', end='', flush=True); time.sleep(0.3); "
        "print(' in use (addr=tcp://127.0.0.1:31000)', flush=True); time.sleep(120)"
    )
    with open(tmp_path / "engine.log", "ab") as log:
        engine = subprocess.Popen([sys.executable, "-c", script], stdout=log, process_group=0)
    try:
        r = replica(tmp_path, engine, free_port("127.0.0.1"))
        with pytest.raises(EngineStartError, match="cannot become healthy: its log says .*Address already in use"):
            r._wait_healthy(60)  # fails on the line, long before this
        assert engine.poll() is not None  # and the server it started is stopped
    finally:
        terminate_engine(engine, grace_s=2)


def test_log_watch_finds_a_line_written_in_parts(tmp_path):
    log = tmp_path / "log"
    watch = LogWatch(log, ("needle here",))
    assert watch.found() is None  # no log yet
    log.write_text("start\nthe need")
    assert watch.found() is None
    with open(log, "a") as f:
        f.write("le here, then\nmore\n")
    assert watch.found() == "the needle here, then"
    assert LogWatch(log, ()).found() is None  # an engine with no such lines
