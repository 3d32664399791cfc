"""Prefix routing on the engines' own KV events against the approximate table, round_robin and vllm-router, on the
same engines (issue 53's benchmark matrix).

Engines: `--engines` plain vLLM servers started here together (no Ray; on a GPU each given its KV cache in bytes,
so that none profiles memory another is filling; --engines-one-by-one as before), each with prefix caching, a KV
cache capped by `num_gpu_blocks_override` (sized so that workload (a)'s working set exceeds one engine's cache but
fits in all of them: --fill x working set / engines), and `--kv-events-config` on two ports of its own
(flagscale/engines/vllm_kv_events.py, as a replica's engine is planned), with VLLM_SERVER_DEV_MODE so that every
pass starts from empty caches (POST /reset_prefix_cache, which the engine publishes as AllBlocksCleared).

Systems, in front of the same engines, alternating within each round (the order reversed every other round):
  kv_events    the project's Router (benchmarks/fixed_router.py, its own process, fixed replica list), cache_aware
               with routing_options.kv_events: true: it subscribes to the engines' events like a deployed router
  table        the same with kv_events: false: the approximate prefix table
  round_robin  the same router, round_robin
  vllm_router  the vllm-router binary, --policy cache_aware (its own approximate tree)
Each pass starts the system's router process(es) anew (a KV-events router rebuilds its index from the replay
endpoints), waits --settle-s, and stops them after.

Workloads:
  a  shared long prefixes: --customers system prompts of ~--prefix-tokens tokens, Zipf (--zipf) popularity, a short
     new question each (completions, streamed, ignore_eos, --output-len tokens), --concurrency at once
  c  no reuse: random prompts of ~--random-tokens tokens (the cost of the machinery)
  d  (a) with the router process(es) restarted half-way and an engine replaced at three quarters (its prefix cache
     emptied, as a replacement's starts: /reset_prefix_cache; in-flight requests drained first, the gaps not timed;
     the oracle's first replica emptied at the same request)
  e  (a) through --routers router processes, requests spread over them in turn (the project's table processes
     share routing hints through benchmarks/fixed_router.py's file stand-in for the GCS; vllm-router processes
     know nothing of each other)
  b  multi-turn chats with growing context (benchmarks/routing.py's workload; no oracle)
A pass issues requests until the trace ends or --pass-s elapse (a time cap, for the GPU budget); the oracle
(benchmarks/kv_events_bench.py's simulate: perfect knowledge of every engine's LRU cache) runs on the requests
the pass actually issued, with the same cache sizes and block keys computed from the engine's tokens; beside it
the table at its best (simulate_table: each prompt where it sent the longest prefix of it, forgotten where (d)'s
router restarted): the oracle's hit rate over it is about the most that knowing the engines' caches can gain over
the table on the trace (the oracle leaves out what is in flight, so a router can pass it by a point or two).

Per system x workload (medians over --rounds): the engines' own prefix-cache hit rate over the pass
(vllm:prefix_cache_hits / queries), the oracle's, TTFT p50/p90, output tok/s, router CPU ms per request (psutil,
the router processes' CPU during the pass), failed requests; for kv_events, the tokens the router predicted as
cached against the engines' own hits, and requests that fell back to the table. Then the issue's targets.

  .venv/bin/python benchmarks/kv_routing.py                   # CPU smoke: 2 engines of the demo model
  python3 benchmarks/kv_routing.py --gpu --output /tmp/kv_routing.json    # 4 engines on one GPU (8b, dummy weights)
  python3 benchmarks/kv_routing.py --gpu --gpus 2 --engines 2              # an engine per GPU: balance counts there

Everything it started is stopped (by process group), also on error or Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shlex
import shutil
import signal
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
for _path in (REPO, REPO / "benchmarks", REPO / "benchmarks" / "gpu"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from fixed_router import Processes, router_argv, wait_healthy  # noqa: E402  (benchmarks/fixed_router.py)
from kv_events_bench import simulate, simulate_table  # noqa: E402  (benchmarks/kv_events_bench.py: the oracle)

MODEL = "demo"  # served model name (benchmarks/routing.py's chats ask for this one too)
SYSTEMS = (
    "kv_events", "table", "round_robin", "vllm_router", "kv_prefill", "table_prefill", "kv_inflight", "table_inflight",
    "kv_replica",
)  # fmt: skip
# the project's cache_aware systems, their routing_options beside the defaults: *_prefill / *_inflight the load
# weighed as prefill characters / in-flight requests, whichever the default is; kv_replica each replica's own
# prefill queue, where engines sharing a GPU are weighed on the GPU's by default
CACHE_AWARE: dict[str, dict[str, Any]] = {
    "kv_events": {"kv_events": True}, "table": {"kv_events": False},
    "kv_prefill": {"kv_events": True, "balance_by": "prefill"},
    "table_prefill": {"kv_events": False, "balance_by": "prefill"},
    "kv_inflight": {"kv_events": True, "balance_by": "inflight"},
    "table_inflight": {"kv_events": False, "balance_by": "inflight"},
    "kv_replica": {"kv_events": True, "balance_scope": "replica"},
}  # fmt: skip
WORKLOADS = ("a", "c", "d", "e", "b")
# the demo tokenizer's words (one or two tokens each), as benchmarks/routing.py writes its prompts
WORDS = (
    "the quick brown fox jumps over a lazy dog while serving engineers measure tokens per second ray serve routes "
    "requests to vllm engines on many hosts and chips prefill decode cache hello world what is the capital of "
    "france paris berlin tokyo one two three four five system user assistant content role message stream chunk"
).split()
CPU_DEFAULTS = {
    "size": "demo", "engines": 2, "block_size": 128, "customers": 8, "prefix_tokens": 700, "question_words": 12,
    "random_tokens": 400, "output_len": 8, "requests": 48, "concurrency": 4, "pass_s": 60.0, "max_model_len": 2048,
    "gpu_memory_utilization": 0.05, "settle_s": 1.5, "rounds": 1,
}  # fmt: skip
GPU_DEFAULTS = {
    "size": "8b", "engines": 4, "block_size": 16, "customers": 48, "prefix_tokens": 2048, "question_words": 24,
    "random_tokens": 1024, "output_len": 32, "requests": 600, "concurrency": 32, "pass_s": 12.0,
    "max_model_len": 4096, "gpu_memory_utilization": 0.2, "settle_s": 1.0, "rounds": 1,
}  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu", action="store_true", help="GPU sizes (4 engines on one GPU, 8b dummy weights)")
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS[:4]))
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=["a", "c", "d", "e"])
    parser.add_argument("--size", help="benchmarks/gpu/model.py size, or demo (CPU: demo; GPU: 8b)")
    parser.add_argument("--engines", type=int)
    parser.add_argument(
        "--gpus", type=int, default=1, help="with --gpu: the engines dealt over this many GPUs (default: all on one)"
    )
    parser.add_argument(
        "--engines-one-by-one", action="store_true", help="each engine healthy before the next starts (as before)"
    )
    parser.add_argument("--block-size", type=int, help="KV block size in tokens (CPU: 128, vLLM's; GPU: 16)")
    parser.add_argument("--cache-blocks", type=int, help="num_gpu_blocks_override (default: sized by --fill)")
    parser.add_argument("--fill", type=float, default=1.5, help="all engines' caches together / (a)'s working set")
    parser.add_argument("--customers", type=int)
    parser.add_argument("--prefix-tokens", type=int, help="each customer's system prompt, about")
    parser.add_argument("--question-words", type=int)
    parser.add_argument("--zipf", type=float, default=1.0)
    parser.add_argument("--random-tokens", type=int, help="workload (c)'s prompts, about")
    parser.add_argument("--output-len", type=int)
    parser.add_argument("--requests", type=int, help="per pass (c: half as many)")
    parser.add_argument("--concurrency", type=int)
    parser.add_argument("--routers", type=int, default=2, help="router processes of workload (e)")
    parser.add_argument("--pass-s", type=float, help="a pass stops issuing requests after this long")
    parser.add_argument("--rounds", type=int)
    parser.add_argument("--settle-s", type=float, help="after a router (re)starts, before requests")
    parser.add_argument(
        "--balance-abs-threshold", type=int, help="the project's cache_aware routers' load bound (default: theirs)"
    )
    parser.add_argument("--max-model-len", type=int)
    parser.add_argument("--gpu-memory-utilization", type=float)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", "--out", type=Path, default=None)
    args = parser.parse_args(argv)
    for key, value in (GPU_DEFAULTS if args.gpu else CPU_DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


# ------------------------------------------------------------------------------------------------ workloads


def words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(count))


def zipf_picks(rng: random.Random, items: int, count: int, s: float) -> list[int]:
    """`count` draws of 0..items-1, item k with weight 1/(k+1)^s."""
    weights = [1 / (rank + 1) ** s for rank in range(items)]
    return rng.choices(range(items), weights, k=count)


def shared_prefix_trace(args, seed: int, words_per_token: float) -> list[str]:
    """Workload (a): each request a customer's long system prompt (Zipf) and a new short question."""
    rng = random.Random(seed)
    prefix_words = max(1, int(args.prefix_tokens * words_per_token))
    prefixes = [f"customer {c} system prompt: " + words(rng, prefix_words) for c in range(args.customers)]
    picks = zipf_picks(rng, args.customers, args.requests, args.zipf)
    return [f"{prefixes[c]} question {n}: {words(rng, args.question_words)}" for n, c in enumerate(picks)]


