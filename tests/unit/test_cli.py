"""The `flagscale` command's argv -> (config dir, config name, Hydra overrides) mapping: pure logic, nothing runs."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import pytest
import yaml
from hydra.core.override_parser.overrides_parser import OverridesParser

from flagscale.actions.invocation import RUN_PY
from flagscale.cli import argv as cli_argv
from flagscale.cli.hydra_entry import absolute_config_path
from flagscale.cli.main import ACTION_HELP, hydra_call
from flagscale.cli.resources import conf_dir, example_names, examples_dir
from flagscale.config.cli import ids_as_text
from flagscale.errors import ConfigError
from tests.conftest import REPO


def test_serve_demo_is_the_embedded_default_config():
    call = hydra_call(["serve", "demo"])
    assert (call.config_dir, call.config_name) == (REPO / "conf", "serve")
    assert call.overrides == ["action=run"]
    assert call.argv() == ["--config-path", str(REPO / "conf"), "--config-name", "serve", "action=run"]


def test_serve_name_finds_the_example():
    call = hydra_call(["serve", "graph", "--dryrun"])
    assert (call.config_dir, call.config_name) == (REPO / "examples" / "graph" / "conf", "serve")
    assert call.overrides == ["action=dryrun"]


def test_serve_a_yaml_file_or_a_directory(tmp_path, monkeypatch):
    (tmp_path / "conf" / "serve").mkdir(parents=True)
    (tmp_path / "conf" / "serve.yaml").write_text("{}\n")
    (tmp_path / "conf" / "mine.yaml").write_text("{}\n")
    monkeypatch.chdir(tmp_path)
    call = hydra_call(["serve", "./conf/mine.yaml"])
    assert (call.config_dir, call.config_name) == (tmp_path / "conf", "mine")
    call = hydra_call(["serve", str(tmp_path)])
    assert (call.config_dir, call.config_name) == (tmp_path / "conf", "serve")
    call = hydra_call(["serve", "qwen3", "-c", "conf/mine.yaml"])  # -c names the file; the model only labels it
    assert (call.config_dir, call.config_name) == (tmp_path / "conf", "mine")
    call = hydra_call(["serve", "-c", "conf/mine.yaml", "--status"])
    assert (call.config_name, call.overrides) == ("mine", ["action=status"])


@pytest.mark.parametrize(("flag", "action"), [(f"--{f}", a) for f, a in cli_argv.SERVE_ACTIONS.items()])
def test_every_action_flag(flag, action):
    assert hydra_call(["serve", "demo", flag]).overrides == [f"action={action}"]


def test_port_model_path_and_engine_args_become_overrides(tmp_path):
    model = tmp_path / "my model"
    model.mkdir()
    engine_args = {
        "max_model_len": 4096,
        "enforce_eager": True,
        "quantization": None,
        "compilation_config": {"level": 3},
    }
    call = hydra_call(
        ["serve", "demo", "--port", "9000", "--model-path", str(model), "--engine-args", json.dumps(engine_args)]
    )
    assert call.overrides == [
        "action=run",
        "experiment.runner.deploy.port=9000",
        f"serve.0.engine_args.model='{model}'",
        "serve.0.engine_args.max_model_len=4096",
        "serve.0.engine_args.enforce_eager=true",
        "serve.0.engine_args.quantization=null",
        "serve.0.engine_args.compilation_config.level=3",
    ]
    hub_id = hydra_call(["serve", "demo", "--model-path", "Qwen/Qwen2.5-7B-Instruct"]).overrides[-1]
    assert hub_id == "serve.0.engine_args.model='Qwen/Qwen2.5-7B-Instruct'"  # not a local path: kept as given


def test_overrides_go_through_before_and_after_the_flags():
    call = hydra_call(["serve", "demo", "foreground=true", "--port", "9001", "output=json", "--status"])
    assert call.overrides == ["action=status", "experiment.runner.deploy.port=9001", "foreground=true", "output=json"]
    call = hydra_call(["serve", "-c", str(REPO / "conf" / "serve.yaml"), "serve=demo"])
    assert call.overrides == ["action=run", "serve=demo"]


@pytest.mark.parametrize(
    "value", ["plain", "with space", "a=b:c/d", "it's", 'say "hi"', "back\\slash", "end\\", "a\\'b", 1, 2.5]
)
def test_hydra_value_reads_back_as_the_same_value(value):
    override = OverridesParser.create().parse_override(f"key={cli_argv.hydra_value(value)}")
    assert override.value() == value


def test_hydra_value_of_lists_and_dicts():
    parser = OverridesParser.create()
    assert parser.parse_override(f"k={cli_argv.hydra_value([1, 'a b', True])}").value() == [1, "a b", True]
    assert parser.parse_override(f"k={cli_argv.hydra_value({'x': 1})}").value() == {"x": 1}


@pytest.mark.parametrize(
    ("argv", "names"),
    [
        (["serve", "nope"], "serve nope"),
        (["serve", "./missing.yaml"], "serve ./missing.yaml"),
        (["serve", "demo", "--engine-args", "{x"], "--engine-args"),
        (["serve", "demo", "--engine-args", "[1]"], "--engine-args"),
        (["serve", "demo", "stray"], "stray"),
        (["serve"], "serve"),
        (["run", "-p", "/no/such/dir", "-n", "x"], "-p /no/such/dir"),
        (["run", "-p", str(REPO / "conf"), "-n", "nope"], "-n nope"),
    ],
)
def test_errors_name_the_file_or_flag(argv, names):
    with pytest.raises(ConfigError) as info:
        hydra_call(argv)
    assert str(info.value).startswith(names + ":"), info.value
    assert info.value.exit_code != 0


def test_unknown_example_lists_the_known_ones():
    with pytest.raises(ConfigError, match=r"known: demo, .*graph"):
        hydra_call(["serve", "nope"])


def test_a_yml_file_is_refused_with_the_reason(tmp_path):
    (tmp_path / "x.yml").write_text("{}\n")
    with pytest.raises(ConfigError, match=r"must end in \.yaml"):
        hydra_call(["serve", str(tmp_path / "x.yml")])


def test_argparse_errors_exit_non_zero(capsys):
    for argv in (["serve", "demo", "--stop", "--status"], ["bogus"], ["run", "-n", "serve"], ["serve", "--port", "x"]):
        with pytest.raises(SystemExit) as info:
            hydra_call(argv)
        assert info.value.code == 2
    assert "not allowed with argument --stop" in capsys.readouterr().err


def test_run_maps_flagscale_run():
    call = hydra_call(["run", "-p", str(REPO / "conf"), "-n", "serve.yaml", "-a", "dryrun", "foreground=true"])
    assert call.argv() == [
        "--config-path",
        str(REPO / "conf"),
        "--config-name",
        "serve",
        "action=dryrun",
        "foreground=true",
    ]
    assert hydra_call(["run", "-p", str(REPO / "conf")]).overrides == []  # the config's own action


def test_help_lists_every_action_with_one_line(capsys):
    for argv in (["--help"], ["serve", "--help"], []):
        with pytest.raises(SystemExit):
            hydra_call(argv)
    out = capsys.readouterr().out
    assert re.search(r"^\s+serve\s+\S", out, re.M) and re.search(r"^\s+run\s+\S", out, re.M)
    for flag in ACTION_HELP:
        assert re.search(rf"^\s+--{flag}\s+\S", out, re.M), flag


def test_relative_config_path_is_read_against_the_base_dir(tmp_path):
    argv = ["--config-path", "examples/x", "-cp=conf", "--config-name", "serve", "a=b"]
    assert absolute_config_path(argv, tmp_path) == [
        "--config-path",
        str(tmp_path / "examples" / "x"),
        f"-cp={tmp_path / 'conf'}",
        "--config-name",
        "serve",
        "a=b",
    ]
    assert absolute_config_path(["--config-path", "/abs"], tmp_path) == ["--config-path", "/abs"]


def test_resources_are_the_checkout_when_run_from_it():
    assert conf_dir() == REPO / "conf"
    assert examples_dir() == REPO / "examples"
    assert example_names() == sorted(p.parent.parent.name for p in (REPO / "examples").glob("*/conf/serve.yaml"))


def _pins(lines) -> list[str]:
    reqs = [line.split("#", 1)[0].strip() for line in lines]
    return [r for r in reqs if r and not r.startswith("-")]


def test_package_dependencies_are_requirements_base_txt():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    base = _pins((REPO / "requirements" / "base.txt").read_text().splitlines())
    declared = project["dependencies"] + project["optional-dependencies"]["dev"]
    assert sorted(declared) == sorted(base)
    cpu = _pins((REPO / "requirements" / "cpu.txt").read_text().splitlines())
    assert [r for r in cpu if r.startswith("vllm")] == project["optional-dependencies"]["cpu"]
    assert project["scripts"]["flagscale"] == "flagscale.cli.main:main"


def test_wheel_carries_the_shipped_configs():
    force = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["hatch"]["build"]["targets"]["wheel"]
    assert force["force-include"] == {"conf": "flagscale/_data/conf", "examples": "flagscale/_data/examples"}
    assert Path(REPO / "flagscale" / "cli" / "resources.py").read_text().count('"_data"') == 1


def _examples() -> list[Path]:
    return sorted(p.parent.parent for p in (REPO / "examples").glob("*/conf/serve.yaml"))


def test_every_example_has_a_readme_its_modules_and_a_row_in_the_index():
    index = (REPO / "examples" / "README.md").read_text()
    assert len(_examples()) >= 11
    for example in _examples():
        assert (example / "README.md").is_file(), example
        assert f"[{example.name}]({example.name}/)" in index, example.name
        for config in (example / "conf").glob("*.yaml"):
            for entry in yaml.safe_load(config.read_text())["defaults"]:
                if isinstance(entry, dict) and "serve" in entry:
                    assert (example / "conf" / "serve" / f"{entry['serve']}.yaml").is_file(), (config, entry)


GPU_ENVS = {"NCCL_NVLS_ENABLE": 0, "TORCH_SYMM_MEM_DISABLE_MULTICAST": 1, "NVSHMEM_DISABLE_NVLS": 1}


def test_every_gpu_example_turns_nvlink_multicast_off():
    gpu = [e for e in _examples() if e.name.startswith("gpu_")]
    assert {e.name for e in gpu} == {"gpu_8b", "gpu_70b", "gpu_moe_ep"}
    for example in gpu:
        envs = yaml.safe_load((example / "conf" / "serve.yaml").read_text())["experiment"]["envs"]
        assert GPU_ENVS.items() <= envs.items(), (example.name, envs)
        for module in (example / "conf" / "serve").glob("*.yaml"):
            for node in yaml.safe_load(module.read_text()):
                assert "model" in node["engine_args"] and node["engine_args"]["tensor_parallel_size"] >= 1, module


def test_what_to_type_next_is_said_in_the_form_the_user_typed(tmp_path):
    """The summary's and errors' next commands: `flagscale serve demo --status` after `flagscale serve demo`, the
    start-only flags left out; `flagscale run -p ... -a status`; `python run.py ... action=status` otherwise."""
    serve = hydra_call(["serve", "demo", "--port", "9001", "experiment.exp_name=x"]).invocation
    assert serve.command("status") == "flagscale serve demo experiment.exp_name=x --status"
    assert serve.command("stop") == "flagscale serve demo experiment.exp_name=x --stop"
    assert serve.command("auto_tune") == "flagscale serve demo experiment.exp_name=x --tune"
    assert serve.command("run") == "flagscale serve demo experiment.exp_name=x"
    (tmp_path / "my conf").mkdir()
    (tmp_path / "my conf" / "mine.yaml").write_text("{}\n")
    run = hydra_call(["run", "-p", str(tmp_path / "my conf"), "-n", "mine"]).invocation
    assert run.command("stop") == f"flagscale run -p '{tmp_path / 'my conf'}' -n mine -a stop"
    assert RUN_PY.command("status") == "python run.py ... action=status"


@pytest.mark.parametrize("typed", ["1e523", "4", "0x1f", "true", "null", "ab12cd"])
def test_ids_typed_on_the_command_line_reach_the_config_as_typed(typed):
    """A replica id's prefix is whatever Ray drew: Hydra would read `1e523` as infinity and `true` as a bool."""
    for key in ("replica", "++replica", "serve_id"):
        (arg,) = ids_as_text([f"{key}={typed}"])
        (override,) = OverridesParser.create().parse_overrides([arg])
        assert override.value() == typed, arg
    assert ids_as_text(["replica='x'", "lines=5", "replica="]) == ["replica='x'", "lines=5", "replica="]
