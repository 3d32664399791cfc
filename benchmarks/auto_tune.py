"""Default config vs the config action=auto_tune picks: goodput under the same load and the same SLO.

Both are measured by the same trial (flagscale/tune/trial.py: deploy, wait healthy, vLLM's serving benchmark through
the router at rising concurrency, goodput = request throughput at the highest level whose p99 TTFT and TPOT meet the
SLO): the default as a one-candidate search (the node as written, `instance: [1]`), the tuned one as a search over
--space. Demo model (conf/serve/demo.yaml's engine args) on this machine's CPU, or with --gpu a random-weight Llama of
benchmarks/gpu/model.py (--size) on the GPU, each replica taking half of it (num_gpus 0.5, gpu_memory_utilization
0.4: the node as written runs one such replica, `instance: 2` two sharing the GPU). Each search in its own exp_dir,
stopped at its end (run_best false), also on error or Ctrl-C. Writes JSON to benchmarks/results/ and prints a
markdown table.

  .venv/bin/python benchmarks/auto_tune.py
  .venv/bin/python benchmarks/auto_tune.py --space '{"instance": [1, 2], "max_num_seqs": [4, 16, 64]}' --prompts 64
  python3 benchmarks/auto_tune.py --gpu --size 1b --space '{"instance": [1, 2], "max_num_batched_tokens": [2048, 16384]}'
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.gpu.checks import GPU_SAFE_ENV  # noqa: E402
from flagscale.tune import history  # noqa: E402

PORT = 8360  # clear of overhead.py (8150-8199), routing.py (8300-8349), the GPU bench (8600-8699) and the e2e tests
DEFAULT_ARGS = {  # conf/serve/demo.yaml's, float32 as on this machine kind
    "model": "${demo_model:}",
    "served_model_name": "demo",
    "max_model_len": 512,
    "enforce_eager": True,
    "gpu_memory_utilization": 0.1,
    "dtype": "float32",
}


def node_of(args: argparse.Namespace) -> dict:
    """The engine node as written: the baseline, and what the space varies."""
    if not args.gpu:
        return {"serve_id": "demo", "engine_args": DEFAULT_ARGS, "resources": {"num_replicas": 1}}
    from benchmarks.gpu.model import ensure_model

    engine_args = {
        "model": str(ensure_model(args.size, weights=not args.dummy_weights)),
        "served_model_name": "demo",
        "max_model_len": 2048,
        "enforce_eager": True,  # a start per trial: no CUDA-graph capture each time
        "gpu_memory_utilization": args.gpu_memory_utilization,
    }
    if args.dummy_weights:
        engine_args["load_format"] = "dummy"
    resources = {"num_replicas": 1, "num_gpus": args.gpus_per_replica}
    return {"serve_id": "demo", "engine_args": engine_args, "resources": resources}


def write_conf(root: Path, name: str, space: dict, args: argparse.Namespace, run_best: bool = False) -> Path:
    conf = root / name
    (conf / "serve").mkdir(parents=True)
    main = {
        "defaults": ["_self_", {"serve": "nodes"}],
        "experiment": {
            "exp_name": f"tune-{name}",
            "exp_dir": str(root / f"exp-{name}"),
            "task": {"type": "serve", "backend": "vllm"},
            "runner": {"deploy": {"host": "127.0.0.1", "port": PORT}},
            "bench": {"input_len": args.input_len, "output_len": args.output_len, "num_prompts": args.prompts},
            "auto_tuner": {
                "space": space,
                "control": {"interval": 5, "run_best": run_best, "max_time_per_task": 900},
                "slo": {"ttft_ms": {"p99": args.ttft_p99}, "tpot_ms": {"p99": args.tpot_p99}},
                "concurrency": args.levels,
                "concurrency_per_device": args.per_device,
            },
        },
        "action": "auto_tune",
        "hydra": {"run": {"dir": "${experiment.exp_dir}/hydra"}},
    }
    if args.gpu:
        main["experiment"]["envs"] = dict(GPU_SAFE_ENV)
    node = node_of(args)
    (conf / "serve.yaml").write_text(yaml.safe_dump(main, sort_keys=False))
    (conf / "serve" / "nodes.yaml").write_text(yaml.safe_dump([node], sort_keys=False))
    return conf


def search(conf: Path, check_best: bool = False) -> tuple[list[dict], float, dict | None]:
    """One auto_tune search; with `check_best` (run_best true) what the winner left serving shows before the stop."""
    t0 = time.monotonic()
    argv = [sys.executable, str(REPO / "run.py"), "--config-path", str(conf), "--config-name", "serve"]
    serving = None
    try:
        proc = subprocess.run(argv, cwd=REPO, text=True, capture_output=True, timeout=7200)
        if check_best and proc.returncode == 0:
            serving = best_serving(argv)
    finally:
        subprocess.run([*argv, "action=stop"], cwd=REPO, capture_output=True, timeout=600)
    print(proc.stdout[-3000:], proc.stderr[-2000:], sep="\n")
    exp_dir = yaml.safe_load((conf / "serve.yaml").read_text())["experiment"]["exp_dir"]
    return history.read(Path(exp_dir) / "auto_tuner" / history.FILE), time.monotonic() - t0, serving


def as_written(rows: list[dict], space: dict) -> dict:
    """The tuned search's row of the node as written (each dimension at 1: one replica, no parallelism)."""
    return next((r for r in rows if all(int(r.get(k) or 0) == 1 for k in space)), {})


