"""Every bad input: one clear error naming the culprit, exit != 0, nothing started (real CLI, real vLLM parser)."""

from __future__ import annotations

import socket

import pytest

from tests.conftest import demo_engine_args, run_cli, write_config

PORT = 18311


def node(serve_id="a", **args):
    return {"serve_id": serve_id, "engine": "vllm", "engine_args": demo_engine_args(**args)}


def assert_nothing_started(exp_dir):
    assert not (exp_dir / "state.json").exists()
    assert not (exp_dir / "ray").exists()
    assert not (exp_dir / "ray_auth_token").exists()


def fails(tmp_path, nodes, *overrides, experiment=None):
    exp_dir = tmp_path / "exp"
    conf = write_config(tmp_path / "conf", nodes, exp_dir, PORT, experiment=experiment)
    result = run_cli(conf, *overrides, timeout=300)
    assert result.returncode != 0, result.output
    assert_nothing_started(exp_dir)
    return result.output


def test_unknown_key_with_did_you_mean(tmp_path):
    bad = node()
    bad["resources"] = {"num_replica": 2}
    out = fails(tmp_path, [bad])
    assert "serve/nodes.yaml" in out and "serve[0](a).resources" in out
    assert "did you mean 'num_replicas'" in out


def test_unknown_engine_arg(tmp_path):
    out = fails(tmp_path, [node(max_model_length=512)])
    assert "serve[0](a).engine_args" in out and "unknown vLLM engine arg 'max_model_length'" in out
    assert "did you mean 'max_model_len'" in out


def test_engine_arg_of_wrong_type(tmp_path):
    out = fails(tmp_path, [node(max_num_seqs="many")])
    assert "serve[0](a).engine_args" in out and "--max-num-seqs" in out and "'many'" in out


def test_model_path_missing(tmp_path):
    out = fails(tmp_path, [node(model="/nonexistent/model")])
    assert "'/nonexistent/model' does not exist" in out and "serve[0](a)" in out


def test_port_in_use(tmp_path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", PORT))
        sock.listen()
        out = fails(tmp_path, [node()])
    assert f"port {PORT}" in out and "already in use" in out and "experiment.runner.deploy.port" in out


def test_duplicate_serve_id(tmp_path):
    out = fails(tmp_path, [node("a"), node("a", served_model_name="other")])
    assert "duplicate serve_id 'a'" in out and "serve[1]" in out


def test_duplicate_served_model_name(tmp_path):
    out = fails(tmp_path, [node("a", served_model_name="m"), node("b", served_model_name="m")])
    assert "served model name 'm'" in out and "'a'" in out and "'b'" in out


def test_parallel_sizes_larger_than_devices(tmp_path):
    out = fails(tmp_path, [node(tensor_parallel_size=4, pipeline_parallel_size=2)])
    assert "TP x PP x DP = 4 x 2 x 1 = 8" in out and "serve[0](a)" in out


def test_unknown_engine(tmp_path):
    bad = node()
    bad["engine"] = "tgi"
    out = fails(tmp_path, [bad])
    assert "unknown engine 'tgi'" in out and "serve[0](a)" in out


def test_unknown_action(tmp_path):
    out = fails(tmp_path, [node()], "action=deploy")
    assert "unknown action 'deploy'" in out


def test_malformed_yaml(tmp_path):
    out = fails(tmp_path, "- serve_id: a\n  engine: vllm\n  engine_args: {model: [unclosed\n")
    assert "nodes.yaml" in out


def test_gpu_requested_on_a_machine_without_one(tmp_path):
    bad = node()
    bad["resources"] = {"num_gpus": 1}
    out = fails(tmp_path, [bad])
    assert "no GPU" in out and "serve[0](a).resources" in out


@pytest.mark.parametrize("override", ["experiment.runner.deploy.port=0"])
def test_out_of_range_port(tmp_path, override):
    out = fails(tmp_path, [node()], override)
    assert "experiment.runner.deploy.port" in out


@pytest.mark.parametrize(
    "resources, expected",
    [
        ({"min_replicas": 0, "max_replicas": 2, "slo": {"ttft_ms": -1}}, "ttft_ms"),
        ({"min_replicas": 0, "max_replicas": 2, "slo": {"ttft": 500}}, "unknown key 'ttft'"),
        ({"slo": {"ttft_ms": 500}}, "slo needs min_replicas and max_replicas"),
    ],
)
def test_bad_slo_block(tmp_path, resources, expected):
    bad = node()
    bad["resources"] = resources
    out = fails(tmp_path, [bad])
    assert "serve[0](a).resources" in out and expected in out
