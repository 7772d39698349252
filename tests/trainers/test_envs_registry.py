"""trainers.envs.registry and the package's import structure: the registry is the only module that
knows the factories (GEM's as a lazy "module:attr" entry, so no import cycle), and importing the
package loads no torch, no GEM and no game."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from trainers.envs.base import Env
from trainers.envs.frozenlake import FrozenLakeEnv
from trainers.envs.registry import ENVS, GEM_FACTORY, GEM_PREFIX, make_env, register_env, resolve_factory

ENVS_DIR = Path(__file__).resolve().parents[2] / "trainers" / "envs"


def project_imports(path: Path) -> set[str]:
    """The project modules (trainers.*, rollkit.*) a file imports, wherever the import is."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        out.update(n for n in names if n.split(".")[0] in ("trainers", "rollkit"))
    return out


def test_the_envs_package_has_no_import_cycle():
    graph = {
        f"trainers.envs.{p.stem}" if p.stem != "__init__" else "trainers.envs": {
            m for m in project_imports(p) if m.startswith("trainers.envs")
        }
        for p in ENVS_DIR.glob("*.py")
    }
    assert graph["trainers.envs.base"] == set()  # the interface imports nothing of the project
    assert graph["trainers.envs.tools"] == set()  # the tool layer imports no env
    assert graph["trainers.envs.gem"] == {"trainers.envs.base", "trainers.envs.tools"}
    assert "trainers.envs.gem" not in graph["trainers.envs.registry"]  # reached by name, lazily

    def visit(mod: str, path: tuple[str, ...]) -> None:
        for dep in graph.get(mod, ()):
            if dep == "trainers.envs":
                continue  # the package itself is a leaf of its submodules' imports
            assert dep not in path, f"import cycle: {' -> '.join((*path, dep))}"
            visit(dep, (*path, dep))

    for mod in graph:
        visit(mod, (mod,))


def test_importing_the_package_loads_no_torch_gem_or_game():
    code = (
        "import json, sys, trainers.envs; "
        "print(json.dumps(sorted(m for m in sys.modules if m in ('torch', 'gem') "
        "or m.startswith('trainers.envs.'))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    loaded = json.loads(out.stdout)
    assert "torch" not in loaded and "gem" not in loaded
    assert set(loaded) == {
        "trainers.envs.base",
        "trainers.envs.registry",
        "trainers.envs.workers",
        "trainers.envs.wrappers",
    }


def test_string_factories_are_imported_on_first_use():
    register_env("lazy-lake", "trainers.envs.frozenlake:FrozenLakeEnv")
    try:
        env = make_env("lazy-lake", size=3, hole_prob=0.0)
        assert isinstance(env, FrozenLakeEnv) and isinstance(env, Env) and env.size == 3
    finally:
        del ENVS["lazy-lake"]
    assert resolve_factory(FrozenLakeEnv) is FrozenLakeEnv
    with pytest.raises(
        ValueError, match=r"factory: module 'trainers.envs.frozenlake' has no attribute 'Nope'"
    ):
        resolve_factory("trainers.envs.frozenlake:Nope")
    with pytest.raises(ValueError, match=r"name: .*'gem:'"):
        register_env("gem:mine", FrozenLakeEnv)
    with pytest.raises(ValueError, match="name: unknown environment 'nope'"):
        make_env("nope")


def test_gem_ids_go_through_the_lazy_gem_factory():
    assert GEM_PREFIX == "gem:" and GEM_FACTORY == "trainers.envs.gem:GemEnv"
    assert resolve_factory(GEM_FACTORY).__name__ == "GemEnv"
    pytest.importorskip("gem")
    env = make_env("gem:game:GuessTheNumber-v0-easy")
    assert type(env).__name__ == "GemEnv" and env.env_id == "game:GuessTheNumber-v0-easy"
    obs, _ = env.reset(seed=0)
    assert isinstance(obs, str) and obs
