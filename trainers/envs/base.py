"""The environment interface of rollkit's agentic trainers, and the action / seed helpers of
the built-in environments.

The interface is GEM's (Axon-RL's General Experience Maker, PyPI ``gem-llm``), itself the
Gymnasium API with text in and text out, so that GEM environments plug in unchanged
(:mod:`trainers.envs.gem`)::

    observation, info = env.reset(seed=None)
    observation, reward, terminated, truncated, info = env.step(action_text)

plus :meth:`Env.state_key`, a hashable value equal exactly when two environment states are the
same; :func:`stable_state_id` turns it into the integer ``state_ids`` that GiGPO
(:func:`rollkit.advantages.gigpo_advantages`) groups steps by, the same in every process. The
conventions of the built-in environments (deterministic ``reset(seed)``, self-contained
observations, the last ``\\boxed{...}`` wins, format errors, ``max_turns``) are in
``docs/agentic.md``. The registry (:func:`~trainers.envs.registry.make_env`) is
:mod:`trainers.envs.registry`.
"""

from __future__ import annotations

import abc
import hashlib
import re
from collections.abc import Hashable
from typing import Any

__all__ = [
    "DIRECTIONS",
    "FORMAT_PENALTY",
    "Env",
    "StepResult",
    "begin_grid_step",
    "check_action",
    "check_positive_int",
    "check_seed",
    "extract_boxed",
    "parse_direction",
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
    """``action``, checked to be a str (``TypeError`` naming it otherwise)."""
    if not isinstance(action, str):
        raise TypeError(f"action: expected a str, got {type(action).__name__}")
    return action


def check_seed(seed: object) -> int | None:
    """``seed``, checked to be an int >= 0 or None (``ValueError`` naming it otherwise)."""
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
        raise ValueError(f"seed: expected an int >= 0 or None, got {seed!r}")
    return seed


def check_positive_int(name: str, value: object) -> int:
    """``value``, checked to be an int >= 1 (``ValueError`` naming ``name`` otherwise)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: expected an int >= 1, got {value!r}")
    return value
