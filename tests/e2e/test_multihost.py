"""Multi-host end to end on real hosts: 3 network namespaces with their own sshd (tests/e2e/netns.py),
Ray started on each over SSH from a hostfile, real vLLM (CPU) engines, requests through the router.

One set of hosts is shared by the module, in order:
  one deployment: 2 prefill replicas on the chipA hosts and 1 decode replica on the chipB host pass KV caches
  between hosts, a llama.cpp node of 2 replicas lands one on each chipA host -> requests -> status host table ->
  kill a worker's Ray node -> status says dead, both models still answer -> stop -> no Ray process anywhere;
  a hostfile with an unreachable host fails within the SSH timeout, naming it, nothing left on the others.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time

import openai
import pytest

from flagscale.launchers.ssh import host_temp_dir
from tests.conftest import STATUS_WAIT_S, demo_engine_args, run_cli, status_cli, wait_for, write_config
from tests.e2e import netns

PORT = 18801
RAY_PORT = 18810
HOSTS = 3
pytestmark = pytest.mark.skipif(netns.available() is not None, reason=str(netns.available()))


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("netns") / "hosts"
    try:
        built = netns.build(HOSTS, workdir)
        yield built
    finally:
        netns.teardown(HOSTS, workdir)


def write_hostfile(path, lines):
    path.write_text("# test hosts (network namespaces)\n" + "\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def hostfile(hosts, tmp_path_factory):
    h1, h2, h3 = (h.ip for h in hosts.hosts)
    return write_hostfile(
        tmp_path_factory.mktemp("hostfile") / "hostfile",
        [f"{h1} slots=1 type=cpu:chipA", f"{h2} slots=1 type=cpu:chipA", f"{h3} slots=1 type=cpu:chipB"],
    )


def deploy(tmp_path, hosts, hostfile, nodes, name, num_cpus=1, **experiment):
    exp_dir = tmp_path / name
    runner = hosts.runner(
        hostfile,
        ray_port=RAY_PORT,
        num_cpus=num_cpus,
        join_timeout_s=120,
        deploy={"host": hosts.hosts[0].ip, "port": PORT, "startup_timeout_s": 600},
    )
    conf = write_config(
        tmp_path / f"conf-{name}", nodes, exp_dir, PORT, experiment={"exp_name": name, "runner": runner, **experiment}
    )
    return conf, exp_dir


def status_json(conf):
    result = status_cli(conf, "output=json")
    return result, json.loads(result.stdout[result.stdout.index("{") :])


def assert_no_ray_left(hosts):
    def none_left() -> bool:
        left = {h.ip: hosts.ray_pids(h) for h in hosts.hosts}
        assert left == {h.ip: [] for h in hosts.hosts}, left
        return True

    wait_for(none_left, 15, "no Ray process on any test host", interval=0.5)


@pytest.fixture
def stop_on_failure():
    confs = []
    yield confs.append
    for conf, exp_dir in confs:
        if (exp_dir / "state.json").exists():
            run_cli(conf, "action=stop", timeout=300)
        for ip in [f"{netns.SUBNET}.{i}" for i in range(2, HOSTS + 2)] + [f"{netns.SUBNET}.250"]:
            shutil.rmtree(host_temp_dir(str(exp_dir.resolve()), ip), ignore_errors=True)  # Ray's logs of the run


def test_pd_pools_and_a_llama_cpp_node_pinned_by_chip_and_a_dead_worker_shows(hosts, tmp_path, stop_on_failure):
    """One deployment over the three hosts: a vLLM node disaggregated 2P1D, its prefill pool on the two chipA
    hosts and its decode pool on the chipB host, the KV cache crossing hosts over NIXL (UCX over TCP between the
    namespaces), answers equal to the decode engine's own greedy ones; beside it a llama.cpp node (docs/engines.md)
    of two replicas, one on each chipA host, all behind one endpoint on the first host. Then a worker host dies:
    status says so, both models still answer, and stop leaves no Ray process on any host."""
    from flagscale.cluster.processes import session_members
    from flagscale.engines.metrics import engine_metrics

    h1, h2, h3 = (h.ip for h in hosts.hosts)
    # FlagScale's experiment.node_args: engine args for the replicas on one host (max_num_seqs is 8 elsewhere).
    node_args = {h3: {"engine_args": {"max_num_seqs": 3}}}
    nodes = [
        {
            "serve_id": "pd",
            "engine": "vllm",
            "engine_args": demo_engine_args(served_model_name="pd"),
            "disaggregation": {
                "prefill": {"resources": {"num_replicas": 2, "num_cpus": 1, "accelerator": "chipA"}},
                "decode": {"resources": {"num_replicas": 1, "num_cpus": 1, "accelerator": "chipB"}},
            },
        },
        {
            "serve_id": "tiny",
            "engine": "llama_cpp",
            "engine_args": {"model": "${demo_model_gguf:}", "max_model_len": 512, "max_num_seqs": 2},
            "resources": {"num_replicas": 2, "num_cpus": 1, "accelerator": "chipA"},
        },
    ]
    # Two slots and two logical CPUs per host: a chipA host holds a prefill replica and a llama.cpp one.
    two_slots = write_hostfile(
        tmp_path / "hostfile",
        [f"{h1} slots=2 type=cpu:chipA", f"{h2} slots=2 type=cpu:chipA", f"{h3} slots=2 type=cpu:chipB"],
    )
    conf, exp_dir = deploy(tmp_path, hosts, two_slots, nodes, "chip-pd", num_cpus=2, node_args=node_args)
    stop_on_failure((conf, exp_dir))
    run = run_cli(conf, timeout=900)
    assert run.returncode == 0, run.output
    state = json.loads((exp_dir / "state.json").read_text())
    assert sorted(h["host"] for h in state["hosts"] if h["remote"]) == sorted([h1, h2, h3])
    assert all(h["session"] and h["node_id"] for h in state["hosts"])

    def each_replica_on_its_chip():
        result, report = status_json(conf)
        assert result.returncode == 0, result.output
        ready = [r for r in report["replicas"] if r["state"] == "READY" and r["requests_served"] is not None]
        placed = sorted((r["engine_kind"], r["role"], r["host"]) for r in ready)
        expected = [("vllm", "prefill", h1), ("vllm", "prefill", h2), ("vllm", "decode", h3)]
        expected += [("llama_cpp", "colocated", h1), ("llama_cpp", "colocated", h2)]
        if placed != sorted(expected):
            return None
        by_host = {h["host"]: h for h in report["hosts"]}
        assert all(h["ray_node"] == "alive" for h in by_host.values()), by_host
        assert [len(by_host[ip]["replicas"]) for ip in (h1, h2, h3)] == [2, 2, 1], by_host
        return ready

    replicas = wait_for(
        each_replica_on_its_chip, STATUS_WAIT_S, "prefill and llama.cpp on both chipA hosts, decode on chipB"
    )
    decode_url = next(r["url"] for r in replicas if r["role"] == "decode")
    assert decode_url.startswith(f"http://{h3}:"), decode_url
    table = status_cli(conf)
    assert "hosts" in table.stdout and "chipB" in table.stdout, table.output
    commands = [
        next(line for line in log.read_text().splitlines() if line.startswith("$ "))
        for log in (exp_dir / "serve_logs").glob("engine-pd*.log")
    ]
    (command,) = [c for c in commands if f"--host {h3} " in c]  # the decode engine, the one on the chipB host
    assert "--max-num-seqs 3" in command and "--max-num-seqs 8" not in command, command

    client = openai.OpenAI(base_url=f"http://{h1}:{PORT}/v1", api_key="none", timeout=120, max_retries=0)
    greedy = {"temperature": 0, "max_tokens": 12, "extra_body": {"ignore_eos": True}}
    prompts = [f"host {i} asks: " + "what crosses the wire " * (3 + 4 * i) for i in range(4)]
    direct = openai.OpenAI(base_url=f"{decode_url}/v1", api_key="none", timeout=120, max_retries=0)
    for prompt in prompts:
        streamed = client.completions.create(model="pd", prompt=prompt, stream=True, **greedy)
        text = "".join(c.choices[0].text for c in streamed if c.choices)
        whole = client.completions.create(model="pd", prompt=prompt, **greedy).choices[0].text
        assert text and text == whole, prompt
        # The decode engine alone, given the whole prompt: what the disaggregated answer must equal.
        assert direct.completions.create(model="pd", prompt=prompt, **greedy).choices[0].text == text, prompt
        assert client.completions.create(model="tiny", prompt="hi", max_tokens=4).usage.completion_tokens >= 1

    def transfers():
        return engine_metrics(decode_url).get("vllm:nixl_xfer_time_seconds_count", 0.0) >= len(prompts)

    wait_for(transfers, 30, "the decode replica on the chipB host to count NIXL transfers")

    # Kill the Ray node of worker host 2 (a prefill and a llama.cpp replica on it) outright: its recorded session.
    worker = next(h for h in state["hosts"] if h["host"] == h2)
    for pid in session_members(worker["session"]):
        os.kill(pid, signal.SIGKILL)

    def worker_dead():
        result, report = status_json(conf)
        states = {h["host"]: h["ray_node"] for h in report["hosts"]}
        assert states[h2] == "dead", states
        return result, states

    result, states = wait_for(worker_dead, STATUS_WAIT_S, f"status to say {h2}'s Ray node is dead", interval=3)
    assert states == {h1: "alive", h2: "dead", h3: "alive"}
    assert result.returncode != 0  # not healthy while a host is down
    for _ in range(4):  # the replicas on the dead host are passed over before the first byte
        assert client.completions.create(model="pd", prompt="hi", max_tokens=4).usage.completion_tokens == 4
        assert client.completions.create(model="tiny", prompt="hi", max_tokens=4).usage.completion_tokens >= 1

    stop = run_cli(conf, "action=stop", timeout=300)
    assert stop.returncode == 0, stop.output
    assert_no_ray_left(hosts)
    assert not (exp_dir / "state.json").exists()


def test_unreachable_host_fails_fast_and_leaves_nothing(hosts, tmp_path, stop_on_failure):
    h1, h2, _ = (h.ip for h in hosts.hosts)
    unreachable = f"{netns.SUBNET}.250"  # on the test subnet, no host behind it
    hostfile = write_hostfile(
        tmp_path / "hostfile",
        [f"{h1} slots=1 type=cpu:chipA", f"{h2} slots=1 type=cpu:chipA", f"{unreachable} slots=1 type=cpu:chipA"],
    )
    nodes = [
        {
            "serve_id": "demo",
            "engine": "vllm",
            "engine_args": demo_engine_args(),
            "resources": {"num_replicas": 1, "num_cpus": 1},
        }
    ]
    conf, exp_dir = deploy(tmp_path, hosts, hostfile, nodes, "unreachable")
    stop_on_failure((conf, exp_dir))
    t0 = time.monotonic()
    run = run_cli(conf, timeout=300)
    elapsed = time.monotonic() - t0
    assert run.returncode != 0
    assert unreachable in run.output and "SSH" in run.output, run.output
    # Without the SSH timeout, a connect to a silent address waits out the kernel's SYN retries (~130 s); the bound
    # leaves a busy machine's CLI start-up room and still tells the two apart.
    assert elapsed < 90, f"took {elapsed:.0f}s with ssh_timeout_s=5"
    assert_no_ray_left(hosts)
    assert not (exp_dir / "state.json").exists()


def test_ssh_config_alias_and_proxy_jump_reach_a_host(hosts, tmp_path):
    """runner.ssh_config: one host through a Host alias (HostName, User, Port, IdentityFile from the file, none
    given explicitly), another through ProxyJump via that alias; a session started there is recorded with its
    leader's start and stopped exactly."""
    from flagscale.cluster import ssh
    from flagscale.cluster.processes import read_process, session_members
    from flagscale.cluster.runner import SshRunner

    h1, _, h3 = hosts.hosts
    config = tmp_path / "ssh_config"
    config.write_text(
        f"Host fs-alias\n  HostName {h1.ip}\n  User root\n  Port {netns.SSH_PORT}\n"
        f"  IdentityFile {hosts.key}\n  IdentitiesOnly yes\n"
        f"Host fs-behind\n  HostName {h3.ip}\n  User root\n  Port {netns.SSH_PORT}\n"
        f"  IdentityFile {hosts.key}\n  ProxyJump fs-alias\n"
    )
    settings = ssh.SshSettings(known_hosts=str(hosts.known_hosts), timeout_s=5, config=str(config))
    with SshRunner("fs-alias", settings) as direct, SshRunner("fs-behind", settings) as behind:
        assert direct.address == h1.ip and behind.address == h3.ip
        # SSH_CONNECTION: client ip, client port, server ip, server port, as the server saw the connection.
        seen = direct.run(["sh", "-c", 'echo "$SSH_CONNECTION"']).stdout.split()
        assert (seen[2], seen[3]) == (h1.ip, str(netns.SSH_PORT))
        seen = behind.run(["sh", "-c", 'echo "$SSH_CONNECTION"']).stdout.split()
        assert seen[0] == h1.ip and seen[2] == h3.ip  # h3 saw the connection come from the jump host
        go = tmp_path / "go"  # the test hosts share this filesystem; the leader lives until its start is read
        leader = f"sleep 120 & while [ ! -e {go} ]; do sleep 0.05; done; echo started"
        session = behind.start_session(["sh", "-c", leader], {}, str(tmp_path / "s.log"), 30)
        assert session.start_ticks == read_process(session.id).start_ticks
        go.touch()
        result = session.wait()
        assert result.code == 0 and result.stdout == "started"
        assert session_members(session.id)
        assert behind.stop_session(session.id, session.start_ticks) == []
        assert session_members(session.id) == []


