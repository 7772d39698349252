"""The environment interface of rollkit's agentic trainers, and its registry.

The interface is GEM's (Axon-RL's General Experience Maker, PyPI ``gem-llm``), itself the
Gymnasium API with text in and text out, so that GEM environments plug in unchanged
(:mod:`trainers.envs.gem`)::

    observation, info = env.reset(seed=None)
    observation, reward, terminated, truncated, info = env.step(action_text)

plus one method that GEM does not have, :meth:`Env.state_key`: a hashable value that is equal
exactly when two environment states are the same. GiGPO (Feng et al., 2025,
arXiv:2505.10978) groups the steps of a task group by identical states;
:func:`stable_state_id` turns a key into the integer ``state_ids`` that
:func:`rollkit.advantages.gigpo_advantages` takes, the same in every process.

Conventions of the built-in environments (shared with GEM's games):

* ``reset(seed)`` is deterministic: the same seed gives the same task, whatever happened before.
  Observations are self-contained text: each one repeats the board / state a small model
  needs, so the policy can act on the latest observation alone.
* Actions are parsed from free text: the **last** ``\\boxed{...}`` (GEM's convention) wins; the
  built-in games also accept a bare direction word when there is no ``\\boxed{}``.
* An action that cannot be parsed (a *format error*) gives ``format_penalty`` (GEM: ``-0.1``)
  and, as in GEM, ends the episode (``terminated=True``) unless ``end_on_format_error=False``.
  A well-formed but impossible action (walking into a wall) gives reward 0, an observation
  saying so, and the episode goes on.
* ``max_turns`` steps without finishing set ``truncated=True`` (Gymnasium's time limit;
  GEM's games also set ``terminated=True`` there, which :mod:`trainers.envs.gem` passes on
  unchanged: callers stop on ``terminated or truncated``).
"""

from __future__ import annotations

import abc
import hashlib
import importlib
import re
from collections.abc import Callable, Hashable
from typing import Any

__all__ = [
    "ENVS",
    "Env",
    "StepResult",
    "begin_grid_step",
    "extract_boxed",
    "parse_direction",
    "list_envs",
    "make_env",
    "register_env",
    "stable_state_id",
]

#: ``(observation, reward, terminated, truncated, info)``
StepResult = tuple[str, float, bool, bool, dict[str, Any]]

#: GEM's format-error reward (``gem.utils.constants.LanguageGameReward.format_error_reward``).
FORMAT_PENALTY = -0.1


class Env(abc.ABC):
    """A text environment: ``reset(seed) -> (obs, info)``, ``step(action) -> (obs, reward,
    terminated, truncated, info)`` (GEM / Gymnasium), plus :meth:`state_key`."""

    #: the most steps of an episode (``truncated`` after that many)
    max_turns: int

    @abc.abstractmethod
    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        """Start an episode; the same ``seed`` gives the same initial state."""

    @abc.abstractmethod
    def step(self, action: str) -> StepResult:
        """Apply the model's text ``action``."""

    @abc.abstractmethod
    def state_key(self) -> Hashable:
        """A hashable value equal exactly when the environment states are equal."""

    def sample_random_action(self) -> str:
        """A random well-formed action (GEM's method), for smoke tests and baselines."""
        raise NotImplementedError(f"{type(self).__name__} has no random action")

    def close(self) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Release resources (nothing by default)."""


def stable_state_id(key: Hashable) -> int:
    """A 63-bit integer hash of ``repr(key)``, equal across processes and runs.

    Python's ``hash`` of a string is salted per process (``PYTHONHASHSEED``), so environments
    stepped in different worker processes would disagree on it; this one does not.

    >>> stable_state_id(("board", 1, 2)) == stable_state_id(("board", 1, 2))
    True
    >>> stable_state_id("a") != stable_state_id("b")
    True
    """
    digest = hashlib.blake2b(repr(key).encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


_BOXED = re.compile(r"\\boxed\{")


def extract_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` in ``text`` (braces balanced), or None.

    >>> extract_boxed(r"I go \\boxed{left} no, \\boxed{up}")
    'up'
    >>> extract_boxed("up") is None
    True
    """
    starts = [m.end() for m in _BOXED.finditer(text)]
    for start in reversed(starts):
        depth, i = 1, start
        while i < len(text):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                return text[start:i].strip()
            i += 1
    return None


