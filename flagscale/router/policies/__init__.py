"""Routing policies: how the router orders a model's replicas for a request (docs/routing.md).

Owns the policy interface (base.py), one module per policy, and POLICIES, the one registry of their names:
`serve[].routing` and `disaggregation.prefill_routing` in flagscale/config/schema.py take exactly these names.
Adding a policy: a module here with a `Policy` subclass, and one line in POLICIES.

May import: the standard library and flagscale/router/circuit_breaker.py (types only). Nothing of config, Ray
or aiohttp: the config schema imports this package to know the names.
"""

from __future__ import annotations

from flagscale.router.policies.base import Policy, RequestInfo, Settings, rank_replicas
from flagscale.router.policies.cache_aware import CacheAware
from flagscale.router.policies.least_load import LeastLoad
from flagscale.router.policies.random import Random
from flagscale.router.policies.round_robin import RoundRobin
from flagscale.router.policies.session import Session

# `routing:` name -> its policy; the first is the default, the order is the one the schema's errors list.
POLICIES: dict[str, type[Policy]] = {cls.name: cls for cls in (CacheAware, LeastLoad, Session, RoundRobin, Random)}

__all__ = ["POLICIES", "Policy", "RequestInfo", "make_policy", "rank_replicas"]


def make_policy(spec: Settings) -> Policy:
    try:
        return POLICIES[spec.policy](spec)
    except KeyError:
        raise ValueError(f"unknown routing policy {spec.policy!r}; one of: {', '.join(POLICIES)}") from None
