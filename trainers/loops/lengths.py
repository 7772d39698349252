"""Per-request response-length budgets: the long-tail workload W1 of ``shared/BENCHMARKS.md``.

Rollout time in RLVR is dominated by a few very long responses: the longest response of a step
is 25-32x the median (RollPacker, Gao et al. 2025, arXiv:2509.21009, Table 1; ROLL Flash,
Lu et al. 2025, arXiv:2510.11345, cites > 20x). A small model on a CPU does not produce that
tail by itself, so the benchmarks control it: every request gets its own ``max_tokens`` drawn
from a log-normal distribution clipped to the cap, and generates with ``ignore_eos`` so that it
runs to exactly that length. Everything else stays real (a real model samples real tokens
through a real engine, and the trainer trains on them).

:math:`L = \\min(\\text{cap}, \\max(1, \\operatorname{round}(m\\, e^{\\sigma Z})))`,
:math:`Z \\sim \\mathcal N(0, 1)`, with median :math:`m`. With :math:`\\sigma = 1.5` the
longest of 64 draws is about :math:`e^{2.15\\sigma} \\approx 25` times the median.

Spec strings (``rollout.length_dist``): ``""`` (every request gets the cap,
``rollout.max_tokens``, and stops at EOS as usual) or ``"lognormal:MEDIAN:SIGMA"``.

>>> s = LengthSampler("lognormal:16:1.5", cap=512, seed=0)
>>> draws = [s.draw() for _ in range(1000)]
>>> 1 <= min(draws) and max(draws) <= 512
True
>>> sorted(draws)[500] in range(13, 20)   # the median
True
>>> LengthSampler("", cap=12).draw(), LengthSampler("", cap=12).ignore_eos
(12, False)
"""

from __future__ import annotations

import math
import random

__all__ = ["LengthSampler"]


class LengthSampler:
    """Draws ``max_tokens`` per request (module docstring).

    Args:
        spec: ``""`` or ``"lognormal:MEDIAN:SIGMA"`` (``MEDIAN >= 1``, ``SIGMA >= 0``).
        cap: the most tokens of any request (``rollout.max_tokens``), ``>= 1``.
        seed: seeds the draws (the same seed gives the same sequence).

    ``ignore_eos`` is True for a distribution (requests run to their drawn length).
    """

    def __init__(self, spec: str, *, cap: int, seed: int = 0) -> None:
        if not isinstance(cap, int) or cap < 1:
            raise ValueError(f"cap must be an int >= 1, got {cap!r}")
        self.spec, self.cap = spec, cap
        self._rng = random.Random(seed)
        self.median = self.sigma = None
        if spec:
            parts = spec.split(":")
            try:
                if parts[0] != "lognormal" or len(parts) != 3:
                    raise ValueError
                median, sigma = float(parts[1]), float(parts[2])
            except ValueError:
                raise ValueError(
                    f"rollout.length_dist: expected '' or 'lognormal:MEDIAN:SIGMA', got {spec!r}"
                ) from None
            if not (median >= 1 and sigma >= 0 and math.isfinite(median) and math.isfinite(sigma)):
                raise ValueError(f"rollout.length_dist: need MEDIAN >= 1 and SIGMA >= 0, got {spec!r}")
            self.median, self.sigma = median, sigma
        self.ignore_eos = bool(spec)

    def draw(self) -> int:
        """One request's ``max_tokens``."""
        if self.median is None:
            return self.cap
        x = self.median * math.exp(self.sigma * self._rng.gauss(0.0, 1.0))
        return max(1, min(self.cap, round(x)))

    def state_dict(self) -> dict:
        return {"rng": self._rng.getstate()}

    def load_state_dict(self, state: dict) -> None:
        self._rng.setstate(state["rng"])
