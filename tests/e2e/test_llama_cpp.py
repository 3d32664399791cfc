"""End to end on one host: llama.cpp's own llama-server (built here, `make llama-cpp`) and vLLM behind one endpoint.

The config is FlagScale v1.0-shaped: `experiment.task.backend: llama_cpp` gives the node without `engine` its
engine; the vLLM node says `engine: vllm` (the mixed case). One deployment is shared by the module, in order:
refusals before start (dryrun) -> serve -> both models through the OpenAI SDK (completion, streamed chat) ->
status names each replica's engine kind and reads llama.cpp's load -> the vLLM replica is routed on its engine's
KV events, llama.cpp's on the approximate table (status says which) -> logs show llama-server's own lines -> the
key guards llama-server -> a killed llama-server's requests go to the other replica, which Serve replaces ->
an engine arg change (--parallel) updates in place -> stop leaves no llama-server.
"""

from __future__ import annotations

import json
import os
import signal
import urllib.error
import urllib.request

import openai
import psutil
import pytest
import yaml

from flagscale.demo_model import ensure_demo_model_gguf
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

PORT = 19271
KEY_ENV, API_KEY = "FS_E2E_LLAMA_KEY", "e2e-llama-key-0123"
LLAMA, VLLM = "tiny", "beta"
LLAMA_REPLICAS = 2


def llama_node(max_num_seqs: int, **extra) -> dict:
    return {
        "serve_id": LLAMA,
        "engine_args": {
            "model": "${demo_model_gguf:}",
            "max_model_len": 512,
            "max_num_seqs": max_num_seqs,
            "gpu_memory_utilization": 0.5,  # a vLLM key: ignored by llama.cpp, with a notice
        },
        "engine_args_specific": {"llama_cpp": {"n_gpu_layers": 0, "batch_size": 256}},
        "resources": {"num_replicas": LLAMA_REPLICAS, "num_cpus": 1},
        **extra,
    }


def write_mixed_config(root, max_num_seqs: int, llama_extra: dict | None = None):
    nodes = [
        llama_node(max_num_seqs, **(llama_extra or {})),
        {
            "serve_id": VLLM,
            "engine": "vllm",
            "engine_args": demo_engine_args(served_model_name=VLLM),
            "resources": {"num_replicas": 1, "num_cpus": 1},
        },
    ]
    deploy = {"host": "127.0.0.1", "port": PORT, "startup_timeout_s": 600, "api_key_env": KEY_ENV}
    return write_config(
        root / "conf",
        nodes,
        root / "exp",
        PORT,
        experiment={"task": {"type": "serve", "backend": "llama_cpp"}, "runner": {"hostfile": None, "deploy": deploy}},
    )


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama-cpp")
    conf = write_mixed_config(root, max_num_seqs=2)
    os.environ[KEY_ENV] = API_KEY
    result = run_cli(conf, timeout=900)
    state_path = root / "exp" / "state.json"
    yield {"root": root, "conf": conf, "exp_dir": root / "exp", "run": result, "llama_pids": set()}
    if state_path.exists():  # a test failed before the stop test ran
        run_cli(conf, "action=stop", timeout=300)


@pytest.fixture(scope="module")
def client(deployment):
    assert deployment["run"].returncode == 0, deployment["run"].output
    return openai.OpenAI(base_url=f"http://127.0.0.1:{PORT}/v1", api_key=API_KEY, timeout=120, max_retries=0)


def status_json(deployment, require_healthy=True) -> dict:
    result = status_cli(deployment["conf"], "output=json")
    assert result.returncode == 0 or not require_healthy, result.output
    return json.loads(result.stdout[result.stdout.index("{") :])


def llama_servers(engine_pid: int) -> list[psutil.Process]:
    """The llama-server processes under a replica's engine wrapper."""
    try:
        children = psutil.Process(engine_pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    return [p for p in children if p.name() == "llama-server"]


def record_llama_servers(deployment) -> list[dict]:
    """The llama.cpp replicas in status, each with its llama-server PIDs (kept for the stop test)."""
    replicas = [r for r in status_json(deployment)["replicas"] if r["engine_kind"] == "llama_cpp"]
    assert len(replicas) == LLAMA_REPLICAS and all(r["state"] == "READY" for r in replicas), replicas
    for replica in replicas:
        servers = llama_servers(replica["engine_pid"])
        assert len(servers) == 1, (replica, servers)
        replica["server_pid"] = servers[0].pid
        deployment["llama_pids"].add(servers[0].pid)
    return replicas


def http(url: str, key: str | None = None, body: dict | None = None) -> tuple[int, dict | str]:
    data = json.dumps(body).encode() if body is not None else None
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data, headers), timeout=60) as resp:
            text = resp.read().decode()
            return resp.status, json.loads(text) if text.startswith("{") else text
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_bad_llama_cpp_configs_are_refused_before_start(tmp_path, demo_model_path):
    cases = {
        "not-gguf": ({"engine_args": {"model": str(demo_model_path / "config.json")}}, "is not a GGUF file"),
        "tp": ({"engine_args": {"tensor_parallel_size": 2}}, "tensor_parallel_size: 2"),
        "pd": (
            {"disaggregation": {"prefill": {"resources": {"num_replicas": 1}}, "decode": {"resources": {}}}},
            "cannot move KV caches",
        ),
    }
    for name, (change, expected) in cases.items():
        node = llama_node(2)
        for key, value in change.items():
            node[key] = {**node[key], **value} if key == "engine_args" else value
        conf = write_config(
            tmp_path / name,
            [node],
            tmp_path / f"exp-{name}",
            PORT,
            experiment={"task": {"type": "serve", "backend": "llama_cpp"}},
        )
        result = run_cli(conf, "action=dryrun", timeout=300)
        assert result.returncode == 2 and expected in result.stderr, (name, result.output)
        assert f"serve[0]({LLAMA})" in result.stderr, (name, result.output)
        assert not (tmp_path / f"exp-{name}" / "state.json").exists()


