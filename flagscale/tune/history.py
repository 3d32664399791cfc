"""exp_dir/auto_tuner/history.csv (FlagScale's name): one row per candidate, rewritten whole after every trial
(written aside, then renamed: a Ctrl-C or a crash leaves the last complete file).

Each row carries a key: a digest of the candidate's values, the node, the workload and the SLO. A second
auto_tune on the same exp_dir takes a finished row (done or failed) with the same key instead of running the
trial again; anything that changes what a trial measures changes the key.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
from pathlib import Path
from typing import Any

from flagscale.errors import write_error
from flagscale.paths import private_dir, write_private

FILE = "history.csv"
# Columns after the space's own (one per dimension, named as in the space).
COLUMNS = (
    "status",
    "reason",
    "devices",
    "concurrency",
    "goodput",
    "goodput_per_device",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    "ttft_mean_ms",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "tpot_mean_ms",
    "tpot_p50_ms",
    "tpot_p99_ms",
    "itl_mean_ms",
    "itl_p50_ms",
    "itl_p99_ms",
    "e2el_mean_ms",
    "failed_requests",
    "slo_ratio",
    "deployed_by",
    "elapsed_s",
    "key",
)
FINISHED = ("done", "failed")


def trial_key(candidate: dict[str, Any], serve_id: str, workload: dict[str, Any], slo: Any) -> str:
    blob = json.dumps({"candidate": candidate, "serve_id": serve_id, "workload": workload, "slo": slo}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def write(path: Path, dims: list[str], rows: list[dict[str, Any]]) -> None:
    private_dir(path.parent)
    columns = [*dims, *(c for c in COLUMNS if c not in dims)]
    extra = sorted({k for row in rows for k in row} - set(columns))  # dimensions of an earlier, wider space
    text = io.StringIO(newline="")
    writer = csv.DictWriter(text, fieldnames=[*columns, *extra], extrasaction="ignore")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: _cell(v) for k, v in row.items()})
    aside = path.with_suffix(".csv.tmp")
    try:
        write_private(aside, text.getvalue(), newline="")
        os.replace(aside, path)
    except OSError as exc:  # a full disk: the previous file stays, one clear error names it
        aside.unlink(missing_ok=True)
        raise write_error(path, exc) from None


def read(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    with path.open(newline="") as f:
        return [{k: parse_cell(v) for k, v in row.items() if k is not None} for row in csv.DictReader(f)]


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, dict)):
        return json.dumps(value)
    return str(value)


def parse_cell(text: str | None) -> Any:
    """A cell back to the value it was written from: '' -> None, numbers, true/false, JSON lists; else text."""
    if text is None or text == "":
        return None
    if text in ("true", "false"):
        return text == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    if text[0] in "[{":
        try:
            return json.loads(text)
        except ValueError:
            pass
    return text
