"""What a replica's answer says of the replica (flagscale/router/verdict.py): the rule as a table."""

from __future__ import annotations

import pytest

from flagscale.router.verdict import DEAD_MARKER_SCAN_BYTES, Verdict, judge

MARKER = b"EngineDeadError"
DEAD = b'{"error": {"message": "EngineCore encountered an issue", "type": "EngineDeadError"}}'

# status, a path where the engine runs the model, body, the engine kind's dead-engine marker -> verdict
TABLE = [
    (200, True, b"", MARKER, Verdict.OK),
    (200, True, DEAD, MARKER, Verdict.OK),  # below 500 the body is not searched
    (400, True, b"bad request", MARKER, Verdict.OK),  # a 4xx is the client's problem
    (404, False, b"", MARKER, Verdict.OK),
    (499, True, DEAD, MARKER, Verdict.OK),
    (500, True, b"", MARKER, Verdict.FAILED),  # the body not read yet, or not the marker: its health check tells
    (500, True, b"internal error", MARKER, Verdict.FAILED),
    (503, True, DEAD, MARKER, Verdict.ENGINE_DIED),
    (500, True, DEAD, b"", Verdict.FAILED),  # an engine kind without a marker
    (500, True, b"x" * (DEAD_MARKER_SCAN_BYTES - len(MARKER)) + MARKER, MARKER, Verdict.ENGINE_DIED),
    (500, True, b"x" * (DEAD_MARKER_SCAN_BYTES - len(MARKER) + 1) + MARKER, MARKER, Verdict.FAILED),  # too far in
    (500, False, DEAD, MARKER, Verdict.NOT_JUDGED),  # /tokenize, /version...: passed on, the replica not judged
    (502, False, b"", MARKER, Verdict.NOT_JUDGED),
]


@pytest.mark.parametrize(("status", "inference", "body", "marker", "verdict"), TABLE)
def test_an_answer_says_this_of_its_replica(status, inference, body, marker, verdict):
    assert judge(status, inference, body, marker) is verdict
