"""The SGLang engine kind (flagscale/engines/sglang.py) without SGLang: no CPU machine can run it (CUDA kernels
only). Where it is installed is found by its files; its flag table comes from its own parser, here a stand-in
`sglang` package whose `ServerArgs.add_cli_args` defines a few of SGLang 0.5.17's flags, read through the same
subprocess probe. The server itself runs on GPU machines (tests/gpu, docs/engines.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flagscale import engines
from flagscale.engines import sglang
from flagscale.engines.base import HostShare
from flagscale.errors import ConfigError

SERVER_ARGS = """
class ServerArgs:
    @staticmethod
    def add_cli_args(parser):
        parser.add_argument("--model-path", "--model", type=str)
        parser.add_argument("--context-length", type=int)
        parser.add_argument("--max-running-requests", type=int)
        parser.add_argument("--mem-fraction-static", type=float)
        parser.add_argument("--tp-size", type=int, default=1)
        parser.add_argument("--dp-size", type=int, default=1)
        parser.add_argument("--served-model-name", type=str)
        parser.add_argument("--trust-remote-code", action="store_true")
        parser.add_argument("--disable-radix-cache", action="store_true")
        parser.add_argument("--enable-metrics", action="store_true")
        parser.add_argument("--api-key", type=str)
        parser.add_argument("--json-model-override-args", type=str)
        parser.add_argument("--host", type=str)
        parser.add_argument("--port", type=int)
"""
# what the stand-in server prints: its arguments and its command line as other users see it
# what the stand-in server does: writes its arguments and its command line as other users see it to a file, and
# logs its arguments the way SGLang logs its ServerArgs at start (key included)
LAUNCH_SERVER = """
import json, logging, os, sys
logging.basicConfig(level=logging.INFO, force=True)
cmdline = open("/proc/self/cmdline", "rb").read().split(b"\\0")
with open(os.environ["SEEN"], "w") as f:
    json.dump({"argv": sys.argv, "cmdline": [c.decode() for c in cmdline if c]}, f)
