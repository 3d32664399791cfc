"""End to end: `run` on a running deployment updates it in place, and an autoscaled node scales (issue 12).

Real Ray, a real vLLM (CPU) engine on the demo model, one replica; one deployment for the module's two tests.

1. While two clients send requests without a pause (streamed and not), the config's `max_num_seqs` changes from
   8 to 4 and `run` is given it again: Serve starts a replica with the new args, the router takes it in, the old
   one drains and stops. No request fails, and the replica serving afterwards runs with the new value. A change
   that cannot be applied in place (the port) is refused and changes nothing; the same config again changes
   nothing; dryrun shows the difference.
2. The same node, made autoscaled by that update too (`min_replicas: 1, max_replicas: 2,
   target_ongoing_requests: 2`; one replacement for both changes). Requests reach the engines through the router, not through Serve, so what Serve
   scales on is the load each vLLM server reports (flagscale/replica/autoscaling.py). Six clients streaming long
   answers put ~6 requests on the one replica: status must show the target go to 2 and a second replica serving;
   when the clients stop, back to 1. No request fails on the way, the drained replica's included. Then `stop`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import openai
import psutil
import pytest

from tests.conftest import REPO, STATUS_WAIT_S, demo_engine_args, run_cli, status_cli, wait_for, write_config

PORT = 19171
# What the update of test 1 turns on besides the engine arg (one replacement for both; two clients keep the load
# at the target, so the node stays at one replica until test 2's six).
AUTOSCALED = {
    "num_cpus": 1,
    "min_replicas": 1,
    "max_replicas": 2,
    "target_ongoing_requests": 2,
    "upscale_delay_s": 2,
    "downscale_delay_s": 10,
}


def status_json(conf) -> dict:
    result = status_cli(conf, "output=json")
    assert result.returncode == 0, result.output
    return json.loads(result.stdout[result.stdout.index("{") :])


def serving_replicas(conf) -> list[dict] | None:
    """The one READY replica as a list of one; None ("not yet") while none or several are (one still draining)."""
    ready = [r for r in status_json(conf)["replicas"] if r["state"] == "READY"]
    return ready if len(ready) == 1 else None


def vllm_argv(replica: dict) -> list[str]:
    return psutil.Process(replica["engine_pid"]).children()[0].cmdline()  # engine_proc's child: vLLM's server


class SteadyLoad:
    """Clients sending one request after another until stopped; every answer is checked."""

    def __init__(self, clients: int = 2):
        self.client = openai.OpenAI(base_url=f"http://127.0.0.1:{PORT}/v1", api_key="none", timeout=120, max_retries=0)
        self.stop = threading.Event()
        self.ok = 0
        self.failures: list[str] = []
        self.threads = [threading.Thread(target=self._loop, args=(i,), daemon=True) for i in range(clients)]

    def _loop(self, index: int) -> None:
        n = 0
        while not self.stop.is_set():
            n += 1
            try:
                request = {"model": "demo", "prompt": f"update {index} {n}", "max_tokens": 24}
                request["extra_body"] = {"ignore_eos": True}
                if (index + n) % 2:
                    chunks = list(self.client.completions.create(stream=True, **request))
                    finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
                else:
                    finish = self.client.completions.create(**request).choices[0].finish_reason
                assert finish == "length", f"an answer that ended with {finish!r}, not after its 24 tokens"
                self.ok += 1
            except Exception as exc:  # noqa: BLE001 - every failure is the finding
                self.failures.append(f"{type(exc).__name__}: {exc}")

    def __enter__(self) -> SteadyLoad:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(180)


def node(max_num_seqs: int, resources: dict | None = None) -> dict:
    return {
        "serve_id": "demo",
        "engine": "vllm",
        "engine_args": demo_engine_args(served_model_name="demo", max_num_seqs=max_num_seqs),
        "resources": resources or {"num_replicas": 1, "num_cpus": 1},
    }


@pytest.fixture(scope="module")
def module_dir(tmp_path_factory):
    """The module's config and exp_dir; whatever a failed test left running is stopped at the end."""
    tmp_path = tmp_path_factory.mktemp("update")
    yield tmp_path
    if (tmp_path / "exp" / "state.json").exists():
        run_cli(tmp_path / "conf", "action=stop", timeout=300)


