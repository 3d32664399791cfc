"""The SLO planner under a real bursty load (issue 51): the same seeded trace, loaded with vLLM's own serving
benchmark (`vllm bench serve`), on one deployment per system, one after another in one run:

- slo: `resources.slo` (the SLO planner, replica/slo_policy.py), min..max replicas;
- request_count: Serve's request-count autoscaling, `target_ongoing_requests` as a user would set it (--target:
  the in-flight requests of one replica at the rate it sustains within the SLO, as auto_tune measures it);
- static_max / static_min: a fixed count at max and at min.

The trace: --rate is one replica's sustainable request rate; the segments (TRACE) are multiples of it: idle, a ramp
in steps to twice it, a plateau, a spike to three times it, a fall, idle again. Each step is one `vllm bench serve`
pass (Poisson arrivals at the step's rate, --seed + the step's index: the same requests for every system; random
dataset, prompt and output lengths uniform within +-50 % of --input-len / --output-len), started at its own time
on one of a few pre-imported benchmark workers (flagscale/actions/bench.py), so a slow step's tail does not delay
the next step's arrivals. Replicas are counted every --poll-s from the router's /metrics (the engines' series carry
a `replica` label): replica-seconds over the trace, and the reaction to the ramp and the spike (seconds from the
segment's start until a second replica serves).

Per system: SLO attainment (share of requests whose TTFT and mean inter-token latency both meet --ttft-ms /
--itl-ms), goodput (such requests per second of trace), replica-seconds, goodput per replica-second, failed
requests, reactions. JSON to benchmarks/results/slo-load-<ts>.json, a markdown table printed. Every deployment is
stopped (`action=stop` on its exp_dir), also on error or Ctrl-C.

  .venv/bin/python benchmarks/slo_load.py                                  # every system, --rate 2
  .venv/bin/python benchmarks/slo_load.py --systems slo request_count --rate 3 --target 2
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO / "benchmarks" / "gpu"))

from model import ensure_model  # noqa: E402  (benchmarks/gpu/model.py)
from routing import CPU_SIZES  # noqa: E402  (benchmarks/routing.py: registers its CPU shapes in model.SIZES)

from flagscale.actions.bench import vllm_bench_worker  # noqa: E402
from flagscale.demo_model import ensure_demo_model  # noqa: E402

PORT = 8370  # clear of overhead.py (8150-8199), routing.py (8300-8349), auto_tune.py (8360), the GPU bench (86xx)
SYSTEMS = ("slo", "request_count", "static_max", "static_min")
# (label, seconds, rate at its start, rate at its end) in multiples of --rate; a ramp goes in STEP_S steps
TRACE = (
    ("idle", 20, 0.0, 0.0),
    ("ramp", 90, 0.3, 2.0),
    ("plateau", 60, 1.6, 1.6),
    ("spike", 20, 3.0, 3.0),
    ("fall", 60, 0.5, 0.5),
    ("idle", 40, 0.0, 0.0),
)
STEP_S = 15
WORKERS = 4  # benchmark processes taking steps in turn (a step's tail overlaps the next step's start)
ENGINE_ARGS = {
    "served_model_name": "demo",
    "max_model_len": 512,
    "max_num_seqs": 16,
    "enforce_eager": True,
    "gpu_memory_utilization": 0.1,
    "dtype": "float32",
}


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    parser.add_argument("--rate", type=float, default=2.0, help="one replica's sustainable request rate (req/s)")
    parser.add_argument("--target", type=float, default=2.0, help="request_count's target_ongoing_requests")
    parser.add_argument("--min-replicas", type=int, default=1)
    parser.add_argument("--max-replicas", type=int, default=2)
    parser.add_argument("--ttft-ms", type=float, default=2000.0)
    parser.add_argument("--itl-ms", type=float, default=250.0)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--downscale-delay-s", type=float, default=30.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--size", choices=["demo", *sorted(CPU_SIZES)], default="cpu-40m",
        help="the model: the demo model (too fast on CPU for the engine to be what saturates), or a random-weight "
        "Llama of benchmarks/gpu/model.py's CPU shapes (benchmarks/routing.py)",
    )  # fmt: skip
    parser.add_argument("--poll-s", type=float, default=2.0)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    return parser.parse_args()


def steps(rate: float) -> list[dict[str, Any]]:
    """The trace as steps: {segment, start_s, seconds, rps}; idle segments have rps 0 (nothing is sent)."""
    out, t = [], 0.0
    for label, seconds, first, last in TRACE:
        count = max(1, round(seconds / STEP_S)) if first != last else 1
        for i in range(count):
            share = first + (last - first) * (i + 0.5) / count if count > 1 else first
            out.append({"segment": label, "start_s": t, "seconds": seconds / count, "rps": share * rate})
            t += seconds / count
    return out


def resources(system: str, args: argparse.Namespace) -> dict[str, Any]:
    common = {"num_cpus": 1}
    if system == "static_max":
        return {**common, "num_replicas": args.max_replicas}
    if system == "static_min":
        return {**common, "num_replicas": max(1, args.min_replicas)}
    scaled = {
        **common,
        "min_replicas": args.min_replicas,
        "max_replicas": args.max_replicas,
        "upscale_delay_s": 0,
        "downscale_delay_s": args.downscale_delay_s,
    }
    if system == "slo":
        return {**scaled, "slo": {"ttft_ms": args.ttft_ms, "itl_ms": args.itl_ms, "percentile": 90}}
    return {**scaled, "target_ongoing_requests": args.target}


class Deployment:
    """One system's deployment: `run.py --config-path <its tree> action=run|stop` on a private exp_dir."""

    def __init__(self, system: str, args: argparse.Namespace, work: Path):
        self.system, self.url = system, f"http://127.0.0.1:{PORT}"
        self.conf, self.log = work / system / "conf", work / system / "orchestrator.log"
        (self.conf / "serve").mkdir(parents=True)
        main = {
            "defaults": ["_self_", {"serve": "nodes"}],
            "experiment": {
                "exp_name": f"slo-load-{system}",
                "exp_dir": str(work / system / "exp"),
                "task": {"type": "serve"},
                "runner": {"hostfile": None, "deploy": {"host": "127.0.0.1", "port": PORT, "startup_timeout_s": 900}},
                "envs": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
            },
            "action": "run",
            "hydra": {"run": {"dir": "${experiment.exp_dir}/hydra"}},
        }
        engine_args = {"model": str(args.model_dir), **ENGINE_ARGS}
        node = {"serve_id": "demo", "engine": "vllm", "engine_args": engine_args, "resources": resources(system, args)}
        (self.conf / "serve.yaml").write_text(yaml.safe_dump(main, sort_keys=False))
        (self.conf / "serve" / "nodes.yaml").write_text(yaml.safe_dump([node], sort_keys=False))

    def cli(self, action: str) -> list[str]:
        return [sys.executable, str(REPO / "run.py"), "--config-path", str(self.conf), "--config-name", "serve",
                f"action={action}"]  # fmt: skip

    def start(self) -> None:
        with open(self.log, "ab") as log:
            done = subprocess.run(self.cli("run"), cwd=REPO, stdout=log, stderr=subprocess.STDOUT, timeout=1200)
        if done.returncode != 0:
            raise RuntimeError(f"{self.system}: `run` exited with {done.returncode}; see {self.log}")

    def stop(self) -> None:
        with open(self.log, "ab") as log:
            subprocess.run(self.cli("stop"), cwd=REPO, stdout=log, stderr=subprocess.STDOUT, timeout=600)


