"""Statistics of an ablation: the Student-t confidence interval of a mean over seeds, and the
normalised area under a learning curve. The t quantile is scipy's (``pip install
'rollkit-rl[ablate]'``). See docs/ablations.md.

>>> round(t_quantile(0.975, 2), 3)
4.303
>>> auc([0, 10, 20], [0.2, 0.6, 0.6])
0.5
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

from trainers.deps import require

__all__ = ["auc", "mean_ci", "t_quantile"]


def t_quantile(p: float, df: float) -> float:
    """The ``p`` quantile of Student's t with ``df`` degrees of freedom (``scipy.stats.t.ppf``).

    >>> round(t_quantile(0.975, 2), 4), round(t_quantile(0.975, 10), 4), round(t_quantile(0.975, 1e9), 4)
    (4.3027, 2.2281, 1.96)
    """
    if not 0.0 < p < 1.0:
        raise ValueError(f"p must be in (0, 1), got {p}")
    if not df > 0:
        raise ValueError(f"df must be > 0, got {df}")
    return float(require("scipy.stats").t.ppf(p, df))


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
