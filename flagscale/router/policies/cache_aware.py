"""cache_aware (the default): the replica holding the longest prefix of the prompt, as long as that saves time.

A prompt's prefix is tracked in blocks of characters (PrefixTable): the replica's engine caches the KV of what
it was sent, so sending a conversation's next turn where its earlier turns went reuses that cache.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from flagscale.router.policies.base import Policy, Replica, RequestInfo, Settings, rank_replicas, setting

PREFIX_KEY_BYTES = 12  # a prefix block's key: blake2b of the blocks up to it, this many bytes
MAX_PREFIX_CHARS = 32_768  # CacheAwareSettings.max_prefix_chars's default; the policy passes its node's
SENT_FRESH_S = 5.0  # on KV events: a prompt sent to a replica counts as held there this long before its events say


@dataclass(frozen=True)
class CacheAwareSettings(Settings):
    """cache_aware's own `routing_options`: its load bound, its prefix table's size and what of a prompt it keys."""

    balance_abs_threshold: int = setting(
        4,
        "balance_by inflight (and the data-parallel rank within a replica): the replica with the longest cached "
        "prefix is skipped (least load instead) when its in-flight requests exceed the least busy replica's by more "
        "than this.",
        ge=0,
    )
    balance_by: Literal["prefill", "inflight"] = setting(
        "prefill",
        "how the warm replica's load is weighed: prefill = the prompt characters each replica would compute before "
        "this request's first token (the part of it not cached there, plus what this router sent there that has no "
        "first byte yet), least first; inflight = its in-flight requests over the least busy replica's, within "
        "balance_abs_threshold (docs/routing.md).",
    )
    balance_scope: Literal["device", "replica"] = setting(
        "device",
        "balance_by prefill: whose queue a replica's is. device = the prefill queued on every replica of the pool "
        "that shares a GPU (or pinned CPU cores) with it, on the same host: engines sharing a device share its "
        "compute, so moving a prompt between them saves no queueing and loses the cache; replica = its own only.",
    )
    cache_threshold: float = setting(
        0.3,
        "a cached prefix shorter than this fraction of the prompt (e.g. only a shared system prompt) does not "
        "count: the request goes by least load.",
        ge=0,
        le=1,
    )
    prefix_block_chars: int = setting(64, "characters per block of the prompt prefix table.", ge=1)
    max_prefix_blocks: int = setting(
        100_000, "blocks the prefix table of a model holds, least recently used evicted first.", ge=1
    )
    max_prefix_chars: int = setting(
        MAX_PREFIX_CHARS,
        "only the first this many characters of a prompt are hashed into the prefix table (a longer prompt is "
        "keyed by its beginning).",
        ge=1,
    )
    kv_events: Literal["auto", True, False] = setting(
        "auto",
        "route on the engines' own KV-cache events (an index of the blocks each replica holds, keyed as the engine "
        "keys them) rather than on the table of what was sent where: auto = where the engine kind publishes them; "
        "true = required (an engine that cannot is a config error); false = the table only.",
    )


def prompt_text(body: dict[str, Any], max_chars: int = MAX_PREFIX_CHARS) -> str:
    """The text whose prefix decides cache reuse, up to `max_chars` characters: completions' `prompt`; chat's
    conversation rendered as the concatenated role + content of its messages (so each turn of a chat extends the
    previous turn's key). Parts of a type the engine will refuse count as empty text."""
    messages = body.get("messages")
    if isinstance(messages, list):
        parts, size = [], 0
        for message in messages:
            if not isinstance(message, dict):
                continue
            content = message.get("content")
            if isinstance(content, list):  # content parts: keep the text ones
                content = "".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
            elif not isinstance(content, str):
                content = ""
            role = message.get("role")
            parts.append(f"<{role if isinstance(role, str) else ''}>{content}")
            size += len(parts[-1])
            if size >= max_chars:
                break
        return "".join(parts)[:max_chars]
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt[:max_chars]
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, str):
            return first[:max_chars]  # a batch of prompts: the first one decides
        ids = prompt if isinstance(first, int) else first if isinstance(first, list) else ()
        return " ".join(map(str, ids[:max_chars]))[:max_chars] if isinstance(ids, list) else ""  # token ids
    return ""


