"""A node's routing as planned: which policy picks its replicas and the policy's settings. The policies
themselves are in flagscale/serve/routing.py; this is what the plan hands them (docs/routing.md)."""

from __future__ import annotations

from dataclasses import dataclass

POLICIES = ("cache_aware", "least_load", "session", "round_robin", "random")
DEFAULT_POLICY = "cache_aware"


@dataclass(frozen=True)
class RoutingSpec:
    """One engine node's routing, as planned (flagscale/plan.py) and given to the router per model."""

    policy: str = DEFAULT_POLICY
    balance_abs_threshold: int = 4
    cache_threshold: float = 0.3
    prefix_block_chars: int = 64
    max_prefix_blocks: int = 100_000
    max_sessions: int = 100_000
    max_migrations: int = 2
