"""What the router processes of one deployment share (deploy.router_processes, docs/design.md).

Every router process is a full router of its own (policies, queues, circuit breakers); they share the port with
SO_REUSEPORT and the kernel spreads client connections over them. Three things need all of them, and go through
Ray's GCS key-value store, as the replica registry does (flagscale/replica/registry.py):

- each process publishes a report on every refresh: its stats (Router.stats's shape) and its own
  `flagscale_router_*` series, so that `stats` and `/metrics` on any one process answer for all of them;
- `stop` drains them all: the process asked to drain sets a drain request (with a deadline), every process
  looks for it every refresh and stops taking requests, and the one asked waits until every process has
  reported draining with nothing in flight.

And one thing goes directly from process to process: routing hints (RoutingHints). Whenever a process sends a
prompt to a replica, it tells the others which replica got which prefix-table keys, over loopback UDP (the
processes all run on the endpoint's host), so every process's cache_aware table learns every prompt and they
all route a prefix to where it went first, as one router would. A lost datagram costs a possible cache miss,
never a request. Any local process can send to those ports, so each hint carries an HMAC under the deployment's
secret (RouterSpec.peer_secret, from a 0600 file in the exp_dir: `secret_of`); one without a valid HMAC, or
naming a replica (or a model of it) this process does not know, is dropped, and a hint's keys are bounded
(HINT_MAX_KEYS), so the prefix tables they feed stay within their own bounds.

A process that dies stops publishing; once its report's `seq` has not advanced for STALE_AFTER_S, as the others
see it by their own clock (flagscale/replica/liveness.py), they drop it and withdraw it from the store.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flagscale.cluster.ray_compat import kv_del, kv_get, kv_list, kv_put
from flagscale.replica.liveness import Liveness
from flagscale.router.policies import RequestInfo
from flagscale.router.policies.base import Replica
from flagscale.router.policies.cache_aware import PREFIX_KEY_BYTES
from flagscale.secrets import secret_file

if TYPE_CHECKING:  # (types only: `status` reads the reports through this module without loading aiohttp)
    from flagscale.router.metrics import RouterMetrics
    from flagscale.router.replicas import Replicas
    from flagscale.router.spec import RouterSpec
    from flagscale.router.state import Counters

log = logging.getLogger("flagscale.router")

KV_NAMESPACE = "flagscale"
STALE_AFTER_S = 10.0  # a report whose seq has not advanced for this long is a process that is gone
DRAIN_POLL_S = 0.25  # how often a draining process reports
HINT_MAX_KEYS = 4096  # the prompt's first this many prefix blocks go in one hint (one datagram, < 64 KiB)
HINT_TAG_BYTES = 32  # a hint's HMAC-SHA256 under the deployment's secret, in front of it
COUNTS = ("inflight", "moved", "resumed", "decode_only", "kv_released")  # a process's counts, summed over processes
SECRET_FILE = "router_peers.secret"  # in the exp_dir, 0600: the deployment's peer secret (secret_of)


def secret_of(exp_dir: str | Path) -> str:
    """The deployment's peer secret: read from the exp_dir's SECRET_FILE, made there (0600) by the first run. The
    same across updates and restarts, so every router process Serve starts for the deployment has it."""
    return secret_file(Path(exp_dir) / SECRET_FILE)


@dataclass
class PeerReport:
    process: str  # "<host>:<pid>"
    pid: int
    started_at: float
    updated_at: float  # the publisher's wall clock: shown, never compared with another process's
    stats: dict[str, Any]  # Router.collect_stats of that process
    metrics: str  # its own flagscale_router_* series, Prometheus text
    hints_port: int = 0  # the loopback UDP port it takes routing hints on (0: none)
    seq: int = 0  # advanced on every publish: readers judge staleness by it (liveness.py)


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


def withdraw_all(app: str) -> None:
    """Every router process's report and the drain mark of `app`: what its routers keep in the key-value store."""
    for key in kv_list(_prefix(app), namespace=KV_NAMESPACE):
        kv_del(key, namespace=KV_NAMESPACE)
    kv_del(_drain_key(app), namespace=KV_NAMESPACE)


