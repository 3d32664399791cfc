"""Engines that share a GPU start one after another.

While vLLM starts, it profiles the GPU's memory and sizes its KV cache from what it sees; a neighbour allocating at
the same moment is counted as this engine's own overhead, and its KV cache comes out short or empty. So a replica
holds an exclusive lock per GPU it uses (files in this user's private directory under the temp dir, shared by
every replica on the host, which all run as this user) from before its server starts until the server is
healthy; one whose engine args give its KV cache a size of their own (vLLM's kv_cache_memory_bytes:
EngineKind.kv_size_args) measures nothing a neighbour could disturb and starts at once. The directory is checked
(cluster/tempdirs.py): in one that another user made first, they could hold or swap a lock file and keep engines
from starting. Locks are taken in GPU order, so two replicas never wait on
each other; the kernel drops a lock when its holder dies, so a killed replica never blocks the next."""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from flagscale.cluster.tempdirs import ensure_private_dir, user_tmp_root

POLL_S = 0.5


def lock_dir() -> Path:
    return Path(user_tmp_root(tempfile.gettempdir()))


def lock_path(gpu_id: str) -> Path:
    return lock_dir() / f"gpu-start-{gpu_id}.lock"


@contextlib.contextmanager
def gpu_start_lock(
    gpu_ids: list[str], timeout_s: float, note: Callable[[str], None] = lambda _: None
) -> Iterator[None]:
    """Hold every GPU's start-up lock for the body; TimeoutError after `timeout_s` naming the GPU still held,
    tempdirs.UnsafeDirectory (naming it) when the lock directory is not this user's alone."""
    deadline = time.monotonic() + timeout_s
    held: list[int] = []
    if gpu_ids:
        ensure_private_dir(str(lock_dir()))
    try:
        for gpu_id in sorted(set(gpu_ids), key=lambda g: (len(g), g)):
            fd = os.open(lock_path(gpu_id), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
            held.append(fd)
            waiting_said = False
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise TimeoutError(
                            f"GPU {gpu_id}: another engine was still starting on it after "
                            f"{timeout_s:.0f}s ({lock_path(gpu_id)})"
                        ) from None
                    if not waiting_said:
                        note(f"waiting for another engine on GPU {gpu_id} to finish starting")
                        waiting_said = True
                    time.sleep(POLL_S)
        yield
    finally:
        for fd in held:
            os.close(fd)  # closing the descriptor releases its lock