def test_run_serves_both_engines_behind_one_endpoint(deployment, client):
    out = deployment["run"].output
    assert f"http://127.0.0.1:{PORT}/v1" in out
    assert "ignored by llama.cpp: gpu_memory_utilization" in out, out
    assert sorted(m.id for m in client.models.list().data) == sorted([LLAMA, VLLM])


@pytest.mark.parametrize("model", [LLAMA, VLLM])
def test_completion(client, model):
    completion = client.completions.create(
        model=model, prompt="hello world", max_tokens=8, extra_body={"ignore_eos": True}
    )
    assert completion.usage.completion_tokens == 8
    assert completion.choices[0].text


@pytest.mark.parametrize("model", [LLAMA, VLLM])
def test_streamed_chat_arrives_in_several_chunks(client, model):
    chunks = streamed_chat_chunks(client, model)
    assert len(chunks) >= 3, chunks


def test_status_names_each_engine_and_reads_llama_cpp_load(deployment, client):
    def engines_read() -> dict:
        report = status_json(deployment)
        kinds = sorted(r["engine_kind"] for r in report["replicas"])
        assert kinds == ["llama_cpp"] * LLAMA_REPLICAS + ["vllm"], kinds
        llama = [r for r in report["replicas"] if r["engine_kind"] == "llama_cpp"]
        assert all("running" in (r["engine"] or {}) for r in llama), llama  # from llama-server's /metrics, keyed
        return report

    report = wait_for(engines_read, STATUS_WAIT_S, "status to list both engine kinds and read llama.cpp's /metrics")
    assert report["healthy"]
    table = status_cli(deployment["conf"])
    assert table.returncode == 0 and "llama_cpp" in table.stdout, table.stdout
    record_llama_servers(deployment)


def test_vllm_is_routed_on_its_kv_events_and_llama_cpp_on_the_approximate_table(deployment, client):
    prompt = " ".join(["the router keeps what each engine holds in its cache"] * 14)  # ~380 tokens: 2 full blocks
    for model in (LLAMA, VLLM):
        client.completions.create(model=model, prompt=prompt, max_tokens=4, extra_body={"ignore_eos": True})

    def sources_read() -> list[dict]:
        replicas = status_json(deployment)["replicas"]
        vllm = [r for r in replicas if r["engine_kind"] == "vllm"]
        llama = [r for r in replicas if r["engine_kind"] == "llama_cpp"]
        index = (vllm[0].get("router") or {}).get("kv_index") or {}
        assert vllm[0]["kv_events"].startswith("tcp://") and index.get("live") and index.get("blocks", 0) > 0, vllm
        assert all(not r["kv_events"] and "kv_index" not in (r.get("router") or {}) for r in llama), llama
        assert any((r.get("router") or {}).get("prefix_blocks", 0) > 0 for r in llama), llama  # the table in use
        return replicas

    wait_for(sources_read, STATUS_WAIT_S, "the vLLM replica's KV-event index to hold the prompt's blocks")

    def wide_says_which() -> str:
        wide = status_cli(deployment["conf"], "output=wide")
        assert wide.returncode == 0 and "approximate" in wide.stdout and "live" in wide.stdout, wide.stdout
        return wide.stdout

    wait_for(wide_says_which, STATUS_WAIT_S, "status output=wide to say 'approximate' for llama.cpp, 'live' for vLLM")


def test_logs_show_the_llama_server_log(deployment, client):
    result = run_cli(deployment["conf"], "action=logs", f"serve_id={LLAMA}", timeout=120)
    assert result.returncode == 0, result.output
    assert "llama-server --model" in result.stdout and "--metrics" in result.stdout, result.stdout[-3000:]
    assert "listening on http" in result.stdout, result.stdout[-3000:]  # llama-server's own line
    assert API_KEY not in result.stdout


