"""The environment registry: names -> factories, and :func:`make_env`.

A factory is a callable returning an :class:`~trainers.envs.base.Env`, or a ``"module:attr"``
string that is imported only when the environment is built (the built-in games are registered
that way, so importing the registry loads none of them). GEM's environments are reached as
``"gem:<GEM id>"`` through the lazy factory :data:`GEM_FACTORY`: ``gem-llm`` is imported only
when such an environment is built.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from trainers.envs.base import Env

__all__ = ["ENVS", "GEM_FACTORY", "GEM_PREFIX", "list_envs", "make_env", "register_env", "resolve_factory"]

#: name -> factory (a class or a ``"module:attr"`` string, imported on first use)
ENVS: dict[str, Callable[..., Env] | str] = {
    "frozenlake": "trainers.envs.frozenlake:FrozenLakeEnv",
    "sokoban": "trainers.envs.sokoban:SokobanEnv",
    "calculator": "trainers.envs.calculator:CalculatorEnv",
    "python-tool": "trainers.envs.python_tool_env:PythonToolEnv",
}

#: the prefix of GEM ids in :func:`make_env` (``"gem:game:Sokoban-v0-easy"``)
GEM_PREFIX = "gem:"
#: the factory of ``"gem:<id>"`` environments, called as ``factory(gem_id, **kwargs)``
GEM_FACTORY = "trainers.envs.gem:GemEnv"


def register_env(name: str, factory: Callable[..., Env] | str, *, overwrite: bool = False) -> None:
    """Register ``factory`` (a callable returning an :class:`Env`, or ``"module:attr"``).

    >>> register_env("lake-3x3", "trainers.envs.frozenlake:FrozenLakeEnv")
    >>> make_env("lake-3x3", size=3).size
    3
    >>> del ENVS["lake-3x3"]
    """
    if not isinstance(name, str) or not name or name.startswith(GEM_PREFIX):
        raise ValueError(f"name: expected a non-empty str not starting with {GEM_PREFIX!r}, got {name!r}")
    if name in ENVS and not overwrite:
        raise ValueError(f"name: environment {name!r} is already registered (pass overwrite=True)")
    if not (callable(factory) or (isinstance(factory, str) and ":" in factory)):
        raise TypeError(f"factory: expected a callable or 'module:attr', got {factory!r}")
    ENVS[name] = factory


def list_envs() -> list[str]:
    """Registered names (GEM's ids are reached as ``"gem:<gem id>"``)."""
    return sorted(ENVS)


def resolve_factory(factory: Callable[..., Env] | str) -> Callable[..., Env]:
    """``factory`` itself, or for a ``"module:attr"`` string the attribute, imported now.

    >>> resolve_factory("trainers.envs.frozenlake:FrozenLakeEnv").__name__
    'FrozenLakeEnv'
    """
    if isinstance(factory, str):
        module, _, attr = factory.partition(":")
        try:
            return getattr(importlib.import_module(module), attr)
        except AttributeError:
            raise ValueError(f"factory: module {module!r} has no attribute {attr!r} ({factory!r})") from None
    return factory


def make_env(name: str, **kwargs: Any) -> Env:
    """Build a registered environment: ``make_env("frozenlake", size=4)``; a GEM environment by
    its GEM id after ``gem:``: ``make_env("gem:game:Sokoban-v0-easy")`` (needs ``gem-llm``).

    >>> env = make_env("frozenlake", size=4)
    >>> obs, info = env.reset(seed=0)
    >>> "P" in obs and "G" in obs
    True
    """
    if not isinstance(name, str):
        raise TypeError(f"name: expected a str, got {type(name).__name__}")
    if name.startswith(GEM_PREFIX):
        return resolve_factory(GEM_FACTORY)(name[len(GEM_PREFIX) :], **kwargs)
    if name not in ENVS:
        raise ValueError(f"name: unknown environment {name!r}; registered: {list_envs()} or 'gem:<id>'")
    return resolve_factory(ENVS[name])(**kwargs)
