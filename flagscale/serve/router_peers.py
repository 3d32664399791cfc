"""What the router processes of one deployment share (deploy.router_processes, docs/design.md).

Every router process is a full router of its own (policies, queues, circuit breakers); they share the port with
SO_REUSEPORT and the kernel spreads client connections over them. Three things need all of them, and go through
Ray's GCS key-value store, as the replica registry does (flagscale/serve/registry.py):

- each process publishes a report on every refresh: its stats (Router.stats's shape) and its own
  `flagscale_router_*` series, so that `stats` and `/metrics` on any one process answer for all of them;
- `stop` drains them all: the process asked to drain sets a drain request (with a deadline), every process
  looks for it every refresh and stops taking requests, and the one asked waits until every process has
  reported draining with nothing in flight.

And one thing goes directly from process to process: routing hints (RoutingHints). Whenever a process sends a
prompt to a replica, it tells the others which replica got which prefix-table keys, over loopback UDP (the
processes all run on the endpoint's host), so every process's cache_aware table learns every prompt and they
all route a prefix to where it went first, as one router would. A lost datagram costs a possible cache miss,
never a request.

A process that dies stops publishing; its report is dropped once older than STALE_AFTER_S.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import time
from dataclasses import asdict, dataclass
from typing import Any

from flagscale.cluster.ray_compat import kv_del, kv_get, kv_list, kv_put
from flagscale.serve.routing import PREFIX_KEY_BYTES

KV_NAMESPACE = "flagscale"
STALE_AFTER_S = 10.0  # a report not refreshed for this long is a process that is gone
DRAIN_POLL_S = 0.25  # how often a draining process reports
HINT_MAX_KEYS = 4096  # the prompt's first this many prefix blocks go in one hint (one datagram, < 64 KiB)


@dataclass
class PeerReport:
    process: str  # "<host>:<pid>"
    pid: int
    started_at: float
    updated_at: float
    stats: dict[str, Any]  # Router._collect_stats of that process
    metrics: str  # its own flagscale_router_* series, Prometheus text
    hints_port: int = 0  # the loopback UDP port it takes routing hints on (0: none)

    @property
    def stale(self) -> bool:
        return time.time() - self.updated_at > STALE_AFTER_S


def this_process() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def _prefix(app: str) -> bytes:
    return f"routers/{app}/".encode()


def _drain_key(app: str) -> bytes:
    return f"router-drain/{app}".encode()


def publish(app: str, report: PeerReport) -> None:
    report.updated_at = time.time()
    kv_put(_prefix(app) + report.process.encode(), json.dumps(asdict(report)).encode(), namespace=KV_NAMESPACE)


def withdraw(app: str, process: str) -> None:
    kv_del(_prefix(app) + process.encode(), namespace=KV_NAMESPACE)


def reports(app: str) -> list[PeerReport]:
    """Every live router process's last report."""
    found = []
    for key in kv_list(_prefix(app), namespace=KV_NAMESPACE):
        raw = kv_get(key, namespace=KV_NAMESPACE)
        if raw is None:
            continue
        report = PeerReport(**json.loads(raw))
        if not report.stale:
            found.append(report)
    return found


def request_drain(app: str, timeout_s: float) -> None:
    now = time.time()
    kv_put(_drain_key(app), json.dumps({"set_at": now, "until": now + timeout_s}).encode(), namespace=KV_NAMESPACE)


def drain_requested(app: str, started_at: float) -> bool:
    """Is a drain under way that concerns a process started at `started_at`? (A request set before the process
    started belongs to an earlier deployment of the same name.)"""
    raw = kv_get(_drain_key(app), namespace=KV_NAMESPACE)
    if raw is None:
        return False
    request = json.loads(raw)
    return request["set_at"] >= started_at and time.time() < request["until"]


def merge_stats(by_process: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Several processes' stats -> one: totals and per-replica counts summed, a replica's circuit the worst any
    process sees, its prefix table the largest; under "processes", each process's own load."""
    merged: dict[str, Any] = {"inflight": 0, "moved": 0, "resumed": 0, "replicas": {}, "processes": {}}
    severity = {"closed": 0, "half_open": 1, "open": 2}
    for process, stats in sorted(by_process.items()):
        for key in ("inflight", "moved", "resumed"):
            merged[key] += stats.get(key, 0)
        served = 0
        for replica_id, entry in stats.get("replicas", {}).items():
            served += entry.get("served", 0)
            into = merged["replicas"].get(replica_id)
            if into is None:
                merged["replicas"][replica_id] = dict(entry)
                continue
            for key in ("served", "inflight", "migrations", "circuit_opened", "sessions"):
                if key in entry:
                    into[key] = into.get(key, 0) + entry[key]
            if "prefix_blocks" in entry:
                into["prefix_blocks"] = max(into.get("prefix_blocks", 0), entry["prefix_blocks"])
            if severity.get(entry.get("circuit"), 0) > severity.get(into.get("circuit"), 0):
                into["circuit"] = entry["circuit"]
        merged["processes"][process] = {
            "pid": stats.get("pid"),
            "inflight": stats.get("inflight", 0),
            "served": served,
            "moved": stats.get("moved", 0),
            "resumed": stats.get("resumed", 0),
            "draining": stats.get("draining", False),
        }
    return merged


class RoutingHints(asyncio.DatagramProtocol):
    """This process's end of the routing hints: `send` tells every peer (their ports, from their reports) where a
    prompt went; a hint that comes in is handed to `on_hint(pool, model, replica_id, keys)`."""

    def __init__(self, on_hint) -> None:
        self.on_hint = on_hint
        self.peers: list[int] = []
        self.transport: asyncio.DatagramTransport | None = None

    @classmethod
    async def open(cls, on_hint) -> RoutingHints:
        hints = cls(on_hint)
        await asyncio.get_running_loop().create_datagram_endpoint(lambda: hints, local_addr=("127.0.0.1", 0))
        return hints

    @property
    def port(self) -> int:
        return self.transport.get_extra_info("sockname")[1] if self.transport else 0

    def connection_made(self, transport) -> None:
        self.transport = transport

    def send(self, pool: str, model: str, replica_id: str, keys: list[bytes]) -> None:
        message = encode_hint(pool, model, replica_id, keys)
        for port in self.peers:
            self.transport.sendto(message, ("127.0.0.1", port))

    def datagram_received(self, data: bytes, addr) -> None:
        if addr[0] != "127.0.0.1":
            return
        try:
            hint = decode_hint(data)
        except ValueError:
            return
        self.on_hint(*hint)

    def error_received(self, exc: Exception) -> None:
        pass  # a peer that went away: its port leaves the list at the next refresh


def encode_hint(pool: str, model: str, replica_id: str, keys: list[bytes]) -> bytes:
    head = json.dumps([pool, model, replica_id]).encode()
    return head + b"\n" + b"".join(keys[:HINT_MAX_KEYS])


def decode_hint(data: bytes) -> tuple[str, str, str, list[bytes]]:
    head, sep, body = data.partition(b"\n")
    if not sep or len(body) % PREFIX_KEY_BYTES:
        raise ValueError("not a routing hint")
    pool, model, replica_id = json.loads(head)
    keys = [body[i : i + PREFIX_KEY_BYTES] for i in range(0, len(body), PREFIX_KEY_BYTES)]
    return pool, model, replica_id, keys
