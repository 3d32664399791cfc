"""SGLang: each replica runs SGLang's own OpenAI server (`python -m sglang.launch_server`) on its GPUs.

SGLang ships CUDA kernels only: it serves on NVIDIA GPUs, and the release must match the host's torch (on the GPU
image, torch 2.11 + CUDA 13: sglang 0.5.11 - 0.5.17, docs/engines.md). Its pins differ from vLLM's, so it may live
apart: FLAGSCALE_SGLANG_PATH names directories put in front of the server's PYTHONPATH (an `--target` install, a
venv's site-packages), in the shell and in experiment.envs; without it, SGLang is imported from the environment the
orchestrator runs in.

Engine args are SGLang's own `ServerArgs` flags in snake_case, checked against the flag table its parser builds
(read once per installed version, in a subprocess of its environment, and cached). FlagScale's common args are
mapped: model -> --model-path, max_model_len -> --context-length, max_num_seqs -> --max-running-requests,
gpu_memory_utilization -> --mem-fraction-static, tensor/pipeline/data_parallel_size -> --tp/--pp/--dp-size.
Its /metrics (--enable-metrics, always on) give the load. The API key reaches it through the environment, never
argv (flagscale/engines/sglang_server.py adds it to SGLang's own arguments inside the server process).
"""

from __future__ import annotations

import difflib
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from flagscale.engines.base import OPENAI_INFERENCE_PATHS, Capabilities, EngineKind, HostShare, ServerLaunch
from flagscale.engines.model_args import check_hf_model, positive_int
from flagscale.engines.sglang_kv_events import kv_events_launch
from flagscale.engines.sglang_server import KEY_ENV
from flagscale.errors import ConfigError
from flagscale.paths import default_cache_dir

PATH_ENV = "FLAGSCALE_SGLANG_PATH"
# FlagScale's engine-neutral keys -> SGLang's (SGLang's own key, if also set, wins)
COMMON_ARGS = {
    "max_model_len": "context_length",
    "max_num_seqs": "max_running_requests",
    "gpu_memory_utilization": "mem_fraction_static",
    "tensor_parallel_size": "tp_size",
    "pipeline_parallel_size": "pp_size",
    "data_parallel_size": "dp_size",
}
SIZING_ARGS = (
    ("tp_size", "tensor_parallel_size"),
    ("pp_size", "pipeline_parallel_size"),
    ("dp_size", "data_parallel_size"),
)
# vLLM keys that FlagScale configs carry and that mean nothing to SGLang: dropped with a notice.
IGNORED_ARGS = {
    "enforce_eager": "vLLM's CUDA-graph switch (SGLang's: disable_cuda_graph)",
    "block_size": "vLLM's KV block size (SGLang's: page_size)",
    "swap_space": "vLLM's CPU swap",
    "kv_cache_memory_bytes": "vLLM's KV cache size (SGLang sizes it by mem_fraction_static)",
    "max_num_batched_tokens": "vLLM's scheduler budget (SGLang's: chunked_prefill_size)",
    "enable_chunked_prefill": "vLLM's switch (SGLang chunks prefills by chunked_prefill_size)",
    "enable_prefix_caching": "SGLang's RadixAttention caches prefixes unless disable_radix_cache",
    "disable_log_stats": "vLLM's log setting",
    "disable_log_requests": "vLLM's log setting",
}
# Set by the orchestrator, never by the user.
MANAGED_ARGS = {
    "model_path": "give the model as engine_args.model",
    "api_key": "set experiment.runner.deploy.api_key (the router needs it too)",
    "enable_metrics": "always on: the load and status come from /metrics",
}
UNSAFE_ARGS = {
    "enable_custom_logit_processor": "lets requests send code (serialized logit processors) for the server to run",
}
FLAG_PROBE = """
import argparse, json
from sglang.srt.server_args import ServerArgs
parser = argparse.ArgumentParser()
ServerArgs.add_cli_args(parser)
flags = {o: a.nargs != 0 for a in parser._actions for o in a.option_strings if o.startswith("--")}
print(json.dumps(flags))
"""
# A scheduler process's title: sglang::scheduler, then _DP<d>, _PP<p>, _TP<t> (and others) as the split has them.
SCHEDULER_TITLE = re.compile(r"sglang::scheduler(\S*)")


