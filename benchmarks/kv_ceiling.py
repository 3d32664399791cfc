"""How much any router could gain over the approximate table on a kv_routing.py run's traces (issue 53's (d), (e)).

kv_routing.py's traces are seeded: from a result JSON's `args` this rebuilds each pass's trace (the model's
tokenizer, without weights), then replays it through the oracle (kv_events_bench.simulate: every engine's cache
known) and through the table at its best (kv_events_bench.simulate_table: each prompt where it sent the longest
prefix of it, forgotten at (d)'s router restart). Runs from before kv_routing.py reported the table model
(2026-12-02) get it here. (d)'s breaks are taken at half and three quarters of the requests the pass issued (the
run breaks at those fractions of the trace or of --pass-s, whichever comes first; the JSON does not keep the
index), so the oracle recomputed here can differ from the run's by a few tenths of a point; both are printed.

  python3 benchmarks/kv_ceiling.py benchmarks/results/gpu-kv-routing-8b-shared-c128-ad-20261202.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks"), str(REPO / "benchmarks" / "gpu")]

import kv_routing  # noqa: E402
from kv_events_bench import simulate, simulate_table  # noqa: E402
from model import ensure_model  # noqa: E402  (benchmarks/gpu/model.py)


def ceilings(result: dict) -> list[dict]:
    """Per (a)/(d)/(e) row of a kv_routing.py result: its hit rate, the oracle's (the run's, recomputed) and the
    table model's on the pass's trace."""
    args = argparse.Namespace(**result["args"])
    if args.size == "demo":
        from flagscale.demo_model import ensure_demo_model

        model_dir = ensure_demo_model()
    else:
        model_dir = ensure_model(args.size, device="cpu", weights=False)
    ctx = kv_routing.prepare(args, model_dir)
    blocks = ctx["cache_blocks"] - 1  # (vLLM keeps one block of the pool as its null block)
    found = []
    for row in result["rows"]:
        if row["workload"] not in ("a", "d", "e"):
            continue
        issued = row["issued"]
        trace = ctx["oracle"]["a"][:issued]
        breaks = [issued // 2, 3 * issued // 4] if row["workload"] == "d" else []
        emptied = {breaks[1]: 0} if breaks else None
        oracle = simulate(trace, args.engines, blocks, args.block_size, emptied)["oracle_hit_rate"]
        table = simulate_table(trace, args.engines, blocks, args.block_size, emptied, set(breaks[:1]))
        found.append({
            "workload": row["workload"], "system": row["system"], "round": row["round"], "hit_rate": row["hit_rate"],
            "run_oracle": row.get("oracle_hit_rate"), "oracle": oracle, "table_model": table,
            "oracle_over_table_model": round(oracle / table, 3) if table else None,
        })  # fmt: skip
    return found


def main(argv: list[str]) -> None:
    print("| file | workload | system | round | hit rate | oracle (run / here) | table model | oracle / table model |")
    print("|---|---|---|---|---|---|---|---|")
    for path in argv:
        for c in ceilings(json.loads(Path(path).read_text())):
            print(f"| {Path(path).name} | {c['workload']} | {c['system']} | {c['round']} | {c['hit_rate']} | "
                  f"{c['run_oracle']} / {c['oracle']} | {c['table_model']} | {c['oracle_over_table_model']}x |")  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1:])
