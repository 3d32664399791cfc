"""Which published records are alive, judged by one clock: the reader's own.

Records in Ray's key-value store are written on one host and read on others (replica records, the router
processes' reports), and hosts' wall clocks disagree. So a record carries no time to compare against: it carries
`seq`, which its publisher advances on every publish, and a reader that keeps looking (a router, a waiting `run`)
notes, by its own monotonic clock, when it last saw each record's `seq` advance. A record whose `seq` has not
advanced for `stale_after_s` is stale, whatever any host's clock says. A record seen for the first time counts as
just advanced: a reader that has not watched it cannot know its age.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Iterable
from typing import Any


class Liveness:
    """Per record key: the last `seq` seen and when (`clock`, monotonic) it was first seen at that value."""

    def __init__(self, stale_after_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.stale_after_s = stale_after_s
        self._clock = clock
        self._seen: dict[Hashable, tuple[int, float]] = {}

    def observe(self, key: Hashable, seq: int) -> float:
        """A read of the record `key` found `seq`: its age, seconds since its `seq` last advanced (0 when it just
        did, or the record is new to this reader)."""
        now = self._clock()
        last = self._seen.get(key)
        if last is None or last[0] != seq:  # (a lower seq: the record was written anew, e.g. by a restarted process)
            self._seen[key] = (seq, now)
            return 0.0
        return now - last[1]

    def stale(self, key: Hashable, seq: int) -> bool:
        """observe(), judged: has `key`'s seq stood still for longer than stale_after_s?"""
        return self.observe(key, seq) > self.stale_after_s

    def age(self, key: Hashable) -> float | None:
        """Seconds since `key`'s seq last advanced, as last observed (None: never observed)."""
        last = self._seen.get(key)
        return None if last is None else self._clock() - last[1]

    def split(self, records: list[Any], key: Callable[[Any], Hashable]) -> tuple[list[Any], list[Any]]:
        """One read's records (each with its `seq`, under `key(record)`): (the live ones, the stale ones). Records
        no longer listed are forgotten."""
        self.keep_only(key(r) for r in records)
        stale = [r for r in records if self.stale(key(r), r.seq)]
        return [r for r in records if not any(r is s for s in stale)], stale

    def keep_only(self, keys: Iterable[Hashable]) -> None:
        """Forget records no longer listed (withdrawn), so the table stays as large as the store."""
        keep = set(keys)
        for key in [k for k in list(self._seen) if k not in keep]:  # (a snapshot: readers may run in threads)
            self._seen.pop(key, None)
