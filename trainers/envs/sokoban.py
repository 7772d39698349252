"""Sokoban in text: push every box onto a target.

The puzzle of gym-sokoban (Schrader, 2018) and RAGEN / GEM's text versions. Levels are drawn
by **reverse play**, as in gym-sokoban: carve a random room, put the boxes on their targets,
then walk the player around at random, *pulling* any box it walks away from. Every pull is a
push played backwards, so every level is solvable; levels with a box still on its target are
redrawn. All randomness comes from ``random.Random(seed)``: the same seed gives the same level
in every process.

Board symbols (GEM's, in ASCII): ``#`` wall, ``_`` floor, ``O`` empty target, ``X`` box,
``*`` box on a target (GEM: ``√``), ``P`` player, ``S`` player on a target.

Rewards: 1 when the last box reaches its target (the episode ends); optional shaping
``+shaping`` per box pushed onto a target and ``-shaping`` per box pushed off one (off by
default: ``shaping=0``); 0 and an explanation for a move into a wall or an immovable box;
``format_penalty`` (GEM's -0.1) for an action with no direction (ends the episode unless
``end_on_format_error=False``); ``truncated`` after ``max_turns`` steps.
"""

from __future__ import annotations

import random
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

__all__ = ["SokobanEnv", "generate_level"]

_MOVES = {"up": (-1, 0), "down": (1, 0), "left": (0, -1), "right": (0, 1)}

Cell = tuple[int, int]


def _carve(h: int, w: int, rng: random.Random) -> set[Cell]:
    """Floor cells of a random room: a random walk inside the border walls."""
    interior = (h - 2) * (w - 2)
    target = max(3, int(0.6 * interior))
    r, c = rng.randrange(1, h - 1), rng.randrange(1, w - 1)
    floor = {(r, c)}
    d = rng.choice(list(_MOVES.values()))
    for _ in range(20 * interior):
        if len(floor) >= target:
            break
        if rng.random() < 0.35:
            d = rng.choice(list(_MOVES.values()))
        nr, nc = r + d[0], c + d[1]
        if 1 <= nr < h - 1 and 1 <= nc < w - 1:
            r, c = nr, nc
            floor.add((r, c))
    return floor


def generate_level(
    height: int, width: int, num_boxes: int, rng: random.Random, *, steps: int | None = None
) -> tuple[frozenset[Cell], frozenset[Cell], frozenset[Cell], Cell]:
    """``(floor, targets, boxes, player)`` of a solvable level with no box on a target.

    ``steps`` random reverse moves (default ``5 * (height + width)``; a move that pulls a box
    is preferred with probability 0.6); up to 200 redraws.
    """
    steps = 5 * (height + width) if steps is None else steps
    for _ in range(200):
        floor = _carve(height, width, rng)
        cells = sorted(floor)
        if len(cells) < num_boxes + 2:
            continue
        picks = rng.sample(cells, num_boxes + 1)
        targets = frozenset(picks[:num_boxes])
        player = picks[num_boxes]
        boxes = set(targets)
        for _ in range(steps):
            moves = [
                (d, (player[0] + d[0], player[1] + d[1]))
                for d in _MOVES.values()
                if (player[0] + d[0], player[1] + d[1]) in floor
                and (player[0] + d[0], player[1] + d[1]) not in boxes
            ]
            if not moves:
                break
            pulls = [m for m in moves if (player[0] - m[0][0], player[1] - m[0][1]) in boxes]
            (dr, dc), nxt = rng.choice(pulls if pulls and rng.random() < 0.6 else moves)
            behind = (player[0] - dr, player[1] - dc)
            if behind in boxes:  # pull the box along: a push played backwards
                boxes.remove(behind)
                boxes.add(player)
            player = nxt
        if not boxes & targets:
            return frozenset(floor), targets, frozenset(boxes), player
    raise RuntimeError(f"no level after 200 draws ({height}x{width}, {num_boxes} boxes)")


