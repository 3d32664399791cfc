"""End to end on one host: real Ray, real vLLM (CPU) engines, real HTTP, the official OpenAI SDK.

One deployment with two models (alpha with two replicas); the run is shared by the tests of this module,
in order: serve -> completions and streamed chat from each model -> load spreads over alpha's replicas ->
a killed engine is replaced -> status -> `action=logs` (every replica's log, narrowed, followed) -> keys ->
metrics -> bench action -> run twice changes nothing -> stop (a follower ends by itself; the logs stay) ->
nothing left.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import struct
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import psutil
import pytest

from flagscale.cluster.processes import session_members
from flagscale.router.keyring import engine_key_if_made
from tests.conftest import (
    STATUS_WAIT_S,
    demo_engine_args,
    run_cli,
    status_cli,
    streamed_chat_chunks,
    wait_for,
    write_config,
)
from tests.e2e.log_follow import Follow, header, sections

PORT = 18411
MODELS = ("alpha", "beta")
REPLICAS = {"alpha": 2, "beta": 1}
KEY_ENV, API_KEY = "FS_E2E_API_KEY", "e2e-secret-key-0123"  # deploy.api_key_env: the key stays out of the YAML
ENV_SECRET = f"hf_{secrets.token_hex(12)}"  # experiment.envs.HF_TOKEN: a secret env value


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    root = tmp_path_factory.mktemp("two-models")
    exp_dir = root / "exp"
    nodes = [
        {
            "serve_id": name,
            "engine": "vllm",
            "engine_args": demo_engine_args(served_model_name=name),
            "resources": {"num_replicas": REPLICAS[name], "num_cpus": 1},
        }
        for name in MODELS
    ]
    deploy = {"host": "127.0.0.1", "port": PORT, "startup_timeout_s": 600, "api_key_env": KEY_ENV}
    conf = write_config(
        root / "conf",
        nodes,
        exp_dir,
        PORT,
        experiment={
            "runner": {"hostfile": None, "deploy": deploy},
            "envs": {"HF_TOKEN": ENV_SECRET},
        },
    )
    os.environ[KEY_ENV] = API_KEY  # run_cli passes this process's environment on
    result = run_cli(conf, timeout=900)
    state_path = exp_dir / "state.json"
    sessions = [h["session"] for h in json.loads(state_path.read_text())["hosts"]] if state_path.exists() else []
    yield {"conf": conf, "exp_dir": exp_dir, "run": result, "sessions": sessions}
    if state_path.exists():  # a test failed before the stop test ran
        run_cli(conf, "action=stop", timeout=300)


@pytest.fixture(scope="module")
def client(deployment):
    assert deployment["run"].returncode == 0, deployment["run"].output
    return openai.OpenAI(base_url=f"http://127.0.0.1:{PORT}/v1", api_key=API_KEY, timeout=120)


def test_run_prints_endpoint_and_models(deployment):
    out = deployment["run"].output
    assert deployment["run"].returncode == 0, out
    assert f"http://127.0.0.1:{PORT}/v1" in out
    assert "alpha, beta" in out
    assert (deployment["exp_dir"] / "serve_logs" / "runner.log").exists()


def test_models_lists_both(client):
    assert sorted(m.id for m in client.models.list().data) == sorted(MODELS)


@pytest.mark.parametrize("model", MODELS)
def test_completion(client, model):
    completion = client.completions.create(model=model, prompt="hello world", max_tokens=8)
    assert completion.model == model
    assert completion.usage.completion_tokens == 8
    assert completion.choices[0].text


@pytest.mark.parametrize("model", MODELS)
def test_streamed_chat_arrives_in_several_chunks(client, model):
    chunks = streamed_chat_chunks(client, model)
    assert len(chunks) >= 3
    assert all(c.model == model for c in chunks)


def test_unknown_model_is_a_404_naming_the_models(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gamma", prompt="x", max_tokens=2)
    assert "alpha" in str(info.value) and "beta" in str(info.value)


def status_json(deployment, require_healthy=True) -> dict:
    result = status_cli(deployment["conf"], "output=json")
    assert result.returncode == 0 or not require_healthy, result.output
    return json.loads(result.stdout[result.stdout.index("{") :])


def test_load_spreads_evenly_over_replicas(deployment, client):
    def alpha_counts() -> dict[str, int] | None:  # once the router counts both of alpha's replicas
        replicas = status_json(deployment)["replicas"]
        known = [r for r in replicas if r["serve_id"] == "alpha" and r["requests_served"] is not None]
        return {r["replica_id"]: r["requests_served"] or 0 for r in replicas} if len(known) == 2 else None

    before = wait_for(alpha_counts, STATUS_WAIT_S, "the router to list both of alpha's replicas")

    def complete(i):
        return client.completions.create(model="alpha", prompt=f"request {i}", max_tokens=4)

    with ThreadPoolExecutor(8) as pool:
        assert all(c.usage.completion_tokens == 4 for c in pool.map(complete, range(60)))

    def alpha_counts_since() -> list[int]:  # once the router's totals include all 60 requests
        after = [r for r in status_json(deployment)["replicas"] if r["serve_id"] == "alpha"]
        counts = [r["requests_served"] - before.get(r["replica_id"], 0) for r in after]
        assert len(counts) == 2 and sum(counts) == 60, counts
        return counts

    counts = wait_for(alpha_counts_since, STATUS_WAIT_S, "the router's counts of alpha's 60 requests", interval=1)
    # Each replica takes a fair part. Not an equal one: the policy weighs the requests in flight, and on a busy
    # 2-core machine one replica can run slower and rightly get fewer (24 and 36 on CI, 2026-11-28).
    assert min(counts) >= 60 / 4, counts


def test_killed_engine_fails_over_and_is_replaced(deployment, client):
    def alpha_engines() -> list[dict]:
        alpha = [r for r in status_json(deployment)["replicas"] if r["serve_id"] == "alpha"]
        assert len(alpha) == 2 and all(r["engine_pid"] for r in alpha), alpha
        return alpha

    victim = wait_for(alpha_engines, STATUS_WAIT_S, "alpha's two replicas and their engine PIDs in status", interval=2)[
        0
    ]
    os.kill(victim["engine_pid"], signal.SIGKILL)  # the wrapper exits too: the server is gone
    for i in range(10):  # no request fails: the router moves on to the other replica
        assert client.completions.create(model="alpha", prompt=f"after kill {i}", max_tokens=2).usage

    def alpha_replaced() -> bool:
        report = status_json(deployment, require_healthy=False)
        ready = [r for r in report["replicas"] if r["serve_id"] == "alpha" and r["state"] == "READY"]
        replaced = victim["replica_id"] not in {r["replica_id"] for r in ready}
        assert report["healthy"] and len(ready) == 2 and replaced, f"alpha was not back to 2 healthy replicas: {report}"
        return True

    wait_for(alpha_replaced, 300, "alpha back to 2 healthy replicas, the killed one replaced", interval=5)


def test_status_is_healthy(deployment, client):
    result = status_cli(deployment["conf"], "output=json")
    assert result.returncode == 0, result.output
    report = json.loads(result.stdout[result.stdout.index("{") :])
    assert report["healthy"] and report["status"] == "RUNNING"
    assert {d for d in report["deployments"]} == {"alpha", "beta", "router"}
    assert sorted(r["serve_id"] for r in report["replicas"]) == ["alpha", "alpha", "beta"]
    assert {r["engine_kind"] for r in report["replicas"]} == {"vllm"}
    table = status_cli(deployment["conf"], columns=80)  # an 80-column terminal
    assert table.returncode == 0 and "HEALTHY" in table.stdout and "alpha" in table.stdout
    assert max(len(line) for line in table.stdout.splitlines()) <= 80 and "…" not in table.stdout, table.stdout
    replica_ids = [r["replica_id"] for r in report["replicas"]]
    assert all(replica_id in table.stdout for replica_id in replica_ids), table.stdout


def test_logs_show_every_replica_narrowed_down_and_followed(deployment, client):
    """action=logs: the runner's log and each replica's under a header naming serve_id, replica, host and path,
    with vLLM's own start-up lines; serve_id= and replica= narrow it down, unknown ones are refused with the valid
    ones listed; follow=true prints a request's line as vLLM writes it and ends on Ctrl-C."""
    conf, exp_dir = deployment["conf"], deployment["exp_dir"]
    replicas = status_json(deployment)["replicas"]
    alpha = [r for r in replicas if r["serve_id"] == "alpha"]
    (beta,) = [r for r in replicas if r["serve_id"] == "beta"]

    shown = run_cli(conf, "action=logs", "lines=1000", timeout=120)
    assert shown.returncode == 0, shown.output
    logs = sections(shown.stdout)
    assert f"==> runner log (localhost): {exp_dir}/serve_logs/runner.log <==" in logs, list(logs)
    for r in replicas:
        assert header(r) in logs, list(logs)
        assert f"Starting vLLM server on {r['url']}" in logs[header(r)]

    shown = run_cli(conf, "action=logs", "serve_id=beta", timeout=120)  # the default: the last 50 lines of each
    assert shown.returncode == 0, shown.output
    assert list(sections(shown.stdout)) == [header(beta)]
    assert len(sections(shown.stdout)[header(beta)].splitlines()) == 50
    shown = run_cli(conf, "action=logs", f"replica={alpha[0]['replica_id'][:5]}", "lines=5", timeout=120)
    assert shown.returncode == 0, shown.output
    assert list(sections(shown.stdout)) == [header(alpha[0])]

    refused = run_cli(conf, "action=logs", "serve_id=nope", timeout=120)
    assert refused.returncode != 0
    assert "no engine replica of serve_id 'nope'" in refused.stderr and "alpha, beta" in refused.stderr
    refused = run_cli(conf, "action=logs", "replica=zzzzzzzzz", timeout=120)
    assert refused.returncode != 0
    assert all(f"{r['serve_id']}/{r['replica_id']}" in refused.stderr for r in replicas), refused.stderr

    followers = [Follow(conf, "serve_id=alpha", "lines=1"), Follow(conf, "serve_id=beta", "lines=1")]
    try:
        wait_for(lambda: all(f.started for f in followers), 120, "both followers to start")
        assert client.completions.create(model="beta", prompt="followed", max_tokens=4).usage
        wait_for(lambda: '"POST /v1/completions HTTP/1.1" 200' in followers[1].stdout, 60, "the request's line")
        assert not any(header(r) in followers[1].stdout for r in alpha)
        for follower in followers:
            assert follower.interrupt() == 0, follower.stderr
    finally:
        for follower in followers:
            follower.kill()


