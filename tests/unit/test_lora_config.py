"""LoRA adapters in the config (issue 52): `lora:` and vLLM's spellings in engine_args as one setting, every adapter
checked before anything starts (its directory, adapter_config.json, its base, its rank), one error naming the
adapter, the file and the key; engines that cannot serve adapters refused by name; the argv and the plan."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flagscale.config.load import ConfigSources, load_config
from flagscale.config.lora import node_lora, same_base
from flagscale.demo_model import ensure_demo_lora
from flagscale.errors import ConfigError
from flagscale.facts import TargetFacts
from flagscale.plan import build_plan
from flagscale.serve.app import router_spec

SOURCES = ConfigSources(main="conf/serve.yaml", serve="conf/serve/nodes.yaml")


def config(model, lora=None, engine="vllm", replicas=1, **engine_args):
    node = {
        "serve_id": "m",
        "engine": engine,
        "engine_args": {"model": str(model), "max_model_len": 256, **engine_args},
        "resources": {"num_replicas": replicas},
    }
    if lora is not None:
        node["lora"] = lora
    cfg = {"experiment": {"exp_name": "t", "exp_dir": "/tmp/t", "runner": {"deploy": {"port": 8123}}}, "serve": [node]}
    return load_config(cfg, SOURCES)


def plan(cfg):
    return build_plan(cfg, SOURCES, target_facts=TargetFacts(cpus=8))


@pytest.fixture(scope="module")
def adapter() -> Path:
    return ensure_demo_lora("unit-a")


def copy_adapter(adapter: Path, to: Path, **config_changes) -> Path:
    to.mkdir()
    (to / "adapter_model.safetensors").write_bytes((adapter / "adapter_model.safetensors").read_bytes())
    config = {**json.loads((adapter / "adapter_config.json").read_text()), **config_changes}
    (to / "adapter_config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    return to


def test_adapters_are_planned_with_the_engines_flags_and_served_as_models(demo_model_path, adapter):
    cfg = config(demo_model_path, {"adapters": {"sql": str(adapter)}, "max_loras": 2})
    engine = plan(cfg).engines[0]
    assert engine.adapters == {"sql": str(adapter)}
    argv = " ".join(engine.argv)
    assert "--enable-lora" in argv and "--max-loras 2" in argv and "--lora-modules" not in argv
    spec = router_spec(plan(cfg))
    assert spec.models == {"m": "m", "sql": "m"}
    assert spec.routing["sql"] == spec.routing["m"] and spec.engines["sql"] == "vllm"


def test_vllm_spellings_in_engine_args_are_the_same_setting(demo_model_path, adapter):
    spelled = config(demo_model_path, enable_lora=True, lora_modules=[f"sql={adapter}"], max_loras=2)
    assert plan(spelled).engines[0].adapters == {"sql": str(adapter)}
    both = config(demo_model_path, {"adapters": {"sql": str(adapter)}}, max_loras=3)
    assert plan(both).engines[0].lora.max_loras == 3
    as_json = config(demo_model_path, lora_modules=[json.dumps({"name": "bot", "path": str(adapter)})])
    assert plan(as_json).engines[0].adapters == {"bot": str(adapter)}
    with pytest.raises(ConfigError, match=r"max_loras is 3 here and 2 in the node's lora") as err:
        plan(config(demo_model_path, {"max_loras": 2}, max_loras=3))
    assert "serve[0](m).engine_args.max_loras" in str(err.value)


def test_lora_modules_in_runner_cli_args_are_read_and_checked(demo_model_path, adapter):
    cfg = config(demo_model_path)
    cfg.experiment.runner.cli_args = {"lora_modules": [f"sql={adapter}"]}
    assert plan(cfg).engines[0].adapters == {"sql": str(adapter)}


def test_bad_settings_in_engine_args_are_named():
    with pytest.raises(ConfigError, match=r"n.engine_args: max_cpu_loras \(1\) must be at least max_loras \(2\)"):
        node_lora(None, {"max_loras": 2, "max_cpu_loras": 1}, "n.engine_args")
    with pytest.raises(ConfigError, match=r"n.engine_args.max_loras: .*greater than or equal to 1"):
        node_lora(None, {"max_loras": 0}, "n.engine_args")


def test_enable_lora_false_with_adapters_is_refused():
    with pytest.raises(ConfigError, match="enable_lora is false"):
        node_lora(None, {"enable_lora": False, "lora_modules": ["a=/x"]}, "n.engine_args")
    assert node_lora(None, {"enable_lora": False, "model": "x"}, "w") == (None, {"model": "x"})


@pytest.mark.parametrize(
    "change, message",
    [
        (
            {"base_model_name_or_path": "meta-llama/Llama-3.1-8B"},
            "base_model_name_or_path is 'meta-llama/Llama-3.1-8B'",
        ),
        ({"r": 32}, r"r is 32, above the engine's default max_lora_rank 16; set lora.max_lora_rank to at least 32"),
        ({"r": None}, "r is None, not a positive rank"),
        ({"peft_type": "IA3"}, "peft_type is 'IA3', not LORA"),
    ],
)
def test_a_bad_adapter_config_is_named_with_its_file_and_key(demo_model_path, adapter, tmp_path, change, message):
    bad = copy_adapter(adapter, tmp_path / "bad", **change)
    with pytest.raises(ConfigError, match=message) as err:
        plan(config(demo_model_path, {"adapters": {"sql": str(bad)}}))
    text = str(err.value)
    assert "LoRA adapter 'sql'" in text and f"{bad}/adapter_config.json" in text
    assert "serve[0](m).lora.adapters.sql" in text


def test_a_missing_directory_config_or_weights_is_refused_before_start(demo_model_path, adapter, tmp_path):
    with pytest.raises(ConfigError, match=rf"LoRA adapter 'sql': {tmp_path}/nowhere is no directory"):
        plan(config(demo_model_path, {"adapters": {"sql": str(tmp_path / "nowhere")}}))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"empty/adapter_config.json is missing"):
        plan(config(demo_model_path, lora_modules=[f"sql={tmp_path / 'empty'}"]))
    no_weights = copy_adapter(adapter, tmp_path / "no-weights")
    (no_weights / "adapter_model.safetensors").unlink()
    with pytest.raises(ConfigError, match=r"has no weights \(adapter_model.safetensors or adapter_model.bin\)") as err:
        plan(config(demo_model_path, lora_modules=[f"sql={no_weights}"]))
    assert "serve[0](m).engine_args.lora_modules" in str(err.value)


def test_rank_bound_and_names(demo_model_path, adapter, tmp_path):
    big = copy_adapter(adapter, tmp_path / "big", r=32)
    with pytest.raises(ConfigError, match=r"r is 32, above max_lora_rank 16"):
        plan(config(demo_model_path, {"adapters": {"sql": str(big)}, "max_lora_rank": 16}))
    assert plan(config(demo_model_path, {"adapters": {"sql": str(big)}, "max_lora_rank": 32})).engines[0].adapters
    with pytest.raises(ConfigError, match="has the name the node's base model is served by"):
        plan(config(demo_model_path, {"adapters": {"m": str(adapter)}}))
    with pytest.raises(ConfigError, match="adapter name 'a/b' is not a safe name"):
        config(demo_model_path, {"adapters": {"a/b": str(adapter)}})
    with pytest.raises(ConfigError, match=r"max_cpu_loras \(1\) must be at least max_loras \(2\)"):
        config(demo_model_path, {"max_loras": 2, "max_cpu_loras": 1})


def test_engines_without_adapter_serving_are_refused_by_name(adapter, tmp_path):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    cfg = config(gguf, {"adapters": {"sql": str(adapter)}}, engine="llama_cpp")
    with pytest.raises(ConfigError, match=r"llama.cpp applies GGUF LoRA adapters .*engine: vllm") as err:
        plan(cfg)
    assert "serve[0](m).lora" in str(err.value)


@pytest.mark.parametrize(
    "base, model, same",
    [
        ("meta-llama/Llama-3.1-8B", "/models/Llama-3.1-8B", True),
        ("/models/Llama-3.1-8B/", "meta-llama/Llama-3.1-8B", True),
        ("meta-llama/Llama-3.1-8B", "META-LLAMA/llama-3.1-8b", True),
        ("meta-llama/Llama-3.1-8B", "meta-llama/Llama-3.1-70B", False),
        ("org-a/Llama", "org-b/Llama", False),
        ("/x/hub/models--Qwen--Qwen2.5-7B/snapshots/abc", "Qwen/Qwen2.5-7B", True),
        ("/models/a", "/models/b", False),
    ],
)
def test_an_adapters_base_is_compared_as_paths_and_hub_names(base, model, same):
    assert same_base(base, model) is same


def test_a_local_base_matches_through_a_link(demo_model_path, tmp_path):
    link = tmp_path / "my-model-link"
    link.symlink_to(demo_model_path)
    assert same_base(str(link), str(demo_model_path))
