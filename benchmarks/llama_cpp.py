"""What the orchestrator costs over plain llama.cpp: llama-server through FlagScale vs llama-server alone.

Both serve the same GGUF (the demo model, ${demo_model_gguf:}) with the same llama-server flags: the argv the
llama_cpp engine kind makes of the same engine args (so --parallel, --kv-unified-per-slot, --alias and --threads
match). One replica behind the router vs the bare server, loaded one at a time with vLLM's serving benchmark
(random dataset, streaming, ignore_eos; overhead.py's machinery), alternating plain / orchestrator in each round.
Reports per-system medians over the rounds and the orchestrator/plain ratios, and writes everything to JSON.

  .venv/bin/python benchmarks/llama_cpp.py               # 3 rounds x 100 prompts at concurrency 1 and 8
  .venv/bin/python benchmarks/llama_cpp.py --quick       # smoke test: 1 round x 20 prompts

On a GPU (issue 36; the CUDA llama-server `make llama-cpp` builds there): `--gpu` gives the replica one GPU
(resources.num_gpus 1: Ray's CUDA_VISIBLE_DEVICES, `--n-gpu-layers all` from the engine kind) and plain llama-server
GPU 0 with `--n-gpu-layers all`; `--gguf` / `--tokenizer` serve another model than the demo one (a random-weight
Llama of benchmarks/gpu/model.py converted with `python -m flagscale.demo_model to-gguf CONVERTER DIR OUT f16`).
NVLink multicast stays off in both (GPU_SAFE_ENV), as every GPU benchmark here does.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import overhead  # noqa: E402  (benchmarks/overhead.py: the orchestrator's run/stop, bench passes, medians)
from rich.table import Table  # noqa: E402

from benchmarks.gpu.checks import GPU_SAFE_ENV  # noqa: E402  (NVLink multicast off)
from flagscale.actions.bench import vllm_bench_worker  # noqa: E402
from flagscale.engines import llama_cpp, llama_cpp_build  # noqa: E402
from flagscale.net import port_is_free  # noqa: E402

console = overhead.console
MODEL_NAME = overhead.MODEL_NAME  # conf/serve/demo.yaml's served_model_name, given to both servers
PORT_RANGE = range(8450, 8500)  # clear of overhead.py, routing.py, pd.py (8400-8449) and the GPU bench


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=None, help="A/B rounds (default 3; 1 with --quick)")
    parser.add_argument("--num-prompts", type=int, default=None, help="prompts per pass (default 100; 20 with --quick)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8], help="max concurrency per pass")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--parallel", type=int, default=8, help="max_num_seqs -> --parallel (slots)")
    parser.add_argument("--threads", type=int, default=1, help="the replica's num_cpus -> --threads")
    parser.add_argument("--quick", action="store_true", help="smoke test: 20 prompts, 1 round")
    parser.add_argument("--gpu", action="store_true", help="one GPU for each system, every layer on it")
    parser.add_argument("--gguf", type=Path, default=None, help="the GGUF to serve (default: the demo model's)")
    parser.add_argument("--tokenizer", type=Path, default=None, help="the load's tokenizer dir (default: demo's)")
    parser.add_argument("--max-model-len", type=int, default=512, help="-> --kv-unified-per-slot")
    parser.add_argument("--output", type=Path, default=None, help="default benchmarks/results/llama-cpp-<time>.json")
    args = parser.parse_args()
    args.rounds = args.rounds or (1 if args.quick else 3)
    args.num_prompts = args.num_prompts or (20 if args.quick else 100)
    return args


def engine_args(gguf: Path, args: argparse.Namespace) -> dict[str, Any]:
    return {
        "model": str(gguf),
        "served_model_name": [MODEL_NAME],
        "max_num_seqs": args.parallel,
        "max_model_len": args.max_model_len,
    }


class PlainLlamaServer(overhead.PlainServer):
    """llama-server alone, with the flags the engine kind gives a replica."""

    name = "plain llama-server"

    def __init__(self, gguf: Path, port: int, work_dir: Path, args: argparse.Namespace):
        kind = llama_cpp.KIND
        # --threads as a replica reserving `threads` CPUs gets it
        argv = kind.argv(kind.map_common_args({**engine_args(gguf, args), "threads": args.threads}), "plain")
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = work_dir / "plain-llama-server.log"
        self.argv = kind.launch(argv, "127.0.0.1", port, None, None).argv
        if args.gpu:  # what a user runs on one GPU; the kind's launch outside Ray says --device none
            self.argv = [*self.argv[: self.argv.index("--device")], *self.argv[self.argv.index("--device") + 2 :]]
            self.argv += ["--n-gpu-layers", "all"]
            os.environ.update({"CUDA_VISIBLE_DEVICES": "0", **GPU_SAFE_ENV})  # the plain server inherits it


def orchestrator(gguf: Path, port: int, work_dir: Path, args: argparse.Namespace) -> overhead.Orchestrator:
    """conf/serve.yaml's demo node turned into one llama.cpp replica (its vLLM keys are ignored, with a notice)."""
    orch = overhead.Orchestrator(port, work_dir)
    values = {**engine_args(gguf, args), "served_model_name": MODEL_NAME}
    orch.overrides = [
        "experiment.exp_name=llama-cpp-bench",
        f"experiment.exp_dir={orch.exp_dir}",
        f"experiment.runner.deploy.port={port}",
        "serve.0.engine=llama_cpp",
        f"serve.0.resources.num_cpus={args.threads}",
        *(
            ["serve.0.resources.num_gpus=1", *(f"++experiment.envs.{k}={v}" for k, v in GPU_SAFE_ENV.items())]
            if args.gpu
            else []
        ),
        *overhead.engine_args_overrides(values),
    ]
    return orch


