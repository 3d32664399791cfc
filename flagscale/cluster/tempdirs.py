"""Directories under /tmp that hold a run's Ray sockets, logs and auth token: private to the user, checked.

Their names are short (Ray's socket paths must fit in 107 bytes) and derived from the exp_dir, so someone else
could create one first: a directory that is not ours, is a link, or that others may write into is refused,
naming it. Run on the host itself; over SSH as `python -m flagscale.cluster.tempdirs <path>` (plain stdlib).
"""

from __future__ import annotations

import os
import stat
import sys


class UnsafeDirectory(Exception):
    pass


def ensure_private_dir(path: str) -> str:
    """Create `path` (mode 0700, parents as needed) or accept it only if it is a directory owned by this user that
    no one else can write to; its mode is then narrowed to 0700. UnsafeDirectory (naming it) otherwise."""
    parent = os.path.dirname(path.rstrip("/"))
    if parent and not os.path.isdir(parent):
        os.makedirs(parent, mode=0o700, exist_ok=True)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise UnsafeDirectory(f"{path} exists and is not a directory (a link or a file); refusing to use it")
    if info.st_uid != os.getuid():
        raise UnsafeDirectory(
            f"{path} is owned by uid {info.st_uid}, not by this user (uid {os.getuid()}); refusing to use it. "
            "Remove it, or use another exp_dir"
        )
    if info.st_mode & 0o022:
        raise UnsafeDirectory(
            f"{path} can be written by other users (mode {stat.S_IMODE(info.st_mode):o}); refusing to use it. "
            "Remove it, or chmod 700 it"
        )
    if stat.S_IMODE(info.st_mode) != 0o700:
        os.chmod(path, 0o700)
    return path


if __name__ == "__main__":
    try:
        ensure_private_dir(sys.argv[1])
    except (UnsafeDirectory, OSError) as exc:
        print(exc, file=sys.stderr)
        sys.exit(1)
