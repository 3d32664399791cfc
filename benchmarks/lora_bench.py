"""LoRA adapters under Zipf popularity: the adapter placement (flagscale/router/policies/adapters.py) vs the same
router without it (adapter-oblivious: each adapter's own policy over every replica, today's routing) vs one plain
vLLM server with every adapter (issue 52).

Engines: `--replicas` plain vLLM servers (`--enable-lora --max-loras M`), each started by this script with every one
of `--adapters` generated rank-`--rank` adapters of the base (flagscale/demo_model.py's ensure_lora: q/k/v/o_proj,
B nonzero) loaded through vLLM's runtime LoRA route, so the engines are the same for every pass. On CPU (the
default): the demo model, float32, each engine's model worker bound to a core of its own (VLLM_CPU_OMP_THREADS_BIND,
as the orchestrator binds them). With `--gpu`: benchmarks/gpu/model.py's random-weight Llama of `--size` (1b),
bfloat16, enforce_eager, one engine per GPU (CUDA_VISIBLE_DEVICES), or all on GPU 0 with `--same-gpu` (started one
after another, 0.4 of its memory each); `--max-loras` (4 CPU, 16 GPU): adapter slots per engine, fewer than the
adapters either way; `--max-cpu-loras` (default: every adapter): the adapters an engine keeps in host memory; one
not among them is read from disk again when a request needs it.

The router: the project's Router class in a process of its own (benchmarks/fixed_router.py), its replica list
fixed to those engines (no Ray), with or without the placement; the placement counts what it would call loads and
evictions in both modes (an adapter sent to a replica that did not hold it among its last max_loras), per adapter
(its /metrics). The plain baseline: the same workload straight to the first engine, per replica the fair comparison
("no worse than plain vLLM per replica": the router's tok/s over its replicas).

Workloads (`--workloads`): `zipf`: `--requests` streamed completions, `--concurrency` at once, each for an adapter
drawn from a Zipf law (s = `--zipf`) over the adapters, a prompt of `--input-len` tokens (0: a short one),
`--tokens` tokens out (ignore_eos); `hot`: the same, but the second half sends every other request to the least
popular adapter (`--hot` alone: only that one). `--rates R ...`: open loop instead, each workload at each rate
(`zipf@5`): Poisson arrivals at R requests/s through the router, and R / `--replicas` (one replica's share) to the
plain engine, so its TTFT p90 against the placed router's is the per-replica comparison there (rate 0: the closed
loop, `zipf`, among them). vLLM runs at most max_loras distinct adapters in a batch: a request for another waits for
a slot, so a concurrency that mixes more adapters than max_loras per replica is where placement counts. After a
warm-up of every engine, the modes alternate (reversed every other pass), `--rounds` of zipf and `--hot-rounds` of
hot. Per pass: TTFT p50/p90, output tok/s, requests/s, adapter loads per minute (the hot pass: the hot adapter's
TTFT too). Bounded in time (GPU defaults): no request started after `--pass-max-s` of a pass (those left:
`not_sent`), no set of passes started that may end past `--budget-s` from the start (skipped whole, named). A
markdown table and the targets' ratios printed at the end; JSON to `--output`. On a machine of few cores, two
engines' spinning model workers take every core from their API servers, the router and the clients: measure the
per-replica comparison on a machine with cores to spare beyond the engines', or on GPUs.

  .venv/bin/python benchmarks/lora_bench.py                          # CPU: 50 adapters, 2 replicas, max_loras 4
  .venv/bin/python benchmarks/lora_bench.py --adapters 6 --requests 24 --concurrency 4      # a CPU smoke
  python3 benchmarks/lora_bench.py --gpu --output /tmp/bench/gpu-lora.json     # 1B base, 2 GPUs, max_loras 16, zipf x2 + hot
  python3 benchmarks/lora_bench.py --gpu --same-gpu --max-loras 8 --rates 3 5 --workloads zipf --rounds 1   # open loop

Everything it started is stopped (by pid), also on error or Ctrl-C. Engines and routers are started here, not
through `run`: no Ray, so the two routing modes see the very same engines.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from flagscale.demo_model import ensure_demo_model, ensure_lora  # noqa: E402
from flagscale.devices.nvidia import MULTICAST_OFF  # noqa: E402
from flagscale.net import free_port  # noqa: E402

sys.path.insert(0, str(REPO / "benchmarks"))
from fixed_router import Processes, router_argv, wait_healthy  # noqa: E402  (benchmarks/fixed_router.py)

BASE = "demo"
MODES = ("placed", "oblivious", "plain")
WORKLOADS = ("zipf", "hot")
GPU_MEMORY = 0.85  # of a GPU an engine alone on it takes; engines sharing one: 0.4 each at most
WORDS = (
    "the quick brown fox jumps over a lazy dog while serving engineers measure tokens per second ray serve routes "
    "requests to vllm engines on many hosts and chips prefill decode cache hello world what is the capital of france"
).split()
# (CPU, GPU) defaults of the options left unset: the CPU run as docs/benchmarks.md reports it; the GPU run sized to
# a few minutes on two H200s with a 1B base, its concurrency mixing more adapters than max_loras on each replica
DEFAULTS = {
    "requests": (400, 256),
    "concurrency": (16, 64),
    "tokens": (16, 128),
    "input_len": (0, 256),
    "workloads": (["zipf"], ["zipf", "hot"]),
    "rounds": (1, 2),
    "pass_max_s": (0.0, 30.0),
    "budget_s": (0.0, 400.0),
    # GPU: 2 x 16 slots for 50 adapters, so placement can keep the popular ones resident; at 4 a replica (run on
    # 2026-11-29) every mode spent its time waiting for slots and placement measured 0.72-1.14x oblivious
    "max_loras": (4, 16),
}


def fill_defaults(args: argparse.Namespace) -> argparse.Namespace:
    """The options left unset (None) get the CPU or the GPU (`args.gpu`) default; `--hot` alone: the hot workload
    only; max_cpu_loras: every adapter (all host-held: a GPU run with 8 host slots and one with 50 measured the
    same, so loads from disk were not what limited them); the warm-up: a quarter of the requests on CPU (its first
    batches of each shape run slowly), one concurrency's worth on GPU (the LoRA kernels' first compile)."""
    for key, pair in DEFAULTS.items():
        if getattr(args, key) is None:
            setattr(args, key, pair[1] if args.gpu else pair[0])
    if args.hot:
        args.workloads = ["hot"]
    if args.rates:
        args.workloads = [f"{kind}@{rate:g}" if rate else kind for kind in args.workloads for rate in args.rates]
    if args.max_cpu_loras is None:
        args.max_cpu_loras = args.adapters
    args.max_cpu_loras = max(args.max_cpu_loras, args.max_loras)  # vLLM refuses fewer
    if args.warmup is None:
        args.warmup = args.concurrency if args.gpu else args.requests // 4
    return args


def gpu_layout(replicas: int, gpus: int, same_gpu: bool) -> list[tuple[str, float]]:
    """Each engine's CUDA_VISIBLE_DEVICES and gpu_memory_utilization: one engine per GPU (round robin when there are
    more engines than GPUs), or every engine on GPU 0; engines sharing a GPU split GPU_MEMORY, 0.4 each at most."""
    devices = [0] * replicas if same_gpu else [i % max(gpus, 1) for i in range(replicas)]
    layout = []
    for device in devices:
        sharing = devices.count(device)
        util = GPU_MEMORY if sharing == 1 else min(0.4, GPU_MEMORY / sharing)
        layout.append((str(device), round(util, 3)))
    return layout


def visible_gpus() -> list[str]:
    """The GPUs this script may use: CUDA_VISIBLE_DEVICES where set (another benchmark may hold the others), else
    every GPU nvidia-smi lists."""
    if os.environ.get("CUDA_VISIBLE_DEVICES"):
        return [d.strip() for d in os.environ["CUDA_VISIBLE_DEVICES"].split(",") if d.strip()]
    listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=True).stdout
    return [str(i) for i, line in enumerate(ln for ln in listing.splitlines() if ln.startswith("GPU "))]


def engine_argv(model_dir: Path, port: int, args, gpu_memory: float) -> list[str]:
    argv = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
        "--served-model-name", BASE, "--host", "127.0.0.1", "--port", str(port), "--enforce-eager",
        "--enable-lora", "--max-loras", str(args.max_loras), "--max-lora-rank", str(args.rank),
        "--max-cpu-loras", str(args.max_cpu_loras),
    ]  # fmt: skip
    if args.gpu:
        argv += ["--dtype", "bfloat16", "--max-model-len", str(max(1024, args.input_len + args.tokens + 64))]
        return argv + ["--max-num-seqs", "256", "--gpu-memory-utilization", str(gpu_memory)]
    argv += ["--dtype", "float32", "--max-model-len", "512", "--max-num-seqs", "16"]
    # vLLM's CPU build takes the fraction of the NUMA node's memory, not the machine's: 0.05 of a 9.8-GiB node
    # (this machine kind, 2026-12-02) leaves nothing beside the demo model and its LoRA buffers
    return argv + ["--gpu-memory-utilization", "0.1"]


def engine_env(index: int, args, device: str) -> dict[str, str]:
    env = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    if args.gpu:  # multicast off in every process (the lent machines), FlashInfer's sampler not installed there
        return env | MULTICAST_OFF | {"CUDA_VISIBLE_DEVICES": device, "VLLM_USE_FLASHINFER_SAMPLER": "0"}
    # each engine's model worker on a core of its own (two left to the OS's choice spin against each other on a
    # small machine), as the orchestrator's CPU layout does
    return env | {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_OMP_THREADS_BIND": str(index % (os.cpu_count() or 1)),
    }


def base_model(args) -> Path:
    """The demo model on CPU; on GPU the random-weight Llama of `--size`, built by benchmarks/gpu/model.py in a
    process of its own (on the GPU, which this process so never holds)."""
    if not args.gpu:
        return ensure_demo_model()
    argv = [sys.executable, str(REPO / "benchmarks" / "gpu" / "model.py"), "--size", args.size]
    built = subprocess.run(argv, check=True, stdout=subprocess.PIPE, text=True)  # its log: on stderr
    return Path(built.stdout.strip().splitlines()[-1])


def load_adapters(url: str, adapters: dict[str, str]) -> None:
    for name, path in adapters.items():
        body = json.dumps({"lora_name": name, "lora_path": path}).encode()
        request = urllib.request.Request(
            url + "/v1/load_lora_adapter", body, {"Content-Type": "application/json"}, method="POST"
        )
        urllib.request.urlopen(request, timeout=120).read()


def workload(adapters: list[str], requests: int, zipf: float, hot: bool, seed: int) -> list[str]:
    """Each request's adapter: Zipf over `adapters` (rank 1 most popular); `hot`: the second half sends every other
    request to the least popular adapter."""
    rng = random.Random(seed)
    weights = [1 / (rank**zipf) for rank in range(1, len(adapters) + 1)]
    picks = rng.choices(adapters, weights, k=requests)
    if hot:
        for i in range(requests // 2, requests, 2):
            picks[i] = adapters[-1]
    return picks


def make_prompts(model_dir: Path, count: int, input_len: int, seed: int) -> list[str]:
    """`count` prompts of about `input_len` tokens of the model's tokenizer, each its own words (no shared prefix
    beyond chance); input_len 0: short ones."""
    if input_len <= 0:
        return [f"request {i} the quick brown fox" for i in range(count)]
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    rng = random.Random(seed)
    prompts = []
    for i in range(count):
        text = f"request {i} " + " ".join(rng.choices(WORDS, k=input_len))  # a word is one token or more
        ids = tokenizer.encode(text).ids[:input_len]
        prompts.append(tokenizer.decode(ids))
    return prompts


def percentile(values: list[float], q: float) -> float | None:
    ordered = sorted(values)
    return round(ordered[int(q * (len(ordered) - 1))], 3) if ordered else None


async def drive(
    url: str, picks: list[str], prompts: list[str], args, max_s: float = 0.0, rate: float | None = None
) -> dict[str, Any]:
    """The requests of `picks` (adapter names) with `prompts`, `args.concurrency` at once, or (`rate`) each at its
    Poisson arrival time, `rate` a second on average, whatever is in flight; `max_s` > 0: no request started after
    that many seconds (those left are counted in `not_sent`)."""
    import aiohttp

    ttfts: list[tuple[str, float]] = []
    tokens, failed = 0, 0
    queue = list(enumerate(picks))
    began = time.monotonic()

    async def one(session, index: int, model: str) -> None:
        nonlocal tokens, failed
        body = {"model": model, "prompt": prompts[index % len(prompts)], "max_tokens": args.tokens}
        body |= {"stream": True, "ignore_eos": True, "temperature": 0}
        started = time.monotonic()
        first = None
        try:
            async with session.post(url + "/v1/completions", json=body) as resp:
                if resp.status != 200:
                    raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:200]}")
                async for line in resp.content:
                    if line.startswith(b"data: {"):
                        first = first or time.monotonic()
                        tokens += 1
        except Exception as exc:  # noqa: BLE001 - counted; the first is shown
            failed += 1
            if failed == 1:
                print(f"  a request failed: {exc}", file=sys.stderr)
            return
        ttfts.append((model, (first or time.monotonic()) - started))

    async def worker(session) -> None:
        while queue and not (max_s and time.monotonic() - began > max_s):
            index, model = queue.pop(0)
            await one(session, index, model)

    async def arrivals(session) -> None:
        gaps, due, started = random.Random(len(picks)), began, []
        while queue and not (max_s and time.monotonic() - began > max_s):
            due += gaps.expovariate(rate)
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            index, model = queue.pop(0)
            started.append(asyncio.ensure_future(one(session, index, model)))
        await asyncio.gather(*started)

    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        if rate:
            await arrivals(session)
        else:
            await asyncio.gather(*(worker(session) for _ in range(args.concurrency)))
    wall = time.monotonic() - began
    times = [t for _, t in ttfts]
    hot = [t for model, t in ttfts if model == args.hot_adapter]  # (the hot workload's: None in the others)
    return {
        "requests": len(picks) - len(queue),
        "not_sent": len(queue),
        "failed": failed,
        "wall_s": round(wall, 1),
        "ttft_p50_s": percentile(times, 0.5),
        "ttft_p90_s": percentile(times, 0.9),
        "output_tok_s": round(tokens / wall, 1),
        "requests_s": round(len(ttfts) / wall, 2),
        **({"hot_ttft_p50_s": percentile(hot, 0.5), "hot_ttft_p90_s": percentile(hot, 0.9)} if hot else {}),
    }


def parse_adapter_counts(text: str) -> dict[str, dict[str, int]]:
    """The router's /metrics text: {"loads": {adapter: n}, "evictions": {adapter: n}}."""
    names = {"flagscale_router_adapter_loads_total": "loads", "flagscale_router_adapter_evictions_total": "evictions"}
    counts: dict[str, dict[str, int]] = {"loads": {}, "evictions": {}}
    for line in text.splitlines():
        name, _, rest = line.partition("{")
        if name in names:
            adapter = rest.partition('model="')[2].partition('"')[0]
            counts[names[name]][adapter] = int(float(line.rpartition(" ")[2]))
    return counts


