"""This machine's GPUs, as nvidia-smi lists them: what local planning checks GPU demand and memory against."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    memory_mib: int


def local_gpus() -> list[Gpu]:
    """Empty without nvidia-smi or when it fails (a CPU machine)."""
    if not shutil.which("nvidia-smi"):
        return []
    query = ["nvidia-smi", "--query-gpu=index,name,memory.total", "--format=csv,noheader,nounits"]
    try:
        out = subprocess.run(query, capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    gpus = []
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 3 and parts[0].isdigit() and parts[2].isdigit():
            gpus.append(Gpu(int(parts[0]), parts[1], int(parts[2])))
    return gpus


def local_gpu_count() -> int:
    return len(local_gpus())
