"""How the router picks a model's replica for a request: routing policies and a per-replica circuit breaker.

Each policy is a small class behind one interface (in the style of SkyPilot's load-balancing policies):

- `select(upstreams, request, now)`: the replicas to try, in order (the router tries them in turn while a
  replica refuses the connection, i.e. while nothing was sent yet);
- `before_request(upstream, request)` / `after_request(upstream, request, ok)`: hooks around the request sent
  to the replica chosen;
- `on_replica_joined(upstream)` / `on_replica_left(replica_id)`: the registry's replica list changed.

Policies (`routing:` of an engine node): `cache_aware` (default), `least_load`, `session`, `round_robin`,
`random`.
Replicas whose circuit is open are never offered (`CircuitBreaker.allows`).
"""

from __future__ import annotations

import hashlib
import random
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from flagscale.config.routing import (  # noqa: F401 - re-exported
    DEFAULT_MAX_ONGOING_REQUESTS,
    DEFAULT_POLICY,
    POLICIES,
    RoutingSpec,
)

if TYPE_CHECKING:  # nothing here needs Ray
    from flagscale.serve import registry


LOAD_SLACK = 1  # in-flight requests a replica may be above the least busy one and still count as "as free"
COOLDOWN_S = 5.0  # an open circuit stays open this long, then lets one probe through
BREAKER_FAILURES = 3  # consecutive failures (5xx, dropped connection) that open a replica's circuit
SESSION_HEADER = "x-session-id"
PREFIX_KEY_BYTES = 12  # a prefix block's key: blake2b of the blocks up to it, this many bytes


# ---- circuit breaker ------------------------------------------------------------------------------------


class CircuitBreaker:
    """closed (requests flow) -> open after `threshold` consecutive failures, or at once on a refused connection
    (`trip`): skipped for `cooldown_s` -> half-open: one probe (a request, or the router's /health probe) is let
    through; its success closes the circuit, its failure opens it again for another cool-down.

    A 4xx answer is a success here: the replica worked, the request was the client's problem."""

    def __init__(self, threshold: int = BREAKER_FAILURES, cooldown_s: float = COOLDOWN_S):
        self.threshold = threshold
        self.cooldown_s = cooldown_s
        self.failures = 0  # consecutive
        self.open_until = 0.0  # > 0: the circuit was opened; requests wait until then
        self.probing = False  # half-open: the one probe is in flight
        self.opened = 0  # how many times it opened (stats)

    def state(self, now: float | None = None) -> str:
        now = time.monotonic() if now is None else now
        if self.open_until == 0.0:
            return "closed"
        return "open" if now < self.open_until or self.probing else "half_open"

    def allows(self, now: float) -> bool:
        """May a request be offered to this replica now (does not claim the probe)."""
        return self.state(now) in ("closed", "half_open")

    def begin(self, now: float) -> bool:
        """A request is about to be sent: False if another one already took the half-open probe."""
        state = self.state(now)
        if state == "closed":
            return True
        if state == "half_open":
            self.probing = True
            return True
        return False

    def success(self) -> None:
        self.failures = 0
        self.open_until = 0.0
        self.probing = False

    def failure(self, now: float) -> None:
        self.failures += 1
        if self.open_until or self.failures >= self.threshold:  # a failed probe, or too many in a row
            self._open(now)

    def trip(self, now: float) -> None:
        """Open at once (the replica refused the connection: nothing listens there)."""
        self.failures = max(self.failures + 1, self.threshold)
        self._open(now)

    def _open(self, now: float) -> None:
        self.open_until = now + self.cooldown_s
        self.probing = False
        self.opened += 1


# ---- replica state --------------------------------------------------------------------------------------


@dataclass
class Upstream:
    """One engine replica as the router sees it."""

    record: registry.ReplicaRecord
    inflight: int = 0
    sent: int = 0  # requests routed here, counted when picked (served only counts once headers are back)
    served: int = 0
    migrations: int = 0  # requests that failed here and moved to another replica
    max_ongoing: int = DEFAULT_MAX_ONGOING_REQUESTS  # its deployment's max_ongoing_requests: more wait in the router
    breaker: CircuitBreaker = field(default_factory=CircuitBreaker)

    @property
    def replica_id(self) -> str:
        return self.record.replica_id


@dataclass
class RequestInfo:
    """What a policy may look at: the parsed body and the headers (lower-case names)."""

    model: str
    body: dict[str, Any]
    headers: dict[str, str] = field(default_factory=dict)
    memo: dict[str, Any] = field(default_factory=dict)  # what a policy computed in select, for its hooks


def prompt_text(body: dict[str, Any], max_chars: int = RoutingSpec.max_prefix_chars) -> str:
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


# ---- policies -------------------------------------------------------------------------------------------


