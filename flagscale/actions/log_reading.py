"""Reading a log where it is: its size and byte ranges through its host's CommandRunner (`wc -c`, `dd`: plain argvs),
the last lines from a window that grows from the end, follow's place in each log, and printing under headers."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

from rich.console import Console

from flagscale.actions.log_sources import LogSource
from flagscale.cluster import ssh
from flagscale.cluster.runner import CommandRunner, runner_for
from flagscale.errors import ClusterError

READ_TIMEOUT_S = 30.0  # one read of one log, on its host
MAX_READ_BYTES = 1 << 20  # follow: at most this much of one log per poll (a burst is caught up over the next polls)
TAIL_WINDOW_BYTES = 4 << 20  # the last lines are looked for in the file's last 4 MiB
TAIL_FIRST_BYTES = 64 << 10  # the first look for the last lines; grown 4x at a time up to TAIL_WINDOW_BYTES


@dataclass
class Chunk:
    offset: int  # the byte offset read up to
    text: str
    truncated: bool = False  # the file is shorter than the offset asked for: it was truncated or replaced


def size_argv(path: str) -> list[str]:
    """The file's size in bytes, as `wc -c` prints it (the first word)."""
    return ["wc", "-c", "--", path]


def bytes_argv(path: str, start: int, count: int) -> list[str]:
    """`count` bytes of the file from byte `start` (fewer where it ends)."""
    return [
        "dd",
        f"if={path}",
        "bs=1M",
        "iflag=skip_bytes,count_bytes",
        f"skip={start}",
        f"count={count}",
        "status=none",
    ]


def last_lines(text: str, count: int) -> str:
    """The last `count` lines of text, as `tail -n` gives them."""
    if count <= 0 or not text:
        return ""
    ends_whole = text.endswith("\n")
    kept = (text[:-1] if ends_whole else text).split("\n")[-count:]
    return "\n".join(kept) + ("\n" if ends_whole else "")


@dataclass
class Follower:
    """One log being read: where it stands, and the line it is part-way through (printed once it is whole)."""

    source: LogSource
    offset: int | None = None
    partial: str = ""
    problem: str | None = None  # the last read failure, printed once
    gone: bool = False  # printed "not readable" once; stays quiet until it reads again


@dataclass
class Readers:
    """One CommandRunner per host, opened on first use (an SSH connection kept for follow's polls)."""

    settings: ssh.SshSettings = field(default_factory=ssh.SshSettings)
    # (node id, host) -> the runner of a Ray node (the run's Launcher.node_runner): logs read there, not here or over SSH
    node_runner: Callable[[str, str], CommandRunner] | None = None
    _runners: dict[str, CommandRunner] = field(default_factory=dict)

    def runner(self, source: LogSource) -> CommandRunner:
        if source.node_id and self.node_runner:
            if source.node_id not in self._runners:
                self._runners[source.node_id] = self.node_runner(source.node_id, source.host)
            return self._runners[source.node_id]
        remote = source.ssh_host is not None and not os.access(source.path, os.R_OK)
        key = source.ssh_host if remote else "localhost"
        if key not in self._runners:
            self._runners[key] = runner_for(key, remote, self.settings)
        return self._runners[key]

    def read(self, source: LogSource, offset: int | None, lines: int) -> Chunk:
        """The last `lines` lines of the log as it is now (offset None), else what follows `offset`, at most
        MAX_READ_BYTES; Chunk.offset is where the text ends. A file shorter than `offset` is truncated."""
        runner = self.runner(source)
        size = int(self._run(runner, source.path, size_argv(source.path)).split()[0])
        if offset is None:
            return Chunk(size, self._tail(runner, source.path, size, lines))
        if size < offset:
            return Chunk(size, "", truncated=True)
        end = min(size, offset + MAX_READ_BYTES)
        text = self._run(runner, source.path, bytes_argv(source.path, offset, end - offset)) if end > offset else ""
        return Chunk(end, text)

    def _tail(self, runner: CommandRunner, path: str, size: int, lines: int) -> str:
        """The last `lines` lines before byte `size`, looked for in a window from the end that grows until it holds
        them (or is TAIL_WINDOW_BYTES, or the whole file): a long log's last lines without reading all of it."""
        window = TAIL_FIRST_BYTES
        while True:
            start = max(0, size - min(window, TAIL_WINDOW_BYTES))
            text = self._run(runner, path, bytes_argv(path, start, size - start)) if size > start else ""
            if text.count("\n") > lines or start == 0 or window >= TAIL_WINDOW_BYTES:
                return last_lines(text, lines)
            window *= 4

    @staticmethod
    def _run(runner: CommandRunner, path: str, argv: list[str]) -> str:
        result = runner.run(argv, timeout_s=READ_TIMEOUT_S)
        if result.code != 0:
            why = (result.stderr or result.stdout).strip().splitlines()
            raise ClusterError(f"cannot read {path}: {why[-1] if why else f'exit code {result.code}'}")
        return result.stdout

    def close(self) -> None:
        for runner in self._runners.values():
            runner.close()
        self._runners.clear()


class Printer:
    """Writes logs' text under their headers (stdout); a header again whenever the text comes from another log, as
    tail -f does. Notes (follow's progress, read problems) go to stderr, so the logs can be piped."""

    def __init__(self, out=None, notes: Console | None = None):
        self.out = out or sys.stdout
        self.notes = notes or Console(stderr=True, highlight=False, soft_wrap=True)
        self.current: LogSource | None = None

    def header(self, source: LogSource) -> None:
        if self.current is not None:
            self.out.write("\n")
        self.out.write(source.header() + "\n")
        self.out.flush()
        self.current = source

    def text(self, source: LogSource, text: str) -> None:
        if not text:
            return
        if self.current != source:
            self.header(source)
        self.out.write(text if text.endswith("\n") else text + "\n")
        self.out.flush()

    def note(self, message: str) -> None:
        self.out.flush()
        self.notes.print(message, markup=False, style="yellow", soft_wrap=True)
