"""Where the project keeps files of its own on this machine: the cache of built and generated things (the demo
models, llama-server, vLLM's parser tables). Imports nothing of the project, so every floor may use it."""

from __future__ import annotations

import os
from pathlib import Path


def default_cache_dir() -> Path:
    """$FLAGSCALE_CACHE, else $XDG_CACHE_HOME/flagscale, else ~/.cache/flagscale."""
    root = os.environ.get("FLAGSCALE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "flagscale"
    )
    return Path(root)


def private_dir(path: Path) -> Path:
    """`path` made (parents too) and set to 0700: what the project writes there may hold secrets."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(path, 0o700)
    return path


def private_file(path: Path) -> Path:
    """`path` created if missing and set to 0600 (an existing file keeps its content): later opens for appending,
    by this process or another, write to a file only the user reads."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        os.fchmod(fd, 0o600)
    finally:
        os.close(fd)
    return path


def write_private(path: Path, text: str, newline: str | None = None) -> None:
    """`text` as the whole of `path`, a file only the user reads (0600, also when it existed before)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "w", newline=newline) as f:
        f.write(text)
