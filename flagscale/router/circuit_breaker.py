"""A replica's circuit breaker: replicas that keep failing are skipped for a cool-down, then probed once.

The router trips it (routing to a replica, its /health probe every refresh); the policies only ask `allows`."""

from __future__ import annotations

import enum
import time

COOLDOWN_S = 5.0  # an open circuit stays open this long, then lets one probe through
BREAKER_FAILURES = 3  # consecutive failures (5xx, dropped connection) that open a replica's circuit


class CircuitState(enum.StrEnum):
    """A circuit as requests see it (its value is what `stats` shows)."""

    CLOSED = "closed"  # requests flow
    OPEN = "open"  # skipped: cooling down, waiting for a heartbeat, or its one probe is in flight
    HALF_OPEN = "half_open"  # the next request (or the router's /health probe) is its probe


class CircuitBreaker:
    """closed (requests flow) -> open after `threshold` consecutive failures, or at once on a refused connection
    (`trip`): skipped for `cooldown_s` -> half-open: one probe (a request, or the router's /health probe) is let
    through (`begin`); its success closes the circuit, its failure opens it again for another cool-down, and a
    probe that ends without a verdict (`release`) lets the next request probe.

    A 4xx answer is a success here: the replica worked, the request was the client's problem.

    Where the replica's heartbeats are known (`heartbeat`, from the registry), an opened circuit also waits for one
    published after it opened: the replica publishes only after its own health check, which makes sure the process
    answering on the engine's port is the engine it started (flagscale/replica/engine.py), so a probe that a
    squatter on the port answers does not readmit it. "After" is told without the replica host's clock: the first
    registry read that began after the opening found the record at some `seq`; a greater `seq` was published after
    that read, so after the opening.

    Its fields change only through these methods; `state` is read from them."""

    def __init__(self, threshold: int = BREAKER_FAILURES, cooldown_s: float = COOLDOWN_S):
        self.threshold = threshold
        self.cooldown_s = cooldown_s
        self._failures = 0  # consecutive
        self._open_until = 0.0  # > 0: the circuit was opened; requests wait until then
        self._probing = False  # half-open: the one probe is in flight
        self._opened = 0  # how many times it opened (stats)
        self._opened_at = 0.0  # monotonic time of the last opening
        self._heartbeats = False  # the replica's heartbeats are known (from the registry)
        self._vouch_base: int | None = None  # its seq as the first registry read begun after the opening found it
        self._vouched = True  # a heartbeat published after the last opening was seen (or none are known)

    @property
    def failures(self) -> int:
        """Consecutive failures so far."""
        return self._failures

    @property
    def opened(self) -> int:
        """How many times the circuit opened."""
        return self._opened

    def state(self, now: float | None = None) -> CircuitState:
        now = time.monotonic() if now is None else now
        if self._open_until == 0.0:
            return CircuitState.CLOSED
        if now < self._open_until or self._probing or not self._vouched:
            return CircuitState.OPEN
        return CircuitState.HALF_OPEN

    def heartbeat(self, seq: int, read_began: float) -> None:
        """A registry read that began at `read_began` (monotonic, this process's clock) found the replica's record at
        `seq` (each heartbeat advances it, published after the replica's own health check passed)."""
        self._heartbeats = True
        if self._vouched or read_began < self._opened_at:
            return
        if self._vouch_base is None:
            self._vouch_base = seq
        elif seq > self._vouch_base:
            self._vouched = True

    def allows(self, now: float) -> bool:
        """May a request be offered to this replica now (does not claim the probe)."""
        return self.state(now) is not CircuitState.OPEN

    def begin(self, now: float) -> bool:
        """A request is about to be sent: False if another one already took the half-open probe."""
        state = self.state(now)
        if state is CircuitState.HALF_OPEN:
            self._probing = True
        return state is not CircuitState.OPEN

    def release(self) -> None:
        """The request that may have held the half-open probe ended without a verdict on the replica (cancelled
        before it answered, or an answer that says nothing of the replica): the next request probes."""
        self._probing = False

    def success(self) -> None:
        self._failures = 0
        self._open_until = 0.0
        self._probing = False

    def failure(self, now: float) -> None:
        self._failures += 1
        if self._open_until or self._failures >= self.threshold:  # a failed probe, or too many in a row
            self._open(now)

    def trip(self, now: float) -> None:
        """Open at once (the replica refused the connection: nothing listens there)."""
        self._failures = max(self._failures + 1, self.threshold)
        self._open(now)

    def _open(self, now: float) -> None:
        self._open_until = now + self.cooldown_s
        self._opened_at = time.monotonic()
        self._vouched, self._vouch_base = not self._heartbeats, None
        self._probing = False
        self._opened += 1
