"""Three models time-sharing one GPU through sleep and wake (issue 51, item 3), against the same three always awake.

  python3 benchmarks/gpu/sleep_share.py --size 1b --out /tmp/sleep-share     # on a GPU machine (benchmarks/gpu/README.md)
  python3 benchmarks/gpu/sleep_share.py --dry                                # plan both systems only (any machine)

Both systems serve three models (`m0`, `m1`, `m2`: the random-weight Llama of `--size`, model.py) on one GPU, each
node one replica with `num_gpus: 0.25` and `gpu_memory_utilization: 0.3`, deployed one system after the other
through the real CLI (`run`, `stop`):

  awake   the three replicas always awake
  sleep   the same, with `resources.sleep_delay_s: --sleep-s`: an idle replica sleeps (vLLM sleep level 1)

The trace moves the traffic from one model to the next: `--phase-s` seconds of `--concurrency` closed-loop streamed
completions (`--input-len` / `--output-len` tokens, ignore_eos) to m0, then m1, then m2, then m0 again; only one
model has traffic at a time, as when models with bursty, disjoint users share a GPU. Meanwhile nvidia-smi is
sampled every 0.5 s: GPU memory held (sum over the GPU's processes), so each system's GiB-seconds of GPU memory.
Per phase: requests, failures, TTFT p50/p99 and the first request's TTFT (on the sleep system, the wake's cost),
output tokens per second.

Then, on the sleep system only, the wake time to first token: `--wakes` times, wait until m0 sleeps (status), send
one streamed completion (max_tokens 16) and time its first token at the client; then the same request awake.
Target (issue 51): <= 1 s for a 1B model. Output: <out>/sleep-share.json. Every deployment it started is stopped,
also on error.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import aiohttp
import checks
import model as bench_model
from deployments import PORT, cli, write_config

MODELS = ("m0", "m1", "m2")


def nodes(model_dir: str, sleep_s: float | None, max_model_len: int) -> list[dict]:
    engine = {"model": model_dir, "max_model_len": max_model_len, "enforce_eager": True, "gpu_memory_utilization": 0.3}
    resources = {"num_replicas": 1, "num_gpus": 0.25}
    if sleep_s is not None:
        resources["sleep_delay_s"] = sleep_s
    return [
        {
            "serve_id": name,
            "engine": "vllm",
            "engine_args": {**engine, "served_model_name": name},
            "resources": resources,
        }
        for name in MODELS
    ]


class MemorySampler:
    """nvidia-smi every `every_s` in a thread: (monotonic time, MiB held by every process on the GPUs this process
    may use: CUDA_VISIBLE_DEVICES's, by index or UUID; all of them when it is unset)."""

    def __init__(self, every_s: float = 0.5):
        self.every_s, self.samples = every_s, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            used = sum(app["used_mb"] for app in checks.gpu_apps() if self._visible(app))
            self.samples.append((time.monotonic(), used))
            self._stop.wait(self.every_s)

    @staticmethod
    def _visible(app: dict) -> bool:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        return visible is None or bool({app["gpu"], app["uuid"]} & {d.strip() for d in visible.split(",")})

    def __enter__(self) -> MemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)

    def summary(self) -> dict:
        pairs = list(zip(self.samples, self.samples[1:]))
        gib_s = sum((t1 - t0) * used / 1024 for (t0, used), (t1, _) in pairs)
        seconds = self.samples[-1][0] - self.samples[0][0] if len(self.samples) > 1 else 0.0
        used = [u for _, u in self.samples] or [0.0]
        return {
            "gib_seconds": round(gib_s, 1),
            "seconds": round(seconds, 1),
            "mean_gib": round(gib_s / seconds, 2) if seconds else 0.0,
            "peak_gib": round(max(used) / 1024, 2),
            "min_gib": round(min(used) / 1024, 2),
        }


async def one_request(session: aiohttp.ClientSession, url: str, model: str, args, max_tokens: int) -> dict:
    """One streamed completion: TTFT and tokens at the client, or its error."""
    prompt = [7 + (i % 400) for i in range(args.input_len)]
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    began, first, chunks = time.monotonic(), None, 0
    try:
        async with session.post(f"{url}/v1/completions", json=body) as resp:
            if resp.status != 200:
                return {"error": f"HTTP {resp.status}: {(await resp.text())[:200]}"}
            async for line in resp.content:
                if line.startswith(b"data: ") and not line.startswith(b"data: [DONE]"):
                    first = first or time.monotonic()
                    chunks += 1
    except (aiohttp.ClientError, TimeoutError) as exc:
        return {"error": repr(exc)}
    if first is None:
        return {"error": "no token"}
    return {"ttft_s": first - began, "tokens": chunks, "seconds": time.monotonic() - began}


