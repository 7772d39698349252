"""The ablation grid: factors and their levels, seeds, and one :class:`Cell` per combination.

A :class:`Factor` is a config key and the levels it takes; :func:`expand_grid` makes one
:class:`Cell` per combination of levels and seed, with a stable id (a hash of its overrides,
seed and runner). :func:`validate_cells` checks every cell's config and registry names before
anything runs. See docs/ablations.md.

>>> factors = [parse_factor("algorithm.advantage=grpo,dr-grpo"), parse_factor("train.lr=1e-5,3e-5")]
>>> cells = expand_grid(factors, seeds=[0, 1], fixed=["train.steps=10"])
>>> len(cells), cells[0].overrides()
(8, ['train.steps=10', 'algorithm.advantage=grpo', 'train.lr=1e-5', 'seed=0'])
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from rollkit.registry import REGISTRIES
from trainers.config import ALIASES, Config, load_config

__all__ = [
    "REGISTRY_FIELDS",
    "RESERVED_KEYS",
    "Cell",
    "Factor",
    "expand_grid",
    "parse_factor",
    "parse_seeds",
    "split_levels",
    "validate_cells",
]

#: Config fields whose value is a name in a rollkit registry (checked before any cell runs).
REGISTRY_FIELDS = {
    "algorithm.advantage": "advantage",
    "algorithm.policy_loss": "policy_loss",
    "algorithm.aggregation": "aggregation",
    "algorithm.kl.estimator": "kl",
}

#: Keys the runner sets itself: a grid or fixed override may not set them.
RESERVED_KEYS = ("seed", "logging.dir")


def split_levels(text: str) -> list[str]:
    """Split ``text`` at the commas that are not inside brackets, braces or quotes.

    >>> split_levels("grpo,dr-grpo")
    ['grpo', 'dr-grpo']
    >>> split_levels("{clip_high: 0.28, clip_low: 0.2},{}")
    ['{clip_high: 0.28, clip_low: 0.2}', '{}']
    """
    out, depth, quote, cur = [], 0, "", []
    for ch in text:
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "[{(":
            depth += 1
        elif ch in "]})":
            depth -= 1
        if ch == "," and depth == 0 and not quote:
            out.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    out.append("".join(cur).strip())
    return out


@dataclass(frozen=True)
class Factor:
    """One ablated config key and its levels (the values as written on the command line)."""

    key: str
    levels: tuple[str, ...]

    @property
    def name(self) -> str:
        """The short column name: the last component of the key (``algorithm.advantage`` -> ``advantage``)."""
        return self.key.rsplit(".", 1)[-1]


def _norm_key(key: str, arg: str) -> str:
    key = key.strip().lstrip("-").replace("-", "_")
    if not key or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*", key):
        raise ValueError(f"{arg}: {key!r} is not a config key such as algorithm.advantage")
    key = ALIASES.get(key, key)
    if key in RESERVED_KEYS:
        raise ValueError(
            f"{arg}: {key} is set by the ablation runner (use --seeds for seeds; --out for the directories)"
        )
    return key


def parse_factor(spec: str) -> Factor:
    """A :class:`Factor` from ``"key=level1,level2,..."`` (levels split by :func:`split_levels`).

    >>> parse_factor("algorithm.aggregation=token-mean,seq-mean-token-mean")
    Factor(key='algorithm.aggregation', levels=('token-mean', 'seq-mean-token-mean'))
    """
    if not isinstance(spec, str):
        raise TypeError(f"--grid: expected a string 'key=a,b,...', got {type(spec).__name__}")
    if "=" not in spec:
        raise ValueError(f"--grid {spec!r}: expected key=level1,level2,...")
    key, rest = spec.split("=", 1)
    key = _norm_key(key, f"--grid {spec!r}")
    levels = split_levels(rest)
    if any(not lv for lv in levels):
        raise ValueError(f"--grid {spec!r}: empty level (levels are separated by commas)")
    dup = sorted({lv for lv in levels if levels.count(lv) > 1})
    if dup:
        raise ValueError(f"--grid {spec!r}: level(s) {dup} given twice")
    return Factor(key, tuple(levels))


def parse_seeds(text: str | Sequence[int]) -> list[int]:
    """Seeds from ``"0,1,2"`` or a sequence of ints; they must be distinct non-negative ints.

    >>> parse_seeds("0,1,2")
    [0, 1, 2]
    """
    if isinstance(text, str):
        parts = [p.strip() for p in text.split(",")]
        try:
            seeds = [int(p) for p in parts]
        except ValueError:
            raise ValueError(
                f"--seeds: expected comma-separated integers such as 0,1,2, got {text!r}"
            ) from None
    else:
        seeds = list(text)
        if not all(isinstance(s, int) and not isinstance(s, bool) for s in seeds):
            raise TypeError(f"seeds: expected integers, got {seeds!r}")
    if not seeds:
        raise ValueError("--seeds: at least one seed is needed")
    if any(s < 0 for s in seeds):
        raise ValueError(f"--seeds: seeds must be >= 0, got {seeds}")
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"--seeds: a seed is given twice in {seeds}")
    return seeds


def _slug(text: str, n: int = 24) -> str:
    s = re.sub(r"[^A-Za-z0-9.+-]+", "_", text).strip("_")
    return (s or "x")[:n]


@dataclass(frozen=True)
class Cell:
    """One run of the grid: the factors' levels, a seed, the fixed overrides and the runner.

    ``runner`` names how the cell is run (e.g. ``"recipe"`` or the warm-up settings) and is
    part of the id, so changing it, the fixed overrides, a level or the seed makes a new cell.

    >>> Cell((("algorithm.advantage", "grpo"),), 0, ("train.steps=5",)).id
    'grpo_s0-068ba8ee7e'
    """

    levels: tuple[tuple[str, str], ...]  # (key, level) per factor, in grid order
    seed: int
    fixed: tuple[str, ...] = ()
    runner: str = "recipe"

    def overrides(self) -> list[str]:
        """The command-line overrides of this cell (fixed first, then the levels, then the seed)."""
        return [*self.fixed, *(f"{k}={v}" for k, v in self.levels), f"seed={self.seed}"]

    @property
    def key(self) -> tuple[str, ...]:
        """The levels without the seed: cells with the same key are seeds of one configuration."""
        return tuple(v for _, v in self.levels)

    @property
    def id(self) -> str:
        """``<levels>_s<seed>-<hash>``: readable, and stable (sha256 of the overrides, seed, runner)."""
        spec = json.dumps(
            {
                "levels": list(self.levels),
                "seed": self.seed,
                "fixed": list(self.fixed),
                "runner": self.runner,
            },
            sort_keys=True,
        )
        digest = hashlib.sha256(spec.encode()).hexdigest()[:10]
        readable = "_".join(_slug(v) for _, v in self.levels)
        return f"{readable + '_' if readable else ''}s{self.seed}-{digest}"

    def to_dict(self) -> dict[str, Any]:
        """The cell as JSON-ready data (its id, levels, seed, fixed overrides, runner, overrides)."""
        return {
            "id": self.id,
            "levels": dict(self.levels),
            "seed": self.seed,
            "fixed": list(self.fixed),
            "runner": self.runner,
            "overrides": self.overrides(),
        }


def expand_grid(
    factors: Sequence[Factor], seeds: Sequence[int], fixed: Sequence[str] = (), runner: str = "recipe"
) -> list[Cell]:
    """Every combination of the factors' levels x every seed (seeds vary fastest).

    Raises ``ValueError`` for a key given twice, a fixed override of an ablated or reserved
    key, or a fixed override that is not ``key=value``.
    """
    factors = list(factors)
    if not all(isinstance(f, Factor) for f in factors):
        raise TypeError("factors: expected Factor objects (see parse_factor)")
    keys = [f.key for f in factors]
    dup = sorted({k for k in keys if keys.count(k) > 1})
    if dup:
        raise ValueError(f"--grid: key(s) {dup} given more than once; put all levels in one --grid")
    fixed = list(fixed)
    for o in fixed:
        if not isinstance(o, str) or "=" not in o:
            raise ValueError(f"fixed override {o!r}: expected key=value (after --)")
        k = _norm_key(o.split("=", 1)[0], f"fixed override {o!r}")
        if k in keys:
            raise ValueError(f"fixed override {o!r}: {k} is ablated by --grid; drop one of the two")
    seeds = parse_seeds(seeds)
    combos: list[tuple[tuple[str, str], ...]] = [()]
    for f in factors:
        combos = [(*c, (f.key, lv)) for c in combos for lv in f.levels]
    return [Cell(c, s, tuple(fixed), runner) for c in combos for s in seeds]


def validate_cells(cells: Sequence[Cell], base: Callable[[], Config] = Config) -> None:
    """Check every cell's config before anything runs: fields and values (:func:`load_config`)
    and registry names (:data:`REGISTRY_FIELDS`). Raises ``ValueError`` naming the override,
    or the registry's known names."""
    for cell in cells:
        try:
            cfg = load_config(cell.overrides(), base=base())
        except ValueError as e:
            raise ValueError(f"cell {cell.id}: {e}") from None
        for key, reg_name in REGISTRY_FIELDS.items():
            value: Any = cfg
            for part in key.split("."):
                value = getattr(value, part)
            reg = REGISTRIES[reg_name]
            if value not in reg:
                raise ValueError(
                    f"{key}: unknown {reg.kind} {value!r}; known: {', '.join(sorted(reg.names()))}"
                )
