"""The results of finished cells: their per-step metrics and per-cell statistics.

:func:`collect` gathers the per-step metrics of every finished cell; :func:`summarize`
computes per cell the final held-out accuracy, the area under its curve (:func:`~ablations.stats.auc`),
the wall time and the generated tokens. See docs/ablations.md.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ablations.grid import Cell
from ablations.runner import cell_dir, is_done
from ablations.stats import auc
from trainers.tracking import read_metrics

__all__ = ["CellStats", "cell_stats", "collect", "summarize"]


def _merged_rows(path: Path) -> list[dict[str, Any]]:
    """``metrics.jsonl`` rows merged by step (the end-of-run evaluation shares the last step)."""
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
