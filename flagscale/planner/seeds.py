"""The SLO planner's seeds from action=auto_tune's results (docs/autoscaling.md): what one replica of the best
finished trial of the exp_dir's auto_tuner/history.csv (flagscale/tune/history.py writes it) sustained within
the search's SLO, in prompt and output tokens per second (PlannerSettings.seed_*_tps)."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

HISTORY = Path("auto_tuner") / "history.csv"  # in the exp_dir (tune/history.py's FILE)


def seeds_in(exp_dir: str | Path) -> dict[str, float] | None:
    """The seeds the exp_dir's history gives, None without one (or without a done trial that measured them)."""
    path = Path(exp_dir) / HISTORY
    if not path.is_file():
        return None
    with path.open(newline="") as f:
        return planner_seeds([{k: _number(v) for k, v in row.items() if k is not None} for row in csv.DictReader(f)])


def _number(text: str | None) -> Any:
    for kind in (int, float):
        try:
            return kind(text)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            pass
    return text


def planner_seeds(rows: list[dict[str, Any]]) -> dict[str, float] | None:
    """What one replica of the best finished trial sustained within the search's SLO, as the SLO planner's seeds
    (flagscale/planner/types.py PlannerSettings.seed_*_tps): prompt and output tokens per second per replica. None
    without a done trial that measured them."""
    done = [r for r in rows if r.get("status") == "done" and isinstance(r.get("output_throughput"), (int, float))]
    if not done:
        return None
    best = max(done, key=lambda r: r.get("goodput_per_device") or 0)
    replicas = best.get("instance") if isinstance(best.get("instance"), int) and best["instance"] > 0 else 1
    output = best["output_throughput"] / replicas
    total = best.get("total_token_throughput")
    prompt = (total - best["output_throughput"]) / replicas if isinstance(total, (int, float)) else None
    if output <= 0:
        return None
    return {"seed_output_tps": output, **({"seed_prompt_tps": prompt} if prompt and prompt > 0 else {})}