class PrefixTable:
    """An approximate prefix tree over character blocks: the prompt is cut into blocks of `block_chars`
    characters, block i is keyed by a hash of blocks 0..i (a hash chain, so equal keys mean equal prefixes),
    and each key maps to the replicas that were sent a prompt with that prefix (and when, last). Bounded to
    `max_blocks` keys, least recently used evicted first (deeper blocks of a prompt before shallower ones)."""

    def __init__(self, block_chars: int = 64, max_blocks: int = 100_000):
        self.block_chars = block_chars
        self.max_blocks = max_blocks
        self.blocks: OrderedDict[bytes, dict[str, float]] = OrderedDict()  # key -> {replica id: sent at}

    def keys(self, text: str) -> list[bytes]:
        keys, digest = [], b""
        for start in range(0, len(text) - self.block_chars + 1, self.block_chars):
            digest = hashlib.blake2b(
                digest + text[start : start + self.block_chars].encode(), digest_size=PREFIX_KEY_BYTES
            ).digest()
            keys.append(digest)
        return keys

    def match(self, keys: list[bytes], since: Callable[[str], float] | None = None) -> dict[str, int]:
        """Replica id -> how many leading blocks of the prompt it was sent (`since(replica id)`: sent at or after
        then)."""
        matched: dict[str, int] = {}
        for depth, key in enumerate(keys, 1):
            holders = self.blocks.get(key)
            if not holders:
                break
            for replica_id, sent_at in holders.items():
                if matched.get(replica_id, 0) == depth - 1 and (since is None or sent_at >= since(replica_id)):
                    matched[replica_id] = depth  # it holds every block up to this one
        return matched

    def insert(self, keys: list[bytes], replica_id: str, now: float | None = None) -> None:
        sent_at = time.monotonic() if now is None else now
        for key in reversed(keys):  # the first block ends up most recently used: evicted last
            holders = self.blocks.get(key)
            if holders is None:
                self.blocks[key] = {replica_id: sent_at}
            else:
                holders[replica_id] = sent_at
                self.blocks.move_to_end(key)
        while len(self.blocks) > self.max_blocks:
            self.blocks.popitem(last=False)

    def remove_replica(self, replica_id: str) -> None:
        for key in list(self.blocks):
            holders = self.blocks[key]
            holders.pop(replica_id, None)
            if not holders:
                del self.blocks[key]

    def size(self, replica_id: str) -> int:
        return sum(1 for holders in self.blocks.values() if replica_id in holders)


class PrefillBacklog:
    """The prompt characters a replica has yet to compute before its queued requests' first tokens (`balance_by:
    prefill`), kept on the replica (Replica.prefill_chars: one count over all the models it serves): each request's
    uncached part, added when sent, taken off at its first byte or its end, whichever comes first. A router process
    counts only what it sent itself."""

    @staticmethod
    def add(request: RequestInfo, upstream: Replica, chars: float) -> None:
        PrefillBacklog.answered(request)  # (an earlier attempt of this request, elsewhere)
        request.memo["backlog"] = (upstream, chars)
        upstream.prefill_chars += chars

    @staticmethod
    def answered(request: RequestInfo) -> None:
        entry = request.memo.pop("backlog", None)
        if entry is not None:
            upstream, chars = entry
            upstream.prefill_chars = max(0.0, upstream.prefill_chars - chars)


