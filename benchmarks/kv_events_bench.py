"""KV-event routing (issue 53): the parts measurable without engines. The comparison on live engines (KV
events vs the approximate table vs round_robin vs vllm-router, workloads (a)-(e)) is benchmarks/kv_routing.py,
which feeds its own traces to `simulate` here.

- `keying`: the router's CPU per request to key a prompt as the engine does (tokenize with the model's
  tokenizer.json + chat template, hash the blocks: flagscale/router/kv_keys.py, through kv_events.py's `_keyed`
  against an engine that holds every block of every prompt before), p50/p99 over --repeats, for completions and
  chats of --tokens tokens, each a prompt never seen (keyed up to its first block no engine holds) and one whose
  long prefix was seen before (flagscale/router/token_prefixes.py). The issue's target: <= 1 ms of CPU at p99 for an 8k-token prompt.
- `subscribe`: the router's CPU to follow one engine's KV-event stream (subscription, decoding, index) at --rates
  batches a second from a publisher in another process: an engine publishes a batch every step that stores blocks.
- `oracle`: the hit rate a router with perfect knowledge of every engine's cache would reach on a shared-prefix
  trace (workload (a): --customers long system prompts, Zipf popularity), simulated from the trace and the cache
  sizes (--cache-blocks per replica, LRU, --replicas): the bound the issue compares the real hit rate with.

  .venv/bin/python benchmarks/kv_events_bench.py keying --tokens 1024 8192
  .venv/bin/python benchmarks/kv_events_bench.py subscribe --rates 50 200 800
  .venv/bin/python benchmarks/kv_events_bench.py oracle --replicas 2 --cache-blocks 64
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections import OrderedDict


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def keying(tokenizer: str, tokens: list[int], block_size: int, repeats: int) -> dict:
    from flagscale.router.kv_events import ModelKeys, _keyed  # the project's, on first use
    from flagscale.router.token_prefixes import CHECKS

    keys = ModelKeys({"tokenizer": tokenizer, "hash_algo": "sha256", "hash_seed": "vllm-none-hash"}, None)
    prompts = keys.tokens
    stored: set[int] = set()  # every block of every prompt keyed so far: an engine whose cache holds them all
    words = "serve engine prefix cache block token router replica event index keys hash chat model".split()
    report = {}
    rng = random.Random(7)
    sample = " ".join(rng.choice(words) for _ in range(2000))
    tokens_per_word = len(prompts.of({"prompt": sample}, 1 << 20)[0]) / 2000
    for _ in range(CHECKS):  # a router's first long prompts: the chunked tokens checked against the whole text's
        prompts.of({"prompt": " ".join(rng.choice(words) for _ in range(2000))}, 1 << 20)

    def text_of(count: int) -> str:
        return " ".join(rng.choice(words) for _ in range(count))

    for target in tokens:
        count = int(target / tokens_per_word)
        shared = text_of(count - 40)
        # "new": a prompt never seen (keyed up to its first block no engine holds: one chunk); "seen prefix": the
        # same long prefix with a new end of ~40 words each time (the workloads KV routing is for: token_prefixes.py
        # tokenizes only the end)
        for seen in (False, True):
            for kind in ("completion", "chat"):
                cpu = []
                for _ in range(repeats):
                    text = f"{shared if seen else text_of(count - 40)} {text_of(40)}"
                    body = (
                        {"prompt": text} if kind == "completion" else {"messages": [{"role": "user", "content": text}]}
                    )
                    began = time.process_time()
                    _keyed(keys, body, block_size, held=stored.__contains__)
                    cpu.append((time.process_time() - began) * 1000)
                    ids, _ = prompts.of(body, 1 << 20)  # the engine stores the prompt's blocks (not timed)
                    stored.update(keys.hasher.keys(ids, block_size))
                report[f"{kind} {len(ids)} tokens, {'seen prefix' if seen else 'new'}"] = {
                    "cpu_ms_p50": round(statistics.median(cpu), 3),
                    "cpu_ms_p99": round(_percentile(cpu, 0.99), 3),
                }
    report["prefix cache"] = {"exact": prompts.prefixes.exact, "chunks reused": prompts.prefixes.chunks_reused}
    return report


def oracle(replicas: int, cache_blocks: int, customers: int, prefix_blocks: int, requests: int, seed: int) -> dict:
    """Each request: a customer's prefix (Zipf), then one new block; simulated as `simulate` does."""
    rng = random.Random(seed)
    weights = [1 / (rank + 1) for rank in range(customers)]
    trace = []
    for n in range(requests):
        customer = rng.choices(range(customers), weights)[0]
        blocks = [(customer, i) for i in range(prefix_blocks)] + [("question", n)]
        trace.append((blocks, [], len(blocks)))  # (the question block, the last, is new: never a hit)
    return simulate(trace, replicas, cache_blocks, block_tokens=1)


