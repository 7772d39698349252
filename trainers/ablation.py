"""Algorithm ablations: a grid of config overrides x seeds, run resumably, summarised with CIs.

An ablation is a list of :class:`Factor` s (a config key and the levels it takes), a list of
seeds and fixed overrides. :func:`expand_grid` makes one :class:`Cell` per combination of
levels and seed; each cell has a stable id (a hash of its overrides, seed and runner) and its
own directory ``<out>/cells/<id>/`` with the command's log (``log.txt``), the trainer's
``metrics.jsonl`` and, once it finished successfully, ``done.json``. :func:`run_cells` runs
the cells that are not done (in parallel subprocesses, or Ray tasks), so an interrupted
ablation continues where it stopped and a crashed cell runs again. :func:`collect` gathers
the per-step metrics of every finished cell, :func:`summarize` computes per cell

* the final held-out accuracy (``eval/accuracy`` at the last evaluation),
* the area under the held-out accuracy curve, by the trapezoid rule over steps divided by
  the step range (the mean accuracy over training, in ``[0, 1]``),
* the wall time of the cell's command and the number of generated tokens,

and their mean ± 95% confidence interval over seeds (Student t, :func:`mean_ci`).
:func:`write_markdown` and :func:`plot_curves` write the table and the learning-curve PNG
(one panel per factor; each level's curve is averaged over the other factors within a seed,
then mean ± 95% CI over seeds). ``recipes/ablate.py`` is the command line over this module.

>>> factors = [parse_factor("algorithm.advantage=grpo,dr-grpo"), parse_factor("train.lr=1e-5,3e-5")]
>>> cells = expand_grid(factors, seeds=[0, 1], fixed=["train.steps=10"])
>>> len(cells), cells[0].overrides()
(8, ['train.steps=10', 'algorithm.advantage=grpo', 'train.lr=1e-5', 'seed=0'])
>>> round(t_quantile(0.975, 2), 3)
4.303
"""

from __future__ import annotations

import csv
import hashlib
import itertools
import json
import math
import os
import re
import shutil
import subprocess
import time
import warnings
from collections import defaultdict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainers.config import ALIASES, Config, load_config

__all__ = [
    "REGISTRY_FIELDS",
    "Cell",
    "CellResult",
    "CellStats",
    "Factor",
    "auc",
    "cell_stats",
    "collect",
    "expand_grid",
    "is_done",
    "mean_ci",
    "parse_factor",
    "parse_seeds",
    "plot_curves",
    "run_cells",
    "split_levels",
    "student_t_cdf",
    "summarize",
    "t_quantile",
    "validate_cells",
    "warm_start_fit",
    "write_metrics",
    "write_markdown",
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

# --------------------------------------------------------------------------- the grid


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
    from rollkit.registry import REGISTRIES

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


# --------------------------------------------------------------------------- running


@dataclass
class CellResult:
    """What happened to a cell in :func:`run_cells`: ``status`` is ``"skipped"`` (already
    done), ``"ran"`` or ``"failed"``."""

    cell: Cell
    status: str
    wall_s: float = 0.0
    returncode: int | None = None
    log: Path | None = None


def cell_dir(out: str | Path, cell: Cell) -> Path:
    return Path(out) / "cells" / cell.id


def is_done(out: str | Path, cell: Cell) -> bool:
    """A cell is done when its ``done.json`` exists and names this cell's id."""
    f = cell_dir(out, cell) / "done.json"
    if not f.is_file():
        return False
    try:
        return json.loads(f.read_text()).get("id") == cell.id
    except (json.JSONDecodeError, OSError):
        return False


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True))
    tmp.replace(path)


def _run_one(cell_d: str, argv: list[str], env: dict[str, str], cwd: str | None) -> tuple[int, float]:
    """Run ``argv`` with stdout and stderr to ``<cell_d>/log.txt``; ``(returncode, seconds)``."""
    t0 = time.perf_counter()
    with open(Path(cell_d) / "log.txt", "w") as log:
        log.write("$ " + " ".join(argv) + "\n")
        log.flush()
        rc = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd).returncode
    return rc, time.perf_counter() - t0