def http_status(url: str, key: str | None = None, body: dict | None = None) -> int:
    data = json.dumps(body).encode() if body is not None else None
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data, headers), timeout=60) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_api_key_is_required_at_the_endpoint_and_at_each_engine(deployment, client):
    """The clients' key at the endpoint; the deployment's engine key, never the clients', at each engine."""
    engine_url = next(r["url"] for r in status_json(deployment)["replicas"] if r["serve_id"] == "alpha")
    request = {"model": "alpha", "prompt": "hi", "max_tokens": 2}
    engine_key = engine_key_if_made(deployment["exp_dir"])
    for base, key, other in ((f"http://127.0.0.1:{PORT}", API_KEY, engine_key), (engine_url, engine_key, API_KEY)):
        assert http_status(f"{base}/v1/completions", body=request) == 401, base
        assert http_status(f"{base}/v1/completions", "wrong", body=request) == 401, base
        assert http_status(f"{base}/v1/completions", other, body=request) == 401, base
        assert http_status(f"{base}/v1/completions", key, body=request) == 200, base
        assert http_status(f"{base}/health") == 200, base
    assert API_KEY not in (deployment["exp_dir"] / "state.json").read_text()
    assert API_KEY not in status_cli(deployment["conf"], "output=json").output


def test_every_engine_path_but_health_needs_the_key(deployment, client):
    """vLLM's own key check guards only /v1, /v2, /inference and /cohere; the replica's middleware
    (engines/vllm_auth.py) guards the rest, such as /invocations, which runs completions."""

    def all_engines_read() -> list[dict]:
        replicas = status_json(deployment)["replicas"]
        assert len(replicas) == 3 and all(r["engine"] for r in replicas), replicas
        return replicas

    replicas = wait_for(
        all_engines_read, STATUS_WAIT_S, "status to read every engine's load (its /metrics, with the key)"
    )
    for replica in replicas:
        model, base = replica["serve_id"], replica["url"]
        requests = {
            "/invocations": {"model": model, "prompt": "hi", "max_tokens": 2},
            "/tokenize": {"model": model, "prompt": "hi"},
            "/v1/completions": {"model": model, "prompt": "hi", "max_tokens": 2},
            "/metrics": None,
            "/v1/models": None,
        }
        for path, body in requests.items():
            assert http_status(base + path, body=body) == 401, (base, path)
            assert http_status(base + path, "wrong", body=body) == 401, (base, path)
            assert http_status(base + path, engine_key_if_made(deployment["exp_dir"]), body=body) == 200, (base, path)
        assert http_status(f"{base}/health") == 200, base


