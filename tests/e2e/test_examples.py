"""Every config the project ships (conf/ and examples/) passes dryrun through the `flagscale` command's entry, run
from outside the checkout, each in a process of its own forked from the suite's CLI zygote (tests/cli_zygote.py;
tests/e2e/test_cli.py runs the installed script itself): nothing started. What a config needs that this machine lacks is given on the command line as
a user would: a hostfile of test hosts (dryrun connects to none), the demo model for GPU-sized model ids. The
existing-Ray-cluster example is checked to load and validate up to connecting, which fails naming the address."""

from __future__ import annotations

from pathlib import Path

import pytest

from flagscale.engines import llama_cpp_build
from flagscale.net import free_port
from tests.conftest import REPO, run_flagscale, write_moe_model

EXAMPLES = REPO / "examples"
NEEDS_A_CLUSTER = {"ray_cluster"}
SHIPPED = [
    (conf_dir, p.stem)
    for conf_dir in [REPO / "conf", *sorted(EXAMPLES.glob("*/conf"))]
    for p in sorted(conf_dir.glob("*.yaml"))
    if conf_dir.parent.name not in NEEDS_A_CLUSTER
]
SCHEMA_WORDS = ("unknown key", "Input should be", "Field required", "Extra inputs")


def command(conf_dir: Path, name: str) -> list[str]:
    """`flagscale serve demo|<example> --dryrun`, or `flagscale run` for an example's other configs."""
    if conf_dir == REPO / "conf":
        return ["serve", "demo", "--dryrun"]
    if name == "serve":
        return ["serve", conf_dir.parent.name, "--dryrun"]
    return ["run", "-p", str(conf_dir), "-n", name, "-a", "dryrun"]


def what_it_needs(example: str, tmp_path: Path, demo_model_path: Path, request=None) -> list[str]:
    if example == "tp_two_hosts":
        hosts = tmp_path / "hosts"
        hosts.write_text("127.0.0.2 slots=1 type=cpu\n127.0.0.3 slots=1 type=cpu\n")
        return [f"experiment.runner.hostfile={hosts}"]
    if example == "gpu_moe_ep":  # expert parallel needs a MoE model: a tiny Mixtral's config.json, no weights
        hosts = tmp_path / "hosts"
        hosts.write_text("127.0.0.2 slots=8 type=gpu\n127.0.0.3 slots=8 type=gpu\n")
        model = write_moe_model(tmp_path / "tiny-mixtral", demo_model_path)
        return [f"experiment.runner.hostfile={hosts}", "--model-path", str(model)]
    if example.startswith("gpu_"):
        hosts = tmp_path / "hosts"
        hosts.write_text("127.0.0.2 slots=8 type=gpu\n127.0.0.3 slots=8 type=gpu\n")
        return [f"experiment.runner.hostfile={hosts}", "--model-path", str(demo_model_path)]
    if example in ("llama_cpp", "slo_sleep"):
        if not llama_cpp_build.is_built():
            pytest.skip("llama.cpp is not built here (make llama-cpp, which make test runs first)")
    return []


@pytest.mark.parametrize("conf_dir, name", SHIPPED, ids=[f"{d.relative_to(REPO)}/{n}" for d, n in SHIPPED])
def test_shipped_config_dryruns(conf_dir, name, tmp_path, demo_model_path, request):
    needs = what_it_needs(conf_dir.parent.name, tmp_path, demo_model_path, request)
    argv = [*command(conf_dir, name), f"experiment.exp_dir={tmp_path / 'exp'}", *needs]
    result = run_flagscale(*argv, cwd=tmp_path, timeout=300, forked=True)
    assert result.returncode == 0, result.output
    assert "dryrun: nothing was started" in result.stdout
    assert "router: 1 process(es)" in result.stdout  # CPU deployments: one router process by default


def test_70b_at_tp8_plans_eight_ranks_per_replica(tmp_path, demo_model_path):
    needs = what_it_needs("gpu_70b", tmp_path, demo_model_path)
    argv = ["serve", "gpu_70b", "--dryrun", "serve=tp8", f"experiment.exp_dir={tmp_path / 'exp'}", *needs]
    result = run_flagscale(*argv, cwd=tmp_path, timeout=300, forked=True)
    assert result.returncode == 0, result.output
    assert "TP 8 x PP 1 x DP 1" in " ".join(result.stdout.split()), result.stdout


def test_moe_ep_over_two_hosts_plans_whole_dp_ranks_per_host(tmp_path, demo_model_path):
    needs = what_it_needs("gpu_moe_ep", tmp_path, demo_model_path)
    argv = ["serve", "gpu_moe_ep", "--dryrun", "serve=dp16_two_hosts", f"experiment.exp_dir={tmp_path / 'exp'}"]
    result = run_flagscale(*argv, *needs, cwd=tmp_path, timeout=300, forked=True)
    assert result.returncode == 0, result.output
    out = " ".join(result.stdout.split())
    assert "TP 1 x PP 1 x DP 16 = 16 per replica, expert parallel" in out, result.stdout
    assert "127.0.0.3: headless ranks 8-15 (DP 8-15, EP 8-15), GPUs 0-7" in out, result.stdout
    assert "--data-parallel-start-rank 8" in out and "--data-parallel-address 127.0.0.2" in out, result.stdout


def test_existing_ray_cluster_example_loads_and_names_the_address_it_needs(tmp_path):
    address = f"127.0.0.1:{free_port()}"
    argv = ["serve", "ray_cluster", "--dryrun", f"experiment.runner.address={address}"]
    result = run_flagscale(*argv, f"experiment.exp_dir={tmp_path / 'exp'}", cwd=tmp_path, timeout=120, forked=True)
    assert result.returncode != 0
    assert f"nobody answers at {address}" in result.stderr, result.output
    assert not any(word in result.output for word in SCHEMA_WORDS), result.output
