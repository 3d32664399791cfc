"""A node's routing as planned: which policy picks its replicas and the policy's settings. The policies
themselves are in flagscale/router/policies/; this is what the plan hands them (docs/routing.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import get_args

from flagscale.config.schema import DeployConfig, RoutingOptions, RoutingPolicy

POLICIES: tuple[str, ...] = get_args(RoutingPolicy)  # the policies' registry's names, in its order
DEFAULT_POLICY = POLICIES[0]  # cache_aware
_DEFAULT = {name: field.default for name, field in RoutingOptions.model_fields.items()}
_DEPLOY = {name: field.default for name, field in DeployConfig.model_fields.items()}
# Requests one engine replica is sent at once when its node sets no resources.max_ongoing_requests: far above
# vLLM's max_num_seqs (256 by default), so the engine's own scheduler does the queueing and throughput is never
# capped by the router; the router's queue only takes over past it.
DEFAULT_MAX_ONGOING_REQUESTS = 1000


@dataclass(frozen=True)
class RoutingSpec:
    """One engine node's routing, as planned (flagscale/plan.py) and given to the router per model: the policy and
    the node's `routing_options` (a plain dataclass, so the router's Serve user_config stays JSON)."""

    policy: str = DEFAULT_POLICY
    balance_abs_threshold: int = _DEFAULT["balance_abs_threshold"]
    cache_threshold: float = _DEFAULT["cache_threshold"]
    prefix_block_chars: int = _DEFAULT["prefix_block_chars"]
    max_prefix_blocks: int = _DEFAULT["max_prefix_blocks"]
    max_prefix_chars: int = _DEFAULT["max_prefix_chars"]
    max_sessions: int = _DEFAULT["max_sessions"]
    max_migrations: int = _DEFAULT["max_migrations"]


@dataclass(frozen=True)
class Admission:
    """The router's bounds on what it takes in (deploy settings, docs/routing.md#admission-control)."""

    max_body_bytes: int = _DEPLOY["max_body_bytes"]
    max_queued_requests: int = _DEPLOY["max_queued_requests"]
    queue_timeout_s: float = _DEPLOY["queue_timeout_s"]

    @classmethod
    def of(cls, deploy: DeployConfig) -> Admission:
        return cls(deploy.max_body_bytes, deploy.max_queued_requests, deploy.queue_timeout_s)