def test_metrics_show_every_engine_replica_and_the_router(deployment, client):
    from prometheus_client.parser import text_string_to_metric_families

    def every_replica() -> dict:
        scrape = urllib.request.Request(
            f"http://127.0.0.1:{PORT}/metrics", headers={"Authorization": f"Bearer {API_KEY}"}
        )
        with urllib.request.urlopen(scrape, timeout=30) as resp:
            families = {f.name: f for f in text_string_to_metric_families(resp.read().decode())}
        replicas = {(s.labels["serve_id"], s.labels["replica"]) for s in families["vllm:num_requests_running"].samples}
        assert sorted(serve_id for serve_id, _ in replicas) == ["alpha", "alpha", "beta"], replicas
        return families

    families = wait_for(every_replica, 60, "/metrics to carry all three engine replicas' series")
    served = [s for s in families["flagscale_router_requests"].samples if s.name.endswith("_total")]
    assert {s.labels["model"] for s in served if s.labels["status"] == "200"} == {"alpha", "beta"}
    assert "flagscale_router_time_to_first_byte_seconds" in families
    assert {s.labels["role"] for s in families["vllm:num_requests_running"].samples} == {"colocated"}


def test_bench_action_writes_json_and_png(deployment, client):
    result = run_cli(
        deployment["conf"],
        "action=bench",
        "experiment.bench.num_prompts=6",
        "experiment.bench.input_len=16",
        "experiment.bench.output_len=8",
        "experiment.bench.concurrency=[1,3]",
        "experiment.bench.model=beta",
        "experiment.bench.slo_ttft_ms=5000",
        timeout=600,
    )
    assert result.returncode == 0, result.output
    reports = sorted((deployment["exp_dir"] / "bench").glob("bench-*.json"))
    assert reports
    report = json.loads(reports[-1].read_text())
    assert report["model"] == "beta"
    assert [row["concurrency"] for row in report["rows"]] == [1, 3]
    for row in report["rows"]:
        assert row["completed"] == 6 and row["failed"] == 0 and row["output_tok_s"] > 0
        assert {"p50", "p90", "p99", "mean"} <= set(row["ttft_ms"]) and row["tpot_ms"]["p50"] > 0
        assert row["goodput_req_s"] is not None
    png = reports[-1].with_suffix(".png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", png[16:24])
    assert width > 100 and height > 100


