"""The engine interface (flagscale/engines/): the contract every registered kind keeps, and each kind's argv and
FlagScale mapping. llama.cpp's flag table comes from a stand-in binary printing help text in llama-server's
layout (the real binary's table is checked too when it is built: `make llama-cpp`)."""

from __future__ import annotations

import stat

import pytest

from flagscale import engines
from flagscale.config.load import ConfigSources, load_config
from flagscale.engines import llama_cpp, llama_cpp_build
from flagscale.engines.base import Capabilities, EngineKind, ServerLaunch
from flagscale.errors import ConfigError
from flagscale.plan import build_plan

# llama-server --help's layout (common/arg.cpp: spellings, value hint, help text at column 40 or on the next line)
HELP = """\
----- common params -----

-h,    --help, --usage                  print usage and exit
-t,    --threads N                      number of CPU threads to use during generation (default: -1)
                                        (env: LLAMA_ARG_THREADS)
-c,    --ctx-size N                     size of the prompt context (default: 0, 0 = loaded from model)
-b,    --batch-size N                   logical maximum batch size (default: 2048)
-ngl,  --gpu-layers, --n-gpu-layers N   max. number of layers to store in VRAM
-kvu,  --kv-unified, -no-kvu, --no-kv-unified
                                        use single unified KV buffer shared across all sequences
--kv-unified-per-slot N                 context limit per parallel slot (default: unset, behavior unchanged).
-cb,   --cont-batching, -nocb, --no-cont-batching
                                        whether to enable continuous batching (default: enabled)
-m,    --model FNAME                    model path to load
-a,    --alias STRING                   set model name aliases, comma-separated (to be used by API)
--host HOST                             ip address to listen (default: 127.0.0.1)
--port PORT                             port to listen (default: 8080)
-hft,  --hf-token TOKEN                 Hugging Face access token (default: value from HF_TOKEN environment
                                        variable)
--api-key KEY                           API key to use for authentication, multiple keys can be provided as a
                                        comma-separated list (default: none)
--api-key-file FNAME                    path to file containing API keys (default: none)
--metrics                               enable prometheus compatible metrics endpoint (default: disabled)
-np,   --parallel N                     number of server slots (default: -1, -1 = auto)
"""


