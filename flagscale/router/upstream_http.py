"""The router's HTTP/1.1 client for the requests it relays to the replicas' servers.

With aiohttp's client, each piece of a streamed answer goes through a StreamReader to a task woken to read it,
then through the server's writer: at c=16 that machinery was two thirds of the router's CPU per token
(docs/benchmarks.md, "Where the router's CPU per token goes"). Here a connection is an asyncio protocol whose
`data_received` runs httptools' parser (llhttp: status line, headers, chunked framing) and hands each piece of
the body straight to a sink, which writes it on to the client: a streamed token wakes no task. The handler
awaits only the answer's head and its end (or a full client buffer, during which the replica is not read).

Connections are kept per host:port and reused while idle for at most `keepalive_s` (the replicas' servers close
idle ones after 5 s). Errors: ConnectFailed (no connection: nothing was sent), Disconnected (the connection broke
before or while the answer came, or the answer was not HTTP), Stalled (a Disconnected: the replica sent nothing
for longer than its bound, `first_byte_s` before the answer's body begins, `idle_s` between two pieces of it).

Stalls are found by upstream_watch.StallWatch's sweep, not by a timer per piece: a piece costs one counter
increment. TCP keepalive is on, so a connection to a host that vanished breaks even while idle.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from urllib.parse import urlsplit

import httptools
from multidict import CIMultiDict

from flagscale.router.upstream_watch import StallWatch, tcp_keepalive


class UpstreamError(Exception):
    """The replica's answer could not be had."""


class ConnectFailed(UpstreamError):
    """No connection could be made: nothing was sent."""


class Disconnected(UpstreamError):
    """The connection broke before or while the answer came."""


class Stalled(Disconnected):
    """The replica sent nothing for longer than its bound (a frozen engine, a lost host): the connection was
    closed and the answer is given up, as for a replica that died."""


# A sink takes a piece of the body and says whether more may come now (False: its consumer is full or gone).
Sink = Callable[[bytes], bool]


class UpstreamClient:
    """Keep-alive connections to the replicas and the requests sent on them. Use it on one event loop."""

    def __init__(
        self, keepalive_s: float, connect_timeout_s: float, first_byte_s: float = 900.0, idle_s: float = 30.0
    ) -> None:
        self.keepalive_s = keepalive_s
        self.connect_timeout_s = connect_timeout_s
        self.watch = StallWatch(first_byte_s, idle_s)  # the connections waiting for an answer, and their silence
        self._idle: dict[tuple[str, int], list[_Connection]] = {}
        self._addresses: dict[str, tuple[str, int]] = {}

    async def request(
        self, method: str, url: str, body: bytes, headers: dict[str, str], keep_alive: bool = True
    ) -> Answer:
        """Sends the request and returns its answer once the answer's head is in. `url`: the replica's base URL
        and the path (with its query). The caller closes the answer (Answer.close) when done with it."""
        host, port, target = self._address(url)
        conn = self._idle_connection((host, port))
        if conn is None:
            conn = await self._connect(host, port)
        head = [f"{method} {target} HTTP/1.1", f"Host: [{host}]:{port}" if ":" in host else f"Host: {host}:{port}"]
        head += [f"{name}: {value}" for name, value in headers.items()]
        if body or method not in ("GET", "HEAD", "DELETE", "OPTIONS"):
            head.append(f"Content-Length: {len(body)}")
        if not keep_alive or method == "HEAD":
            head.append("Connection: close")
        answer = Answer(conn, head_only=method == "HEAD")
        conn.send(("\r\n".join(head) + "\r\n\r\n").encode("utf-8", "surrogateescape") + body, answer)
        self.watch.add(conn)
        try:
            await answer.head
        except BaseException:
            answer.close()
            raise
        return answer

    def address(self, url: str) -> tuple[str, int]:
        host, port, _ = self._address(url)
        return host, port

    def close(self) -> None:
        """Closes the idle connections (those in use close with their answers)."""
        self.watch.close()
        for conns in self._idle.values():
            for conn in conns:
                conn.abort()
        self._idle.clear()

    def _address(self, url: str) -> tuple[str, int, str]:
        """(host, port, request target) of a URL: the part before the path is parsed once per replica."""
        cut = url.find("/", url.find("//") + 2)
        base, target = (url, "/") if cut < 0 else (url[:cut], url[cut:])
        address = self._addresses.get(base)
        if address is None:
            parts = urlsplit(base)
            if parts.scheme != "http" or not parts.hostname:
                raise ValueError(f"not an http:// URL: {url!r}")
            address = self._addresses[base] = (parts.hostname, parts.port or 80)
        return address[0], address[1], target

    def _idle_connection(self, key: tuple[str, int]) -> _Connection | None:
        conns = self._idle.get(key)
        stale_before = time.monotonic() - self.keepalive_s
        while conns:
            conn = conns.pop()
            if conn.idle_since >= stale_before and conn.usable():
                return conn
            conn.abort()
        return None

    async def _connect(self, host: str, port: int) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, conn = await loop.create_connection(lambda: _Connection(self, (host, port)), host, port)
        except TimeoutError as exc:
            raise ConnectFailed(f"no connection to {host}:{port} within {self.connect_timeout_s:g} s") from exc
        except OSError as exc:
            raise ConnectFailed(f"cannot connect to {host}:{port}: {exc.strerror or exc}") from exc
        return conn

    def _release(self, conn: _Connection) -> None:
        conn.idle_since = time.monotonic()
        self._idle.setdefault(conn.key, []).append(conn)

    def _forget(self, conn: _Connection) -> None:
        self.watch.busy.discard(conn)
        conns = self._idle.get(conn.key)
        if conns and conn in conns:
            conns.remove(conn)


