"""End to end: action=auto_tune on a FlagScale-shaped config (issue 23).

Real Ray, real vLLM (CPU) engines on the demo model, vLLM's serving benchmark through the router. The space is
`instance` x `max_num_seqs` = 4 candidates, two of which the engine refuses (max_num_seqs above
max_num_batched_tokens: vLLM's parser accepts it, its scheduler config does not): they come first, so the first
one's engine exits at start, and the second, with the same engine args, is failed for the same cause without a
start. Plus one value pruning skips (its KV cache cannot fit what gpu_memory_utilization gives). The first search
is interrupted (SIGINT) once a trial is done: nothing is left running, history.csv keeps the trials. The second
search on the same exp_dir skips the three it finished (failed ones included), runs the last, and leaves the best
serving (run_best, in place from the last trial's deployment), which answers; then it is stopped.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import openai
import yaml

from flagscale.cluster.processes import session_members
from flagscale.tune import history
from tests.conftest import FAST_START_ENVS, REPO, demo_engine_args, run_cli, wait_for, write_config

PORT = 19241
# The refused values first: their failures are recorded by the first search, and run_best then starts from the
# last good trial's deployment instead of from nothing (a failed trial stops the deployment).
SPACE = {"max_num_seqs": [512, 4, 100000], "instance": [1, 2]}


def tuner_conf(tmp_path):
    node = {  # FlagScale's shape: no `engine`, it comes from task.backend
        "serve_id": "demo",
        "engine_args": demo_engine_args(
            served_model_name="demo", max_num_batched_tokens=256, enable_chunked_prefill=True
        ),
        "resources": {"num_replicas": 1},
    }
    experiment = {
        "task": {"type": "serve", "backend": "vllm"},
        "bench": {"input_len": 32, "output_len": 16, "num_prompts": 8, "concurrency": [1, 4]},
        "auto_tuner": {
            "space": SPACE,
            "control": {"interval": 0, "run_best": True, "max_time_per_task": 400},
            "slo": {"ttft_ms": {"p99": 20000}, "tpot_ms": {"p99": 5000}},
        },
    }
    return write_config(tmp_path / "conf", [node], tmp_path / "exp", PORT, experiment=experiment)


def sessions_of(exp) -> set[int]:
    state = exp / "state.json"
    try:
        return {h["session"] for h in json.loads(state.read_text())["hosts"]}
    except (OSError, ValueError, KeyError):
        return set()


def rows_by_candidate(exp) -> dict[tuple, dict]:
    return {(r["max_num_seqs"], r["instance"]): r for r in history.read(exp / "auto_tuner" / "history.csv")}


def test_auto_tune_interrupted_resumed_past_failing_candidates_leaves_the_best_serving(tmp_path, monkeypatch):
    conf = tuner_conf(tmp_path)
    exp = tmp_path / "exp"

    listed = run_cli(conf, "action=dryrun", timeout=300)
    assert listed.returncode == 0, listed.output
    out = " ".join(listed.stdout.split())
    assert "6 candidate(s) over max_num_seqs, instance" in out
    assert "max_num_seqs=4 instance=2 would run" in out
    assert "max_num_seqs=100000 instance=1 skipped: memory: weights" in out and "gives" in out
    assert not exp.joinpath("state.json").exists() and not exp.joinpath("auto_tuner").exists()

    first = subprocess.Popen(
        [
            sys.executable,
            str(REPO / "run.py"),
            "--config-path",
            str(conf),
            "--config-name",
            "serve",
            "action=auto_tune",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200"},
    )
    sessions: set[int] = set()
    try:

        def one_trial_recorded() -> bool:
            sessions.update(sessions_of(exp))
            assert first.poll() is None, "the first search ended before it was interrupted"
            return any(r["status"] == "done" for r in rows_by_candidate(exp).values())

        # a trial's own budget is 400 s (max_time_per_task), after the failing candidate and the cluster's start
        wait_for(one_trial_recorded, 900, "the first trial in history.csv")
        first.send_signal(signal.SIGINT)
        interrupted = first.communicate(timeout=300)[0]
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert first.returncode == 130, interrupted
    assert "interrupted: history.csv keeps what was measured" in interrupted
    assert sessions and not [p for s in sessions for p in session_members(s)]
    assert not (exp / "state.json").exists()
    kept = rows_by_candidate(exp)[(4, 1)]
    assert kept["status"] == "done" and kept["goodput"] > 0

    try:
        second = run_cli(conf, "action=auto_tune", timeout=900)
        assert second.returncode == 0, second.output
        out = " ".join(second.stdout.split())
        assert "3 finished in an earlier search" in out and "2 skipped by pruning" in out
        rows = rows_by_candidate(exp)
        assert rows[(4, 1)]["key"] == kept["key"] and rows[(4, 1)]["request_throughput"] == kept["request_throughput"]
        assert rows[(4, 1)]["deployed_by"] == "earlier search"
        assert rows[(4, 2)]["status"] == "done"
        for failing in ((512, 1), (512, 2)):
            assert rows[failing]["status"] == "failed", rows[failing]
            assert "max_num_batched_tokens" in rows[failing]["reason"], rows[failing]["reason"]
        assert "same engine args as max_num_seqs=512 instance=1" in rows[(512, 2)]["reason"]
        assert rows[(512, 2)]["elapsed_s"] == 0
        assert rows[(100000, 1)]["status"] == "skipped" and rows[(100000, 1)]["reason"].startswith("memory:")
        best = max((rows[(4, 1)], rows[(4, 2)]), key=lambda r: r["goodput_per_device"])
        assert f"best: max_num_seqs=4 instance={best['instance']}" in out
        assert (exp / "auto_tuner" / "auto_tune.png").stat().st_size > 0

        best_nodes = yaml.safe_load((exp / "auto_tuner" / "best" / "serve" / "best.yaml").read_text())
        assert best_nodes[0]["engine_args"]["max_num_seqs"] == 4
        assert best_nodes[0]["resources"]["num_replicas"] == best["instance"]
        # run_best: the best serves; the written best config is what runs (run with it changes nothing)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{PORT}/v1", api_key="none", timeout=120, max_retries=0)
        answer = client.completions.create(model="demo", prompt="hello", max_tokens=4)
        assert answer.choices[0].text is not None
        # the written config reads every experiment.envs value from the environment (it keeps no value there)
        assert "set VLLM_ENABLE_V1_MULTIPROCESSING first" in out
        for name, value in FAST_START_ENVS.items():
            monkeypatch.setenv(name, value)
        again = run_cli(exp / "auto_tuner" / "best", timeout=300)
        assert again.returncode == 0 and "nothing to change" in again.stdout, again.output
        sessions = sessions_of(exp)
    finally:
        stopped = run_cli(conf, "action=stop", timeout=300)
    assert stopped.returncode == 0, stopped.output
    wait_for(
        lambda: not [p for s in sessions for p in session_members(s)], 60, "the best deployment's processes to exit"
    )
