"""The router's port is its deployment's alone (flagscale/router/own_port.py): listeners sharing it with
SO_REUSEPORT are told apart by the deployment their process was started for."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import psutil
import pytest

from flagscale.net import free_port
from flagscale.router.own_port import DEPLOYMENT_ENV, foreign_listeners

LISTEN = (
    "import socket, sys, time\n"
    "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)\n"
    "s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(); print('listening', flush=True); time.sleep(60)\n"
)


@pytest.fixture
def listener():
    started = []

    def start(host: str, port: int, deployment: str | None) -> subprocess.Popen:
        env = {k: v for k, v in os.environ.items() if k != DEPLOYMENT_ENV}
        if deployment is not None:
            env[DEPLOYMENT_ENV] = deployment
        proc = subprocess.Popen(
            [sys.executable, "-c", LISTEN, host, str(port)], stdout=subprocess.PIPE, text=True, env=env
        )
        started.append(proc)
        assert proc.stdout.readline().strip() == "listening"
        return proc

    yield start
    for proc in started:
        proc.kill()
        proc.wait(10)


def own_socket(host: str, port: int) -> socket.socket:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen()
    return sock


def test_a_router_of_the_same_deployment_is_not_foreign(listener):
    port = free_port()
    listener("127.0.0.1", port, "app@/exp/a")
    with own_socket("127.0.0.1", port):
        assert foreign_listeners("127.0.0.1", port, "app@/exp/a") == []


def test_another_deployment_or_an_untagged_process_is_named(listener):
    port = free_port()
    theirs = listener("127.0.0.1", port, "app@/exp/b")
    untagged = listener("127.0.0.1", port, None)
    with own_socket("127.0.0.1", port):
        found = foreign_listeners("127.0.0.1", port, "app@/exp/a")
    name = psutil.Process(untagged.pid).name()
    assert found == sorted([f"pid {theirs.pid} (deployment app@/exp/b)", f"pid {untagged.pid} ({name})"])


def test_without_a_deployment_every_other_listener_is_foreign(listener):
    port = free_port()
    theirs = listener("127.0.0.1", port, "app@/exp/a")
    assert foreign_listeners("127.0.0.1", port, None) == [f"pid {theirs.pid} (deployment app@/exp/a)"]


def test_a_wildcard_listener_overlaps_a_loopback_one(listener):
    port = free_port()
    theirs = listener("0.0.0.0", port, "app@/exp/b")
    assert foreign_listeners("127.0.0.1", port, "app@/exp/a") == [f"pid {theirs.pid} (deployment app@/exp/b)"]
    assert foreign_listeners("127.0.0.1", port + 1 if port < 65535 else port - 1, "app@/exp/a") == []


def test_a_sibling_bound_during_the_look_is_looked_at_again_not_called_foreign(listener, monkeypatch):
    # psutil reads the processes' fds before the socket table: a router of the same deployment that binds in
    # between shows with no owner (what a CI run met on 2026-11-28, refusing its own deployment's port)
    port = free_port()
    sibling = listener("127.0.0.1", port, "app@/exp/a")
    real, looks = psutil.net_connections, []

    def racing(kind):
        looks.append(kind)
        conns = real(kind=kind)
        return [c._replace(pid=None) if c.pid == sibling.pid and len(looks) == 1 else c for c in conns]

    monkeypatch.setattr(psutil, "net_connections", racing)
    monkeypatch.setattr("flagscale.router.own_port.OWNERLESS_RESCAN_S", 0.01)
    with own_socket("127.0.0.1", port):
        assert foreign_listeners("127.0.0.1", port, "app@/exp/a") == []
    assert len(looks) == 2


def test_a_listener_that_never_shows_an_owner_is_named_after_the_rescans(listener, monkeypatch):
    port = free_port()
    other = listener("127.0.0.1", port, "app@/exp/a")
    real = psutil.net_connections
    monkeypatch.setattr(
        psutil, "net_connections", lambda kind: [c._replace(pid=None) if c.pid == other.pid else c for c in real(kind)]
    )
    monkeypatch.setattr("flagscale.router.own_port.OWNERLESS_RESCAN_S", 0.01)
    with own_socket("127.0.0.1", port):
        assert foreign_listeners("127.0.0.1", port, "app@/exp/a") == ["a process whose owner cannot be read"]
