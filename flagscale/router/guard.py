"""The router's guards on its clients, before a request is routed (docs/operations.md, "Timeouts and limits"):

- ConnectionCap + GuardedSite: at most `max_client_connections` open client connections per process (beyond,
  503 and closed at once), so clients that open connections and never finish a request cannot take every file
  descriptor (aiohttp's keepalive_timeout, RUNNER_OPTIONS, closes those that send no whole head in time);
- KeyCheck: repeated 401s from one client address slowed down;
- host_allowed: without a key, only Host headers that a DNS-rebinding page cannot send;
- BodyBudget: the bytes of request bodies being read and parsed at once, bounded per process.
"""

from __future__ import annotations

import asyncio
import ipaddress
import resource
import socket
import time
from collections import OrderedDict

from aiohttp import web

FULL_ANSWER = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\nRetry-After: 1\r\n"
    b'Content-Length: 95\r\n\r\n{"error":{"message":"too many open connections","type":"ServiceUnavailableError","code":503}}\n'
)
# 401s from one client address: the first FREE_FAILURES are answered at once, then each waits twice as long as the
# one before (from FIRST_DELAY_S), at most MAX_DELAY_S; an address forgotten after FORGET_S without a failure.
FREE_FAILURES, FIRST_DELAY_S, MAX_DELAY_S, FORGET_S = 5, 0.1, 5.0, 300.0
MAX_TRACKED_ADDRESSES = 10_000


def open_file_share(limit: int) -> int:
    """`limit`, or half this process's open-file limit if that is lower (the rest: replicas, logs, Ray)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return limit if soft == resource.RLIM_INFINITY else max(1, min(limit, soft // 2))


class ConnectionCap:
    """The open client connections of one router process, at most `limit`."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.open = 0
        self.refused = 0

    def protocol(self, handler: asyncio.Protocol) -> asyncio.Protocol:
        return _Counted(self, handler)


class _Counted(asyncio.Protocol):
    """aiohttp's handler of one connection, counted (or refused when the cap is reached). Every call is passed on."""

    __slots__ = ("_cap", "_handler", "_admitted")

    def __init__(self, cap: ConnectionCap, handler: asyncio.Protocol) -> None:
        self._cap, self._handler, self._admitted = cap, handler, False

    def connection_made(self, transport) -> None:
        if self._cap.open >= self._cap.limit:
            self._cap.refused += 1
            transport.write(FULL_ANSWER)
            transport.close()
            return
        self._cap.open += 1
        self._admitted = True
        self._handler.connection_made(transport)

    def connection_lost(self, exc) -> None:
        if self._admitted:
            self._admitted = False
            self._cap.open -= 1
            self._handler.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._admitted:
            self._handler.data_received(data)

    def eof_received(self):
        return self._handler.eof_received() if self._admitted else None

    def pause_writing(self) -> None:
        self._handler.pause_writing()

    def resume_writing(self) -> None:
        self._handler.resume_writing()


class GuardedSite(web.TCPSite):
    """aiohttp's TCPSite, with each connection's handler counted by `cap`."""

    def __init__(self, runner: web.BaseRunner, host: str, port: int, cap: ConnectionCap, **options) -> None:
        super().__init__(runner, host, port, **options)
        self.cap = cap

    async def start(self) -> None:
        self._runner._reg_site(self)  # (BaseSite.start; TCPSite.start, but with the counted protocol)
        server = self._runner.server
        self._server = await asyncio.get_running_loop().create_server(
            lambda: self.cap.protocol(server()),
            self._host,
            self._port,
            backlog=self._backlog,
            reuse_address=self._reuse_address,
            reuse_port=self._reuse_port,
        )
        self._bound_port = self._server.sockets[0].getsockname()[1]


class KeyCheck:
    """401s counted per client address (bounded table) and, past FREE_FAILURES, answered later and later (the keys
    themselves are compared in keyring.accepts)."""

    def __init__(self) -> None:
        self._failures: OrderedDict[str, tuple[int, float]] = OrderedDict()  # address -> (count, last failure)

    def succeeded(self, address: str) -> None:
        if self._failures:
            self._failures.pop(address, None)

    def failure_delay(self, address: str) -> float:
        """Counts a failure of `address`; how long its 401 waits."""
        now = time.monotonic()
        count, last = self._failures.pop(address, (0, now))
        count = 1 if now - last > FORGET_S else count + 1
        self._failures[address] = (count, now)
        while len(self._failures) > MAX_TRACKED_ADDRESSES:
            self._failures.popitem(last=False)
        if count <= FREE_FAILURES:
            return 0.0
        return min(MAX_DELAY_S, FIRST_DELAY_S * 2 ** (count - FREE_FAILURES - 1))


def own_names(host: str, allowed: tuple[str, ...]) -> frozenset[str]:
    """Host names a keyless router answers to: localhost, deploy.host, this machine's names, deploy.allowed_hosts."""
    names = {"localhost", host.lower(), socket.gethostname().lower(), socket.getfqdn().lower()}
    return frozenset(names | {name.lower() for name in allowed})


def host_allowed(host_header: str | None, names: frozenset[str]) -> bool:
    """May a request with this Host header be answered without a key? An IP address (a page on another site cannot
    make a browser send one of ours as Host: DNS rebinding needs a name), or one of `names`, or *.localhost."""
    if not host_header:
        return True  # HTTP/1.0 without Host: no browser sends that
    host = host_header.strip().lower()
    if host.startswith("["):  # [v6]:port
        return True
    name = host.rsplit(":", 1)[0] if host.count(":") == 1 else host
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        pass
    return name in names or name.endswith(".localhost")


class BodyBudget:
    """The bytes of request bodies being read and parsed at once in this process, at most `limit`."""

    def __init__(self) -> None:
        self.taken = 0

    def take(self, size: int, limit: int) -> bool:
        if self.taken + size > limit and self.taken > 0:
            return False
        self.taken += size
        return True

    def give_back(self, size: int) -> None:
        self.taken -= size