def rank_replicas(upstreams: list[Upstream], turn: int, now: float) -> list[Upstream]:
    """The least_load order of a model's replicas.

    Replicas at most LOAD_SLACK in-flight requests above the least busy one come first, fewest requests
    sent first, so equal replicas get equal shares even when one of them runs a little faster (pure
    least-in-flight hands the faster one every freed slot). Busier replicas follow, least busy first.
    Ties rotate with `turn`; replicas whose circuit is open are left out."""
    ups = [u for u in upstreams if u.breaker.allows(now)]
    if len(ups) > 1:
        ups = ups[turn % len(ups) :] + ups[: turn % len(ups)]
        free_enough = min(u.inflight for u in ups) + LOAD_SLACK
        ups.sort(key=lambda u: (0, u.sent) if u.inflight <= free_enough else (1, u.inflight))  # stable sort
    return ups


class Policy:
    name = ""

    def __init__(self, spec: RoutingSpec | None = None):
        self.spec = spec or RoutingSpec(policy=self.name)
        self._turn = 0

    def next_turn(self) -> int:
        self._turn += 1
        return self._turn

    def select(self, upstreams: list[Upstream], request: RequestInfo, now: float) -> list[Upstream]:
        raise NotImplementedError

    def before_request(self, upstream: Upstream, request: RequestInfo) -> None:
        pass

    def after_request(self, upstream: Upstream, request: RequestInfo, ok: bool) -> None:
        pass

    def on_replica_joined(self, upstream: Upstream) -> None:
        pass

    def on_replica_left(self, replica_id: str) -> None:
        pass

    def learn(self, replica_id: str, prefix_keys: list[bytes]) -> None:
        """Another router process of the deployment sent a prompt with these prefix keys to this replica."""

    def stats(self, replica_id: str) -> dict[str, Any]:
        return {}


class LeastLoad(Policy):
    """Today's bounded-load rule (rank_replicas)."""

    name = "least_load"

    def select(self, upstreams, request, now):
        return rank_replicas(upstreams, self.next_turn(), now)


class RoundRobin(Policy):
    """Each request to the next replica in turn, whatever their load."""

    name = "round_robin"

    def select(self, upstreams, request, now):
        ups = [u for u in upstreams if u.breaker.allows(now)]
        if not ups:
            return []
        turn = self.next_turn() % len(ups)
        return ups[turn:] + ups[:turn]


class Random(Policy):
    """A replica drawn at random per request, the others after it in random order (FlagScale's `random`)."""

    name = "random"

    def __init__(self, spec: RoutingSpec | None = None):
        super().__init__(spec)
        self._rng = random.Random()

    def select(self, upstreams, request, now):
        ups = [u for u in upstreams if u.breaker.allows(now)]
        self._rng.shuffle(ups)
        return ups


class Session(Policy):
    """Affinity by the OpenAI `user` field, else the X-Session-Id header: a session's requests go to the replica
    that served its first one while that replica is there and its circuit closed; requests without a session,
    and a session's first request, go by least_load. The session table is an LRU of `max_sessions`."""

    name = "session"

    def __init__(self, spec: RoutingSpec | None = None):
        super().__init__(spec)
        self.sessions: OrderedDict[str, str] = OrderedDict()  # session key -> replica id

    @staticmethod
    def key(request: RequestInfo) -> str | None:
        user = request.body.get("user")
        if isinstance(user, str) and user:
            return "user:" + user
        header = request.headers.get(SESSION_HEADER)
        return "header:" + header if header else None

    def select(self, upstreams, request, now):
        ranked = rank_replicas(upstreams, self.next_turn(), now)
        key = self.key(request)
        replica_id = self.sessions.get(key) if key else None
        if replica_id is not None:
            sticky = [u for u in ranked if u.replica_id == replica_id]
            return sticky + [u for u in ranked if u.replica_id != replica_id]
        return ranked

    def before_request(self, upstream, request):
        key = self.key(request)
        if key is None:
            return
        self.sessions[key] = upstream.replica_id
        self.sessions.move_to_end(key)
        while len(self.sessions) > self.spec.max_sessions:
            self.sessions.popitem(last=False)

    def on_replica_left(self, replica_id):
        for key in [k for k, r in self.sessions.items() if r == replica_id]:
            del self.sessions[key]

    def stats(self, replica_id):
        return {"sessions": sum(1 for r in self.sessions.values() if r == replica_id)}