def router_counts(url: str) -> dict[str, dict[str, int]]:
    return parse_adapter_counts(urllib.request.urlopen(url + "/metrics", timeout=30).read().decode())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu", action="store_true", help="the --size base on GPUs, one engine per GPU")
    parser.add_argument("--size", default="1b", help="with --gpu: benchmarks/gpu/model.py's size (default 1b)")
    parser.add_argument("--same-gpu", action="store_true", help="with --gpu: every engine on GPU 0")
    parser.add_argument("--adapters", type=int, default=50)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--max-loras", type=int, help="adapter slots per engine (default 4 CPU, 16 GPU)")
    parser.add_argument("--max-cpu-loras", type=int, help="default: the adapters (every one host-held)")
    parser.add_argument("--requests", type=int, help="per pass (default 400 CPU, 256 GPU)")
    parser.add_argument("--concurrency", type=int, help="default 16 CPU, 64 GPU")
    parser.add_argument(
        "--rates",
        type=float,
        nargs="+",
        help="open loop: Poisson arrivals at each rate (requests/s), not --concurrency; 0: the closed loop as well",
    )
    parser.add_argument("--tokens", type=int, help="output tokens (default 16 CPU, 128 GPU)")
    parser.add_argument("--input-len", type=int, help="prompt tokens, 0: a short prompt (default 0 CPU, 256 GPU)")
    parser.add_argument("--zipf", type=float, default=1.1)
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, help="default: zipf (CPU), zipf hot (GPU)")
    parser.add_argument("--hot", action="store_true", help="only the hot workload (a cold adapter turns hot)")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--rounds", type=int, help="of the zipf workload (default 1 CPU, 2 GPU)")
    parser.add_argument("--hot-rounds", type=int, default=1)
    parser.add_argument("--warmup", type=int, help="requests per engine before the passes")
    parser.add_argument(
        "--pass-max-s", type=float, help="no request started after this many s of a pass (0: none; GPU default 30)"
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        help="no set of passes started that may end past this many seconds from the start (0 CPU, 400 GPU)",
    )
    parser.add_argument("--startup-timeout", type=float, default=600)
    parser.add_argument("--output", type=Path, help="the JSON (default benchmarks/results/{cpu,gpu}-lora-TIME.json)")
    return fill_defaults(parser.parse_args(argv))


