"""End to end: `action=logs` on a real deployment (real Ray, two vLLM CPU engines, nodes a and b): every replica's
log under a header naming serve_id, replica, host and path, with vLLM's own start-up lines; serve_id= and replica=
narrow it down, unknown ones are refused with the valid ones listed; follow=true prints a request's line as it is
written, ends on Ctrl-C, and ends by itself when the deployment is stopped; a stopped deployment's logs still show.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

from tests.conftest import REPO, demo_engine_args, run_cli, wait_for, write_config

PORT = 19181


def sections(stdout: str) -> dict[str, str]:
    """{header line: the text under it} of `action=logs` output."""
    found: dict[str, str] = {}
    header = None
    for line in stdout.splitlines():
        if line.startswith("==> ") and line.endswith(" <=="):
            header = line
            found[header] = ""
        elif header is not None:
            found[header] += line + "\n"
    return found


class Follow:
    """`action=logs follow=true ...` running in the background; its output collected as it comes."""

    def __init__(self, conf, *overrides: str):
        argv = [str(REPO / "run.py"), "--config-path", str(conf), "--config-name", "serve"]
        argv += ["action=logs", "follow=true", *overrides]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200"}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", AS_FROM_A_TERMINAL, sys.executable, *argv],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.out: list[str] = []
        self.err: list[str] = []
        self._readers = [
            threading.Thread(target=lambda: self.out.extend(self.proc.stdout), daemon=True),
            threading.Thread(target=lambda: self.err.extend(self.proc.stderr), daemon=True),
        ]
        for reader in self._readers:
            reader.start()

    @property
    def stdout(self) -> str:
        return "".join(self.out)

    @property
    def stderr(self) -> str:
        return "".join(self.err)

    def wait(self, timeout: float) -> int:
        code = self.proc.wait(timeout=timeout)
        for reader in self._readers:
            reader.join(timeout=10)
        return code

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


# A suite run as a background job (`cmd &` in a non-interactive shell) hands its children SIGINT ignored, and a
# Python started so never raises KeyboardInterrupt: the follower is exec'd with SIGINT at its default, as a
# terminal gives it, so that Ctrl-C is tested wherever the suite runs.
AS_FROM_A_TERMINAL = (
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execv(sys.argv[1], sys.argv[1:])"
)


def stacks(pid: int) -> str:
    """Every thread's stack in process `pid` (py-spy, native frames included)."""
    argv = [str(Path(sys.executable).with_name("py-spy")), "dump", "--native", "--pid", str(pid)]
    try:
        dump = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"(py-spy dump failed: {exc})"
    return dump.stdout + dump.stderr


def complete(model: str, prompt: str) -> None:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 4}).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{PORT}/v1/completions", body, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as answer:
        assert answer.status == 200


def test_logs_of_a_running_then_stopped_deployment(tmp_path):
    exp_dir = tmp_path / "exp"
    nodes = [
        {
            "serve_id": name,
            "engine": "vllm",
            "engine_args": demo_engine_args(served_model_name=name),
            "resources": {"num_replicas": 1, "num_cpus": 1},
        }
        for name in ("a", "b")
    ]
    conf = write_config(tmp_path / "conf", nodes, exp_dir, PORT)
    followers: list[Follow] = []
    try:
        started = run_cli(conf, timeout=900)
        assert started.returncode == 0, started.output
        status = run_cli(conf, "action=status", "output=json", timeout=120)
        replicas = {r["serve_id"]: r for r in json.loads(status.stdout[status.stdout.index("{") :])["replicas"]}
        assert sorted(replicas) == ["a", "b"], status.output
        a, b = replicas["a"], replicas["b"]

        def header(r: dict) -> str:
            return f"==> serve_id {r['serve_id']}, replica {r['replica_id']}, host {r['host']}: {r['log']} <=="

        # no filter: the runner's log, then each replica's, with vLLM's start-up line naming that replica's URL
        shown = run_cli(conf, "action=logs", "lines=1000", timeout=120)
        assert shown.returncode == 0, shown.output
        logs = sections(shown.stdout)
        assert f"==> runner log (localhost): {exp_dir}/serve_logs/runner.log <==" in logs, list(logs)
        for r in (a, b):
            assert header(r) in logs, list(logs)
            assert f"Starting vLLM server on {r['url']}" in logs[header(r)]

        # the default: the last 50 lines of each
        shown = run_cli(conf, "action=logs", "serve_id=a", timeout=120)
        assert shown.returncode == 0, shown.output
        assert list(sections(shown.stdout)) == [header(a)]
        assert len(sections(shown.stdout)[header(a)].splitlines()) == 50

        shown = run_cli(conf, "action=logs", f"replica={b['replica_id'][:5]}", "lines=5", timeout=120)
        assert shown.returncode == 0, shown.output
        assert list(sections(shown.stdout)) == [header(b)]

        refused = run_cli(conf, "action=logs", "serve_id=nope", timeout=120)
        assert refused.returncode != 0
        assert "no engine replica of serve_id 'nope'" in refused.stderr and "a, b" in refused.stderr
        refused = run_cli(conf, "action=logs", "replica=zzzzzzzzz", timeout=120)
        assert refused.returncode != 0
        assert f"a/{a['replica_id']}" in refused.stderr and f"b/{b['replica_id']}" in refused.stderr

        # follow: a request's access line shows up as vLLM writes it; Ctrl-C ends it
        interrupted = Follow(conf, "serve_id=b", "lines=1")
        followers.append(interrupted)
        follow = Follow(conf, "serve_id=a", "lines=1")
        followers.append(follow)
        wait_for(lambda: "Ctrl-C" in follow.stderr and "Ctrl-C" in interrupted.stderr, 120, "follow to start")
        complete("a", "hello")
        wait_for(lambda: '"POST /v1/completions HTTP/1.1" 200' in follow.stdout, 60, "the request's line")
        assert header(b) not in follow.stdout
        interrupted.proc.send_signal(signal.SIGINT)
        # (the fresh-clone runs that saw a follower ignore Ctrl-C ran the suite as a background job: AS_FROM_A_TERMINAL)
        try:
            code = interrupted.wait(timeout=90)
        except subprocess.TimeoutExpired:
            stuck = stacks(interrupted.proc.pid)
            raise AssertionError(f"not exited 90 s after Ctrl-C:\n{stuck}\n{interrupted.stderr}") from None
        assert code == 0, interrupted.stderr

        # stop: the follower sees the deployment go and ends by itself
        stopped = run_cli(conf, "action=stop", timeout=300)
        assert stopped.returncode == 0, stopped.output
        assert follow.wait(timeout=60) == 0, follow.stderr
        assert "is stopped; no more lines will come" in follow.stderr

        # stopped: the logs are still there, found from the log dir
        shown = run_cli(conf, "action=logs", "serve_id=a", "lines=1000", timeout=120)
        assert shown.returncode == 0, shown.output
        (text,) = sections(shown.stdout).values()
        assert f"Starting vLLM server on {a['url']}" in text and '"POST /v1/completions HTTP/1.1" 200' in text
        assert f"replica {a['replica_id']}, host localhost: {a['log']}" in shown.stdout
    finally:
        for f in followers:
            f.kill()
        if (exp_dir / "state.json").exists():
            run_cli(conf, "action=stop", timeout=300)
