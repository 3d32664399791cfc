"""NVIDIA GPUs: Ray's `GPU`, CUDA_VISIBLE_DEVICES, nvidia-smi for memory, NCCL. This machine's GPUs
(`local_gpus`) are what local planning checks GPU demand and memory against and what the local Ray node starts with.

NVLink multicast (NVLS) stays off in every process of a host with more than one GPU: on the shared hosts these
run on, a process that sets up multicast objects can wedge the whole GPU fabric for every tenant
(docs/parallelism.md)."""

from __future__ import annotations

import os
import shutil
import subprocess

from flagscale.devices.base import Collective, Device, DeviceFamily, EngineOnFamily
from flagscale.devices.listing import nvidia_smi_csv

Gpu = Device  # the name callers used before families

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
QUERY = ("nvidia-smi", "--query-gpu=index,uuid,name,memory.total", "--format=csv,noheader,nounits")

FAMILY = DeviceFamily(
    name="nvidia",
    title="NVIDIA GPU",
    ray_resource="GPU",
    ray_manager="NvidiaGPUAcceleratorManager",
    visible_env="CUDA_VISIBLE_DEVICES",
    chip_types=frozenset(
        {"gpu", "cuda", "a100", "a800", "h100", "h800", "h20", "h200", "b200", "l40s", "l40", "l20", "l4", "a10"}
    ),
    list_argv=QUERY,
    parse_listing=nvidia_smi_csv,
    collective=Collective("NCCL", ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")),
    engines={
        "vllm": EngineOnFamily("vLLM's CUDA build"),
        "sglang": EngineOnFamily("SGLang's CUDA build"),
        "llama_cpp": EngineOnFamily("llama.cpp built with CUDA"),
    },
    alternatives={
        "vllm": (EngineOnFamily("vllm-plugin-FL (FlagGems, FlagCX)", "vllm-plugin-fl", {"VLLM_PLUGINS": "fl"}),)
    },
    multi_device_env=MULTICAST_OFF,
    kv_connectors=frozenset({"NixlConnector", "P2pNcclConnector", "LMCacheConnectorV1"}),
)


def local_gpus() -> list[Gpu]:
    """Empty without nvidia-smi or when it fails (a CPU machine)."""
    if not shutil.which("nvidia-smi"):
        return []
    try:
        out = subprocess.run(list(QUERY), capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return visible(nvidia_smi_csv(out), os.environ.get("CUDA_VISIBLE_DEVICES"))


def visible(gpus: list[Gpu], cuda_visible_devices: str | None) -> list[Gpu]:
    """The GPUs CUDA_VISIBLE_DEVICES leaves this process, in its order (unset: all). Like CUDA, an entry naming no
    GPU here (an index or a UUID or its prefix) ends the list; an empty value leaves none. Ray refuses to start a node
    with more GPUs than the variable lists, so this is what a node started here may claim."""
    if cuda_visible_devices is None:
        return gpus
    chosen: list[Gpu] = []
    for entry in (e.strip() for e in cuda_visible_devices.split(",")):
        match = [g for g in gpus if (entry.isdigit() and g.index == int(entry)) or (entry and g.uuid.startswith(entry))]
        if len(match) != 1 or match[0] in chosen:
            break
        chosen.append(match[0])
    return chosen


def local_gpu_count() -> int:
    return len(local_gpus())