def start_engines(args, procs: Processes, model_dir: Path, adapters: dict[str, str]) -> tuple[list[str], list]:
    """The engines, each with every adapter loaded; engines sharing a GPU start one after another (each measures
    the memory left to it). Returns their URLs and argvs."""
    visible = visible_gpus() if args.gpu else []
    layout = [(visible[int(d)] if visible else d, m) for d, m in gpu_layout(args.replicas, len(visible), args.same_gpu)]
    sequential = args.gpu and len({device for device, _ in layout}) < len(layout)
    urls, argvs, pending = [], [], []
    for i, (device, memory) in enumerate(layout):
        port = free_port()
        argv = engine_argv(model_dir, port, args, memory)
        proc = procs.start(argv, f"engine-{i}", engine_env(i, args, device))
        urls.append(f"http://127.0.0.1:{port}")
        argvs.append({"argv": argv[3:], "device": device if args.gpu else "cpu"})
        pending.append((urls[-1], proc, procs.log_dir / f"engine-{i}.log"))
        if sequential:
            wait_healthy(urls[-1], args.startup_timeout, f"vLLM engine {i}", proc, pending[-1][2])
    for i, (url, proc, log) in enumerate(pending):
        wait_healthy(url, args.startup_timeout, f"vLLM engine {i}", proc, log)
        load_adapters(url, adapters)
    return urls, argvs