def test_one_engine_over_two_hosts(hosts, hostfile, tmp_path, stop_on_failure, demo_model_path):
    """TP=2 over the two chipA hosts (one rank each): vLLM's multi-node mp executor, the API server and rank 0 on
    one host, the headless rank 1 on the other (docs/parallelism.md). Greedy answers equal plain vLLM TP=2 on one
    host; a rank that dies takes its replica down and Serve replaces it; stop leaves no rank anywhere."""
    from tests.e2e.plain_vllm import answers, plain_answers

    h1, h2, _ = (h.ip for h in hosts.hosts)
    nodes = [
        {
            "serve_id": "tp",
            "engine": "vllm",
            "engine_args": demo_engine_args(served_model_name="tp", tensor_parallel_size=2),
            "resources": {"num_replicas": 1, "num_cpus": 1, "accelerator": "chipA"},
        }
    ]
    conf, exp_dir = deploy(tmp_path, hosts, hostfile, nodes, "tp-hosts")
    stop_on_failure((conf, exp_dir))
    run = run_cli(conf, timeout=900)
    assert run.returncode == 0, run.output
    client = openai.OpenAI(base_url=f"http://{h1}:{PORT}/v1", api_key="none", timeout=120, max_retries=0)
    spanning = answers(client, "tp")

    def ranks_on_both_hosts():
        _, report = status_json(conf)
        (replica,) = [r for r in report["replicas"] if r["state"] == "READY"]
        ranks = replica.get("ranks") or []
        assert sorted((r["rank"], r["host"]) for r in ranks) in (
            [(0, h1), (1, h2)],
            [(0, h2), (1, h1)],
        ), ranks
        assert all(r["pid"] and len(r["cpus"]) == 1 for r in ranks), ranks
        return replica

    replica = wait_for(ranks_on_both_hosts, STATUS_WAIT_S, "status: the replica's rank 0 and 1 on the two chipA hosts")
    remote = next(r for r in replica["ranks"] if r["rank"] == 1)
    assert "Worker_TP1" in " ".join(open(f"/proc/{remote['pid']}/cmdline").read().split("\0"))

    # A rank on the other host dies: the replica's health check fails and Serve replaces the replica as a whole.
    os.kill(remote["pid"], signal.SIGKILL)

    def replaced():
        _, report = status_json(conf)
        ready = [r for r in report["replicas"] if r["state"] == "READY" and r.get("ranks")]
        assert ready and ready[0]["replica_id"] != replica["replica_id"], report["replicas"]
        return True

    wait_for(replaced, 600, "Serve to replace the replica whose remote rank died", interval=5)
    assert answers(client, "tp") == spanning

    stop = run_cli(conf, "action=stop", timeout=300)
    assert stop.returncode == 0, stop.output
    assert_no_ray_left(hosts)
    # plain vLLM TP=2 on one host, ranks on the same cores
    assert plain_answers(demo_model_path, 2, "0|1", tmp_path / "plain.log") == spanning
