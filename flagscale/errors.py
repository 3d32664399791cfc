"""The one error type users see (a message that names the culprit, and a non-zero exit), and the excerpt of a log
or traceback that says why something failed."""

from __future__ import annotations

import errno
import re


class FlagScaleError(Exception):
    """An error the user can act on. `where` names the file, key, host or line at fault."""

    exit_code = 1

    def __init__(self, message: str, where: str | None = None):
        self.where = where
        super().__init__(f"{where}: {message}" if where else message)


class ConfigError(FlagScaleError):
    exit_code = 2


class ClusterError(FlagScaleError):
    exit_code = 3


class DeployError(FlagScaleError):
    exit_code = 4


class NotSupportedError(ConfigError):
    """A FlagScale feature whose keys load but which this project does not serve yet."""


# `ValueError: ...`, `pkg.mod.SomeError: ...`, `RayTaskError(EngineStartError): ...`, also behind a log prefix such as
# vLLM's `(EngineCore_DP0 pid=7) `. The colon keeps out source lines quoted in a traceback (`raise SomeError(`).
_ERROR_LINE = re.compile(r"(?:^|\s)[\w.]*(?:Error|Exception)(?:\([\w.]*\))?:")
_TRACEBACK_FRAME = re.compile(r'\bFile "[^"]*", line \d+')
# An error that only points at another one ("Engine core initialization failed. See root cause above.").
_POINTER = re.compile(r"(root cause|stack trace)\b.{0,20}\babove", re.IGNORECASE)


def error_excerpt(text: str, after: int = 2, fallback: int = 10) -> str:
    """The line of `text` (a log, or an exception's text) that states the last error, with the `after` lines that
    follow it; without such a line, the last `fallback` lines. Blank lines are skipped; '' for a blank text.

    After a traceback's last frame, the first error line is the exception's own: the lines after it are its message,
    which may quote other errors (an engine's start-up error quotes the engine log's)."""
    lines = [line.rstrip() for line in text.splitlines() if line.strip()]
    errors = [i for i, line in enumerate(lines) if _ERROR_LINE.search(line)]
    if not errors:
        return "\n".join(lines[-fallback:]) if fallback > 0 else ""
    frames = [i for i, line in enumerate(lines) if _TRACEBACK_FRAME.search(line)]
    after_last_frame = [i for i in errors if frames and i > frames[-1]]
    start = after_last_frame[0] if after_last_frame else errors[-1]
    if _POINTER.search(lines[start]):  # the error it points at: the last one before it that says more
        said = [i for i in errors if i < start and not _POINTER.search(lines[i])]
        start = said[-1] if said else start
    return "\n".join(lines[start : start + 1 + after])


class WriteError(FlagScaleError):
    """A file the runner records its work in could not be written (a full disk, most often)."""


def write_error(path: object, exc: OSError) -> WriteError:
    """One clear error for a failed write of `path`, the disk full case said in words."""
    full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
    return WriteError(f"cannot write it: {'the disk is full (' + exc.strerror + ')' if full else exc}", str(path))
