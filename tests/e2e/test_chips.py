"""Device families without the chips (docs/chips.md): two network-namespace hosts (tests/e2e/netns.py) pose as
Ascend hosts, one as a CPU host. On the "Ascend" hosts Ray starts with `NPU` resources, a stub `npu-smi` on their
PATH lists one fake 910B3 each, and vLLM's CPU engine stands in for vllm-ascend. What is checked is what the
orchestrator owns: the listing read at start, the NPU each replica reserved, ASCEND_RT_VISIBLE_DEVICES and
VLLM_PLUGINS in the engine process as Ray assigned and the family declares, status per replica and host, a
llama.cpp node beside it on the CPU host, and refusals before anything starts (a type naming no family, more NPUs
than the hosts have, an engine kind the family does not run). The vendor's engine itself is not run here.
"""

from __future__ import annotations

import json
import os
import shutil

import openai
import pytest

from flagscale.launchers.ssh import host_temp_dir
from tests.conftest import STATUS_WAIT_S, demo_engine_args, run_cli, status_cli, wait_for, write_config
from tests.e2e import netns

PORT = 18861
RAY_PORT = 18870
HOSTS = 3
pytestmark = pytest.mark.skipif(netns.available() is not None, reason=str(netns.available()))

NPU_SMI = """#!/bin/sh
# a stand-in for Ascend's npu-smi: one 910B3 with 64 GiB of HBM
cat <<'LISTING'
+---------------------------+---------------+----------------------------------------------------+
| NPU   Name                | Health        | Power(W)    Temp(C)           Hugepages-Usage(page)|
| Chip                      | Bus-Id        | AICore(%)   Memory-Usage(MB)  HBM-Usage(MB)        |
+===========================+===============+====================================================+
| 0     910B3               | OK            | 93.6        40                0    / 0             |
| 0                         | 0000:C1:00.0  | 0           0    / 0          3339 / 65536         |
+===========================+===============+====================================================+
LISTING
"""


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("netns") / "hosts"
    try:
        yield netns.build(HOSTS, workdir)
    finally:
        netns.teardown(HOSTS, workdir)


@pytest.fixture(scope="module")
def stub_path(tmp_path_factory):
    """A directory with the stub npu-smi, first on the PATH of the "Ascend" hosts only (their nodes_envs)."""
    stub = tmp_path_factory.mktemp("ascend-bin")
    (stub / "npu-smi").write_text(NPU_SMI)
    (stub / "npu-smi").chmod(0o755)
    return f"{stub}:{os.environ.get('PATH', '/usr/bin:/bin')}"


def hostfile_of(path, lines):
    path.write_text("# a CPU host and two hosts posing as Ascend ones\n" + "\n".join(lines) + "\n")
    return path


def config(tmp_path, hosts, stub_path, nodes, name, lines=None):
    h1, h2, h3 = (h.ip for h in hosts.hosts)
    lines = lines or [f"{h1} slots=1 type=cpu", f"{h2} slots=1 type=ascend", f"{h3} slots=1 type=910B"]
    runner = hosts.runner(
        hostfile_of(tmp_path / f"hostfile-{name}", lines),
        ray_port=RAY_PORT,
        num_cpus=1,
        join_timeout_s=120,
        deploy={"host": h1, "port": PORT, "startup_timeout_s": 600},
    )
    envs = {"nodes_envs": {h2: {"PATH": stub_path}, h3: {"PATH": stub_path}}}
    exp_dir = tmp_path / name
    conf = write_config(
        tmp_path / f"conf-{name}", nodes, exp_dir, PORT, experiment={"exp_name": name, "runner": runner, "envs": envs}
    )
    return conf, exp_dir


def npu_node(replicas=2, engine="vllm"):
    args = demo_engine_args(served_model_name="npu") if engine == "vllm" else {"model": "${demo_model_gguf:}"}
    return {
        "serve_id": "npu",
        "engine": engine,
        "engine_args": args,
        "resources": {"num_replicas": replicas, "num_cpus": 1, "accelerator": "ascend"},
    }


CPU_NODE = {
    "serve_id": "tiny",
    "engine": "llama_cpp",
    "engine_args": {"model": "${demo_model_gguf:}", "max_model_len": 512, "max_num_seqs": 2},
    "resources": {"num_replicas": 1, "num_cpus": 1, "accelerator": "cpu"},
}


def environ(pid: int) -> dict[str, str]:
    raw = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
    return dict(item.decode(errors="replace").partition("=")[::2] for item in raw if b"=" in item)


def refused(conf) -> str:
    run = run_cli(conf, timeout=300)
    assert run.returncode != 0, run.output
    return " ".join(run.output.split())


