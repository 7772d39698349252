"""Reports of an ablation: the per-step metrics as CSV / Parquet, the Markdown summary with
confidence intervals over seeds, and the learning-curve plot (:func:`write_report` writes all
three). See docs/ablations.md.
"""

from __future__ import annotations

import csv
import math
import warnings
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ablations.grid import Cell, Factor
from ablations.results import CellStats, collect, summarize
from ablations.stats import mean_ci
from trainers.deps import require

__all__ = ["Report", "plot_curves", "write_markdown", "write_metrics", "write_report"]


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
        pa = require("pyarrow")
        pq = require("pyarrow.parquet")
    except ImportError:
        return paths
    table = pa.Table.from_pylist([{c: r.get(c) for c in cols} for r in rows]) if rows else pa.table({})
    pq.write_table(table, out / "metrics.parquet")
    paths.append(out / "metrics.parquet")
    return paths


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


def _summary_table(stats: Sequence[CellStats], factors: Sequence[Factor]) -> list[str]:
    """One row per configuration: mean ± CI over seeds of accuracy, AUC, before and gain."""
    names = [f.name for f in factors]
    head = [*names, "seeds", "final accuracy", "AUC", "before", "gain", "wall s", "tokens"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
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
    return lines


def _marginal_table(stats: Sequence[CellStats], factors: Sequence[Factor], pos: int) -> list[str]:
    """Factor ``pos``'s levels averaged over the other factors within each seed, then mean ±
    CI over seeds, and the paired per-seed difference to its first level."""
    f = factors[pos]
    base = f.levels[0]
    others = " (averaged over the other factors within each seed)" if len(factors) > 1 else ""
    lines = [
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
    return lines


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
    lines += _summary_table(stats, factors)
    for pos in range(len(factors)):
        lines += _marginal_table(stats, factors, pos)
    path.write_text("\n".join(lines) + "\n")
    return path


def _curve_on(steps: list[float], xs: list[float], ys: list[float]) -> list[float]:
    """Linear interpolation of ``(xs, ys)`` at ``steps`` (NaN outside ``xs``'s range)."""
    np = require("numpy")
    if not xs:
        return [math.nan] * len(steps)
    v = np.interp(steps, xs, ys, left=math.nan, right=math.nan)
    return [float(x) for x in v]


def _seed_curves(
    stats: Sequence[CellStats], pos: int, level: str, metric: str, grid: list[float]
) -> dict[int, list[float]]:
    """``{seed: curve on grid}`` for ``level`` of factor ``pos``, the other factors averaged."""
    np = require("numpy")
    by: dict[int, list[list[float]]] = defaultdict(list)
    for s in stats:
        if s.cell.key[pos] == level and s.curves.get(metric, ([], []))[0]:
            by[s.cell.seed].append(_curve_on(grid, *s.curves[metric]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # an all-NaN column stays NaN
        return {k: list(np.nanmean(np.array(v), axis=0)) for k, v in sorted(by.items())}


def _plot_panel(
    ax: Any,
    stats: Sequence[CellStats],
    f: Factor,
    pos: int,
    metric: str,
    *,
    delta: bool,
    confidence: float,
) -> None:
    """One panel: each level of factor ``f`` (column ``pos``) as the mean curve of ``metric``
    over seeds with its CI band; with ``delta``, as the paired difference to the first level."""
    np = require("numpy")
    grid = sorted({x for s in stats for x in s.curves.get(metric, ([], []))[0]})
    values = [v for s in stats for v in s.curves.get(metric, ([], []))[1]]
    unit = bool(values) and 0.0 <= min(values) and max(values) <= 1.0
    base = _seed_curves(stats, pos, f.levels[0], metric, grid) if delta else {}
    for lv in f.levels:
        curves = _seed_curves(stats, pos, lv, metric, grid)
        if delta:
            curves = {k: list(np.array(v) - np.array(base[k])) for k, v in curves.items() if k in base}
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
    ax.set_xlabel("step")
    ax.set_ylabel(f"Δ {metric} vs {f.levels[0]}" if delta else metric, fontsize=8 if delta else 10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


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
    if not factors:
        raise ValueError("factors: nothing to plot (no --grid factor)")
    if not metrics:
        raise ValueError("metrics: at least one metric to plot")
    matplotlib = require("matplotlib")
    matplotlib.use("Agg")
    plt = require("matplotlib.pyplot")
    rows = [(m, False) for m in metrics] + ([(metrics[0], True)] if paired else [])
    nrow, ncol = len(rows), len(factors)
    fig, axes = plt.subplots(nrow, ncol, figsize=(4.6 * ncol, 3.2 * nrow), squeeze=False)
    for r, (metric, delta) in enumerate(rows):
        for c, f in enumerate(factors):
            _plot_panel(axes[r][c], stats, f, c, metric, delta=delta, confidence=confidence)
            axes[r][c].set_title(f.name if r == 0 else "", fontsize=10)
    fig.suptitle(
        f"mean ± {round(confidence * 100)}% CI over seeds, other factors averaged within each seed",
        fontsize=9,
    )
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


@dataclass(frozen=True)
class Report:
    """The files :func:`write_report` wrote, and the per-cell statistics they were made from."""

    metrics: list[Path]
    summary: Path
    curves: Path
    stats: list[CellStats]


def write_report(
    cells: Sequence[Cell],
    factors: Sequence[Factor],
    out: str | Path,
    *,
    title: str = "Ablation",
    command: str = "",
    plot_metrics: Sequence[str] = ("eval/accuracy",),
) -> Report:
    """Everything an ablation writes into ``out`` from its finished cells: ``metrics.csv`` /
    ``metrics.parquet`` (:func:`write_metrics`), ``summary.md`` (:func:`write_markdown`) and
    ``curves.png`` (:func:`plot_curves` of ``plot_metrics``). Raises ``ValueError`` when no
    cell has finished."""
    out = Path(out)
    stats = summarize(cells, out, curve_metrics=plot_metrics)
    if not stats:
        raise ValueError(f"no finished cell to summarise in {out}")
    metrics = write_metrics(collect(cells, out), out)
    summary = write_markdown(stats, factors, out / "summary.md", title=title, command=command)
    curves = plot_curves(stats, factors, out / "curves.png", metrics=plot_metrics)
    return Report(metrics, summary, curves, stats)