def run_cells(
    cells: Sequence[Cell],
    out: str | Path,
    command: Sequence[str],
    *,
    parallel: int = 1,
    use_ray: bool = False,
    cpus_per_cell: int = 1,
    cwd: str | Path | None = None,
    env: dict[str, str] | None = None,
    log: Callable[[str], None] = print,
) -> list[CellResult]:
    """Run every cell that is not done: ``[*command, *cell.overrides(), logging.dir=<cell dir>]``.

    A cell whose ``done.json`` exists is skipped; any other cell directory is cleared and the
    cell runs again (so a crashed or interrupted cell restarts from scratch). At most
    ``parallel`` cells run at once: as subprocesses from a thread pool, or with
    ``use_ray=True`` as Ray tasks of ``num_cpus=cpus_per_cell`` (each runs the same
    subprocess in a Ray worker). If Ray is not initialised it starts a local Ray instance, or
    connects to the cluster at ``RAY_ADDRESS`` when that is set (its nodes must see the same
    paths: a shared filesystem). Each subprocess gets
    ``OMP_NUM_THREADS=cpus_per_cell``. ``done.json`` is written when the command exits 0 and
    left a ``metrics.jsonl``. Returns one :class:`CellResult` per cell, in order.
    """
    if parallel < 1:
        raise ValueError(f"parallel must be >= 1, got {parallel}")
    if cpus_per_cell < 1:
        raise ValueError(f"cpus_per_cell must be >= 1, got {cpus_per_cell}")
    if not command:
        raise ValueError("command: empty")
    out = Path(out).resolve()
    base_env = dict(os.environ if env is None else env)
    root = str(Path(__file__).resolve().parents[1])
    base_env["PYTHONPATH"] = os.pathsep.join(p for p in (root, base_env.get("PYTHONPATH", "")) if p)
    base_env["OMP_NUM_THREADS"] = str(cpus_per_cell)
    base_env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    cwd_s = str(cwd) if cwd is not None else None

    results: dict[int, CellResult] = {}
    todo: list[tuple[int, Cell, Path, list[str]]] = []
    for i, cell in enumerate(cells):
        d = cell_dir(out, cell)
        if is_done(out, cell):
            results[i] = CellResult(cell, "skipped", log=d / "log.txt")
            continue
        if d.exists():
            shutil.rmtree(d)
        d.mkdir(parents=True)
        _write_json(d / "cell.json", cell.to_dict())
        todo.append((i, cell, d, [*command, *cell.overrides(), f"logging.dir={d}"]))
    log(f"[ablate] {len(cells)} cells: {len(cells) - len(todo)} done already, {len(todo)} to run")

    def finish(i: int, cell: Cell, d: Path, argv: list[str], rc: int, wall: float) -> None:
        ok = rc == 0 and (d / "metrics.jsonl").is_file()
        if ok:
            _write_json(
                d / "done.json",
                {
                    **cell.to_dict(),
                    "command": argv,
                    "returncode": rc,
                    "wall_s": wall,
                    "finished": time.time(),
                },
            )
        results[i] = CellResult(cell, "ran" if ok else "failed", wall, rc, d / "log.txt")
        n_fin = sum(1 for r in results.values() if r.status != "skipped")
        log(
            f"[ablate] {n_fin}/{len(todo)} {cell.id}: "
            + (f"done in {wall:.1f}s" if ok else f"FAILED (exit {rc}), see {d / 'log.txt'}")
        )

    if todo and use_ray:
        from trainers.deps import require

        ray = require("ray")
        if not ray.is_initialized():
            ray.init(
                address=os.environ.get("RAY_ADDRESS") or "local",
                include_dashboard=False,
                log_to_driver=False,
                runtime_env={"env_vars": {"PYTHONPATH": base_env["PYTHONPATH"]}},
            )
        remote = ray.remote(num_cpus=cpus_per_cell)(_run_one)
        pending: dict[Any, tuple[int, Cell, Path, list[str]]] = {}
        queue = list(todo)
        while queue or pending:
            while queue and len(pending) < parallel:
                item = queue.pop(0)
                pending[remote.remote(str(item[2]), item[3], base_env, cwd_s)] = item
            ready, _ = ray.wait(list(pending), num_returns=1)
            for ref in ready:
                item = pending.pop(ref)
                rc, wall = ray.get(ref)
                finish(*item, rc, wall)
    elif todo:
        with ThreadPoolExecutor(max_workers=parallel) as pool:
            futs = {
                pool.submit(_run_one, str(d), argv, base_env, cwd_s): (i, c, d, argv)
                for i, c, d, argv in todo
            }
            for fut in as_completed(futs):
                rc, wall = fut.result()
                finish(*futs[fut], rc, wall)
    return [results[i] for i in range(len(cells))]