class PrefixTable:
    """An approximate prefix tree over character blocks: the prompt is cut into blocks of `block_chars`
    characters, block i is keyed by a hash of blocks 0..i (a hash chain, so equal keys mean equal prefixes),
    and each key maps to the replicas that were sent a prompt with that prefix. Bounded to `max_blocks` keys,
    least recently used evicted first (deeper blocks of a prompt before shallower ones)."""

    def __init__(self, block_chars: int = 64, max_blocks: int = 100_000):
        self.block_chars = block_chars
        self.max_blocks = max_blocks
        self.blocks: OrderedDict[bytes, set[str]] = OrderedDict()

    def keys(self, text: str) -> list[bytes]:
        keys, digest = [], b""
        for start in range(0, len(text) - self.block_chars + 1, self.block_chars):
            digest = hashlib.blake2b(
                digest + text[start : start + self.block_chars].encode(), digest_size=PREFIX_KEY_BYTES
            ).digest()
            keys.append(digest)
        return keys

    def match(self, keys: list[bytes]) -> dict[str, int]:
        """Replica id -> how many leading blocks of the prompt it was sent."""
        matched: dict[str, int] = {}
        for depth, key in enumerate(keys, 1):
            holders = self.blocks.get(key)
            if not holders:
                break
            for replica_id in holders:
                if matched.get(replica_id, 0) == depth - 1:  # it holds every block up to this one
                    matched[replica_id] = depth
        return matched

    def insert(self, keys: list[bytes], replica_id: str) -> None:
        for key in reversed(keys):  # the first block ends up most recently used: evicted last
            holders = self.blocks.get(key)
            if holders is None:
                self.blocks[key] = {replica_id}
            else:
                holders.add(replica_id)
                self.blocks.move_to_end(key)
        while len(self.blocks) > self.max_blocks:
            self.blocks.popitem(last=False)

    def remove_replica(self, replica_id: str) -> None:
        for key in list(self.blocks):
            holders = self.blocks[key]
            holders.discard(replica_id)
            if not holders:
                del self.blocks[key]

    def size(self, replica_id: str) -> int:
        return sum(1 for holders in self.blocks.values() if replica_id in holders)


class CacheAware(Policy):
    """Prefix-cache-aware routing: the replica that was sent the longest prefix of this prompt (blocks of the
    PrefixTable) goes first, unless its in-flight requests exceed the least busy replica's by more than
    `balance_abs_threshold`: then the least_load order. No match, or a match shorter than `cache_threshold` of
    the prompt (e.g. only a shared system prompt): least_load, so new conversations still spread. The replica
    picked is recorded as holding the prompt's blocks (when the request is sent: the engine caches it as it runs).
    """

    name = "cache_aware"

    def __init__(self, spec: RoutingSpec | None = None):
        super().__init__(spec)
        self.table = PrefixTable(self.spec.prefix_block_chars, self.spec.max_prefix_blocks)

    def _prompt_keys(self, request: RequestInfo) -> list[bytes]:
        if "prefix_keys" not in request.memo:
            text = prompt_text(request.body, self.spec.max_prefix_chars)
            request.memo["prefix_keys"] = self.table.keys(text)
            request.memo["prompt_chars"] = len(text)
        return request.memo["prefix_keys"]

    def select(self, upstreams, request, now):
        ranked = rank_replicas(upstreams, self.next_turn(), now)
        keys = self._prompt_keys(request)
        if len(ranked) < 2:
            return ranked
        matched = self.table.match(keys)
        if not matched:
            return ranked
        least = min(u.inflight for u in ranked)
        best = None
        for upstream in ranked:  # ranked order breaks ties between equally long matches
            depth = matched.get(upstream.replica_id, 0)
            if depth and (best is None or depth > matched[best.replica_id]):
                best = upstream
        if best is None or best.inflight > least + self.spec.balance_abs_threshold:
            return ranked
        matched_chars = matched[best.replica_id] * self.table.block_chars
        if matched_chars < self.spec.cache_threshold * request.memo["prompt_chars"]:
            return ranked  # only a small part is cached (say a shared system prompt): spread by load
        return [best] + [u for u in ranked if u is not best]

    def before_request(self, upstream, request):
        self.table.insert(self._prompt_keys(request), upstream.replica_id)

    def learn(self, replica_id, prefix_keys):
        self.table.insert(prefix_keys, replica_id)

    def on_replica_left(self, replica_id):
        self.table.remove_replica(replica_id)

    def stats(self, replica_id):
        return {"prefix_blocks": self.table.size(replica_id)}


POLICY_CLASSES: dict[str, type[Policy]] = {
    cls.name: cls for cls in (CacheAware, LeastLoad, Session, RoundRobin, Random)
}
assert tuple(sorted(POLICY_CLASSES)) == tuple(sorted(POLICIES))


def make_policy(spec: RoutingSpec) -> Policy:
    try:
        return POLICY_CLASSES[spec.policy](spec)
    except KeyError:
        raise ValueError(f"unknown routing policy {spec.policy!r}; one of: {', '.join(POLICIES)}") from None