def search_path() -> list[str]:
    return [p for p in os.environ.get(PATH_ENV, "").split(os.pathsep) if p]


def installed() -> Path | None:
    """The dist-info directory of the SGLang the server would import, or None."""
    for entry in [*search_path(), *sys.path]:
        found = sorted(Path(entry or ".").glob("sglang-*.dist-info"))
        if found and (Path(entry or ".") / "sglang" / "launch_server.py").is_file():
            return found[-1]
    return None


def server_env() -> dict[str, str]:
    """PYTHONPATH with FLAGSCALE_SGLANG_PATH in front of the replica's own (which keeps flagscale importable)."""
    path = search_path()
    if not path:
        return {}
    return {"PYTHONPATH": os.pathsep.join([*path, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])}


def flag_table(dist_info: Path) -> dict[str, bool]:
    """SGLang's long flags -> whether each takes a value, from its own parser, cached per installed version."""
    cache = default_cache_dir() / f"sglang-flags-{dist_info.name}.json"
    try:
        return json.loads(cache.read_text())
    except (OSError, ValueError):
        pass
    env = {**os.environ, **server_env()}
    try:
        probe = subprocess.run(
            [sys.executable, "-c", FLAG_PROBE], capture_output=True, text=True, timeout=300, env=env, check=False
        )
    except subprocess.TimeoutExpired:
        raise ConfigError("SGLang's argument parser gave no answer within 300 s", "engine sglang") from None
    if probe.returncode != 0:
        tail = probe.stderr.strip().splitlines()[-1:] or ["no output"]
        raise ConfigError(f"SGLang's argument parser cannot be loaded here: {tail[0]}", "engine sglang")
    table = json.loads(probe.stdout.strip().splitlines()[-1])
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_suffix(".tmp")
    tmp.write_text(json.dumps(table))
    tmp.replace(cache)
    return table


def flag_argv(table: dict[str, bool], key: str, value: Any, where: str) -> list[str]:
    """One engine arg -> SGLang's flag and value, refused unless its parser has the flag."""
    name = "--" + key.replace("_", "-")
    if name not in table:
        known = [n[2:].replace("-", "_") for n in table]
        close = difflib.get_close_matches(key, known, n=3)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise ConfigError(f"SGLang has no flag {name} (engine arg {key!r}){hint}", f"{where}.{key}")
    if not table[name]:
        if value is True:
            return [name]
        if value is False:
            negative = "--no-" + name[2:]
            return [negative] if negative in table else []  # a switch that is off by default
        raise ConfigError(f"{name} is a switch: give true or false", f"{where}.{key}")
    if isinstance(value, bool):
        return [name, str(value).lower()]
    if isinstance(value, dict):
        return [name, json.dumps(value)]
    if isinstance(value, list):
        return [name, *(str(v) for v in value)]
    return [name, str(value)]


def scheduler_rank(title: str, tp: int, pp: int) -> int | None:
    """The global rank of an SGLang scheduler process from its title, or None when it is none."""
    match = SCHEDULER_TITLE.fullmatch(title.split(" ")[0])
    if not match:
        return None
    parts = dict(re.findall(r"_(DP|PP|TP)(\d+)", match.group(1)))
    dp, pp_rank, tp_rank = (int(parts.get(k, 0)) for k in ("DP", "PP", "TP"))
    return dp * tp * pp + pp_rank * tp + tp_rank