def warm_start_fit(
    cfg: Config, *, sft_steps: int, sft_lr: float = 3e-3, sft_batch_size: int = 64
) -> dict[str, Any]:
    """Supervised warm-up, then RL: the cell body for models that need a starting accuracy.

    Builds the embedded engines (:func:`trainers.sync_trainer.build_engines`), runs
    ``sft_steps`` steps of :func:`~trainers.sync_trainer.supervised_warmup` (its own AdamW at
    ``sft_lr``, batches of ``sft_batch_size`` train prompts, seeded by ``cfg.seed``), pushes
    the weights to the rollout engine, then builds the :class:`~trainers.sync_trainer.SyncTrainer`
    (so a KL reference is the warmed-up policy) and returns ``fit()``'s summary. The tiny
    model of the tests learns 1-digit addition this way (docs/trainer.md).
    """
    if sft_steps < 0:
        raise ValueError(f"sft_steps must be >= 0, got {sft_steps}")
    import torch

    from trainers.engines import TorchTrainEngine
    from trainers.sync_trainer import SyncTrainer, build_engines, build_prompts, supervised_warmup

    rollout, train, tok = build_engines(cfg)
    if sft_steps and not isinstance(getattr(train, "model", None), torch.nn.Module):
        raise ValueError(
            f"sft_steps: the warm-up trains train.model in place; train.engine={cfg.train.engine!r} has none"
        )
    if sft_steps:
        train_prompts, _ = build_prompts(cfg)
        sft = TorchTrainEngine(train.model, lr=sft_lr, grad_clip=cfg.train.grad_clip, device=cfg.train.device)
        loss = supervised_warmup(
            sft,
            tok,
            train_prompts,
            steps=sft_steps,
            batch_size=sft_batch_size,
            seed=cfg.seed,
            chat_template=cfg.data.chat_template if cfg.data.chat_template != "auto" else "off",
        )
        print(f"[sft] {sft_steps} warm-up steps, last loss {loss:.3f}", flush=True)
        rollout.update_weights(train.export_weights(), version=0)
    return SyncTrainer(cfg, rollout=rollout, train=train, tokenizer=tok).fit()


# --------------------------------------------------------------------------- statistics


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (modified Lentz)."""
    tiny, qab, qap, qam = 1e-300, a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 500):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < 1e-15:
            break
    return h


def _betainc(a: float, b: float, x: float) -> float:
    """The regularised incomplete beta function ``I_x(a, b)``."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    lbeta = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(lbeta) * _betacf(a, b, x) / a
    return 1.0 - math.exp(lbeta) * _betacf(b, a, 1.0 - x) / b


