"""The tests' own subscriptions to engines' KV-event publishers (tests/e2e/test_kv_events.py,
tests/gpu/test_kv_events_dp.py): the last batch sequence each publisher sent, to wait until the router applied it."""

from __future__ import annotations

import threading
import time

import zmq


class Sequences:
    """Subscriptions to publishers (name -> endpoint): the last batch sequence each one sent, and when one last did."""

    def __init__(self, endpoints: dict[str, str]):
        self.last: dict[str, int] = {}
        self.changed_at = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, args=(endpoints,), daemon=True)
        self._thread.start()

    def _read(self, endpoints: dict[str, str]) -> None:
        ctx = zmq.Context.instance()
        sockets = {}
        for replica, endpoint in endpoints.items():
            sub = ctx.socket(zmq.SUB)
            sub.connect(endpoint)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sockets[sub] = replica
        poller = zmq.Poller()
        for sub in sockets:
            poller.register(sub, zmq.POLLIN)
        while not self._stop.is_set():
            for sub, _ in poller.poll(200):
                frames = sub.recv_multipart()
                self.last[sockets[sub]] = int.from_bytes(frames[1], "big")
                self.changed_at = time.monotonic()
        for sub in sockets:
            sub.close(0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