def test_second_run_with_the_same_config_changes_nothing(deployment, client):
    state_before = (deployment["exp_dir"] / "state.json").read_text()
    result = run_cli(deployment["conf"], timeout=300)
    assert result.returncode == 0 and "nothing to change" in result.output, result.output
    assert sorted(m.id for m in client.models.list().data) == sorted(MODELS)
    assert (deployment["exp_dir"] / "state.json").read_text() == state_before  # nothing started or redeployed


def test_no_secret_in_any_file_under_exp_dir_nor_in_any_command_line(deployment, client):
    """Neither the API key nor an env value is in a file under exp_dir (state file, Hydra's output, every log,
    Ray's session logs through serve_logs/ray) or in any process's argv (issue 19)."""
    shown = run_cli(deployment["conf"], "action=dryrun", timeout=300)  # prints the resolved config
    assert shown.returncode == 0 and "HF_TOKEN: '***'" in shown.stdout, shown.output
    found = [f"dryrun output: {s}" for s in (API_KEY, ENV_SECRET) if s in shown.output]
    for root, _, files in os.walk(deployment["exp_dir"], followlinks=True):
        for name in files:
            path = os.path.join(root, name)
            if os.path.isfile(path):  # not Ray's sockets
                data = open(path, "rb").read()
                found += [f"{path}: {s}" for s in (API_KEY, ENV_SECRET) if s.encode() in data]
    for proc in psutil.process_iter(["pid", "cmdline"]):
        argv = " ".join(proc.info["cmdline"] or [])
        found += [f"pid {proc.info['pid']} argv: {s}" for s in (API_KEY, ENV_SECRET) if s in argv]
    assert not found, found


def test_stop_leaves_nothing_but_the_logs(deployment, client):
    assert deployment["sessions"]
    members_before = [p for s in deployment["sessions"] for p in session_members(s)]
    assert members_before, "the run's Ray processes should be alive before stop"
    (beta,) = [r for r in status_json(deployment)["replicas"] if r["serve_id"] == "beta"]
    follower = Follow(deployment["conf"], "serve_id=beta", "lines=1")
    try:
        wait_for(lambda: follower.started, 120, "the follower to start")
        result = run_cli(deployment["conf"], "action=stop", timeout=300)
        assert result.returncode == 0, result.output
        assert follower.wait(timeout=60) == 0, follower.stderr  # it saw the deployment go, and ended by itself
        assert "is stopped; no more lines will come" in follower.stderr
    finally:
        follower.kill()
    assert not [p for s in deployment["sessions"] for p in session_members(s)]
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", PORT), timeout=2).close()
    with socket.socket() as sock:  # a new server could take the port (TIME_WAIT allowed, as servers do)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", PORT))
    assert not (deployment["exp_dir"] / "state.json").exists()
    again = run_cli(deployment["conf"], "action=stop", timeout=120)
    assert again.returncode == 0 and "nothing is running" in again.output
    status = status_cli(deployment["conf"])
    assert status.returncode != 0 and "nothing is running" in status.output

    # stopped: the logs are still there, found from the log dir
    shown = run_cli(deployment["conf"], "action=logs", "serve_id=beta", "lines=1000", timeout=120)
    assert shown.returncode == 0, shown.output
    (text,) = sections(shown.stdout).values()
    assert f"Starting vLLM server on {beta['url']}" in text and '"POST /v1/completions HTTP/1.1" 200' in text
    assert f"replica {beta['replica_id']}, host localhost: {beta['log']}" in shown.stdout
