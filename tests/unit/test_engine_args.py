"""engine_args -> vLLM argv, checked by the installed vLLM's own `vllm serve` parser (real parser, no fake)."""

import argparse
import types

import pytest

from flagscale.engines import vllm_args as engine_args
from flagscale.engines.vllm_args import parsed, to_argv
from flagscale.errors import ConfigError

WHERE = "conf/serve/x.yaml: serve[0](a).engine_args"


def test_values_become_flags_and_parse():
    argv = to_argv(
        {
            "model": "/m",
            "tensor_parallel_size": 2,
            "enforce_eager": True,
            "enable_chunked_prefill": False,
            "served_model_name": ["a", "b"],
            "max_num_batched_tokens": 1024,
        },
        WHERE,
    )
    assert argv[:2] == ["--model", "/m"]
    assert "--enforce-eager" in argv and "--no-enable-chunked-prefill" in argv
    ns = parsed(argv)
    assert ns.tensor_parallel_size == 2 and ns.served_model_name == ["a", "b"] and ns.max_num_batched_tokens == 1024


def test_frontend_args_are_accepted_and_host_port_left_to_the_orchestrator():
    argv = to_argv({"model": "/m", "host": "0.0.0.0", "port": 4567, "chat_template": "/t.jinja"}, WHERE)
    assert "--port" not in argv and "--host" not in argv
    assert ["--chat-template", "/t.jinja"] == argv[2:4]


def test_unknown_arg_suggests():
    with pytest.raises(ConfigError) as info:
        to_argv({"model": "/m", "max_model_length": 5}, WHERE)
    assert WHERE in str(info.value) and "did you mean 'max_model_len'" in str(info.value)


def test_wrong_type_is_reported_by_vllm_parser():
    with pytest.raises(ConfigError) as info:
        to_argv({"model": "/m", "tensor_parallel_size": "two"}, WHERE)
    assert "--tensor-parallel-size" in str(info.value) and "'two'" in str(info.value)


def test_bool_flag_rejects_non_bool():
    with pytest.raises(ConfigError) as info:
        to_argv({"model": "/m", "enforce_eager": "yes"}, WHERE)
    assert "enforce_eager" in str(info.value)


# ---- where vLLM keeps its parser: tried in order across releases ----------------------------------------------


def _fake_vllm(monkeypatch, present: dict[str, dict]) -> list[str]:
    """vLLM's layout as `present` says (module -> attributes); returns the modules asked for, in order."""
    asked = []

    def import_module(name):
        asked.append(name)
        if name not in present:
            raise ModuleNotFoundError(f"No module named '{name}'", name=name)
        return types.SimpleNamespace(**present[name])

    monkeypatch.setattr(engine_args, "_import_module", import_module)
    monkeypatch.setattr(engine_args, "vllm_version", lambda: "vllm-0.99.0")
    engine_args.vllm_serve_parser.cache_clear()
    return asked


@pytest.fixture
def fresh_parser():
    engine_args.vllm_serve_parser.cache_clear()
    yield
    engine_args.vllm_serve_parser.cache_clear()  # the real parser again for the other tests


class _Parser(argparse.ArgumentParser):
    pass


def _make_arg_parser(tag):
    def make(parser):
        parser.add_argument("--tag", default=tag)
        return parser

    return make


@pytest.mark.parametrize(
    "module, release",
    [
        ("vllm.entrypoints.common.cli_args", "0.33"),
        ("vllm.entrypoints.launchers.cli_args", "0.29 - 0.32"),
        ("vllm.entrypoints.openai.cli_args", "0.26 - 0.28"),
    ],
)
def test_serve_parser_is_found_where_each_release_keeps_it(monkeypatch, fresh_parser, module, release):
    asked = _fake_vllm(
        monkeypatch,
        {
            module: {"make_arg_parser": _make_arg_parser(release)},
            "vllm.utils.argparse_utils": {"FlexibleArgumentParser": _Parser},
        },
    )
    parser = engine_args.vllm_serve_parser()
    assert isinstance(parser, _Parser) and parser.prog == "vllm serve"
    assert parser.parse_args([]).tag == release
    order = list(engine_args.SERVE_PARSER_MODULES)
    assert [m for m in asked if m in order] == order[: order.index(module) + 1]  # newest first, stops at the hit


