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
import sys

from flagscale.paths import UnsafeDirectory, check_ours, ensure_private_dir, user_tmp_root

__all__ = ["UnsafeDirectory", "ensure_dir_in_private_parent", "ensure_private_dir", "user_tmp_root"]


def ensure_dir_in_private_parent(path: str) -> str:
    """A run's Ray temp dir: its parent made private (ensure_private_dir), then `path` created in it (0700) or
    accepted whatever its mode (Ray's own chmod) if it is a directory of ours."""
    path = path.rstrip("/")
    ensure_private_dir(os.path.dirname(path))
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    check_ours(path, os.lstat(path))
    return path


if __name__ == "__main__":
    try:
        ensure_dir_in_private_parent(sys.argv[1])
    except (UnsafeDirectory, OSError) as exc:
        print(exc, file=sys.stderr)
        sys.exit(1)