def best_serving(argv: list[str]) -> dict:
    """run_best's deployment: status's replicas (state, GPUs, ranks) and one completion through the router."""
    status = subprocess.run([*argv, "action=status", "output=json"], cwd=REPO, text=True, capture_output=True)
    report = json.loads(status.stdout) if status.returncode == 0 else {"error": status.stderr[-2000:]}
    request = urllib.request.Request(
        f"http://127.0.0.1:{PORT}/v1/completions",
        json.dumps({"model": "demo", "prompt": "hello", "max_tokens": 8}).encode(),
        {"content-type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as resp:
        answer = json.load(resp)
    replicas = [{k: r.get(k) for k in ("replica_id", "state", "gpus", "ranks")} for r in report.get("replicas", [])]
    return {
        "healthy": report.get("healthy"),
        "replicas": replicas,
        "completion_tokens": answer["usage"]["completion_tokens"],
    }


class GpuEnvWatch(threading.Thread):
    """--gpu: every `interval_s`, every process nvidia-smi lists on a GPU must carry NVLink multicast off
    (benchmarks/gpu/checks.py env_check); the first that does not stops the run (SIGTERM to this process: the
    search's deployment is stopped) and is reported. A process is checked once; one whose environment cannot be
    read is asked again `recheck_s` later, and passes if it is gone by then (a trial's engine stopping: its
    workers outlive the server they inherited the environment from by a moment)."""

    def __init__(self, interval_s: float = 10.0, recheck_s: float = 3.0):
        super().__init__(daemon=True)
        self.interval_s, self.recheck_s, self.stop = interval_s, recheck_s, threading.Event()
        self.checked: set[int] = set()
        self.problems: list[str] = []

    def run(self) -> None:
        while not self.stop.wait(self.interval_s):
            self.problems = self.check()
            if self.problems:
                os.kill(os.getpid(), signal.SIGTERM)
                return

    def check(self) -> list[str]:
        from benchmarks.gpu import checks

        new = [app["pid"] for app in checks.gpu_apps() if app["pid"] not in self.checked]
        report = checks.env_check({}, new)
        problems = checks.env_problems(report, gpu_group_required=False)  # those without the variables
        unread = report.get("gpu processes (nvidia-smi)", {}).get("unknown", [])
        if unread and not self.stop.wait(self.recheck_s):
            problems += checks.env_problems(checks.env_check({}, unread))  # the ones gone by now are skipped
        if not problems:
            self.checked.update(new)
        return problems

    def summary(self) -> dict:
        return {"gpu_processes_checked": len(self.checked), "problems": self.problems}


def _interrupted(signum, frame) -> None:
    raise KeyboardInterrupt


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--space", default='{"instance": [1, 2], "max_num_seqs": [4, 16]}', help="JSON space")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=48, help="per concurrency level")
    parser.add_argument("--levels", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument(
        "--per-device", action="store_true", help="auto_tuner.concurrency_per_device: levels and prompts x devices"
    )
    parser.add_argument("--ttft-p99", type=float, default=1000.0, help="SLO, ms")
    parser.add_argument("--tpot-p99", type=float, default=60.0, help="SLO, ms")
    parser.add_argument("--gpu", action="store_true", help="a random-weight Llama on the GPU instead of the demo model")
    parser.add_argument("--size", default="1b", help="--gpu: benchmarks/gpu/model.py's size")
    parser.add_argument("--dummy-weights", action="store_true", help="--gpu: config.json only, load_format dummy")
    parser.add_argument("--gpus-per-replica", type=float, default=0.5, help="--gpu: the node's num_gpus as written")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.4, help="--gpu: per replica")
    parser.add_argument(
        "--run-best", action="store_true", help="the tuned search leaves its best serving: checked, then stopped"
    )
    parser.add_argument("--skip-default", action="store_true", help="no search of its own for the node as written")
    parser.add_argument(
        "--output", type=Path, default=None, help="JSON path (default benchmarks/results/auto_tune-<ts>.json)"
    )
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, _interrupted)  # as Ctrl-C: the search's finally stops its deployment
    if args.gpu:
        for key, value in GPU_SAFE_ENV.items():
            os.environ.setdefault(key, value)
        os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    space = json.loads(args.space)
    watch = GpuEnvWatch() if args.gpu else None
    if watch is not None:
        watch.start()
    try:
        return _searches(args, space, watch)
    except KeyboardInterrupt:
        if watch is not None and watch.problems:
            print("stopped: a GPU process lacks NVLink multicast off:\n  " + "\n  ".join(watch.problems))
            return 1
        raise
    finally:
        if watch is not None:
            watch.stop.set()


def _searches(args: argparse.Namespace, space: dict, watch: GpuEnvWatch | None) -> int:
    with tempfile.TemporaryDirectory(prefix="tune-bench-") as tmp:
        root = Path(tmp)
        if args.skip_default:  # the node as written is a candidate of --space too: its row is the default
            default_rows, default_s = [], 0.0
        else:
            default_rows, default_s, _ = search(write_conf(root, "default", {"instance": [1]}, args))
        tuned_conf = write_conf(root, "tuned", space, args, run_best=args.run_best)
        tuned_rows, tuned_s, serving = search(tuned_conf, check_best=args.run_best)
    default = default_rows[0] if default_rows else as_written(tuned_rows, space)
    done = [r for r in tuned_rows if r.get("status") == "done" and r.get("goodput")]
    best = max(done, key=lambda r: r["goodput_per_device"]) if done else None
    result = {
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "default": default,
        "tuned_best": best,
        "tuned_rows": tuned_rows,
        "best_serving": serving,
        "seconds": {"default": round(default_s), "tuned": round(tuned_s)},
        "env_check": watch.summary() if watch is not None else None,
    }
    out = args.output or REPO / "benchmarks" / "results" / f"auto_tune-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(
        f"\nSLO p99 TTFT <= {args.ttft_p99:g} ms, p99 TPOT <= {args.tpot_p99:g} ms; {args.prompts} prompts of "
        f"{args.input_len} -> {args.output_len} tokens per level {args.levels}\n"
    )
    print("| config | goodput req/s | per device | at concurrency | TTFT p99 ms | TPOT p99 ms | search s |")
    print("|---|---|---|---|---|---|---|")
    for label, row, seconds in (("default", default, default_s), ("tuned", best, tuned_s)):
        if row is None:
            print(f"| {label} | none met the SLO | | | | | {seconds:.0f} |")
            continue
        dims = " ".join(f"{k}={row[k]}" for k in space if k in row) if label == "tuned" else "as written"
        print(
            f"| {label} ({dims}) | {row.get('goodput')} | {row.get('goodput_per_device')} | {row.get('concurrency')} "
            f"| {row.get('ttft_p99_ms')} | {row.get('tpot_p99_ms')} | {seconds:.0f} |"
        )
    print("\n| candidate | status | devices | goodput req/s | per device | at c | TTFT p99 ms | TPOT p99 ms |")
    print("|---|---|---|---|---|---|---|---|")
    for row in tuned_rows:
        dims = " ".join(f"{k}={row[k]}" for k in space if k in row)
        print(
            f"| {dims} | {row.get('status')} {row.get('reason') or ''} | {row.get('devices')} | {row.get('goodput')} "
            f"| {row.get('goodput_per_device')} | {row.get('concurrency')} | {row.get('ttft_p99_ms')} "
            f"| {row.get('tpot_p99_ms')} |"
        )
    if serving is not None:
        print(f"\nrun_best left serving: {json.dumps(serving)}")
    if watch is not None:
        print(f"env check: {watch.summary()}")
    if best is not None and default.get("goodput_per_device"):
        print(f"\ntuned / default goodput per device: {best['goodput_per_device'] / default['goodput_per_device']:.2f}")
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
