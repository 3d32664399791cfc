"""The tree's layout holds (docs/design.md, issue 33): no import circles, no import that runs back up the floors
(imports under `if TYPE_CHECKING:` are for type checkers only and count for neither), no class over 300 lines or
function over 60, project imports inside functions only with a reason beside them, and vLLM named in code (not
comments or docstrings) in at most 4 modules outside engines/ and tune/.

The floors, bottom to top, are FLOORS below: a module may import its own floor or a lower one.
"""

import ast
import collections
import io
import pathlib
import subprocess
import sys
import tokenize

# bottom -> top; a module may import its own floor or lower. "=x" matches x exactly (a package's __init__).
FLOORS = [
    [
        "flagscale",
        "flagscale.adaptors",
        "flagscale.errors",
        "flagscale.net",
        "flagscale.devices",
        "flagscale.paths",
        "flagscale.secrets",
        "=flagscale.actions",
    ],
    ["flagscale.engines", "flagscale.planner", "flagscale.router.policies", "flagscale.router.circuit_breaker"],
    ["flagscale.demo_model"],
    ["flagscale.config"],
    ["flagscale.cluster"],
    ["flagscale.replica"],
    ["flagscale.router"],
    ["flagscale.launchers"],
    ["flagscale.facts", "flagscale.plan"],
    ["flagscale.serve"],
    ["flagscale.update"],
    ["flagscale.actions"],
    ["flagscale.tune"],
    ["flagscale.actions.auto_tune", "flagscale.actions.dryrun"],
    ["flagscale.actions.dispatch", "flagscale.cli"],
]
MAX_CLASS, MAX_FUNC, MAX_VLLM_MODULES = 300, 60, 4


def floor(m):
    best = None
    for i, group in enumerate(FLOORS):
        for g in group:
            exact = g.startswith("=")
            g = g.lstrip("=")
            hit = m == g if exact else (m == g or m.startswith(g + "."))
            if hit and (best is None or len(g) + exact > best[1]):
                best = (i, len(g) + exact)
    return best[0] if best else None


def modules(root):
    mods = {}
    for p in sorted((root / "flagscale").rglob("*.py")):
        name = ".".join(p.relative_to(root).with_suffix("").parts)
        mods[name.removesuffix(".__init__")] = p
    return mods


def _type_checking_only(node):
    """`if TYPE_CHECKING:` (or `typing.TYPE_CHECKING`) with no else branch."""
    if not isinstance(node, ast.If) or node.orelse:
        return False
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports(name, path, mods):
    tree = ast.parse(path.read_text())
    pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []

    def visit(node, in_func):
        for child in ast.iter_child_nodes(node):
            if _type_checking_only(child):
                continue  # read by type checkers only: neither an upward import nor a circle at run time
            f = in_func or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            targets = []
            if isinstance(child, ast.Import):
                targets = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    parts = pkg.split(".")[: len(pkg.split(".")) - child.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in child.names]
            for t in targets:
                internal = t
                while internal and internal not in mods:
                    internal = internal.rpartition(".")[0]
                out.append((child.lineno, t, internal if internal.startswith("flagscale") else None, f))
            visit(child, f)

    visit(tree, False)
    return out, tree


