"""Deployments on a GPU through the real CLI: run -> test -> status -> bench -> stop, one after another.

  python3 benchmarks/gpu/deployments.py --out DIR            # every deployment below, JSON summary in DIR
  python3 benchmarks/gpu/deployments.py --only share4 --dry  # plan only (works on a CPU machine)

  one      the demo model, 1 replica, 1 GPU
  share4   4 replicas with num_gpus 0.25 each on one GPU (gpu_memory_utilization 0.2 each): they start in turn,
           and every engine must report its KV cache (the failure this guards against: concurrent start-ups
           counting each other's allocations, leaving one engine without KV cache)
  models   two models behind one endpoint, each engine with half the GPU

Each step's exit code, seconds and last lines go to DIR/deployments.json; engine logs' KV-cache lines too.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
PORT = 8700
GPU_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
ENGINE = {"model": "${demo_model:}", "max_model_len": 512, "enforce_eager": True}
DEPLOYMENTS = {
    "one": [
        {
            "serve_id": "demo",
            "engine": "vllm",
            "engine_args": {**ENGINE, "gpu_memory_utilization": 0.3},
            "resources": {"num_replicas": 1},
        }
    ],
    "share4": [
        {
            "serve_id": "demo",
            "engine": "vllm",
            "engine_args": {**ENGINE, "gpu_memory_utilization": 0.2},
            "resources": {"num_replicas": 4, "num_gpus": 0.25},
        }
    ],
    "models": [
        {
            "serve_id": name,
            "engine": "vllm",
            "engine_args": {**ENGINE, "gpu_memory_utilization": 0.4, "served_model_name": name},
            "resources": {"num_replicas": 1, "num_gpus": 0.5},
        }
        for name in ("alpha", "beta")
    ],
}
KV_LINE = re.compile(
    r"(Available KV cache memory: [0-9.]+ GiB|GPU KV cache size: [0-9,]+ tokens|"
    r"No available memory for the cache blocks[^\n]*)"
)


def write_config(root: Path, name: str, nodes: list[dict]) -> Path:
    conf = root / f"conf-{name}"
    (conf / "serve").mkdir(parents=True, exist_ok=True)
    experiment = {
        "exp_name": f"gpu-{name}",
        "exp_dir": str(root / f"exp-{name}"),
        "task": {"type": "serve"},
        "runner": {"hostfile": None, "deploy": {"host": "127.0.0.1", "port": PORT, "startup_timeout_s": 600}},
        "envs": dict(GPU_ENV),
        "bench": {"input_len": 256, "output_len": 128, "num_prompts": 128, "concurrency": [32]},
    }
    main = {
        "defaults": ["_self_", {"serve": "nodes"}],
        "experiment": experiment,
        "action": "run",
        "hydra": {"run": {"dir": "${experiment.exp_dir}/hydra"}},
    }
    (conf / "serve.yaml").write_text(yaml.safe_dump(main, sort_keys=False))
    (conf / "serve" / "nodes.yaml").write_text(yaml.safe_dump(nodes, sort_keys=False))
    return conf


def cli(conf: Path, action: str, timeout_s: float) -> dict:
    argv = [
        sys.executable,
        str(REPO / "run.py"),
        "--config-path",
        str(conf),
        "--config-name",
        "serve",
        f"action={action}",
    ]
    t0 = time.monotonic()
    try:
        proc = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            cwd=REPO,
            env={**os.environ, **GPU_ENV, "COLUMNS": "160"},
        )
        code, out = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        code, out = "timeout", (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else ""
    seconds = round(time.monotonic() - t0, 1)
    print(f"  {action}: exit {code} in {seconds}s", flush=True)
    return {"action": action, "exit": code, "seconds": seconds, "tail": out.strip().splitlines()[-25:]}


def kv_lines(exp_dir: Path) -> dict[str, list[str]]:
    found = {}
    for log in sorted((exp_dir / "serve_logs").glob("engine-*.log")):
        found[log.name] = sorted(set(KV_LINE.findall(log.read_text(errors="replace"))))
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("/tmp/gpu-deployments"))
    parser.add_argument("--only", nargs="+", choices=sorted(DEPLOYMENTS), default=list(DEPLOYMENTS))
    parser.add_argument("--dry", action="store_true", help="dryrun only")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results = {}
    for name in args.only:
        print(f"{name}:", flush=True)
        conf = write_config(args.out, name, DEPLOYMENTS[name])
        steps = [cli(conf, "dryrun", 300)]
        if not args.dry and steps[0]["exit"] == 0:
            steps.append(cli(conf, "run", 900))
            if steps[-1]["exit"] == 0:
                for action, bound in (("test", 300), ("status", 120), ("bench", 600)):
                    steps.append(cli(conf, action, bound))
            steps.append(cli(conf, "stop", 300))
        results[name] = {"nodes": DEPLOYMENTS[name], "steps": steps, "kv_cache": kv_lines(args.out / f"exp-{name}")}
        (args.out / "deployments.json").write_text(json.dumps(results, indent=2))
    failed = [n for n, r in results.items() if any(s["exit"] != 0 for s in r["steps"])]
    print(
        f"deployments: {len(results) - len(failed)}/{len(results)} passed every step; {args.out / 'deployments.json'}"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