def serving_replicas(url: str) -> int | None:
    """Replicas in the router's table now: distinct `replica` labels of the engines' running-requests series."""
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=10) as answer:
            text = answer.read().decode()
    except OSError:
        return None
    return len({line.split('replica="')[1].split('"')[0] for line in text.splitlines()
                if line.startswith("vllm:num_requests_running{") and 'replica="' in line})  # fmt: skip


def bench_argv(url: str, step: dict[str, Any], index: int, args: argparse.Namespace) -> list[str]:
    prompts = max(1, round(step["rps"] * step["seconds"]))
    return [
        "--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions", "--model", "demo",
        "--tokenizer", str(args.model_dir), "--dataset-name", "random", "--input-len", str(args.input_len),
        "--output-len", str(args.output_len), "--random-range-ratio", "0.5", "--num-prompts", str(prompts),
        "--request-rate", f"{step['rps']:.4f}", "--seed", str(args.seed + index), "--ignore-eos",
        "--ready-check-timeout-sec", "0", "--disable-tqdm", "--save-detailed", "--percentile-metrics", "ttft,itl",
    ]  # fmt: skip


def load(system: str, args: argparse.Namespace, work: Path, url: str) -> dict[str, Any]:
    """The trace against `url`: every request's outcome, and the replica count over time."""
    plan = steps(args.rate)
    counts: list[tuple[float, int]] = []
    finished = threading.Event()

    def poll() -> None:
        while not finished.is_set():
            n = serving_replicas(url)
            if n is not None:
                counts.append((time.monotonic(), n))
            finished.wait(args.poll_s)

    with contextlib.ExitStack() as stack:
        workers = [stack.enter_context(vllm_bench_worker(work / system / f"bench-{i}.log")) for i in range(WORKERS)]
        poller = threading.Thread(target=poll, daemon=True)
        began = time.monotonic() + 2
        poller.start()

        def run_step(index: int) -> list[dict[str, Any]]:
            step = plan[index]
            time.sleep(max(0.0, began + step["start_s"] - time.monotonic()))
            if step["rps"] <= 0:
                return []
            result = workers[index % WORKERS](bench_argv(url, step, index, args))
            return [
                {"step": index, "segment": step["segment"], "ttft_s": ttft, "itl_s": itls, "error": error}
                for ttft, itls, error in zip(result["ttfts"], result["itls"], result["errors"], strict=True)
            ]

        with ThreadPoolExecutor(len(plan)) as pool:  # each step waits for its own start time
            requests = [r for rows in pool.map(run_step, range(len(plan))) for r in rows]
        finished.set()
        poller.join()
    end = began + sum(step["seconds"] for step in plan)
    return {"requests": requests, "counts": [(t - began, n) for t, n in counts if t <= end], "plan": plan}


