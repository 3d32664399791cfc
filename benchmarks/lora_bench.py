"""LoRA adapters under Zipf popularity: the adapter placement (flagscale/router/policies/adapters.py) vs the same
router without it (adapter-oblivious: each adapter's own policy over every replica, today's routing) vs one plain
vLLM server with every adapter (issue 52).

Engines: `--replicas` plain vLLM servers (CPU, the demo model, `--enable-lora --max-loras M`), each started by this
script with every one of `--adapters` generated rank-8 adapters (flagscale/demo_model.py's ensure_demo_lora) loaded
through vLLM's runtime LoRA route, so the engines are the same for every pass. The router: the project's Router
class in a process of its own, its replica list fixed to those engines (no Ray), with or without the placement;
the placement counts what it would call loads and evictions in both modes (an adapter sent to a replica that did
not hold it among its last max_loras). The plain baseline: the same workload straight to the first engine, per
replica the fair comparison ("no worse than plain vLLM per replica": the router's tok/s over its replicas). Each
engine's model worker is bound to a core of its own (VLLM_CPU_OMP_THREADS_BIND), as the orchestrator binds them.

Workload: `--requests` streamed completions, `--concurrency` at once, each for an adapter drawn from a Zipf law
(s = `--zipf`) over the adapters, a short prompt, `--tokens` tokens (ignore_eos); the second half of a `--hot`
pass sends half of its requests to one adapter that was cold. After a warm-up of each engine, the modes alternate
(reversed every other round). Per pass: TTFT p50/p90, output tok/s, requests/s, adapter loads per minute. JSON to
benchmarks/results/, a markdown table printed. On a machine of few cores, two engines' spinning model workers take
every core from their API servers, the router and the clients, which one plain engine alone does not: measure the
per-replica comparison on a machine with a core or more to spare beyond the engines'.

  .venv/bin/python benchmarks/lora_bench.py                          # 50 adapters, 2 replicas, max_loras 4
  .venv/bin/python benchmarks/lora_bench.py --adapters 20 --requests 200 --modes placed oblivious

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
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from flagscale.demo_model import ensure_demo_lora, ensure_demo_model  # noqa: E402
from flagscale.net import free_port  # noqa: E402

BASE = "demo"
MODES = ("placed", "oblivious", "plain")


def engine_argv(port: int, max_loras: int, adapters: int) -> list[str]:
    return [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(ensure_demo_model()),
        "--served-model-name", BASE, "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "512",
        "--max-num-seqs", "16", "--enforce-eager", "--dtype", "float32", "--gpu-memory-utilization", "0.05",
        "--enable-lora", "--max-loras", str(max_loras), "--max-lora-rank", "8", "--max-cpu-loras", str(adapters),
    ]  # fmt: skip


def wait_healthy(url: str, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{what} at {url} was not healthy within {timeout_s:g} s")


def load_adapters(url: str, adapters: dict[str, str]) -> None:
    for name, path in adapters.items():
        body = json.dumps({"lora_name": name, "lora_path": path}).encode()
        request = urllib.request.Request(
            url + "/v1/load_lora_adapter", body, {"Content-Type": "application/json"}, method="POST"
        )
        urllib.request.urlopen(request, timeout=120).read()


def serve_router(port: int, urls: list[str], adapters: list[str], max_loras: int, placed: bool) -> None:
    """One router process: the project's Router over `urls`, each replica serving the base and every adapter;
    `placed`: the adapters' placement orders replicas, else it only counts (adapter-oblivious routing)."""
    from flagscale.config.routing import RoutingSpec
    from flagscale.replica import registry
    from flagscale.router.policies import adapters as placement_module
    from flagscale.router.router import Router
    from flagscale.router.spec import RouterSpec

    if not placed:  # the same bookkeeping, no ordering: the loads and evictions today's routing causes
        placement_module.Placement.order = lambda self, adapter, ranked: ranked
    models = [BASE, *adapters]
    records = [
        registry.ReplicaRecord(
            app="lora", serve_id="demo", replica_id=f"r{i}", models=models, url=url, node_id="", node_ip="127.0.0.1",
            pid=0, engine_pid=0, log_path="", updated_at=time.time() + 10**9,
        )
        for i, url in enumerate(urls)
    ]  # fmt: skip
    registry.list_replicas = lambda app, include_stale=False: records  # the benchmark's stand-in for the GCS
    spec = RouterSpec(
        app="lora",
        host="127.0.0.1",
        port=port,
        models=dict.fromkeys(models, "demo"),
        pin_cpus=False,
        routing={model: RoutingSpec() for model in models},
        refresh_s=3600,
        share_with_peers=False,
        adapters=dict.fromkeys(adapters, BASE),
        max_loras={"demo": max_loras},
    )
    Router(spec)
    threading.Event().wait()