def run_pass(args, procs: Processes, urls: list[str], mode: str, picks: list[str], prompts: list[str], names, rate):
    """One mode's pass; `rate` (open loop): the router's requests/s, the plain engine one replica's share of it."""
    router, url = None, urls[0]
    if mode != "plain":
        port = free_port()
        models = [BASE, *names]
        config = {
            "port": port, "app": "lora", "replicas": [{"url": u} for u in urls], "models": models,
            "routing": dict.fromkeys(models, {}), "adapter_placement": mode == "placed",
            "spec": {"adapters": dict.fromkeys(names, BASE), "max_loras": {"bench": args.max_loras}},
        }  # fmt: skip
        router = procs.start(router_argv(config), f"router-{mode}")
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, 60, "the router", router, procs.log_dir / f"router-{mode}.log")
    if rate and router is None:
        rate /= args.replicas
    result = asyncio.run(drive(url, picks, prompts, args, args.pass_max_s, rate))
    if router is None:
        result["output_tok_s_per_replica"] = result["output_tok_s"]
        return result
    counts = router_counts(url)
    procs.stop([router])
    loads = sum(counts["loads"].values())
    result |= {"adapter_loads": loads, "evictions": sum(counts["evictions"].values())}
    result["loads_per_min"] = round(loads / (result["wall_s"] / 60), 1)
    result["output_tok_s_per_replica"] = round(result["output_tok_s"] / args.replicas, 1)
    top = sorted(counts["loads"].items(), key=lambda item: -item[1])[:5]
    result["top_loads"] = dict(top)  # the router's per-adapter count, its five most loaded adapters
    return result


