"""Which KV-cache blocks each replica's engine holds, as its own events say (docs/routing.md, "The engines' own KV
events"): one ReplicaIndex per replica, fed the engine's event batches in sequence order by kv_events.py.

Pure logic (no sockets): an event batch is what the engine's publisher packs, decoded to plain values
(`[ts, [event, ...], dp_rank]`, each event a dict with a "type": BlockStored / BlockRemoved / AllBlocksCleared).
Blocks are keyed by the engine's block hash, as a 64-bit integer (the engine's events carry that form by default;
a byte hash is cut to it the same way, kv_keys.block_key). Memory is bounded by a block count per replica, not by
prompt text: past `max_blocks` the oldest blocks of the replica go first (counted).
"""

from __future__ import annotations

import sys
from collections import deque
from dataclasses import dataclass, field
from typing import Any

GPU, CPU = "GPU", "CPU"  # the engine's media; an event without one is about its GPU (device) cache
MAX_INDEXED_BLOCKS = 262_144  # per replica: ~20 MB of index, more blocks than an H200's KV cache of a small model
RATE_WINDOW_S = 10.0  # events per second: over this window
SILENT_AFTER_S = 15.0  # a replica sent new blocks that publishes nothing for this long is taken for silent

# what apply() found
APPLIED, DUPLICATE, GAP, RESTARTED = "applied", "duplicate", "gap", "restarted"


def block_key(block_hash: Any) -> int:
    """An engine block hash as the index keys it: the low 64 bits of a byte hash (as vLLM's own events cut it), an
    integer as its 64 bits unsigned."""
    if isinstance(block_hash, (bytes, bytearray)):
        return int.from_bytes(block_hash, "big") & 0xFFFF_FFFF_FFFF_FFFF
    return int(block_hash) & 0xFFFF_FFFF_FFFF_FFFF  # a signed 64-bit one (SGLang's) as the same bits unsigned


def _stamp(batch: Any) -> float:
    """The engine's time stamp on a batch (its first field); -inf when it has none."""
    if isinstance(batch, (list, tuple)) and batch and isinstance(batch[0], (int, float)):
        return float(batch[0])
    return float("-inf")