logging.getLogger("sglang").info("server_args=ServerArgs(api_key=%r)", sys.argv[-1])
print("argv", sys.argv)
"""


@pytest.fixture
def installed(tmp_path, monkeypatch) -> Path:
    site = tmp_path / "sgl-site"
    (site / "sglang" / "srt").mkdir(parents=True)
    (site / "sglang-0.5.17.dist-info").mkdir()
    (site / "sglang" / "__init__.py").write_text("")
    (site / "sglang" / "srt" / "__init__.py").write_text("")
    (site / "sglang" / "srt" / "server_args.py").write_text(SERVER_ARGS)
    (site / "sglang" / "launch_server.py").write_text(LAUNCH_SERVER)
    monkeypatch.setenv(sglang.PATH_ENV, str(site))
    monkeypatch.setenv("FLAGSCALE_CACHE", str(tmp_path / "cache"))
    return site


def test_sglang_missing_is_refused_naming_where_it_was_looked_for(tmp_path, monkeypatch):
    monkeypatch.setenv(sglang.PATH_ENV, str(tmp_path))
    with pytest.raises(ConfigError) as info:
        engines.get("sglang").check_available("serve[0](x).engine")
    message = str(info.value)
    assert info.value.where == "serve[0](x).engine"
    assert f"SGLang is not installed in {sglang.PATH_ENV} ({tmp_path})" in message and "docs/engines.md" in message


def test_flag_table_comes_from_sglangs_parser_once_per_version(installed, tmp_path):
    dist_info = sglang.installed()
    assert dist_info == installed / "sglang-0.5.17.dist-info"
    table = sglang.flag_table(dist_info)
    assert table["--context-length"] is True and table["--trust-remote-code"] is False and table["--model"] is True
    assert (tmp_path / "cache" / "sglang-flags-sglang-0.5.17.dist-info.json").is_file()
    (installed / "sglang" / "srt" / "server_args.py").write_text("raise ImportError('gone')")
    assert sglang.flag_table(dist_info) == table  # cached: the parser is not loaded again


def test_a_parser_that_cannot_be_loaded_is_one_error(installed):
    (installed / "sglang" / "srt" / "server_args.py").write_text("raise ImportError('needs CUDA')")
    with pytest.raises(ConfigError, match="SGLang's argument parser cannot be loaded here: ImportError: needs CUDA"):
        sglang.flag_table(sglang.installed())


def test_flagscale_args_become_sglangs_own_flags(installed):
    kind = engines.get("sglang")
    args = {
        "model": "/models/llama",
        "max_model_len": 4096,
        "max_num_seqs": 64,
        "gpu_memory_utilization": 0.8,
        "tensor_parallel_size": 2,
        "served_model_name": ["llama"],
        "trust_remote_code": True,
        "disable_radix_cache": False,
        "enforce_eager": True,  # vLLM's: dropped with a notice
        "json_model_override_args": {"rope_scaling": None},
        "port": 9,  # the replica's own
    }
    argv = kind.argv(kind.map_common_args(args), "serve[0](m).engine_args")
    assert argv == [
        "--model-path", "/models/llama", "--context-length", "4096", "--max-running-requests", "64",
        "--mem-fraction-static", "0.8", "--tp-size", "2", "--served-model-name", "llama", "--trust-remote-code",
        "--json-model-override-args", '{"rope_scaling": null}',
    ]  # fmt: skip
    assert kind.map_common_args({"max_num_seqs": 8, "max_running_requests": 16}) == {"max_running_requests": 16}
    assert "enforce_eager" in kind.ignored_args


@pytest.mark.parametrize(
    ("args", "where", "message"),
    [
        ({"context_lenght": 8}, "context_lenght", "SGLang has no flag --context-lenght .*did you mean context_length"),
        ({"trust_remote_code": "yes"}, "trust_remote_code", "--trust-remote-code is a switch: give true or false"),
        ({"api_key": "k-0123456789abcdef"}, "api_key", "deploy.api_key"),
        ({"model_path": "/m"}, "model_path", "engine_args.model"),
        ({"served_model_name": ["a", "b"]}, "served_model_name", "one name"),
    ],
)
def test_bad_engine_args_are_refused_naming_the_key(installed, args, where, message):
    kind = engines.get("sglang")
    with pytest.raises(ConfigError, match=message) as info:
        kind.argv({"model": "/m", **args}, "serve[0](m).engine_args")
    assert info.value.where == f"serve[0](m).engine_args.{where}"


def test_parallel_sizes_from_either_spelling_and_gpus_required():
    kind = engines.get("sglang")
    assert kind.parallel({"tensor_parallel_size": 2}, "w") == (2, 1, 1)
    assert kind.parallel({"tp_size": 4, "dp_size": 2}, "w") == (4, 1, 2)
    with pytest.raises(ConfigError, match="positive integer"):
        kind.parallel({"tp_size": 0}, "w")
    kind.check_parallel((2, 1, 1), on_cpu=False, where="w")
    with pytest.raises(ConfigError, match="NVIDIA GPUs only"):
        kind.check_parallel((1, 1, 1), on_cpu=True, where="w")
    assert kind.check_unsafe_args({"enable_custom_logit_processor": False}, [], "w") is None
    with pytest.raises(ConfigError, match="allow_engine_args: \\[enable_custom_logit_processor\\]"):
        kind.check_unsafe_args({"enable_custom_logit_processor": True}, [], "w")


@pytest.mark.parametrize(
    ("title", "tp", "pp", "rank"),
    [
        ("sglang::scheduler", 1, 1, 0),
        ("sglang::scheduler_TP1", 2, 1, 1),
        ("sglang::scheduler_DP1_TP1", 2, 1, 3),
        ("sglang::scheduler_PP1_TP0", 2, 2, 2),
        ("sglang::detokenizer", 2, 1, None),
        ("python3 -m flagscale.engines.sglang_server", 2, 1, None),
    ],
)
def test_scheduler_ranks_from_their_titles(title, tp, pp, rank):
    assert engines.get("sglang").worker_rank(title, tp, pp) == rank


def test_the_api_key_reaches_sglang_but_not_its_command_line_nor_its_log(installed, tmp_path):
    kind = engines.get("sglang")
    launch = kind.launch(["--model-path", "/m"], "127.0.0.1", 8000, "s3cret", None)
    assert "s3cret" not in launch.argv and launch.secret_env == {"FLAGSCALE_SGLANG_API_KEY": "s3cret"}
    assert launch.argv[1:3] == ["-m", "flagscale.engines.sglang_server"] and "--enable-metrics" in launch.argv
    assert launch.env["PYTHONPATH"].split(os.pathsep)[0] == str(installed)
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, **launch.env, **launch.secret_env, "SEEN": str(tmp_path / "seen.json")}
    env["PYTHONPATH"] += os.pathsep + str(repo)
    result = subprocess.run(launch.argv, env=env, capture_output=True, text=True, timeout=60, check=True)
    seen = json.loads((tmp_path / "seen.json").read_text())
    assert seen["argv"][-2:] == ["--api-key", "s3cret"] and "--enable-metrics" in seen["argv"]
    assert "s3cret" not in " ".join(seen["cmdline"])
    assert "server_args=ServerArgs(api_key='***')" in result.stderr and "'***'" in result.stdout
    assert "s3cret" not in result.stdout + result.stderr
    bound = kind.bind_ranks(launch, HostShare("h", 0, 1, (0, 1), gpus=("2", "3")))
    assert bound.env["CUDA_VISIBLE_DEVICES"] == "2,3" and bound.secret_env == launch.secret_env


def test_without_a_path_of_its_own_sglang_runs_in_this_environment(monkeypatch):
    monkeypatch.delenv(sglang.PATH_ENV, raising=False)
    launch = engines.get("sglang").launch([], "127.0.0.1", 1, None, None)
    assert launch.argv[0] == sys.executable and launch.env == {} and launch.secret_env == {}


def test_the_gpu_benchmark_gives_plain_sglang_what_the_replica_gets(installed, tmp_path):
    repo = Path(__file__).resolve().parents[2]
    sys.path[:0] = [str(repo / "benchmarks"), str(repo / "benchmarks" / "gpu")]
    saved = dict(os.environ)
    try:
        import bench_gpu  # (sets the GPU-safe variables in os.environ on import: put back below)
        import overhead
    finally:
        os.environ.clear()
        os.environ.update(saved)
    engine_args = {"max_model_len": 2048, "max_num_seqs": 64, "gpu_memory_utilization": 0.4, "enforce_eager": False}
    plain = overhead.PlainSGLang(tmp_path / "m", 8600, tmp_path, engine_args)
    assert plain.argv[1:3] == ["-m", "sglang.launch_server"]
    flags = plain.argv[3 : plain.argv.index("--enable-metrics")]
    assert dict(zip(flags[::2], flags[1::2], strict=True)) == {
        "--model-path": str(tmp_path / "m"),
        "--served-model-name": "demo",
        "--context-length": "2048",
        "--max-running-requests": "64",
        "--mem-fraction-static": "0.4",
    }  # enforce_eager: vLLM's, dropped
    assert plain.argv[-5:] == ["--enable-metrics", "--host", "127.0.0.1", "--port", "8600"]
    assert plain.env["PYTHONPATH"].startswith(str(installed))
    orch = bench_gpu.Orch("orchestrator", 8601, tmp_path, tmp_path / "m", engine_args, engine="sglang")
    assert "++serve.0.engine=sglang" in orch.overrides
    assert f"++experiment.envs.{sglang.PATH_ENV}={installed}" in orch.overrides


def sglang_plan(model_path, **engine_args):
    from flagscale.config.load import ConfigSources, load_config
    from flagscale.plan import build_plan

    sources = ConfigSources(main="conf/serve.yaml", serve="conf/serve/gpu.yaml")
    cfg = {
        "experiment": {"exp_name": "t", "exp_dir": "/tmp/t", "runner": {"deploy": {"port": 8123}}},
        "serve": [
            {
                "serve_id": "llm",
                "engine": "sglang",
                "engine_args": {"model": str(model_path), "max_model_len": 256, **engine_args},
            }
        ],
    }
    return build_plan(load_config(cfg, sources), sources, check_port=False)


def test_a_plan_on_gpus_reserves_tp_gpus_and_on_cpus_is_refused(installed, demo_model_path, monkeypatch):
    import flagscale.facts
    from flagscale.devices import Gpu

    monkeypatch.setattr(flagscale.facts, "local_gpus", lambda: [])
    with pytest.raises(ConfigError, match="NVIDIA GPUs only") as info:
        sglang_plan(demo_model_path)
    assert str(info.value).startswith("conf/serve/gpu.yaml: serve[0](llm).engine_args")
    monkeypatch.setattr(flagscale.facts, "local_gpus", lambda: [Gpu(i, "NVIDIA H200", 143771) for i in range(2)])
    engine = sglang_plan(demo_model_path, tensor_parallel_size=2, gpu_memory_utilization=0.5).engines[0]
    assert engine.device == "gpu" and engine.devices_per_replica == 2 and engine.ray_actor_options["num_gpus"] == 2
    assert engine.argv[:2] == ["--model-path", str(demo_model_path)]
    assert {"--tp-size", "--context-length", "--mem-fraction-static"} <= set(engine.argv)
