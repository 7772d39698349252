"""The core tests: what CI runs against the oldest core set the version ranges allow.

The core tests are every top-level ``tests/test_*.py`` except the few that exercise the whole
project (docs, the site, the benchmarks), plus the doctests of ``rollkit`` except its optional
interop with torchrl. They must run with only rollkit's core installed (torch, tensordict,
einops) and the ``test`` extra, so these tests check every import they make. ``.ci/run`` reads
the selection from this file::

    python tests/test_core_ranges.py        # prints the pytest arguments of the core tests
"""

from __future__ import annotations

import ast
import sys
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Top-level test files that are not core tests: they run the docs' examples, build the site, or
# drive the benchmarks, all of which import trainers/, recipes/ and their backends;
# test_logprobs.py compares rollkit.logprobs with trainers.engines.hf_rollout (and vLLM).
NOT_CORE = (
    "test_docs.py",
    "test_mkdocs.py",
    "test_benchmarks_smoke.py",
    "test_logprobs.py",
    "test_sim.py",  # drives trainers/ code in benchmarks/sim
    "test_bench_gpu_smoke.py",  # runs benchmarks/bench_gpu.py (trainers, transformers)
    "test_bench_distill.py",  # runs benchmarks/bench_distill.py (trainers, transformers)
    "test_bench_epoch.py",  # runs bench_async / bench_tail_batching --epoch (trainers, transformers, pyyaml)
)
# rollkit modules whose doctests need an extra (torchrl, TRL, verl, OpenRLHF).
NOT_CORE_DOCTESTS = ("rollkit/interop", "rollkit/integrations")
# What a core test may import: the core, the `test` extra, the standard library.
CORE_IMPORTS = frozenset(
    {"rollkit", "torch", "tensordict", "einops", "pytest", "hypothesis", "numpy", "packaging"}
) | frozenset(sys.stdlib_module_names)


def core_test_files() -> list[Path]:
    """The top-level test files of the core tests, sorted."""
    return sorted(p for p in (ROOT / "tests").glob("test_*.py") if p.name not in NOT_CORE)


def core_pytest_args() -> list[str]:
    """The pytest arguments that run the core tests from the repository root."""
    files = [str(p.relative_to(ROOT)) for p in core_test_files()]
    return [*files, "rollkit", *(f"--ignore={d}" for d in NOT_CORE_DOCTESTS)]


def _top(name: str) -> str:
    return name.split(".")[0]


def _imports(path: Path) -> set[str]:
    """Top-level names of the modules `path` imports (anywhere in the file) that could make it
    fail without an extra. Not counted: modules the file skips on with ``pytest.importorskip``
    and imports inside a ``try`` that catches ImportError."""
    tree = ast.parse(path.read_text(), filename=str(path))
    skipped, guarded = set(), set()
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", None) == "importorskip"
            and node.args
            and isinstance(node.args[0], ast.Constant)
        ):
            skipped.add(_top(str(node.args[0].value)))
        elif isinstance(node, ast.Try) and any(
            ast.unparse(h.type or ast.Name("BaseException")) in ("ImportError", "ModuleNotFoundError")
            for h in node.handlers
        ):
            guarded |= {n for stmt in node.body for n in _imports_in(stmt)}
    return _imports_in(tree) - skipped - guarded


def _imports_in(node: ast.AST) -> set[str]:
    out = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Import):
            out |= {_top(a.name) for a in sub.names}
        elif isinstance(sub, ast.ImportFrom) and sub.level == 0 and sub.module:
            out.add(_top(sub.module))
    return out


def _declared_ranges() -> dict[str, str]:
    tomllib = pytest.importorskip("tomllib")
    requirement = pytest.importorskip("packaging.requirements").Requirement
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [requirement(r) for r in project["dependencies"]]
    return {r.name: str(r.specifier) for r in reqs}


def test_core_tests_import_only_the_core():
    bad = {
        p.name: sorted(_imports(p) - CORE_IMPORTS) for p in core_test_files() if _imports(p) - CORE_IMPORTS
    }
    assert not bad, (
        f"core tests import modules outside the core {bad}: CI runs them with only torch, "
        "tensordict, einops and the `test` extra installed. Use pytest.importorskip, move the "
        "file under tests/trainers/, or list it in NOT_CORE in tests/test_core_ranges.py"
    )


def test_core_selection_holds_the_primitives_tests():
    names = {p.name for p in core_test_files()}
    for expected in ("test_losses_policy.py", "test_advantages_outcome.py", "test_td.py", "test_package.py"):
        assert expected in names, f"{expected} is missing from the core tests"
    for name in NOT_CORE:
        assert (ROOT / "tests" / name).exists(), f"NOT_CORE names a test file that does not exist: {name}"
    for d in NOT_CORE_DOCTESTS:
        assert (ROOT / d).exists(), f"NOT_CORE_DOCTESTS names a path that does not exist: {d}"


def test_installed_core_lies_in_the_declared_ranges():
    specifier_set = pytest.importorskip("packaging.specifiers").SpecifierSet
    ranges = _declared_ranges()
    assert set(ranges) == {"torch", "tensordict", "einops"}, f"core dependencies changed: {ranges}"
    for name, spec in ranges.items():
        installed = metadata.version(name)
        assert specifier_set(spec).contains(installed, prereleases=True), (
            f"installed {name} {installed} is outside the declared range {spec!r}"
        )


if __name__ == "__main__":
    print(" ".join(core_pytest_args()))
