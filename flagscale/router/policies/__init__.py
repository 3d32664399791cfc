"""Routing policies: how the router orders a model's replicas for a request (docs/routing.md).

Owns the policy interface and the settings every policy has (base.py), one module per policy, and POLICIES, the
one registry of their names: `serve[].routing` and `disaggregation.prefill_routing` in flagscale/config/node.py
take exactly these names, and `serve[].routing_options` exactly the fields of the chosen policy's settings type.
adapters.py is no registered policy: the placement of LoRA adapters the router wraps around an adapter's policy.
Adding a policy: a module here with a `Policy` subclass (and, if it has settings of its own, a `Settings` subclass
beside it, named by its `settings_type`), and one line in POLICIES.

May import: the standard library and flagscale/router/circuit_breaker.py (types only). Nothing of config, Ray
or aiohttp: the config schema imports this package to know the names and the settings.
"""

from __future__ import annotations

from typing import Protocol

from flagscale.router.policies.base import Policy, RequestInfo, Settings, rank_replicas
from flagscale.router.policies.cache_aware import CacheAware
from flagscale.router.policies.least_load import LeastLoad
from flagscale.router.policies.random import Random
from flagscale.router.policies.round_robin import RoundRobin
from flagscale.router.policies.session import Session

# `routing:` name -> its policy; the first is the default, the order is the one the schema's errors list.
POLICIES: dict[str, type[Policy]] = {cls.name: cls for cls in (CacheAware, LeastLoad, Session, RoundRobin, Random)}
DEFAULT_POLICY = next(iter(POLICIES))

__all__ = [
    "DEFAULT_POLICY",
    "POLICIES",
    "Policy",
    "RequestInfo",
    "Routing",
    "Settings",
    "make_policy",
    "policy_type",
    "rank_replicas",
]


class Routing(Protocol):
    """A model's routing: a policy's name and that policy's settings (flagscale/config/routing.py's RoutingSpec)."""

    policy: str
    settings: Settings


def policy_type(name: str) -> type[Policy]:
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; one of: {', '.join(POLICIES)}") from None


def make_policy(spec: Routing) -> Policy:
    return policy_type(spec.policy)(spec.settings)
