"""Algorithm ablations: a grid of config overrides x seeds, run resumably, summarised with
confidence intervals over seeds. ``recipes/ablate.py`` is the command line; docs/ablations.md
the guide.

- :mod:`ablations.grid`: factors, levels, seeds and cells (:func:`expand_grid`).
- :mod:`ablations.runner`: running the cells as subprocesses or Ray tasks, resumably (:func:`run_cells`).
- :mod:`ablations.warm_start`: the supervised-warm-up-then-RL cell body (:func:`~ablations.warm_start.warm_start_fit`).
- :mod:`ablations.results`: per-step metrics and per-cell statistics of finished cells.
- :mod:`ablations.stats`: the Student-t interval of a mean (:func:`mean_ci`) and the AUC.
- :mod:`ablations.report`: ``metrics.csv`` / ``.parquet``, ``summary.md`` and ``curves.png`` (:func:`write_report`).

>>> cells = expand_grid([parse_factor("algorithm.advantage=grpo,dr-grpo")], seeds=[0, 1])
>>> len(cells), cells[0].overrides()
(4, ['algorithm.advantage=grpo', 'seed=0'])
"""

from ablations.grid import (
    REGISTRY_FIELDS,
    RESERVED_KEYS,
    Cell,
    Factor,
    expand_grid,
    parse_factor,
    parse_seeds,
    split_levels,
    validate_cells,
)
from ablations.report import Report, plot_curves, write_markdown, write_metrics, write_report
from ablations.results import CellStats, cell_stats, collect, summarize
from ablations.runner import CELL_TIMEOUT_S, CellResult, cell_dir, is_done, run_cells
from ablations.stats import auc, mean_ci, t_quantile

__all__ = [
    "CELL_TIMEOUT_S",
    "REGISTRY_FIELDS",
    "RESERVED_KEYS",
    "Cell",
    "CellResult",
    "CellStats",
    "Factor",
    "Report",
    "auc",
    "cell_dir",
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
    "summarize",
    "t_quantile",
    "validate_cells",
    "write_markdown",
    "write_metrics",
    "write_report",
]