@pytest.fixture
def fake_llama_server(tmp_path, monkeypatch):
    binary = tmp_path / "bin" / "llama-server"
    binary.parent.mkdir()
    (tmp_path / "help.txt").write_text(HELP)
    binary.write_text(f"#!/bin/sh\ncat {tmp_path / 'help.txt'}\n")
    binary.chmod(binary.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setattr(llama_cpp_build, "server_binary", lambda cache_dir=None: binary)
    return binary


@pytest.fixture
def gguf(tmp_path):
    path = tmp_path / "tiny.gguf"
    path.write_bytes(b"GGUF" + b"\0" * 60)
    return path


KIND = llama_cpp.KIND


def llama_argv(args: dict, model) -> list[str]:
    return KIND.argv(KIND.map_common_args({"model": str(model), **args}), "serve[0](tiny).engine_args")


# ---- the contract, for every registered kind ----


@pytest.mark.parametrize("name", list(engines.ENGINES))
def test_every_kind_is_registered_under_its_own_name_and_describes_itself(name):
    kind = engines.get(name)
    assert isinstance(kind, EngineKind) and kind.name == name and kind.display
    assert isinstance(kind.capabilities, Capabilities)
    assert set(kind.capabilities.parallel) <= {"tp", "pp", "dp"}
    assert kind.health_path.startswith("/")
    # the load is made of samples status shows too: what autoscaling acts on, an operator can read
    assert set(kind.load_metrics) <= set(kind.status_gauges), kind.load_metrics
    assert not set(kind.ignored_args) & {"model", "served_model_name", "max_num_seqs", "max_model_len"}
    assert kind.load({m: 2.0 for m in kind.load_metrics}) == 2.0 * len(kind.load_metrics)


@pytest.mark.parametrize("name", list(engines.ENGINES))
def test_every_kind_maps_common_args_from_its_tables(name):
    """One loop on the base renames common_args and drops ignored_args: a kind states its keys, not the loop."""
    kind = engines.get(name)
    assert type(kind).map_common_args is EngineKind.map_common_args
    assert not set(kind.common_args) & set(kind.ignored_args)
    for common, own in kind.common_args.items():
        assert kind.map_common_args({common: 1}) == {own: 1}
        assert kind.map_common_args({common: 1, own: 2}) == {own: 2}  # the engine's own key wins
    assert kind.map_common_args({key: 1 for key in kind.ignored_args}) == {}


@pytest.mark.parametrize("name", list(engines.ENGINES))
def test_every_kind_serves_or_refuses_consistently(name, fake_llama_server, gguf):
    """A kind that cannot run here refuses at check_available and at argv after it; every kind serves on the host
    and port it is given, with the API key in its secret env and never in argv."""
    kind = engines.get(name)
    try:
        kind.check_available("serve[0]")
    except ConfigError:
        with pytest.raises(ConfigError):
            kind.argv({"model": str(gguf)}, "serve[0].engine_args")
    launch = kind.launch(["--model", "m"], "127.0.0.1", 12345, "the-key", None)
    assert isinstance(launch, ServerLaunch)
    assert "12345" in launch.argv and "127.0.0.1" in launch.argv
    assert "the-key" not in " ".join(launch.argv) and "the-key" in launch.secret_env.values()
    assert "the-key" not in " ".join(f"{k}={v}" for k, v in {**launch.env, **launch.env_defaults}.items())
    without_key = kind.launch(["--model", "m"], "127.0.0.1", 12345, None, None)
    assert not without_key.secret_env


@pytest.mark.parametrize("name", list(engines.ENGINES))
def test_kinds_without_kv_transfer_say_so(name):
    kind = engines.get(name)
    if not kind.capabilities.kv_transfer:
        with pytest.raises(NotImplementedError):
            kind.kv_transfer_args(None, "prefill", True, {})


# ---- vLLM: FlagScale's common keys are its own spellings ----


def test_vllm_passes_flagscale_keys_through():
    args = {"model": "m", "max_num_seqs": 4, "max_model_len": 512, "served_model_name": ["a"], "dtype": "float32"}
    kind = engines.get("vllm")
    assert kind.map_common_args(args) == args and not kind.ignored_args
    assert kind.parallel({"tensor_parallel_size": 2, "pipeline_parallel_size": 2}, "w") == (2, 2, 1)


# ---- llama.cpp ----


def test_llama_cpp_hf_token_goes_by_the_env_never_argv(fake_llama_server, gguf):
    argv = llama_argv({"hf_token": "hf_secret", "threads": 2}, gguf)
    assert "hf_secret" not in " ".join(argv) and "--hf-token" not in argv
    assert KIND.secret_env({"hf_token": "hf_secret"}, "w") == {"HF_TOKEN": "hf_secret"}  # llama-server reads HF_TOKEN
    assert "hf_token" in KIND.secret_args


def llama_config(gguf, deploy: dict) -> dict:
    return {
        "experiment": {
            "exp_name": "t",
            "exp_dir": "/tmp/t",
            "task": {"type": "serve"},
            "runner": {"hostfile": None, "deploy": {"port": 8123, **deploy}},
        },
        "serve": [{"serve_id": "m", "engine": "llama_cpp", "engine_args": {"model": str(gguf)}}],
        "action": "run",
    }


@pytest.mark.parametrize("deploy", [{"api_key": "one,two,three-four-five"}, {"api_key_env": "FS_TEST_COMMA_KEY"}])
def test_llama_cpp_refuses_a_key_with_a_comma_naming_the_key(fake_llama_server, gguf, monkeypatch, deploy):
    from flagscale.config.load import ConfigSources, load_config
    from flagscale.plan import build_plan

    monkeypatch.setenv("FS_TEST_COMMA_KEY", "one,two,three-four-five")
    sources = ConfigSources(main="conf/serve.yaml")
    with pytest.raises(ConfigError) as info:
        build_plan(load_config(llama_config(gguf, deploy), sources), sources, check_port=False)
    entry = next(iter(deploy))
    assert f"conf/serve.yaml: experiment.runner.deploy.{entry}" in str(info.value) and "','" in str(info.value)
    assert "one,two,three-four-five" not in str(info.value)
    plan = build_plan(
        load_config(llama_config(gguf, {"api_key": "one-two-three-four-five"}), sources), sources, check_port=False
    )
    assert plan.api_key == "one-two-three-four-five"


def test_llama_cpp_names_the_request_headers_the_router_drops():
    assert "x-conversation-id" in KIND.dropped_request_headers
    assert all(h == h.lower() for name in engines.ENGINES for h in engines.get(name).dropped_request_headers)
    assert "x-conversation-id" in engines.dropped_request_headers()  # what the router drops, over every kind


def test_llama_cpp_maps_flagscale_keys(fake_llama_server, gguf):
    argv = llama_argv(
        {"max_num_seqs": 4, "max_model_len": 512, "served_model_name": ["tiny", "small"], "n_gpu_layers": 0},
        gguf,
    )
    assert argv == [
        "--model",
        str(gguf),
        "--parallel",
        "4",
        "--kv-unified-per-slot",
        "512",
        "--alias",
        "tiny,small",
        "--n-gpu-layers",
        "0",
    ]


def test_llama_cpp_dryrun_shows_the_flags_its_argv_sets():
    argv = ["--model", "/m.gguf", "--parallel", "4", "--n-gpu-layers", "-1", "--no-cont-batching", "--alias", "a,b"]
    assert KIND.shown_args(argv) == {
        "model": "/m.gguf",
        "parallel": "4",
        "n_gpu_layers": "-1",
        "no_cont_batching": True,
        "alias": "a,b",
    }


def test_llama_cpp_own_key_wins_over_the_common_one(fake_llama_server, gguf):
    argv = llama_argv({"max_num_seqs": 4, "parallel": 2}, gguf)
    assert argv[argv.index("--parallel") + 1] == "2" and argv.count("--parallel") == 1


def test_llama_cpp_drops_vllm_keys_and_host_port(fake_llama_server, gguf):
    args = {"gpu_memory_utilization": 0.9, "dtype": "float32", "enforce_eager": True, "host": "0.0.0.0", "port": 1}
    args.update(tensor_parallel_size=1, pipeline_parallel_size=1)
    assert llama_argv(args, gguf) == ["--model", str(gguf)]
    assert set(KIND.ignored_args) >= {"gpu_memory_utilization", "dtype", "enforce_eager"}


def test_llama_cpp_switches(fake_llama_server, gguf):
    assert llama_argv({"cont_batching": False, "kv_unified": True}, gguf)[2:] == ["--no-cont-batching", "--kv-unified"]
    with pytest.raises(ConfigError, match="always on"):  # managed, not a user switch
        llama_argv({"metrics": True}, gguf)
    with pytest.raises(ConfigError, match="--kv-unified is a switch"):
        llama_argv({"kv_unified": 3}, gguf)
    with pytest.raises(ConfigError, match="--threads takes a value"):
        llama_argv({"threads": True}, gguf)


def test_llama_cpp_unknown_key_names_it_and_the_closest_flags(fake_llama_server, gguf):
    with pytest.raises(ConfigError) as info:
        llama_argv({"n_gpu_layer": 0}, gguf)
    assert "--n-gpu-layer" in str(info.value) and "n_gpu_layers" in str(info.value)
    assert str(info.value).startswith("serve[0](tiny).engine_args.n_gpu_layer")


@pytest.mark.parametrize("key", ["api_key", "api_key_file", "alias", "metrics", "api_prefix"])
def test_llama_cpp_managed_keys_are_refused(fake_llama_server, gguf, key):
    with pytest.raises(ConfigError, match=key):
        llama_argv({key: "x"}, gguf)


@pytest.mark.parametrize("key", ["tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"])
def test_llama_cpp_refuses_parallel_ranks(key):
    assert KIND.parallel({key: 1}, "w") == (1, 1, 1)
    with pytest.raises(ConfigError, match=f"{key}: 2"):
        KIND.parallel({key: 2}, "w")


def test_llama_cpp_model_must_be_a_gguf_file(tmp_path, gguf):
    assert KIND.check_model(str(gguf), "w") == str(gguf.resolve())
    (tmp_path / "hf").mkdir()
    (tmp_path / "weights.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}")
    cases = {
        str(tmp_path / "hf"): "is a directory",
        str(tmp_path / "weights.safetensors"): "is not a GGUF file",
        str(tmp_path / "missing.gguf"): "cannot be read",
        None: "model is required",
    }
    for model, message in cases.items():
        with pytest.raises(ConfigError, match=message) as info:
            KIND.check_model(model, "serve[0](tiny).engine_args")
        if model:
            assert model in str(info.value)


def test_llama_cpp_launch(fake_llama_server):
    launch = KIND.launch(["--model", "m.gguf"], "10.0.0.2", 8080, "k", None)
    assert launch.argv[0] == str(fake_llama_server)
    assert launch.argv[1:] == [
        "--model",
        "m.gguf",
        "--metrics",
        "--host",
        "10.0.0.2",
        "--port",
        "8080",
        "--threads",
        "1",
        "--device",
        "none",
    ]
    assert launch.secret_env == {"LLAMA_API_KEY": "k"}
    own = KIND.launch(["--model", "m.gguf", "--threads", "3", "--device", "CUDA0"], "10.0.0.2", 8080, None, None)
    assert own.argv.count("--threads") == 1 and own.argv.count("--device") == 1


def test_llama_cpp_replica_with_a_gpu_puts_every_layer_on_it_unless_told(fake_llama_server, monkeypatch):
    monkeypatch.setattr(llama_cpp, "reserved_gpus", lambda: ["3"])
    launch = KIND.launch(["--model", "m.gguf"], "10.0.0.2", 8080, None, None)
    assert launch.argv[-2:] == ["--n-gpu-layers", "all"] and "--device" not in launch.argv
    own = KIND.launch(["--model", "m.gguf", "--n-gpu-layers", "20"], "10.0.0.2", 8080, None, None)
    assert own.argv.count("--n-gpu-layers") == 1 and "all" not in own.argv


def test_llama_cpp_missing_binary_names_the_make_target(tmp_path, monkeypatch):
    monkeypatch.setattr(llama_cpp_build, "server_binary", lambda cache_dir=None: tmp_path / "nothing")
    with pytest.raises(ConfigError, match="make llama-cpp"):
        KIND.check_available("serve[0](tiny).engine")


def test_llama_cpp_load_from_its_metrics():
    metrics = {"llamacpp:requests_processing": 2.0, "llamacpp:requests_deferred": 3.0, "llamacpp:n_decode_total": 9.0}
    assert KIND.load(metrics) == 5.0
    assert KIND.status_load(metrics) == {"running": 2.0, "waiting": 3.0}


def test_help_table_parse_and_cache(fake_llama_server):
    table = llama_cpp.flag_table(fake_llama_server)
    assert table["--threads"].takes_value and table["--threads"].names == ("-t", "--threads")
    assert table["--n-gpu-layers"] == table["--gpu-layers"] and table["--n-gpu-layers"].takes_value
    assert not table["--kv-unified"].takes_value and "--no-kv-unified" in table
    assert not table["--metrics"].takes_value and table["--kv-unified-per-slot"].takes_value
    assert table["--api-key"].takes_value
    assert all(name[2].isalnum() for name in table)  # not the section titles
    (fake_llama_server.parent.parent / "help.txt").write_text("")  # the binary changes nothing; the cache answers
    assert llama_cpp.flag_table(fake_llama_server) == table


def test_the_built_llama_server_has_the_flags_mapped_to():
    binary = llama_cpp_build.server_binary()
    if not binary.is_file():
        pytest.skip("llama-server is not built here (make llama-cpp)")
    table = llama_cpp.flag_table(binary)
    wanted = ["--parallel", "--kv-unified-per-slot", "--alias", "--model", "--threads", "--metrics", "--host"]
    assert all(table[name] for name in [*wanted, "--port", "--n-gpu-layers", "--device", "--no-cont-batching"])
    assert not table["--metrics"].takes_value and table["--parallel"].takes_value


# ---- SGLang: where it is not installed (every CPU machine), refused before start; the rest: test_sglang.py ----


def test_sglang_is_refused_naming_what_it_lacks(monkeypatch):
    monkeypatch.delenv("FLAGSCALE_SGLANG_PATH", raising=False)
    with pytest.raises(ConfigError, match="SGLang is not installed in this Python environment") as info:
        engines.get("sglang").check_available("serve[0](x).engine")
    assert "FLAGSCALE_SGLANG_PATH" in str(info.value) and "docs/engines.md" in str(info.value)


# ---- engine args that hand every client more than the model need the node to opt in (issue 34, item 2) ----


def test_unsafe_engine_args_are_refused_unless_the_node_opts_in():
    kind = KIND
    where = "serve[0](tiny).engine_args"
    for key, value in (("tools", "all"), ("agent", True), ("ui_mcp_proxy", True), ("slot_save_path", "/tmp/s")):
        with pytest.raises(ConfigError) as info:
            kind.check_unsafe_args({key: value}, [], where)
        assert info.value.where == f"{where}.{key}" and f"allow_engine_args: [{key}]" in str(info.value)
        kind.check_unsafe_args({key: value}, [key], where)  # opted in by name
    kind.check_unsafe_args({"agent": False, "tools": ""}, [], where)  # off: nothing to opt into
    with pytest.raises(ConfigError) as info:
        kind.check_unsafe_args({}, ["tool"], where)
    assert info.value.where == "serve[0](tiny).allow_engine_args" and "tools" in str(info.value)


def test_the_plan_refuses_an_unsafe_engine_arg_naming_the_node_and_key(demo_model_path):
    sources = ConfigSources(main="conf/serve.yaml", serve="conf/serve/m.yaml")

    def config(**node):
        engine_args = {"model": str(demo_model_path), "tool_server": "demo"}
        serve = [{"serve_id": "m", "engine": "vllm", "engine_args": engine_args, **node}]
        experiment = {"exp_name": "t", "exp_dir": "/tmp/t", "runner": {"deploy": {"port": 8123}}}
        return load_config({"experiment": experiment, "serve": serve, "action": "run"}, sources)

    with pytest.raises(ConfigError) as info:
        build_plan(config(), sources, check_port=False)
    assert "serve[0](m).engine_args.tool_server" in str(info.value) and "allow_engine_args" in str(info.value)
    plan = build_plan(config(allow_engine_args=["tool_server"]), sources, check_port=False)
    assert "--tool-server" in plan.engines[0].argv