def check(root):
    mods = modules(root)
    edges = collections.defaultdict(set)
    findings = []
    for name, path in mods.items():
        lines = path.read_text().splitlines()
        found, tree = imports(name, path, mods)
        seen = set()
        for lineno, target, internal, in_func in found:
            if internal and internal != name:
                edges[name].add(internal)
                fa, fb = floor(name), floor(internal)
                if fa is None or fb is None:
                    findings.append(f"no floor: {name} or {internal} (add it to FLOORS)")
                elif fb > fa and (lineno, internal) not in seen:
                    seen.add((lineno, internal))
                    findings.append(f"up: {name} -> {internal} ({path}:{lineno})")
            if in_func and internal and (lineno, "reason") not in seen:
                seen.add((lineno, "reason"))
                here, above = lines[lineno - 1], lines[lineno - 2] if lineno > 1 else ""
                if "#" not in here and not above.strip().startswith("#"):
                    findings.append(f"import in a function without a reason: {path}:{lineno} ({target})")
        for node in ast.walk(tree):
            size = (node.end_lineno or node.lineno) - node.lineno + 1 if hasattr(node, "end_lineno") else 0
            if isinstance(node, ast.ClassDef) and size > MAX_CLASS:
                findings.append(f"class over {MAX_CLASS} lines: {path}:{node.lineno} {node.name} ({size})")
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and size > MAX_FUNC:
                findings.append(f"function over {MAX_FUNC} lines: {path}:{node.lineno} {node.name} ({size})")
    # circles (Tarjan)
    index, low, stack, on, n = {}, {}, [], set(), [0]
    sys.setrecursionlimit(10000)

    def strong(v):
        index[v] = low[v] = n[0]
        n[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                findings.append(f"import circle: {' <-> '.join(sorted(comp))}")

    for v in list(mods):
        if v not in index:
            strong(v)
    # vLLM named in code (not comments or docstrings) outside engines/
    naming = []
    for name, path in mods.items():
        # tune/ may name vLLM (issue 33); a device family names the engine kinds it runs and their plugins (issue 54)
        if name.startswith(("flagscale.engines", "flagscale.tune", "flagscale.devices")):
            continue
        src = path.read_text()
        docstrings = set()
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
                first = node.body[0]
                if (
                    isinstance(first, ast.Expr)
                    and isinstance(first.value, ast.Constant)
                    and isinstance(first.value.value, str)
                ):
                    docstrings.add(first.lineno)
        for tok in tokenize.generate_tokens(io.StringIO(src).readline):
            if (
                tok.type in (tokenize.NAME, tokenize.STRING)
                and "vllm" in tok.string.lower()
                and tok.start[0] not in docstrings
            ):
                naming.append(name)
                break
    if len(naming) > MAX_VLLM_MODULES:
        findings.append(
            f"vLLM named in code in {len(naming)} modules outside engines/ (at most {MAX_VLLM_MODULES}): {', '.join(naming)}"
        )
    return findings


ROOT = pathlib.Path(__file__).resolve().parents[2]
FINDINGS = check(ROOT)


def _of(kind: str) -> list[str]:
    return [f for f in FINDINGS if f.startswith(kind)]


def test_no_import_circles():
    assert not _of("import circle"), _of("import circle")


def test_no_import_runs_back_up_the_floors():
    assert not _of("up:") and not _of("no floor"), _of("up:") + _of("no floor")


def test_classes_and_functions_fit_in_a_head():
    assert not _of("class over") and not _of("function over"), _of("class over") + _of("function over")


def test_project_imports_inside_functions_say_why():
    assert not _of("import in a function"), _of("import in a function")


def test_vllm_is_named_only_in_engines_and_a_few_modules():
    assert not _of("vLLM named"), _of("vLLM named")


def test_type_only_imports_are_not_edges(tmp_path):
    (tmp_path / "flagscale").mkdir()
    source = tmp_path / "flagscale" / "low.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from flagscale.high import Plan\n"
        "if typing.TYPE_CHECKING:\n    import flagscale.high\n"
        "import flagscale.high\n"
    )
    mods = {"flagscale.low": source, "flagscale.high": source}
    found, _ = imports("flagscale.low", source, mods)
    assert [(lineno, internal) for lineno, _, internal, _ in found] == [(1, None), (6, "flagscale.high")]


def test_code_shape_stays_within_its_limits():
    """tools/code_shape.py --check: no module over 400 lines, at most 20 imports inside functions, each with its
    reason (issue 50)."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "code_shape.py"), "--check"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout[done.stdout.find("over the limits") :]
