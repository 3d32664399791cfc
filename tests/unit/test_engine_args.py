"""engine_args -> vLLM argv, checked by the installed vLLM's own `vllm serve` parser (real parser, no fake)."""

import pytest

from flagscale.config.engine_args import parsed, to_argv
from flagscale.errors import ConfigError

WHERE = "conf/serve/x.yaml: serve[0](a).engine_args"


def test_values_become_flags_and_parse():
    argv = to_argv(
        {"model": "/m", "tensor_parallel_size": 2, "enforce_eager": True, "enable_chunked_prefill": False,
         "served_model_name": ["a", "b"], "max_num_batched_tokens": 1024},
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
