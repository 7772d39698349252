r"""Multi-domain RLVR: exact per-step domain quotas, and pass@k / mean@k evaluation metrics.

A multi-domain run (ROLL's ``domain_interleave_probs``: math, code, general reasoning, ...)
draws every step's ``B`` prompts from ``D`` domains in proportion to weights :math:`w_d`. This
module computes the integer split (:func:`domain_quotas`), keeps a checkpointable cursor per
domain (:class:`DomainSampler`), and scores evaluation samples per problem
(:func:`pass_at_k`, :func:`mean_at_k`, from :func:`correct_counts`). Per-domain reward
normalisation needs nothing new: it is :func:`rollkit.rewards.normalize_rewards` with
``level="group"`` and the domain ids as ``group_ids`` (guide: ``docs/domains.md``).

**The quota scheme** (:func:`domain_quotas`). With :math:`x_d = B\,w_d / \sum_e w_e` (exact
rational arithmetic, :class:`fractions.Fraction`), each domain gets its floor
:math:`\lfloor x_d\rfloor` (Hamilton's largest-remainder start) and the
:math:`R = B - \sum_d \lfloor x_d\rfloor` leftover prompts go to the domains picked by
*systematic sampling* (Madow 1949; Baker 1987's stochastic universal sampling) of the
remainders :math:`r_d = x_d - \lfloor x_d\rfloor`: lay the :math:`r_d` end to end on
:math:`[0, R)` in domain order and give one extra prompt to each domain whose segment
:math:`[C_{d-1}, C_d)` holds one of the points :math:`u, u + 1, \dots, u + R - 1`:

.. math::

    q_d = \lfloor x_d\rfloor + \lceil C_d - u\rceil - \lceil C_{d-1} - u\rceil,
    \qquad C_d = \sum_{e \le d} r_e,\quad u \in [0, 1)

The offset is :math:`u_t = \{u_0 + t\varphi\}` for step :math:`t`, with :math:`u_0` drawn
from ``seed`` and :math:`\varphi = (\sqrt 5 - 1)/2` (a golden-ratio rotation). Properties:

* :math:`\sum_d q_d = B` exactly (the sum telescopes to :math:`\lceil R - u\rceil = R`);
* :math:`q_d \in \{\lfloor x_d\rfloor, \lceil x_d\rceil\}` (a segment of length
  :math:`r_d < 1` holds at most one point); a zero weight gives 0;
* for a uniform :math:`u` the extra prompt goes to domain :math:`d` with probability exactly
  :math:`r_d` (the segment's length), so :math:`E[q_d] = x_d`;
* over steps the offsets are a low-discrepancy sequence, so for fixed weights the running
  total :math:`\sum_{t<T} q_d(t)` stays within :math:`O(\log T)` of :math:`T x_d` (Ostrowski's
  bound for the golden rotation; independent offsets would drift as :math:`\sqrt T`);
* deterministic in ``(weights, batch_size, seed, step)``: no state, any step can be
  recomputed after a restart.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from fractions import Fraction
from typing import Any

import torch
from torch import Tensor

from rollkit.ops import group_index
from rollkit.scheduling import EpochSampler
from rollkit.validation import (
    check_group_ids,
    check_int,
    check_int_tensor,
    check_ndim,
    check_real,
    check_same_device,
    check_same_shape,
    check_tensor,
    values_readable,
)

__all__ = [
    "DomainSampler",
    "correct_counts",
    "domain_quotas",
    "mean_at_k",
    "pass_at_k",
]

_GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0  # 1 / phi: the irrational rotation of the offsets


# --------------------------------------------------------------------------- quotas


def _check_weights(weights: object) -> list[Fraction]:
    """The weights as exact fractions; raise naming ``weights`` unless they are D >= 1 finite
    numbers >= 0, not all zero (a 1-D real tensor or a sequence of numbers)."""
    if isinstance(weights, Tensor):
        check_ndim("weights", weights, 1)
        if weights.dtype == torch.bool or weights.is_complex():
            raise TypeError(f"weights: expected a real tensor, got dtype {weights.dtype}")
        if weights.is_meta:
            raise ValueError("weights: is on the meta device; quotas need the values")
        values = weights.detach().cpu().tolist()
    elif isinstance(weights, (str, bytes, Mapping)) or not isinstance(weights, Sequence):
        raise TypeError(
            f"weights: expected a 1-D tensor or a sequence of numbers, got {type(weights).__name__}"
        )
    else:
        values = list(weights)
    if not values:
        raise ValueError("weights: needs at least one domain, got none")
    out = []
    for i, v in enumerate(values):
        f = check_real("weights", v)
        if not (math.isfinite(f) and f >= 0):
            raise ValueError(f"weights: must be finite and >= 0, got {v} at index {i}")
        out.append(Fraction(v) if isinstance(v, int) else Fraction(f))
    if not any(out):
        raise ValueError("weights: need at least one positive weight, got all zeros")
    return out


def _check_nonnegative_int(name: str, value: object) -> int:
    v = check_int(name, value)
    if v < 0:
        raise ValueError(f"{name}: must be >= 0, got {v}")
    return v


def _offset(seed: int, step: int) -> Fraction:
    """``u_t = frac(u_0 + t / phi)`` in ``[0, 1)``, ``u_0`` a uniform draw seeded by ``seed``."""
    u0 = random.Random(f"rollkit.domain_quotas/{seed}").random()
    return Fraction((u0 + (step * _GOLDEN) % 1.0) % 1.0)


def _apportion(weights: list[Fraction], batch_size: int, u: Fraction) -> list[int]:
    """Floors plus systematic sampling of the remainders at offset ``u`` (exact arithmetic)."""
    total = sum(weights)
    quotas, before, cum = [], 0, Fraction(0)
    for w in weights:
        x = w * batch_size / total
        floor = math.floor(x)
        cum += x - floor
        after = math.ceil(cum - u)
        quotas.append(floor + after - before)
        before = after
    return quotas


def domain_quotas(
    weights: Sequence[float] | Tensor,  # [D] >= 0, not all 0
    batch_size: int,
    *,
    step: int,
    seed: int = 0,
) -> list[int]:  # [D] ints >= 0 summing to batch_size
    r"""How many of a step's ``batch_size`` prompts each of ``D`` domains gets: exact integers.

        x_d = B w_d / sum_e w_e
        q_d = floor(x_d) + ceil(C_d - u_t) - ceil(C_{d-1} - u_t),   C_d = sum_{e <= d} (x_e - floor(x_e))
        u_t = frac(u_0(seed) + t (sqrt(5) - 1) / 2)

    Largest-remainder apportionment whose leftover prompts are dealt by systematic sampling
    of the fractional remainders (module docstring: the proofs). Guarantees: ``sum(q) ==
    batch_size``; every ``q_d`` is ``floor(x_d)`` or ``ceil(x_d)`` (so exactly ``x_d`` when it
    is an integer, and 0 for a zero weight); over uniformly random seeds ``E[q_d] = x_d``;
    over the steps of one seed the running total of a domain stays within ``O(log T)`` of
    ``T x_d``. The weights need not sum to 1 (ROLL's ``domain_interleave_probs`` do). Pure and
    deterministic in its arguments, computed exactly (:class:`fractions.Fraction`) on the host.

    Args:
        weights: ``[D]`` finite weights ``>= 0``, at least one positive (a 1-D real tensor, or
            a sequence of numbers).
        batch_size: ``B >= 0``, the prompts of the step.
        step: ``t >= 0``, the training step.
        seed: any int; it fixes ``u_0``.

    Returns:
        ``D`` ints ``>= 0`` that sum to ``batch_size``.

    >>> domain_quotas([0.5, 0.25, 0.25], 8, step=0)            # integral shares are exact
    [4, 2, 2]
    >>> q = domain_quotas([0.6, 0.3, 0.1], 8, step=3, seed=1)   # x = 4.8, 2.4, 0.8
    >>> sum(q), q[0] in (4, 5), q[1] in (2, 3), q[2] in (0, 1)
    (8, True, True, True)
    >>> sum(domain_quotas([1, 1, 1], 10, step=t)[0] for t in range(300)) / 300   # -> 10/3
    3.3333333333333335
    """
    w = _check_weights(weights)
    b = _check_nonnegative_int("batch_size", batch_size)
    t = _check_nonnegative_int("step", step)
    s = check_int("seed", seed)
    return _apportion(w, b, _offset(s, t))


class DomainSampler:
    """Per-step prompt ids for ``D`` domains: :func:`domain_quotas` plus one
    :class:`rollkit.scheduling.EpochSampler` (the domain's cursor) per domain.

    ``next(sampler)`` returns ``D`` lists of prompt ids, list ``d`` holding the
    :func:`domain_quotas` of step ``sampler.step`` for domain ``d``, drawn from that domain's
    epoch iterator (id ``epoch * num_prompts[d] + index``, shuffled per epoch with the seed
    ``seed * 1_000_003 + d``), then advances the step. The state is the step and the ``D``
    cursors (``state_dict`` / ``load_state_dict``); the configuration (sizes, weights, batch
    size, seed, shuffle) must match on load.

    >>> s = DomainSampler([4, 100], [0.5, 0.5], 4, shuffle=False)
    >>> next(s), next(s), next(s)
    ([[0, 1], [0, 1]], [[2, 3], [2, 3]], [[4, 5], [4, 5]])
    >>> t = DomainSampler([4, 100], [0.5, 0.5], 4, shuffle=False)
    >>> t.load_state_dict(s.state_dict())
    >>> next(t) == next(s) == [[6, 7], [6, 7]]          # domain 0 is in its second epoch
    True
    """

    def __init__(
        self,
        num_prompts: Sequence[int],  # [D] data-set sizes
        weights: Sequence[float] | Tensor,  # [D]
        batch_size: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
    ) -> None:
        self._weights = _check_weights(weights)
        if isinstance(num_prompts, (str, bytes, Mapping)) or not isinstance(num_prompts, Sequence):
            raise TypeError(f"num_prompts: expected a sequence of ints, got {type(num_prompts).__name__}")
        if len(num_prompts) != len(self._weights):
            raise ValueError(
                f"num_prompts: has {len(num_prompts)} domains but weights has {len(self._weights)}"
            )
        self.num_prompts = [check_int("num_prompts", n) for n in num_prompts]
        if min(self.num_prompts) < 1:
            raise ValueError(f"num_prompts: every domain needs >= 1 prompt, got {self.num_prompts}")
        self.weights = [float(w) for w in self._weights]
        self.batch_size = _check_nonnegative_int("batch_size", batch_size)
        self.seed = check_int("seed", seed)
        if not isinstance(shuffle, bool):
            raise TypeError(f"shuffle: expected a bool, got {type(shuffle).__name__}")
        self.shuffle = shuffle
        self.step = 0
        self.cursors = [
            EpochSampler(n, shuffle=shuffle, seed=self.seed * 1_000_003 + d)
            for d, n in enumerate(self.num_prompts)
        ]

    def __iter__(self) -> DomainSampler:
        return self

    def __next__(self) -> list[list[int]]:
        quotas = _apportion(self._weights, self.batch_size, _offset(self.seed, self.step))
        self.step += 1
        return [[next(c) for _ in range(q)] for c, q in zip(self.cursors, quotas)]

    def state_dict(self) -> dict[str, Any]:
        """The configuration, the step and the ``D`` cursor states (plain Python values)."""
        return {
            "num_prompts": list(self.num_prompts),
            "weights": list(self.weights),
            "batch_size": self.batch_size,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "step": self.step,
            "cursors": [c.state_dict() for c in self.cursors],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict`; the configuration must match this sampler's."""
        if not isinstance(state, Mapping):
            raise TypeError(f"state: expected a mapping, got {type(state).__name__}")
        for key in ("num_prompts", "weights", "batch_size", "seed", "shuffle"):
            if state.get(key) != getattr(self, key):
                raise ValueError(
                    f"state: {key} is {state.get(key)!r} in the checkpoint but {getattr(self, key)!r} here"
                )
        step = _check_nonnegative_int("state['step']", state.get("step"))
        cursors = state.get("cursors")
        if not isinstance(cursors, Sequence) or len(cursors) != len(self.cursors):
            raise ValueError(f"state: 'cursors' must hold {len(self.cursors)} cursor states")
        for c, s in zip(self.cursors, cursors):
            c.load_state_dict(s)
        self.step = step


# --------------------------------------------------------------------------- pass@k, mean@k


def correct_counts(
    correct: Tensor,  # [B] bool (or 0/1) correctness of each sample
    group_ids: Tensor,  # [B] int problem id of each sample
) -> tuple[Tensor, Tensor]:  # [G] int64 num_samples, [G] int64 num_correct
    """Per problem: the number of samples ``n`` and of correct ones ``c``, from per-sample data.

    Problems are numbered by sorted id (as :func:`rollkit.ops.group_index`), so both outputs
    are ``[G]`` and feed :func:`pass_at_k` / :func:`mean_at_k`.

    >>> n, c = correct_counts(torch.tensor([True, False, True, True]), torch.tensor([7, 7, 3, 7]))
    >>> n.tolist(), c.tolist()
    ([1, 3], [1, 2])
    """
    check_tensor("correct", correct)
    check_ndim("correct", correct, 1)
    if correct.is_complex():
        raise TypeError(f"correct: expected a bool or 0/1 tensor, got dtype {correct.dtype}")
    check_group_ids("group_ids", group_ids, correct.shape[0])
    check_same_device("group_ids", group_ids, "correct", correct)
    if correct.dtype != torch.bool and values_readable("correct", correct):
        bad = (correct != 0) & (correct != 1)
        if bool(bad.any()):
            raise ValueError(f"correct: expected 0/1 values, got {correct[bad][0].item()}")
    index, num = group_index(group_ids)
    n = torch.zeros(num, dtype=torch.int64, device=correct.device)
    n.index_add_(0, index, torch.ones_like(index))
    c = torch.zeros(num, dtype=torch.int64, device=correct.device)
    c.index_add_(0, index, (correct != 0).to(torch.int64))
    return n, c


def _check_counts(num_samples: Tensor, num_correct: Tensor, k: object) -> int:
    """``[P]`` integer counts with ``0 <= c <= n`` and an int ``1 <= k <= n``; returns ``k``."""
    check_int_tensor("num_samples", num_samples)
    check_ndim("num_samples", num_samples, 1)
    check_int_tensor("num_correct", num_correct)
    check_same_shape("num_correct", num_correct, "num_samples", num_samples)
    check_same_device("num_correct", num_correct, "num_samples", num_samples)
    k = check_int("k", k)
    if k < 1:
        raise ValueError(f"k: must be >= 1, got {k}")
    if num_samples.numel() and values_readable("num_samples", num_samples):
        bad = (num_correct < 0) | (num_correct > num_samples)
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            raise ValueError(
                f"num_correct: must be in [0, num_samples], problem {i} has "
                f"c={int(num_correct[i])}, n={int(num_samples[i])}"
            )
        small = num_samples < k
        if bool(small.any()):
            i = int(small.nonzero()[0, 0])
            raise ValueError(f"k: {k} exceeds the {int(num_samples[i])} samples of problem {i} (k <= n)")
    return k


def pass_at_k(
    num_samples: Tensor,  # [P] int n: samples per problem
    num_correct: Tensor,  # [P] int c: correct samples per problem
    *,
    k: int,
) -> Tensor:  # [P] float64
    """The unbiased pass@k estimator of Chen et al. 2021 (Codex, arXiv:2107.03374), per problem.

        pass@k = 1 - C(n - c, k) / C(n, k)
               = 1 - prod_{i = n - c + 1}^{n} (1 - k / i)      (1 when n - c < k)

    the probability that a size-``k`` subset, drawn without replacement from the ``n`` samples
    of a problem of which ``c`` are correct, holds a correct one: an unbiased estimate of the
    chance that ``k`` fresh samples solve the problem (the biased ``1 - (1 - c/n)^k`` is not).
    Computed as the paper's numerically stable product, in log space (``-expm1(sum
    log1p(-k / i))``, float64), vectorised over problems with different ``n``: exact to a few
    ulps even where ``C(n, k)`` overflows. The benchmark score is the mean over problems.

    Args:
        num_samples: ``[P]`` integer ``n >= k`` per problem.
        num_correct: ``[P]`` integer ``0 <= c <= n`` (:func:`correct_counts` gives both from
            per-sample correctness and problem ids).
        k: ``>= 1``.

    Returns:
        ``[P]`` float64 on the device of the inputs.

    >>> pass_at_k(torch.tensor([4, 4, 10]), torch.tensor([1, 0, 10]), k=2)    # 1 - C(3,2)/C(4,2)
    tensor([0.5000, 0.0000, 1.0000], dtype=torch.float64)
    >>> float(pass_at_k(torch.tensor([5]), torch.tensor([2]), k=1))           # pass@1 = c / n
    0.4
    """
    k = _check_counts(num_samples, num_correct, k)
    n, c = num_samples.to(torch.int64), num_correct.to(torch.int64)
    solved = n - c < k  # every k-subset holds a correct sample
    terms = torch.where(solved, torch.zeros_like(c), c)  # the product has c factors
    problem = torch.repeat_interleave(torch.arange(n.shape[0], device=n.device), terms)
    start = torch.cumsum(terms, 0) - terms
    i = (n - terms + 1)[problem] + torch.arange(problem.shape[0], device=n.device) - start[problem]
    log_fail = torch.zeros(n.shape[0], dtype=torch.float64, device=n.device)
    log_fail.index_add_(0, problem, torch.log1p(-k / i.to(torch.float64)))  # i > k: finite
    # 0 - expm1, not -expm1: a problem with no correct sample gives +0.0, not -0.0
    return torch.where(solved, torch.ones_like(log_fail), 0.0 - torch.expm1(log_fail))


def mean_at_k(
    num_samples: Tensor,  # [P] int n
    num_correct: Tensor,  # [P] int c
    *,
    k: int,
) -> Tensor:  # [P] float64
    """mean@k per problem: the expected fraction of correct answers among ``k`` samples.

        mean@k = E_{S subset of the n samples, |S| = k} [ (1/k) sum_{s in S} correct_s ] = c / n

    The average, over all ``C(n, k)`` size-``k`` subsets of the ``n`` samples, of the subset's
    accuracy: each sample lies in a fraction ``k / n`` of the subsets, so this is ``c / n`` for
    every ``k <= n``, the unbiased, minimum-variance estimate of the per-sample accuracy
    (``avg@k`` in some reports; using only the first ``k`` samples is unbiased too, with more
    variance). ``k`` only states the protocol and is checked: ``k <= n``. Averaged over
    problems it is the benchmark's mean@k. For graded (non-binary) scores use the per-problem
    mean of the scores, :func:`rollkit.ops.segment_mean`.

    >>> mean_at_k(torch.tensor([4, 8]), torch.tensor([1, 6]), k=4)
    tensor([0.2500, 0.7500], dtype=torch.float64)
    """
    _check_counts(num_samples, num_correct, k)
    return num_correct.to(torch.float64) / num_samples.to(torch.float64)
