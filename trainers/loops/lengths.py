r"""Per-request response-length budgets: the long-tail workload W1 (docs/benchmarks.md).

A small model on a CPU does not produce the long tail of RLVR response lengths by itself (the
longest response of a step is 25-32x the median in RollPacker, arXiv:2509.21009), so the W1
benchmarks control it: every request gets its own ``max_tokens`` drawn from a log-normal
distribution clipped to the cap and generates with ``ignore_eos``, so that it runs to exactly
that length.

:math:`L = \min(\text{cap}, \max(1, \operatorname{round}(m\, e^{\sigma Z})))`,
:math:`Z \sim \mathcal N(0, 1)`, with median :math:`m`. With :math:`\sigma = 1.5` the
longest of 64 draws is about :math:`e^{2.15\sigma} \approx 25` times the median.

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

from trainers.config import parse_length_dist

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
        parsed = parse_length_dist(spec)
        self.median, self.sigma = parsed if parsed is not None else (None, None)
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
