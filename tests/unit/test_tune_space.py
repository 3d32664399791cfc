"""auto_tune's space: both FlagScale shapes -> candidates and their configs; every bad input is one error naming
the key, before any trial. Pure logic plus vLLM's argument parser (no Ray, no engine)."""

from __future__ import annotations

import pytest

from flagscale.config.load import ConfigSources, load_config
from flagscale.errors import ConfigError
from flagscale.plan import engine_args_of
from flagscale.tune.space import candidate_config, check_values, read_space

SOURCES = ConfigSources(main="conf/serve.yaml", serve="conf/serve/nodes.yaml")


def tune_config(tmp_path, auto_tuner: dict, nodes: list[dict] | None = None) -> dict:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text("{}")
    node = {
        "serve_id": "m",
        "engine_args": {"model": str(model), "max_model_len": 256},
        "resources": {"num_replicas": 1},
    }
    return {
        "experiment": {
            "exp_name": "t",
            "exp_dir": str(tmp_path / "exp"),
            "task": {"type": "serve", "backend": "vllm"},
            "runner": {"deploy": {"port": 8123}},
            "auto_tuner": auto_tuner,
        },
        "serve": nodes or [node],
        "action": "auto_tune",
    }


def space_of(cfg):
    config = load_config(cfg, SOURCES)
    space = read_space(config, SOURCES.main)
    check_values(config, space)
    return config, space


def error(cfg) -> str:
    with pytest.raises(ConfigError) as info:
        space_of(cfg)
    return str(info.value)


def test_flat_shape_expands_to_the_grid_and_maps_flagscale_dims(tmp_path):
    cfg = tune_config(
        tmp_path,
        {"space": {"tensor_model_parallel_size": [1], "instance": [1, 2], "max_num_seqs": [4, 8], "block_size": 16}},
    )
    config, space = space_of(cfg)
    candidates = space.candidates()
    assert len(candidates) == 4
    assert candidates[0] == {"tensor_model_parallel_size": 1, "instance": 1, "max_num_seqs": 4, "block_size": 16}
    assert candidates[-1]["instance"] == 2 and candidates[-1]["max_num_seqs"] == 8
    tuned = candidate_config(config, space, candidates[-1])
    node = tuned.serve[0]
    assert node.resources.num_replicas == 2
    assert engine_args_of(node, tuned)["tensor_parallel_size"] == 1
    assert engine_args_of(node, tuned)["max_num_seqs"] == 8
    assert config.serve[0].resources.num_replicas == 1  # the original is untouched
    assert "max_num_seqs" not in config.serve[0].engine_args


def test_per_engine_shape_reads_the_nodes_engine_block(tmp_path):
    cfg = tune_config(tmp_path, {"engines": ["vllm"], "space": {"vllm": {"max_num_batched_tokens": [512, 1024]}}})
    _, space = space_of(cfg)
    assert space.dims == {"max_num_batched_tokens": [512, 1024]}
    assert space.where.endswith("experiment.auto_tuner.space.vllm")
    assert len(space.candidates()) == 2


def test_engine_args_specific_gets_the_candidates_value(tmp_path):
    cfg = tune_config(tmp_path, {"space": {"max_num_seqs": [4]}})
    cfg["serve"][0]["engine_args_specific"] = {"vllm": {"max_num_seqs": 64}}
    config, space = space_of(cfg)
    tuned = candidate_config(config, space, {"max_num_seqs": 4})
    assert engine_args_of(tuned.serve[0], tuned)["max_num_seqs"] == 4


def test_unknown_space_key_names_the_key_with_a_suggestion(tmp_path):
    message = error(tune_config(tmp_path, {"space": {"max_num_seq": [4]}}))
    assert message.startswith("conf/serve.yaml: experiment.auto_tuner.space")
    assert "unknown space key 'max_num_seq'" in message and "did you mean 'max_num_seqs'" in message
    message = error(tune_config(tmp_path, {"space": {"instances": [1]}}))
    assert "did you mean 'instance'" in message


