"""The benchmarks run where CI cannot (a GPU machine) and import the project lazily, inside functions: every
`from flagscale... import name` in benchmarks/ must still name something that exists, wherever it is written."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def project_imports() -> list[tuple[str, int, str, str]]:
    found = []
    for path in sorted((REPO / "benchmarks").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "flagscale":
                found += [(str(path.relative_to(REPO)), node.lineno, node.module, a.name) for a in node.names]
    return found


def test_every_project_import_in_the_benchmarks_resolves():
    imports = project_imports()
    assert imports, "no `from flagscale... import` found under benchmarks/"
    missing = []
    for where, line, module, name in imports:
        try:
            target = importlib.import_module(module)
        except ImportError as exc:
            missing.append(f"{where}:{line}: {module}: {exc}")
            continue
        if not hasattr(target, name):
            try:
                importlib.import_module(f"{module}.{name}")
            except ImportError:
                missing.append(f"{where}:{line}: {module} has no {name}")
    assert not missing, "\n".join(missing)
