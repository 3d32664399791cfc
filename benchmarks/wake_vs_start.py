"""The first request after an idle spell (issue 51): a replica kept asleep against one stopped at zero.

Two systems, the same node (one llama.cpp replica on the demo GGUF, `min_replicas: 0`, `max_replicas: 1`, an SLO,
`downscale_delay_s` --idle-s), one deployment each, alternating in each round:

- asleep: with `sleep_delay_s` --idle-s as well: the SLO planner sizes the replicas awake, Serve keeps the replica
  started, llama-server unloads its model when idle (docs/autoscaling.md, "Asleep, not stopped");
- stopped: without it: idle, the planner takes the node to zero replicas (scale from zero).

Each deployment is started, left idle until its state says so (asleep: the replica ASLEEP and the planner's target
0; stopped: no replica and target 0), then sent one streamed completion with the OpenAI SDK: its time to first
token and to the end, measured at the client. Then `stop`. JSON to --out, a table printed.

  .venv/bin/python benchmarks/wake_vs_start.py                 # 3 rounds
  .venv/bin/python benchmarks/wake_vs_start.py --rounds 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import openai
import yaml

REPO = Path(__file__).resolve().parents[1]
PORT = 8520  # clear of the other benchmarks' ports (overhead, routing, pd: 8400-8449; llama_cpp: 8450-8499)
SYSTEMS = ("asleep", "stopped")
IDLE_WAIT_S = 600.0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--idle-s", type=float, default=3.0, help="downscale_delay_s, and sleep_delay_s (asleep)")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    return parser.parse_args()


class Deployment:
    """One system's deployment: `run.py --config-path <its tree> action=...` on a private exp_dir."""

    def __init__(self, system: str, args: argparse.Namespace, work: Path):
        self.system, self.work = system, work / system
        self.conf, self.exp_dir = self.work / "conf", self.work / "exp"
        (self.conf / "serve").mkdir(parents=True)
        resources: dict[str, Any] = {"min_replicas": 0, "max_replicas": 1, "num_cpus": 1, "upscale_delay_s": 0}
        resources |= {"downscale_delay_s": args.idle_s, "slo": {"ttft_ms": 5000}}
        if system == "asleep":
            resources["sleep_delay_s"] = args.idle_s
        node = {
            "serve_id": "demo",
            "engine": "llama_cpp",
            "engine_args": {"model": "${demo_model_gguf:}", "max_model_len": 512, "max_num_seqs": 4},
            "engine_args_specific": {"llama_cpp": {"n_gpu_layers": 0}},
            "resources": resources,
        }
        deploy = {"host": "127.0.0.1", "port": PORT, "startup_timeout_s": 600}
        main = {
            "defaults": ["_self_", {"serve": "nodes"}],
            "experiment": {
                "exp_name": f"wake-vs-start-{system}",
                "exp_dir": str(self.exp_dir),
                "task": {"type": "serve"},
                "runner": {"hostfile": None, "deploy": deploy},
            },
            "action": "run",
            "hydra": {"run": {"dir": "${experiment.exp_dir}/hydra"}},
        }
        (self.conf / "serve.yaml").write_text(yaml.safe_dump(main, sort_keys=False))
        (self.conf / "serve" / "nodes.yaml").write_text(yaml.safe_dump([node], sort_keys=False))

    def cli(self, action: str, *extra: str, timeout: float = 900, check: bool = True) -> str:
        argv = [sys.executable, str(REPO / "run.py"), "--config-path", str(self.conf), "--config-name", "serve"]
        done = subprocess.run([*argv, f"action={action}", *extra], cwd=REPO, capture_output=True, text=True,
                              timeout=timeout)  # fmt: skip
        if check and done.returncode != 0:
            raise RuntimeError(f"{self.system}: action={action} exited {done.returncode}: {done.stderr[-2000:]}")
        return done.stdout

    def idle(self) -> dict[str, Any] | None:
        """The status once the node is idle as this system leaves it (else None)."""
        out = self.cli("status", "output=json", timeout=120, check=False)
        if "{" not in out:
            return None
        report = json.loads(out[out.index("{") :])
        ready = [r for r in report["replicas"] if r["state"] == "READY"]
        if report["planner"].get("demo", {}).get("target") != 0:
            return None
        if self.system == "asleep":
            return report if len(ready) == 1 and ready[0]["asleep"] else None
        return report if not ready else None


def first_request(max_tokens: int) -> dict[str, float]:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{PORT}/v1", api_key="none", timeout=600, max_retries=0)
    began = time.monotonic()
    first = None
    tokens = 0
    stream = client.completions.create(model="demo", prompt="after a quiet spell", max_tokens=max_tokens, stream=True)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            first = first or time.monotonic()
            tokens += 1
    end = time.monotonic()
    return {"ttft_s": (first or end) - began, "total_s": end - began, "chunks": tokens}


def one(system: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    deployment = Deployment(system, args, work)
    try:
        deployment.cli("run")
        deadline = time.monotonic() + IDLE_WAIT_S
        while (report := deployment.idle()) is None:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{system}: not idle within {IDLE_WAIT_S:g}s")
            time.sleep(2)
        result = first_request(args.max_tokens)
        return {"system": system, **result, "planner_reason": report["planner"]["demo"].get("reason")}
    finally:
        deployment.cli("stop", timeout=600)


def main() -> None:
    args = parse_args()
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="wake-vs-start-") as tmp:
        for round_index in range(args.rounds):
            order = SYSTEMS if round_index % 2 == 0 else SYSTEMS[::-1]
            for system in order:
                found = one(system, args, Path(tmp) / f"r{round_index}")
                runs.append({"round": round_index, **found})
                print(f"round {round_index} {system}: TTFT {found['ttft_s']:.3f} s, total {found['total_s']:.3f} s")
    medians = {
        system: {key: statistics.median(r[key] for r in runs if r["system"] == system) for key in ("ttft_s", "total_s")}
        for system in SYSTEMS
    }
    ratio = medians["stopped"]["ttft_s"] / medians["asleep"]["ttft_s"]
    print("| system | TTFT s (median) | total s (median) |\n|---|---|---|")
    for system in SYSTEMS:
        print(f"| {system} | {medians[system]['ttft_s']:.3f} | {medians[system]['total_s']:.3f} |")
    print(f"stopped / asleep TTFT: {ratio:.0f}x")
    out = args.out / f"wake-vs-start-{time.strftime('%Y%m%d-%H%M%S')}.json" if args.out.is_dir() else args.out
    report = {"args": {k: str(v) for k, v in vars(args).items()}, "runs": runs, "medians": medians, "ratio": ratio}
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
