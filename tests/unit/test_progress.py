"""flagscale/progress.py: drawn on a terminal, silent elsewhere (CI logs, pipes)."""

from __future__ import annotations

import io

from rich.console import Console

from flagscale.progress import steps, waiting


def test_quiet_when_not_a_terminal():
    out = io.StringIO()
    with waiting("converting", console=Console(file=out)) as note:
        note("half way", advance=1)
    assert list(steps([1, 2], "trials", console=Console(file=out))) == [1, 2]
    assert out.getvalue() == ""


def test_drawn_on_a_terminal_and_off_with_the_variable(monkeypatch):
    out = io.StringIO()
    terminal = Console(file=out, force_terminal=True, width=100)
    assert list(steps(["a", "b"], "auto_tune trials", console=terminal)) == ["a", "b"]
    assert "auto_tune trials" in out.getvalue()
    monkeypatch.setenv("FLAGSCALE_PROGRESS", "0")
    quiet = io.StringIO()
    with waiting("converting", console=Console(file=quiet, force_terminal=True)):
        pass
    assert quiet.getvalue() == ""
