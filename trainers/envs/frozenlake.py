"""FrozenLake in text: walk across a frozen lake from the start to the goal without falling in.

The grid world of Gymnasium's ``FrozenLake-v1`` (and RAGEN's text version), rendered for a
language model. ``reset(seed)`` draws a random ``size x size`` map (start top-left, goal
bottom-right, each other cell a hole with probability ``hole_prob``) that always has a safe
path (breadth-first search; maps without one are redrawn), so the same seed gives the same
map in every process. Board symbols: ``P`` the player, ``S`` start, ``F`` frozen (safe),
``H`` hole, ``G`` goal.

Rewards: 1 on reaching the goal (episode ends), 0 for falling into a hole (episode ends),
0 for a step, 0 and "you cannot move there" for walking off the edge, ``format_penalty``
(GEM's -0.1) for an action with no direction in it (the episode ends, as in GEM, unless
``end_on_format_error=False``); ``truncated`` after ``max_turns`` steps. With
``slippery > 0`` a move goes to one of the two perpendicular directions with that total
probability (Gymnasium's ``is_slippery`` is ``2/3``), drawn from the reset seed.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Hashable
from typing import Any

from trainers.envs.base import (
    DIRECTIONS,
    FORMAT_PENALTY,
    Env,
    StepResult,
    begin_grid_step,
    check_positive_int,
    check_seed,
)

__all__ = ["FrozenLakeEnv", "generate_map"]

_MOVES = {"up": (-1, 0), "down": (1, 0), "left": (0, -1), "right": (0, 1)}
_PERPENDICULAR = {
    "up": ("left", "right"),
    "down": ("left", "right"),
    "left": ("up", "down"),
    "right": ("up", "down"),
}


def _has_path(desc: list[str]) -> bool:
    n = len(desc)
    seen, todo = {(0, 0)}, deque([(0, 0)])
    while todo:
        r, c = todo.popleft()
        if desc[r][c] == "G":
            return True
        for dr, dc in _MOVES.values():
            nr, nc = r + dr, c + dc
            if 0 <= nr < n and 0 <= nc < n and (nr, nc) not in seen and desc[nr][nc] != "H":
                seen.add((nr, nc))
                todo.append((nr, nc))
    return False


def generate_map(size: int, hole_prob: float, rng: random.Random) -> tuple[str, ...]:
    """A ``size x size`` map (rows of ``S``/``F``/``H``/``G``) with a safe path from S to G.

    >>> generate_map(3, 0.0, random.Random(0))
    ('SFF', 'FFF', 'FFG')
    """
    for _ in range(1000):
        rows = ["".join("H" if rng.random() < hole_prob else "F" for _ in range(size)) for _ in range(size)]
        rows[0] = "S" + rows[0][1:]
        rows[-1] = rows[-1][:-1] + "G"
        if _has_path(rows):
            return tuple(rows)
    raise RuntimeError(f"no map with a safe path after 1000 draws (size={size}, hole_prob={hole_prob})")


class FrozenLakeEnv(Env):
    """Text FrozenLake (module docstring).

    Args:
        size: the grid is ``size x size`` (>= 2).
        hole_prob: probability that a cell other than start / goal is a hole, in ``[0, 1)``.
        max_turns: steps before ``truncated`` (default ``4 * size``).
        slippery: probability in ``[0, 1]`` that a move slips sideways.
        format_penalty: reward of an action without a direction.
        end_on_format_error: a format error ends the episode (GEM's behaviour).

    >>> env = FrozenLakeEnv(size=3, hole_prob=0.0)
    >>> obs, _ = env.reset(seed=0)
    >>> print(obs.split("Board:\\n")[1])
    P F F
    F F F
    F F G
    You have 12 moves left. Enter your move.
    >>> env.step(r"\\boxed{down}")[1:4], env.step("down")[1:4], env.step("right, right")[1:4]
    ((0.0, False, False), (0.0, False, False), (0.0, False, False))
    >>> obs, reward, terminated, truncated, info = env.step("right")
    >>> reward, terminated, obs.splitlines()[0]
    (1.0, True, 'You moved right and reached the goal!')
    """

    def __init__(
        self,
        size: int = 4,
        hole_prob: float = 0.2,
        max_turns: int | None = None,
        *,
        slippery: float = 0.0,
        format_penalty: float = FORMAT_PENALTY,
        end_on_format_error: bool = True,
    ) -> None:
        if isinstance(size, bool) or not isinstance(size, int) or size < 2:
            raise ValueError(f"size: expected an int >= 2, got {size!r}")
        if not 0.0 <= hole_prob < 1.0:
            raise ValueError(f"hole_prob: expected a float in [0, 1), got {hole_prob!r}")
        if not 0.0 <= slippery <= 1.0:
            raise ValueError(f"slippery: expected a float in [0, 1], got {slippery!r}")
        self.size = size
        self.hole_prob = float(hole_prob)
        self.max_turns = check_positive_int("max_turns", 4 * size if max_turns is None else max_turns)
        self.slippery = float(slippery)
        self.format_penalty = float(format_penalty)
        self.end_on_format_error = bool(end_on_format_error)
        self.desc: tuple[str, ...] = ()
        self.pos = (0, 0)
        self.turn = 0
        self.done = True
        self._rng = random.Random(0)
        self._action_rng = random.Random(0)

    # ------------------------------------------------------------------ text

    def board(self) -> str:
        rows = []
        for r, line in enumerate(self.desc):
            rows.append(" ".join("P" if (r, c) == self.pos else ch for c, ch in enumerate(line)))
        return "\n".join(rows)

    def _status(self) -> str:
        return f"Board:\n{self.board()}\nYou have {self.max_turns - self.turn} moves left. Enter your move."

    def instructions(self) -> str:
        return (
            f"You are playing FrozenLake on a {self.size}x{self.size} frozen lake. Walk from the start S "
            "to the goal G without stepping into a hole H.\n"
            "Symbols: P is you, F is frozen ice (safe), H is a hole, G is the goal.\n"
            "Each turn, move one cell: up, down, left or right. Write your move in \\boxed{}, "
            "for example \\boxed{right}.\n"
        )

    # ------------------------------------------------------------------ API

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        check_seed(seed)
        self._rng = random.Random(seed)
        self._action_rng = random.Random(None if seed is None else f"actions-{seed}")
        self.desc = generate_map(self.size, self.hole_prob, self._rng)
        self.pos = (0, 0)
        self.turn = 0
        self.done = False
        return self.instructions() + self._status(), {"seed": seed}

    def step(self, action: str) -> StepResult:
        move, info, invalid = begin_grid_step(self, action)
        if invalid is not None:
            return invalid
        if self.slippery and self._rng.random() < self.slippery:
            move = self._rng.choice(_PERPENDICULAR[move])
            info["slipped_to"] = move
        dr, dc = _MOVES[move]
        r, c = self.pos[0] + dr, self.pos[1] + dc
        reward, terminated = 0.0, False
        if not (0 <= r < self.size and 0 <= c < self.size):
            text = f"You cannot move {move}: that is the edge of the lake."
        else:
            self.pos = (r, c)
            cell = self.desc[r][c]
            if cell == "H":
                text, terminated = f"You moved {move} and fell into a hole. Game over.", True
            elif cell == "G":
                text, reward, terminated = f"You moved {move} and reached the goal!", 1.0, True
            else:
                text = f"You moved {move}" + (" (you slipped on the ice)." if "slipped_to" in info else ".")
        truncated = not terminated and self.turn >= self.max_turns
        self.done = terminated or truncated
        if truncated:
            text += " You are out of moves."
        return f"{text}\n{self._status()}", reward, terminated, truncated, info

    def state_key(self) -> Hashable:
        return ("frozenlake", self.desc, self.pos)

    def sample_random_action(self) -> str:
        return f"\\boxed{{{self._action_rng.choice(DIRECTIONS)}}}"
