"""flagscale.net: the port and /health probes every layer uses."""

import socket
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


def test_free_port_skips_ports_in_use_and_ports_handed_out(monkeypatch):
    import flagscale.net as net

    monkeypatch.setattr(net, "_ephemeral_low", lambda: 65536)
    monkeypatch.setattr(net, "_handed_out", set())
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


def test_free_port_stays_below_the_ephemeral_range(monkeypatch):
    import flagscale.net as net

    monkeypatch.setattr(net, "_handed_out", set())
    low = min(net._ephemeral_low(), net._PICK_RANGE[1] + 1)
    ports = [free_port() for _ in range(20)]
    assert all(net._PICK_RANGE[0] <= port < low for port in ports) or low <= net._PICK_RANGE[0]
