"""slo_load.py's step trace on the simulator (flagscale/planner/simulate.py): the SLO planner, with sleep or without,
against static max, in seconds and without an engine, so a GPU run of slo_load can be predicted before it is made
and a change to the planner checked on the trace that run will use (docs/benchmarks.md).

The same trace as slo_load (slo_trace.steps: --rate is one replica's sustainable rate, the segments multiples of
it, --time-scale), Poisson arrivals per tick, prompt and output lengths uniform within +-50 % of --input-len /
--output-len. The planner's settings are slo_load's: upscale delay 0, --downscale-delay-s x --time-scale, seeded
with --rate's tokens (prompt --rate x --input-len, output --rate x --output-len, as slo_load's history.csv);
slo_sleep's lets go after --sleep-delay-s x --time-scale, and a replica let go sleeps after its last request and
that delay. The replica: --prefill-tps / --decode-tps saturated, TTFT and ITL floors, a batching engine's join
(simulate.py), --start-s, --wake-s. Prints per system SLO attainment, replica-seconds (awake) and every change with its reason.

  .venv/bin/python benchmarks/slo_steps_sim.py                       # the 2026-12-01 two-GPU run's shape, x1
  .venv/bin/python benchmarks/slo_steps_sim.py --time-scale 0.4 --ttft-join-ms 80
  .venv/bin/python benchmarks/slo_steps_sim.py --rate 25.112 --decode-tps 8500 --prefill-tps 27000 \
      --itl-floor-ms 20 --ttft-floor-ms 40 --ttft-join-ms 60 --start-s 70 --wake-s 1.5   # one H200, 8B x 4
"""

from __future__ import annotations

import argparse
import random
import sys
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from slo_trace import steps  # noqa: E402  (benchmarks/slo_trace.py)

from flagscale.planner.planner import Planner  # noqa: E402
from flagscale.planner.replay import Result, Static, replay  # noqa: E402
from flagscale.planner.simulate import ReplicaModel, SimPool  # noqa: E402
from flagscale.planner.trace import Tick, poisson  # noqa: E402
from flagscale.planner.types import PlannerSettings, Slo, planned_awake  # noqa: E402


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--rate", type=float, default=75.175, help="one replica's sustainable req/s (the 2026-12-01 calibration)")
    add("--time-scale", type=float, default=1.0)
    add("--max-replicas", type=int, default=4)
    add("--input-len", type=int, default=512)
    add("--output-len", type=int, default=128)
    add("--ttft-ms", type=float, default=500.0)
    add("--itl-ms", type=float, default=50.0)
    add("--downscale-delay-s", type=float, default=30.0, help="at time scale 1")
    add("--sleep-delay-s", type=float, default=5.0, help="slo_sleep's idle delay, at time scale 1 (as slo_load)")
    add("--prefill-tps", type=float, default=100_000.0, help="prompt tokens/s one replica computes, saturated")
    add("--decode-tps", type=float, default=25_000.0, help="output tokens/s one replica streams, saturated")
    add("--ttft-floor-ms", type=float, default=20.0)
    add("--itl-floor-ms", type=float, default=8.0)
    add("--ttft-join-ms", type=float, default=40.0, help="what a prompt waits for the running batch")
    add("--start-s", type=float, default=110.0, help="a replica's cold start (measured: 104-141 s)")
    add("--wake-s", type=float, default=0.5)
    add("--tick-s", type=float, default=2.0, help="the planner's tick (slo_policy pushes every 2 s)")
    add("--seed", type=int, default=1)
    return parser.parse_args(argv)


def ticks(args: argparse.Namespace) -> list[Tick]:
    rng, out = random.Random(args.seed), []
    for step in steps(args.rate, args.time_scale):
        for k in range(round(step["seconds"] / args.tick_s)):
            n = poisson(rng, step["rps"] * args.tick_s)
            prompt = sum(rng.uniform(0.5, 1.5) * args.input_len for _ in range(n))
            output = sum(rng.uniform(0.5, 1.5) * args.output_len for _ in range(n))
            out.append(Tick(step["start_s"] + k * args.tick_s, n, prompt, output))
    return out


def simulate(args: argparse.Namespace) -> list[Result]:
    model = ReplicaModel(
        prefill_tps=args.prefill_tps, decode_tps=args.decode_tps, ttft_floor_ms=args.ttft_floor_ms,
        itl_floor_ms=args.itl_floor_ms, ttft_join_ms=args.ttft_join_ms, start_s=args.start_s, wake_s=args.wake_s,
    )  # fmt: skip
    slo, top, trace = Slo(args.ttft_ms, args.itl_ms), args.max_replicas, ticks(args)
    seeds = {"seed_prompt_tps": args.rate * args.input_len, "seed_output_tps": args.rate * args.output_len}
    delays = {"upscale_delay_s": 0.0, "downscale_delay_s": args.downscale_delay_s * args.time_scale}
    planned = PlannerSettings(slo, 1, top, start_s=args.start_s, **delays, **seeds)
    sleep_delay_s = args.sleep_delay_s * args.time_scale
    asleep = planned_awake(planned, sleep_delay_s)  # as SloPolicy plans a node that sleeps
    # a replica let go finishes its longest request (at the ITL SLO), idles sleep_delay_s, then sleeps
    idle_into_sleep = replace(model, drain_s=sleep_delay_s + 1.5 * args.output_len * args.itl_ms / 1000)
    systems = {
        "slo_sleep": (SimPool(None, idle_into_sleep, 0, sleeps=True, asleep=top), Planner(asleep)),
        "slo": (SimPool(None, model, 1), Planner(planned)),
        "static_max": (SimPool(None, model, top), Static(top)),
    }
    return [replay(name, trace, {None: pool}, slo, args.tick_s) for name, pool in systems.items()]


def main() -> int:
    args = arguments()
    results = simulate(args)
    static = next(r for r in results if r.system == "static_max")
    print("| system | SLO attainment | replica-s | share of static max's |\n|---|---|---|---|")
    for r in results:
        print(f"| {r.system} | {100 * r.attainment:.1f} % | {r.gpu_s:.0f} | {r.gpu_s / static.gpu_s:.0%} |")
    for r in results:
        for time_s, _, before, after, why in r.changes:
            print(f"{r.system} {time_s:6.0f} s: {before} -> {after}: {why}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
