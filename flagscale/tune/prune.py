"""What cannot fit, found before any trial, with the reason recorded in history.csv.

Two checks: the plan's own (build_plan: TP x PP x replicas against the target's devices, GPU shares, weights per
GPU; a ConfigError there means "does not fit"), and memory arithmetic: the weights plus the KV cache of
`max_num_seqs` sequences of `max_model_len` tokens, per device, against what `gpu_memory_utilization` gives
(on a GPU a fraction of its memory; on vLLM's CPU backend a fraction of a NUMA node's RAM).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from flagscale.devices import local_gpus
from flagscale.facts import model_weight_bytes

GIB = 1024**3
NUMA_NODES = Path("/sys/devices/system/node")
CGROUP_LIMIT = Path("/sys/fs/cgroup/memory.max")  # cgroup v2
# vLLM's own defaults when the engine args leave these unset.
VLLM_DEFAULT_MAX_NUM_SEQS = 256
DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2, "fp8": 1, "float8": 1, "int8": 1}


@dataclass(frozen=True)
class ModelShape:
    """What the KV cache of one token costs, from the model's config.json."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int


def model_shape(model_dir: str, dtype: str | None, kv_cache_dtype: str | None) -> ModelShape | None:
    """None for a model without a local config.json (a hub id): the memory check is then left to the engine."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        return None
    cfg = json.loads(path.read_text())
    cfg = cfg.get("text_config", cfg)  # multimodal configs nest the language model's
    try:
        heads = int(cfg["num_attention_heads"])
        layers = int(cfg["num_hidden_layers"])
        head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    except (KeyError, TypeError, ValueError):
        return None
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    model_dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
    chosen = kv_cache_dtype if kv_cache_dtype not in (None, "auto") else dtype
    if chosen in (None, "auto"):
        chosen = model_dtype
    size = next((b for name, b in DTYPE_BYTES.items() if str(chosen).startswith(name)), 2)
    return ModelShape(layers=layers, kv_heads=kv_heads, head_dim=head_dim, dtype_bytes=size)


def kv_bytes_per_token(shape: ModelShape) -> int:
    return 2 * shape.layers * shape.kv_heads * shape.head_dim * shape.dtype_bytes  # K and V


def memory_problem(
    weight_bytes: int,
    kv_token_bytes: int,
    max_num_seqs: int,
    max_model_len: int,
    devices_per_replica: int,
    utilization: float,
    device_bytes: int,
    device: str,
) -> str | None:
    """Why one replica's weights + full KV cache do not fit what gpu_memory_utilization gives per device, or None.
    Weights and KV cache are split evenly over the replica's TP x PP devices."""
    tokens = max_num_seqs * max_model_len
    kv = kv_token_bytes * tokens
    need = (weight_bytes + kv) / devices_per_replica
    budget = utilization * device_bytes
    if need <= budget:
        return None
    where = "of the GPU's" if device == "gpu" else "of the NUMA node's RAM (vLLM's CPU backend)"
    return (
        f"memory: weights {weight_bytes / GIB:.2f} GiB + KV cache {kv / GIB:.2f} GiB (max_num_seqs {max_num_seqs} x "
        f"max_model_len {max_model_len} = {tokens} tokens) over {devices_per_replica} device(s) = {need / GIB:.2f} GiB "
        f"per device, but gpu_memory_utilization {utilization:g} {where} {device_bytes / GIB:.1f} GiB gives "
        f"{budget / GIB:.2f} GiB"
    )


def replica_memory_problem(
    args: dict[str, Any], devices_per_replica: int, device: str, device_bytes: int | None, default_utilization: float
) -> str | None:
    """memory_problem for one engine replica of the plan, from its engine args and its model's config.json."""

    if device_bytes is None:
        return None
    model = str(args["model"])
    shape = model_shape(model, args.get("dtype"), args.get("kv_cache_dtype"))
    if shape is None:
        return None
    max_model_len = args.get("max_model_len") or _max_positions(model)
    if not isinstance(max_model_len, int):
        return None
    return memory_problem(
        weight_bytes=model_weight_bytes(model) or 0,
        kv_token_bytes=kv_bytes_per_token(shape),
        max_num_seqs=int(args.get("max_num_seqs") or VLLM_DEFAULT_MAX_NUM_SEQS),
        max_model_len=max_model_len,
        devices_per_replica=devices_per_replica,
        utilization=float(args.get("gpu_memory_utilization") or default_utilization),
        device_bytes=device_bytes,
        device=device,
    )


def _max_positions(model: str) -> int | None:
    cfg = json.loads((Path(model) / "config.json").read_text())
    value = cfg.get("text_config", cfg).get("max_position_embeddings")
    return value if isinstance(value, int) else None


def device_bytes_of(device: str) -> int | None:
    """Memory of one device of this machine: a GPU's (the smallest), or for CPU engines cpu_engine_bytes(); None
    if unknown."""
    if device == "cpu":
        return cpu_engine_bytes()
    if device == "gpu":
        gpus = local_gpus()
        return min(g.memory_mib for g in gpus) * 1024 * 1024 if gpus else None
    return None  # a hostfile chip type: its memory is not known here


def cpu_engine_bytes(nodes: Path = NUMA_NODES, cgroup_limit: Path = CGROUP_LIMIT) -> int:
    """The RAM vLLM's CPU backend takes gpu_memory_utilization of: not the machine's but the NUMA node's its worker
    runs on (`/sys/devices/system/node/node<N>/meminfo` MemTotal; on a lent 2-core VM, 9.8 of 23.5 GiB), so the
    smallest node's, or the machine's where the kernel lists no nodes; capped, as vLLM caps it, by a cgroup's
    memory limit."""
    sizes = []
    for meminfo in sorted(nodes.glob("node[0-9]*/meminfo")):
        for line in meminfo.read_text().splitlines():  # "Node 0 MemTotal:       10315512 kB"
            fields = line.split()
            if len(fields) >= 4 and fields[2] == "MemTotal:":
                sizes.append(int(fields[3]) * 1024)
    total = min(sizes) if sizes else psutil.virtual_memory().total
    limit = cgroup_limit.read_text().strip() if cgroup_limit.is_file() else "max"
    return min(total, int(limit)) if limit.isdigit() else total


def shared_ram_problem(replicas: int, utilization: float) -> str | None:
    """CPU engines on this machine: each replica's vLLM reserves gpu_memory_utilization of its NUMA node's RAM at
    start."""
    if replicas * utilization > 1:
        return (
            f"memory: {replicas} CPU replicas x gpu_memory_utilization {utilization:g} = {replicas * utilization:.2f} "
            "of a NUMA node's RAM (vLLM's CPU backend reserves that fraction of its node's per engine)"
        )
    return None


def devices_problem(devices: int, cards: int | None) -> str | None:
    if cards is not None and devices > cards:
        return f"devices: TP x PP x instance = {devices} > cards {cards}"
    return None
