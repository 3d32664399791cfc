"""Deploying onto an existing Ray cluster (`runner.type: ray`), end to end: the module starts a Ray cluster as its
user would (`ray start --head` here with token auth, `ray start --address` on a netns test host), each node a session
of its own that the module records and stops exactly; the runner only deploys onto it.

In order, on that one cluster:
  bad input fails before anything starts: an address nobody answers, a wrong token, more replicas than the nodes hold;
  a deployment (a llama.cpp engine) whose replica asks for a chip type only the worker has serves from there, shows
  both nodes in status, reads the worker's engine log through Ray, is updated in place;
  a second one from another exp_dir (a vLLM engine) coexists; a third with the first one's name is refused; each
  stop removes only its own application, registry entries and engine processes, and the cluster runs on.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import time

import openai
import psutil
import pytest

from flagscale.cluster.processes import read_process, stop_session
from tests.conftest import (
    REPO,
    STATUS_WAIT_S,
    demo_engine_args,
    llama_cpp_node,
    run_cli,
    status_cli,
    wait_for,
    write_config,
)
from tests.e2e import netns

RAY_PORT = 18960
PORT_A = 18961
PORT_B = 18962
CHIP = "chipX"
HEAD_IP = f"{netns.SUBNET}.1"  # this machine's address on the test hosts' bridge: the head's node IP
RAY_CLI = [sys.executable, "-m", "ray.scripts.scripts", "start", "--disable-usage-stats", "--num-cpus", "2"]
# Worker ports as the project's own nodes take them (flagscale/cluster/ray_node.py: WORKER_PORTS), away from the
# ports the deployments below serve on (Ray's default range, 10002-19999, holds them).
NODE_PORTS = ["--min-worker-port", "20000", "--max-worker-port", "29999"]
pytestmark = pytest.mark.skipif(netns.available() is not None, reason=str(netns.available()))


def start_node(argv: list[str], env: dict[str, str], log_path) -> tuple[int, int]:
    """`ray start` as the leader of a new session; returns (session, leader start ticks) once it exited 0."""
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    ticks = read_process(proc.pid).start_ticks
    assert proc.wait(timeout=120) == 0, log_path.read_text()
    return proc.pid, ticks


def netns_names() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """One head here and one worker on a netns host, token auth on; the module's env carries the token the way Ray
    reads it, so every CLI call below connects as the cluster's user would."""
    work = tmp_path_factory.mktemp("raycluster")
    token = work / "token"
    token.write_text(secrets.token_hex(32))
    token.chmod(0o600)
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)}
    sessions = []
    hosts_dir = work / "hosts"
    temp_dirs = [f"/tmp/fsrc{os.getpid()}{role}" for role in "hw"]  # Ray's sockets need a short path
    # netns.build tears down test hosts of the same names first: never those of another module running right now.
    wait_for(lambda: "fs77h" not in netns_names(), 900, "another module's test hosts to go away", interval=5)
    try:
        hosts = netns.build(1, hosts_dir)
        worker = hosts.hosts[0]
        head_argv = [*RAY_CLI, "--head", "--port", str(RAY_PORT), "--node-ip-address", HEAD_IP, *NODE_PORTS]
        head_argv += ["--temp-dir", temp_dirs[0], "--include-dashboard", "false"]
        head_argv += ["--ray-client-server-port", "18963", "--dashboard-agent-listen-port", "18964"]
        sessions.append(start_node(head_argv, env, work / "head.log"))
        worker_argv = ["ip", "netns", "exec", worker.netns, *RAY_CLI, "--address", f"{HEAD_IP}:{RAY_PORT}"]
        worker_argv += ["--node-ip-address", worker.ip, *NODE_PORTS, "--temp-dir", temp_dirs[1]]
        worker_argv += ["--resources", json.dumps({CHIP: 2})]  # a chip type only the worker has
        sessions.append(start_node(worker_argv, env, work / "worker.log"))
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("RAY_AUTH_MODE", "token")
            patch.setenv("RAY_AUTH_TOKEN_PATH", str(token))
            wait_for(lambda: len(view()["nodes"]) == 2, 60, "both Ray nodes alive", interval=1)
            yield worker
    finally:
        for session, ticks in sessions:
            stop_session(session, ticks)
        netns.teardown(1, hosts_dir)
        for path in temp_dirs:
            shutil.rmtree(path, ignore_errors=True)


