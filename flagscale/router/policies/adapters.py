"""Where a LoRA adapter's requests go (docs/routing.md, "LoRA adapters"): pure decisions over what the router knows.

Every replica of a node can serve each of its adapters (each replica has them all loaded: flagscale/replica/
adapters.py), but an engine runs at most `max_loras` adapters in a batch at once: a request for an adapter none of
the replica's requests in flight uses waits for a free slot, and the adapter's weights are swapped in, evicting the
one least recently used. So, unless a replica is overloaded (more than `slack` requests in flight above the least
busy one that has room for the adapter: runs it, or has a free slot), an adapter's request goes first to a replica
already running that adapter (the router's requests in flight there: it joins their batch), then to one with a free
slot that holds the adapter (ran it lately, as the router sent it, or as the engine reported at its last health
check: vLLM's vllm:lora_requests_info), then to one with a free slot, and only then to one whose slots are all
taken. A hot adapter so fills the replicas running it and spreads to more as they overload; a cold one goes where it
is held. Within each tier the model's own policy's order is kept (cache_aware: prefix affinity, within the adapter).

Not a registered policy (no `routing:` name): a wrapper the router puts around an adapter's policy.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from flagscale.router.policies.base import Policy, Replica, RequestInfo

ADAPTER_SLACK = 4  # in-flight requests a replica may be above the least busy one and still be preferred

# the tiers of a replica for one adapter's request, best first
RUNNING, HELD, FREE_SLOT, FULL, OVERLOADED = range(5)


def tier(running: bool, holds: bool, inflight: int, least: int, busy: int, max_loras: int, slack: int) -> int:
    """A replica's tier for an adapter's request. OVERLOADED: more than `slack` requests in flight above `least`
    (Placement.order: the least busy replica with room for the adapter). Else RUNNING: the replica has requests of
    this adapter in flight (it joins their batch); HELD: it holds the adapter (recently run there) and has a free
    adapter slot (`busy`: the adapters of its requests in flight, fewer than max_loras); FREE_SLOT: a free slot, the
    adapter loaded into it; FULL: every slot taken by other adapters' requests, it waits for one."""
    if inflight > least + slack:
        return OVERLOADED
    if running:
        return RUNNING
    if busy < max_loras:
        return HELD if holds else FREE_SLOT
    return FULL


def engine_reported(replica: Replica) -> list[str]:
    """The adapters the replica's engine ran or had queued at its last health check (its registry record)."""
    record = getattr(replica, "record", None)
    return getattr(record, "adapters_running", None) or []


