"""What every routing policy is: the interface the router calls, what a policy sees of a request and of a
replica, and the least_load order the others fall back on.

- `select(upstreams, request, now)`: the replicas to try, in order (the router tries them in turn while a
  replica refuses the connection, i.e. while nothing was sent yet);
- `before_request(upstream, request)` / `after_request(upstream, request, ok)`: hooks around the request sent
  to the replica chosen (before_request may set `request.upstream_headers` for that replica);
- `first_byte(request)`: the first byte of the request's answer reached the client (a stream's first event: the
  engine finished the prompt's prefill);
- `on_replica_joined(upstream)` / `on_replica_left(replica_id)`: the registry's replica list changed;
- `learn(replica_id, prefix_keys)`: another router process sent a prompt there (routing hints);
- `stats(replica_id)`: the policy's table for `stats`.

Replicas whose circuit is open are never offered (`CircuitBreaker.allows`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

if TYPE_CHECKING:
    from flagscale.router.circuit_breaker import CircuitBreaker

LOAD_SLACK = 1  # in-flight requests a replica may be above the least busy one and still count as "as free"


class Replica(Protocol):
    """What a policy sees of a replica (the router's Upstream, flagscale/router/replicas.py)."""

    inflight: int
    sent: int  # requests routed there, counted when picked
    prefill_chars: float  # prompt characters queued there before a first byte (cache_aware's PrefillBacklog)
    breaker: CircuitBreaker

    @property
    def replica_id(self) -> str: ...

    @property
    def devices(self) -> frozenset[str]:
        """The compute it runs on, one string per device and host ("<node>/<family>:<id>"; pinned CPU cores
        "<node>/cpu:<core>"): replicas whose sets meet share it. Empty: not known (counted as its own)."""
        ...


def setting(default: Any, doc: str, *, ge: float | None = None, le: float | None = None) -> Any:
    """One setting of a policy: a field of its Settings dataclass, and with it a `routing_options` key of the config
    schema (flagscale/config/schema.py reads `doc` and the bounds `ge`/`le` from the field's metadata)."""
    return field(default=default, metadata={"doc": doc, "ge": ge, "le": le})


@dataclass(frozen=True)
class Settings:
    """A policy's settings: what its node's `routing_options` set. Every policy has these; a policy with settings
    of its own subclasses this beside its Policy (Policy.settings_type) and declares each with `setting`."""

    max_migrations: int = setting(
        2,
        "how many times a request whose replica fails it (dropped connection, 5xx, a stream broken off) moves to "
        "another replica, each replica at most once; a stream goes on where it broke off (docs/routing.md). 0: never.",
        ge=0,
    )

    @classmethod
    def names(cls) -> list[str]:
        return [setting.name for setting in fields(cls)]


@dataclass
class RequestInfo:
    """What a policy may look at: the parsed body and the headers (lower-case names)."""

    model: str
    body: dict[str, Any]
    headers: dict[str, str] = field(default_factory=dict)
    memo: dict[str, Any] = field(default_factory=dict)  # what a policy computed in select, for its hooks
    # headers the policy's before_request asks to send to the replica it was handed (this attempt only): e.g. the
    # data-parallel rank of that replica the request is pinned to (router/kv_ranks.py)
    upstream_headers: dict[str, str] = field(default_factory=dict)


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
    settings_type: ClassVar[type[Settings]] = Settings  # what its node's `routing_options` may set

    def __init__(self, settings: Settings | None = None):
        settings = settings if settings is not None else self.settings_type()
        if type(settings) is not self.settings_type:
            raise TypeError(f"{self.name} takes {self.settings_type.__name__}, not {type(settings).__name__}")
        self.settings = settings
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

    def first_byte(self, request: RequestInfo) -> None:
        pass

    def on_replica_joined(self, upstream: Replica) -> None:
        pass

    def on_replica_left(self, replica_id: str) -> None:
        pass

    def learn(self, replica_id: str, prefix_keys: list[bytes]) -> None:
        """Another router process of the deployment sent a prompt with these prefix keys to this replica."""

    def stats(self, replica_id: str) -> dict[str, Any]:
        return {}
