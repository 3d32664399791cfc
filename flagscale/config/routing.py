"""A node's routing as planned: which policy picks its replicas and the policy's settings. The policies
themselves are in flagscale/serve/routing.py; this is what the plan hands them (docs/routing.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import get_args

from flagscale.config.schema import RoutingOptions, RoutingPolicy

POLICIES: tuple[str, ...] = get_args(RoutingPolicy)
DEFAULT_POLICY = "cache_aware"
_DEFAULT = {name: field.default for name, field in RoutingOptions.model_fields.items()}


@dataclass(frozen=True)
class RoutingSpec:
    """One engine node's routing, as planned (flagscale/plan.py) and given to the router per model: the policy and
    the node's `routing_options` (a plain dataclass, so the router's Serve user_config stays JSON)."""

    policy: str = DEFAULT_POLICY
    balance_abs_threshold: int = _DEFAULT["balance_abs_threshold"]
    cache_threshold: float = _DEFAULT["cache_threshold"]
    prefix_block_chars: int = _DEFAULT["prefix_block_chars"]
    max_prefix_blocks: int = _DEFAULT["max_prefix_blocks"]
    max_sessions: int = _DEFAULT["max_sessions"]
    max_migrations: int = _DEFAULT["max_migrations"]
