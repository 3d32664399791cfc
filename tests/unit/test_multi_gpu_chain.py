"""benchmarks/gpu/multi_gpu.sh's own behaviour, without a GPU: it runs from a snapshot of the repo (a device-tool
call that copies the working tree afresh must not change files under a running chain), and a step that needs
FlagScale's configs fails when they are absent instead of letting the test skip."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def chain(tmp_path: Path, *steps: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(REPO / "benchmarks/gpu/multi_gpu.sh"), str(tmp_path / "out"), *steps],
        cwd=REPO,
        env={**os.environ, "TMPDIR": str(tmp_path), **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_pd_config_step_without_the_configs_fails_and_says_where_it_looked(tmp_path):
    done = chain(tmp_path, "pdfs4", FLAGSCALE_CONFIGS=str(tmp_path / "nowhere"))
    assert f"pdfs4: no FlagScale configs at {tmp_path / 'nowhere'}" in done.stdout, done.stdout + done.stderr
    assert "=== pdfs4 exit 1" in done.stdout, done.stdout


def test_the_chain_runs_from_a_snapshot_of_the_repo(tmp_path):
    done = chain(tmp_path, "no-such-step")
    line = next(x for x in done.stdout.splitlines() if x.startswith("=== running from a snapshot of the repo: "))
    snapshot = Path(line.rsplit(" ", 1)[1])
    assert snapshot != REPO and (snapshot / "benchmarks/gpu/multi_gpu.sh").is_file(), done.stdout
    assert not (snapshot / ".git").exists()
    assert "unknown step no-such-step" in done.stdout, done.stdout
    in_place = chain(tmp_path, "no-such-step", FLAGSCALE_CHAIN_SNAPSHOT="0")
    assert "running from a snapshot" not in in_place.stdout, in_place.stdout
