"""llama.cpp: each replica runs llama.cpp's own OpenAI server, `llama-server`, on one GGUF file.

The binary is built here once per version (flagscale/engines/llama_cpp_build.py, `make llama-cpp`). Engine args are
llama-server's own long flags in snake_case (`n_gpu_layers: 0` -> `--n-gpu-layers 0`), checked against the flag
table its `--help` prints (read once per binary and cached beside it). FlagScale's common args are mapped
(docs/engines.md): max_num_seqs -> --parallel, served_model_name -> --alias, max_model_len ->
--kv-unified-per-slot (each sequence gets max_model_len; the KV pool is sized to parallel x max_model_len).
Its /metrics (always on) give the load; the API key reaches it through LLAMA_API_KEY and hf_token through
HF_TOKEN, never argv (a key with a comma is refused: llama-server splits keys on commas); --threads defaults to the
CPUs the replica reserves. A replica that reserves GPUs (resources.num_gpus; the default on a GPU host) sees only
those (Ray's CUDA_VISIBLE_DEVICES) and puts every layer on them (--n-gpu-layers all) unless told otherwise; one that
reserves none offloads nothing (--device none). Offloading needs the CUDA build `make llama-cpp` makes on a host
with NVIDIA GPUs and nvcc (llama_cpp_build.py).
"""

from __future__ import annotations

import difflib
import json
import math
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flagscale.adaptors import ray
from flagscale.engines import llama_cpp_build
from flagscale.engines.base import OPENAI_INFERENCE_PATHS, Capabilities, EngineKind, ServerLaunch, SleepMode
from flagscale.errors import ConfigError

GGUF_MAGIC = b"GGUF"
API_KEY_ENV = "LLAMA_API_KEY"  # llama-server reads --api-key from it (common/arg.cpp)
# Secret engine args -> the env var llama-server reads them from (its --help: "(env: HF_TOKEN)"), never argv.
SECRET_ARGS = {"hf_token": "HF_TOKEN"}
# Set by the orchestrator, never by the user: the replica's address, the key, the metrics the load comes from, and
# the model names (served_model_name).
MANAGED_ARGS = {
    "host": "the orchestrator gives each replica its own address",
    "port": "the orchestrator gives each replica its own port",
    "api_key": "set experiment.runner.deploy.api_key (the router needs it too)",
    "api_key_file": "set experiment.runner.deploy.api_key (the router needs it too)",
    "alias": "set served_model_name",
    "metrics": "always on: the load and status come from /metrics",
    "api_prefix": "the router and the replica's health check reach the engine's paths at its root",
}
# FlagScale's engine-neutral keys -> llama-server's (an own key of the same meaning, if also set, wins)
# (served_model_name -> --alias is done in argv: a user's own `alias` is refused, not overridden)
COMMON_ARGS = {"max_num_seqs": "parallel", "max_model_len": "kv_unified_per_slot"}
PARALLEL_ARGS = ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size")
# vLLM keys that FlagScale configs carry in engine_args and that mean nothing to llama.cpp: dropped with a notice,
# so one engine_args block can serve both backends. Anything else unknown to llama-server is an error.
IGNORED_ARGS = {
    "gpu_memory_utilization": "llama.cpp sizes its memory by the context (max_model_len x max_num_seqs)",
    "kv_cache_memory_bytes": "llama.cpp sizes its KV cache by the context (max_model_len x max_num_seqs)",
    "dtype": "a GGUF file fixes its weights' types",
    "trust_remote_code": "a GGUF file holds no code",
    "enforce_eager": "vLLM's CUDA-graph switch",
    "block_size": "vLLM's KV block size",
    "swap_space": "vLLM's CPU swap",
    "enable_prefix_caching": "llama.cpp reuses a slot's prompt prefix by itself (cache_prompt)",
    "disable_log_stats": "vLLM's log setting",
    "disable_log_requests": "vLLM's log setting",
    "max_num_batched_tokens": "vLLM's scheduler budget (llama.cpp: batch_size / ubatch_size)",
}

# llama-server flags that hand clients more than the model: refused unless the node opts in (allow_engine_args)
UNSAFE_ARGS = {
    "tools": "turns on llama-server's built-in tools for AI agents (shell commands, files)",
    "tools_runtime": "sets where llama-server's built-in tools run",
    "agent": "turns on llama-server's agent (it runs tools)",
    "mcp_servers_config": "gives llama-server MCP servers to call",
    "mcp_servers_json": "gives llama-server MCP servers to call",
    "ui_mcp_proxy": "turns on llama-server's MCP proxy (it fetches URLs a client names)",
    "slot_save_path": "lets llama-server write slot files at a client's request",
    "media_path": "lets requests read the host's files under that directory (file:// media URLs)",
}

FLAG_TABLE_FORMAT = 1  # of the cached table: a cache written by another parse_help is read again


@dataclass(frozen=True)
class Flag:
    names: tuple[str, ...]  # every spelling, short and long ("-t", "--threads")
    takes_value: bool