async def phase(url: str, model: str, args) -> dict:
    """`args.concurrency` clients sending back to back to `model` for `args.phase_s` seconds."""
    results: list[dict] = []
    began = time.monotonic()
    deadline = began + args.phase_s

    async def client(session: aiohttp.ClientSession) -> None:
        while time.monotonic() < deadline:
            results.append(
                {"sent_s": time.monotonic() - began, **await one_request(session, url, model, args, args.output_len)}
            )

    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(*(client(session) for _ in range(args.concurrency)))
    elapsed = time.monotonic() - began
    ok = [r for r in results if "ttft_s" in r]
    ttfts = sorted(r["ttft_s"] for r in ok)
    first = min(ok, key=lambda r: r["sent_s"]) if ok else None
    return {
        "model": model,
        "requests": len(results),
        "failed": len(results) - len(ok),
        "errors": sorted({r["error"] for r in results if "error" in r})[:3],
        "first_ttft_s": round(first["ttft_s"], 3) if first else None,
        "ttft_p50_s": round(statistics.median(ttfts), 3) if ttfts else None,
        "ttft_p99_s": round(ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))], 3) if ttfts else None,
        "output_tokens_per_s": round(sum(r["tokens"] for r in ok) / elapsed, 1),
    }


def asleep_now(conf: Path) -> dict[str, bool]:
    argv = [sys.executable, str(bench_model.REPO / "run.py"), "--config-path", str(conf), "--config-name", "serve"]
    report = checks.status_json([*argv, "action=status"], cwd=str(bench_model.REPO))
    return {r["serve_id"]: bool(r.get("asleep")) for r in report.get("replicas", [])}


def wait_asleep(conf: Path, model: str, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            if asleep_now(conf).get(model):
                return True
        time.sleep(1.0)
    return False


async def wake_ttfts(conf: Path, url: str, args) -> dict:
    """The first token of one request to a sleeping m0 (waits for the sleep before each), then awake."""
    asleep, awake = [], []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        for _ in range(args.wakes):
            if not await asyncio.to_thread(wait_asleep, conf, "m0", args.sleep_s + 90):
                return {"error": "m0 did not fall asleep", "asleep": asleep, "awake": awake}
            asleep.append(await one_request(session, url, "m0", args, 16))
            awake.append(await one_request(session, url, "m0", args, 16))
    pick = lambda rs: [round(r["ttft_s"], 3) for r in rs if "ttft_s" in r]  # noqa: E731
    return {
        "asleep_ttft_s": pick(asleep),
        "awake_ttft_s": pick(awake),
        "asleep_ttft_median_s": statistics.median(pick(asleep)) if pick(asleep) else None,
        "awake_ttft_median_s": statistics.median(pick(awake)) if pick(awake) else None,
        "errors": [r["error"] for r in asleep + awake if "error" in r],
    }


def run_system(name: str, conf: Path, args) -> dict:
    url = f"http://127.0.0.1:{PORT}"
    out: dict = {"steps": []}
    out["steps"].append(cli(conf, "run", 900))
    try:
        if out["steps"][-1]["exit"] != 0:
            return out
        if name == "sleep":  # start as an idle GPU does: every model asleep
            out["all_asleep_at_start"] = all(wait_asleep(conf, m, args.sleep_s + 90) for m in MODELS)
        with MemorySampler() as memory:
            out["phases"] = [asyncio.run(phase(url, m, args)) for m in (*MODELS, MODELS[0])]
        out["gpu_memory"] = memory.summary()
        out["memory_samples_mib"] = [(round(t - memory.samples[0][0], 1), u) for t, u in memory.samples]
        if name == "sleep" and args.wakes:
            out["wake"] = asyncio.run(wake_ttfts(conf, url, args))
    finally:
        out["steps"].append(cli(conf, "stop", 300))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="1b")
    parser.add_argument("--out", type=Path, default=Path("/tmp/sleep-share"))
    parser.add_argument("--systems", nargs="+", default=["sleep", "awake"], choices=["sleep", "awake"])
    parser.add_argument("--sleep-s", type=float, default=5.0)
    parser.add_argument("--phase-s", type=float, default=20.0)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--wakes", type=int, default=5)
    parser.add_argument("--dry", action="store_true", help="dryrun both systems only")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model_dir = "${demo_model:}" if args.dry else str(bench_model.ensure_model(args.size))
    results = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "gpu": checks.nvidia_smi("--query-gpu=name,memory.total"),
    }
    for name in args.systems:
        print(f"{name}:", flush=True)
        conf = write_config(args.out, name, nodes(model_dir, args.sleep_s if name == "sleep" else None, 1024))
        results[name] = {"steps": [cli(conf, "dryrun", 300)]} if args.dry else run_system(name, conf, args)
        (args.out / "sleep-share.json").write_text(json.dumps(results, indent=2))
    print(json.dumps({k: v for k, v in results.items() if k != "args"}, indent=1, default=str)[:6000])
    failed = [n for n in args.systems if any(s["exit"] != 0 for s in results[n]["steps"])]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
