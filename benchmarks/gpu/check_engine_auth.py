"""Does the engines' key middleware (flagscale/engines/vllm_auth.py) guard a plain vLLM server of the installed
version? Starts `python -m vllm.entrypoints.openai.api_server --middleware ...RequireApiKey` on a random-weight model
(model.py) with VLLM_API_KEY set, asks each path with and without the key, prints one line per request and exits 0
only if every path but /health refused a request without the key and took one with it.

    PYTHONPATH=/tmp/site:. python3 benchmarks/gpu/check_engine_auth.py --size tiny    # on the GPU machine
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.gpu.model import ensure_model  # noqa: E402
from flagscale.engines.vllm_auth import KEY_ENV, MIDDLEWARE  # noqa: E402
from flagscale.net import free_port  # noqa: E402

# (method, path, JSON body or None): the OpenAI routes vLLM guards itself and the ones it leaves open.
PATHS = [
    ("GET", "/v1/models", None),
    ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2}),
    ("POST", "/invocations", {"prompt": "hi", "max_tokens": 2}),
    ("POST", "/tokenize", {"prompt": "hi"}),
    ("GET", "/metrics", None),
    ("GET", "/version", None),
]


def ask(url: str, method: str, body: dict | None, key: str | None) -> int:
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    data = json.dumps({"model": "m", **body}).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:  # not listening yet
        return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="tiny")
    parser.add_argument("--startup-timeout-s", type=float, default=300)
    args = parser.parse_args()
    model = ensure_model(args.size)
    key, port = secrets.token_urlsafe(16), free_port()
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]
    argv += ["--served-model-name", "m", "--enforce-eager", "--gpu-memory-utilization", "0.2"]
    argv += ["--max-model-len", "512", "--port", str(port), "--middleware", MIDDLEWARE]
    env = {**os.environ, KEY_ENV: key}
    server = subprocess.Popen(argv, env=env, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + args.startup_timeout_s
        while ask(base + "/health", "GET", None, None) != 200:
            if server.poll() is not None or time.monotonic() > deadline:
                print(f"vLLM did not come up (exit {server.poll()})")
                return 1
            time.sleep(1)
        import vllm

        print(f"vllm {vllm.__version__}: /health without the key -> 200")
        ok = True
        for method, path, body in PATHS:
            without, with_key = ask(base + path, method, body, None), ask(base + path, method, body, key)
            good = without == 401 and with_key != 401
            ok &= good
            print(f"{method:4} {path:16} without key -> {without}, with key -> {with_key}  {'ok' if good else 'OPEN'}")
        return 0 if ok else 1
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)


if __name__ == "__main__":
    sys.exit(main())
