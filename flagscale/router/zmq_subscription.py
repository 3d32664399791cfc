"""A ZMQ SUB socket read from the router's asyncio loop at wakes, not with an await per message.

An engine publishes a KV-event batch on every step that stores blocks; awaiting a poll and a receive per batch
through pyzmq's asyncio layer cost ~300 us of CPU a batch here, five times decoding and applying it. So the socket's
own FD wakes the loop (loop.add_reader), everything queued is then read without blocking, and a stream read less
than COALESCE_S ago is read again only that long after: a busy stream is read in batches of what came meanwhile
(the index lags by at most that), a quiet one at once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

from flagscale.adaptors import zmq

COALESCE_S = 0.01
MOST_PER_WAKE = 256  # messages read at one wake before the loop runs other work again


class Subscription:
    """A SUB socket connected to `endpoint`, subscribed to `topic`, read with `ready()` then `queued()`."""

    def __init__(self, context: Any, endpoint: str, topic: str) -> None:
        self._socket = zmq.Socket(context, zmq.SUB)  # a plain socket of any context (an asyncio one's too)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(endpoint)
        self._socket.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._wake = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._socket.FD, self._signalled)
        self._read_at = float("-inf")

    def _signalled(self) -> None:
        # ZMQ's FD stays readable until the socket's state is read: read it here, or the loop spins while a busy
        # stream waits out COALESCE_S
        self._socket.getsockopt(zmq.EVENTS)
        self._wake.set()

    async def ready(self) -> None:
        """Until a message is queued (and COALESCE_S since the last read). The FD signals that the state may have
        changed (edge-triggered): the state is read after the signal is cleared, so a message that came between
        is not slept over."""
        while True:
            self._wake.clear()
            if self._socket.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                break
            await self._wake.wait()
        # the wait for a message first, the coalescing after: a quiet stream's batch costs one wake, not two
        since = time.monotonic() - self._read_at
        if since < COALESCE_S:
            await asyncio.sleep(COALESCE_S - since)
        self._read_at = time.monotonic()

    def queued(self, most: int = MOST_PER_WAKE) -> Iterator[list[bytes]]:
        """The messages queued now (at most `most`), read without blocking."""
        for _ in range(most):
            try:
                yield self._socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return

    def close(self) -> None:
        self._loop.remove_reader(self._socket.FD)
        self._socket.close(linger=0)
