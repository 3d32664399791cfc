"""Silence on the replicas' connections (upstream_http): which answers have been silent too long, found by one
sweep every SWEEP_S over the connections waiting for an answer, never by a timer per piece (a piece costs its
connection one counter increment). Before the first byte of an answer's body a replica may be silent for
`first_byte_s` (a prompt's prefill, a whole non-streamed answer), between two pieces for `idle_s`; a connection
whose answer's relay paused it (its client is slow) is not silent. Past its bound, the connection is closed and its
answer fails (upstream_http.Stalled): the request moves on as from a replica that died."""

from __future__ import annotations

import asyncio
import socket
import time
from typing import Any

SWEEP_S = 1.0  # how often connections waiting for an answer are checked for silence
# TCP keepalive on the replicas' connections: probes after 30 s of silence, every 10 s, 3 unanswered: broken.
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_PROBES = 30, 10, 3


def tcp_keepalive(transport: asyncio.BaseTransport) -> None:
    """TCP keepalive on a connection, so one to a host that vanished breaks even while nothing is sent on it."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in (
        ("TCP_KEEPIDLE", KEEPALIVE_IDLE_S),
        ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
        ("TCP_KEEPCNT", KEEPALIVE_PROBES),
    ):
        if hasattr(socket, option):  # (Linux; macOS lacks some)
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)


class StallWatch:
    """The connections waiting for (the rest of) an answer (`busy`), and the sweep over them. A connection here
    has `key` (host, port), `answer` (with `paused` and `body_began`), `received` (pieces so far), `seen`,
    `quiet_since` and `stall(reason)`."""

    def __init__(self, first_byte_s: float, idle_s: float) -> None:
        self.first_byte_s, self.idle_s = first_byte_s, idle_s
        self.busy: set[Any] = set()
        self._sweep: asyncio.TimerHandle | None = None

    def add(self, conn: Any) -> None:
        conn.quiet_since, conn.seen = time.monotonic(), conn.received
        self.busy.add(conn)
        if self._sweep is None:
            self._sweep = asyncio.get_running_loop().call_later(SWEEP_S, self._check)

    def quiet_replicas(self, quiet_s: float) -> set[tuple[str, int]]:
        """host:port of the replicas with an answer silent (not paused by its client) for at least `quiet_s`."""
        now = time.monotonic()
        return {
            c.key for c in self.busy if c.answer is not None and not c.answer.paused and now - c.quiet_since >= quiet_s
        }

    def give_up(self, key: tuple[str, int], reason: str) -> int:
        """Every answer being waited for from the replica at host:port fails (Stalled: reason); how many."""
        stalled = [c for c in self.busy if c.key == key and c.answer is not None]
        for conn in stalled:
            conn.stall(reason)
        return len(stalled)

    def close(self) -> None:
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None

    def _check(self) -> None:
        """The sweep: a connection silent for longer than its bound is given up."""
        self._sweep = None
        now = time.monotonic()
        for conn in list(self.busy):
            answer = conn.answer
            if answer is None:
                self.busy.discard(conn)
            elif conn.received != conn.seen or answer.paused:  # it spoke, or its client holds it back
                conn.seen, conn.quiet_since = conn.received, now
            else:
                began = answer.body_began
                bound = self.idle_s if began else self.first_byte_s
                if now - conn.quiet_since > bound:
                    what = "between two pieces of its answer" if began else "before the first byte of its answer"
                    conn.stall(f"sent nothing for {bound:g} s {what}")
        if self.busy:
            self._sweep = asyncio.get_running_loop().call_later(SWEEP_S, self._check)
