"""One client request as the router carries it from replica to replica (Exchange), and the hot path of a
streamed answer: each piece from the replica's connection (upstream_http) goes through ClientStream.feed
(resume.py) straight to the client's transport in Exchange.relay_piece, with no task woken per piece."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from flagscale.router.policies import Policy, RequestInfo
from flagscale.router.resume import ClientStream

# A client's unsent bytes beyond which its replica is not read until the client takes them (uvloop's and
# asyncio's default high-water mark for a transport, at which aiohttp's writer waits too).
CLIENT_BUFFER_BYTES = 64 * 1024


@dataclass
class Exchange:
    """One client request as the router carries it from replica to replica."""

    http: Any  # the client's aiohttp request
    model: str
    policy: Policy
    info: RequestInfo
    body: bytes
    stream: ClientStream | None  # completions and chat streams: relayed event by event
    max_moves: int  # times it may move to another replica after one failed it (routing_options.max_migrations)
    headers: dict = field(default_factory=dict)
    target: str = ""  # the path (and query) sent to a replica: the one the public surface allowed
    inference: bool = True  # the engine runs the model on that path (a 5xx there is the replica failing)
    tried: set[str] = field(default_factory=set)  # replica ids: each gets the request at most once
    moves: int = 0
    engine_deaths: int = 0  # replicas whose connection broke off during this request (RETRIES_AFTER_ENGINE_DEATH)
    key_refusals: int = 0  # replicas that refused the router's engine key (401) during this request
    unreachable: int = 0
    refreshed: bool = False  # it ran out of replicas and had the router read the registry again (once per request)
    failure: str = ""  # why the last replica that had it failed
    last_answer: Any = None  # the last 5xx answer, returned as is when no replica is left
    response: Any = None  # the client's stream response, once begun
    writer: Any = None  # its aiohttp writer
    client: Any = None  # the client's connection (asyncio transport) the stream is written to
    chunked: bool = True  # its body is framed in chunks
    plain_body: bytes | None = None  # disaggregated: the request without the KV transfer parameters
    fingerprint: str | None = None  # once the client has part of a stream: the fingerprint of the model making it
    other_versions: bool = False  # replicas were passed over to resume it: they run another version of the model
    kv_pending: dict | None = None  # a prefill's KV transfer parameters no decode replica has answered for yet
    started: float = field(default_factory=time.monotonic)
    first_byte_at: float | None = None  # when the client got the first byte of its answer
    sent_bytes: int = 0

    async def begin_stream(self, response) -> None:
        """Sends the client the head of its streamed answer; the body follows through relay_piece and write."""
        self.response = response
        self.writer = await response.prepare(self.http)
        self.client = self.http.transport
        self.chunked = self.http.version >= (1, 1)  # aiohttp frames the body in chunks for HTTP/1.1 clients

    def relay_piece(self, data: bytes) -> bool:
        """A piece of the replica's streamed body, straight from its connection (upstream_http): the events
        for the client (ClientStream.feed) are written to the client's connection here, framed as aiohttp
        frames the rest of the answer. False: the client's buffer is full or the client is gone."""
        out = self.stream.feed(data) if self.stream is not None else data
        transport = self.client
        if transport is None or transport.is_closing():
            return False
        if not out:
            return True
        self.answer_began()
        self.sent_bytes += len(out)
        transport.write(b"%x\r\n%b\r\n" % (len(out), out) if self.chunked else out)
        return transport.get_write_buffer_size() <= CLIENT_BUFFER_BYTES

    async def drain(self) -> None:
        """Waits for the client to take what it was sent (relay_piece said it was full)."""
        if self.client is None or self.client.is_closing():
            raise ConnectionResetError("the client went away")
        await self.writer.drain()

    async def write(self, data: bytes) -> None:
        """Bytes of a streamed answer to the client."""
        self.answer_began()
        self.sent_bytes += len(data)
        await self.response.write(data)

    def answer_began(self) -> None:
        """The client gets the first byte of its answer now (once: later calls do nothing): timed, and the policy
        told (the request's prefill is done)."""
        if self.first_byte_at is None:
            self.first_byte_at = time.monotonic()
            self.policy.first_byte(self.info)

    def with_kv(self, payload: dict, kv: dict) -> None:
        """A disaggregated request goes to decode with the prefill's KV transfer parameters."""
        self.plain_body = self.body
        self.kv_pending = kv
        with_kv = {**payload, "kv_transfer_params": kv}
        self.body = json.dumps(with_kv).encode()
        if self.stream is not None:
            self.stream.body = with_kv

    def without_kv(self) -> None:
        """Sent again elsewhere: that replica computes the prompt itself (the KV blocks were for the first)."""
        if self.plain_body is not None:
            self.body = self.plain_body
            if self.stream is not None:
                self.stream.body = {k: v for k, v in self.stream.body.items() if k != "kv_transfer_params"}
