"""The SLO planner on a simulated cluster (flagscale/planner/simulate.py): a seeded bursty day (flagscale/planner/
trace.py) on --gpus GPUs, one replica per GPU, replayed under four systems on the same trace and the same
simulated replicas:

- slo: the SLO planner (flagscale/planner/planner.py, the code the deployment runs), min..max replicas;
- slo_sleep: the same with `sleep_delay_s` (docs/autoscaling.md, "Asleep, not stopped"): the planner sizes the
  replicas awake (none when idle), a replica let go sleeps instead of stopping and is woken in --wake-s when the
  target rises. A sleeping replica's GPU counts as free (time-shared with other models, what sleep is for).
  Colocated only: a disaggregated pool cannot sleep;
- request_count: today's autoscaling (in-flight requests / target_ongoing_requests, Serve's policy), with
  target_ongoing_requests set as auto_tune would find it: the in-flight count of one replica at the load it
  sustains within the SLO on the trace's mean request;
- static_max, static_min: fixed at max and at min replicas.

Colocated by default; --pd splits each GPU budget into a prefill and a decode pool (half each), each with its own
planner (prefill on TTFT and prompt tokens, decode on ITL, KV and output tokens). Reports per system SLO attainment
(share of requests meeting both TTFT and ITL at the percentile), goodput, GPU-hours, goodput per GPU-hour, failed
requests (held past the bound at zero replicas), changes, and the reaction to the morning ramp and the 14:00 spike.
Writes to --out: <name>.json (the table), <name>-changes.csv (every change of every system, with its reason),
<name>-timeline.csv (per minute: load and replicas asked for), <name>.png (matplotlib, when installed).

  .venv/bin/python benchmarks/slo_planner.py                    # 64 GPUs, seed 1, colocated
  .venv/bin/python benchmarks/slo_planner.py --pd --seed 2
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from flagscale.planner.planner import Planner  # noqa: E402
from flagscale.planner.replay import RequestCount, Static, planner_pools, reactions, replay  # noqa: E402
from flagscale.planner.simulate import ITL_SLOPE, ReplicaModel, SimPool, ttft_ms  # noqa: E402
from flagscale.planner.trace import DAY, bursty_day, events  # noqa: E402
from flagscale.planner.types import DECODE, PREFILL, PlannerSettings, Slo, planned_awake  # noqa: E402


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", type=int, default=64)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--peak-load", type=float, default=0.6, help="the trace's peak, as a share of --gpus' capacity")
    parser.add_argument("--tick-s", type=float, default=5.0)
    parser.add_argument("--pd", action="store_true", help="prefill and decode pools apart")
    parser.add_argument("--ttft-ms", type=float, default=500.0)
    parser.add_argument("--itl-ms", type=float, default=50.0)
    parser.add_argument("--percentile", type=float, default=90.0)
    parser.add_argument("--min-replicas", type=int, default=1, help="per pool")
    parser.add_argument("--start-s", type=float, default=60.0, help="a new replica's time to serve")
    parser.add_argument("--wake-s", type=float, default=1.0, help="a sleeping replica's (slo_sleep)")
    join = "what a prompt waits for the running batch (simulate.py; 0: the plain queueing shape)"
    parser.add_argument("--ttft-join-ms", type=float, default=ReplicaModel.ttft_join_ms, help=join)
    parser.add_argument("--upscale-delay-s", type=float, default=15.0)
    parser.add_argument("--downscale-delay-s", type=float, default=300.0)
    parser.add_argument("--sleep-delay-s", type=float, default=300.0, help="slo_sleep: idle this long, one sleeps")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    parser.add_argument("--name", default=None, help="file name stem (default slo-planner-<mode>-<gpus>gpu-s<seed>)")
    return parser.parse_args()


def mean_request(model: ReplicaModel) -> tuple[float, float, float]:
    """The trace's mean prompt and output tokens (request-weighted over the busy phases) and one replica's
    saturated request rate on it (colocated)."""
    busy = [phase for phase in DAY if phase.rate or phase.to_rate]
    weights = [(phase.rate + phase.to_rate) / 2 for phase in busy]
    prompt = sum(w * phase.prompt_mean for w, phase in zip(weights, busy)) / sum(weights)
    output = sum(w * phase.output_mean for w, phase in zip(weights, busy)) / sum(weights)
    return prompt, output, 1.0 / (prompt / model.prefill_tps + output / model.decode_tps)


def target_ongoing(model: ReplicaModel, slo: Slo, role: str | None) -> float:
    """What auto_tune would settle on: one replica's in-flight requests at the most load it carries within the SLO
    (utilization u where TTFT = (floor + join) / (1 - u) and ITL = floor / (1 - ITL_SLOPE u) meet their bounds;
    Little's law)."""
    prompt, output, _ = mean_request(model)
    bounds = [1 - (model.ttft_floor_ms + model.ttft_join_ms) / slo.ttft_ms if role != DECODE else 1.0]
    bounds.append((1 - model.itl_floor_ms / slo.itl_ms) / ITL_SLOPE if role != PREFILL else 1.0)
    u = min(0.95, *bounds)
    work = (prompt / model.prefill_tps if role != DECODE else 0) + (output / model.decode_tps if role != PREFILL else 0)
    latency_s = ttft_ms(model, u) / 1000 + output * model.itl_floor_ms / (1 - ITL_SLOPE * u) / 1000
    return round(u / work * latency_s, 1)


def systems(args: argparse.Namespace, model: ReplicaModel, slo: Slo) -> dict[str, dict]:
    roles = (PREFILL, DECODE) if args.pd else (None,)
    top = args.gpus // len(roles)
    settings = {
        role: PlannerSettings(
            slo, args.min_replicas, top, role, args.upscale_delay_s, args.downscale_delay_s, args.start_s
        )
        for role in roles
    }
    start = {role: args.min_replicas for role in roles}
    # as SloPolicy plans a node that sleeps
    awake = {role: planned_awake(s, args.sleep_delay_s) for role, s in settings.items()}
    # all of max started at `run` (EnginePlan.initial_replicas), the ones not wanted awake asleep
    sleeping = {
        role: (SimPool(role, model, start[role], sleeps=True, asleep=top - start[role]), Planner(s))
        for role, s in awake.items()
    }
    return {
        "slo": planner_pools(settings, model, start),
        **({} if args.pd else {"slo_sleep": sleeping}),  # a disaggregated pool cannot sleep (plan/sleep.py)
        "request_count": {
            role: (SimPool(role, model, start[role]), RequestCount(s, target_ongoing(model, slo, role)))
            for role, s in settings.items()
        },
        "static_max": {role: (SimPool(role, model, top), Static(top)) for role in roles},
        "static_min": {role: (SimPool(role, model, args.min_replicas), Static(args.min_replicas)) for role in roles},
    }


def write_outputs(args: argparse.Namespace, name: str, results: list, meta: dict) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    table = [result.summary() for result in results]
    (args.out / f"{name}.json").write_text(json.dumps({**meta, "systems": table}, indent=2) + "\n")
    with open(args.out / f"{name}-changes.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["system", "time_s", "pool", "from", "to", "reason"])
        for result in results:
            writer.writerows([result.system, *change] for change in result.changes)
    with open(args.out / f"{name}-timeline.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["time_s", "arrival_rps", *(f"{result.system}_replicas" for result in results)])
        for row in zip(*(result.timeline for result in results)):
            writer.writerow([row[0][0], round(row[0][1], 2), *(point[2] for point in row)])
    if importlib.util.find_spec("matplotlib") is not None:
        plot(args.out / f"{name}.png", results, meta["title"])


def plot(path: Path, results: list, title: str) -> None:
    from flagscale.adaptors import matplotlib_figure  # noqa: PLC0415  (a plot only when asked for)

    fig = matplotlib_figure.Figure(figsize=(11, 5.5))
    load, count = fig.add_subplot(2, 1, 1), fig.add_subplot(2, 1, 2)
    first = results[0].timeline
    load.plot([t / 3600 for t, _, _ in first], [rps for _, rps, _ in first], color="grey", linewidth=0.8)
    load.set_ylabel("arrivals (req/s)")
    load.set_title(title)
    for result in results:
        count.plot([t / 3600 for t, _, _ in result.timeline], [n for _, _, n in result.timeline], label=result.system)
    count.set_ylabel("replicas asked for")
    count.set_xlabel("hour of the day")
    count.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def markdown(results: list) -> str:
    rows = [result.summary() for result in results]
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(str(row.get(key, "")) for key in keys) + " |" for row in rows]
    return "\n".join(lines)


def main() -> int:
    args = arguments()
    model = ReplicaModel(start_s=args.start_s, wake_s=args.wake_s, ttft_join_ms=args.ttft_join_ms)
    slo = Slo(args.ttft_ms, args.itl_ms, args.percentile)
    _, _, replica_rps = mean_request(model)
    peak_rps = args.peak_load * args.gpus * replica_rps
    mode = "pd" if args.pd else "colocated"
    name = args.name or f"slo-planner-{mode}-{args.gpus}gpu-s{args.seed}"
    began = time.monotonic()
    ticks = bursty_day(args.seed, peak_rps, args.tick_s)
    results = []
    for system, pools in systems(args, model, slo).items():
        result = replay(system, ticks, pools, slo, args.tick_s)
        reactions(result, events())
        results.append(result)
    elapsed = time.monotonic() - began
    title = f"{mode}, {args.gpus} GPUs, seed {args.seed}, peak {peak_rps:.0f} req/s, SLO p{args.percentile:g} "
    title += f"TTFT {args.ttft_ms:g} ms ITL {args.itl_ms:g} ms"
    meta = {
        "pools_at_08h_19h": {r.system: [r.at_hour(8), r.at_hour(19)] for r in results},
        "title": title,
        "seconds": round(elapsed, 1),
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    write_outputs(args, name, results, meta)
    print(title)
    print(markdown(results))
    if args.pd:
        for result in results[:2]:
            print(f"{result.system}: pools at 08:00 {result.at_hour(8)}, at 19:00 {result.at_hour(19)}")
    print(f"replayed {len(ticks)} ticks x {len(results)} systems in {elapsed:.1f} s; files: {args.out}/{name}*")
    return 0


if __name__ == "__main__":
    sys.exit(main())