def parse_help(text: str) -> dict[str, Flag]:
    """llama-server --help -> long flag ("--threads") -> Flag. An option line starts at column 0; its spellings are
    comma-separated, followed by a value hint when it takes one; its help text starts at column 40 or on the next
    line when the spellings are longer (common/arg.cpp: common_arg::to_string)."""
    table: dict[str, Flag] = {}
    for line in text.splitlines():
        if not line.startswith("-") or line.startswith("-----"):  # not an option, or a section title
            continue
        options = line[:37] if len(line) > 40 and line[37:40] == "   " else line
        pieces = [piece.strip() for piece in options.strip().split(",")]
        words = [word for piece in pieces for word in piece.split()]
        names = tuple(word for word in words if word.startswith("-"))
        flag = Flag(names=names, takes_value=len(words) > len(names))
        for name in names:
            if name.startswith("--"):
                table[name] = flag
    return table


def flag_table(binary: Path) -> dict[str, Flag]:
    """The flags of this binary, from `--help` once, cached beside it (keyed by its size and mtime)."""
    stat = binary.stat()
    key = f"{FLAG_TABLE_FORMAT}-{stat.st_size}-{stat.st_mtime_ns}"
    cache = binary.with_name(f".{binary.name}-flags.json")
    try:
        cached = json.loads(cache.read_text())
        if cached.get("key") == key:
            return {name: Flag(tuple(f["names"]), f["takes_value"]) for name, f in cached["flags"].items()}
    except (OSError, ValueError, KeyError):
        pass
    text = subprocess.run([str(binary), "--help"], capture_output=True, text=True, timeout=60, check=True).stdout
    table = parse_help(text)
    if "--parallel" not in table:
        raise ConfigError(f"{binary} --help lists no --parallel: is it llama-server?", "llama.cpp")
    flags = {name: {"names": list(f.names), "takes_value": f.takes_value} for name, f in table.items()}
    tmp = cache.with_suffix(".tmp")
    tmp.write_text(json.dumps({"key": key, "flags": flags}))
    tmp.replace(cache)
    return table


def check_gguf(model: Any, where: str) -> str:
    """`model` is a GGUF file (by its magic bytes): its resolved path, or a ConfigError naming it."""
    if not isinstance(model, str) or not model:
        raise ConfigError("engine_args.model is required: for llama.cpp, the path of a GGUF file", where)
    path = Path(model).expanduser()
    if path.is_dir():
        raise ConfigError(
            f"model {model!r} is a directory; llama.cpp serves one GGUF file (convert a Hugging Face model with "
            "llama.cpp's convert_hf_to_gguf.py)",
            where,
        )
    try:
        with open(path, "rb") as f:
            magic = f.read(len(GGUF_MAGIC))
    except OSError as exc:
        raise ConfigError(f"model {model!r} cannot be read: {exc.strerror}", where) from None
    if magic != GGUF_MAGIC:
        raise ConfigError(f"model {model!r} is not a GGUF file (it does not start with {GGUF_MAGIC!r})", where)
    return str(path.resolve())


