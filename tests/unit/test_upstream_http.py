"""The router's own HTTP/1.1 client (flagscale/router/upstream_http.py) against real aiohttp servers on loopback:
answers read whole and relayed piece by piece, kept-alive connections reused, the replica not read while the
sink is full, and every way an answer can fail named as ConnectFailed or Disconnected."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from aiohttp import web

from flagscale.net import free_port
from flagscale.router.upstream_http import ConnectFailed, Disconnected, UpstreamClient
from tests.conftest import serve


def run(coro):
    return asyncio.run(coro)


class Replica:
    """An aiohttp server that remembers which connection (peer port) each request came on."""

    def __init__(self) -> None:
        self.peers: list[int] = []
        self.written = 0
        self.finished = asyncio.Event()

    async def start(self, big_bytes: int = 0) -> str:
        async def echo(request):
            self.peers.append(request.transport.get_extra_info("peername")[1])
            body = await request.read()
            return web.json_response({"method": request.method, "query": request.query_string, "body": body.decode()})

        async def stream(request):
            self.peers.append(request.transport.get_extra_info("peername")[1])
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for i in range(int(request.query.get("n", "5"))):
                await resp.write(f"data: {i}\n\n".encode())
            await resp.write_eof()
            return resp

        async def big(request):
            resp = web.StreamResponse()
            await resp.prepare(request)
            piece = b"x" * 65536
            while self.written < big_bytes:
                await resp.write(piece)
                self.written += len(piece)
            await resp.write_eof()
            self.finished.set()
            return resp

        async def broken(request):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await resp.write(b"data: 0\n\n")
            request.transport.close()
            return resp

        app = web.Application()
        app.router.add_route("*", "/echo", echo)
        app.router.add_get("/stream", stream)
        app.router.add_get("/big", big)
        app.router.add_get("/broken", broken)
        self.runner, port = await serve(app)
        return f"http://127.0.0.1:{port}"


def collecting(pieces: list[bytes]):
    """A sink that keeps every piece and never says it is full."""

    def sink(piece: bytes) -> bool:
        pieces.append(piece)
        return True

    return sink


async def no_drain() -> None:
    pass


@contextlib.asynccontextmanager
async def replica_and_client(big_bytes: int = 0, keepalive_s: float = 4.0):
    """A Replica and a client for it: (replica, its URL, client); both closed at the end."""
    replica, upstream = Replica(), UpstreamClient(keepalive_s=keepalive_s, connect_timeout_s=2.0)
    url = await replica.start(big_bytes)
    try:
        yield replica, url, upstream
    finally:
        upstream.close()
        await replica.runner.cleanup()


@contextlib.asynccontextmanager
async def raw_server(handler):
    """An asyncio server answering with `handler(reader, writer)` byte for byte: its URL, and a client for it."""
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    upstream = UpstreamClient(keepalive_s=4.0, connect_timeout_s=2.0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", upstream
    finally:
        upstream.close()
        server.close()


def test_answers_read_whole_and_kept_alive_connections_reused():
    async def main():
        async with replica_and_client() as (replica, url, upstream):
            for i in range(3):
                answer = await upstream.request("POST", f"{url}/echo?i={i}", b"hello", {"Content-Type": "text/plain"})
                assert answer.status == 200 and answer.headers["content-type"].startswith("application/json")
                assert b'"body": "hello"' in await answer.read() and b'"query": "i=' in (await answer.read())
                answer.close()
            answer = await upstream.request("GET", f"{url}/echo", b"", {})
            assert b'"method": "GET"' in await answer.read()
            answer.close()
            assert len(set(replica.peers)) == 1, replica.peers  # one connection for all four
            answer = await upstream.request("GET", f"{url}/echo", b"", {}, keep_alive=False)
            await answer.read()
            answer.close()
            answer = await upstream.request("GET", f"{url}/echo", b"", {})
            await answer.read()
            assert len(set(replica.peers)) == 2, replica.peers  # the one asked to close was not reused

    run(main())


def test_idle_connections_older_than_keepalive_are_not_reused():
    async def main():
        async with replica_and_client(keepalive_s=0.2) as (replica, url, upstream):
            for _ in range(2):
                answer = await upstream.request("GET", f"{url}/echo", b"", {})
                await answer.read()
                answer.close()
                await asyncio.sleep(0.4)
            assert len(set(replica.peers)) == 2

    run(main())


def test_a_stream_is_relayed_piece_by_piece_and_its_connection_reused():
    async def main():
        async def drain():
            raise AssertionError("the sink never said it was full")

        async with replica_and_client() as (replica, url, upstream):
            for _ in range(2):
                pieces: list[bytes] = []
                answer = await upstream.request("GET", f"{url}/stream?n=50", b"", {})
                assert answer.headers["Content-Type"] == "text/event-stream"
                await answer.relay(collecting(pieces), drain)
                answer.close()
                assert b"".join(pieces) == b"".join(f"data: {i}\n\n".encode() for i in range(50))
            assert len(set(replica.peers)) == 1

    run(main())


def test_the_replica_is_not_read_while_the_sink_is_full():
    total = 64 * 1024 * 1024  # far beyond what the sockets' buffers hold between the replica and the client

    async def main():
        received = 0
        full = True
        released = asyncio.Event()
        drained = asyncio.Event()

        def sink(piece: bytes) -> bool:
            nonlocal received
            received += len(piece)
            return not full

        async def drain():
            drained.set()
            await released.wait()

        async with replica_and_client(big_bytes=total) as (replica, url, upstream):
            answer = await upstream.request("GET", f"{url}/big", b"", {})
            relaying = asyncio.create_task(answer.relay(sink, drain))
            await asyncio.wait_for(drained.wait(), 10)
            await asyncio.sleep(1.0)  # unpaused, loopback would carry all 64 MiB in far less
            assert not replica.finished.is_set() and received < total // 4, (received, replica.written)
            full = False
            released.set()
            await asyncio.wait_for(relaying, 60)
            assert received == total and replica.finished.is_set()
            answer.close()

    run(main())


def test_failures_are_named():
    async def main():
        with pytest.raises(ConnectFailed, match="cannot connect to 127.0.0.1"):
            await UpstreamClient(4.0, 2.0).request("GET", f"http://127.0.0.1:{free_port()}/x", b"", {})

        async def not_http(reader, writer):
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"SPDY/9 nonsense\r\n\r\n")
            await writer.drain()
            await asyncio.sleep(5)

        async def silent_close(reader, writer):
            await reader.readuntil(b"\r\n\r\n")
            writer.close()

        for handler, match in ((not_http, "not valid HTTP"), (silent_close, "connection closed")):
            async with raw_server(handler) as (url, upstream):
                with pytest.raises(Disconnected, match=match):
                    await upstream.request("GET", f"{url}/x", b"", {})

        async with replica_and_client() as (replica, url, upstream):
            answer = await upstream.request("GET", f"{url}/broken", b"", {})
            pieces: list[bytes] = []
            with pytest.raises(Disconnected):
                await answer.relay(collecting(pieces), no_drain)
            assert pieces == [b"data: 0\n\n"]
            answer.close()

    run(main())


def test_a_failing_sink_fails_the_relay_and_the_connection_is_not_reused():
    async def main():
        def sink(piece: bytes) -> bool:
            raise ValueError("relay bug")

        async with replica_and_client() as (replica, url, upstream):
            answer = await upstream.request("GET", f"{url}/stream?n=200", b"", {})
            with pytest.raises(ValueError, match="relay bug"):
                await answer.relay(sink, no_drain)
            answer.close()
            answer = await upstream.request("GET", f"{url}/echo", b"", {})
            await answer.read()
            assert len(set(replica.peers)) == 2

    run(main())


def test_a_connection_whose_answer_came_in_while_its_relay_waited_serves_the_next_request():
    """The relay of a finished answer still waits for its client (drain): the connection, back in the pool,
    must not stay paused for the next request on it."""

    async def main():
        released = asyncio.Event()

        async def drain():
            await released.wait()

        async with replica_and_client() as (replica, url, upstream):
            answer = await upstream.request("GET", f"{url}/stream?n=3", b"", {})
            await asyncio.sleep(0.2)  # the whole (small) answer is in before the relay starts
            relaying = asyncio.create_task(answer.relay(lambda piece: False, drain))

            async def answer_in() -> None:
                while not answer.complete:
                    await asyncio.sleep(0.05)

            await asyncio.wait_for(answer_in(), 10)
            second = await asyncio.wait_for(upstream.request("GET", f"{url}/stream?n=3", b"", {}), 5)
            pieces: list[bytes] = []
            await asyncio.wait_for(second.relay(collecting(pieces), drain), 5)
            assert b"".join(pieces) == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"
            assert len(set(replica.peers)) == 1  # the same connection carried both
            released.set()
            await asyncio.wait_for(relaying, 5)

    run(main())


def test_an_interim_answer_is_skipped():
    async def main():
        async def continue_first(reader, writer):
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 2\r\n\r\nok")
            await writer.drain()
            await asyncio.sleep(1)
            writer.close()

        async with raw_server(continue_first) as (url, upstream):
            answer = await upstream.request("POST", f"{url}/x", b"{}", {})
            assert (answer.status, answer.headers["Content-Type"], await answer.read()) == (200, "text/plain", b"ok")
            answer.close()

    run(main())


def test_an_answer_that_lasts_until_its_connection_closes_is_whole_then():
    async def main():
        async def until_close(reader, writer):
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nhello ")
            await writer.drain()
            await asyncio.sleep(0.1)
            writer.write(b"world")
            await writer.drain()
            writer.close()

        async with raw_server(until_close) as (url, upstream):
            answer = await upstream.request("GET", f"{url}/x", b"", {})
            assert await asyncio.wait_for(answer.read(), 5) == b"hello world"
            answer.close()

    run(main())