def test_value_the_parser_rejects_names_the_key(tmp_path):
    message = error(tune_config(tmp_path, {"space": {"max_num_seqs": [4, "many"]}}))
    assert message.startswith("conf/serve.yaml: experiment.auto_tuner.space.max_num_seqs")
    assert "vLLM rejects" in message and "many" in message


def test_empty_space_and_empty_dimension(tmp_path):
    assert "the space is empty" in error(tune_config(tmp_path, {"space": {}}))
    assert "dimension 'max_num_seqs' has no values" in error(tune_config(tmp_path, {"space": {"max_num_seqs": []}}))
    assert "no values" not in error(tune_config(tmp_path, {"space": {"instance": [0]}}))
    assert "instance must be a positive number" in error(tune_config(tmp_path, {"space": {"instance": [0]}}))


def test_model_cannot_be_searched_and_shapes_cannot_mix(tmp_path):
    assert "'model' cannot be searched" in error(tune_config(tmp_path, {"space": {"model": ["/a", "/b"]}}))
    message = error(tune_config(tmp_path, {"space": {"vllm": {"max_num_seqs": [4]}, "instance": [1]}}))
    assert "mixes the per-engine shape" in message


def test_per_engine_shape_errors(tmp_path):
    message = error(tune_config(tmp_path, {"space": {"vlm": {"max_num_seqs": [4]}}}))
    assert "unknown engine 'vlm'" in message and "did you mean 'vllm'" in message
    message = error(tune_config(tmp_path, {"engines": ["vllm", "sglang"], "space": {"vllm": {"max_num_seqs": [4]}}}))
    assert message.startswith("conf/serve.yaml: experiment.auto_tuner.engines") and "no 'sglang' block" in message


def test_several_engine_nodes_need_serve_id(tmp_path):
    cfg = tune_config(tmp_path, {"space": {"max_num_seqs": [4]}})
    second = {
        **cfg["serve"][0],
        "serve_id": "n",
        "engine_args": {**cfg["serve"][0]["engine_args"], "served_model_name": "n"},
    }
    cfg["serve"].append(second)
    assert "several engine nodes (m, n); name the one to tune in serve_id" in error(cfg)
    cfg["experiment"]["auto_tuner"]["serve_id"] = "n"
    _, space = space_of(cfg)
    assert space.serve_id == "n" and space.node_index == 1
    cfg["experiment"]["auto_tuner"]["serve_id"] = "x"
    assert "no engine node 'x'" in error(cfg)


@pytest.mark.parametrize(
    ("slo", "expected"),
    [
        ({"ttft": {"p99": 500}}, "unknown SLO key 'ttft' (did you mean 'ttft_ms'?"),
        ({"ttft_ms": {"p95": 500}}, "unknown SLO key 'p95'"),
        ({"tpot_ms": {"p99": 0}}, "slo.tpot_ms.p99 must be positive"),
    ],
)
def test_bad_slo_names_the_key(tmp_path, slo, expected):
    with pytest.raises(ConfigError) as info:
        load_config(tune_config(tmp_path, {"space": {"max_num_seqs": [4]}, "slo": slo}), SOURCES)
    assert str(info.value).startswith("conf/serve.yaml: experiment.auto_tuner.slo")
    assert expected in str(info.value)


def test_the_real_flagscale_auto_tuner_block_loads(tmp_path):
    block = {
        "space": {
            "tensor_model_parallel_size": [2, 4],
            "pipeline_model_parallel_size": [1, 2, 4],
            "instance": [1, 2, 4],
            "block_size": [16],
            "max_num_batched_tokens": [512, 1024, 2048],
            "max_num_seqs": [256],
        },
        "control": {"interval": 20, "run_best": False},
    }
    config, space = space_of(tune_config(tmp_path, block))
    assert len(space.candidates()) == 54
    assert config.experiment.auto_tuner.control.interval == 20 and not config.experiment.auto_tuner.control.run_best
