"""Deployment graphs end to end: the shipped examples (examples/graph) on real Ray Serve, real HTTP.

1. The diamond A -> B, A -> C, (B, C) -> D of deterministic string nodes: exact response, B and C overlap,
   a sync forward does not block its replica, autoscaling settings read back from Serve, status, stop, and
   cmds.after_stop run by that stop.
2. rewrite -> generate (calls a real vLLM engine node on the demo model) -> post-process.
Plus dryrun's picture and a validation error through the real CLI (nothing started), and a custom node whose
module file is edited while it runs: `run` again redeploys it with the new code.
"""

from __future__ import annotations

import json
import os
import struct
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.conftest import REPO, run_cli, status_cli, wait_for, write_config

EXAMPLE_CONF = REPO / "examples" / "graph" / "conf"
GRAPH_PORT = 18700
PIPELINE_PORT = 18701
# The pipeline runs with an API key: its custom node's calls to the engine node must carry it.
PIPELINE_KEY_ENV, PIPELINE_KEY = "FS_E2E_GRAPH_KEY", "graph-e2e-key-0123"  # keys are >= 16 characters


def post(port: int, path: str, body: dict, timeout: float = 120, key: str | None = None) -> tuple[int, dict]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            return resp.status, json.load(resp)
    except urllib.error.HTTPError as exc:
        return exc.code, json.load(exc)


def overlap(a: dict, b: dict) -> bool:
    return a["start"] < b["end"] and b["start"] < a["end"]


def example_overrides(exp_dir, port: int) -> list[str]:
    return [f"experiment.exp_dir={exp_dir}", f"experiment.runner.deploy.port={port}"]


def test_dryrun_prints_the_graph_and_writes_a_png(tmp_path):
    result = run_cli(EXAMPLE_CONF, *example_overrides(tmp_path, GRAPH_PORT), "action=dryrun", timeout=300)
    assert result.returncode == 0, result.output
    assert "POST http://127.0.0.1:18700/generate  {prompt: str, times: int}" in result.stdout
    assert "B, C -> D" in result.stdout and "D -> response" in result.stdout
    png = (tmp_path / "graph.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", png[16:24])[0] > 100


def test_cli_rejects_a_cycle_before_starting_anything(tmp_path):
    nodes_py = str(REPO / "examples" / "graph" / "nodes.py")
    nodes = [
        {"serve_id": "A", "module": nodes_py, "name": "Normalize"},
        {"serve_id": "B", "module": nodes_py, "name": "Shout", "depends": ["A", "C"]},
        {"serve_id": "C", "module": nodes_py, "name": "Reverse", "depends": ["B"]},
    ]
    deploy = {
        "host": "127.0.0.1",
        "port": GRAPH_PORT + 50,
        "name": "/generate",
        "request": {"args": ["prompt", "times"], "types": ["str", "int"]},
    }
    conf = write_config(
        tmp_path / "conf",
        nodes,
        tmp_path / "exp",
        GRAPH_PORT + 50,
        experiment={"runner": {"hostfile": None, "deploy": deploy}},
    )
    result = run_cli(conf, timeout=300)
    assert result.returncode == 2, result.output
    assert "dependency cycle: B -> C -> B" in result.output and "nodes.yaml" in result.output
    assert not (tmp_path / "exp" / "state.json").exists()


@pytest.fixture(scope="module")
def diamond(tmp_path_factory):
    exp_dir = tmp_path_factory.mktemp("graph") / "exp"
    marker = exp_dir.parent / "after_stop_ran"  # written by cmds.after_stop, with a value from experiment.envs
    overrides = [
        *example_overrides(exp_dir, GRAPH_PORT),
        "+experiment.envs.AFTER_STOP_WORD=done",
        f"+experiment.cmds.after_stop='echo \"$AFTER_STOP_WORD\" > {marker}'",
    ]
    result = run_cli(EXAMPLE_CONF, *overrides, timeout=600)
    yield {"run": result, "exp_dir": exp_dir, "overrides": overrides, "after_stop_marker": marker}
    if (exp_dir / "state.json").exists():
        run_cli(EXAMPLE_CONF, *overrides, "action=stop", timeout=300)


@pytest.fixture(scope="module")
def diamond_up(diamond):
    assert diamond["run"].returncode == 0, diamond["run"].output
    return diamond


def test_diamond_response_is_exact(diamond_up):
    status, body = post(GRAPH_PORT, "/generate", {"prompt": "  Hello   World ", "times": 2})
    assert status == 200, body
    assert body == {"shouted": "HELLO WORLD HELLO WORLD", "reversed": "dlrow olleh dlrow olleh"}


def test_b_and_c_run_concurrently_after_a(diamond_up):
    status, body = post(GRAPH_PORT, "/generate?trace=1", {"prompt": "abc", "times": 1})
    assert status == 200 and body["result"] == {"shouted": "ABC", "reversed": "cba"}
    trace = {t["node"]: t for t in body["trace"]}
    assert set(trace) == {"A", "B", "C", "D"}
    assert overlap(trace["B"], trace["C"]), trace
    assert trace["A"]["end"] <= min(trace["B"]["start"], trace["C"]["start"])
    assert max(trace["B"]["end"], trace["C"]["end"]) <= trace["D"]["start"]


