"""Where the shipped configs are: the checkout's conf/ and examples/ (run.py, `pip install -e .`), or the copies that
a wheel carries under flagscale/_data/ (`pip install .`)."""

from __future__ import annotations

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parents[1]
_CHECKOUT = _PACKAGE.parent
_BUNDLED = _PACKAGE / "_data"


def _root() -> Path:
    if (_CHECKOUT / "conf" / "serve.yaml").is_file() and (_CHECKOUT / "examples").is_dir():
        return _CHECKOUT
    return _BUNDLED


def conf_dir() -> Path:
    """The embedded default config (serve.yaml: the demo model on this machine)."""
    return _root() / "conf"


def examples_dir() -> Path:
    return _root() / "examples"


def example_names() -> list[str]:
    """Every examples/<name> that has conf/serve.yaml, sorted."""
    root = examples_dir()
    if not root.is_dir():
        return []
    return sorted(p.parent.parent.name for p in root.glob("*/conf/serve.yaml"))
