"""least_load: the bounded-load order of rank_replicas (flagscale/router/policies/base.py)."""

from __future__ import annotations

from flagscale.router.policies.base import Policy, rank_replicas


class LeastLoad(Policy):
    """Today's bounded-load rule (rank_replicas)."""

    name = "least_load"

    def select(self, upstreams, request, now):
        return rank_replicas(upstreams, self.next_turn(), now)