def test_sync_forward_does_not_block_its_replica(diamond_up):
    # B's forward is a plain function that sleeps; two requests on its one replica must still overlap.
    with ThreadPoolExecutor(2) as pool:
        replies = list(
            pool.map(lambda i: post(GRAPH_PORT, "/generate?trace=1", {"prompt": f"r{i}", "times": 1}), range(2))
        )
    b_runs = [next(t for t in body["trace"] if t["node"] == "B") for status, body in replies if status == 200]
    assert len(b_runs) == 2
    assert b_runs[0]["replica"] == b_runs[1]["replica"]
    assert overlap(*b_runs), b_runs


def test_bad_requests_are_400_naming_the_field(diamond_up):
    status, body = post(GRAPH_PORT, "/generate", {"prompt": "x", "times": "two"})
    assert status == 400 and "'times' must be int" in body["error"]["message"]
    status, body = post(GRAPH_PORT, "/generate", {"prompt": "x"})
    assert status == 400 and "missing required request field(s) ['times']" in body["error"]["message"]


def test_status_shows_every_node_and_autoscaling_from_serve(diamond_up):
    result = status_cli(EXAMPLE_CONF, *diamond_up["overrides"], "output=json")
    assert result.returncode == 0, result.output
    report = json.loads(result.stdout[result.stdout.index("{") :])
    deployments = report["deployments"]
    assert set(deployments) == {"A", "B", "C", "D", "graph", "router"}
    assert all(d["status"] == "HEALTHY" and d["replicas"] == {"RUNNING": 1} for d in deployments.values())
    autoscaling = deployments["B"]["scaling"]["autoscaling"]  # as Serve's controller applies it
    assert (autoscaling["min_replicas"], autoscaling["max_replicas"], autoscaling["target_ongoing_requests"]) == (
        1,
        2,
        2,
    )
    assert (autoscaling["upscale_delay_s"], autoscaling["downscale_delay_s"]) == (3, 60)
    assert deployments["C"]["scaling"] == {"target_replicas": 1, "num_replicas": 1, "autoscaling": None}
    table = status_cli(EXAMPLE_CONF, *diamond_up["overrides"])
    assert "autoscale 1..2" in table.stdout


def test_stop_diamond(diamond_up):
    marker = diamond_up["after_stop_marker"]
    assert not marker.exists()
    result = run_cli(EXAMPLE_CONF, *diamond_up["overrides"], "action=stop", timeout=300)
    assert result.returncode == 0, result.output
    assert not (diamond_up["exp_dir"] / "state.json").exists()
    # cmds.after_stop ran (synchronously, before stop returned) with the run's envs; its log names the host.
    assert marker.read_text() == "done\n"
    assert "=== localhost" in (diamond_up["exp_dir"] / "serve_logs" / "after_stop.log").read_text()


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory, demo_model_path):
    exp_dir = tmp_path_factory.mktemp("pipeline") / "exp"
    overrides = [
        *example_overrides(exp_dir, PIPELINE_PORT),
        f"+experiment.runner.deploy.api_key_env={PIPELINE_KEY_ENV}",
    ]
    os.environ[PIPELINE_KEY_ENV] = PIPELINE_KEY  # run_cli passes this process's environment on
    result = run_cli(EXAMPLE_CONF, *overrides, timeout=900, name="pipeline")
    yield {"run": result, "exp_dir": exp_dir, "overrides": overrides}
    if (exp_dir / "state.json").exists():
        run_cli(EXAMPLE_CONF, *overrides, "action=stop", timeout=300, name="pipeline")


def test_pipeline_returns_generated_text_through_custom_nodes(pipeline):
    assert pipeline["run"].returncode == 0, pipeline["run"].output
    request = {"prompt": "  what is a graph? ", "max_tokens": 8}
    status, body = post(PIPELINE_PORT, "/generate", request, timeout=300, key=PIPELINE_KEY)
    assert status == 200, body  # the generate node called the engine node with the deployment's key
    assert body["prompt"] == "Question: what is a graph?\nAnswer:"
    assert isinstance(body["text"], str) and body["text"] and body["chars"] == len(body["text"])
    assert post(PIPELINE_PORT, "/generate", request)[0] == 401
    # max_tokens is optional in the list-form request: its default (16) fills in.
    status, body = post(PIPELINE_PORT, "/generate", {"prompt": "what is a node?"}, timeout=300, key=PIPELINE_KEY)
    assert status == 200, body
    assert body["prompt"] == "Question: what is a node?\nAnswer:" and body["text"]
    status, body = post(PIPELINE_PORT, "/generate", {"max_tokens": 4}, timeout=300, key=PIPELINE_KEY)
    assert status == 400 and "missing required request field(s) ['prompt']" in body["error"]["message"]
    # The engine node keeps its OpenAI route on the same port.
    completion_request = {"model": "demo", "prompt": "hi", "max_tokens": 4}
    status, completion = post(PIPELINE_PORT, "/v1/completions", completion_request, key=PIPELINE_KEY)
    assert status == 200 and completion["usage"]["completion_tokens"] == 4
    # The key reached the custom nodes in their init args: not in Serve's view of the app, nor in any log.
    serve_view = status_cli(EXAMPLE_CONF, *pipeline["overrides"], "output=json", name="pipeline")
    assert serve_view.returncode == 0 and PIPELINE_KEY not in serve_view.output, serve_view.output
    serve_logs = pipeline["exp_dir"] / "serve_logs"
    logs = [p for d in (serve_logs, (serve_logs / "ray").resolve()) for p in d.rglob("*") if p.is_file()]
    assert logs and not [p for p in logs if PIPELINE_KEY in p.read_text(errors="replace")]


