"""FlagScale's config keys, both generations: each mapping, each notice, each error. Pure logic plus vLLM's
argument parser (no Ray, no engine)."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from flagscale.actions.bench import bench_settings
from flagscale.config.compat import ignored_key_reasons
from flagscale.config.load import ConfigSources, load_config
from flagscale.config.request import bind, parse_fields
from flagscale.errors import ConfigError
from flagscale.plan import build_plan

SOURCES = ConfigSources(main="conf/serve.yaml", serve="conf/serve/7b.yaml")


def v1_config(model: str = "/m", **experiment) -> dict:
    """FlagScale v1.0 shape: the engine comes from task.backend, the node has no `engine`."""
    cfg = {
        "experiment": {
            "exp_name": "t",
            "exp_dir": "/tmp/t",
            "task": {"type": "serve", "backend": "vllm"},
            "runner": {"hostfile": None, "deploy": {"port": 8123}},
        },
        "serve": [{"serve_id": "vllm_model", "engine_args": {"model": model, "max_model_len": 256}}],
        "action": "run",
    }
    cfg["experiment"].update(experiment)
    return cfg


def error_of(cfg, cls=ConfigError) -> str:
    with pytest.raises(cls) as info:
        load_config(cfg, SOURCES)
    return str(info.value)


def plan_error(cfg, cls=ConfigError) -> str:
    with pytest.raises(cls) as info:
        build_plan(load_config(cfg, SOURCES), SOURCES, check_port=False)
    return str(info.value)


def test_backend_names_the_engine_of_nodes_without_one():
    config = load_config(v1_config(), SOURCES)
    assert config.serve[0].engine == "vllm" and config.serve[0].is_engine
    no_backend = v1_config()
    del no_backend["experiment"]["task"]["backend"]
    assert load_config(no_backend, SOURCES).serve[0].engine == "vllm"


def test_native_backend_needs_custom_nodes():
    cfg = v1_config()
    cfg["experiment"]["task"]["backend"] = "native"
    message = error_of(cfg)
    assert message.startswith("conf/serve/7b.yaml: serve[0](vllm_model)") and "backend native" in message


def test_node_engine_wins_over_backend_and_sglang_is_refused_before_start(demo_model_path, monkeypatch):
    monkeypatch.delenv("FLAGSCALE_SGLANG_PATH", raising=False)
    cfg = v1_config(str(demo_model_path))
    cfg["experiment"]["task"]["backend"] = "sglang"
    assert load_config(cfg, SOURCES).serve[0].engine == "sglang"
    message = plan_error(cfg)
    assert "serve[0](vllm_model).engine" in message and "SGLang is not installed" in message  # (no CPU runs it)
    cfg["serve"][0]["engine"] = "vllm"
    assert build_plan(load_config(cfg, SOURCES), SOURCES, check_port=False).engines[0].serve_id == "vllm_model"


def test_engine_args_specific_merges_over_engine_args(demo_model_path):
    cfg = v1_config(str(demo_model_path))
    cfg["serve"][0]["engine_args_specific"] = {
        "vllm": {"max_model_len": 128, "max-num-seqs": 4},
        "sglang": {"mem_fraction_static": 0.5},
    }
    config = load_config(cfg, SOURCES)
    assert any("engine_args_specific.sglang ignored" in n for n in config.notices)
    engine = build_plan(config, SOURCES, check_port=False).engines[0]
    assert engine.argv[engine.argv.index("--max-model-len") + 1] == "128"
    assert engine.argv[engine.argv.index("--max-num-seqs") + 1] == "4"
    cfg["serve"][0]["engine_args_specific"] = {"trtllm": {}}
    assert "unknown engine(s) ['trtllm']" in error_of(cfg)


def test_tp_from_engine_args_specific_sizes_the_replica(demo_model_path, tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("127.0.0.2 slots=8 type=gpu\n127.0.0.3 slots=8 type=gpu\n")
    cfg = v1_config(str(demo_model_path))
    cfg["experiment"]["runner"]["hostfile"] = str(hostfile)
    cfg["serve"][0]["engine_args_specific"] = {"vllm": {"tensor_parallel_size": 16}}
    plan = build_plan(load_config(cfg, SOURCES), SOURCES, check_port=False)
    assert plan.engines[0].devices_per_replica == 16 and len(plan.engines[0].placement_bundles) == 2
    assert "1 replica(s) x 16 (TP 16 x PP 1 x DP 1)" in plan.cluster.demand["gpu"]


def test_cli_args_are_engine_args_of_every_node(demo_model_path):
    cfg = v1_config(str(demo_model_path))
    cfg["experiment"]["runner"]["cli_args"] = {"max_num_seqs": 5, "max_model_len": 64}
    argv = build_plan(load_config(cfg, SOURCES), SOURCES, check_port=False).engines[0].argv
    assert argv[argv.index("--max-num-seqs") + 1] == "5"
    assert argv[argv.index("--max-model-len") + 1] == "256"  # the node's own value wins
    cfg["experiment"]["runner"]["cli_args"] = {"max_num_seq": 5}
    assert "unknown vLLM engine arg 'max_num_seq'" in plan_error(cfg)


def test_legacy_deploy_and_slide_spelling_are_mapped_with_notices():
    cfg = v1_config()
    cfg["experiment"]["deploy"] = {"port": 9001, "use_fs_server": False}
    del cfg["experiment"]["runner"]["deploy"]
    config = load_config(cfg, SOURCES)
    assert config.experiment.runner.deploy.port == 9001 and config.experiment.runner.deploy.use_fs_serve is False
    notices = "\n".join(config.notices)
    assert "experiment.deploy (FlagScale's older place)" in notices
    assert "use_fs_server (the spelling in FlagScale's slides) is read as use_fs_serve" in notices
    both = v1_config()
    both["experiment"]["deploy"] = {"port": 1}
    assert "both experiment.deploy" in error_of(both)


def test_launcher_keys_are_accepted_and_listed_in_one_notice():
    cfg = v1_config(envs={"USE_FLAGCX": True, "FLAGCX_PATH": "/x", "CUDA_DEVICE_MAX_CONNECTIONS": 1})
    cfg["experiment"]["runner"].update(
        nnodes=2,
        nproc_per_node=8,
        docker="flagos",
        no_shared_fs=True,
        device_type="gpu",
        master_addr="10.0.0.1",
        master_port=29500,
        type="ssh",
    )
    cfg["experiment"]["runner"]["deploy"].update(use_fs_serve=True, enable_composition=True)
    config = load_config(cfg, SOURCES)
    (launcher,) = [n for n in config.notices if n.startswith("ignored FlagScale launcher keys")]
    for key in (
        "runner.nnodes",
        "runner.nproc_per_node",
        "runner.docker",
        "runner.no_shared_fs",
        "runner.device_type",
        "runner.master_addr",
        "runner.master_port",
        "runner.deploy.use_fs_serve",
        "runner.deploy.enable_composition",
    ):
        assert f"experiment.{key} (" in launcher, key
    assert "runner.type" not in launcher  # used: ssh (or unset) starts the cluster over SSH, ray uses a running one
    assert any("FLAGCX_PATH, USE_FLAGCX" in n for n in config.notices)
    assert not load_config(v1_config(), SOURCES).notices  # nothing set, nothing said
    assert set(ignored_key_reasons()) >= {"experiment.runner.nnodes", "experiment.runner.deploy.use_fs_serve"}


@pytest.mark.parametrize(
    "key, value, expect",
    [
        ("nnodes", "two", "nnodes"),
        ("nproc_per_node", 0, "nproc_per_node"),
        ("no_shared_fs", "maybe", "no_shared_fs"),
        ("master_port", 70000, "master_port"),
    ],
)
def test_bad_values_in_launcher_keys_are_errors_naming_file_and_key(key, value, expect):
    cfg = v1_config()
    cfg["experiment"]["runner"][key] = value
    message = error_of(cfg)
    assert message.startswith(f"conf/serve.yaml: experiment.runner.{expect}"), message


def test_unknown_keys_flagscale_lacks_too_are_still_typos():
    cfg = v1_config()
    cfg["experiment"]["runner"]["nnode"] = 2
    assert "unknown key 'nnode'" in error_of(cfg) and "did you mean 'nnodes'" in error_of(cfg)


def test_pd_keys_make_a_prefill_and_a_decode_pool_of_every_engine_node(demo_model_path):
    cfg = v1_config(str(demo_model_path))
    deploy = cfg["experiment"]["runner"]["deploy"]
    deploy.update(
        prefill_decode_disaggregation=True,
        prefill_num=2,
        decode_num=3,
        prefill_decode_strategy="random",
        decode_gpu_memory_utilization=0.15,
    )
    cfg["serve"][0]["resources"] = {"num_cpus": 1}
    plan = build_plan(load_config(cfg, SOURCES), SOURCES, check_port=False)
    prefill, decode = plan.engines
    assert (prefill.serve_id, prefill.role, prefill.num_replicas) == ("vllm_model-prefill", "prefill", 2)
    assert (decode.serve_id, decode.role, decode.num_replicas) == ("vllm_model-decode", "decode", 3)
    assert prefill.group == decode.group == "vllm_model" and prefill.model_names == decode.model_names
    assert prefill.routing.policy == "random" and decode.routing.policy == "cache_aware"
    assert prefill.ray_actor_options["num_cpus"] == 1
    argv = " ".join(decode.argv)
    assert "--gpu-memory-utilization 0.15" in argv and '"kv_role": "kv_consumer"' in argv
    assert '"kv_load_failure_policy": "recompute"' in argv
    assert '"kv_role": "kv_producer"' in " ".join(prefill.argv)
    assert "--gpu-memory-utilization 0.15" not in " ".join(prefill.argv)


def test_pd_keys_are_checked(demo_model_path):
    cfg = v1_config(str(demo_model_path))
    deploy = cfg["experiment"]["runner"]["deploy"]
    deploy.update(prefill_decode_disaggregation=True, prefill_num=0)
    assert "experiment.runner.deploy.prefill_num" in error_of(cfg)
    deploy.update(prefill_num=1, prefill_decode_strategy="fastest")
    assert "prefill_decode_strategy" in error_of(cfg) and "'slo'" in error_of(cfg)
    deploy.update(prefill_decode_strategy="slo", decode_gpu_memory_utilization=1.5)
    assert "decode_gpu_memory_utilization" in error_of(cfg)
    deploy.update(decode_gpu_memory_utilization=None, prefill_address="elsewhere")
    message = plan_error(cfg)
    assert "deploy.prefill_address" in message and "needs runner.hostfile" in message


def test_pd_is_refused_before_start_where_it_cannot_work(demo_model_path):
    cfg = v1_config(str(demo_model_path))
    cfg["serve"][0]["disaggregation"] = {"kv_connector": "NoSuchConnector"}
    message = plan_error(cfg)
    assert "serve[0](vllm_model).disaggregation.kv_connector" in message and "has no KV connector" in message
    assert "NixlConnector" in message  # what it has
    cfg["serve"][0]["disaggregation"] = {}
    cfg["serve"][0]["engine_args"]["kv_transfer_config"] = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
    assert "not engine_args.kv_transfer_config" in plan_error(cfg)
    custom = v1_config(str(demo_model_path))
    custom["serve"].append({"serve_id": "c", "module": "x.py", "name": "C", "disaggregation": {}})
    assert "`disaggregation` is for engine nodes" in error_of(custom)


def test_auto_tuner_block_loads():
    cfg = v1_config(auto_tuner={"space": {"instance": [1, 2]}, "control": {"interval": 20, "run_best": False}})
    cfg["action"] = "auto_tune"
    config = load_config(cfg, SOURCES)
    assert config.experiment.auto_tuner.space == {"instance": [1, 2]} and config.action == "auto_tune"


def test_auto_tuner_block_under_another_action_gets_a_notice():
    cfg = v1_config(auto_tuner={"space": {"instance": [1, 2]}})
    (notice,) = [n for n in load_config(cfg, SOURCES).notices if "auto_tuner" in n]
    assert notice == "experiment.auto_tuner ignored: only action=auto_tune (and dryrun) reads it (action is run)"
    cfg["action"] = "auto_tune"
    assert not [n for n in load_config(cfg, SOURCES).notices if "auto_tuner" in n]


def test_pd_keys_while_pd_is_off_get_a_notice():
    cfg = v1_config()
    cfg["experiment"]["runner"]["deploy"].update(prefill_num=2, decode_gpu_memory_utilization=0.5)
    (notice,) = [n for n in load_config(cfg, SOURCES).notices if "prefill" in n]
    assert notice == (
        "experiment.runner.deploy.prefill_num, decode_gpu_memory_utilization ignored: "
        "prefill_decode_disaggregation is off"
    )
    cfg["experiment"]["runner"]["deploy"]["prefill_decode_disaggregation"] = False
    assert [n for n in load_config(cfg, SOURCES).notices if "prefill" in n] == [notice]
    cfg["experiment"]["runner"]["deploy"]["prefill_decode_disaggregation"] = True
    assert not [n for n in load_config(cfg, SOURCES).notices if "prefill" in n]


def test_engine_host_and_port_get_a_notice_naming_the_node_and_the_endpoint():
    cfg = v1_config()
    cfg["serve"][0]["engine_args"].update(host="0.0.0.0", port=9010)
    (notice,) = [n for n in load_config(cfg, SOURCES).notices if "engine_args" in n]
    assert notice.startswith("serve 'vllm_model': engine_args host/port not passed to the engine")
    assert "the endpoint is experiment.runner.deploy.host/port" in notice and "9010" not in notice
    # deploy.port unset: FlagScale's meaning, the first engine's port is the endpoint's, and the notice says so.
    del cfg["experiment"]["runner"]["deploy"]["port"]
    (notice,) = [n for n in load_config(cfg, SOURCES).notices if "engine_args" in n]
    assert notice.endswith("(deploy.port is unset, so the endpoint's port is this 9010)")
    cfg = v1_config()
    cfg["experiment"]["runner"]["cli_args"] = {"port": 9011}
    cfg["experiment"]["node_args"] = {"10.0.0.1": {"engine_args": {"host": "10.0.0.1"}}}
    notices = [n for n in load_config(cfg, SOURCES).notices if "engine_args" in n]
    assert notices[0].startswith("serve 'vllm_model': engine_args port not passed to the engine")
    assert notices[1].startswith("experiment.node_args.10.0.0.1.engine_args host not passed to the engine")


def test_num_replicas_auto_counts_the_target_devices(demo_model_path, tmp_path):
    import os

    cfg = v1_config(str(demo_model_path))
    cfg["serve"][0]["resources"] = {"num_replicas": "auto"}
    plan = build_plan(load_config(cfg, SOURCES), SOURCES, check_port=False)
    assert plan.engines[0].num_replicas == os.cpu_count()  # CPU engines: one core per TP rank
    assert any("num_replicas auto ->" in n for n in plan.notes)
    hostfile = tmp_path / "hosts"
    hostfile.write_text("127.0.0.2 slots=8 type=gpu\n127.0.0.3 slots=4 type=gpu\n")
    cfg["experiment"]["runner"]["hostfile"] = str(hostfile)
    cfg["serve"][0]["engine_args"]["tensor_parallel_size"] = 4
    assert build_plan(load_config(cfg, SOURCES), SOURCES, check_port=False).engines[0].num_replicas == 3
    cfg["serve"][0]["resources"] = {"num_replicas": "many"}
    assert "num_replicas" in error_of(cfg)


def test_autoscaling_delays_and_max_ongoing_reach_serve_options():
    cfg = v1_config()
    cfg["serve"][0]["resources"] = {
        "min_replicas": 1,
        "max_replicas": 3,
        "upscale_delay_s": 2,
        "downscale_delay_s": 30,
        "max_ongoing_requests": 7,
    }
    from flagscale.config.replicas import replica_settings

    scaling = replica_settings(load_config(cfg, SOURCES).serve[0].resources).serve_scaling()
    assert scaling == {
        "autoscaling_config": {"min_replicas": 1, "max_replicas": 3, "upscale_delay_s": 2, "downscale_delay_s": 30},
        "max_ongoing_requests": 7,
    }
    cfg["serve"][0]["resources"] = {"num_replicas": 2, "downscale_delay_s": 30}
    assert "either num_replicas or min_replicas/max_replicas" in error_of(cfg)


def test_node_args_must_name_hostfile_hosts_and_not_resize(demo_model_path, tmp_path):
    cfg = v1_config(str(demo_model_path), node_args={"127.0.0.9": {"engine_args": {"max_num_seqs": 2}}})
    assert "per-host engine args need runner.hostfile" in plan_error(cfg)
    hostfile = tmp_path / "hosts"
    hostfile.write_text("127.0.0.2 slots=1\n127.0.0.3 slots=1\n")
    cfg["experiment"]["runner"]["hostfile"] = str(hostfile)
    message = plan_error(cfg)
    assert "experiment.node_args.127.0.0.9" in message and "not in" in message
    cfg["experiment"]["node_args"] = {"127.0.0.3": {"engine_args": {"max_num_seqs": 2}}}
    engine = build_plan(load_config(cfg, SOURCES), SOURCES, check_port=False).engines[0]
    assert set(engine.host_argv) == {"127.0.0.3"}
    host = engine.host_argv["127.0.0.3"]
    assert host[host.index("--max-num-seqs") + 1] == "2" and "--max-num-seqs" not in engine.argv
    cfg["experiment"]["node_args"] = {"127.0.0.3": {"engine_args": {"tensor_parallel_size": 2}}}
    assert "cannot differ per host" in plan_error(cfg)
    cfg["experiment"]["node_args"] = {"127.0.0.3": {"engine_args": {"max_num_seqz": 2}}}
    message = plan_error(cfg)
    assert "experiment.node_args.127.0.0.3.engine_args" in message and "max_num_seqz" in message


def test_profile_is_the_default_of_bench_and_experiment_bench_wins():
    cfg = v1_config()
    cfg["serve"][0]["profile"] = {
        "prefix_len": 0,
        "input_len": 1024,
        "output_len": 512,
        "num_prompts": 16,
        "range_ratio": 1,
    }
    settings = bench_settings(load_config(cfg, SOURCES), "vllm_model")
    assert (settings.input_len, settings.output_len, settings.num_prompts, settings.range_ratio) == (1024, 512, 16, 1)
    cfg["experiment"]["bench"] = {"input_len": 64}
    settings = bench_settings(load_config(cfg, SOURCES), "vllm_model")
    assert (settings.input_len, settings.output_len) == (64, 512)
    cfg["serve"][0]["profile"] = {"input_len": -1}
    assert "profile.input_len" in error_of(cfg)


def test_oc_env_defaults_resolve(monkeypatch):
    monkeypatch.delenv("FS_TEST_PORT", raising=False)
    raw = v1_config()
    raw["experiment"]["runner"]["deploy"]["port"] = "${oc.env:FS_TEST_PORT,9123}"
    assert load_config(OmegaConf.create(raw), SOURCES).experiment.runner.deploy.port == 9123
    monkeypatch.setenv("FS_TEST_PORT", "9124")
    assert load_config(OmegaConf.create(raw), SOURCES).experiment.runner.deploy.port == 9124


def test_request_list_form_with_optional_fields_and_defaults():
    fields = parse_fields(
        [
            {"arg": "prompt", "type": "str"},
            {"arg": "n", "type": "int", "default": 2},
            {"arg": "tag", "type": "Optional[str]"},
            {"arg": "stop", "type": "Union[str, list]", "required": False},
            {"arg": "shape", "type": "tuple", "default": None},
        ],
        "deploy.request",
    )
    assert [f.required for f in fields] == [True, False, False, False, False]
    assert bind(fields, {"prompt": "x"}) == ({"prompt": "x", "n": 2, "tag": None, "stop": None, "shape": None}, None)
    assert bind(fields, {"prompt": "x", "shape": [1, 2], "stop": ["a"]})[0]["shape"] == (1, 2)
    assert "missing required request field(s) ['prompt']" in bind(fields, {"n": 1})[1]
    assert "'n' must be int" in bind(fields, {"prompt": "x", "n": "3"})[1]
    assert "'stop' must be Union[str, list]" in bind(fields, {"prompt": "x", "stop": 3})[1]
    old = parse_fields({"args": ["prompt"], "types": ["str"]}, "deploy.request")
    assert old[0].required and bind(old, {"prompt": "y"}) == ({"prompt": "y"}, None)


@pytest.mark.parametrize(
    "request_, expect",
    [
        ([{"arg": "p", "type": "string"}], "unsupported type 'string'"),
        ([{"arg": "p", "type": "Optional[int"}], "missing ']'"),
        ([{"arg": "p", "typ": "str"}], "unknown key(s) ['typ']"),
        ([{"arg": "p"}, {"arg": "p"}], "duplicates"),
        ([{"arg": "n", "type": "int", "default": "x"}], "default 'x' of field 'n' is not a int"),
        ([{"arg": "n", "type": "int", "required": True, "default": 1}], "required and has a default"),
    ],
)
def test_request_field_errors_name_the_entry(request_, expect):
    with pytest.raises(ConfigError) as info:
        parse_fields(request_, "conf/serve.yaml: experiment.runner.deploy.request")
    assert expect in str(info.value) and "deploy.request" in str(info.value)


def test_pools_land_on_their_chip_types_and_a_pinned_pool_on_its_host(demo_model_path, tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("127.0.0.2 slots=2 type=cpu:chipA\n127.0.0.3 slots=1 type=cpu:chipB\n")
    cfg = v1_config(str(demo_model_path))
    cfg["experiment"]["runner"]["hostfile"] = str(hostfile)
    cfg["serve"][0]["disaggregation"] = {
        "prefill": {"resources": {"num_replicas": 2, "accelerator": "chipA"}},
        "decode": {"resources": {"num_replicas": 1, "accelerator": "chipB"}, "host": "127.0.0.3"},
    }
    prefill, decode = build_plan(load_config(cfg, SOURCES), SOURCES, check_port=False).engines
    assert prefill.chip == "chipA" and decode.chip == "chipB"
    assert "accelerator_type:cpu:chipA" in str(prefill.ray_actor_options)
    assert decode.pinned_host == "127.0.0.3" and decode.ray_actor_options["resources"]["node:127.0.0.3"] > 0
    cfg["serve"][0]["disaggregation"]["decode"]["host"] = "127.0.0.9"
    message = plan_error(cfg)
    assert "disaggregation.decode.host" in message and "127.0.0.9" in message and "not in" in message
    cfg["serve"][0]["disaggregation"]["decode"] = {"resources": {"accelerator": "chipC"}}
    assert "chipC" in plan_error(cfg)