def test_flexible_argument_parser_falls_back_to_vllm_utils(monkeypatch, fresh_parser):
    asked = _fake_vllm(
        monkeypatch,
        {
            "vllm.entrypoints.openai.cli_args": {"make_arg_parser": _make_arg_parser("old")},
            "vllm.utils": {"FlexibleArgumentParser": _Parser},
        },
    )
    assert isinstance(engine_args.vllm_serve_parser(), _Parser)
    assert asked[-2:] == ["vllm.utils.argparse_utils", "vllm.utils"]


def test_module_without_the_name_is_passed_over(monkeypatch, fresh_parser):
    _fake_vllm(
        monkeypatch,
        {
            "vllm.entrypoints.common.cli_args": {"something_else": 1},
            "vllm.entrypoints.launchers.cli_args": {"make_arg_parser": _make_arg_parser("x")},
            "vllm.utils.argparse_utils": {"FlexibleArgumentParser": _Parser},
        },
    )
    assert engine_args.vllm_serve_parser().parse_args([]).tag == "x"


def test_parser_nowhere_is_one_clear_error_naming_version_and_places(monkeypatch, fresh_parser):
    _fake_vllm(monkeypatch, {"vllm.utils.argparse_utils": {"FlexibleArgumentParser": _Parser}})
    with pytest.raises(ConfigError) as info:
        engine_args.vllm_serve_parser()
    message = str(info.value)
    assert "vllm-0.99.0" in message and "make_arg_parser" in message
    for module in engine_args.SERVE_PARSER_MODULES:
        assert f"{module}.make_arg_parser" in message


def test_broken_vllm_import_is_reported_not_skipped(monkeypatch, fresh_parser):
    """A dependency missing inside vLLM is not 'this location does not exist': say so, with the version."""

    def import_module(name):
        raise ModuleNotFoundError("No module named 'torch'", name="torch")

    monkeypatch.setattr(engine_args, "_import_module", import_module)
    monkeypatch.setattr(engine_args, "vllm_version", lambda: "vllm-0.99.0")
    with pytest.raises(ConfigError) as info:
        engine_args.vllm_serve_parser()
    assert "vllm-0.99.0" in str(info.value) and "torch" in str(info.value)


def test_bench_entry_points_use_the_same_lookup(monkeypatch):
    from flagscale.actions import bench

    calls = {}

    def add_cli_args(parser):
        parser.add_argument("--num-prompts", type=int)

    def main(args):
        calls["args"] = args
        return {"ok": True}

    _fake_vllm(
        monkeypatch,
        {
            "vllm.benchmarks.serve": {"add_cli_args": add_cli_args, "main": main},
            "vllm.utils": {"FlexibleArgumentParser": _Parser},
        },
    )
    assert bench.run_vllm_bench(["--num-prompts", "3"]) == {"ok": True}
    assert calls["args"].num_prompts == 3


def test_bench_without_vllm_benchmark_is_a_clear_error(monkeypatch):
    from flagscale.actions import bench

    _fake_vllm(monkeypatch, {"vllm.utils.argparse_utils": {"FlexibleArgumentParser": _Parser}})
    with pytest.raises(ConfigError) as info:
        bench.run_vllm_bench([])
    assert "vllm-0.99.0" in str(info.value) and "vllm.benchmarks.serve.add_cli_args" in str(info.value)


def test_installed_vllm_is_found_by_the_lookup(fresh_parser):
    """The real installed vLLM: the lookup lands on a parser that knows `vllm serve`'s flags."""
    assert "--max-model-len" in {s for a in engine_args.vllm_serve_parser()._actions for s in a.option_strings}
