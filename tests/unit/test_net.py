"""flagscale.net: the port and /health probes every layer uses."""

import os
import socket
import stat
import subprocess
import sys
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

from flagscale.net import endpoint_in_use, free_port, health_ok, health_problem, port_is_free, port_open, wait_for_port


def test_listening_port_is_open_and_not_free():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        assert port_open("127.0.0.1", port)
        assert wait_for_port("127.0.0.1", port, timeout_s=2)
        assert not port_is_free("127.0.0.1", port)
        assert endpoint_in_use("0.0.0.0", port) and endpoint_in_use("127.0.0.1", port)  # a wildcard asks loopback
    assert not endpoint_in_use("0.0.0.0", port)


def test_free_port_is_free_and_closed():
    port = free_port()
    assert port_is_free("127.0.0.1", port)
    assert not port_open("127.0.0.1", port)
    assert not wait_for_port("127.0.0.1", port, timeout_s=0.3)


def _serve(code: int, body: bytes) -> tuple[HTTPServer, str]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(code)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def test_health_probes():
    ok, ok_url = _serve(200, b"")
    bad, bad_url = _serve(503, b"no replica for 'm'\n")
    try:
        assert health_ok(ok_url, 2) and health_problem(ok_url, 2) is None
        assert not health_ok(bad_url, 2)
        assert health_problem(bad_url, 2) == "HTTP 503: no replica for 'm'"
    finally:
        ok.shutdown()
        bad.shutdown()
    dead = f"http://127.0.0.1:{free_port()}"
    assert not health_ok(dead, 1)
    assert health_problem(dead, 1).startswith("unreachable (")


def test_free_port_skips_ports_in_use_and_ports_handed_out(monkeypatch, tmp_path):
    import flagscale.net as net

    monkeypatch.setattr(net, "_ephemeral_low", lambda: 65536)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # a ledger of this test's own
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        monkeypatch.setattr(net, "_PICK_RANGE", (taken, taken))
        fallback = free_port()  # the range's one port is listened on: the OS's choice instead
        assert fallback != taken and port_is_free("127.0.0.1", fallback)
    monkeypatch.setattr(net, "_PICK_RANGE", (30000, 30099))
    picks = [free_port() for _ in range(10)]
    assert len(set(picks)) == 10 and all(port_is_free("127.0.0.1", port) for port in picks)


def test_free_port_stays_below_the_ephemeral_range(monkeypatch, tmp_path):
    import flagscale.net as net

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    low = min(net._ephemeral_low(), net._PICK_RANGE[1] + 1)
    ports = [free_port() for _ in range(20)]
    assert all(net._PICK_RANGE[0] <= port < low for port in ports) or low <= net._PICK_RANGE[0]


PICKER = """
import sys, tempfile, time
tempfile.tempdir = sys.argv[1]
from flagscale.net import free_port
while time.time() < float(sys.argv[2]):  # all start picking at the same moment
    time.sleep(0.005)
print(" ".join(str(free_port()) for _ in range(25)))
"""


def test_processes_picking_at_once_never_get_the_same_port(tmp_path):
    """Replicas that start at once on a host each pick ports in their own process: 8 processes x 25 ports drawn from
    the ~2,700 of the range would repeat one almost surely (birthday bound) without the host-wide ledger."""
    import time

    start_at = time.time() + 3
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", PICKER, str(tmp_path), str(start_at)], stdout=subprocess.PIPE, text=True
        )
        for _ in range(8)
    ]
    picks = []
    for proc in procs:
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0
        picks += [int(word) for word in out.split()]
    assert len(picks) == 200 and len(set(picks)) == 200, sorted(p for p in picks if picks.count(p) > 1)
    ledger = tmp_path / f"flagscale-{os.getuid()}" / "ports.ledger"
    assert stat.S_IMODE(ledger.stat().st_mode) == 0o600 and len(ledger.read_text().splitlines()) == 200


def test_an_expired_reservation_is_given_out_again(monkeypatch, tmp_path):
    import flagscale.net as net

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(net, "_ephemeral_low", lambda: 65536)
    port = free_port()
    monkeypatch.setattr(net, "_PICK_RANGE", (port, port))
    assert free_port() != port  # reserved: the OS's choice instead
    monkeypatch.setattr(net, "PORT_HOLD_S", 0.0)
    ledger = tmp_path / f"flagscale-{os.getuid()}" / "ports.ledger"
    ledger.write_text(f"{port} {0}\n")  # expired
    assert free_port() == port