class SGLang(EngineKind):
    name = "sglang"
    display = "SGLang"
    # SGLang's --lora-paths names adapters a request picks with its own `lora_path` field; its OpenAI `model` naming
    # of adapters changed across versions, and no SGLang is installed where this project is tested to pin one
    lora_refusal = "is not wired for LoRA adapters here (its --lora-paths is untested against an installed SGLang)"
    # RadixAttention reuses the KV cache of shared prefixes; TP, PP and DP within a replica on its GPUs. No resume
    # (its streams carry no token ids the router could continue from) and no KV transfer through the project's
    # connectors (SGLang's own PD backends are not wired up).
    # Its radix cache publishes page events the router can key (sglang_kv_events.py), with a page of 16 or more.
    capabilities = Capabilities(prefix_caching=True, parallel=("tp", "pp", "dp"), kv_events=True)
    status_gauges = {
        "sglang:num_running_reqs": "running",
        "sglang:num_queue_reqs": "waiting",
        "sglang:token_usage": "kv_cache_usage",
    }
    load_metrics = ("sglang:num_running_reqs", "sglang:num_queue_reqs")
    sizing_args = tuple(key for pair in SIZING_ARGS for key in pair)
    common_args = COMMON_ARGS
    ignored_args = IGNORED_ARGS
    unsafe_args = UNSAFE_ARGS
    rank_runner = "SGLang's own scheduler processes"
    inference_paths = (
        *OPENAI_INFERENCE_PATHS,
        "/v1/score",
        "/v1/classify",
    )
    public_paths = (*inference_paths, "/v1/tokenize", "/v1/detokenize")

    def check_available(self, where: str) -> None:
        if installed() is None:
            place = f"in {PATH_ENV} ({os.environ[PATH_ENV]}) or " if search_path() else ""
            raise ConfigError(
                f"SGLang is not installed {place}in this Python environment: it serves on NVIDIA GPUs with a release "
                "whose torch pin matches the host's (docs/engines.md); install it there, or name its directory in "
                f"{PATH_ENV}; else use engine: vllm or engine: llama_cpp",
                where,
            )

    def check_model(self, model: Any, where: str) -> str:
        return check_hf_model(model, where)

    def parallel(self, args: dict[str, Any], where: str) -> tuple[int, int, int]:
        sizes = []
        for own, common in SIZING_ARGS:
            key = own if own in args else common
            sizes.append(positive_int(args, key, f"{where}.{key}"))
        return tuple(sizes)  # type: ignore[return-value]

    def check_parallel(self, parallel: tuple[int, int, int], on_cpu: bool, where: str) -> None:
        if on_cpu:
            raise ConfigError(
                "SGLang serves on NVIDIA GPUs only: give the node resources.num_gpus on a GPU host (or use "
                "engine: vllm or engine: llama_cpp on CPUs)",
                where,
            )

    def argv(self, args: dict[str, Any], where: str) -> list[str]:
        dist_info = installed()
        if dist_info is None:
            self.check_available(where)
        table = flag_table(dist_info)  # type: ignore[arg-type]
        argv = ["--model-path", str(args["model"])]
        for key, value in args.items():
            if key == "model" or value is None or key in self.address_args:  # notices say so (config/compat.py)
                continue
            if key in MANAGED_ARGS:
                raise ConfigError(f"{key} is not an engine arg here: {MANAGED_ARGS[key]}", f"{where}.{key}")
            if key == "served_model_name" and not isinstance(value, str):
                if len(value) != 1:
                    raise ConfigError("SGLang serves a model under one name: give one", f"{where}.{key}")
                value = value[0]
            argv += flag_argv(table, key, value, where)
        return argv

    def launch(self, argv: list[str], host: str, port: int, api_key: str | None, role: str | None) -> ServerLaunch:
        command = [
            sys.executable,
            "-m",
            "flagscale.engines.sglang_server",
            *argv,
            "--enable-metrics",
            "--host",
            host,
            "--port",
            str(port),
        ]
        return ServerLaunch(command, env=server_env(), secret_env={KEY_ENV: api_key} if api_key else {})

    def bind_ranks(self, launch: ServerLaunch, share: HostShare) -> ServerLaunch:
        # SGLang runs its ranks on the GPUs it sees, from the first: those Ray granted the replica
        env = {**launch.env, share.visible_env: ",".join(share.gpus)} if share.gpus else launch.env
        return ServerLaunch(launch.argv, env, launch.env_defaults, launch.secret_env)

    def kv_events_launch(self, argv, host, pub_port, replay_port, topic, env, ranks=1):
        return kv_events_launch(argv, host, pub_port, replay_port, topic, ranks)

    def worker_rank(self, title: str, tp: int, pp: int, parent_title: str = "") -> int | None:
        return scheduler_rank(title, tp, pp)


KIND = SGLang()