def student_t_cdf(t: float, df: float) -> float:
    """``P(T <= t)`` for Student's t with ``df`` degrees of freedom:
    ``1 - I_{df/(df+t^2)}(df/2, 1/2) / 2`` for ``t >= 0`` (symmetric for ``t < 0``).

    >>> round(student_t_cdf(0.0, 3), 6), round(student_t_cdf(12.7062047, 1), 6)
    (0.5, 0.975)
    """
    if df <= 0:
        raise ValueError(f"df must be > 0, got {df}")
    tail = 0.5 * _betainc(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t >= 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The ``p`` quantile of Student's t with ``df`` degrees of freedom (inverse of
    :func:`student_t_cdf` by bisection to ``1e-12``; no scipy needed).

    >>> round(t_quantile(0.975, 2), 4), round(t_quantile(0.975, 10), 4), round(t_quantile(0.975, 1e9), 4)
    (4.3027, 2.2281, 1.96)
    """
    if not 0.0 < p < 1.0:
        raise ValueError(f"p must be in (0, 1), got {p}")
    if df <= 0:
        raise ValueError(f"df must be > 0, got {df}")
    if p == 0.5:
        return 0.0
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    lo, hi = 0.0, 1.0
    while student_t_cdf(hi, df) < p:
        lo, hi = hi, hi * 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if student_t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-12 * max(1.0, hi):
            break
    return 0.5 * (lo + hi)


def mean_ci(values: Sequence[float], confidence: float = 0.95) -> tuple[float, float, int]:
    """``(mean, half_width, n)`` of the two-sided Student-t confidence interval of the mean:
    ``half_width = t_{(1+c)/2, n-1} * s / sqrt(n)`` with ``s`` the sample standard deviation.
    Non-finite values (``None``, NaN) are dropped; ``half_width`` is NaN when ``n < 2`` and
    ``mean`` is NaN when ``n == 0``.

    >>> m, h, n = mean_ci([1.0, 2.0, 3.0])
    >>> m, round(h, 4), n          # t_{0.975, 2} = 4.3027, s = 1
    (2.0, 2.4841, 3)
    """
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    xs = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    n = len(xs)
    if n == 0:
        return math.nan, math.nan, 0
    m = sum(xs) / n
    if n < 2:
        return m, math.nan, n
    s = math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1))
    return m, t_quantile((1.0 + confidence) / 2.0, n - 1) * s / math.sqrt(n), n


def auc(steps: Sequence[float], values: Sequence[float]) -> float:
    """Area under ``values`` over ``steps`` by the trapezoid rule, divided by the step range
    (so a constant curve ``c`` has AUC ``c``); a single point gives its value, none gives NaN.
    Points are sorted by step; ``None``/NaN values are dropped.

    >>> auc([0, 10, 20], [0.0, 0.5, 0.5])
    0.375
    """
    pts = sorted(
        (float(s), float(v)) for s, v in zip(steps, values) if v is not None and math.isfinite(float(v))
    )
    if not pts:
        return math.nan
    if len(pts) == 1 or pts[-1][0] == pts[0][0]:
        return sum(v for _, v in pts) / len(pts)
    area = sum((s1 - s0) * (v0 + v1) / 2.0 for (s0, v0), (s1, v1) in itertools.pairwise(pts))
    return area / (pts[-1][0] - pts[0][0])


# --------------------------------------------------------------------------- collecting


def _merged_rows(path: Path) -> list[dict[str, Any]]:
    """``metrics.jsonl`` rows merged by step (the end-of-run evaluation shares the last step)."""
    from trainers.tracking import read_metrics

    by: dict[int, dict[str, Any]] = {}
    for r in read_metrics(path):
        by.setdefault(int(r["step"]), {}).update(r)
    rows = [by[k] for k in sorted(by)]
    for r in rows:
        if "rollout/tokens" not in r and r.get("throughput/rollout_tokens_per_s") is not None:
            r["rollout/tokens"] = round(r["throughput/rollout_tokens_per_s"] * r.get("time/rollout", 0.0))
    return rows


def collect(cells: Sequence[Cell], out: str | Path) -> list[dict[str, Any]]:
    """Per-step rows of every finished cell: ``cell``, ``seed``, one column per factor (its
    short name), then the trainer's metrics (rows of the same step merged; ``rollout/tokens``
    added from throughput x rollout time when the trainer does not log it)."""
    rows = []
    for cell in cells:
        if not is_done(out, cell):
            continue
        for r in _merged_rows(cell_dir(out, cell) / "metrics.jsonl"):
            meta = {"cell": cell.id, "seed": cell.seed, **{k.rsplit(".", 1)[-1]: v for k, v in cell.levels}}
            rows.append({**meta, **r})
    return rows


def write_metrics(rows: Sequence[dict[str, Any]], out: str | Path) -> list[Path]:
    """``<out>/metrics.csv`` (and ``metrics.parquet`` when pyarrow is installed); returns the paths."""
    out = Path(out)
    cols: list[str] = []
    for r in rows:
        cols += [k for k in r if k not in cols]
    paths = [out / "metrics.csv"]
    with paths[0].open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        for r in rows:
            w.writerow(r)
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        return paths
    table = pa.Table.from_pylist([{c: r.get(c) for c in cols} for r in rows]) if rows else pa.table({})
    pq.write_table(table, out / "metrics.parquet")
    paths.append(out / "metrics.parquet")
    return paths


@dataclass
class CellStats:
    """Per-cell results: final / initial held-out accuracy, AUC, wall seconds, generated tokens
    and the ``curves`` ``{metric: (steps, values)}``."""

    cell: Cell
    final_accuracy: float
    initial_accuracy: float
    auc: float
    wall_s: float
    tokens: float
    curves: dict[str, tuple[list[float], list[float]]] = field(default_factory=dict)

    @property
    def gain(self) -> float:
        """``final_accuracy - initial_accuracy`` (what training added; NaN without a first evaluation)."""
        return self.final_accuracy - self.initial_accuracy


def cell_stats(
    cell: Cell, out: str | Path, metric: str = "eval/accuracy", curve_metrics: Sequence[str] = ()
) -> CellStats:
    """:class:`CellStats` of a finished cell (from its ``metrics.jsonl`` and ``done.json``)."""
    d = cell_dir(out, cell)
    rows = _merged_rows(d / "metrics.jsonl")
    done = json.loads((d / "done.json").read_text())
    ev = [(r["step"], r[metric]) for r in rows if r.get(metric) is not None]
    curves = {}
    for m in {metric, *curve_metrics}:
        pts = [(r["step"], r[m]) for r in rows if r.get(m) is not None]
        curves[m] = ([float(s) for s, _ in pts], [float(v) for _, v in pts])
    return CellStats(
        cell=cell,
        final_accuracy=ev[-1][1] if ev else math.nan,
        initial_accuracy=ev[0][1] if ev and ev[0][0] == rows[0]["step"] and len(ev) > 1 else math.nan,
        auc=auc(*zip(*ev)) if ev else math.nan,
        wall_s=float(done.get("wall_s", math.nan)),
        tokens=float(sum(r.get("rollout/tokens") or 0 for r in rows)),
        curves=curves,
    )


def summarize(
    cells: Sequence[Cell], out: str | Path, metric: str = "eval/accuracy", curve_metrics: Sequence[str] = ()
) -> list[CellStats]:
    """:func:`cell_stats` of every finished cell."""
    return [cell_stats(c, out, metric, curve_metrics) for c in cells if is_done(out, c)]


def _fmt(m: float, h: float, digits: int = 3, signed: bool = False) -> str:
    if math.isnan(m):
        return "n/a"
    v = f"{m:+.{digits}f}" if signed else f"{m:.{digits}f}"
    return v if math.isnan(h) else f"{v} ± {h:.{digits}f}"


def _per_seed_marginal(stats: Sequence[CellStats], pos: int, level: str, attr: str) -> dict[int, float]:
    """``{seed: mean of attr}`` over the cells at ``level`` of factor ``pos`` (other factors averaged)."""
    by: dict[int, list[float]] = defaultdict(list)
    for s in stats:
        if s.cell.key[pos] == level:
            v = getattr(s, attr)
            if math.isfinite(v):
                by[s.cell.seed].append(v)
    return {seed: sum(v) / len(v) for seed, v in sorted(by.items()) if v}


def write_markdown(
    stats: Sequence[CellStats],
    factors: Sequence[Factor],
    path: str | Path,
    *,
    title: str = "Ablation",
    command: str = "",
) -> Path:
    """The summary table (one row per configuration, mean ± 95% CI over seeds) and one
    marginal table per factor (per seed, the mean over the other factors' levels; then mean ±
    95% CI over seeds, and the paired per-seed difference to the factor's first level), as
    Markdown."""
    path = Path(path)
    lines = [f"# {title}", ""]
    if command:
        lines += ["```bash", command, "```", ""]
    seeds = sorted({s.cell.seed for s in stats})
    lines += [
        f"{len(stats)} finished cells, seeds {seeds}. Mean ± 95% confidence interval (Student t) over "
        "seeds. Final: held-out accuracy at the last evaluation; AUC: area under the held-out accuracy "
        "curve divided by the step range; before: the first evaluation; gain: final - before, per "
        "cell; wall: seconds per cell (the whole command); tokens: generated rollout tokens per cell.",
        "",
    ]
    names = [f.name for f in factors]
    head = [*names, "seeds", "final accuracy", "AUC", "before", "gain", "wall s", "tokens"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    groups: dict[tuple[str, ...], list[CellStats]] = defaultdict(list)
    for s in stats:
        groups[s.cell.key].append(s)
    order = {f.key: {lv: i for i, lv in enumerate(f.levels)} for f in factors}
    for key in sorted(groups, key=lambda k: [order[f.key].get(v, 0) for f, v in zip(factors, k)]):
        g = groups[key]
        cis = [
            mean_ci([getattr(s, a) for s in g]) for a in ("final_accuracy", "auc", "initial_accuracy", "gain")
        ]
        wall = mean_ci([s.wall_s for s in g])[0]
        tok = mean_ci([s.tokens for s in g])[0]
        row = [*(f"`{v}`" for v in key), str(len(g)), *(_fmt(m, h) for m, h, _ in cis)]
        lines.append("| " + " | ".join([*row, f"{wall:.0f}", f"{tok:.0f}"]) + " |")
    for pos, f in enumerate(factors):
        base = f.levels[0]
        others = " (averaged over the other factors within each seed)" if len(factors) > 1 else ""
        lines += [
            "",
            f"### {f.name}{others}",
            "",
            f"Δ: the difference to `{base}` paired by seed (mean ± 95% CI of the per-seed differences).",
            "",
            f"| {f.name} | seeds | final accuracy | AUC | gain | Δ final | Δ AUC |",
            "|---|---|---|---|---|---|---|",
        ]
        for lv in f.levels:
            row = [f"`{lv}`"]
            for i, attr in enumerate(("final_accuracy", "auc", "gain")):
                m, h, n = mean_ci(list(_per_seed_marginal(stats, pos, lv, attr).values()))
                row += [str(n)] if i == 0 else []
                row.append(_fmt(m, h))
            for attr in ("final_accuracy", "auc"):
                a, b = _per_seed_marginal(stats, pos, lv, attr), _per_seed_marginal(stats, pos, base, attr)
                m, h, _ = mean_ci([a[k] - b[k] for k in a if k in b])
                row.append("—" if lv == base else _fmt(m, h, signed=True))
            lines.append("| " + " | ".join(row) + " |")
    path.write_text("\n".join(lines) + "\n")
    return path


def _curve_on(steps: list[float], xs: list[float], ys: list[float]) -> list[float]:
    """Linear interpolation of ``(xs, ys)`` at ``steps`` (NaN outside ``xs``'s range)."""
    import numpy as np

    if not xs:
        return [math.nan] * len(steps)
    v = np.interp(steps, xs, ys, left=math.nan, right=math.nan)
    return [float(x) for x in v]


def _seed_curves(
    stats: Sequence[CellStats], pos: int, level: str, metric: str, grid: list[float]
) -> dict[int, list[float]]:
    """``{seed: curve on grid}`` for ``level`` of factor ``pos``, the other factors averaged."""
    import numpy as np

    by: dict[int, list[list[float]]] = defaultdict(list)
    for s in stats:
        if s.cell.key[pos] == level and s.curves.get(metric, ([], []))[0]:
            by[s.cell.seed].append(_curve_on(grid, *s.curves[metric]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # an all-NaN column stays NaN
        return {k: list(np.nanmean(np.array(v), axis=0)) for k, v in sorted(by.items())}


def plot_curves(
    stats: Sequence[CellStats],
    factors: Sequence[Factor],
    path: str | Path,
    *,
    metrics: Sequence[str] = ("eval/accuracy",),
    paired: bool = True,
    confidence: float = 0.95,
) -> Path:
    """Learning curves: one column per factor, one row per metric. For each level, each seed's
    curve is the mean over the other factors' cells at that seed (interpolated onto the union
    of logged steps); the line is the mean over seeds and the band its ``confidence`` CI
    (clipped to ``[0, 1]`` for metrics that stay in it). With ``paired``, a last row shows the
    first metric as the difference to the factor's first level, paired by seed (seed-to-seed
    variation that all levels share cancels there)."""
    from trainers.deps import require

    require("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    if not factors:
        raise ValueError("factors: nothing to plot (no --grid factor)")
    if not metrics:
        raise ValueError("metrics: at least one metric to plot")
    rows = [(m, False) for m in metrics] + ([(metrics[0], True)] if paired else [])
    nrow, ncol = len(rows), len(factors)
    fig, axes = plt.subplots(nrow, ncol, figsize=(4.6 * ncol, 3.2 * nrow), squeeze=False)
    for r, (metric, delta) in enumerate(rows):
        grid = sorted({x for s in stats for x in s.curves.get(metric, ([], []))[0]})
        values = [v for s in stats for v in s.curves.get(metric, ([], []))[1]]
        unit = bool(values) and 0.0 <= min(values) and max(values) <= 1.0
        for c, f in enumerate(factors):
            ax = axes[r][c]
            base = _seed_curves(stats, c, f.levels[0], metric, grid) if delta else {}
            for lv in f.levels:
                curves = _seed_curves(stats, c, lv, metric, grid)
                if delta:
                    curves = {
                        k: list(np.array(v) - np.array(base[k])) for k, v in curves.items() if k in base
                    }
                if not curves:
                    continue
                arr = np.array(list(curves.values()))
                ci = [mean_ci(list(arr[:, j]), confidence) for j in range(len(grid))]
                mean_a = np.array([m for m, _, _ in ci])
                half_a = np.array([0.0 if math.isnan(h) else h for _, h, _ in ci])
                lo, hi = mean_a - half_a, mean_a + half_a
                if unit and not delta:
                    lo, hi = np.clip(lo, 0.0, 1.0), np.clip(hi, 0.0, 1.0)
                line = ax.plot(grid, mean_a, label=f"{lv} (n={len(curves)})", marker="o", ms=2.5)[0]
                ax.fill_between(grid, lo, hi, color=line.get_color(), alpha=0.2)
            if delta:
                ax.axhline(0.0, color="gray", lw=0.8)
            ax.set_title(f.name if r == 0 else "", fontsize=10)
            ax.set_xlabel("step")
            ax.set_ylabel(f"Δ {metric} vs {f.levels[0]}" if delta else metric, fontsize=8 if delta else 10)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.suptitle(
        f"mean ± {round(confidence * 100)}% CI over seeds, other factors averaged within each seed",
        fontsize=9,
    )
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
