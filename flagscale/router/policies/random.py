"""random: a replica drawn at random per request (FlagScale's `random`)."""

from __future__ import annotations

import random

from flagscale.router.policies.base import Policy, Settings


class Random(Policy):
    """A replica drawn at random per request, the others after it in random order (FlagScale's `random`)."""

    name = "random"

    def __init__(self, settings: Settings | None = None):
        super().__init__(settings)
        self._rng = random.Random()

    def select(self, upstreams, request, now):
        ups = [u for u in upstreams if u.breaker.allows(now)]
        self._rng.shuffle(ups)
        return ups