class SokobanEnv(Env):
    """Text Sokoban (module docstring).

    Args:
        dim_room: ``(height, width)`` including the border walls (GEM's name), each >= 4.
        num_boxes: boxes (and targets), >= 1.
        max_turns: steps before ``truncated``.
        shaping: reward per box pushed onto (+) / off (-) a target; 0 disables shaping.
        format_penalty: reward of an action without a direction.
        end_on_format_error: a format error ends the episode (GEM's behaviour).

    >>> env = SokobanEnv(dim_room=(6, 6), num_boxes=1)
    >>> obs, info = env.reset(seed=3)
    >>> print(env.board())
    # # # # # #
    # # # # O #
    # _ _ _ _ #
    # # _ _ X #
    # # # # P #
    # # # # # #
    >>> env.step(r"\\boxed{left}")[1:4]   # a wall: nothing moves
    (0.0, False, False)
    >>> env.step("up")[0].splitlines()[0]
    'You pushed a box up.'
    >>> obs, reward, terminated, truncated, info = env.step(r"\\boxed{UP}")
    >>> reward, terminated, obs.splitlines()[0]
    (1.0, True, 'You pushed a box up. All boxes are on targets: puzzle solved!')
    """

    def __init__(
        self,
        dim_room: tuple[int, int] = (6, 6),
        num_boxes: int = 1,
        max_turns: int = 20,
        *,
        shaping: float = 0.0,
        format_penalty: float = FORMAT_PENALTY,
        end_on_format_error: bool = True,
    ) -> None:
        if len(dim_room) != 2 or any(
            isinstance(d, bool) or not isinstance(d, int) or d < 4 for d in dim_room
        ):
            raise ValueError(f"dim_room: expected (height, width) ints >= 4, got {dim_room!r}")
        self.dim_room = (int(dim_room[0]), int(dim_room[1]))
        self.num_boxes = check_positive_int("num_boxes", num_boxes)
        self.max_turns = check_positive_int("max_turns", max_turns)
        self.shaping = float(shaping)
        self.format_penalty = float(format_penalty)
        self.end_on_format_error = bool(end_on_format_error)
        self.floor: frozenset[Cell] = frozenset()
        self.targets: frozenset[Cell] = frozenset()
        self.boxes: frozenset[Cell] = frozenset()
        self.player: Cell = (0, 0)
        self.turn = 0
        self.done = True
        self._action_rng = random.Random(0)

    # ------------------------------------------------------------------ text

    def board(self) -> str:
        h, w = self.dim_room
        rows = []
        for r in range(h):
            cells = []
            for c in range(w):
                p = (r, c)
                if p == self.player:
                    cells.append("S" if p in self.targets else "P")
                elif p in self.boxes:
                    cells.append("*" if p in self.targets else "X")
                elif p in self.targets:
                    cells.append("O")
                elif p in self.floor:
                    cells.append("_")
                else:
                    cells.append("#")
            rows.append(" ".join(cells))
        return "\n".join(rows)

    def _status(self) -> str:
        return f"Board:\n{self.board()}\nYou have {self.max_turns - self.turn} moves left. Enter your move."

    def instructions(self) -> str:
        return (
            "You are solving a Sokoban puzzle. Push every box onto a target.\n"
            "Symbols: P is you (S when you stand on a target), # is a wall, _ is floor, X is a box, "
            "O is an empty target, * is a box on a target.\n"
            "Move one cell per turn: up, down, left or right. Walking into a box pushes it, unless a wall "
            "or another box is behind it; boxes cannot be pulled. Write your move in \\boxed{}, "
            "for example \\boxed{up}.\n"
        )

    # ------------------------------------------------------------------ API

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        check_seed(seed)
        rng = random.Random(seed)
        self.floor, self.targets, self.boxes, self.player = generate_level(
            *self.dim_room, self.num_boxes, rng
        )
        self._action_rng = random.Random(None if seed is None else f"actions-{seed}")
        self.turn = 0
        self.done = False
        return self.instructions() + self._status(), {"seed": seed}

    def boxes_on_targets(self) -> int:
        return len(self.boxes & self.targets)

    def step(self, action: str) -> StepResult:
        move, info, invalid = begin_grid_step(self, action)
        if invalid is not None:
            return invalid
        dr, dc = _MOVES[move]
        nxt = (self.player[0] + dr, self.player[1] + dc)
        before = self.boxes_on_targets()
        reward, terminated = 0.0, False
        if nxt not in self.floor:
            text = f"You cannot move {move}: there is a wall."
        elif nxt in self.boxes:
            beyond = (nxt[0] + dr, nxt[1] + dc)
            if beyond not in self.floor or beyond in self.boxes:
                text = f"You cannot move {move}: the box cannot be pushed there."
            else:
                self.boxes = (self.boxes - {nxt}) | {beyond}
                self.player = nxt
                text = f"You pushed a box {move}."
        else:
            self.player = nxt
            text = f"You moved {move}."
        after = self.boxes_on_targets()
        reward += self.shaping * (after - before)
        if after == self.num_boxes:
            text += " All boxes are on targets: puzzle solved!"
            reward += 1.0
            terminated = True
        truncated = not terminated and self.turn >= self.max_turns
        self.done = terminated or truncated
        if truncated:
            text += " You are out of moves."
        return f"{text}\n{self._status()}", reward, terminated, truncated, info

    def state_key(self) -> Hashable:
        return (
            "sokoban",
            tuple(sorted(self.floor)),
            tuple(sorted(self.targets)),
            tuple(sorted(self.boxes)),
            self.player,
        )

    def sample_random_action(self) -> str:
        return f"\\boxed{{{self._action_rng.choice(DIRECTIONS)}}}"
