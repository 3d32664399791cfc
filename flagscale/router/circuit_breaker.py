"""A replica's circuit breaker: replicas that keep failing are skipped for a cool-down, then probed once.

The router trips it (routing to a replica, its /health probe every refresh); the policies only ask `allows`."""

from __future__ import annotations

import math
import time

COOLDOWN_S = 5.0  # an open circuit stays open this long, then lets one probe through
BREAKER_FAILURES = 3  # consecutive failures (5xx, dropped connection) that open a replica's circuit


class CircuitBreaker:
    """closed (requests flow) -> open after `threshold` consecutive failures, or at once on a refused connection
    (`trip`): skipped for `cooldown_s` -> half-open: one probe (a request, or the router's /health probe) is let
    through; its success closes the circuit, its failure opens it again for another cool-down.

    A 4xx answer is a success here: the replica worked, the request was the client's problem.

    Where the replica's heartbeats are known (`heartbeat`, from the registry), an opened circuit also waits for one
    published after it opened: the replica publishes only after its own health check, which makes sure the process
    answering on the engine's port is the engine it started (flagscale/replica/engine.py), so a probe that a
    squatter on the port answers does not readmit it."""

    def __init__(self, threshold: int = BREAKER_FAILURES, cooldown_s: float = COOLDOWN_S):
        self.threshold = threshold
        self.cooldown_s = cooldown_s
        self.failures = 0  # consecutive
        self.open_until = 0.0  # > 0: the circuit was opened; requests wait until then
        self.probing = False  # half-open: the one probe is in flight
        self.opened = 0  # how many times it opened (stats)
        self.opened_at = 0.0  # wall clock of the last opening
        self.vouched_at = math.inf  # wall clock of the replica's last heartbeat (inf: none are known)

    def state(self, now: float | None = None) -> str:
        now = time.monotonic() if now is None else now
        if self.open_until == 0.0:
            return "closed"
        if now < self.open_until or self.probing or self.vouched_at < self.opened_at:
            return "open"
        return "half_open"

    def heartbeat(self, at: float) -> None:
        """The replica's last heartbeat (wall clock): published after its own health check passed."""
        self.vouched_at = at

    def allows(self, now: float) -> bool:
        """May a request be offered to this replica now (does not claim the probe)."""
        return self.state(now) in ("closed", "half_open")

    def begin(self, now: float) -> bool:
        """A request is about to be sent: False if another one already took the half-open probe."""
        state = self.state(now)
        if state == "closed":
            return True
        if state == "half_open":
            self.probing = True
            return True
        return False

    def success(self) -> None:
        self.failures = 0
        self.open_until = 0.0
        self.probing = False

    def failure(self, now: float) -> None:
        self.failures += 1
        if self.open_until or self.failures >= self.threshold:  # a failed probe, or too many in a row
            self._open(now)

    def trip(self, now: float) -> None:
        """Open at once (the replica refused the connection: nothing listens there)."""
        self.failures = max(self.failures + 1, self.threshold)
        self._open(now)

    def _open(self, now: float) -> None:
        self.open_until = now + self.cooldown_s
        self.opened_at = time.time()
        self.probing = False
        self.opened += 1