def render(report: dict[str, Any]) -> None:
    settings = report["settings"]
    table = Table(
        title=f"orchestrator vs plain llama-server: median of {settings['rounds']} round(s), "
        f"{settings['num_prompts']} prompts/pass",
        title_justify="left",
    )
    for column in ("metric", "plain", "orchestrator", "orch/plain"):
        table.add_column(column, justify="left" if column == "metric" else "right")
    for concurrency, by_system in report["medians"].items():
        for label, plain in by_system["plain"].items():
            orch = by_system["orchestrator"][label]
            fmt = "{:.0f}" if label == "failed requests" else "{:.1f}"
            cells = ["-" if value is None else fmt.format(value) for value in (plain, orch)]
            ratio = f"{orch / plain:.3f}" if plain and orch is not None else "-"
            table.add_row(f"c={concurrency} {label}", *cells, ratio)
        table.add_section()
    startup = report["startup_s"]
    table.add_row(
        "startup to first completion s",
        f"{startup['plain']:.1f}",
        f"{startup['orchestrator']:.1f}",
        f"{startup['orchestrator'] / startup['plain']:.1f}",
    )
    console.print(table)


def main() -> int:
    args = parse_args()
    from flagscale.demo_model import ensure_demo_model, ensure_demo_model_gguf

    llama_cpp_build.ensure_built()
    if args.gpu and llama_cpp_build.variant().backend != "cuda":
        console.print(f"[red]--gpu needs a CUDA llama-server; this machine's build is {llama_cpp_build.variant().name}")
        return 2
    tokenizer_dir = args.tokenizer or ensure_demo_model()
    gguf = args.gguf or ensure_demo_model_gguf()
    free = [p for p in PORT_RANGE if port_is_free("127.0.0.1", p)]
    plain_port, orch_port = free[0], free[1]
    work_dir = Path(tempfile.mkdtemp(prefix="flagscale-llama-bench-", dir="/tmp"))
    output = args.output or REPO / "benchmarks" / "results" / f"llama-cpp-{time.strftime('%Y%m%d-%H%M%S')}.json"
    plain = PlainLlamaServer(gguf, plain_port, work_dir, args)
    orch = orchestrator(gguf, orch_port, work_dir, args)
    console.print(f"work dir {work_dir}; plain llama-server on :{plain_port}, orchestrator on :{orch_port}")
    signal.signal(signal.SIGTERM, overhead.interrupt)
    try:
        with console.status("starting plain llama-server ..."):
            startup = {"plain": plain.start()}
        plain.stop()
        with console.status("starting the orchestrator ..."):
            startup["orchestrator"] = orch.start()
        with console.status("starting plain llama-server again for the load ..."):
            plain.start()
        console.print(
            f"first completion after: plain {startup['plain']:.1f}s, orchestrator {startup['orchestrator']:.1f}s"
        )
        servers = {"plain": plain.url, "orchestrator": orch.url}
        rounds: list[dict[str, Any]] = []
        with vllm_bench_worker(work_dir / "bench-client.log") as run_bench:
            for round_index in range(args.rounds):
                results: dict[str, Any] = {system: {} for system in servers}
                for concurrency in args.concurrency:
                    # A fresh prompt set per pass, the same for both systems; the order alternates per round.
                    settings = overhead.pass_settings(args, round_index, concurrency)
                    order = list(servers) if round_index % 2 == 0 else list(reversed(servers))
                    for system in order:
                        with console.status(f"round {round_index + 1}/{args.rounds}: {system}, c={concurrency} ..."):
                            row = overhead.run_pass(
                                run_bench,
                                servers[system],
                                tokenizer_dir,
                                settings,
                                concurrency,
                                lambda: {"plain": plain.processes(), "orch": orch.processes()},
                            )
                        results[system][str(concurrency)] = row
                        console.print(
                            f"round {round_index + 1} {system:>12} c={concurrency:<3} {row['output_tok_s']:8.1f} tok/s  "
                            f"TTFT p50 {row['ttft_ms']['p50']:7.1f} ms  TPOT p50 {row['tpot_ms']['p50']:6.1f} ms  "
                            f"failed {row['failed']}"
                        )
                rounds.append(results)
        medians = {str(c): {s: overhead.median_rows(rounds, s, c) for s in servers} for c in args.concurrency}
        report = {
            "settings": {
                **overhead.load_settings(args),
                "parallel": args.parallel,
                "threads": args.threads,
                "gpu": args.gpu,
                "model": str(gguf),
                "dataset": "random",
                "streaming": True,
                "ignore_eos": True,
            },
            "versions": {
                "llama-cpp-python sdist": llama_cpp_build.LLAMA_CPP_PYTHON_VERSION,
                "build": llama_cpp_build.variant().name,
            },
            "machine": {"cpus": os.cpu_count()},
            "startup_s": startup,
            "medians": medians,
            "ratios_orchestrator_over_plain": overhead.ratios_over_plain(medians),
            "rounds": rounds,
            "plain_argv": plain.argv,
            "orchestrator_argv": orch.cli("run"),
            "work_dir": str(work_dir),
        }
        overhead.save_report(report, output, render)
        return 0
    except KeyboardInterrupt:
        console.print("[yellow]interrupted[/]")
        return 130
    finally:
        overhead.stop_both(orch, plain, work_dir)


if __name__ == "__main__":
    sys.exit(main())