DIRECTIONS = ("up", "down", "left", "right")
_DIRECTION_WORD = re.compile(r"\b(up|down|left|right)\b", re.IGNORECASE)


def parse_direction(text: str) -> str | None:
    """The move in ``text``: the content of the last ``\\boxed{}`` if there is one (it must be
    one of ``up/down/left/right``, any case, else ``None``), otherwise the last standalone
    direction word; ``None`` when there is none (a format error).

    >>> parse_direction(r"Going \\boxed{Left}"), parse_direction("I think: down."), parse_direction("jump")
    ('left', 'down', None)
    >>> parse_direction(r"\\boxed{north} up") is None
    True
    """
    boxed = extract_boxed(text)
    if boxed is not None:
        word = boxed.strip().lower()
        return word if word in DIRECTIONS else None
    words = _DIRECTION_WORD.findall(text)
    return words[-1].lower() if words else None


def begin_grid_step(env: Any, action: object) -> tuple[str | None, dict[str, Any], StepResult | None]:
    """The shared start of a grid game's ``step`` (FrozenLake, Sokoban): check the action and
    the episode, count the turn, parse the move. Returns ``(move, info, None)``, or for a
    format error ``(None, info, result)`` with the result to return as GEM does (the
    ``format_penalty``, and the episode ends if ``end_on_format_error`` or at ``max_turns``).
    ``env`` has ``done``, ``turn``, ``max_turns``, ``end_on_format_error``,
    ``format_penalty`` and ``_status()``."""
    check_action(action)
    if env.done:
        raise RuntimeError("step() after the episode ended: call reset()")
    env.turn += 1
    move = parse_direction(action)
    info: dict[str, Any] = {"parsed_action": move}
    if move is not None:
        return move, info, None
    env.done = env.end_on_format_error or env.turn >= env.max_turns
    obs = f"Your action was not valid: write one of {', '.join(DIRECTIONS)} in \\boxed{{}}."
    return (
        None,
        info,
        (
            f"{obs}\n{env._status()}",
            env.format_penalty,
            env.end_on_format_error,
            not env.end_on_format_error and env.turn >= env.max_turns,
            info,
        ),
    )


def check_action(action: object) -> str:
    if not isinstance(action, str):
        raise TypeError(f"action: expected a str, got {type(action).__name__}")
    return action


def check_seed(seed: object) -> int | None:
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
        raise ValueError(f"seed: expected an int >= 0 or None, got {seed!r}")
    return seed


def check_positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: expected an int >= 1, got {value!r}")
    return value


# --------------------------------------------------------------------------- registry

#: name -> factory (a class or a ``"module:attr"`` string, imported on first use)
ENVS: dict[str, Callable[..., Env] | str] = {
    "frozenlake": "trainers.envs.frozenlake:FrozenLakeEnv",
    "sokoban": "trainers.envs.sokoban:SokobanEnv",
    "calculator": "trainers.envs.calculator:CalculatorEnv",
}


def register_env(name: str, factory: Callable[..., Env] | str, *, overwrite: bool = False) -> None:
    """Register ``factory`` (a callable returning an :class:`Env`, or ``"module:attr"``)."""
    if not isinstance(name, str) or not name or name.startswith("gem:"):
        raise ValueError(f"name: expected a non-empty str not starting with 'gem:', got {name!r}")
    if name in ENVS and not overwrite:
        raise ValueError(f"name: environment {name!r} is already registered (pass overwrite=True)")
    if not (callable(factory) or (isinstance(factory, str) and ":" in factory)):
        raise TypeError(f"factory: expected a callable or 'module:attr', got {factory!r}")
    ENVS[name] = factory


def list_envs() -> list[str]:
    """Registered names (GEM's ids are reached as ``"gem:<gem id>"``)."""
    return sorted(ENVS)


def resolve_factory(factory: Callable[..., Env] | str) -> Callable[..., Env]:
    if isinstance(factory, str):
        module, _, attr = factory.partition(":")
        return getattr(importlib.import_module(module), attr)
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
    if name.startswith("gem:"):
        from trainers.envs.gem import GemEnv

        return GemEnv(name[len("gem:") :], **kwargs)
    if name not in ENVS:
        raise ValueError(f"name: unknown environment {name!r}; registered: {list_envs()} or 'gem:<id>'")
    return resolve_factory(ENVS[name])(**kwargs)