def main() -> None:
    args = parse_args()
    work = Path(os.environ.get("TMPDIR", "/tmp")) / f"lora-bench-{os.getpid()}"
    work.mkdir(parents=True)
    procs = Processes(work)
    began = time.monotonic()  # --budget-s counts from here: the model and adapters built, the engines started
    model_dir = base_model(args)
    names = [f"zipf-{i:02d}" for i in range(args.adapters)]
    adapters = {name: str(ensure_lora(model_dir, name, args.rank)) for name in names}
    prompts = make_prompts(model_dir, max(args.requests, args.warmup), args.input_len, seed=0)
    results: dict[str, list[dict[str, Any]]] = {f"{w}/{m}": [] for w in args.workloads for m in args.modes}
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        urls, argvs = start_engines(args, procs, model_dir, adapters)
        started = round(time.monotonic() - began, 1)
        print(f"{args.replicas} engines with {args.adapters} adapters each after {started} s; logs in {work}")
        args.hot_adapter = None
        warm = workload(names, args.warmup, args.zipf, False, seed=-1)
        asyncio.run(warm_up(urls, warm, prompts, args))
        longest = 0.0  # the longest pass so far: a set of passes that long must fit in --budget-s
        for index, (kind, round_) in enumerate(schedule(args.workloads, args.rounds, args.hot_rounds)):
            base, rate = split_kind(kind)
            args.hot_adapter = names[-1] if base == "hot" else None
            picks = workload(names, args.requests, args.zipf, base == "hot", seed=round_)
            if args.budget_s and time.monotonic() - began + longest * len(args.modes) > args.budget_s:
                print(f"skipped {kind} round {round_}: it would end past --budget-s {args.budget_s:g}", flush=True)
                continue  # (a whole set or none: every mode sees the same passes)
            for mode in args.modes if index % 2 == 0 else args.modes[::-1]:  # neither mode always first
                result = run_pass(args, procs, urls, mode, picks, prompts, names, rate)
                result |= {"workload": kind, "mode": mode, "round": round_}
                result["elapsed_s"] = round(time.monotonic() - began)
                longest = max(longest, result["wall_s"])
                print(json.dumps(result), flush=True)
                results[f"{kind}/{mode}"].append(result)
    finally:
        procs.stop()
    report(args, results, {"engines": argvs, "model": str(model_dir), "startup_s": started, "work_dir": str(work)})
    print(f"total {time.monotonic() - began:.0f} s")