def test_changing_an_engine_arg_under_load_replaces_the_replica_without_a_failed_request(module_dir):
    tmp_path = module_dir
    exp = tmp_path / "exp"
    conf = write_config(tmp_path / "conf", [node(8)], exp, PORT)
    first = subprocess.Popen(
        [sys.executable, str(REPO / "run.py"), "--config-path", str(conf), "--config-name", "serve"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200"},
    )
    try:
        # The window of issue 19: the first run has its Ray head but no running deployment yet.
        wait_for(lambda: (exp / "state.json").exists() or first.poll() is not None, 300, "the first run to start Ray")
        second = run_cli(conf, timeout=120)
        still_starting = first.poll() is None and json.loads((exp / "state.json").read_text())["phase"] == "starting"
        assert second.returncode != 0 and f"pid {first.pid} (action=run)" in second.stderr, second.output
        assert "stale" not in second.output
        started_output = first.communicate(timeout=900)[0]
        assert first.returncode == 0, started_output
        assert still_starting, "the second run was not tried while the first was starting"
        (before,) = wait_for(lambda: serving_replicas(conf), STATUS_WAIT_S, "the replica to be listed")
        assert (
            "--max-num-seqs" in vllm_argv(before)
            and vllm_argv(before)[vllm_argv(before).index("--max-num-seqs") + 1] == "8"
        )

        same = run_cli(conf, timeout=120)
        assert same.returncode == 0 and "nothing to change" in same.stdout, same.output

        other_port = write_config(tmp_path / "conf-port", [node(8)], exp, PORT + 1)
        refused = run_cli(other_port, timeout=120)
        assert refused.returncode != 0 and "experiment.runner.deploy.port" in refused.stderr, refused.output
        assert "Nothing was changed" in refused.stderr

        conf = write_config(tmp_path / "conf", [node(4, AUTOSCALED)], exp, PORT)
        shown = run_cli(conf, "action=dryrun", timeout=120)
        assert shown.returncode == 0 and "serve.demo.engine_args.max_num_seqs: 8 -> 4" in shown.stdout, shown.output
        assert "serve.demo.resources.max_replicas: added (2)" in shown.stdout, shown.output

        with SteadyLoad() as load:
            wait_for(lambda: load.ok >= 4, 120, "the clients' first answers")
            updated = run_cli(conf, timeout=900)
            served_before = load.ok
            wait_for(lambda: load.ok >= served_before + 4, 120, "answers from the updated deployment")
        assert updated.returncode == 0 and "updated" in updated.stdout, updated.output
        assert not load.failures, f"{len(load.failures)} of {load.ok + len(load.failures)} failed: {load.failures[:3]}"

        (after,) = wait_for(lambda: serving_replicas(conf), STATUS_WAIT_S, "one serving replica after the update")
        assert after["replica_id"] != before["replica_id"]
        argv = vllm_argv(after)
        assert argv[argv.index("--max-num-seqs") + 1] == "4"

        def old_engine_gone() -> bool:
            return (
                not psutil.pid_exists(before["engine_pid"]) or psutil.Process(before["engine_pid"]).status() == "zombie"
            )

        wait_for(old_engine_gone, 60, "the replaced replica's engine process to exit")
    finally:
        if first.poll() is None:
            first.wait(900)


def scale(conf) -> tuple[int, int]:
    """(Serve's target replicas, replicas serving) of the node."""
    report = status_json(conf)
    target = report["deployments"]["demo"]["scaling"]["target_replicas"]
    return target, sum(1 for r in report["replicas"] if r["serve_id"] == "demo" and r["state"] == "READY")


def test_an_autoscaled_node_scales_up_under_load_and_down_when_idle(module_dir):
    conf = module_dir / "conf"  # test 1's update turned autoscaling on
    try:
        assert wait_for(lambda: scale(conf) == (1, 1) and scale(conf), STATUS_WAIT_S, "one replica at rest") == (1, 1)

        client = openai.OpenAI(base_url=f"http://127.0.0.1:{PORT}/v1", api_key="none", timeout=300, max_retries=0)
        stop, failures, served = threading.Event(), [], []

        def keep_asking(index: int) -> None:
            while not stop.is_set():
                try:
                    chunks = client.completions.create(
                        model="demo",
                        prompt=f"scale {index}",
                        max_tokens=200,
                        stream=True,
                        extra_body={"ignore_eos": True},
                    )
                    finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
                    assert finish == "length", finish
                    served.append(index)
                except Exception as exc:  # noqa: BLE001 - every failure is the finding
                    failures.append(f"{type(exc).__name__}: {exc}")

        clients = [threading.Thread(target=keep_asking, args=(i,), daemon=True) for i in range(6)]
        for thread in clients:
            thread.start()
        try:
            wait_for(lambda: scale(conf) == (2, 2), 420, "Serve to scale the node to 2 replicas, both serving")
        finally:
            stop.set()
            for thread in clients:
                thread.join(300)
        assert not failures, f"{len(failures)} requests failed: {failures[:3]}"
        assert served
        wait_for(lambda: scale(conf) == (1, 1), 240, "Serve to scale the idle node back to 1 replica")
    finally:
        stopped = run_cli(conf, "action=stop", timeout=300)
        assert stopped.returncode == 0, stopped.output