def simulate(trace, replicas: int, cache_blocks: int, block_tokens: int, emptied: dict[int, int] | None = None) -> dict:
    """The oracle: each request of `trace` -- (its prompt's full-block keys in order, the keys of the further blocks
    it stores (its output's), its prompt's tokens) -- goes to the replica holding the most of its prefix (the
    least-used replica on ties), which reuses those blocks (at most the prompt less its last token, as vLLM does),
    then holds every block of the request (LRU, `cache_blocks` per replica). The hit rate is in tokens, as the
    engines count it: tokens reused / prompt tokens. `emptied`: request index -> a replica whose cache is emptied
    before that request (an engine replaced)."""

    def best(n: int, usable: list, caches: list[OrderedDict], load: list[int]) -> int:
        held = [sum(1 for _ in _leading(usable, cache)) for cache in caches]
        return max(range(replicas), key=lambda r: (held[r], -load[r]))

    hit_rate, load = _replay(trace, replicas, cache_blocks, block_tokens, emptied, best)
    return {"oracle_hit_rate": hit_rate, "requests_per_replica": load}


def simulate_table(
    trace, replicas: int, cache_blocks: int, block_tokens: int, emptied: dict[int, int] | None, forgotten: set[int]
) -> float | None:
    """The approximate table at its best, on the same trace and caches as `simulate`: each request goes to the
    replica it sent the longest prefix of the prompt (the least-used replica where it sent none), and the table
    is forgotten before each request index of `forgotten` (its router process restarted). Its hit rate, against
    the oracle's, bounds what knowing the engines' caches can gain over the table on such a trace (workload (d))."""
    sent: dict = {}  # block -> the replicas it was sent to

    def remembered(n: int, usable: list, caches: list[OrderedDict], load: list[int]) -> int:
        if n in forgotten:
            sent.clear()
        depth, along = [0] * replicas, set(range(replicas))
        for block in usable:
            along &= sent.get(block, set())
            if not along:
                break
            for replica in along:
                depth[replica] += 1
        chosen = max(range(replicas), key=lambda r: (depth[r], -load[r]))
        for block in usable:
            sent.setdefault(block, set()).add(chosen)
        return chosen

    return _replay(trace, replicas, cache_blocks, block_tokens, emptied, remembered)[0]


