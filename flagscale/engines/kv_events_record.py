"""What a replica's registry record tells the router of its engine's KV-event publisher (vLLM's and SGLang's
alike): its endpoints, each data-parallel rank's (both ports + the rank), and how to key blocks as the engine does."""

from __future__ import annotations

from typing import Any


def publisher_record(host: str, pub_port: int, replay_port: int, topic: str, ranks: int, **keying: Any) -> dict:
    """The record's `kv_events`: `keying` are the tokenizer, its revision, trust_remote_code, the chat template,
    hash_algo and hash_seed."""
    return {
        "endpoint": f"tcp://{host}:{pub_port}",
        "replay_endpoint": f"tcp://{host}:{replay_port}",
        "topic": topic,
        # each DP rank's publisher, in rank order (the router follows each, and pins a request to a rank by the
        # X-data-parallel-rank header); one entry for a single engine
        "ranks": [
            {"endpoint": f"tcp://{host}:{pub_port + r}", "replay_endpoint": f"tcp://{host}:{replay_port + r}"}
            for r in range(ranks)
        ],
        **keying,
    }
