"""End to end on one host (real Ray, a real vLLM CPU engine, the OpenAI SDK): a node with `resources.slo` and
`min_replicas: 0`, sized by the SLO planner as Serve's autoscaling policy (docs/autoscaling.md).

Shared by the module's tests, in order: the node starts with one replica, idles down to zero after its
downscale delay, and `status` shows the planner's reason; a `run` that changes only the router's part of the
config returns without waiting for a replica of the node at zero; a request at zero is held by the router while
Serve starts a replica, and answered (no 5xx); the router's /metrics counts the planner's changes. (That an idle
node goes back to zero after serving: tests/unit/test_slo_planner.py, on the planner's own clock.)
"""

from __future__ import annotations

import json
import urllib.request

import openai
import pytest
import yaml

from tests.conftest import demo_engine_args, run_cli, status_cli, wait_for, write_config

PORT = 18471
MODEL = "zero"
DOWNSCALE_DELAY_S = 15
SLO = {"ttft_ms": 5000, "itl_ms": 1000, "percentile": 90}
ZERO_WAIT_S = 240  # the delay, the planner's idle forecast decaying (about a minute), a status on a busy machine


def status_json(conf) -> dict:
    result = status_cli(conf, "output=json")
    assert result.returncode == 0, result.output
    return json.loads(result.stdout[result.stdout.index("{") :])


def at_zero(conf) -> dict | None:
    """The status once the node has no replica and its planner's target is zero."""
    report = status_json(conf)
    record = report["planner"].get(MODEL, {})
    live = [r for r in report["replicas"] if r["serve_id"] == MODEL and r["state"] == "READY"]
    return report if not live and record.get("target") == 0 else None


@pytest.fixture(scope="module")
def conf(tmp_path_factory):
    root = tmp_path_factory.mktemp("slo-zero")
    node = {
        "serve_id": MODEL,
        "engine": "vllm",
        "engine_args": demo_engine_args(served_model_name=MODEL),
        "resources": {
            "min_replicas": 0,
            "max_replicas": 1,
            "num_cpus": 1,
            "upscale_delay_s": 0,
            "downscale_delay_s": DOWNSCALE_DELAY_S,
            "slo": SLO,
        },
    }
    return write_config(root / "conf", [node], root / "exp", PORT)


@pytest.fixture(scope="module")
def deployment(conf):
    result = run_cli(conf, timeout=900)
    yield {"conf": conf, "run": result, "url": f"http://127.0.0.1:{PORT}"}
    if (conf.parent / "exp" / "state.json").exists():
        run_cli(conf, "action=stop", timeout=300)


def test_dryrun_says_an_idle_cpu_replica_stops(conf):
    result = run_cli(conf, "action=dryrun", timeout=300)
    assert result.returncode == 0, result.output
    out = " ".join(result.stdout.split())
    assert "autoscale 0..1 (SLO p90 TTFT 5000 ms, ITL 1000 ms)" in out
    assert "idle: stops at zero, starts on the next request (vLLM on CPU cannot sleep)" in out


def test_idles_down_to_zero_and_status_says_why(deployment):
    assert deployment["run"].returncode == 0, deployment["run"].output
    report = wait_for(lambda: at_zero(deployment["conf"]), ZERO_WAIT_S, "the node at zero replicas", interval=5)
    record = report["planner"][MODEL]
    assert record["slo"]["ttft_ms"] == SLO["ttft_ms"] and record["bounds"] == [0, 1]
    assert "idle" in record["last_change"] and record["start_s"] > 0
    table = status_cli(deployment["conf"]).stdout
    assert "SLO planner" in table and "p90 TTFT 5000 ms, ITL 1000 ms" in table


def test_an_update_of_the_router_alone_leaves_a_node_at_zero_there_and_returns(deployment):
    conf = deployment["conf"]
    wait_for(lambda: at_zero(conf), ZERO_WAIT_S, "the node at zero replicas", interval=5)
    nodes_file = conf / "serve" / "nodes.yaml"
    nodes = yaml.safe_load(nodes_file.read_text())
    nodes[0]["routing"] = "round_robin"  # the router's spec only: Serve keeps the engine deployment as it is
    nodes_file.write_text(yaml.safe_dump(nodes, sort_keys=False))
    # before: `run` waited for a replica of the node at zero, which nothing would start (until startup_timeout_s)
    result = run_cli(conf, timeout=300)
    assert result.returncode == 0, result.output
    assert "updating in place" in result.stdout and "serve.zero.routing" in result.stdout
    assert at_zero(conf), "the update started a replica of the node at zero"


def test_first_request_at_zero_is_held_and_served(deployment):
    with urllib.request.urlopen(deployment["url"] + "/health", timeout=10) as health:  # ready: it starts on demand
        assert health.status == 200
    client = openai.OpenAI(base_url=deployment["url"] + "/v1", api_key="none", timeout=600, max_retries=0)
    answer = client.completions.create(model=MODEL, prompt="hello", max_tokens=8)
    assert answer.choices[0].text
    with urllib.request.urlopen(deployment["url"] + "/metrics", timeout=30) as resp:
        metrics = resp.read().decode()
    assert f'flagscale_router_planner_changes_total{{serve_id="{MODEL}"}}' in metrics
    # what the planner sees, from the same record: its wish before the delays, its window's figures
    assert f'flagscale_router_planner_desired_replicas{{serve_id="{MODEL}"}}' in metrics
    assert f'flagscale_router_planner_measured{{serve_id="{MODEL}",signal="arrival_rps"}}' in metrics