def random_trace(args, seed: int, words_per_token: float) -> list[str]:
    """Workload (c): prompts sharing nothing (a request number first, so not even a first block)."""
    rng = random.Random(seed + 7919)
    count = max(1, int(args.random_tokens * words_per_token))
    return [f"{n} {rng.random()} " + words(rng, count) for n in range(max(1, args.requests // 2))]


def block_keys(ids: list[int], block_size: int) -> list[int]:
    """The prompt's full blocks as a hash chain (equal keys: equal prefixes), as a prefix cache keys them."""
    keys, parent = [], 0
    for start in range(0, len(ids) - block_size + 1, block_size):
        parent = hash((parent, tuple(ids[start : start + block_size])))
        keys.append(parent)
    return keys


def oracle_trace(token_ids: list[list[int]], block_size: int, output_len: int) -> list[tuple]:
    """`simulate`'s trace: each request's prompt blocks, the blocks its output fills (each new), its prompt tokens."""
    trace = []
    for n, ids in enumerate(token_ids):
        prompt_blocks = len(ids) // block_size
        stored = [("output", n, b) for b in range(prompt_blocks, (len(ids) + output_len) // block_size)]
        trace.append((block_keys(ids, block_size), stored, len(ids)))
    return trace


def cache_blocks_for(prefix_blocks: list[int], engines: int, fill: float, floor_blocks: int) -> int:
    """Blocks per engine so that all engines together hold `fill` x the working set (the customers' prefixes)
    while one holds less than all of it; at least `floor_blocks` (one max_model_len request)."""
    working_set = sum(prefix_blocks)
    blocks = math.ceil(working_set * fill / engines)
    return max(blocks, floor_blocks)


# ------------------------------------------------------------------------------------------------ engines


def kv_cache_bytes(model_dir: Path, blocks: int, block_size: int, dtype_bytes: int = 2) -> int:
    """What `blocks` KV blocks of the model take (keys and values of every layer, bf16 on a GPU, float32 on CPU),
    with room to spare: --num-gpu-blocks-override then sets the count, and no engine profiles the GPU's free
    memory (nor, on CPU, sizes its cache as a share of its NUMA node less its own RSS, which is <= 0 for a small
    share of a small node)."""
    config = json.loads((model_dir / "config.json").read_text())
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    per_block = 2 * config["num_hidden_layers"] * kv_heads * head_dim * dtype_bytes * block_size
    return int(blocks * per_block * 1.1) + (256 << 20)


def engine_device(index: int, gpus: int, visible: str | None) -> str:
    """The GPU engine `index` runs on with --gpus: the engines dealt round-robin over the first `gpus` of the
    visible devices (CUDA_VISIBLE_DEVICES, else 0..gpus-1)."""
    devices = [d.strip() for d in visible.split(",") if d.strip()] if visible else [str(n) for n in range(gpus)]
    if len(devices) < gpus:
        raise SystemExit(f"--gpus {gpus}: only {len(devices)} visible (CUDA_VISIBLE_DEVICES={visible!r})")
    return devices[index % gpus]


class Engines:
    """The plain vLLM servers, each publishing its KV events on two ports of its own. Started together (on a GPU
    with `--kv-cache-memory-bytes`: no engine profiles the memory another is allocating), or one after another
    with --engines-one-by-one."""

    def __init__(self, args, model_dir: Path, procs: Processes, cache_blocks: int) -> None:
        from flagscale.engines.vllm_kv_events import kv_events_launch
        from flagscale.net import free_port

        self.urls: list[str] = []
        self.kv_events: list[dict[str, Any]] = []
        self.devices: list[dict[str, Any]] = []  # where each engine computes, as its registry record would say
        self.argvs: list[list[str]] = []
        together = not args.engines_one_by_one
        starting = []
        for i in range(args.engines):
            port = free_port()
            argv = [
                sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
                "--served-model-name", MODEL, "--host", "127.0.0.1", "--port", str(port),
                "--max-model-len", str(args.max_model_len), "--enforce-eager", "--enable-prefix-caching",
                "--block-size", str(args.block_size), "--num-gpu-blocks-override", str(cache_blocks),
                "--gpu-memory-utilization", str(args.gpu_memory_utilization), "--prefix-caching-hash-algo", "sha256",
            ]  # fmt: skip
            argv += ["--load-format", "dummy"] if args.gpu else ["--dtype", "float32", "--max-num-seqs", "16"]
            if together or not args.gpu:
                size = kv_cache_bytes(model_dir, cache_blocks, args.block_size, 2 if args.gpu else 4)
                argv += ["--kv-cache-memory-bytes", str(size)]
            # /reset_prefix_cache between passes; a hash seed shared by every engine and the router (vLLM 0.26
            # draws a random first parent without one), as the orchestrator gives its engines
            env = {"VLLM_SERVER_DEV_MODE": "1", "PYTHONHASHSEED": "1234"}
            if not args.gpu:  # each engine's model worker on a core of its own, as the orchestrator binds them
                env |= {"VLLM_CPU_OMP_THREADS_BIND": str(i % (os.cpu_count() or 1))}
                self.devices.append({"cpus": [i % (os.cpu_count() or 1)]})
            else:
                device = engine_device(i, args.gpus, os.environ.get("CUDA_VISIBLE_DEVICES"))
                env |= {"CUDA_VISIBLE_DEVICES": device} if args.gpus > 1 else {}
                self.devices.append({"gpus": [device]})
            made = kv_events_launch(argv, "127.0.0.1", free_port(), free_port(), f"kv@r{i}", env)
            assert made is not None, "these engine args rule KV events out"
            argv += made[0]
            self.argvs.append(argv)
            self.urls.append(f"http://127.0.0.1:{port}")
            self.kv_events.append(made[1])
            starting.append((i, procs.start(argv, f"engine-{i}", env), time.monotonic()))
            if not together:  # each profiles the GPU alone
                self._healthy(*starting.pop())
        for one in starting:
            self._healthy(*one)

    def _healthy(self, index: int, proc: Any, started: float) -> None:
        wait_healthy(self.urls[index], 900, f"vLLM engine {index}", proc)
        print(f"engine {index} up at {self.urls[index]} in {time.monotonic() - started:.0f} s", flush=True)

    def reset_caches(self) -> None:
        """Every engine's prefix cache emptied, and its AllBlocksCleared published: an idle engine publishes its
        queued events only with its next step, so each is sent a one-token request (before the pass's counters)."""
        for index in range(len(self.urls)):
            self.replace(index)

    def replace(self, index: int) -> None:
        """Engine `index` as a replacement would come back: its prefix cache empty (AllBlocksCleared published),
        everything else as it was (a real restart would take the whole pass)."""
        url = self.urls[index]
        request = urllib.request.Request(url + "/reset_prefix_cache", data=b"", method="POST")
        urllib.request.urlopen(request, timeout=30).read()
        body = json.dumps({"model": MODEL, "prompt": "reset", "max_tokens": 1}).encode()
        step = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
        urllib.request.urlopen(step, timeout=60).read()

    def hit_counters(self) -> tuple[float, float, list[tuple[float, float]]]:
        """The engines' prefix-cache hit and query tokens, summed, and each engine's (prompt tokens computed,
        requests finished): how the router spread the work."""
        from flagscale.engines.metrics import engine_metrics

        hits = queries = 0.0
        per_engine = []
        for url in self.urls:
            metrics = engine_metrics(url)
            hit = metrics.get("vllm:prefix_cache_hits_total", 0.0)
            query = metrics.get("vllm:prefix_cache_queries_total", 0.0)
            hits, queries = hits + hit, queries + query
            per_engine.append((query - hit, metrics.get("vllm:request_success_total", 0.0)))
        return hits, queries, per_engine


# ------------------------------------------------------------------------------------------------ routers


def vllm_router_binary() -> str:
    beside = Path(sys.executable).with_name("vllm-router")
    found = str(beside) if beside.exists() else shutil.which("vllm-router")
    if not found:
        raise SystemExit("vllm-router is not installed (beside this python or on PATH)")
    return found


class RouterGroup:
    """One system's router process(es) in front of the engines, their CPU time and /metrics."""

    def __init__(self, system: str, count: int, engines: Engines, procs: Processes, work: Path, args) -> None:
        self.system, self.count, self.engines, self.procs = system, count, engines, procs
        self.work, self.settle_s, self.balance = work, args.settle_s, args.balance_abs_threshold
        self.live: list[tuple[Any, str, Any]] = []  # (Popen, url, psutil.Process)
        self.cpu_s = 0.0  # CPU seconds of processes already stopped, counted from their start's settle
        self.start_cpu_s = 0.0  # CPU seconds the processes took to start and settle (not in cpu_s)
        self.baseline: dict[int, float] = {}
        self.router_metrics: dict[str, float] = {}
        self.starts = 0

    def argv(self, port: int, peers_dir: str | None) -> list[str]:
        from flagscale.net import free_port

        if self.system == "vllm_router":
            return [
                vllm_router_binary(), "--host", "127.0.0.1", "--port", str(port), "--policy", "cache_aware",
                "--log-level", "warning", "--prometheus-port", str(free_port()), "--worker-urls", *self.engines.urls,
            ]  # fmt: skip
        policy = "cache_aware" if self.system in CACHE_AWARE else "round_robin"
        settings: dict[str, Any] = {}
        if policy == "cache_aware":
            settings |= CACHE_AWARE[self.system]
            if self.balance is not None:
                settings["balance_abs_threshold"] = self.balance
        replicas = [
            {"url": u, "kv_events": k, **d}
            for u, k, d in zip(self.engines.urls, self.engines.kv_events, self.engines.devices)
        ]
        config = {
            "port": port, "app": f"kvbench-{os.getpid()}-{self.starts}", "replicas": replicas, "models": [MODEL],
            "routing": {MODEL: {"policy": policy, "settings": settings}}, "processes": self.count,
            "peers_dir": peers_dir,
        }  # fmt: skip
        return router_argv(config)

    def start(self) -> list[str]:
        import psutil

        from flagscale.net import free_port

        self.starts += 1
        peers_dir = str(self.work / f"peers-{self.system}-{self.starts}") if self.count > 1 else None
        started = []
        for i in range(self.count):
            port = free_port()
            proc = self.procs.start(self.argv(port, peers_dir), f"router-{self.system}-{self.starts}-{i}")
            started.append((proc, f"http://127.0.0.1:{port}"))
        for proc, url in started:
            wait_healthy(url, 120, f"router {self.system}", proc)
        time.sleep(self.settle_s)  # a KV-events router's replays, the tokenizer loaded; the peers' reports
        for proc, url in started:
            handle = psutil.Process(proc.pid)
            self.baseline[proc.pid] = _cpu_s(handle)
            self.start_cpu_s += self.baseline[proc.pid]
            self.live.append((proc, url, handle))
        return [url for _, url, _ in self.live]

    def stop(self) -> None:
        """The live processes' CPU since their start and their /metrics counted, then they are stopped."""
        for proc, url, handle in self.live:
            self.cpu_s += _cpu_s(handle) - self.baseline.pop(proc.pid)
            if self.system != "vllm_router":
                for name, value in _router_counters(url, proc.pid).items():
                    self.router_metrics[name] = self.router_metrics.get(name, 0.0) + value
        self.procs.stop([proc for proc, _, _ in self.live])
        self.live = []


def _cpu_s(handle) -> float:
    """CPU seconds of a process and its children."""
    total = 0.0
    for proc in [handle, *handle.children(recursive=True)]:
        try:
            times = proc.cpu_times()
            total += times.user + times.system
        except Exception:  # noqa: BLE001 - a child gone meanwhile
            pass
    return total


ROUTER_COUNTERS = ("flagscale_router_kv_predicted_hit_tokens_total", "flagscale_router_kv_fallbacks_total")


def _router_counters(url: str, pid: int) -> dict[str, float]:
    """The router's KV counters from its /metrics, summed over labels: this process's own series only (with peers
    its /metrics repeats theirs, labelled router_process)."""
    import socket

    try:
        text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    except OSError:
        return {}
    own = f'router_process="{socket.gethostname()}:{pid}"'
    sums: dict[str, float] = {}
    for line in text.splitlines():
        name, _, rest = line.partition("{")
        name = name.partition(" ")[0]
        if name in ROUTER_COUNTERS and ("router_process=" not in rest or own in rest):
            sums[name] = sums.get(name, 0.0) + float(line.rpartition(" ")[2])
    return sums


# ------------------------------------------------------------------------------------------------ load


async def drive(urls: list[str], prompts: list[str], args, breaks=()) -> dict:
    """Closed loop: --concurrency workers take the prompts in order, request n to urls[n % len(urls)], until the
    trace ends or --pass-s elapse. `breaks`: (fraction, action) in order; once that fraction of the trace is issued
    or of --pass-s is gone (whichever first), the rest wait for the requests in flight, `action()` runs (a list it
    returns: the new urls), and the load goes on; the pauses are not timed. The result's `broke_at`: the request
    index at each break."""
    import aiohttp

    records: list[dict[str, Any]] = []
    state = {"next": 0, "inflight": 0, "paused_s": 0.0, "urls": urls, "breaks": list(breaks), "broke_at": []}
    resumed = asyncio.Event()
    resumed.set()
    began = time.monotonic()

    async def one(session, n: int) -> None:
        urls_now = state["urls"]
        body = {"model": MODEL, "prompt": prompts[n], "max_tokens": args.output_len, "temperature": 0}
        body |= {"stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
        started, first, chunks, usage = time.monotonic(), None, 0, None
        try:
            async with session.post(urls_now[n % len(urls_now)] + "/v1/completions", json=body) as resp:
                if resp.status != 200:
                    raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:200]}")
                async for line in resp.content:
                    if not line.startswith(b"data: {"):
                        continue
                    event = json.loads(line[6:])
                    if event.get("usage"):
                        usage = event["usage"]
                    if any(c.get("text") for c in event.get("choices") or ()):
                        first = first or time.monotonic()
                        chunks += 1
        except Exception as exc:  # noqa: BLE001 - counted; the first few shown
            records.append({"n": n, "error": f"{type(exc).__name__}: {exc}"[:200]})
            return
        tokens = usage["completion_tokens"] if usage else chunks
        records.append({"n": n, "ttft_s": (first or time.monotonic()) - started, "tokens": tokens})

    async def pause(n: int) -> None:
        _, action = state["breaks"].pop(0)
        resumed.clear()
        while state["inflight"]:
            await asyncio.sleep(0.02)
        paused = time.monotonic()
        state["broke_at"].append(n)
        state["urls"] = await asyncio.get_running_loop().run_in_executor(None, action) or state["urls"]
        state["paused_s"] += time.monotonic() - paused
        resumed.set()

    async def worker(session) -> None:
        while True:
            await resumed.wait()
            n, elapsed = state["next"], time.monotonic() - began - state["paused_s"]
            if n >= len(prompts) or elapsed > args.pass_s:
                return
            state["next"] += 1
            due = state["breaks"] and state["breaks"][0][0]
            if due and (n >= len(prompts) * due or elapsed > args.pass_s * due):
                await pause(n)
            state["inflight"] += 1
            try:
                await one(session, n)
            finally:
                state["inflight"] -= 1

    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        await asyncio.gather(*(worker(session) for _ in range(args.concurrency)))
    wall = time.monotonic() - began - state["paused_s"]
    return {"records": records, "wall_s": wall, "issued": state["next"], "broke_at": state["broke_at"]}


def summarize(records: list[dict[str, Any]], wall_s: float) -> dict[str, Any]:
    done = [r for r in records if "error" not in r]
    ttft = sorted(r["ttft_s"] * 1000 for r in done)
    errors = sorted({r["error"] for r in records if "error" in r})
    return {
        "requests": len(records),
        "failed": len(records) - len(done),
        "errors": errors[:3],
        "wall_s": round(wall_s, 2),
        "ttft_p50_ms": round(percentile(ttft, 50), 1) if ttft else None,
        "ttft_p90_ms": round(percentile(ttft, 90), 1) if ttft else None,
        "output_tok_s": round(sum(r["tokens"] for r in done) / wall_s, 1) if wall_s > 0 else None,
    }


def percentile(ordered: list[float], q: float) -> float:
    """Linear interpolation between the closest ranks of an ascending list."""
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def chats(url: str, args, seed: int) -> dict:
    """Workload (b): benchmarks/routing.py's multi-turn chats (a shared system prompt, growing conversations)."""
    import routing  # benchmarks/routing.py

    shape = argparse.Namespace(
        system_words=int(args.prefix_tokens * args.words_per_token), user_words=args.question_words,
        conversations=max(2, args.requests // 4), turns=4,
    )  # fmt: skip
    began = time.monotonic()
    done = asyncio.run(
        routing.run_conversations(url, routing.make_workload(seed, shape), args.concurrency, args.output_len)
    )
    records = [
        {"error": r["error"]} if "error" in r else {"ttft_s": r["ttft_s"], "tokens": r["output_tokens"]} for r in done
    ]
    return {"records": records, "wall_s": time.monotonic() - began, "issued": len(records)}


# ------------------------------------------------------------------------------------------------ one pass


def run_pass(system: str, workload: str, ctx: dict[str, Any], args) -> dict[str, Any]:
    """Empty caches, the system's router(s) started, the workload run, hit counters and CPU read, router(s) stopped."""
    engines: Engines = ctx["engines"]
    engines.reset_caches()
    time.sleep(0.3)
    group = RouterGroup(system, args.routers if workload == "e" else 1, engines, ctx["procs"], ctx["work"], args)
    try:
        urls = group.start()
        hits0, queries0, spread0 = engines.hit_counters()
        if workload == "b":
            result = chats(urls[0], args, seed=args.seed + ctx["round"])
        else:
            prompts = ctx["prompts"]["c" if workload == "c" else "a"]
            # (d): the router restarted half-way, an engine replaced (its cache emptied) at three quarters
            breaks = [(0.5, lambda: (group.stop(), group.start())[1]), (0.75, lambda: engines.replace(0))]
            result = asyncio.run(drive(urls, prompts, args, breaks if workload == "d" else ()))
        hits1, queries1, spread1 = engines.hit_counters()
    finally:
        group.stop()
    row = summarize(result["records"], result["wall_s"])
    hits, queries = hits1 - hits0, queries1 - queries0
    row |= {"system": system, "workload": workload, "round": ctx["round"], "issued": result["issued"]}
    row["hit_rate"] = round(hits / queries, 4) if queries else None
    row["engine_hit_tokens"] = hits
    for column, key in (("engine_computed_share", 0), ("engine_request_share", 1)):
        grown = [after[key] - before[key] for before, after in zip(spread0, spread1, strict=True)]
        row[column] = [round(g / sum(grown), 3) for g in grown] if sum(grown) else None
    if workload != "b":
        trace = ctx["oracle"]["c" if workload == "c" else "a"][: result["issued"]]
        # (d): the oracle's first replica emptied where the run's first engine was (a replica's cache, either way)
        emptied = {result["broke_at"][1]: 0} if len(result.get("broke_at") or ()) > 1 else None
        usable_blocks = ctx["cache_blocks"] - 1  # (vLLM keeps one block of the pool as its null block)
        row["oracle_hit_rate"] = simulate(trace, args.engines, usable_blocks, args.block_size, emptied)[
            "oracle_hit_rate"
        ]
        # the table at its best on the same trace, forgotten where (d)'s router restarted
        restarted = {result["broke_at"][0]} if result.get("broke_at") else set()
        row["table_model_hit_rate"] = simulate_table(
            trace, args.engines, usable_blocks, args.block_size, emptied, restarted
        )
    row["router_cpu_ms_per_request"] = round(group.cpu_s * 1000 / max(1, row["requests"]), 3)
    row["router_start_cpu_s"] = round(group.start_cpu_s, 2)
    if CACHE_AWARE.get(system, {}).get("kv_events"):
        row["predicted_hit_tokens"] = group.router_metrics.get(ROUTER_COUNTERS[0])
        row["kv_fallbacks"] = group.router_metrics.get(ROUTER_COUNTERS[1])
    print(json.dumps({k: v for k, v in row.items() if k != "errors" or v}), flush=True)
    return row


# ------------------------------------------------------------------------------------------------ report

COLUMNS = (  # (label, key, format)
    ("hit rate", "hit_rate", "{:.3f}"),
    ("oracle", "oracle_hit_rate", "{:.3f}"),
    ("table model", "table_model_hit_rate", "{:.3f}"),
    ("TTFT p50 ms", "ttft_p50_ms", "{:.1f}"),
    ("TTFT p90 ms", "ttft_p90_ms", "{:.1f}"),
    ("output tok/s", "output_tok_s", "{:.1f}"),
    ("router CPU ms/req", "router_cpu_ms_per_request", "{:.3f}"),
    ("failed", "failed", "{:.0f}"),
    ("predicted hit tok", "predicted_hit_tokens", "{:.0f}"),
    ("engine hit tok", "engine_hit_tokens", "{:.0f}"),
    ("fallbacks", "kv_fallbacks", "{:.0f}"),
)


def medians(rows: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, float | None]]]:
    """workload -> system -> column -> the median over the rounds (failed: the sum)."""
    out: dict[str, dict[str, dict[str, float | None]]] = {}
    for row in rows:
        out.setdefault(row["workload"], {}).setdefault(row["system"], {})
    for workload, systems in out.items():
        for system in systems:
            mine = [r for r in rows if r["workload"] == workload and r["system"] == system]
            for _, key, _ in COLUMNS:
                values = [r[key] for r in mine if r.get(key) is not None]
                if key == "failed":
                    systems[system][key] = sum(values)
                else:
                    systems[system][key] = statistics.median(values) if values else None
    return out


def targets(meds: dict[str, dict[str, dict[str, float | None]]], kv: str = "kv_events") -> list[dict[str, Any]]:
    """The issue's targets for a KV-events system (`kv`), each with its measured value and whether it is met
    (None: a system it compares with was not run); the baselines are today's defaults (table, round_robin)."""

    def get(workload: str, system: str, key: str) -> float | None:
        return meds.get(workload, {}).get(system, {}).get(key)

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b else None

    found = []
    for workload in ("a", "c", "d", "e"):
        hit, best = get(workload, kv, "hit_rate"), get(workload, kv, "oracle_hit_rate")
        gap = None if hit is None or best is None else best - hit
        found.append({"system": kv, "workload": workload, "target": "hit rate within 5 points of the oracle", "value": gap,
                      "shown": None if gap is None else f"{gap * 100:+.1f} points below", "met": None if gap is None
                      else gap <= 0.05})  # fmt: skip
    for workload in ("d", "e"):
        hits = ratio(get(workload, kv, "hit_rate"), get(workload, "table", "hit_rate"))
        p90 = ratio(get(workload, kv, "ttft_p90_ms"), get(workload, "table", "ttft_p90_ms"))
        met = None if hits is None and p90 is None else (hits or 0) >= 1.2 or (p90 is not None and p90 <= 0.6)
        shown = None if met is None else f"hit rate {hits or 0:.2f}x, P90 TTFT {p90 or 0:.2f}x the table's"
        reach = ratio(get(workload, kv, "oracle_hit_rate"), get(workload, kv, "table_model_hit_rate"))
        if shown is not None and reach is not None:
            shown += f" (the oracle's hit rate: {reach:.2f}x the table's at its best on this trace)"
        found.append({"system": kv, "workload": workload, "target": ">= 1.2x the table's hit rate or <= 0.6x its P90 TTFT",
                      "value": [hits, p90], "shown": shown, "met": met})  # fmt: skip
    speed = ratio(get("a", kv, "output_tok_s"), get("a", "round_robin", "output_tok_s"))
    found.append({"system": kv, "workload": "a", "target": ">= 2x round_robin's output tok/s", "value": speed,
                  "shown": None if speed is None else f"{speed:.2f}x", "met": None if speed is None else speed >= 2})  # fmt: skip
    speed = ratio(get("c", kv, "output_tok_s"), get("c", "table", "output_tok_s"))
    kv50, table50 = get("c", kv, "ttft_p50_ms"), get("c", "table", "ttft_p50_ms")
    extra = None if kv50 is None or table50 is None else kv50 - table50
    met = None if speed is None or extra is None else speed >= 0.98 and extra <= 2.0
    shown = None if met is None else f"{speed:.3f}x tok/s, TTFT p50 {extra:+.1f} ms"
    found.append({"system": kv, "workload": "c", "target": ">= 0.98x the table's tok/s and TTFT p50 at most +2 ms",
                  "value": [speed, extra], "shown": shown, "met": met})  # fmt: skip
    return found


def markdown(meds, found: list[dict[str, Any]]) -> str:
    lines = ["| workload | system | " + " | ".join(label for label, _, _ in COLUMNS) + " |"]
    lines.append("|---|---|" + "---|" * len(COLUMNS))
    for workload in WORKLOADS:
        for system in SYSTEMS:
            values = meds.get(workload, {}).get(system)
            if values is None:
                continue
            cells = ["-" if values[key] is None else fmt.format(values[key]) for _, key, fmt in COLUMNS]
            lines.append(f"| {workload} | {system} | " + " | ".join(cells) + " |")
    lines += ["", "| workload | system | target | measured | met |", "|---|---|---|---|---|"]
    for t in found:
        met = "-" if t["met"] is None else ("yes" if t["met"] else "no")
        lines.append(f"| {t['workload']} | {t['system']} | {t['target']} | {t['shown'] or '-'} | {met} |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ main


def prepare(args, model_dir: Path) -> dict[str, Any]:
    """The traces (the same for every system), their engine tokens and oracle traces, and the cache size."""
    from flagscale.router.kv_keys import PromptTokens

    tokens = PromptTokens(str(model_dir))
    sample = words(random.Random(1), 2000)
    args.words_per_token = 2000 / len(tokens.of({"prompt": sample}, 1 << 22)[0])
    prompts = {"a": shared_prefix_trace(args, args.seed, args.words_per_token)}
    prompts["c"] = random_trace(args, args.seed, args.words_per_token)
    ids = {key: [tokens.of({"prompt": p}, 1 << 22)[0] for p in trace] for key, trace in prompts.items()}
    longest = max(len(i) for trace in ids.values() for i in trace) + args.output_len
    if longest > args.max_model_len:
        raise SystemExit(f"prompts of {longest} tokens with their output exceed --max-model-len {args.max_model_len}")
    # the working set: each customer's prefix blocks (the blocks the first request of each customer shares)
    rng = random.Random(args.seed)
    prefix_words = max(1, int(args.prefix_tokens * args.words_per_token))
    prefix_blocks = [
        len(tokens.of({"prompt": f"customer {c} system prompt: " + words(rng, prefix_words)}, 1 << 22)[0])
        // args.block_size
        for c in range(args.customers)
    ]
    floor_blocks = math.ceil(args.max_model_len / args.block_size) + 1
    cache = args.cache_blocks or cache_blocks_for(prefix_blocks, args.engines, args.fill, floor_blocks)
    oracle = {key: oracle_trace(trace, args.block_size, args.output_len) for key, trace in ids.items()}
    print(
        f"trace (a): {len(prompts['a'])} requests over {args.customers} customers, prompts "
        f"{min(map(len, ids['a']))}-{max(map(len, ids['a']))} tokens; working set {sum(prefix_blocks)} blocks of "
        f"{args.block_size}; cache {cache} blocks per engine x {args.engines}; (c): {len(prompts['c'])} requests",
        flush=True,
    )
    return {"prompts": prompts, "oracle": oracle, "cache_blocks": cache, "working_set_blocks": sum(prefix_blocks)}


def main() -> int:
    args = parse_args()
    from model import ensure_model  # benchmarks/gpu/model.py

    command = shlex.join(["python", "benchmarks/kv_routing.py", *sys.argv[1:]])
    started = time.monotonic()
    if args.size == "demo":  # flagscale/demo_model.py's (the demo tokenizer, a tiny shape)
        from flagscale.demo_model import ensure_demo_model

        model_dir = ensure_demo_model()
    else:
        model_dir = ensure_model(args.size, device="cuda" if args.gpu else "cpu", weights=not args.gpu)
    ctx = prepare(args, model_dir)
    work = Path(tempfile.mkdtemp(prefix="kv-routing-"))
    procs = Processes(work)
    ctx |= {"procs": procs, "work": work}
    output = args.output or REPO / "benchmarks" / "results" / f"kv-routing-{time.strftime('%Y%m%d-%H%M%S')}.json"
    print(f"logs in {work}", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    rows: list[dict[str, Any]] = []
    try:
        ctx["engines"] = engines = Engines(args, model_dir, procs, ctx["cache_blocks"])
        print(f"engines up after {time.monotonic() - started:.0f} s", flush=True)
        warm = argparse.Namespace(**{**vars(args), "concurrency": 2, "pass_s": 60.0})
        for url in engines.urls:  # the first batches of each shape run slowly
            asyncio.run(drive([url], ctx["prompts"]["a"][:2] + ctx["prompts"]["c"][:2], warm))
        for round_ in range(args.rounds):
            ctx["round"] = round_
            for w, workload in enumerate(args.workloads):
                shift = (round_ + w) % len(args.systems)  # no system always first
                for system in args.systems[shift:] + args.systems[:shift]:
                    rows.append(run_pass(system, workload, ctx, args))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        procs.stop()
    meds = medians(rows)
    found = [
        t
        for kv in ("kv_events", "kv_prefill", "kv_inflight", "kv_replica")
        if kv in args.systems
        for t in targets(meds, kv)
    ]
    report = {
        "command": command, "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "model_dir": str(model_dir), "cache_blocks": ctx["cache_blocks"],
        "working_set_blocks": ctx["working_set_blocks"], "engine_argv": ctx["engines"].argvs if "engines" in ctx
        else None, "rows": rows, "medians": meds, "targets": found, "total_s": round(time.monotonic() - started, 1),
    }  # fmt: skip
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(report, indent=1) + "\n")
    print()
    print(markdown(meds, found))
    print(f"\n(whole run {report['total_s'] / 60:.1f} min; JSON: {output})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
