"""Directories under /tmp that hold a run's Ray sockets, logs and auth token: private to the user, checked.

Their names are short (Ray's socket paths must fit in 107 bytes) and derived from the exp_dir, so someone else
could create one first. A run's directory is therefore always the child of a private parent: the parent is created
0700, and one that is not ours, is a link, or that others may write into is refused, naming it. The child is
Ray's temp dir, which Ray opens to everyone (mode 777) each time it starts: inside the private parent no one else
can reach it. Run on the host itself; over SSH as `python -m flagscale.cluster.tempdirs <path>` (plain stdlib).

This machine's per-user base is /tmp/flagscale-<uid> (user_tmp_root); when another user made that first, the
user's own cache (<cache>/tmp) serves instead, so no one can block every run by taking the name.
"""

from __future__ import annotations

import os
import stat
import sys

from flagscale.paths import default_cache_dir


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
    _ours(path, info)
    if info.st_mode & 0o022:
        raise UnsafeDirectory(
            f"{path} can be written by other users (mode {stat.S_IMODE(info.st_mode):o}); refusing to use it. "
            "Remove it, or chmod 700 it"
        )
    if stat.S_IMODE(info.st_mode) != 0o700:
        os.chmod(path, 0o700)
    return path


def ensure_dir_in_private_parent(path: str) -> str:
    """A run's Ray temp dir: its parent made private (ensure_private_dir), then `path` created in it (0700) or
    accepted whatever its mode (Ray's own chmod) if it is a directory of ours."""
    path = path.rstrip("/")
    ensure_private_dir(os.path.dirname(path))
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    _ours(path, os.lstat(path))
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


def _ours(path: str, info: os.stat_result) -> None:
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise UnsafeDirectory(f"{path} exists and is not a directory (a link or a file); refusing to use it")
    if info.st_uid != os.getuid():
        raise UnsafeDirectory(
            f"{path} is owned by uid {info.st_uid}, not by this user (uid {os.getuid()}); refusing to use it. "
            "Remove it, or use another exp_dir"
        )


if __name__ == "__main__":
    try:
        ensure_dir_in_private_parent(sys.argv[1])
    except (UnsafeDirectory, OSError) as exc:
        print(exc, file=sys.stderr)
        sys.exit(1)
