"""This machine's GPUs, as nvidia-smi lists them and CUDA_VISIBLE_DEVICES lets this process use: what local
planning checks GPU demand and memory against, and what the local Ray node is started with."""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    memory_mib: int
    uuid: str = ""


def local_gpus() -> list[Gpu]:
    """Empty without nvidia-smi or when it fails (a CPU machine)."""
    if not shutil.which("nvidia-smi"):
        return []
    query = ["nvidia-smi", "--query-gpu=index,uuid,name,memory.total", "--format=csv,noheader,nounits"]
    try:
        out = subprocess.run(query, capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    gpus = []
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 4 and parts[0].isdigit() and parts[3].isdigit():
            gpus.append(Gpu(int(parts[0]), parts[2], int(parts[3]), parts[1]))
    return visible(gpus, os.environ.get("CUDA_VISIBLE_DEVICES"))


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
