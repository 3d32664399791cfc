"""Schema and config loading: pure logic, no Ray, no vLLM."""

import pytest

from flagscale.config.load import ConfigSources, load_config
from flagscale.errors import ConfigError

SOURCES = ConfigSources(main="conf/serve.yaml", serve="conf/serve/demo.yaml")


def base(**overrides):
    cfg = {
        "experiment": {
            "exp_name": "t",
            "exp_dir": "/tmp/t",
            "task": {"type": "serve"},
            "runner": {"deploy": {"port": 8123}},
        },
        "serve": [{"serve_id": "a", "engine": "vllm", "engine_args": {"model": "/m"}}],
        "action": "run",
    }
    cfg.update(overrides)
    return cfg


def error_of(cfg) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(cfg, SOURCES)
    return str(info.value)


def test_valid_config_loads():
    config = load_config(base(), SOURCES)
    assert config.serve[0].serve_id == "a"
    assert config.experiment.runner.deploy.port == 8123


def test_unknown_key_suggests_the_close_one_and_names_the_file():
    cfg = base()
    cfg["serve"][0]["resources"] = {"num_replica": 2}
    message = error_of(cfg)
    assert "conf/serve/demo.yaml" in message
    assert "serve[0](a).resources" in message
    assert "'num_replica'" in message and "did you mean 'num_replicas'" in message


def test_unknown_key_in_experiment_names_main_file():
    cfg = base()
    cfg["experiment"]["runner"]["hostfiel"] = None
    message = error_of(cfg)
    assert message.startswith("conf/serve.yaml: experiment.runner")
    assert "did you mean 'hostfile'" in message


def test_unknown_engine():
    cfg = base()
    cfg["serve"][0]["engine"] = "trtllm"
    assert "unknown engine 'trtllm'" in error_of(cfg)


def test_unknown_action_lists_the_valid_ones():
    message = error_of(base(action="launch"))
    assert "unknown action 'launch'" in message and "dryrun" in message


def test_wrong_type_reports_the_value():
    cfg = base()
    cfg["experiment"]["runner"]["deploy"]["port"] = "eighty"
    message = error_of(cfg)
    assert "experiment.runner.deploy.port" in message and "eighty" in message


def test_replicas_and_autoscaling_are_exclusive():
    cfg = base()
    cfg["serve"][0]["resources"] = {"num_replicas": 2, "max_replicas": 4}
    assert "either num_replicas or min_replicas/max_replicas" in error_of(cfg)


def test_serve_must_be_a_list():
    message = error_of(base(serve={"serve_id": "a"}))
    assert "conf/serve/demo.yaml" in message and "must be a list" in message


def test_legacy_experiment_deploy_is_moved_under_runner():
    cfg = base()
    cfg["experiment"]["deploy"] = cfg["experiment"]["runner"].pop("deploy")
    assert load_config(cfg, SOURCES).experiment.runner.deploy.port == 8123


def test_hyphenated_engine_args_are_normalised():
    cfg = base()
    cfg["serve"][0]["engine_args"]["max-model-len"] = 512
    assert load_config(cfg, SOURCES).serve[0].engine_args["max_model_len"] == 512


def test_env_values_are_scalars_with_per_host_overrides():
    cfg = base()
    cfg["experiment"]["envs"] = {"A": 1, "B": True, "nodes_envs": {"h1": {"A": 2}}}
    config = load_config(cfg, SOURCES)
    assert config.experiment.env_for() == {"A": "1", "B": "1"}
    assert config.experiment.env_for("h1") == {"A": "2", "B": "1"}


@pytest.mark.parametrize(
    "envs",
    [{"FLAGSCALE_NIXL_PROGRESS_PAUSE_US": "1ms"}, {"nodes_envs": {"h1": {"FLAGSCALE_NIXL_PROGRESS_PAUSE_US": -5}}}],
)
def test_a_nixl_progress_pause_that_is_no_whole_number_is_refused_before_start(envs):
    cfg = base()
    cfg["experiment"]["envs"] = envs
    message = error_of(cfg)
    assert "experiment.envs" in message and "FLAGSCALE_NIXL_PROGRESS_PAUSE_US=" in message, message
    assert "microseconds, a whole number" in message, message
    cfg["experiment"]["envs"] = {"FLAGSCALE_NIXL_PROGRESS_PAUSE_US": 250}
    assert load_config(cfg, SOURCES).experiment.env_for() == {"FLAGSCALE_NIXL_PROGRESS_PAUSE_US": "250"}


def test_cpu_affinity_is_auto_or_off():
    assert load_config(base(), SOURCES).experiment.runner.deploy.cpu_affinity == "auto"
    cfg = base()
    cfg["experiment"]["runner"]["deploy"]["cpu_affinity"] = "pinned"
    message = error_of(cfg)
    assert "cpu_affinity" in message and "pinned" in message