def split_kind(kind: str) -> tuple[str, float | None]:
    """A workload's name and its open loop's rate: "zipf@5" -> ("zipf", 5.0), "zipf" -> ("zipf", None)."""
    base, _, rate = kind.partition("@")
    return base, float(rate) if rate else None


def schedule(workloads: list[str], rounds: int, hot_rounds: int) -> list[tuple[str, int]]:
    """The (workload, round) pass sets in order: round by round, each workload's in turn (zipf 0, hot 0, zipf 1),
    so a run cut short by --budget-s has every workload."""
    counts = {kind: rounds if split_kind(kind)[0] == "zipf" else hot_rounds for kind in workloads}
    return [(kind, r) for r in range(max(counts.values(), default=0)) for kind in workloads if r < counts[kind]]


async def warm_up(urls: list[str], picks: list[str], prompts: list[str], args) -> None:
    """Every engine at once: the first batches of each shape (CPU), the LoRA kernels' first compile (GPU)."""
    await asyncio.gather(*(drive(url, picks, prompts, args) for url in urls))


TABLE = (
    ("ttft_p50_s", "TTFT p50 s"), ("ttft_p90_s", "TTFT p90 s"), ("output_tok_s", "output tok/s"),
    ("output_tok_s_per_replica", "per replica"), ("requests_s", "req/s"), ("loads_per_min", "adapter loads/min"),
    ("hot_ttft_p90_s", "hot adapter TTFT p90 s"), ("failed", "failed"), ("not_sent", "not sent"),
)  # fmt: skip