VIEW = """
import json, ray
from flagscale.cluster.ray_compat import kv_get, kv_list, serve_details
ray.init(address="{address}", logging_level="ERROR")
try:
    apps = sorted(serve_details().applications)
except Exception:
    apps = []
keys = sorted(kv_list(b"replicas/", namespace="flagscale"))
engines = [json.loads(kv_get(k, namespace="flagscale"))["engine_pid"] for k in keys]
every = sorted(k.decode() for k in kv_list(b"", namespace="flagscale"))
print(json.dumps({{"nodes": sorted(n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]), "apps": apps,
                  "registry": [k.decode() for k in keys], "engines": engines, "keys": every}}))
"""


def view() -> dict:
    """The cluster as a separate driver sees it: alive nodes, Serve applications, replica registry keys and the
    engine server (engine_proc) pids they name, and every key of the project's namespace in Ray's KV store."""
    code = VIEW.format(address=f"{HEAD_IP}:{RAY_PORT}")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def alive_engines(pids: list[int]) -> list[int]:
    """Those of `pids` that are still engine servers (both nodes share this machine's process table)."""
    alive = []
    for pid in pids:
        try:
            if "flagscale.replica.engine_proc" in psutil.Process(pid).cmdline():
                alive.append(pid)
        except psutil.Error:
            continue
    return alive


def config(tmp_path, name: str, port: int, replicas: int, accelerator: str | None = None, engine: str = "vllm"):
    resources = {"num_replicas": replicas, "num_cpus": 1, **({"accelerator": accelerator} if accelerator else {})}
    if engine == "llama_cpp":
        nodes = [llama_cpp_node("m", **resources)]
    else:
        nodes = [{"serve_id": "m", "engine": "vllm", "engine_args": demo_engine_args(served_model_name="m")}]
        nodes[0]["resources"] = resources
    runner = {"type": "ray", "address": f"{HEAD_IP}:{RAY_PORT}", "deploy": {"port": port, "startup_timeout_s": 600}}
    conf = write_config(tmp_path / f"conf-{name}", nodes, tmp_path / name, port, {"exp_name": name, "runner": runner})
    return conf, tmp_path / name


@pytest.fixture
def stop_on_failure():
    confs = []
    yield confs.append
    for conf, exp_dir in confs:
        if (exp_dir / "state.json").exists():
            run_cli(conf, "action=stop", timeout=300)


def test_bad_input_fails_before_anything_starts(cluster, tmp_path, monkeypatch):
    conf, exp_dir = config(tmp_path, "bad", PORT_A, 1)
    t0 = time.monotonic()
    nobody = run_cli(conf, f"++experiment.runner.address={HEAD_IP}:18969", timeout=120)
    assert nobody.returncode == 3, nobody.output
    assert f"nobody answers at {HEAD_IP}:18969" in nobody.stderr
    assert time.monotonic() - t0 < 60  # the CLI's own start-up included

    monkeypatch.delenv("RAY_AUTH_TOKEN_PATH")
    monkeypatch.setenv("RAY_AUTH_TOKEN", "0" * 64)
    wrong = run_cli(conf, timeout=120)
    assert wrong.returncode == 3, wrong.output
    assert "refused this runner's token" in wrong.stderr and "RAY_AUTH_TOKEN set" in wrong.stderr
    monkeypatch.undo()

    big, _ = config(tmp_path, "big", PORT_A, 5)
    too_big = run_cli(big, timeout=120)
    assert too_big.returncode == 2, too_big.output
    assert "serve 'm': 5 replica(s) x (CPU:1) = CPU:5" in too_big.stderr
    assert f"{HEAD_IP} (head): CPU:2" in too_big.stderr and f"{cluster.ip}: CPU:2" in too_big.stderr
    dry = run_cli(conf, "action=dryrun", timeout=120)
    assert dry.returncode == 0, dry.output
    assert f"node {HEAD_IP} (head)" in dry.stdout and f"node {cluster.ip}" in dry.stdout
    assert f"{HEAD_IP}: m#0" in dry.stdout
    assert not (exp_dir / "state.json").exists()
    assert view()["apps"] == []


