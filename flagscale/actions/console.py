"""The console an action prints to, and what keeps it from stopping a teardown."""

from __future__ import annotations

from rich.console import Console


class WritesOrNot:
    """A console's file whose write errors (EIO from a terminal that hung up) are dropped."""

    def __init__(self, file):
        self._file = file

    def write(self, text: str) -> int:
        try:
            return self._file.write(text)
        except OSError:
            return len(text)

    def flush(self) -> None:
        try:
            self._file.flush()
        except OSError:
            pass

    def __getattr__(self, name: str):
        return getattr(self._file, name)


def survive_hang_up(console: Console) -> None:
    """After a hang-up the terminal may refuse writes: what follows (a teardown) goes on regardless."""
    if not isinstance(console.file, WritesOrNot):
        console.file = WritesOrNot(console.file)
