"""benchmarks/router_capacity.py keeps working: its replay mode, with the project's Router and with the floor relay,
streams every token through and reports the router's CPU per token (no Ray; a few seconds)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO


def test_replay_through_the_router_and_the_floor(tmp_path):
    rows = []
    for router in ("project", "floor"):
        output = tmp_path / f"{router}.json"
        argv = [sys.executable, str(REPO / "benchmarks" / "router_capacity.py"), "--router", router]
        argv += ["--processes", "1", "--loads", "1x4", "--upstreams", "1", "--step-ms", "5", "--tokens", "16"]
        argv += ["--duration", "2", "--warmup", "1", "--output", str(output)]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=180, cwd=REPO)
        assert done.returncode == 0, done.stdout + done.stderr
        rows += json.loads(output.read_text())["rows"]
    assert len(rows) == 2 and rows[1]["router"] == "floor relay (not a router)"
    for row in rows:
        assert row["failed"] == 0 and row["requests"] > 0 and row["tokens_per_s"] > 0, row
        assert row["router_cpu_us_per_token"] > 0, row


def test_floor_in_front_of_engines_asks_for_what_it_needs_before_starting_anything():
    script = [sys.executable, str(REPO / "benchmarks" / "router_capacity.py")]
    for args, culprit in (
        (["--floor"], "--router floor"),  # the replay: the floor has its own switch there
        (["--upstream", "endpoint", "--url", "http://127.0.0.1:1", "--floor"], "--exp-dir"),
    ):
        done = subprocess.run([*script, *args], capture_output=True, text=True, timeout=60, cwd=REPO)
        assert done.returncode == 2 and culprit in done.stderr, done.stderr


def test_floor_without_a_running_deployment_names_the_exp_dir(tmp_path):
    from benchmarks.router_capacity import replica_urls

    with pytest.raises(SystemExit, match=f"no run state in {tmp_path}"):
        replica_urls(tmp_path)