class LlamaCpp(EngineKind):
    name = "llama_cpp"
    display = "llama.cpp"
    # prefix_caching: a request goes to the slot whose cached prompt shares most with it, and the shared part is not
    # computed again (cache_prompt, on by default). Resume: see docs/engines.md.
    # It closes a connection after every streamed response although its headers say Keep-Alive (measured): the
    # router opens a fresh connection per request instead of reusing one that may already be gone.
    # Sleep: llama-server unloads its model after --sleep-idle-seconds without a task (its memory, host or GPU,
    # freed; /props says `is_sleeping`) and loads it again for the next request, which waits meanwhile: no route to
    # call either way, the replica only reads the state for the router.
    capabilities = Capabilities(prefix_caching=True, keeps_connections=False, sleep_on_gpu=True, sleep_on_cpu=True)
    sleep_mode = SleepMode(
        args={},
        env={},
        sleeping_path="/props",
        sleeping_field="is_sleeping",
        activity_metrics=("llamacpp:prompt_tokens_total", "llamacpp:tokens_predicted_total"),
        asleep_means="its model unloaded and its memory freed; the next request loads it again",
        idle_arg="sleep_idle_seconds",
    )
    status_gauges = {"llamacpp:requests_processing": "running", "llamacpp:requests_deferred": "waiting"}
    load_metrics = ("llamacpp:requests_processing", "llamacpp:requests_deferred")
    slo_samples = {  # no latency histograms: sized on its queue and token rates alone
        "prompt_tokens": "llamacpp:prompt_tokens_total",
        "output_tokens": "llamacpp:tokens_predicted_total",
        "running": "llamacpp:requests_processing",
        "waiting": "llamacpp:requests_deferred",
    }
    common_args = COMMON_ARGS
    ignored_args = IGNORED_ARGS
    # llama-server's --lora takes GGUF adapters and applies them to every request (or per request by index, its
    # `lora` field): none is a model clients name in `model`
    lora_refusal = (
        "applies GGUF LoRA adapters (--lora) to every request of its server, not as models clients name in `model`"
    )
    checked_only_args = PARALLEL_ARGS  # `parallel` refuses any but 1
    unsafe_args = UNSAFE_ARGS
    # llama-server's OpenAI (and Anthropic messages, rerank) routes and its tokenizer. Left out: /slots (other
    # users' prompts), /props, /lora-adapters, /tools, /models/load, /v1/stream (another conversation's stream),
    # /infill, /completion and the other native routes: on the engine's own port (docs/operations.md).
    inference_paths = (
        *OPENAI_INFERENCE_PATHS,
        "/v1/rerank",
        "/v1/messages",
    )
    public_paths = (
        *inference_paths,
        "/v1/responses/input_tokens",
        "/v1/messages/count_tokens",
        "/tokenize",
        "/detokenize",
    )
    secret_args = tuple(SECRET_ARGS)
    secret_arg_env = SECRET_ARGS
    # llama-server keeps generating for a client that hung up when the request names a conversation
    dropped_request_headers = ("x-conversation-id",)

    def binary(self) -> Path:
        return llama_cpp_build.server_binary()

    def check_available(self, where: str) -> None:
        if not self.binary().is_file():
            raise ConfigError(
                f"llama-server is not built on this machine ({self.binary()} is missing): run `make llama-cpp` "
                "(python -m flagscale.engines.llama_cpp_build; about 10 CPU-minutes, once per version)",
                where,
            )

    def check_model(self, model: Any, where: str) -> str:
        return check_gguf(model, where)

    def parallel(self, args: dict[str, Any], where: str) -> tuple[int, int, int]:
        for key in PARALLEL_ARGS:
            value = args.get(key, 1)
            if value != 1:
                raise ConfigError(
                    f"{key}: {value!r}: a llama.cpp replica is one process on one host and cannot be split; "
                    "serve more copies with resources.num_replicas (or use engine: vllm)",
                    where,
                )
        return (1, 1, 1)

    def argv(self, args: dict[str, Any], where: str) -> list[str]:
        table = flag_table(self.binary())
        argv = ["--model", str(args["model"])]
        for key, value in args.items():
            if key == "model" or value is None:
                continue
            if key == "served_model_name":
                argv += ["--alias", value if isinstance(value, str) else ",".join(value)]
                continue
            if key in ("host", "port") or key in SECRET_ARGS:  # notices say so (config/compat.py); secret_env
                continue
            if key in MANAGED_ARGS:
                raise ConfigError(f"{key} is not an engine arg here: {MANAGED_ARGS[key]}", f"{where}.{key}")
            argv += _flag_argv(table, key, value, where)
        return argv

    def check_api_key(self, api_key: str, where: str) -> None:
        if "," in api_key:
            raise ConfigError(
                "the API key contains ',': llama-server splits its key on commas and would accept each piece alone; "
                "choose a key without commas",
                where,
            )

    def launch(self, argv: list[str], host: str, port: int, api_key: str | None, role: str | None) -> ServerLaunch:
        command = [str(self.binary()), *argv, "--metrics", "--host", host, "--port", str(port)]
        given = set(argv)
        if not {"--threads", "-t"} & given:  # llama-server's own default is every core of the host
            command += ["--threads", str(reserved_cpus())]
        if reserved_gpus():
            # CUDA_VISIBLE_DEVICES (Ray's) shows it only the replica's GPUs; every layer on them, unless told
            if not {"--n-gpu-layers", "--gpu-layers"} & given:
                command += ["--n-gpu-layers", "all"]
        elif not {"--device", "-dev"} & given:
            # a replica without GPUs: a CUDA build would otherwise offload onto GPUs that Ray gave to others
            command += ["--device", "none"]
        return ServerLaunch(command, secret_env={API_KEY_ENV: api_key} if api_key else {})


def reserved_cpus() -> int:
    """The CPUs Ray reserved for the calling replica (its ray_actor_options num_cpus), at least 1; 1 outside Ray."""
    if not ray.is_initialized():
        return 1
    return max(1, math.floor(ray.get_runtime_context().get_assigned_resources().get("CPU", 1)))


def reserved_gpus() -> list[str]:
    """The GPUs Ray reserved for the calling replica (its num_gpus); none outside Ray."""
    if not ray.is_initialized():
        return []
    return [str(gpu) for gpu in ray.get_gpu_ids()]


def _flag_argv(table: dict[str, Flag], key: str, value: Any, where: str) -> list[str]:
    """One engine arg -> llama-server's flag and value, refused unless its flag table has it."""
    name = "--" + key.replace("_", "-")
    flag = table.get(name)
    if flag is None:
        known = [n[2:].replace("-", "_") for n in table]
        close = difflib.get_close_matches(key, known, n=3)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise ConfigError(f"llama-server has no flag {name} (engine arg {key!r}){hint}", f"{where}.{key}")
    if not flag.takes_value:
        if value is True:
            return [name]
        negative = "--no-" + name[2:]
        if value is False and negative in table:
            return [negative]
        raise ConfigError(f"{name} is a switch: give true{' or false' if negative in table else ''}", f"{where}.{key}")
    if isinstance(value, bool) or isinstance(value, (dict, list)):
        raise ConfigError(f"{name} takes a value, got {value!r}", f"{where}.{key}")
    return [name, str(value)]


KIND = LlamaCpp()
