"""vLLM's KV-cache events: the `--kv-events-config` a replica's engine publishes its cache's block events with,
and what a router needs to compute the same block keys (docs/routing.md, "The engines' own KV events").

vLLM's engine core publishes, over ZMQ, batches of `BlockStored` / `BlockRemoved` / `AllBlocksCleared` on a PUB
socket (frames: topic, 8-byte big-endian sequence, msgpack payload) and answers replays on a ROUTER socket: a
request carrying a start sequence gets every buffered batch from it, then an end marker of sequence -1
(vllm/distributed/kv_events.py). Its block hashes are those of its prefix cache (vllm/v1/core/kv_cache_utils.py):
the hash function `prefix_caching_hash_algo` names over (parent hash, the block's token ids, extra keys), the first
block's parent derived from PYTHONHASHSEED or a fixed seed.
"""

from __future__ import annotations

import json
from typing import Any

from flagscale.engines.cli_flags import flags_of
from flagscale.engines.kv_events_record import publisher_record

CONFIG_FLAG = "--kv-events-config"
# hash functions the router can compute as the engine does: the cryptographic ones, whose first parent is derived
# from a fixed seed (xxhash's is random per process unless PYTHONHASHSEED is set)
HASH_ALGOS = ("sha256", "sha256_cbor")
TOKENIZER_MODES = ("auto", "hf")  # the fast tokenizer (tokenizer.json) the router loads too
DEFAULT_NONE_HASH_SEED = "vllm-none-hash"  # what the first block's parent is hashed from without PYTHONHASHSEED


def kv_events_launch(
    argv: list[str], host: str, pub_port: int, replay_port: int, topic: str, env: dict[str, str], ranks: int = 1
) -> tuple[list[str], dict[str, Any]] | None:
    """The flags that make the engine publish on host:pub_port (replays on host:replay_port), and what its registry
    record tells the router: the endpoints and how to compute the engine's block keys. None when the engine has no
    prefix cache, publishes by a config of the user's own, or hashes in a way the router cannot repeat.

    A server of `ranks` data-parallel engines (one API server, an engine core per rank, all on this host): each
    rank's publisher binds the ports given plus its rank (vLLM's offset_endpoint_port), so pub_port .. + ranks - 1
    and replay_port .. + ranks - 1 are the caller's to reserve; the record lists every rank's endpoints."""
    flags = flags_of(argv)
    algo = str(flags.get("--prefix-caching-hash-algo", "sha256"))
    seed = env.get("PYTHONHASHSEED")
    if CONFIG_FLAG in flags or "--no-enable-prefix-caching" in flags or (algo not in HASH_ALGOS and seed is None):
        return None
    if str(flags.get("--tokenizer-mode", "auto")) not in TOKENIZER_MODES:  # e.g. mistral's own tokenizer
        return None
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{pub_port}",
        # vLLM binds the replay socket to the address given, but its PUB socket only to a wildcard (any other
        # address it connects to): the events listen on every interface of the host (docs/routing.md)
        "replay_endpoint": f"tcp://{host}:{replay_port}",
        "topic": topic,
    }
    record = publisher_record(
        host,
        pub_port,
        replay_port,
        topic,
        ranks,
        tokenizer=str(flags.get("--tokenizer") or flags.get("--model") or ""),
        tokenizer_revision=flags.get("--tokenizer-revision") or flags.get("--revision") or None,
        trust_remote_code=flags.get("--trust-remote-code") is True,
        chat_template=flags.get("--chat-template") or None,
        hash_algo=algo,
        hash_seed=seed if seed is not None else DEFAULT_NONE_HASH_SEED,
    )
    return [CONFIG_FLAG, json.dumps(config)], record
