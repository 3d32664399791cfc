"""What tensor parallelism costs or gains on this machine: TP=2 vs TP=1, plain vLLM and through the orchestrator.

Four systems on the demo model with the same engine args (benchmarks/overhead.py's): plain vLLM TP=1 (vLLM's own
CPU binding), plain vLLM TP=2 (ranks bound to cores 0|1, VLLM_CPU_OMP_THREADS_BIND), the orchestrator with
tensor_parallel_size 1 and 2 (it binds TP=2's ranks itself, docs/parallelism.md). A CPU engine's workers spin while
idle, so only one system runs at a time: each is started, loaded with vLLM's serving benchmark (random dataset,
streaming, ignore_eos) at each concurrency, and stopped; the order alternates from round to round. Reports medians
over the rounds, TP=2/TP=1 ratios for plain and orchestrated, and orchestrated/plain at each TP, as JSON.

  .venv/bin/python benchmarks/parallel.py                 # 2 rounds x 100 prompts at concurrency 1 and 8
  .venv/bin/python benchmarks/parallel.py --quick         # 1 round x 20 prompts
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from benchmarks.overhead import (  # noqa: E402
    ENGINE_ARGS,
    METRICS,
    Orchestrator,
    PlainVLLM,
    installed_version,
    load_settings,
    pass_settings,
    pick_ports,
    run_pass,
)
from flagscale.actions.bench import vllm_bench_worker  # noqa: E402

SYSTEMS = ("plain-tp1", "plain-tp2", "orch-tp1", "orch-tp2")
console = Console(highlight=False, width=160)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=None, help="rounds (default 2; 1 with --quick)")
    parser.add_argument("--num-prompts", type=int, default=None, help="prompts per pass (default 100; 20 --quick)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--output", type=Path, default=None, help="default benchmarks/results/parallel-<time>.json")
    args = parser.parse_args()
    args.rounds = args.rounds or (1 if args.quick else 2)
    args.num_prompts = args.num_prompts or (20 if args.quick else 100)
    return args


class PlainTP(PlainVLLM):
    def __init__(self, model_dir: Path, port: int, work_dir: Path, tp: int):
        super().__init__(model_dir, port, work_dir, {**ENGINE_ARGS, "tensor_parallel_size": tp})
        self.log_path = work_dir / f"plain-tp{tp}.log"
        self.bind = {"VLLM_CPU_OMP_THREADS_BIND": "|".join(str(core) for core in range(tp))} if tp > 1 else {}
        if tp > 1:
            self.argv += ["--distributed-executor-backend", "mp"]

    def start(self) -> float:
        saved = dict(os.environ)
        os.environ.update(self.bind)  # Popen in PlainVLLM.start inherits it
        try:
            return super().start()
        finally:
            os.environ.clear()
            os.environ.update(saved)


def orchestrator_tp(port: int, work_dir: Path, tp: int) -> Orchestrator:
    orchestrator = Orchestrator(port, work_dir / f"orch-tp{tp}")
    orchestrator.exp_dir.parent.mkdir(parents=True, exist_ok=True)
    orchestrator.log_path = work_dir / f"orch-tp{tp}.log"
    orchestrator.overrides = [
        o.replace("experiment.exp_name=overhead", f"experiment.exp_name=parallel-tp{tp}")
        for o in orchestrator.overrides
    ]
    orchestrator.overrides.append(f"serve.0.engine_args.tensor_parallel_size={tp}")
    return orchestrator


def server_processes(server):
    return lambda: {"server": server.processes()}


def medians(rounds: list[dict[str, Any]], system: str, concurrency: int) -> dict[str, float]:
    passes = [r[system][str(concurrency)] for r in rounds if system in r]
    out = {
        label: statistics.median(p[key] if stat is None else p[key][stat] for p in passes)
        for label, key, stat in METRICS
    }
    out["failed requests"] = sum(p["failed"] for p in passes)
    return out


def ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def render(report: dict[str, Any]) -> None:
    for concurrency, by_system in report["medians"].items():
        table = Table(title=f"c={concurrency}: median of {report['settings']['rounds']} round(s)", title_justify="left")
        for column in ("metric", *SYSTEMS, "plain tp2/tp1", "orch tp2/tp1", "orch/plain tp1", "orch/plain tp2"):
            table.add_column(column, justify="left" if column == "metric" else "right")
        for label, _, _ in METRICS:
            m = {s: by_system[s][label] for s in SYSTEMS}
            ratios = [
                ratio(m["plain-tp2"], m["plain-tp1"]),
                ratio(m["orch-tp2"], m["orch-tp1"]),
                ratio(m["orch-tp1"], m["plain-tp1"]),
                ratio(m["orch-tp2"], m["plain-tp2"]),
            ]
            table.add_row(
                label, *(f"{m[s]:.1f}" for s in SYSTEMS), *("-" if r is None else f"{r:.2f}x" for r in ratios)
            )
        console.print(table)
    console.print("start-up (s, to the first completion): " + json.dumps(report["startup_s"]))


def main() -> int:
    args = parse_args()
    from flagscale.demo_model import ensure_demo_model

    model_dir = ensure_demo_model()
    (port,) = pick_ports([None])
    work_dir = Path(tempfile.mkdtemp(prefix="flagscale-bench-parallel-", dir="/tmp"))
    output = args.output or REPO / "benchmarks" / "results" / f"parallel-{time.strftime('%Y%m%d-%H%M%S')}.json"
    console.print(f"work dir {work_dir}; every system on :{port}, one at a time")

    def make(system: str):
        tp = int(system[-1])
        if system.startswith("plain"):
            return PlainTP(model_dir, port, work_dir, tp)
        return orchestrator_tp(port, work_dir, tp)

    rounds: list[dict[str, Any]] = []
    startup: dict[str, list[float]] = {s: [] for s in SYSTEMS}
    with vllm_bench_worker(work_dir / "bench-client.log") as run_bench:
        for round_index in range(args.rounds):
            order = SYSTEMS if round_index % 2 == 0 else tuple(reversed(SYSTEMS))
            results: dict[str, Any] = {}
            for system in order:
                server = make(system)
                try:
                    with console.status(f"round {round_index + 1}: starting {system} ..."):
                        startup[system].append(server.start())
                    results[system] = {}
                    for concurrency in args.concurrency:
                        settings = pass_settings(args, round_index, concurrency)
                        with console.status(f"round {round_index + 1}: {system}, concurrency {concurrency} ..."):
                            row = run_pass(
                                run_bench, server.url, model_dir, settings, concurrency, server_processes(server)
                            )
                        results[system][str(concurrency)] = row
                        console.print(
                            f"round {round_index + 1} {system:>9} c={concurrency:<3} {row['output_tok_s']:8.1f} tok/s  "
                            f"TTFT p50 {row['ttft_ms']['p50']:7.1f} ms  TPOT p50 {row['tpot_ms']['p50']:6.1f} ms"
                        )
                finally:
                    server.stop()
            rounds.append(results)
    report = {
        "settings": {
            **load_settings(args),
            "engine_args": ENGINE_ARGS,
            "model": str(model_dir),
        },
        "versions": {"vllm": installed_version("vllm", "vllm-cpu"), "ray": installed_version("ray")},
        "machine": {"cpus": os.cpu_count()},
        "startup_s": {s: statistics.median(v) for s, v in startup.items() if v},
        "medians": {str(c): {s: medians(rounds, s, c) for s in SYSTEMS} for c in args.concurrency},
        "rounds": rounds,
        "work_dir": str(work_dir),
    }
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(report, indent=2))
    render(report)
    console.print(f"results: {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
