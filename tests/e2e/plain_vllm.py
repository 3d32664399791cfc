"""Plain vLLM (no orchestrator) as the reference a parallel deployment's answers must equal."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import openai

from flagscale.net import free_port, health_ok
from tests.conftest import demo_engine_args, wait_for

GREEDY = {"temperature": 0, "max_tokens": 12, "extra_body": {"ignore_eos": True}}
PROMPTS = ["hello world", "one engine over two hosts " * 4, "the quick brown fox jumps over the lazy dog " * 3]


def answers(client: openai.OpenAI, model: str) -> list[str]:
    return [client.completions.create(model=model, prompt=p, **GREEDY).choices[0].text for p in PROMPTS]


_answered: dict[tuple[str, int, str], list[str]] = {}  # one plain run per test session (`make test`: one pytest)


def plain_answers(model_path: Path, tp: int, bind: str, log: Path, timeout_s: float = 600) -> list[str]:
    """Greedy answers of `python -m vllm.entrypoints.openai.api_server` with TP `tp`, ranks bound as `bind`
    (VLLM_CPU_OMP_THREADS_BIND), the demo engine args of tests/conftest.py; the server is stopped after."""
    key = (str(model_path), tp, bind)
    if key not in _answered:
        _answered[key] = _run_plain(model_path, tp, bind, log, timeout_s)
    return _answered[key]


def _run_plain(model_path: Path, tp: int, bind: str, log: Path, timeout_s: float) -> list[str]:
    port = free_port("127.0.0.1")
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_path)]
    argv += ["--served-model-name", "plain", "--max-model-len", "512", "--max-num-seqs", "8", "--enforce-eager"]
    argv += ["--gpu-memory-utilization", str(demo_engine_args()["gpu_memory_utilization"])]
    argv += ["--dtype", "float32", "--tensor-parallel-size", str(tp), "--distributed-executor-backend", "mp"]
    argv += ["--host", "127.0.0.1", "--port", str(port)]
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": bind}
    with open(log, "ab") as out:
        server = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: server.poll() is not None or health_ok(url, timeout_s=2), timeout_s, f"plain vLLM TP={tp}")
        assert server.poll() is None, log.read_text()[-3000:]
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=120, max_retries=0)
        return answers(client, "plain")
    finally:
        stop_group(server)


def stop_group(server: subprocess.Popen) -> None:
    """SIGTERM to the server's session group (its engine core and workers), SIGKILL after 30 s."""
    for sig, wait_s in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(server.pid, sig)
        except ProcessLookupError:
            return
        try:
            server.wait(wait_s)
            return
        except subprocess.TimeoutExpired:
            continue
