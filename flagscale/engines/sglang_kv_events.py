"""SGLang's KV-cache events: the `--kv-events-config` a replica's SGLang server publishes its radix cache's page
events with, and what a router needs to compute the same keys (docs/routing.md, "The engines' own KV events").

SGLang (0.5.17, sglang/srt/disaggregation/kv_events.py) publishes on vLLM's wire format: a PUB socket sending
(topic, 8-byte big-endian sequence, msgpack batch of BlockStored / BlockRemoved / AllBlocksCleared), a ROUTER
socket answering replays from a sequence with an end marker of -1; an endpoint with a wildcard host is bound. A
data-parallel rank publishes on both ports plus its rank. Its keys are per page of `page_size` tokens: sha256 over
the parent page's digest (none for a prompt's first page) and the page's token ids as little-endian uint32, the
event carrying the digest's first 8 bytes (sglang/srt/mem_cache/cpp_utils/hash_binding.cpp, mem_cache/utils.py);
no seed, and neither the LoRA adapter nor a cache salt is hashed.
"""

from __future__ import annotations

import json
from typing import Any

from flagscale.engines.cli_flags import flags_of
from flagscale.engines.kv_events_record import publisher_record

CONFIG_FLAG = "--kv-events-config"
HASH_ALGO = "sglang_sha256"  # flagscale/router/kv_keys.py computes it
# SGLang's default page is one token: an event and a key per token. The router follows an engine whose pages are at
# least this long; a smaller page routes on the approximate table (give engine_args.page_size: 16 or more).
MIN_PAGE_TOKENS = 16


def kv_events_launch(
    argv: list[str], host: str, pub_port: int, replay_port: int, topic: str, ranks: int = 1
) -> tuple[list[str], dict[str, Any]] | None:
    """The flags that make the server publish on host:pub_port (replays on host:replay_port; rank r of a
    data-parallel server on both + r), and what its registry record tells the router. None where the router could
    not repeat its keys or follow it at a bearable cost: no radix cache, speculative decoding (EAGLE keys its pages
    by token pairs), a page under MIN_PAGE_TOKENS, no tokenizer in the server, or a config of the user's own."""
    flags = flags_of(argv)
    if CONFIG_FLAG in flags or "--disable-radix-cache" in flags or "--skip-tokenizer-init" in flags:
        return None
    if flags.get("--speculative-algorithm") not in (None, True, "None", "none", ""):
        return None
    try:
        page = int(flags.get("--page-size") or 1)
    except ValueError:
        return None
    if page < MIN_PAGE_TOKENS:
        return None
    config = {
        "publisher": "zmq",
        "endpoint": f"tcp://*:{pub_port}",
        "replay_endpoint": f"tcp://*:{replay_port}",
        "topic": topic,
    }
    record = publisher_record(
        host,
        pub_port,
        replay_port,
        topic,
        ranks,
        tokenizer=str(flags.get("--tokenizer-path") or flags.get("--model-path") or ""),
        tokenizer_revision=flags.get("--revision") or None,
        trust_remote_code=flags.get("--trust-remote-code") is True,
        chat_template=flags.get("--chat-template") or None,
        hash_algo=HASH_ALGO,
        hash_seed="",
    )
    return [CONFIG_FLAG, json.dumps(config)], record
