"""One action at a time on an exp_dir: `run` (start or update), `test` and `stop` hold an OS lock on
<exp_dir>/action.lock for their whole life; a second one is refused at once, naming the holder.

fcntl.flock belongs to the open file, so the kernel releases it when the holder exits, however it exits: a crashed
run never blocks the next one. The holder writes who it is (pid, action, since when) into the locked file for the
refusal message; the file itself is left in place (removing it would let two processes lock two different files).
The descriptor is not inherited by the processes the holder starts (Python opens files non-inheritable), so a Ray
node outliving the run does not keep the lock.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from pathlib import Path

from flagscale.errors import FlagScaleError

LOCK_FILE = "action.lock"


class ExpDirBusy(FlagScaleError):
    pass


class ExpDirLock:
    def __init__(self, exp_dir: str | Path, action: str):
        self.path = Path(exp_dir) / LOCK_FILE
        self.action = action
        self._fd: int | None = None

    def acquire(self) -> ExpDirLock:
        """Take the lock or raise ExpDirBusy naming the holder; never waits."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise ExpDirBusy(
                f"another action holds this exp_dir: {describe_holder(holder)}. Wait for it to finish "
                + (
                    "(an attached `run foreground=true` stops with Ctrl-C in its terminal, or "
                    f"`kill -INT {holder['pid']}`)"
                    if holder.get("foreground")
                    else "or stop it first"
                ),
                str(self.path.parent),
            ) from None
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        self.describe(foreground=False)
        return self

    def describe(self, **details: object) -> None:
        """(Re)write the holder record: pid, action, since when, and `details` (e.g. foreground=True)."""
        assert self._fd is not None
        record = {"pid": os.getpid(), "action": self.action, "since": time.time(), **details}
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, json.dumps(record).encode(), 0)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the only descriptor of the open file releases the flock
            self._fd = None

    def __enter__(self) -> ExpDirLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _read_holder(fd: int) -> dict:
    try:
        data = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except ValueError:  # being rewritten right now
        return {}
    return data if isinstance(data, dict) else {}


def describe_holder(holder: dict) -> str:
    if not isinstance(holder.get("pid"), int):
        return "a process that is just starting"
    since = holder.get("since")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since)) if isinstance(since, (int, float)) else "?"
    action = holder.get("action", "?")
    attached = ", attached (foreground=true)" if holder.get("foreground") else ""
    return f"pid {holder['pid']} (action={action}{attached}) since {when}"
