"""Listening beyond loopback without a key is said, with what listens where (run and dryrun print it); a Ray
cluster's move of deploy.host 127.0.0.1 to the head's address is said with the endpoint, and why."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from flagscale.cluster.hostfile import parse_hostfile
from flagscale.cluster.ray_facts import ClusterFacts, NodeFacts
from flagscale.config.load import ConfigSources, load_config
from flagscale.facts import TargetFacts
from flagscale.plan import build_plan, open_without_key

SOURCES = ConfigSources(main="conf/serve.yaml")


def config(model, deploy: dict, **runner):
    cfg = {
        "experiment": {
            "exp_name": "t",
            "exp_dir": "/tmp/t",
            "runner": {"hostfile": None, "deploy": {"port": 8123, **deploy}, **runner},
        },
        "serve": [{"serve_id": "m", "engine_args": {"model": str(model), "max_model_len": 256}}],
    }
    return load_config(cfg, SOURCES)


def ray_facts() -> TargetFacts:
    total = {"CPU": 8.0, "memory": 1e9, "node:__internal_head__": 1.0}
    head = NodeFacts("id-head", "10.0.0.5", True, total, dict(total))
    worker = NodeFacts("id-w", "10.0.0.6", False, {"CPU": 8.0}, {"CPU": 8.0})
    return TargetFacts(ray_cluster=ClusterFacts("10.0.0.5:6379", [head, worker]))


def test_loopback_only_says_nothing(demo_model_path):
    assert open_without_key(build_plan(config(demo_model_path, {}), SOURCES, target_facts=TargetFacts())) is None


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3"])
def test_a_router_beyond_loopback_without_a_key_is_said_with_where(demo_model_path, host):
    plan = build_plan(config(demo_model_path, {"host": host}), SOURCES, target_facts=TargetFacts())
    warning = open_without_key(plan)
    assert warning and "no API key" in warning and f"the router on {host}:8123" in warning
    assert "api_key_env" in warning and "engine" not in warning  # engines here stay on 127.0.0.1
    keyed = config(demo_model_path, {"host": host, "api_key": "k-0123456789abcdef"})
    assert open_without_key(build_plan(keyed, SOURCES, target_facts=TargetFacts())) is None


def test_a_hostfile_puts_engines_on_node_addresses(demo_model_path, tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("10.9.0.1 slots=8 type=cpu\n10.9.0.2 slots=8 type=cpu\n")
    cfg = config(demo_model_path, {}, hostfile=str(hostfile))
    plan = build_plan(cfg, SOURCES, target_facts=TargetFacts(hostfile=parse_hostfile(hostfile), cpus=8))
    warning = open_without_key(plan)
    assert warning and "every engine server on its node's address (10.9.0.1, 10.9.0.2)" in warning


def test_a_ray_cluster_moves_loopback_to_the_head_and_says_why(demo_model_path):
    plan = build_plan(
        config(demo_model_path, {}, type="ray", address="10.0.0.5:6379"), SOURCES, target_facts=ray_facts()
    )
    assert plan.host == "10.0.0.5" and plan.endpoint == "http://10.0.0.5:8123"
    assert plan.endpoint_moved and "127.0.0.1 is served at 10.0.0.5" in plan.endpoint_moved
    assert "head node" in plan.endpoint_moved
    warning = open_without_key(plan)
    assert "the router on 10.0.0.5:8123" in warning and "(10.0.0.5, 10.0.0.6)" in warning

    from flagscale.actions.run import _print_ready

    out = io.StringIO()
    _print_ready(plan, Console(file=out, width=300), 1.0)
    assert "http://10.0.0.5:8123/v1" in out.getvalue() and "head node" in out.getvalue()
    unmoved = build_plan(
        config(demo_model_path, {"host": "0.0.0.0"}, type="ray", address="10.0.0.5:6379"),
        SOURCES,
        target_facts=ray_facts(),
    )
    assert unmoved.endpoint_moved is None


def test_dryrun_prints_the_warning(tmp_path):
    from tests.conftest import demo_engine_args, run_cli, write_config

    conf = write_config(
        tmp_path / "conf", [{"serve_id": "a", "engine_args": demo_engine_args()}], tmp_path / "e", 18995
    )
    result = run_cli(conf, "action=dryrun", "experiment.runner.deploy.host=0.0.0.0", timeout=300)
    assert result.returncode == 0, result.output
    assert "warning:" in result.stdout and "no API key" in result.stdout and "0.0.0.0:18995" in result.stdout
    quiet = run_cli(conf, "action=dryrun", timeout=300)
    assert quiet.returncode == 0 and "no API key" not in quiet.stdout, quiet.output
