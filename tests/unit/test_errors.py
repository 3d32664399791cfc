"""error_excerpt: the one rule for "which lines of a log or traceback say why", and the callers that print it."""

from __future__ import annotations

from flagscale.actions.deploy import cause
from flagscale.errors import error_excerpt
from flagscale.replica.process import cause_from_log
from flagscale.serve.graph import GraphNodeError

VLLM_LOG = """\
(APIServer pid=7) INFO 11-24 18:33:22 [model.py:733] Resolved architecture: LlamaForCausalLM
(APIServer pid=7) WARNING 11-24 18:33:22 [system_utils.py:255] can cause `OSError: [Errno 24] Too many open files`
Traceback (most recent call last):
  File "/venv/vllm/engine/arg_utils.py", line 1955, in create_model_config
    return ModelConfig(
           ^^^^^^^^^^^^
  File "/venv/pydantic/_internal/_dataclasses.py", line 121, in __init__
    s.__pydantic_validator__.validate_python(ArgsKwargs(args, kwargs), self_instance=s)
pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig
  Value error, User-specified max_model_len (4096) is greater than the derived max_model_len (2048)
    For further information visit https://errors.pydantic.dev/2.14/v/value_error
"""

SERVE_MESSAGE = """\
The deployment failed to start 3 times in a row. See controller logs for details. Error:
ray.exceptions.RayTaskError(EngineStartError): ray::ServeReplica:demo:broken.initialize_and_get_metadata()
  File "/work/flagscale/replica/engine.py", line 150, in _wait_healthy
    raise EngineStartError(
flagscale.replica.engine.EngineStartError: vLLM server for 'broken' exited with code 1 during start-up; log x.log:
pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig
  Value error, User-specified max_model_len (4096) is greater than the derived max_model_len (2048)
"""


def test_a_tracebacks_exception_line_and_the_lines_after_it():
    assert error_excerpt(VLLM_LOG) == "\n".join(VLLM_LOG.splitlines()[-3:])


def test_the_exception_line_wins_over_errors_its_message_quotes():
    excerpt = error_excerpt(SERVE_MESSAGE, after=11)
    assert excerpt.startswith("flagscale.replica.engine.EngineStartError: vLLM server for 'broken' exited")
    assert excerpt.endswith("is greater than the derived max_model_len (2048)")


def test_without_a_traceback_the_last_error_line():
    log = "(EngineCore pid=3) ValueError: first\nsome line\nRuntimeError: second\nafter it\n"
    assert error_excerpt(log, after=1) == "RuntimeError: second\nafter it"


def test_source_lines_quoted_in_a_traceback_are_not_errors():
    assert error_excerpt("    raise SomeError(\nthe end", fallback=1) == "the end"


def test_without_an_error_line_the_last_lines():
    assert error_excerpt("one\n\ntwo\nthree\n", fallback=2) == "two\nthree"
    assert error_excerpt("one\ntwo", fallback=0) == ""
    assert error_excerpt("  \n\n") == ""


def test_callers(tmp_path):
    assert cause(SERVE_MESSAGE).startswith("flagscale.replica.engine.EngineStartError:")
    assert cause("") == "no message from Ray Serve"
    log = tmp_path / "engine.log"
    log.write_text(VLLM_LOG)
    assert "max_model_len (4096) is greater than the derived max_model_len" in cause_from_log(log)
    assert cause_from_log(tmp_path / "missing.log") == "(no log)"
    ray_text = 'ray::CustomNode.forward()\n  File "node.py", line 3, in forward\n    raise ValueError("boom")\nValueError: boom'
    assert str(GraphNodeError("summarize", RuntimeError(ray_text))) == "node 'summarize' failed: ValueError: boom"
    assert str(GraphNodeError("summarize", TimeoutError())) == "node 'summarize' failed: TimeoutError"


def test_an_error_that_points_above_gives_way_to_the_one_it_points_at():
    log = """(Worker pid=9) ERROR Traceback (most recent call last):
(Worker pid=9) ERROR   File "/v/cpu_worker.py", line 260, in determine_available_memory
(Worker pid=9) ERROR ValueError: Available memory on node 0 (6.99/13.59 GiB) is less than requested for kv
(EngineCore pid=8) ERROR RuntimeError: Worker failed with error 'Available memory ...', please check the stack trace above for the root cause
Traceback (most recent call last):
  File "/v/core_client.py", line 80, in __init__
RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}
"""
    assert error_excerpt(log, after=0) == (
        "(Worker pid=9) ERROR ValueError: Available memory on node 0 (6.99/13.59 GiB) is less than requested for kv"
    )
