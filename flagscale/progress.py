"""A progress display on the long waits a user sits through (generating or converting a model, auto_tune's trials),
drawn with rich on stderr only when stderr is a terminal: CI logs, pipes and tests see nothing of it, and
FLAGSCALE_PROGRESS=0 turns it off. Callers add one line around the wait:

    with waiting("converting the demo model to GGUF") as note:
        ...; note("step 2 of 3")
    for candidate in steps(candidates, "auto_tune trials"):
        ...
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import TypeVar

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

T = TypeVar("T")
Note = Callable[..., None]


def enabled(console: Console) -> bool:
    return console.is_terminal and os.environ.get("FLAGSCALE_PROGRESS", "1") != "0"


def _quiet(text: str | None = None, advance: int = 0) -> None:
    del text, advance


@contextmanager
def waiting(what: str, total: int | None = None, console: Console | None = None) -> Iterator[Note]:
    """A spinner with the elapsed time (a bar when `total` steps are known) while the block runs; it vanishes when
    the block ends. Yields `note(text=None, advance=0)`: a short line beside it, and steps done."""
    console = console or Console(stderr=True)
    if not enabled(console):
        yield _quiet
        return
    columns = [SpinnerColumn(), TextColumn("{task.description}")]
    if total is not None:
        columns += [BarColumn(), MofNCompleteColumn()]
    columns += [TimeElapsedColumn(), TextColumn("[dim]{task.fields[note]}")]
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task(what, total=total, note="")

        def note(text: str | None = None, advance: int = 0) -> None:
            progress.update(task, advance=advance, **({"note": text} if text is not None else {}))

        yield note


def steps(items: Iterable[T], what: str, console: Console | None = None) -> Iterator[T]:
    """`items`, one by one, under a bar that counts them."""
    items = list(items)
    with waiting(what, total=len(items), console=console) as note:
        for item in items:
            yield item
            note(advance=1)