@dataclass
class Placement:
    """One node's adapters on its replicas, as the router sent them: per replica, the adapters of its requests in
    flight (`active`: adapter -> requests) and those it held last (`held`: least recently used first, at most
    max_loras); loads and evictions counted per adapter."""

    max_loras: int
    slack: int = ADAPTER_SLACK
    active: dict[str, dict[str, int]] = field(default_factory=dict)
    held: dict[str, OrderedDict[str, None]] = field(default_factory=dict)
    loads: dict[str, int] = field(default_factory=dict)
    evictions: dict[str, int] = field(default_factory=dict)

    def order(self, adapter: str, ranked: list[Replica]) -> list[Replica]:
        """`ranked` (the adapter's policy's order) sorted by tier, stably: the policy's order within each tier."""
        if not ranked:
            return ranked
        least = self.least_busy_with_room(adapter, ranked)

        def rank(u: Replica) -> int:
            active = self.active.get(u.replica_id, {})
            holds = adapter in self.held.get(u.replica_id, {}) or adapter in engine_reported(u)
            return tier(adapter in active, holds, u.inflight, least, len(active), self.max_loras, self.slack)

        return sorted(ranked, key=rank)

    def least_busy_with_room(self, adapter: str, ranked: list[Replica]) -> int:
        """The fewest requests in flight on a replica that could start `adapter`'s request now: running it, or a
        slot free (every slot taken everywhere: on any replica). Overload is measured against it, not against a
        replica whose slots are all taken: a request moved there waits until every request of one of its adapters
        has ended, which costs more than joining a larger batch."""
        active = self.active
        roomy = [
            u.inflight
            for u in ranked
            if adapter in active.get(u.replica_id, {}) or len(active.get(u.replica_id, {})) < self.max_loras
        ]
        return min(roomy or [u.inflight for u in ranked])

    def sent(self, adapter: str, replica_id: str, in_flight: bool = True) -> list[str]:
        """`adapter`'s request went to `replica_id` (`in_flight`: by this router, which calls done() when it ends;
        else another router process's, learnt from its hint): it holds the adapter now (a load if it did not), and
        the least recently used one beyond max_loras is evicted. Returns the evicted adapters."""
        if in_flight:
            active = self.active.setdefault(replica_id, {})
            active[adapter] = active.get(adapter, 0) + 1
        held = self.held.setdefault(replica_id, OrderedDict())
        if adapter in held:
            held.move_to_end(adapter)
            return []
        held[adapter] = None
        self.loads[adapter] = self.loads.get(adapter, 0) + 1
        evicted = []
        while len(held) > self.max_loras:
            gone, _ = held.popitem(last=False)
            self.evictions[gone] = self.evictions.get(gone, 0) + 1
            evicted.append(gone)
        return evicted

    def done(self, adapter: str, replica_id: str) -> None:
        """A request of `adapter` this router sent to `replica_id` ended."""
        active = self.active.get(replica_id, {})
        if active.get(adapter, 0) > 1:
            active[adapter] -= 1
        else:
            active.pop(adapter, None)

    def forget(self, adapter: str, replica_id: str) -> None:
        """The replica no longer serves `adapter` (it left, or unloaded the adapter)."""
        held = self.held.get(replica_id)
        if held is not None:
            held.pop(adapter, None)
            if not held:
                del self.held[replica_id]

    def holders(self, adapter: str) -> list[str]:
        return [replica for replica, held in self.held.items() if adapter in held]


class AdapterAware(Policy):
    """An adapter's routing: its own policy's order (`inner`), placed by its node's shared Placement."""

    def __init__(self, adapter: str, inner: Policy, placement: Placement):
        self.adapter, self.inner, self.placement = adapter, inner, placement
        self.name, self.settings, self.settings_type = inner.name, inner.settings, inner.settings_type

    @property
    def uses_kv_events(self) -> bool:
        """The adapter's requests are keyed with it and routed on the engines' KV events as its policy's are."""
        return getattr(self.inner, "uses_kv_events", False)

    @property
    def exact(self) -> Any:
        return getattr(self.inner, "exact", None)

    @exact.setter
    def exact(self, events: Any) -> None:  # (router/kv_events.py hands the policy its KV events)
        self.inner.exact = events

    def select(self, upstreams: list[Replica], request: RequestInfo, now: float) -> list[Replica]:
        return self.placement.order(self.adapter, self.inner.select(upstreams, request, now))

    def before_request(self, upstream: Replica, request: RequestInfo) -> None:
        self.placement.sent(self.adapter, upstream.replica_id)
        self.inner.before_request(upstream, request)

    def first_byte(self, request: RequestInfo) -> None:
        self.inner.first_byte(request)

    def after_request(self, upstream: Replica, request: RequestInfo, ok: bool) -> None:
        self.placement.done(self.adapter, upstream.replica_id)
        self.inner.after_request(upstream, request, ok)

    def on_replica_joined(self, upstream: Replica) -> None:
        self.inner.on_replica_joined(upstream)

    def on_replica_left(self, replica_id: str) -> None:
        self.placement.forget(self.adapter, replica_id)
        self.inner.on_replica_left(replica_id)

    def learn(self, replica_id: str, prefix_keys: list[bytes]) -> None:
        """Another router process sent this adapter's prompt there: that replica holds the adapter now."""
        self.placement.sent(self.adapter, replica_id, in_flight=False)
        self.inner.learn(replica_id, prefix_keys)

    def stats(self, replica_id: str) -> dict[str, Any]:
        return {**self.inner.stats(replica_id), "adapters": list(self.placement.held.get(replica_id, {}))}
