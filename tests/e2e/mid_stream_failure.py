"""Fails a replica while it is in the middle of the streams it runs: a process of its own beside a test's
streaming clients, whose threads can hold the test's interpreter for seconds at a time on a busy machine
(tests/e2e/test_failover.py).

    python mid_stream_failure.py '{"replicas": [{"replica_id": ..., "url": ..., "pids": [...]}, ...],
                                   "signal": "SIGKILL", "timeout_s": 120, "stream_tokens": 1800}'

It reads each replica's engine counters, prints "ready", and then waits (bounded by timeout_s) for a replica whose
engine runs a request and has generated, since "ready", at least 32 and at most 3/4 of stream_tokens per
request it runs: each one's first tokens sent, none near its end (the test's streams all start at "ready", alone,
and an engine runs its requests in step). The bounds also keep out an engine gone idle, whose running-requests
gauge keeps the value of its last step: it has generated a whole stream's tokens per request by then. It sends
that replica's pids the signal, prints the replica's id and exits 0; 1 when no replica got there in time.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

from flagscale.engines.metrics import engine_metrics

GENERATED, RUNNING = "vllm:generation_tokens_total", "vllm:num_requests_running"


def mid_way(replica: dict, since: float, stream_tokens: int, seen: dict) -> bool:
    began = time.monotonic()
    metrics = engine_metrics(replica["url"])
    running, generated = metrics[RUNNING], metrics[GENERATED] - since
    last = seen.get(replica["replica_id"], {"reads": 0, "slowest_read_s": 0.0})
    slowest = max(last["slowest_read_s"], round(time.monotonic() - began, 2))
    seen[replica["replica_id"]] = {"running": running, "generated": generated, "reads": last["reads"] + 1,
                                   "slowest_read_s": slowest}  # fmt: skip
    return running >= 1 and 32 * running <= generated <= stream_tokens * 3 / 4 * running


def main(spec: dict) -> int:
    replicas = spec["replicas"]
    since = {r["replica_id"]: engine_metrics(r["url"])[GENERATED] for r in replicas}
    print("ready", flush=True)
    seen: dict[str, dict] = {}  # each replica's last reading, for the failure's message
    deadline = time.monotonic() + spec["timeout_s"]
    while time.monotonic() < deadline:
        for replica in replicas:
            try:
                found = mid_way(replica, since[replica["replica_id"]], spec["stream_tokens"], seen)
            except OSError:  # an engine's /metrics unanswered for now
                continue
            if found:
                for pid in replica["pids"]:
                    os.kill(pid, signal.Signals[spec["signal"]])
                print(replica["replica_id"], flush=True)
                return 0
        time.sleep(0.02)
    print(f"no replica mid-way through its streams within {spec['timeout_s']} s; last read: {seen}", flush=True)
    return 1


if __name__ == "__main__":
    sys.exit(main(json.loads(sys.argv[1])))