def _replay(trace, replicas: int, cache_blocks: int, block_tokens: int, emptied, choose) -> tuple[float | None, list]:
    """Requests of `trace` in order, each to the replica `choose(n, usable blocks, caches, load)` picks, which
    reuses the leading blocks it holds and then holds all of the request's (LRU)."""
    caches = [OrderedDict() for _ in range(replicas)]
    load = [0] * replicas
    hits = queries = 0
    for n, (blocks, stored, prompt_tokens) in enumerate(trace):
        if emptied and n in emptied:
            caches[emptied[n]].clear()
        usable = blocks[: max(0, (prompt_tokens - 1) // block_tokens)]
        chosen = choose(n, usable, caches, load)
        hits += sum(1 for _ in _leading(usable, caches[chosen])) * block_tokens
        queries += prompt_tokens
        load[chosen] += 1
        cache = caches[chosen]
        for block in [*blocks, *stored]:
            cache.pop(block, None)
            cache[block] = None
            while len(cache) > cache_blocks:
                cache.popitem(last=False)
    return (round(hits / queries, 4) if queries else None), load


def _leading(blocks, cache):
    for block in blocks:
        if block not in cache:
            return
        yield block


def _publish(port: int, replay_port: int, rate: float, seconds: float) -> None:
    """An engine's side (in a process of its own): answers one replay (nothing buffered), then publishes `rate`
    batches a second for `seconds`, each a BlockStored of 2 blocks as vLLM packs it."""
    import msgspec
    import zmq

    ctx = zmq.Context()
    pub, replay = ctx.socket(zmq.PUB), ctx.socket(zmq.ROUTER)
    pub.bind(f"tcp://127.0.0.1:{port}")
    replay.bind(f"tcp://127.0.0.1:{replay_port}")
    if replay.poll(30_000):
        client, _, _ = replay.recv_multipart()
        replay.send_multipart([client, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])
    time.sleep(0.5)
    rng, began = random.Random(0), time.monotonic()
    for seq in range(int(rate * seconds)):
        event = {"type": "BlockStored", "block_hashes": [rng.getrandbits(63) for _ in range(2)],
                 "parent_block_hash": None, "token_ids": list(range(32)), "block_size": 16, "medium": "GPU"}  # fmt: skip
        pub.send_multipart([b"", seq.to_bytes(8, "big"), msgspec.msgpack.encode([time.time(), [event]])])
        time.sleep(max(0.0, began + (seq + 1) / rate - time.monotonic()))
    time.sleep(0.5)


def subscribe(rates: list[float], seconds: float) -> dict:
    """The router's CPU to follow one engine's event stream (flagscale/router/kv_events.py's subscription and
    index) at each rate of batches a second: the publisher runs in another process."""
    import asyncio
    import multiprocessing

    from flagscale.net import free_port
    from flagscale.router.kv_events import KVEvents

    async def one(rate: float) -> dict:
        port, replay_port = free_port(), free_port()
        publisher = multiprocessing.get_context("spawn").Process(
            target=_publish, args=(port, replay_port, rate, seconds)
        )
        publisher.start()
        hub = KVEvents()
        index = hub.index.follow("r0")
        info = {"endpoint": f"tcp://127.0.0.1:{port}", "replay_endpoint": f"tcp://127.0.0.1:{replay_port}"}
        task = asyncio.get_running_loop().create_task(hub._follow("r0", info))
        deadline = time.monotonic() + 30
        while not index.synced:
            if time.monotonic() > deadline:
                raise TimeoutError("the publisher's replay endpoint never answered")
            await asyncio.sleep(0.05)
        cpu, wall = time.process_time(), time.monotonic()
        while publisher.is_alive():
            await asyncio.sleep(0.2)
        cpu, wall = time.process_time() - cpu, time.monotonic() - wall
        task.cancel()
        batches = index.last_seq + 1
        return {"batches": batches, "cpu_share_of_a_core": round(cpu / wall, 4),
                "cpu_us_per_batch": round(cpu / max(batches, 1) * 1e6, 1)}  # fmt: skip

    return {f"{rate:g} batches/s": asyncio.run(one(rate)) for rate in rates}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    keys = sub.add_parser("keying")
    keys.add_argument("--tokenizer", default=None, help="a model directory (default: the demo model)")
    keys.add_argument("--tokens", type=int, nargs="+", default=[1024, 8192])
    keys.add_argument("--block-size", type=int, default=16)
    keys.add_argument("--repeats", type=int, default=200)
    follow = sub.add_parser("subscribe")
    follow.add_argument("--rates", type=float, nargs="+", default=[50, 200, 800])
    follow.add_argument("--seconds", type=float, default=5.0)
    sim = sub.add_parser("oracle")
    sim.add_argument("--replicas", type=int, default=2)
    sim.add_argument("--cache-blocks", type=int, default=64)
    sim.add_argument("--customers", type=int, default=32)
    sim.add_argument("--prefix-blocks", type=int, default=8)
    sim.add_argument("--requests", type=int, default=2000)
    sim.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.what == "keying":
        from flagscale.demo_model import ensure_demo_model  # the project's, on first use

        tokenizer = args.tokenizer or str(ensure_demo_model())
        print(json.dumps(keying(tokenizer, args.tokens, args.block_size, args.repeats), indent=1))
    elif args.what == "subscribe":
        print(json.dumps(subscribe(args.rates, args.seconds), indent=1))
    else:
        print(
            json.dumps(
                oracle(args.replicas, args.cache_blocks, args.customers, args.prefix_blocks, args.requests, args.seed)
            )
        )


if __name__ == "__main__":
    main()
