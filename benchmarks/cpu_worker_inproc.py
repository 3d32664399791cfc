"""vLLM on CPU, one rank: its model worker in a process of its own (vLLM's default) or inside the engine core.

vLLM's CPU platform starts a single-rank engine as three processes: the API server, the engine core and the model
worker, the last two with `spawn`, so each imports vLLM and torch afresh. With VLLM_ENABLE_V1_MULTIPROCESSING=0 the
engine core (still a process of its own: the OpenAI server always runs it apart) runs the worker itself. This script
starts plain vLLM both ways on the demo model, alternating, and compares start-up time (to the first completion),
memory (RSS and PSS of the whole process tree) and serving (vLLM's own benchmark at each concurrency).

  .venv/bin/python benchmarks/cpu_worker_inproc.py             # 3 rounds, 200 prompts at concurrency 1 and 16
  .venv/bin/python benchmarks/cpu_worker_inproc.py --quick     # 1 round, 20 prompts
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
sys.path.insert(0, str(REPO / "benchmarks"))

import overhead  # noqa: E402
from overhead import PlainVLLM, console, memory_mb, pass_settings, pick_ports, run_pass  # noqa: E402

from flagscale.actions.bench import vllm_bench_worker  # noqa: E402

MODES = {"worker process": "1", "worker in engine core": "0"}
METRICS = (("output tok/s", "output_tok_s", None), ("TTFT p50 ms", "ttft_ms", "p50"), ("TPOT p50 ms", "tpot_ms", "p50"))


class Plain(PlainVLLM):
    def __init__(self, mode: str, *args):
        super().__init__(*args)
        self.name = f"plain vLLM ({mode})"
        self.multiprocessing = MODES[mode]

    def start(self) -> float:
        saved = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = self.multiprocessing
        try:
            return super().start()
        finally:
            if saved is None:
                del os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"]
            else:
                os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = saved


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=None, help="A/B rounds (default 3; 1 with --quick)")
    parser.add_argument("--num-prompts", type=int, default=None, help="prompts per pass (default 200; 20 with --quick)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args()
    args.rounds = args.rounds or (1 if args.quick else 3)
    args.num_prompts = args.num_prompts or (20 if args.quick else 200)
    return args


def median(rows: list[dict], key: str, stat: str | None) -> float:
    return statistics.median(row[key] if stat is None else row[key][stat] for row in rows)


def main() -> int:
    args = parse_args()
    from flagscale.demo_model import ensure_demo_model

    model_dir = ensure_demo_model()
    work_dir = Path(tempfile.mkdtemp(prefix="flagscale-bench-", dir="/tmp"))
    output = args.output or REPO / "benchmarks" / "results" / f"cpu-worker-inproc-{time.strftime('%Y%m%d-%H%M%S')}.json"
    (port,) = pick_ports([None])
    rounds: list[dict[str, Any]] = []
    with vllm_bench_worker(work_dir / "bench-client.log") as run_bench:
        for round_index in range(args.rounds):
            # alternate which mode goes first, so a warming machine favours neither
            order = list(MODES) if round_index % 2 == 0 else list(reversed(MODES))
            results: dict[str, Any] = {}
            for mode in order:
                server = Plain(mode, model_dir, port, work_dir)
                try:
                    startup = server.start()
                    memory = memory_mb(server.processes())
                    passes = {}
                    for concurrency in args.concurrency:
                        settings = pass_settings(args, round_index, concurrency)
                        row = run_pass(
                            run_bench,
                            server.url,
                            model_dir,
                            settings,
                            concurrency,
                            lambda server=server: {"plain": server.processes()},
                        )
                        passes[str(concurrency)] = row
                finally:
                    server.stop()
                results[mode] = {"startup_s": round(startup, 1), "memory": memory, "passes": passes}
                console.print(
                    f"round {round_index + 1} {mode:>22}: first completion {startup:5.1f} s, "
                    f"{memory['processes']} processes, PSS {memory['pss_mb']:.0f} MB, "
                    + ", ".join(f"c={c} {p['output_tok_s']:.0f} tok/s" for c, p in passes.items()),
                    soft_wrap=True,
                )
            rounds.append(results)
    summary: dict[str, Any] = {}
    for mode in MODES:
        summary[mode] = {
            "startup_s": statistics.median(r[mode]["startup_s"] for r in rounds),
            "pss_mb": round(statistics.median(r[mode]["memory"]["pss_mb"] for r in rounds)),
            "rss_mb": round(statistics.median(r[mode]["memory"]["rss_mb"] for r in rounds)),
        }
        for concurrency in map(str, args.concurrency):
            rows = [r[mode]["passes"][concurrency] for r in rounds]
            summary[mode][f"c={concurrency}"] = {label: round(median(rows, k, s), 1) for label, k, s in METRICS}
    base, inproc = (summary[m] for m in MODES)
    ratios = {
        "startup_s": round(inproc["startup_s"] / base["startup_s"], 2),
        "pss_mb": round(inproc["pss_mb"] / base["pss_mb"], 2),
        **{
            key: {label: round(inproc[key][label] / base[key][label], 2) for label in inproc[key]}
            for key in inproc
            if key.startswith("c=")
        },
    }
    report = {
        "settings": {**vars(args), "output": str(output), "engine_args": overhead.ENGINE_ARGS, "model": str(model_dir)},
        "machine": {"cpus": os.cpu_count()},
        "rounds": rounds,
        "medians": summary,
        "ratios_inproc_over_process": ratios,
    }
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(report, indent=2))
    console.print_json(json.dumps({"medians": summary, "ratios_inproc_over_process": ratios}))
    console.print(f"written to {output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