@dataclass
class ReplicaIndex:
    """One replica's blocks by medium (insertion order: oldest first), and its stream's bookkeeping."""

    max_blocks: int = MAX_INDEXED_BLOCKS
    media: dict[str, dict[int, None]] = field(default_factory=lambda: {GPU: {}})
    last_seq: int = -1  # the last batch applied
    last_stamp: float = float("-inf")  # the engine's time stamp on the latest batch applied
    block_size: int | None = None  # tokens per block, from the engine's BlockStored events
    synced: bool = False  # a replay since the subscription began has been applied: the index is whole
    replays: int = 0
    gaps: int = 0  # sequence gaps seen (each asked a replay)
    lost: int = 0  # batches neither the stream nor a replay delivered (the replay buffer no longer had them)
    restarts: int = 0  # the publisher began again from sequence 0 (its engine restarted)
    cleared: int = 0  # AllBlocksCleared events
    reset_at: float = float("-inf")  # when the index last found its engine's cache emptied (cleared, restarted)
    evicted: int = 0  # blocks dropped by max_blocks
    events: int = 0
    last_event_at: float | None = None
    expecting_since: float | None = None  # sent a request with new blocks, no event since
    _times: deque = field(default_factory=deque)

    @property
    def blocks(self) -> int:
        return sum(len(hashes) for hashes in self.media.values())

    def apply(self, seq: int, batch: Any, now: float, replaying: bool = False) -> str:
        """Apply batch `seq` (`replaying`: it comes from the replay endpoint): APPLIED; DUPLICATE (applied already:
        a replay overlapping the stream); GAP (batches missing before it) or RESTARTED (a new publisher: the index
        was cleared): nothing applied, the caller asks a replay from last_seq + 1."""
        if seq <= self.last_seq:
            if replaying or _stamp(batch) <= self.last_stamp:
                return DUPLICATE
            # an earlier sequence number with a later stamp than anything applied: a new publisher (its engine
            # restarted), whose cache began empty; the caller replays it from its start
            self.clear(now)
            self.restarts += 1
            self.last_seq, self.last_stamp = -1, float("-inf")
            return RESTARTED
        if seq > self.last_seq + 1 and not replaying:
            self.gaps += 1
            return GAP
        if seq > self.last_seq + 1:  # a replay that starts after what was missing: older ones are gone
            self.lost += seq - self.last_seq - 1
        self._apply_events(batch, now)
        self.last_seq = seq
        return APPLIED

    def _apply_events(self, batch: Any, now: float) -> None:
        events = batch[1] if isinstance(batch, (list, tuple)) and len(batch) > 1 else []
        for event in events:
            if not isinstance(event, dict):
                continue
            kind = event.get("type")
            if kind == "BlockStored":
                self._store(event)
            elif kind == "BlockRemoved":
                hashes = self.media.get(event.get("medium") or GPU, {})
                for block_hash in event.get("block_hashes") or ():
                    hashes.pop(block_key(block_hash), None)
            elif kind == "AllBlocksCleared":
                self.clear(now)
                self.cleared += 1
        self.events += len(events)
        self.last_stamp = max(self.last_stamp, _stamp(batch))
        self.last_event_at = now
        self.expecting_since = None
        self._times.append((now, len(events)))
        while self._times and self._times[0][0] < now - RATE_WINDOW_S:
            self._times.popleft()

    def _store(self, event: dict) -> None:
        if event.get("block_size"):
            self.block_size = int(event["block_size"])
        hashes = self.media.setdefault(event.get("medium") or GPU, {})
        for block_hash in event.get("block_hashes") or ():
            key = block_key(block_hash)
            hashes.pop(key, None)  # stored again: the newest
            hashes[key] = None
        over = self.blocks - self.max_blocks
        while over > 0:
            largest = max(self.media.values(), key=len)
            del largest[next(iter(largest))]
            self.evicted += 1
            over -= 1

    def clear(self, now: float) -> None:
        for hashes in self.media.values():
            hashes.clear()
        self.reset_at = now

    def depth(self, keys: list[int]) -> tuple[int, int]:
        """How many leading blocks of `keys` the replica holds: on its GPU, and on its GPU or CPU tier."""
        gpu, tiers = self.media.get(GPU, {}), list(self.media.values())
        on_gpu = 0
        for key in keys:
            if key not in gpu:
                break
            on_gpu += 1
        anywhere = on_gpu
        for key in keys[on_gpu:]:
            if not any(key in hashes for hashes in tiers):
                break
            anywhere += 1
        return on_gpu, anywhere

    def expect(self, now: float) -> None:
        """A request that will store new blocks was sent: an event should follow."""
        if self.expecting_since is None:
            self.expecting_since = now

    def silent(self, now: float) -> bool:
        return self.expecting_since is not None and now - self.expecting_since > SILENT_AFTER_S

    def live(self, now: float) -> bool:
        """Whether routing may go by this index: whole (replayed) and not silent while sent work."""
        return self.synced and not self.silent(now)

    def state(self, now: float) -> str:
        if not self.synced:
            return "syncing"
        return "silent" if self.silent(now) else "live"

    def events_per_s(self, now: float) -> float:
        recent = sum(count for at, count in self._times if at >= now - RATE_WINDOW_S)
        return round(recent / RATE_WINDOW_S, 2)

    def memory_bytes(self) -> int:
        """What the index holds in memory, roughly: its tables and their integer keys."""
        return sum(sys.getsizeof(hashes) + 32 * len(hashes) for hashes in self.media.values())

    def stats(self, now: float) -> dict[str, Any]:
        return {
            "blocks": self.blocks,
            "events_per_s": self.events_per_s(now),
            "last_seq": self.last_seq,
            "replays": self.replays,
            "gaps": self.gaps,
            "lost": self.lost,
            "restarts": self.restarts,
            "evicted": self.evicted,
            "live": self.live(now),
            "state": self.state(now),
            "memory_bytes": self.memory_bytes(),
        }


class KVIndex:
    """Every followed replica's ReplicaIndex, by replica id."""

    def __init__(self, max_blocks: int = MAX_INDEXED_BLOCKS) -> None:
        self.max_blocks = max_blocks
        self.replicas: dict[str, ReplicaIndex] = {}

    def follow(self, replica_id: str) -> ReplicaIndex:
        index = self.replicas.get(replica_id)
        if index is None:
            index = self.replicas[replica_id] = ReplicaIndex(self.max_blocks)
        return index

    def forget(self, replica_id: str) -> None:
        """The replica left (or restarted under a new id): its entries go with it."""
        self.replicas.pop(replica_id, None)

    def depths(self, keys: list[int], replica_ids: list[str]) -> dict[str, tuple[int, int]]:
        return {rid: self.replicas[rid].depth(keys) for rid in replica_ids if rid in self.replicas}
