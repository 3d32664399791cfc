"""vLLM's LoRA slot rule behind the router's adapter placement, simulated (issue 52; docs/benchmarks.md).

An engine runs at most `max_loras` adapters in a batch: each step its scheduler admits waiting requests in order,
skipping one whose adapter is not among the running batch's while `max_loras` others run (vLLM's scheduler), and
every running request makes one token a step. The step takes `--step-ms` plus `--per-seq-ms` per running request;
a request's TTFT ends with its first step. The router in front is the project's own: the adapter placement
(flagscale/router/policies/adapters.py's Placement, the very class) over the default policy's load order (replicas
with fewer prompts waiting for a first token first, then least_load's rank_replicas), or that load order alone
(`oblivious`, today's routing without the placement). Two replicas, Poisson arrivals (`--rates`) or a closed loop
of `--concurrency` streams, adapters drawn from a Zipf law over `--adapters`. Seeded: a run prints the same table
every time.

Calibrated on one H200 with two 1B engines on it (lora_bench.py --gpu --same-gpu --max-loras 8): at the defaults
the closed loop gives oblivious 5.5 requests/s (measured 4.9-6.4) and the placement before 2026-12-02 (overload
against any replica) 1.11x (measured 1.10x and 1.12x). It leaves out prefill cost, the two engines' contention for one GPU and the adapters' swap-in
time: read its ratios, not its seconds.

  python3 benchmarks/lora_slots_sim.py                                 # 4 and 5 req/s and 64 streams, 16 seeds
  python3 benchmarks/lora_slots_sim.py --rates 3 5.5 --seeds 32 --slack 8
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from flagscale.router.policies.adapters import ADAPTER_SLACK, Placement  # noqa: E402
from flagscale.router.policies.base import rank_replicas  # noqa: E402

MODES = ("placed", "oblivious")


class _Closed:
    def allows(self, now: float) -> bool:
        return True


@dataclass
class Request:
    adapter: str
    arrived: float
    left: int
    first_token: float | None = None


@dataclass
class Engine:
    """One replica: what the router sees of it (inflight, sent, backlog) and its engine's running and waiting."""

    replica_id: str
    inflight: int = 0
    sent: int = 0
    backlog: int = 0  # requests without a first token yet (the default policy's prefill queue, counted)
    breaker: _Closed = field(default_factory=_Closed)
    running: list[Request] = field(default_factory=list)
    waiting: list[Request] = field(default_factory=list)
    next_step: float = 0.0

    def admit(self, max_loras: int) -> None:
        """vLLM's rule: waiting requests in order, each unless its adapter would be one more than max_loras."""
        adapters = {r.adapter for r in self.running}
        still = []
        for request in self.waiting:
            if request.adapter in adapters or len(adapters) < max_loras:
                adapters.add(request.adapter)
                self.running.append(request)
            else:
                still.append(request)
        self.waiting = still

    def step(self, now: float, args: argparse.Namespace) -> list[Request]:
        """One engine step from `now`: every running request makes a token; returns those that finished."""
        self.admit(args.max_loras)
        end = now + (args.step_ms + args.per_seq_ms * len(self.running)) / 1000
        finished = []
        for request in self.running:
            if request.first_token is None:
                request.first_token = end
                self.backlog -= 1
            request.left -= 1
            if request.left == 0:
                finished.append(request)
        for request in finished:
            self.running.remove(request)
            self.inflight -= 1
        self.next_step = end
        return finished


def zipf_adapters(count: int, s: float) -> tuple[list[str], list[float]]:
    weights = [1 / (k + 1) ** s for k in range(count)]
    return [f"a{k:02d}" for k in range(count)], weights


class Router:
    """The default policy's load order, with or without the placement."""

    def __init__(self, placed: bool, args: argparse.Namespace, rng: random.Random):
        self.placement = Placement(args.max_loras, slack=args.slack) if placed else None
        self.rng, self.turn = rng, 0

    def send(self, engines: list[Engine], request: Request) -> None:
        self.turn += 1
        order = sorted(rank_replicas(engines, self.turn, 0.0), key=lambda e: e.backlog)
        if self.placement is not None:
            order = self.placement.order(request.adapter, order)
            self.placement.sent(request.adapter, order[0].replica_id)
        chosen = order[0]
        chosen.inflight, chosen.sent, chosen.backlog = chosen.inflight + 1, chosen.sent + 1, chosen.backlog + 1
        chosen.waiting.append(request)

    def ended(self, engine: Engine, request: Request) -> None:
        if self.placement is not None:
            self.placement.done(request.adapter, engine.replica_id)