def workload(args, adapters: list[str], seed: int) -> list[str]:
    """Each request's adapter: Zipf over `adapters` (rank 1 most popular); with --hot, the second half sends every
    other request to the least popular adapter."""
    rng = random.Random(seed)
    weights = [1 / (rank**args.zipf) for rank in range(1, len(adapters) + 1)]
    picks = rng.choices(adapters, weights, k=args.requests)
    if args.hot:
        for i in range(args.requests // 2, args.requests, 2):
            picks[i] = adapters[-1]
    return picks


async def drive(url: str, picks: list[str], args) -> dict[str, Any]:
    import aiohttp

    ttfts: list[float] = []
    tokens, failed = 0, 0
    queue = list(enumerate(picks))

    async def one(session, index: int, model: str) -> None:
        nonlocal tokens, failed
        body = {"model": model, "prompt": f"request {index} the quick brown fox", "max_tokens": args.tokens}
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
        ttfts.append((first or time.monotonic()) - started)

    async def worker(session) -> None:
        while queue:
            index, model = queue.pop(0)
            await one(session, index, model)

    began = time.monotonic()
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        await asyncio.gather(*(worker(session) for _ in range(args.concurrency)))
    wall = time.monotonic() - began
    ttfts.sort()
    return {
        "requests": len(picks),
        "failed": failed,
        "wall_s": round(wall, 1),
        "ttft_p50_s": round(statistics.median(ttfts), 3) if ttfts else None,
        "ttft_p90_s": round(ttfts[int(0.9 * (len(ttfts) - 1))], 3) if ttfts else None,
        "output_tok_s": round(tokens / wall, 1),
        "requests_s": round(len(ttfts) / wall, 2),
    }


def router_loads(url: str) -> tuple[int, int]:
    text = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    sums = {"flagscale_router_adapter_loads_total": 0.0, "flagscale_router_adapter_evictions_total": 0.0}
    for line in text.splitlines():
        name = line.partition("{")[0]
        if name in sums:
            sums[name] += float(line.rpartition(" ")[2])
    return int(sums["flagscale_router_adapter_loads_total"]), int(sums["flagscale_router_adapter_evictions_total"])


class Processes:
    """What this benchmark started, each in a session of its own; all stopped at the end (by pid)."""

    def __init__(self, log_dir: Path) -> None:
        self.procs: list[subprocess.Popen] = []
        self.log_dir = log_dir

    def start(self, argv: list[str], name: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        log = open(self.log_dir / f"{name}.log", "w")
        proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
            env={**os.environ, **(env or {})},
        )  # fmt: skip
        self.procs.append(proc)
        return proc

    def stop(self, procs: list[subprocess.Popen] | None = None) -> None:
        chosen = procs if procs is not None else self.procs
        for proc in chosen:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in chosen:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--adapters", type=int, default=50)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--max-loras", type=int, default=4)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--zipf", type=float, default=1.1)
    parser.add_argument("--hot", action="store_true", help="a cold adapter turns hot half-way")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    work = Path(os.environ.get("TMPDIR", "/tmp")) / f"lora-bench-{os.getpid()}"
    work.mkdir(parents=True)
    procs = Processes(work)
    names = [f"zipf-{i:02d}" for i in range(args.adapters)]
    adapters = {name: str(ensure_demo_lora(name)) for name in names}
    env = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    results: dict[str, list[dict[str, Any]]] = {mode: [] for mode in args.modes}
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        urls = []
        for i in range(args.replicas):
            port = free_port()
            # each engine's model worker on a core of its own (two left to the OS's choice spin against each other
            # on a small machine), as the orchestrator's CPU layout does
            bind = {"VLLM_CPU_OMP_THREADS_BIND": str(i % (os.cpu_count() or 1))}
            procs.start(engine_argv(port, args.max_loras, args.adapters), f"engine-{i}", {**env, **bind})
            urls.append(f"http://127.0.0.1:{port}")
        for url in urls:
            wait_healthy(url, 600, "a vLLM engine")
            load_adapters(url, adapters)
        print(f"{args.replicas} engines with {args.adapters} adapters each; max_loras {args.max_loras}")
        for url in urls:  # warm-up: vLLM's CPU engine runs its first batches of each shape slowly
            asyncio.run(drive(url, workload(args, names, seed=-1)[: args.requests // 4], args))
        for round_ in range(args.rounds):
            picks = workload(args, names, seed=round_)
            modes = args.modes if round_ % 2 == 0 else args.modes[::-1]  # neither mode always first
            for mode in modes:
                router = None
                url = urls[0]
                if mode != "plain":
                    port = free_port()
                    argv = [sys.executable, __file__, "router", str(port), json.dumps(urls), json.dumps(names)]
                    router = procs.start([*argv, str(args.max_loras), mode], f"router-{mode}")
                    url = f"http://127.0.0.1:{port}"
                    wait_healthy(url, 60, "the router")
                result = asyncio.run(drive(url, picks, args))
                if router is not None:
                    loads, evictions = router_loads(url)
                    result |= {"adapter_loads": loads, "evictions": evictions}
                    result["loads_per_min"] = round(loads / (result["wall_s"] / 60), 1)
                    result["output_tok_s_per_replica"] = round(result["output_tok_s"] / args.replicas, 1)
                    procs.stop([router])
                else:
                    result["output_tok_s_per_replica"] = result["output_tok_s"]
                result["mode"], result["round"] = mode, round_
                print(json.dumps(result))
                results[mode].append(result)
    finally:
        procs.stop()
    report(args, results)


def report(args, results: dict[str, list[dict[str, Any]]]) -> None:
    out = REPO / "benchmarks" / "results" / f"cpu-lora-{time.strftime('%Y%m%d-%H%M')}.json"
    out.write_text(json.dumps({"args": vars(args), "results": results}, indent=1) + "\n")
    columns = ("ttft_p50_s", "ttft_p90_s", "output_tok_s", "output_tok_s_per_replica", "requests_s", "loads_per_min")
    columns += ("failed",)
    print("\n| mode | TTFT p50 s | TTFT p90 s | output tok/s | per replica | req/s | adapter loads/min | failed |")
    print("|---|---|---|---|---|---|---|---|")
    for mode, rows in results.items():
        cells = []
        for key in columns:
            values = [r[key] for r in rows if r.get(key) is not None]
            cells.append(str(round(statistics.median(values), 3)) if values else "-")
        print(f"| {mode} | {' | '.join(cells)} |")
    print(f"(written to {out})")


if __name__ == "__main__":
    if sys.argv[1:2] == ["router"]:
        port, urls, names, max_loras, mode = sys.argv[2:7]
        serve_router(int(port), json.loads(urls), json.loads(names), int(max_loras), placed=mode == "placed")
    else:
        main()
