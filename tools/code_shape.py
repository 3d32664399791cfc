"""The code's shape in numbers (issue 50): module and function sizes, imports inside functions (each with the reason
written beside it), and how far the router's parts reach into the Router object.

    python tools/code_shape.py            # the report
    python tools/code_shape.py --check    # exit 1 when a limit below is passed

tests/unit/test_layout.py holds the hard rules (circles, floors, class and function size); this script reports the
numbers behind them, so a before/after can be quoted.
"""

from __future__ import annotations

import argparse
import ast
import pathlib
import sys
from collections import Counter
from dataclasses import dataclass

ROOT = pathlib.Path(__file__).resolve().parents[1]
MAX_MODULE_LINES, MAX_FUNCTION_LINES, MAX_IMPORTS_IN_FUNCTIONS = 400, 60, 20
# The router's parts and the names under which they held the whole Router (issue 50, item 1).
ROUTER_PARTS = {"frontend.py": "Frontend", "failover.py": "Failover", "pd.py": "Prefill", "peers.py": "PeerLink"}
ROUTER_NAMES = {"router", "_router"}


@dataclass(frozen=True)
class LocalImport:
    where: str
    module: str
    reason: str  # the comment on the line or the one above; "" when there is none


def python_files(root: pathlib.Path) -> list[pathlib.Path]:
    return sorted((root / "flagscale").rglob("*.py"))


def function_sizes(tree: ast.AST) -> list[tuple[str, int, int]]:
    return [
        (node.name, node.lineno, node.end_lineno - node.lineno + 1)
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    ]


def local_imports(path: pathlib.Path, tree: ast.AST, lines: list[str]) -> list[LocalImport]:
    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if inside and isinstance(child, (ast.Import, ast.ImportFrom)):
                if isinstance(child, ast.Import):
                    module = child.names[0].name
                else:
                    module = "." * child.level + (child.module or "")
                here, above = lines[child.lineno - 1], lines[child.lineno - 2] if child.lineno > 1 else ""
                reason = here.partition("#")[2] or (above.strip()[1:] if above.strip().startswith("#") else "")
                found.append(LocalImport(f"{path.relative_to(ROOT)}:{child.lineno}", module, reason.strip()))
            visit(child, inside)

    visit(tree, False)
    return found


def router_reach(root: pathlib.Path) -> dict[str, list[str]]:
    """Per router part: the Router attributes it reads or writes through the Router object it was given."""
    reach = {}
    for module, part in ROUTER_PARTS.items():
        path = root / "flagscale" / "router" / module
        if not path.exists():
            continue
        attrs = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Attribute):
                continue
            owner = node.value
            if isinstance(owner, ast.Name) and owner.id in ROUTER_NAMES:
                attrs.add(node.attr)
            elif (
                isinstance(owner, ast.Attribute)
                and owner.attr in ROUTER_NAMES
                and isinstance(owner.value, ast.Name)
                and owner.value.id == "self"
            ):
                attrs.add(node.attr)  # self.router.x (aiohttp's app.router is another router)
        reach[part] = sorted(attrs)
    return reach


def report(root: pathlib.Path) -> tuple[list[str], list[str]]:
    lines_out, over = [], []
    modules, functions, imports = [], [], []
    for path in python_files(root):
        text = path.read_text()
        lines = text.splitlines()
        tree = ast.parse(text)
        modules.append((len(lines), str(path.relative_to(root))))
        functions += [
            (size, f"{path.relative_to(root)}:{lineno} {name}") for name, lineno, size in function_sizes(tree)
        ]
        imports += local_imports(path, tree, lines)
    modules.sort(reverse=True)
    functions.sort(reverse=True)
    lines_out.append(f"modules: {len(modules)}, {sum(n for n, _ in modules)} lines")
    lines_out.append(f"largest modules (limit {MAX_MODULE_LINES}):")
    lines_out += [f"  {n:5d}  {name}" for n, name in modules[:8]]
    over += [f"module over {MAX_MODULE_LINES} lines: {name} ({n})" for n, name in modules if n > MAX_MODULE_LINES]
    lines_out.append(f"longest functions (limit {MAX_FUNCTION_LINES}):")
    lines_out += [f"  {n:5d}  {name}" for n, name in functions[:8]]
    over += [
        f"function over {MAX_FUNCTION_LINES} lines: {name} ({n})" for n, name in functions if n > MAX_FUNCTION_LINES
    ]
    by_module = Counter(i.module.split(".")[0] or i.module for i in imports)
    lines_out.append(
        f"imports inside functions: {len(imports)} (limit {MAX_IMPORTS_IN_FUNCTIONS}); by module: "
        + ", ".join(f"{m} {n}" for m, n in by_module.most_common())
    )
    lines_out += [f"  {i.where}  {i.module}  # {i.reason or '(no reason given)'}" for i in imports]
    if len(imports) > MAX_IMPORTS_IN_FUNCTIONS:
        over.append(f"{len(imports)} imports inside functions (limit {MAX_IMPORTS_IN_FUNCTIONS})")
    over += [f"import inside a function without a reason: {i.where} ({i.module})" for i in imports if not i.reason]
    lines_out.append("router parts' reach into the Router (distinct attributes):")
    for part, attrs in router_reach(root).items():
        lines_out.append(f"  {part:9s} {len(attrs):2d}  {' '.join(attrs)}")
    return lines_out, over


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when a limit is passed")
    args = parser.parse_args()
    lines, over = report(ROOT)
    print("\n".join(lines))
    if over:
        print("\nover the limits:\n" + "\n".join(f"  {o}" for o in over))
    return 1 if args.check and over else 0


if __name__ == "__main__":
    sys.exit(main())