class _Connection(asyncio.Protocol):
    """One TCP connection to a replica's server, carrying one request at a time."""

    def __init__(self, client: UpstreamClient, key: tuple[str, int]) -> None:
        self.client, self.key = client, key
        self.transport: asyncio.Transport | None = None
        self.answer: Answer | None = None
        self.parser = None
        self.idle_since = 0.0
        self.received = 0  # data_received calls: the stall sweep compares it with `seen`
        self.seen = 0
        self.quiet_since = 0.0

    def usable(self) -> bool:
        return self.transport is not None and not self.transport.is_closing()

    def send(self, request: bytes, answer: Answer) -> None:
        self.answer = answer
        self.parser = httptools.HttpResponseParser(answer)
        self.transport.write(request)

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    def stall(self, reason: str) -> None:
        """Gives up on the answer: the connection is closed, its answer fails with Stalled."""
        answer, self.answer = self.answer, None
        self.abort()
        if answer is not None:
            answer.broken(Stalled(reason))

    def done(self, keep_alive: bool) -> None:
        """The answer is in whole: the connection goes back to the pool (reading, even if its answer's relay
        paused it), or is closed."""
        self.answer, self.parser = None, None
        self.client.watch.busy.discard(self)
        if keep_alive and self.usable():
            self.transport.resume_reading()
            self.client._release(self)
        else:
            self.abort()

    # ---- asyncio.Protocol ----

    def connection_made(self, transport) -> None:
        self.transport = transport
        tcp_keepalive(transport)

    def data_received(self, data: bytes) -> None:
        self.received += 1
        if self.parser is None:  # nothing asked: a server that speaks out of turn is not reused
            self.abort()
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            answer = self.answer
            self.abort()
            if answer is not None:
                answer.broken(Disconnected(f"the answer is not valid HTTP ({exc})"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.client._forget(self)
        answer, self.answer = self.answer, None
        if answer is not None:
            answer.connection_closed(exc)


class Answer:
    """A replica's answer: status and headers once its head is in; then the body, read whole (`read`) or handed
    on piece by piece as it arrives (`relay`). Its methods named on_* are httptools' parser callbacks."""

    def __init__(self, conn: _Connection, head_only: bool) -> None:
        self._conn = conn
        self._head_only = head_only
        self._loop = asyncio.get_running_loop()
        self.head: asyncio.Future = self._loop.create_future()
        self.status = 0
        self.headers: CIMultiDict[str] = CIMultiDict()
        self._header_pairs: list[tuple[str, str]] = []
        self._parts: list[bytes] = []  # the body that came before a sink was given
        self._sink: Sink | None = None
        self._wake: asyncio.Future | None = None  # what the handler waits on during read/relay
        self._paused = False
        self.body_began = False
        self.complete = False
        self._interim = False
        self._until_close = False  # the body lasts until the connection closes
        self._error: BaseException | None = None

    # ---- the handler's side ----

    async def read(self) -> bytes:
        """The whole body."""
        while not self.complete:
            await self._wait()
        return b"".join(self._parts)

    async def relay(self, sink: Sink, drain: Callable[[], Awaitable[None]]) -> None:
        """Hands the body to `sink` piece by piece until its end. While the sink says it is full, the replica
        is not read until `drain` returns."""
        parts, self._parts = self._parts, []
        self._sink = sink
        for part in parts:
            if not sink(part):
                self._pause()
        while True:
            if self._paused:
                await drain()
                self._paused = False
                if self._conn.answer is self:  # (once the answer is in, the connection is no longer this one's)
                    self._conn.transport.resume_reading()
            if self.complete:
                return
            await self._wait()

    def close(self) -> None:
        """Done with the answer: a connection whose answer is not in whole is closed, not reused."""
        if not self.complete and self._conn.answer is self:
            self._conn.answer = None
            self._conn.abort()

    async def _wait(self) -> None:
        if self._error is not None:
            raise self._error
        self._wake = self._loop.create_future()
        try:
            await self._wake
        finally:
            self._wake = None
        if self._error is not None:
            raise self._error

    def _wake_handler(self) -> None:
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)

    def _pause(self) -> None:
        if not self._paused:
            self._paused = True
            if self._conn.answer is self:  # not once the answer is in: the connection may carry another
                self._conn.transport.pause_reading()
            self._wake_handler()

    def connection_closed(self, exc: Exception | None) -> None:
        """The end of an answer whose length is its connection's (neither Content-Length nor chunked), or
        of a broken one."""
        if exc is None and self._until_close:
            self.complete = True
            self._wake_handler()
        else:
            self.broken(Disconnected(f"the connection closed ({exc})" if exc else "the connection closed"))

    def broken(self, error: BaseException) -> None:
        if self.complete or self._error is not None:
            return
        self._error = error
        if not self.head.done():
            self.head.set_exception(error)
        self._wake_handler()

    # ---- httptools' callbacks (from the connection's data_received) ----

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_pairs.append((name.decode("latin-1"), value.decode("latin-1")))

    def on_headers_complete(self) -> None:
        status = self._conn.parser.get_status_code()
        if 100 <= status < 200:  # an interim answer (100 Continue, 103 Early Hints): the answer follows it
            self._interim = True
            self._header_pairs = []
            return
        self.status = status
        self.headers = CIMultiDict(self._header_pairs)
        framed = "Content-Length" in self.headers or "chunked" in self.headers.get("Transfer-Encoding", "").lower()
        self._until_close = not framed and status not in (204, 304)
        if not self.head.done():
            self.head.set_result(None)
        if self._head_only:
            self.complete = True
            self._conn.done(keep_alive=False)

    @property
    def paused(self) -> bool:
        return self._paused

    def on_body(self, body: bytes) -> None:
        self.body_began = True
        sink = self._sink
        if sink is None:
            self._parts.append(body)
            return
        try:
            more = sink(body)
        except Exception as exc:  # the relay's own failure: the handler raises it
            self._error = exc
            self._conn.answer = None
            self._conn.abort()
            self._wake_handler()
            return
        if not more:
            self._pause()

    def on_message_complete(self) -> None:
        if self._interim:
            self._interim = False
            return
        if self.complete:
            return
        self.complete = True
        self._conn.done(keep_alive=self._conn.parser.should_keep_alive())
        self._wake_handler()
