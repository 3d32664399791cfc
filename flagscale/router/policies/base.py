"""What every routing policy is: the interface the router calls, what a policy sees of a request and of a
replica, and the least_load order the others fall back on.

- `select(upstreams, request, now)`: the replicas to try, in order (the router tries them in turn while a
  replica refuses the connection, i.e. while nothing was sent yet);
- `before_request(upstream, request)` / `after_request(upstream, request, ok)`: hooks around the request sent
  to the replica chosen;
- `on_replica_joined(upstream)` / `on_replica_left(replica_id)`: the registry's replica list changed;
- `learn(replica_id, prefix_keys)`: another router process sent a prompt there (routing hints);
- `stats(replica_id)`: the policy's table for `stats`.

Replicas whose circuit is open are never offered (`CircuitBreaker.allows`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from flagscale.router.circuit_breaker import CircuitBreaker

LOAD_SLACK = 1  # in-flight requests a replica may be above the least busy one and still count as "as free"


class Replica(Protocol):
    """What a policy sees of a replica (the router's Upstream, flagscale/router/replicas.py)."""

    inflight: int
    sent: int  # requests routed there, counted when picked
    breaker: CircuitBreaker

    @property
    def replica_id(self) -> str: ...


class Settings(Protocol):
    """What a policy reads of its node's routing (flagscale/config/routing.py's RoutingSpec; the policies sit
    below config, whose schema reads their names from the registry)."""

    policy: str
    balance_abs_threshold: int
    cache_threshold: float
    prefix_block_chars: int
    max_prefix_blocks: int
    max_prefix_chars: int
    max_sessions: int


@dataclass
class RequestInfo:
    """What a policy may look at: the parsed body and the headers (lower-case names)."""

    model: str
    body: dict[str, Any]
    headers: dict[str, str] = field(default_factory=dict)
    memo: dict[str, Any] = field(default_factory=dict)  # what a policy computed in select, for its hooks


def rank_replicas(upstreams: list[Replica], turn: int, now: float) -> list[Replica]:
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
    name = ""  # what `routing:` names it: its key in POLICIES (flagscale/router/policies/__init__.py)

    def __init__(self, spec: Settings):
        self.spec = spec
        self._turn = 0

    def next_turn(self) -> int:
        self._turn += 1
        return self._turn

    def select(self, upstreams: list[Replica], request: RequestInfo, now: float) -> list[Replica]:
        raise NotImplementedError

    def before_request(self, upstream: Replica, request: RequestInfo) -> None:
        pass

    def after_request(self, upstream: Replica, request: RequestInfo, ok: bool) -> None:
        pass

    def on_replica_joined(self, upstream: Replica) -> None:
        pass

    def on_replica_left(self, replica_id: str) -> None:
        pass

    def learn(self, replica_id: str, prefix_keys: list[bytes]) -> None:
        """Another router process of the deployment sent a prompt with these prefix keys to this replica."""

    def stats(self, replica_id: str) -> dict[str, Any]:
        return {}