class CacheAware(Policy):
    """Prefix-cache-aware routing on the share of this prompt each replica holds (its engine's KV events, or the
    PrefixTable of what it was sent). `balance_by: prefill` (the default): the replica that would compute the
    fewest prompt characters before this request's first token (the part it does not hold, plus its PrefillBacklog)
    goes first. `balance_by: inflight`: the one holding most goes first, unless its in-flight requests exceed the
    least busy replica's by more than `balance_abs_threshold`: then the least_load order. Either way a share under
    `cache_threshold` (e.g. only a shared system prompt) counts as none, so new conversations spread. The replica
    picked is recorded as holding the prompt's blocks (when the request is sent: the engine caches it as it runs).
    On the engines' KV events, a replica of several data-parallel engines counts its deepest rank, and the request
    is pinned to a rank of it by the same rule (router/kv_ranks.py).
    """

    name = "cache_aware"
    settings_type = CacheAwareSettings
    settings: CacheAwareSettings

    def __init__(self, settings: CacheAwareSettings | None = None):
        super().__init__(settings)
        self.table = PrefixTable(self.settings.prefix_block_chars, self.settings.max_prefix_blocks)

    def _prompt_keys(self, request: RequestInfo) -> list[bytes]:
        if "prefix_keys" not in request.memo:
            text = prompt_text(request.body, self.settings.max_prefix_chars)
            request.memo["prefix_keys"] = self.table.keys(text)
            request.memo["prompt_chars"] = len(text)
        return request.memo["prefix_keys"]

    exact: Any = None  # the engines' own KV events (flagscale/router/kv_events.py), handed over by the router

    @property
    def uses_kv_events(self) -> bool:
        return self.settings.kv_events is not False

    def select(self, upstreams, request, now):
        ranked = rank_replicas(upstreams, self.next_turn(), now)
        keys = self._prompt_keys(request)
        if len(ranked) < 2 and not (self.exact is not None and self.exact.has_ranks(ranked)):
            return ranked  # (one replica of DP ranks is matched still: before_request picks its rank)
        found = self.exact.match(request, ranked, now) if self.exact is not None else None
        reuse = (
            self._reuse_on_events(found, keys, request, now)
            if found is not None
            else self._reuse_on_table(keys, request)
        )
        if self.settings.balance_by == "prefill":
            return self._by_prefill(ranked, reuse, request)
        least = min(u.inflight for u in ranked)
        best = None
        for upstream in ranked:  # ranked order breaks ties between equally long matches
            share = reuse.get(upstream.replica_id, 0.0)
            if share and (best is None or share > reuse[best.replica_id]):
                best = upstream
        if best is None or best.inflight > least + self.settings.balance_abs_threshold:
            return ranked
        if reuse[best.replica_id] < self.settings.cache_threshold:
            return ranked  # only a small part is cached (say a shared system prompt): spread by load
        return [best] + [u for u in ranked if u is not best]

    def _by_prefill(self, ranked: list, reuse: dict[str, float], request: RequestInfo) -> list:
        """`ranked` by the prompt characters each replica would compute before this request's first token; ranked
        order breaks ties (no reuse and no backlog anywhere: least_load's order)."""
        chars = request.memo["prompt_chars"]
        threshold = self.settings.cache_threshold
        uncached = {}
        for upstream in ranked:
            share = min(1.0, reuse.get(upstream.replica_id, 0.0))
            uncached[upstream.replica_id] = chars * (1.0 - (share if share >= threshold else 0.0))
        request.memo["uncached_chars"] = uncached
        queued = self._queued_prefill(ranked)
        # a tie (no reuse anywhere on a shared device): the replica with less of its own queue starts it sooner, as
        # each engine schedules its own queue
        return sorted(ranked, key=lambda u: (uncached[u.replica_id] + queued[u.replica_id], u.prefill_chars))

    def _queued_prefill(self, ranked: list) -> dict[str, float]:
        """Replica id -> the prefill queued before a new request's first token there: its own backlog, or
        (`balance_scope: device`) the backlog of every replica of `ranked` sharing a device with it."""
        queued = {u.replica_id: u.prefill_chars for u in ranked}
        if self.settings.balance_scope != "device":
            return queued
        on_device: dict[str, list] = {}
        for upstream in ranked:
            for device in upstream.devices:
                on_device.setdefault(device, []).append(upstream)
        for upstream in ranked:
            sharing = {id(other): other for device in upstream.devices for other in on_device[device]}
            if len(sharing) > 1:
                queued[upstream.replica_id] = sum(other.prefill_chars for other in sharing.values())
        return queued

    def _reuse_on_table(self, keys: list[bytes], request: RequestInfo) -> dict[str, float]:
        """Replica id -> the share of the prompt it was sent, by the table."""
        chars = request.memo["prompt_chars"]
        if not chars:
            return {}
        return {rid: depth * self.table.block_chars / chars for rid, depth in self.table.match(keys).items()}

    def _reuse_on_events(self, found: Any, keys: list[bytes], request: RequestInfo, now: float) -> dict[str, float]:
        """Replica id -> the share of the prompt its engine holds, by its events; or, where more, the share it was
        sent in the last SENT_FRESH_S (after its engine's last reset): blocks it is computing or has not announced
        yet, which a burst of requests for one new prefix would otherwise spread over every replica. A replica
        among them that publishes no events: the table, as without events."""
        if not found.prompt_tokens:
            return {}
        share = {rid: depth * found.block_tokens / found.prompt_tokens for rid, depth in found.depths.items()}
        chars = request.memo["prompt_chars"]
        if not chars:
            return share
        # per replica once (the table asks per block it holds): fresh since SENT_FRESH_S ago or its engine's reset
        fresh_since = {rid: max(now - SENT_FRESH_S, self.exact.reset_at(rid)) for rid in found.depths}
        for rid, depth in self.table.match(keys, lambda rid: fresh_since.get(rid, float("-inf"))).items():
            share[rid] = max(share.get(rid, 0.0), depth * self.table.block_chars / chars)
        return share

    def before_request(self, upstream, request):
        self.table.insert(self._prompt_keys(request), upstream.replica_id)
        uncached = request.memo.get("uncached_chars")
        if uncached is not None:
            PrefillBacklog.add(request, upstream, uncached.get(upstream.replica_id, 0.0))
        if self.exact is not None:
            self.exact.pin(upstream, request, self.settings.balance_abs_threshold, self.settings.cache_threshold)
            self.exact.sent(upstream, request, time.monotonic())

    def first_byte(self, request):
        PrefillBacklog.answered(request)

    def after_request(self, upstream, request, ok):
        PrefillBacklog.answered(request)
        if self.exact is not None:
            self.exact.done(request)

    def learn(self, replica_id, prefix_keys):
        self.table.insert(prefix_keys, replica_id)

    def on_replica_left(self, replica_id):
        self.table.remove_replica(replica_id)

    def stats(self, replica_id):
        exact = self.exact.stats(replica_id) if self.exact is not None else {}
        return {"prefix_blocks": self.table.size(replica_id), **exact}