def reports(app: str) -> list[PeerReport]:
    """Every router process's last report as stored (the live processes withdraw those gone stale: PeerLink)."""
    found = []
    for key in kv_list(_prefix(app), namespace=KV_NAMESPACE):
        raw = kv_get(key, namespace=KV_NAMESPACE)
        if raw is not None:
            found.append(PeerReport(**json.loads(raw)))
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
    merged: dict[str, Any] = {"replicas": {}, "processes": {}} | dict.fromkeys(COUNTS, 0)
    severity = {"closed": 0, "half_open": 1, "open": 2}
    for process, stats in sorted(by_process.items()):
        for key in COUNTS:
            merged[key] += stats.get(key, 0)
        served = 0
        for replica_id, entry in stats.get("replicas", {}).items():
            served += entry.get("served", 0)
            into = merged["replicas"].get(replica_id)
            if into is None:
                merged["replicas"][replica_id] = dict(entry)
                continue
            for key in ("served", "inflight", "prefill_queue_chars", "migrations", "circuit_opened", "sessions"):
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
    prompt went; a hint that comes in with a valid HMAC under `secret` is handed to
    `on_hint(pool, model, replica_id, keys)`; others are dropped (counted in `dropped`)."""

    def __init__(self, on_hint, secret: str) -> None:
        self.on_hint = on_hint
        self._key = secret.encode()
        self.peers: list[int] = []
        self.transport: asyncio.DatagramTransport | None = None
        self.dropped = 0

    @classmethod
    async def open(cls, on_hint, secret: str) -> RoutingHints:
        hints = cls(on_hint, secret)
        await asyncio.get_running_loop().create_datagram_endpoint(lambda: hints, local_addr=("127.0.0.1", 0))
        return hints

    @property
    def port(self) -> int:
        return self.transport.get_extra_info("sockname")[1] if self.transport else 0

    def connection_made(self, transport) -> None:
        self.transport = transport

    def sign(self, message: bytes) -> bytes:
        return hmac.new(self._key, message, hashlib.sha256).digest() + message

    def send(self, pool: str, model: str, replica_id: str, keys: list[bytes]) -> None:
        datagram = self.sign(encode_hint(pool, model, replica_id, keys))
        for port in self.peers:
            self.transport.sendto(datagram, ("127.0.0.1", port))

    def datagram_received(self, data: bytes, addr) -> None:
        tag, message = data[:HINT_TAG_BYTES], data[HINT_TAG_BYTES:]
        expected = hmac.new(self._key, message, hashlib.sha256).digest()
        if addr[0] != "127.0.0.1" or not hmac.compare_digest(tag, expected):
            self.dropped += 1
            return
        try:
            hint = decode_hint(message)
        except ValueError:
            self.dropped += 1
            return
        self.on_hint(*hint)

    def error_received(self, exc: Exception) -> None:
        pass  # a peer that went away: its port leaves the list at the next refresh


def encode_hint(pool: str, model: str, replica_id: str, keys: list[bytes]) -> bytes:
    head = json.dumps([pool, model, replica_id]).encode()
    return head + b"\n" + b"".join(keys[:HINT_MAX_KEYS])


def decode_hint(data: bytes) -> tuple[str, str, str, list[bytes]]:
    head, sep, body = data.partition(b"\n")
    if not sep or len(body) % PREFIX_KEY_BYTES or len(body) > HINT_MAX_KEYS * PREFIX_KEY_BYTES:
        raise ValueError("not a routing hint")
    try:
        pool, model, replica_id = json.loads(head)
    except (ValueError, TypeError) as exc:
        raise ValueError("not a routing hint") from exc
    if not all(isinstance(s, str) for s in (pool, model, replica_id)):
        raise ValueError("not a routing hint")
    keys = [body[i : i + PREFIX_KEY_BYTES] for i in range(0, len(body), PREFIX_KEY_BYTES)]
    return pool, model, replica_id, keys


class PeerLink:
    """A router process's side of the sharing: its report out and the others' in, the drain they share, the routing
    hints. `spec` gives the router's current spec; `replicas`, the table and policies hints feed; `counters`, its
    load and drain state; `metrics`, its own series; `own_stats`, its stats (Router.collect_stats)."""

    def __init__(
        self,
        spec: Callable[[], RouterSpec],
        replicas: Replicas,
        counters: Counters,
        metrics: RouterMetrics,
        own_stats: Callable[[], dict[str, Any]],
    ) -> None:
        self._spec, self._replicas, self._counters = spec, replicas, counters
        self._metrics, self._own_stats = metrics, own_stats
        self.process = this_process()
        self.started_at = time.time()
        self.sharing = False  # shares reports and drains with the other router processes (spec.share_with_peers)
        self.hints: RoutingHints | None = None  # the datagram endpoint routing hints come in on
        self.peer_reports: list[PeerReport] = []  # the other processes' last reports
        # this process's reports' seq, each one higher; the others' reports' liveness, by this process's clock
        self.seq, self.liveness = 0, Liveness(STALE_AFTER_S)

    async def start_sharing(self) -> None:
        """spec.share_with_peers: the hints' endpoint opened, the first report out, the drain watched."""
        self.sharing = True
        secret = self._spec().peer_secret
        if secret:  # (without one, no hints: they could not be told from anyone else's)
            self.hints = await RoutingHints.open(self.learn_hint, secret)
        await self.publish()
        asyncio.get_running_loop().create_task(self.watch_drain())

    def router_series(self) -> list[tuple[dict[str, str], str]]:
        """Every router process's own series, labelled by process (the others' as of their last report)."""
        series = [({"router_process": self.process}, self._metrics.text().decode())]
        return series + [({"router_process": r.process}, r.metrics) for r in self.peer_reports]

    async def publish(self) -> None:
        """This process's report out, the others' in (and so where their routing hints go)."""
        self.seq += 1
        report = PeerReport(
            process=self.process,
            pid=os.getpid(),
            started_at=self.started_at,
            updated_at=0.0,
            stats=self._own_stats(),
            metrics=self._metrics.text().decode(),
            hints_port=self.hints.port if self.hints else 0,
            seq=self.seq,
        )
        app = self._spec().app
        try:
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(None, publish, app, report)
            found = await loop.run_in_executor(None, self.live_reports, app)
        except Exception as exc:  # GCS hiccup: the next refresh tries again
            log.warning("publishing the router's report failed: %s", exc)
            return
        self.peer_reports = [r for r in found if r.process != self.process]
        if self.hints is not None:
            self.hints.peers = [r.hints_port for r in self.peer_reports if r.hints_port]

    def live_reports(self, app: str) -> list[PeerReport]:
        """The reports whose seq this process saw advance within STALE_AFTER_S; stale ones withdrawn."""
        live, stale = self.liveness.split(reports(app), lambda r: r.process)
        for report in stale:
            log.warning("router process %s: no report for %g s; withdrawn", report.process, STALE_AFTER_S)
            withdraw(app, report.process)
        return live

    async def watch_drain(self) -> None:
        """Another process was asked to drain the deployment (stop): this one drains too (it looks every refresh:
        the one asked waits until every process has reported draining), then reports every DRAIN_POLL_S so that
        the one asked sees when nothing is in flight anywhere."""
        counters = self._counters
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(DRAIN_POLL_S if counters.draining else self._spec().refresh_s)
            if not counters.draining:
                try:
                    asked = await loop.run_in_executor(None, drain_requested, self._spec().app, self.started_at)
                except Exception:
                    continue
                counters.draining = asked
            if counters.draining:
                await self.publish()

    async def drain(self, timeout_s: float) -> int:
        """Refuse new requests and wait (bounded) for in-flight ones, in every router process of the deployment
        (the others see the drain request within DRAIN_POLL_S); returns how many were still running."""
        counters = self._counters
        counters.draining = True
        deadline, sharing = time.monotonic() + timeout_s, self.sharing
        before: dict[str, int] = {}  # each process's report seq as a read after the drain request found it
        if sharing:
            try:
                await asyncio.to_thread(request_drain, self._spec().app, timeout_s)
                before = {r.process: r.seq for r in await asyncio.to_thread(reports, self._spec().app)}
            except Exception as exc:
                log.warning("could not ask the other router processes to drain: %s", exc)
                sharing = False
        others = 0
        while time.monotonic() < deadline:
            if sharing:
                others = await asyncio.to_thread(self._others_inflight, before)
            if not counters.inflight and not others:
                break
            await asyncio.sleep(DRAIN_POLL_S)
        return counters.inflight + others

    def _others_inflight(self, before: dict[str, int]) -> int:
        """Requests the other processes still hold (one for a process that has not reported draining since the
        drain request: a report whose seq is above `before`'s, read after the request, was published after it)."""
        left = 0
        for report in (r for r in self.live_reports(self._spec().app) if r.process != self.process):
            drained = report.seq > before.get(report.process, 0) and report.stats.get("draining")
            left += report.stats.get("inflight", 0) if drained else max(1, report.stats.get("inflight", 0))
        return left

    def stats(self, own: dict[str, Any]) -> dict[str, Any]:
        """This process's stats merged with the others' (as of their last report)."""
        by_process = {self.process: own}
        if self.sharing:
            try:
                others = self.live_reports(self._spec().app)
            except Exception:
                others = self.peer_reports
            by_process.update({r.process: r.stats for r in others if r.process != self.process})
        return merge_stats(by_process)

    def send_hint(self, pool: str, model: str, upstream: Replica, info: RequestInfo) -> None:
        """Tell the other processes where this prompt went, so their cache-aware tables learn it too."""
        hints = self.hints
        keys = info.memo.get("prefix_keys")
        if keys and hints is not None and hints.peers:
            hints.send(pool, model, upstream.replica_id, keys)

    def learn_hint(self, pool: str, model: str, replica_id: str, keys: list[bytes]) -> None:
        """A peer's hint, learnt if it names a replica of that pool and model this process knows (a replica it
        does not know would only grow its tables: it learns of replicas from the registry, not from hints)."""
        prefill = pool == "prefill"
        upstream = self._replicas.table.by_replica.get(replica_id)
        if upstream is None or model not in upstream.record.models or prefill != (upstream.record.role == "prefill"):
            if self.hints is not None:
                self.hints.dropped += 1
            return
        policy = self._replicas.policy(model, prefill)
        if policy is not None:
            policy.learn(replica_id, keys)
