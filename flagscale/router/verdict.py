"""What a replica's answer says of the replica (docs/routing.md): a pure rule, apart from the socket code that
acts on it (failover.py, pd.py), so that it can be read, and tested, as a table.

A connection that breaks off (before the answer or during it) is not an answer and is not judged here: the
failover takes it for an engine death at once. After an engine death, a request (or a disaggregated model's
prompt) goes to at most RETRIES_AFTER_ENGINE_DEATH more replicas: it may be what kills them."""

from __future__ import annotations

import enum

RETRIES_AFTER_ENGINE_DEATH = 1  # a request during which an engine died is sent to at most this many more replicas
UNAUTHORIZED = 401
DEAD_MARKER_SCAN_BYTES = 4096  # how much of a 5xx body is searched for the engine kind's engine-dead error


class Verdict(enum.Enum):
    OK = "ok"  # the replica worked: below 500 (a 4xx but 401 is the client's problem), passed on as it is
    NOT_JUDGED = "not judged"  # a 5xx on a path where the engine does not run the model: passed on, no verdict
    FAILED = "failed"  # a 5xx of the model: counted against the replica; its health check says if the engine died
    ENGINE_DIED = "engine died"  # a 5xx whose body is the engine kind's engine-dead error
    # a 401: the replica refused the router's engine key (the client's own key never reaches an engine: keyring.py),
    # so the replica's fault, never the client's: counted against the replica, never passed on
    KEY_REFUSED = "key refused"


def judge(status: int, inference: bool, body: bytes = b"", dead_marker: bytes = b"") -> Verdict:
    """The verdict on a replica that answered `status` (with `body`, where read) on a path where its engine runs
    the model (`inference`: EngineKind.inference_paths) or not; `dead_marker`: the engine kind's engine-dead
    error (EngineKind.dead_engine_marker), looked for in the body's first DEAD_MARKER_SCAN_BYTES."""
    if status == UNAUTHORIZED:
        return Verdict.KEY_REFUSED
    if status < 500:
        return Verdict.OK
    if not inference:
        return Verdict.NOT_JUDGED
    if dead_marker and dead_marker in body[:DEAD_MARKER_SCAN_BYTES]:
        return Verdict.ENGINE_DIED
    return Verdict.FAILED