def call(port: int, method: str, path: str, body: dict | None = None, key: str | None = None) -> int:
    """The status of one request to the endpoint."""
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        data=None if body is None else json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})},
        method=method,
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as resp:
            resp.read()
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_pipeline_endpoint_is_an_allowlist_that_one_client_cannot_knock_out(pipeline):
    """Issue 34: only GET /health skips the key (POST /health needs it, then 405); vLLM's management paths are 404
    at the router, with the key too; a dozen wrong requests (vLLM's 400s) leave the engine in rotation; the router
    processes' peer secret is a 0600 file in the exp_dir, in no status output or log."""
    assert pipeline["run"].returncode == 0, pipeline["run"].output
    assert call(PIPELINE_PORT, "GET", "/health") == 200
    assert call(PIPELINE_PORT, "POST", "/health", {}) == 401
    assert call(PIPELINE_PORT, "POST", "/health", {}, key=PIPELINE_KEY) == 405
    for method, path in (("GET", "/load"), ("POST", "/scale_elastic_ep"), ("GET", "/kv_event_sources")):
        body = {"new_data_parallel_size": 2} if method == "POST" else None
        assert call(PIPELINE_PORT, method, path, body, key=PIPELINE_KEY) == 404, path
    assert call(PIPELINE_PORT, "GET", "/version", key=PIPELINE_KEY) == 200  # a public path
    wrong = {"model": "demo", "prompt": "hi", "max_tokens": -1}
    assert [call(PIPELINE_PORT, "POST", "/v1/completions", wrong, key=PIPELINE_KEY) for _ in range(12)] == [400] * 12
    good = {"model": "demo", "prompt": "hi", "max_tokens": 2, "vllm_xargs": {"kv_transfer_params": "x"}}
    assert [call(PIPELINE_PORT, "POST", "/v1/completions", good, key=PIPELINE_KEY) for _ in range(5)] == [200] * 5
    secret_file = pipeline["exp_dir"] / "router_peers.secret"
    assert secret_file.stat().st_mode & 0o777 == 0o600
    secret = secret_file.read_text().strip()
    serve_view = status_cli(EXAMPLE_CONF, *pipeline["overrides"], "output=json", name="pipeline")
    assert serve_view.returncode == 0 and secret not in serve_view.output
    state = (pipeline["exp_dir"] / "state.json").read_text()
    serve_logs = pipeline["exp_dir"] / "serve_logs"
    logs = [p for d in (serve_logs, (serve_logs / "ray").resolve()) for p in d.rglob("*") if p.is_file()]
    assert secret not in state and not [p for p in logs if secret in p.read_text(errors="replace")]


def test_stop_pipeline(pipeline):
    result = run_cli(EXAMPLE_CONF, *pipeline["overrides"], "action=stop", timeout=300, name="pipeline")
    assert result.returncode == 0, result.output


def test_run_again_after_editing_a_node_redeploys_it_with_the_new_code(tmp_path):
    port = GRAPH_PORT + 60
    module = tmp_path / "greeter.py"
    code = "class Greet:\n    def forward(self, prompt):\n        return {{'text': '{greeting} ' + prompt}}\n"
    module.write_text(code.format(greeting="hello"))
    deploy = {"host": "127.0.0.1", "port": port, "name": "/greet", "request": {"args": ["prompt"], "types": ["str"]}}
    nodes = [{"serve_id": "greet", "module": str(module), "name": "Greet"}]
    conf = write_config(tmp_path / "conf", nodes, tmp_path / "exp", port, experiment={"runner": {"deploy": deploy}})
    try:
        started = run_cli(conf, timeout=600)
        assert started.returncode == 0, started.output
        assert post(port, "/greet", {"prompt": "you"}) == (200, {"text": "hello you"})

        module.write_text(code.format(greeting="goodbye"))
        updated = run_cli(conf, timeout=600)
        assert updated.returncode == 0, updated.output
        assert "serve.greet.module_digest" in updated.output, updated.output
        wait_for(
            lambda: post(port, "/greet", {"prompt": "you"}) == (200, {"text": "goodbye you"}),
            60,
            "the redeployed node to answer with the edited code",
        )
        again = run_cli(conf, timeout=300)
        assert again.returncode == 0 and "nothing to change" in again.output.lower(), again.output
    finally:
        if (tmp_path / "exp" / "state.json").exists():
            run_cli(conf, "action=stop", timeout=300)
