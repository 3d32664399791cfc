"""round_robin: each request to the next replica in turn, whatever their load."""

from __future__ import annotations

from flagscale.router.policies.base import Policy


class RoundRobin(Policy):
    """Each request to the next replica in turn, whatever their load."""

    name = "round_robin"

    def select(self, upstreams, request, now):
        ups = [u for u in upstreams if u.breaker.allows(now)]
        if not ups:
            return []
        turn = self.next_turn() % len(ups)
        return ups[turn:] + ups[:turn]