def arrivals(args: argparse.Namespace, rate: float, rng: random.Random) -> list[tuple[float, str]]:
    names, weights = zipf_adapters(args.adapters, args.zipf)
    times, t = [], rng.expovariate(rate)
    while t < args.seconds:
        times.append(t)
        t += rng.expovariate(rate)
    return [(t, rng.choices(names, weights)[0]) for t in times]


def simulate(placed: bool, rate: float, seed: int, args: argparse.Namespace) -> dict[str, float]:
    """One pass: `rate` requests/s for args.seconds (0: the closed loop for args.seconds). TTFT p50/p90 and
    requests/s (the closed loop's after a warm-up of 5 s)."""
    rng = random.Random(seed)
    engines = [Engine(f"r{i}") for i in range(args.replicas)]
    router = Router(placed, args, rng)
    names, weights = zipf_adapters(args.adapters, args.zipf)
    queue = arrivals(args, rate, rng) if rate else []
    if not rate:
        for _ in range(args.concurrency):
            router.send(engines, Request(rng.choices(names, weights)[0], 0.0, args.tokens))
    ttfts, done, now, index = [], 0, 0.0, 0
    while True:
        busy = [e for e in engines if e.running or e.waiting]
        step_at = min((max(e.next_step, now) for e in busy), default=None)
        arrive_at = queue[index][0] if index < len(queue) else None
        if (step_at is None and arrive_at is None) or (not rate and now > args.seconds):
            break
        if arrive_at is not None and (step_at is None or arrive_at <= step_at):
            now = arrive_at
            router.send(engines, Request(queue[index][1], now, args.tokens))
            index += 1
            continue
        engine = min(busy, key=lambda e: max(e.next_step, now))
        now = max(engine.next_step, now)
        for request in engine.step(now, args):
            router.ended(engine, request)
            if rate or request.arrived >= 5.0:
                ttfts.append(request.first_token - request.arrived)
                done += 1
            if not rate:
                router.send(engines, Request(rng.choices(names, weights)[0], now, args.tokens))
    ttfts.sort()
    return {
        "ttft_p50_s": ttfts[len(ttfts) // 2],
        "ttft_p90_s": ttfts[int(0.9 * (len(ttfts) - 1))],
        "requests_s": done / (args.seconds if rate else args.seconds - 5.0),
    }


def compare(rate: float, args: argparse.Namespace) -> dict[str, list[dict[str, float]]]:
    return {mode: [simulate(mode == "placed", rate, s, args) for s in range(args.seeds)] for mode in MODES}


def report(rate: float, runs: dict[str, list[dict[str, float]]]) -> str:
    load = f"{rate:g} req/s" if rate else "closed loop"
    p90 = {m: statistics.median(r["ttft_p90_s"] for r in runs[m]) for m in MODES}
    rps = {m: statistics.median(r["requests_s"] for r in runs[m]) for m in MODES}
    lines = [
        f"| {load} | {m} | {p90[m]:.2f} | {statistics.median(r['ttft_p50_s'] for r in runs[m]):.2f} | {rps[m]:.2f} |"
        for m in MODES
    ]
    lines.append(f"| {load} | placed / oblivious | {p90['placed'] / p90['oblivious']:.2f}x | | "
                 f"{rps['placed'] / rps['oblivious']:.2f}x |")  # fmt: skip
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", type=float, nargs="+", default=[4.0, 5.0, 0.0], help="0: the closed loop")
    parser.add_argument("--seeds", type=int, default=16, help="passes per mode and load (medians reported)")
    parser.add_argument("--seconds", type=float, default=40.0, help="of arrivals a pass (closed loop: 60)")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--adapters", type=int, default=50)
    parser.add_argument("--zipf", type=float, default=1.1)
    parser.add_argument("--max-loras", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--step-ms", type=float, default=40.0)
    parser.add_argument("--per-seq-ms", type=float, default=0.2)
    parser.add_argument("--slack", type=int, default=ADAPTER_SLACK, help="the placement's overload slack")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    print("| load | mode | TTFT p90 s (median) | TTFT p50 s | requests/s |\n|---|---|---|---|---|")
    for rate in args.rates:
        seconds = args.seconds
        args.seconds = seconds if rate else max(seconds, 60.0)
        print(report(rate, compare(rate, args)), flush=True)
        args.seconds = seconds


if __name__ == "__main__":
    main()