def summary(system: str, measured: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    requests, counts, plan = measured["requests"], measured["counts"], measured["plan"]
    duration = sum(step["seconds"] for step in plan)
    failed = sum(1 for r in requests if r["error"])

    def met(r: dict[str, Any]) -> bool:
        itl = sum(r["itl_s"]) / len(r["itl_s"]) if r["itl_s"] else 0.0
        return not r["error"] and r["ttft_s"] * 1000 <= args.ttft_ms and itl * 1000 <= args.itl_ms

    good = sum(1 for r in requests if met(r))
    replica_s = sum(n * (t1 - t0) for (t0, n), (t1, _) in zip(counts, counts[1:], strict=False))
    reactions = {}
    for segment in ("ramp", "spike"):
        start = next(step["start_s"] for step in plan if step["segment"] == segment)
        reached = next((t for t, n in counts if t >= start and n >= args.max_replicas), None)
        reactions[segment] = None if reached is None else round(reached - start, 1)
    return {
        "system": system,
        "requests": len(requests),
        "failed": failed,
        "attainment": good / len(requests) if requests else 0.0,
        "goodput_req_s": good / duration,
        "replica_s": replica_s,
        "goodput_per_replica_s": good / replica_s if replica_s else 0.0,
        "reaction_s": reactions,
        "replicas": counts,
    }


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| system | requests | failed | SLO attainment | goodput req/s | replica-s | goodput per replica-s | "
        "to max replicas after ramp / spike start (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        react = " / ".join("-" if v is None else f"{v:g}" for v in r["reaction_s"].values())
        lines.append(
            f"| {r['system']} | {r['requests']} | {r['failed']} | {100 * r['attainment']:.1f} % | "
            f"{r['goodput_req_s']:.2f} | {r['replica_s']:.0f} | {r['goodput_per_replica_s']:.3f} | {react} |"
        )
    return "\n".join(lines)


def main() -> None:
    args = arguments()
    args.model_dir = ensure_demo_model() if args.size == "demo" else ensure_model(args.size, device="cpu")
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="flagscale-slo-load-"))
    print(f"work dir {work}; trace: {len(steps(args.rate))} steps, {sum(s[1] for s in TRACE)} s", flush=True)
    rows = []
    for system in args.systems:
        deployment = Deployment(system, args, work)
        try:
            print(f"{system}: starting", flush=True)
            deployment.start()
            measured = load(system, args, work, deployment.url)
        finally:
            deployment.stop()
        rows.append(summary(system, measured, args))
        print(table(rows[-1:]), flush=True)
    stamp = time.strftime("%Y%m%d-%H%M")
    out = args.out / f"slo-load-{stamp}.json"
    out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "trace": TRACE, "systems": rows},
                              indent=1))  # fmt: skip
    print(table(rows))
    print(f"JSON: {out}")


if __name__ == "__main__":
    main()