def summarize(results: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, float | None]]:
    """Per workload/mode: the median over its passes of each TABLE column."""
    summary = {}
    for key, rows in results.items():
        summary[key] = {}
        for column, _ in TABLE:
            values = [r[column] for r in rows if r.get(column) is not None]
            summary[key][column] = round(statistics.median(values), 3) if values else None
    return summary


def targets(summary: dict[str, dict[str, float | None]], workload_: str) -> dict[str, float | None]:
    """The issue's targets for one workload: placed/oblivious throughput (>= 1.3) and p90 TTFT (<= 0.5), placed per
    replica / plain (>= 1.0: no worse than plain vLLM per replica): tok/s, or in an open loop (the same tokens/s
    per replica by construction) plain's TTFT p90 over placed's."""
    placed, oblivious = summary.get(f"{workload_}/placed", {}), summary.get(f"{workload_}/oblivious", {})
    plain = summary.get(f"{workload_}/plain", {})

    def ratio(a, b) -> float | None:
        return round(a / b, 2) if a is not None and b else None

    tok = ratio(placed.get("output_tok_s"), oblivious.get("output_tok_s"))
    p90 = ratio(placed.get("ttft_p90_s"), oblivious.get("ttft_p90_s"))
    if split_kind(workload_)[1]:
        per_replica = ratio(plain.get("ttft_p90_s"), placed.get("ttft_p90_s"))
    else:
        per_replica = ratio(placed.get("output_tok_s_per_replica"), plain.get("output_tok_s"))
    met = None
    if tok is not None and p90 is not None:
        met = (tok >= 1.3 or p90 <= 0.5) and (per_replica is None or per_replica >= 1.0)
    return {"tok_s_vs_oblivious": tok, "ttft_p90_vs_oblivious": p90, "per_replica_vs_plain": per_replica, "met": met}


def report(args, results: dict[str, list[dict[str, Any]]], setup: dict[str, Any]) -> None:
    summary = summarize(results)
    verdicts = {w: targets(summary, w) for w in args.workloads}
    out = args.output or REPO / "benchmarks" / "results" / (
        f"{'gpu' if args.gpu else 'cpu'}-lora-{time.strftime('%Y%m%d-%H%M')}.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    document = {"args": {k: v for k, v in vars(args).items() if k != "output"} | {"output": str(out)}}
    document |= {"setup": setup, "results": results, "summary": summary, "targets": verdicts}
    out.write_text(json.dumps(document, indent=1, default=str) + "\n")
    print("\n| workload | mode | " + " | ".join(title for _, title in TABLE) + " |")
    print("|---|---|" + "---|" * len(TABLE))
    for key, row in summary.items():
        cells = ["-" if row[column] is None else str(row[column]) for column, _ in TABLE]
        print(f"| {key.replace('/', ' | ')} | {' | '.join(cells)} |")
    for kind, verdict in verdicts.items():
        basis = "plain's p90 TTFT / placed's" if split_kind(kind)[1] else "placed per replica / plain tok/s"
        print(
            f"{kind}: placed/oblivious tok/s {verdict['tok_s_vs_oblivious']} (target >= 1.3), p90 TTFT "
            f"{verdict['ttft_p90_vs_oblivious']} (or <= 0.5); {basis} {verdict['per_replica_vs_plain']}"
            f" (>= 1.0): {'met' if verdict['met'] else 'not met' if verdict['met'] is not None else '-'}"
        )
    print(f"(written to {out})")


if __name__ == "__main__":
    main()
