"""Where the project keeps files of its own on this machine: the cache of built and generated things (the demo
models, llama-server, vLLM's parser tables), files and directories private to the user, and the per-user base for
short private directories under /tmp (user_tmp_root: Ray's temp dirs, the start-up locks, the port ledger).
Imports nothing of the project, so every floor may use it."""

from __future__ import annotations

import os
import stat
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


# ---- short private directories under /tmp (cluster/tempdirs.py says why) ----------------------------------


class UnsafeDirectory(Exception):
    pass


def ensure_private_dir(path: str) -> str:
    """Create `path` (mode 0700) or accept it only if it is a directory owned by this user that no one else can
    write to; its mode is then narrowed to 0700. UnsafeDirectory naming it otherwise."""
    path = path.rstrip("/")
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    info = os.lstat(path)
    check_ours(path, info)
    if info.st_mode & 0o022:
        raise UnsafeDirectory(
            f"{path} can be written by other users (mode {stat.S_IMODE(info.st_mode):o}); refusing to use it. "
            "Remove it, or chmod 700 it"
        )
    if stat.S_IMODE(info.st_mode) != 0o700:
        os.chmod(path, 0o700)
    return path


def user_tmp_root(tmp: str = "/tmp") -> str:
    """The per-user base for short-named private directories: <tmp>/flagscale-<uid>, unless that name is taken by
    something that is not a directory of this user's (another user made it first, or it is a link or a file):
    then <cache>/tmp (flagscale/paths.py), its parents created. Nothing is created at the chosen path itself."""
    primary = os.path.join(tmp, f"flagscale-{os.getuid()}")
    try:
        info = os.lstat(primary)
    except FileNotFoundError:
        return primary
    if stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid():
        return primary
    fallback = default_cache_dir() / "tmp"
    fallback.parent.mkdir(parents=True, exist_ok=True)
    return str(fallback)


def check_ours(path: str, info: os.stat_result) -> None:
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise UnsafeDirectory(f"{path} exists and is not a directory (a link or a file); refusing to use it")
    if info.st_uid != os.getuid():
        raise UnsafeDirectory(
            f"{path} is owned by uid {info.st_uid}, not by this user (uid {os.getuid()}); refusing to use it. "
            "Remove it, or use another exp_dir"
        )
