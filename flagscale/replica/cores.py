"""Cores claimed for a replica's CPU ranks on one host: one flock per core, shared by every replica on the host, so
two replicas' ranks never share a core; the kernel drops a dead holder's claims."""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Callable
from pathlib import Path

from flagscale.cluster.tempdirs import ensure_private_dir
from flagscale.replica.startup_lock import lock_dir

CORE_WAIT_S = 60.0  # a replica being replaced may still hold its cores this long (its drain and exit)


class RankStartError(RuntimeError):
    """A replica's ranks could not start: no free cores, or the ranks on another host failed (replica/ranks.py)."""


def core_lock_path(core: int) -> Path:
    return lock_dir() / f"core-{core}.lock"


class CoreClaim:
    """Cores held for a replica's ranks on this host, one flock per core (in this user's private lock directory,
    shared by every replica on the host); the kernel drops them when the holder dies."""

    def __init__(self, cores: list[int], fds: list[int]):
        self.cores = cores
        self._fds = fds

    @classmethod
    def take(cls, count: int, timeout_s: float = CORE_WAIT_S, note: Callable[[str], None] = lambda _: None):
        """`count` cores of this process's allowed ones that no other replica holds, lowest first; waits up to
        `timeout_s` for them, then RankStartError naming what is held."""
        allowed = sorted(os.sched_getaffinity(0))
        if count > len(allowed):
            raise RankStartError(f"the ranks need {count} cores, but this host allows {len(allowed)}: {allowed}")
        ensure_private_dir(str(lock_dir()))
        deadline = time.monotonic() + timeout_s
        said = False
        while True:
            cores, fds = [], []
            for core in allowed:
                fd = os.open(core_lock_path(core), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    os.close(fd)
                    continue
                cores.append(core)
                fds.append(fd)
                if len(cores) == count:
                    return cls(cores, fds)
            for fd in fds:
                os.close(fd)
            if time.monotonic() > deadline:
                raise RankStartError(
                    f"the ranks need {count} cores of {allowed}, but only {cores} were not held by other "
                    f"replicas' ranks after {timeout_s:.0f}s (locks: {lock_dir()}/core-*.lock)"
                )
            if not said:
                note(f"waiting for {count} cores not held by another replica's ranks (up to {timeout_s:.0f}s)")
                said = True
            time.sleep(0.5)

    def per_rank(self, ranks: int) -> tuple[tuple[int, ...], ...]:
        """The cores split into `ranks` equal consecutive groups."""
        size = len(self.cores) // ranks
        return tuple(tuple(self.cores[i * size : (i + 1) * size]) for i in range(ranks))

    def release(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = []
