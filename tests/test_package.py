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
