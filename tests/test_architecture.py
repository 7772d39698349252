"""The layering rules of docs/concepts.md, checked on the source (parsed, never imported).

* Imports point one way: rollkit <- base (``trainers.deps / config / data / models / tracking``)
  <- ``trainers.engines`` <- ``trainers.rewards`` / ``trainers.envs`` / ``trainers.learner``
  <- ``trainers.ray`` / ``trainers.roles`` <- ``trainers.loops`` <- recipes / ablations / benchmarks.
* No import cycle among the project's modules.
* No import of the project's own modules inside a function in ``trainers/``, ``ablations/`` and
  ``recipes/`` (optional heavy third-party backends are imported lazily through
  ``trainers.deps.require``, which names the extra to install). Benchmarks are scripts that set
  thread counts and environment variables before they import; they are exempt.
* ``rollkit`` imports only torch, tensordict, einops and the standard library.
* In ``trainers/``: no class over 400 lines and no function over 80 lines of code (blank lines,
  comments and docstrings not counted); no file over 900 lines and no module of
  ``trainers.config`` over 450; the loops reach Ray only through the roles (no loop imports
  ``trainers.ray``). The files and loops that break the last two rules today are listed (the
  trainer-layer redesign's debt): a listed file may not grow, and nothing may join the lists.
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROJECT = ("rollkit", "trainers", "ablations", "recipes", "benchmarks")
MAX_CLASS_LINES, MAX_FUNCTION_LINES = 400, 80
MAX_FILE_LINES, MAX_CONFIG_MODULE_LINES = 900, 450
#: files of trainers/ over MAX_FILE_LINES today, with their length: each may only shrink, and
#: leaves this table once it fits
OVERSIZED: dict[str, int] = {}
#: loops that import trainers.ray today (Ray belongs to the roles): none may join
LOOPS_ON_RAY: set[str] = set()

#: (prefix, layer): the longest matching prefix decides
LAYERS = [
    ("rollkit", 0),
    ("trainers", 1),
    ("trainers.deps", 1),
    ("trainers.config", 1),
    ("trainers.data", 1),
    ("trainers.models", 1),
    ("trainers.vision", 1),
    ("trainers.tracking", 1),
    ("trainers.engines", 2),
    ("trainers.rewards", 3),
    ("trainers.envs", 3),
    ("trainers.learner", 3),
    ("trainers.critic", 3),
    ("trainers.ray", 4),
    ("trainers.roles", 4),
    ("trainers.loops", 5),
    ("recipes", 6),
    ("ablations", 6),
    ("benchmarks", 6),
]


def layer(module: str) -> int:
    best = max((p for p, _ in LAYERS if module == p or module.startswith(p + ".")), key=len)
    return dict(LAYERS)[best]


def modules() -> dict[str, Path]:
    out = {}
    for top in PROJECT:
        for f in sorted((ROOT / top).rglob("*.py")):
            parts = list(f.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = f
    return out


MODULES = modules()


def _resolve(name: str) -> str | None:
    """The project module an import names (``from pkg import mod`` names ``pkg.mod`` when that
    is a module), or None for third-party modules."""
    if name.split(".")[0] not in PROJECT:
        return None
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports(path: Path) -> list[tuple[str, int, bool]]:
    """``(project module, line, inside a function)`` for every import of a project module."""
    tree = ast.parse(path.read_text(), str(path))
    found: list[tuple[str, int, bool]] = []

    def visit(node: ast.AST, in_func: bool) -> None:
        for child in ast.iter_child_nodes(node):
            func = in_func or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                names = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom) and child.module and not child.level:
                names = [f"{child.module}.{a.name}" for a in child.names]
                names = [n if n in MODULES else child.module for n in names]
            else:
                names = []
            for n in names:
                m = _resolve(n)
                if m is not None:
                    found.append((m, child.lineno, in_func))
            visit(child, func)

    visit(tree, False)
    return found


GRAPH = {m: imports(p) for m, p in MODULES.items()}


def _where(m: str, line: int) -> str:
    return f"{MODULES[m].relative_to(ROOT)}:{line}"


def test_imports_point_one_way():
    bad = [
        f"{_where(m, line)}: {m} (layer {layer(m)}) imports {target} (layer {layer(target)})"
        for m, found in GRAPH.items()
        for target, line, _ in found
        if layer(target) > layer(m)
    ]
    assert not bad, "imports against the layering:\n" + "\n".join(bad)


def test_no_project_import_inside_a_function():
    bad = [
        f"{_where(m, line)}: {m} imports {target} inside a function"
        for m, found in GRAPH.items()
        if not m.startswith("benchmarks")
        for target, line, in_func in found
        if in_func
    ]
    assert not bad, "\n".join(bad)


def test_no_import_cycle():
    edges = defaultdict(set)
    for m, found in GRAPH.items():
        for target, _, in_func in found:
            if not in_func and target != m:
                edges[m].add(target)
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def dfs(u: str) -> None:
        state[u] = 1
        stack.append(u)
        for v in sorted(edges[u]):
            if state.get(v) == 1:
                cycles.append([*stack[stack.index(v) :], v])
            elif v not in state:
                dfs(v)
        stack.pop()
        state[u] = 2

    sys.setrecursionlimit(10_000)
    for m in sorted(MODULES):
        if m not in state:
            dfs(m)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


ROLLKIT_ALLOWED = {"torch", "tensordict", "einops", "rollkit", "hypothesis", "numpy", "torchrl", "__future__"}


def test_rollkit_imports_only_its_core():
    """rollkit needs torch, tensordict and einops; hypothesis (rollkit.testing), torchrl
    (rollkit.interop) and numpy are optional, imported only by the modules that name them."""
    stdlib = set(sys.stdlib_module_names)
    bad = []
    for m, path in MODULES.items():
        if not m.startswith("rollkit"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [node.module]
            for n in names:
                top = n.split(".")[0]
                if top not in stdlib and top not in ROLLKIT_ALLOWED:
                    bad.append(f"{_where(m, node.lineno)}: {n}")
    assert not bad, "\n".join(bad)


def _code_lines(node: ast.AST, source: list[str]) -> int:
    """Lines of code of a def / class: not blank, not a comment, not a docstring."""
    doc: set[int] = set()
    for n in ast.walk(node):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Module)) and n.body:
            first = n.body[0]
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                doc.update(range(first.lineno, first.end_lineno + 1))
    count = 0
    for i in range(node.lineno, node.end_lineno + 1):
        text = source[i - 1].strip()
        if text and not text.startswith("#") and i not in doc:
            count += 1
    return count


def _sizes() -> list[tuple[str, str, int, int]]:
    out = []
    for m, path in MODULES.items():
        if not m.startswith("trainers"):
            continue
        source = path.read_text().splitlines()
        for node in ast.walk(ast.parse("\n".join(source))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                limit = MAX_CLASS_LINES if isinstance(node, ast.ClassDef) else MAX_FUNCTION_LINES
                out.append((_where(m, node.lineno), node.name, _code_lines(node, source), limit))
    return out


def test_classes_and_functions_stay_small():
    bad = [
        f"{where}: {name} has {n} lines of code (limit {limit})"
        for where, name, n, limit in _sizes()
        if n > limit
    ]
    assert not bad, "\n".join(bad)


def test_files_stay_small():
    bad = []
    for m, path in MODULES.items():
        if not m.startswith("trainers"):
            continue
        rel = str(path.relative_to(ROOT))
        n = len(path.read_text().splitlines())
        limit = MAX_CONFIG_MODULE_LINES if m.startswith("trainers.config") else MAX_FILE_LINES
        limit = max(limit, OVERSIZED.get(rel, 0))
        if n > limit:
            bad.append(f"{rel}: {n} lines (limit {limit})")
    assert not bad, "\n".join(bad)
    stale = [f for f, n in OVERSIZED.items() if len((ROOT / f).read_text().splitlines()) <= MAX_FILE_LINES]
    assert not stale, f"now within {MAX_FILE_LINES} lines, remove from OVERSIZED: {stale}"


def test_loops_reach_ray_through_the_roles():
    on_ray = {
        m
        for m, found in GRAPH.items()
        if m.startswith("trainers.loops")
        for t, _, _ in found
        if layer(t) == 4 and t.startswith("trainers.ray")
    }
    assert on_ray <= LOOPS_ON_RAY, (
        f"loops that import trainers.ray (use trainers.roles): {sorted(on_ray - LOOPS_ON_RAY)}"
    )
    assert on_ray == LOOPS_ON_RAY, (
        f"no longer import trainers.ray, remove from LOOPS_ON_RAY: {sorted(LOOPS_ON_RAY - on_ray)}"
    )


@pytest.mark.parametrize(
    ("module", "expected"),
    [
        ("rollkit.losses", 0),
        ("trainers.config", 1),
        ("trainers.engines.build", 2),
        ("trainers.engines.offload", 2),
        ("trainers.envs.base", 3),
        ("trainers.roles", 4),
        ("trainers.loops.sync", 5),
        ("recipes.rlvr_qwen", 6),
    ],
)
def test_layer_table(module, expected):
    assert layer(module) == expected