def test_deploy_serve_update_coexist_and_stop_only_its_own(cluster, tmp_path, stop_on_failure):
    # a: llama.cpp, updated in place (a replacement starts in seconds); b: vLLM, a second engine kind beside it.
    conf_a, exp_a = config(tmp_path, "a", PORT_A, 1, accelerator=CHIP, engine="llama_cpp")
    stop_on_failure((conf_a, exp_a))
    run = run_cli(conf_a, timeout=900)
    assert run.returncode == 0, run.output
    assert f"http://{HEAD_IP}:{PORT_A}/v1" in run.stdout
    assert not (exp_a / "ray_auth_token").exists()  # the cluster's own token, from the environment
    client = openai.OpenAI(base_url=f"http://{HEAD_IP}:{PORT_A}/v1", api_key="none", timeout=120)
    assert client.completions.create(model="m", prompt="hello", max_tokens=4).usage.completion_tokens == 4

    def on_the_chip_node() -> dict:
        status = status_cli(conf_a, "output=json")
        assert status.returncode == 0, status.output
        report = json.loads(status.stdout[status.stdout.index("{") :])
        assert [r["host"] for r in report["replicas"]] == [cluster.ip], report["replicas"]
        by_host = {h["host"]: h for h in report["hosts"]}
        assert by_host[HEAD_IP]["role"] == "head + router" and len(by_host[cluster.ip]["replicas"]) == 1
        return report

    report = wait_for(
        on_the_chip_node, STATUS_WAIT_S, f"status: the replica on the {CHIP} node, both nodes listed", interval=2
    )
    on_worker = next(r for r in report["replicas"] if r["host"] == cluster.ip)
    assert on_worker["url"].startswith(f"http://{cluster.ip}:")  # the engine binds its node's IP
    logs = run_cli(conf_a, "action=logs", f"replica={on_worker['replica_id']}", "lines=5", timeout=120)
    assert logs.returncode == 0, logs.output
    assert f"host {cluster.ip}: /tmp/fsrc" in logs.stdout and "/logs/flagscale/a/engine-m-" in logs.stdout

    conf_a.joinpath("serve/nodes.yaml").write_text(
        conf_a.joinpath("serve/nodes.yaml").read_text().replace("max_num_seqs: 8", "max_num_seqs: 6")
    )
    update = run_cli(conf_a, timeout=900)
    assert update.returncode == 0, update.output
    assert "max_num_seqs: 8 -> 6" in update.stdout and "updated" in update.stdout
    a_engines = view()["engines"]
    assert len(a_engines) == 1 and all("--parallel 6" in " ".join(psutil.Process(p).cmdline()) for p in a_engines)

    conf_b, exp_b = config(tmp_path, "b", PORT_B, 1)
    stop_on_failure((conf_b, exp_b))
    run_b = run_cli(conf_b, timeout=900)
    assert run_b.returncode == 0, run_b.output
    same_name, _ = config(tmp_path / "elsewhere", "a", 18968, 1)
    clash = run_cli(same_name, timeout=120)
    assert clash.returncode != 0 and "already runs a Serve application 'a'" in clash.stderr, clash.output
    both = view()
    assert both["apps"] == ["a", "b"] and len(both["engines"]) == 2, both
    b_engines = [p for p in both["engines"] if p not in a_engines]
    stop_a = run_cli(conf_a, "action=stop", timeout=300)
    assert stop_a.returncode == 0, stop_a.output
    wait_for(lambda: not alive_engines(a_engines), 30, "no engine process of 'a' on either node")
    after = view()
    assert after["apps"] == ["b"] and all(key.startswith("replicas/b/") for key in after["registry"]), after
    assert not [k for k in after["keys"] if "a" in k.split("/")[1:2]], after["keys"]  # records, reports, drain mark
    assert alive_engines(b_engines) == b_engines
    client_b = openai.OpenAI(base_url=f"http://{HEAD_IP}:{PORT_B}/v1", api_key="none", timeout=120)
    assert client_b.completions.create(model="m", prompt="hello", max_tokens=4).usage.completion_tokens == 4

    stop_b = run_cli(conf_b, "action=stop", timeout=300)
    assert stop_b.returncode == 0, stop_b.output
    wait_for(lambda: not alive_engines(b_engines), 30, "no engine process of 'b' on either node")
    assert view() == {"nodes": sorted([HEAD_IP, cluster.ip]), "apps": [], "registry": [], "engines": [], "keys": []}