def test_back_to_back_streams_never_meet_a_closed_connection(deployment, client):
    """llama-server closes a connection after each stream although it says Keep-Alive: a router that reused it
    would fail about every second request there and move it to another replica (docs/engines.md)."""
    # the router's totals are published every few seconds: read when they show nothing in flight, and again once
    # they count these 16 streams, so neither read predates what it is compared over
    before = wait_for(lambda: router_totals(deployment, idle=True), STATUS_WAIT_S, "the router's totals, idle")
    for _ in range(16):
        stream = client.completions.create(model=LLAMA, prompt="hi", max_tokens=4, stream=True)
        assert "".join(c.choices[0].text for c in stream if c.choices)
    after = wait_for(
        lambda: router_totals(deployment, served_at_least=served(before) + 16),
        STATUS_WAIT_S,
        "the router's totals to count the 16 streams",
    )
    assert after["moved"] == before["moved"], after


def served(router: dict) -> int:
    return sum(process["served"] for process in router["processes"].values())


def router_totals(deployment, idle: bool = False, served_at_least: int = 0) -> dict | None:
    router = status_json(deployment).get("router") or {}
    if not router or (idle and router.get("inflight")) or served(router) < served_at_least:
        return None
    return router


def test_api_key_guards_llama_server(deployment, client):
    (replica, *_) = record_llama_servers(deployment)
    base = replica["url"]
    request = {"model": LLAMA, "prompt": "hi", "max_tokens": 2}
    key = engine_key_if_made(deployment["exp_dir"])  # the deployment's engine key; the clients' is refused there
    assert http(f"{base}/v1/completions", body=request)[0] == 401
    assert http(f"{base}/v1/completions", "wrong", body=request)[0] == 401
    assert http(f"{base}/v1/completions", API_KEY, body=request)[0] == 401
    assert http(f"{base}/v1/completions", key, body=request)[0] == 200
    for path in ("/metrics", "/v1/models", "/props"):
        assert http(base + path)[0] == 401, path
        assert http(base + path, key)[0] == 200, path
    assert http(f"{base}/health")[0] == 200
    for pid in deployment["llama_pids"]:
        assert API_KEY not in " ".join(psutil.Process(pid).cmdline())


def test_killed_llama_server_fails_over_and_is_replaced(deployment, client):
    victim, survivor = record_llama_servers(deployment)
    os.kill(victim["server_pid"], signal.SIGKILL)
    for i in range(10):  # no request fails: the router moves on before the first byte
        completion = client.completions.create(model=LLAMA, prompt=f"after kill {i}", max_tokens=2)
        assert completion.usage.completion_tokens >= 1

    def replaced() -> list[dict]:
        replicas = record_llama_servers(deployment)
        assert victim["replica_id"] not in {r["replica_id"] for r in replicas}, replicas
        return replicas

    wait_for(replaced, 300, "llama.cpp back to 2 ready replicas, the killed one replaced", interval=3)


def test_changing_parallel_updates_in_place(deployment, client):
    before = {r["replica_id"] for r in record_llama_servers(deployment)}
    write_mixed_config(deployment["root"], max_num_seqs=3)
    updated = run_cli(deployment["conf"], timeout=900)
    assert updated.returncode == 0 and "updated" in updated.stdout, updated.output

    def three_slots_everywhere() -> list[dict]:
        replicas = record_llama_servers(deployment)
        assert not before & {r["replica_id"] for r in replicas}, replicas
        for replica in replicas:
            code, props = http(f"{replica['url']}/props", engine_key_if_made(deployment["exp_dir"]))
            assert code == 200 and props["total_slots"] == 3, props
        return replicas

    wait_for(three_slots_everywhere, 300, "both llama.cpp replicas replaced by ones with --parallel 3")
    assert client.completions.create(model=LLAMA, prompt="after update", max_tokens=4).usage.completion_tokens >= 1
    assert client.completions.create(model=VLLM, prompt="after update", max_tokens=4).usage.completion_tokens == 4
    assert (
        yaml.safe_load((deployment["conf"] / "serve" / "nodes.yaml").read_text())[0]["engine_args"]["max_num_seqs"] == 3
    )


def test_stop_leaves_no_llama_server(deployment, client):
    record_llama_servers(deployment)
    pids = deployment["llama_pids"]
    assert len(pids) >= 2 * LLAMA_REPLICAS  # the first two, the replacement and the updated ones
    result = run_cli(deployment["conf"], "action=stop", timeout=300)
    assert result.returncode == 0, result.output

    def none_left() -> bool:
        alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        assert not alive, alive
        return True

    wait_for(none_left, 30, "every llama-server this run started to be gone")
    assert not (deployment["exp_dir"] / "state.json").exists()


def test_demo_gguf_is_made_once():
    first = ensure_demo_model_gguf()
    assert first.read_bytes()[:4] == b"GGUF"
    assert ensure_demo_model_gguf() == first