def test_refused_before_start(hosts, stub_path, tmp_path):
    """A type naming no family, more NPUs than the Ascend hosts have, an engine kind the family does not run: each
    refused with the culprit named, nothing started on any host."""
    h1, h2, h3 = (h.ip for h in hosts.hosts)
    bad_type = [f"{h1} slots=1 type=cpu", f"{h2} slots=1 type=ascnd", f"{h3} slots=1 type=910B"]
    conf, exp_dir = config(tmp_path, hosts, stub_path, [npu_node()], "bad-type", bad_type)
    out = refused(conf)
    assert "type=ascnd names no device family" in out and "hostfile-bad-type:3" in out, out
    conf, exp_dir = config(tmp_path, hosts, stub_path, [npu_node(replicas=3)], "over-asked")
    out = refused(conf)
    assert f"{h2}: 1 + {h3}: 1 = 2 ascend device(s)" in out and "= 3 device(s)" in out, out
    conf, exp_dir = config(tmp_path, hosts, stub_path, [npu_node(engine="llama_cpp")], "no-llama-on-npu")
    out = refused(conf)
    assert "engine llama_cpp does not run on Ascend NPUs (ascend)" in out, out
    assert {h.ip: hosts.ray_pids(h) for h in hosts.hosts} == {h.ip: [] for h in hosts.hosts}
    assert not (exp_dir / "state.json").exists()


def test_a_model_on_the_ascend_hosts_sees_the_npus_ray_assigned(hosts, stub_path, tmp_path):
    """Two vLLM replicas on the two "Ascend" hosts (one NPU each, the CPU engine standing in) and a llama.cpp node on
    the CPU host, one endpoint on the CPU host."""
    h1, h2, h3 = (h.ip for h in hosts.hosts)
    conf, exp_dir = config(tmp_path, hosts, stub_path, [npu_node(), CPU_NODE], "chips")
    try:
        run = run_cli(conf, timeout=900)
        assert run.returncode == 0, run.output
        state = json.loads((exp_dir / "state.json").read_text())
        listing = [{"index": 0, "name": "910B3", "memory_mib": 65536}]
        assert state["extra"]["devices"] == {h2: listing, h3: listing}  # the stub, read at start; none on h1

        def placed():
            result = status_cli(conf, "output=json")
            report = json.loads(result.stdout[result.stdout.index("{") :])
            ready = [r for r in report["replicas"] if r["state"] == "READY" and r["requests_served"] is not None]
            if sorted((r["serve_id"], r["host"]) for r in ready) != sorted([("npu", h2), ("npu", h3), ("tiny", h1)]):
                return None
            return report

        report = wait_for(placed, STATUS_WAIT_S, "npu on both Ascend hosts, tiny on the CPU host")
        families = {h["host"]: (h["family"], h["devices"]) for h in report["hosts"]}
        assert families == {h1: ("cpu", None), h2: ("ascend", listing), h3: ("ascend", listing)}
        for replica in [r for r in report["replicas"] if r["serve_id"] == "npu"]:
            assert replica["family"] == "ascend" and replica["gpus"] == ["0"], replica
            env = environ(replica["engine_pid"])
            assert env.get("ASCEND_RT_VISIBLE_DEVICES") == "0", replica
            assert env.get("VLLM_PLUGINS") == "ascend", replica  # vllm-ascend's plugin, as the family declares
        (tiny,) = [r for r in report["replicas"] if r["serve_id"] == "tiny"]
        assert "ASCEND_RT_VISIBLE_DEVICES" not in environ(tiny["engine_pid"]) and tiny["gpus"] == []
        table = status_cli(conf).stdout
        assert "ascend 0" in table, table

        client = openai.OpenAI(base_url=f"http://{h1}:{PORT}/v1", api_key="none", timeout=120, max_retries=0)
        assert client.completions.create(model="npu", prompt="hi", max_tokens=4).usage.completion_tokens == 4
        assert client.completions.create(model="tiny", prompt="hi", max_tokens=4).usage.completion_tokens >= 1
        stop = run_cli(conf, "action=stop", timeout=300)
        assert stop.returncode == 0, stop.output
    finally:
        if (exp_dir / "state.json").exists():
            run_cli(conf, "action=stop", timeout=300)
        for ip in [h.ip for h in hosts.hosts]:
            shutil.rmtree(host_temp_dir(str(exp_dir.resolve()), ip), ignore_errors=True)
    wait_for(
        lambda: {h.ip: hosts.ray_pids(h) for h in hosts.hosts} == {h.ip: [] for h in hosts.hosts},
        15,
        "no Ray process on any test host",
        interval=0.5,
    )
