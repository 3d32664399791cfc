"""End to end: an autoscaled engine node grows under load and shrinks back when idle (issue 12).

Real Ray, real vLLM (CPU) engines on the demo model; `min_replicas: 1, max_replicas: 2, target_ongoing_requests:
2`. Requests reach the engines through the router, not through Serve, so what Serve scales on is the load each
vLLM server reports (flagscale/replica/autoscaling.py). Six clients streaming long answers put ~6 requests on the
one replica: status must show the target go to 2 and a second replica serving; when the clients stop, back to 1.
No request fails on the way, the drained replica's included.
"""

from __future__ import annotations

import json
import threading

import openai

from tests.conftest import demo_engine_args, run_cli, wait_for, write_config

PORT = 19181


def status_json(conf) -> dict:
    result = run_cli(conf, "action=status", "output=json", timeout=120)
    assert result.returncode == 0, result.output
    return json.loads(result.stdout[result.stdout.index("{") :])


def scale(conf) -> tuple[int, int]:
    """(Serve's target replicas, replicas serving) of the node."""
    report = status_json(conf)
    target = report["deployments"]["demo"]["scaling"]["target_replicas"]
    return target, sum(1 for r in report["replicas"] if r["serve_id"] == "demo" and r["state"] == "READY")


def test_engine_node_scales_up_under_load_and_down_when_idle(tmp_path):
    node = {
        "serve_id": "demo",
        "engine": "vllm",
        "engine_args": demo_engine_args(served_model_name="demo"),
        "resources": {
            "num_cpus": 1,
            "min_replicas": 1,
            "max_replicas": 2,
            "target_ongoing_requests": 2,
            "upscale_delay_s": 2,
            "downscale_delay_s": 10,
        },
    }
    conf = write_config(tmp_path / "conf", [node], tmp_path / "exp", PORT)
    started = run_cli(conf, timeout=900)
    try:
        assert started.returncode == 0, started.output
        assert wait_for(lambda: scale(conf) == (1, 1) and scale(conf), 60, "one replica at rest") == (1, 1)

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
