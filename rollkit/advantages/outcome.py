"""Outcome (sequence-level) and group-relative advantage estimators.

Every estimator here maps one scalar reward per sample to one advantage per sample:

* ``rewards``: ``[B]`` float, one outcome reward per sampled response;
* ``group_ids``: ``[B]`` int, which prompt each sample answers. Ids are ARBITRARY: any order,
  any values, any group sizes, singletons included (groups are found with
  :func:`rollkit.ops.group_index`, statistics with ``rollkit.ops.segment_*``, no Python loop);
* returns ``[B]`` float advantages (dtype of ``rewards``). Losses broadcast a ``[B]`` advantage
  over tokens; :func:`rollkit.ops.broadcast_to_tokens` builds the ``[B, T]`` form explicitly.

Conventions shared by all estimators (see ``docs/advantages.md`` for the table):

* **eps placement**: ``A = (r - b) / (std + eps)`` (DeepSeekMath GRPO, verl, TRL, OpenRLHF),
  not ``(r - b) / sqrt(var + eps)`` (that is :func:`rollkit.ops.masked_whiten`).
* **zero spread**: where the standard deviation used for scaling is *exactly* 0 the advantage
  is left unscaled (NeMo-RL's "don't sharpen the ones with no variation"); ``eps`` only
  matters for a positive spread, and ``eps=0`` is allowed.
* **identical rewards give exactly 0**: statistics are computed on rewards shifted by their
  group minimum (``d = r - min_g r``), so a group whose rewards are all equal has ``d = 0``
  bit-for-bit and its advantage is exactly ``0.0``, never ``rounding / eps`` noise (the
  group mean / std path is :func:`rollkit.ops.group_normalize`).
* **singletons**: a group of one sample has advantage 0 for every group-baseline estimator
  (its mean is itself; leave-one-out has no other member); an unbiased (``n - 1``) std of a
  single sample is treated as 0 spread.
* **precision**: the statistics are computed in float64 (float32 on MPS, which has no
  float64) whatever the dtype of ``rewards``, and the advantages cast back to it once: a
  float32 result is the float64 result rounded (rtol ~6e-8), as accurate as the naive
  ``r - mean`` and more. Sums of squares are taken of deviations divided by the group's
  largest absolute deviation (a detached constant), so they neither overflow nor underflow:
  rewards of ``1e30`` give the same advantages as rewards of ``1``. Counts are never held in
  16 bits.
* **gradients**: the estimators are differentiable in ``rewards`` (nothing is detached, for
  reward models trained through the advantage) and their gradients are finite everywhere:
  where the spread is exactly 0 (constant group, singleton, constant batch) the advantage and
  its gradient are those of the unscaled ``r - b`` (a convention: the scaled map has no
  derivative there). Detach the rewards if no gradient should flow.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from rollkit.keys import ADVANTAGES, GREEDY_REWARDS, GROUP_IDS, RESPONSE_LENGTH, REWARDS
from rollkit.ops import (
    _group_normalize,
    _safe_sqrt,
    _segment_count,
    _segment_max,
    _segment_mean,
    _segment_min,
    _segment_sum,
    group_index,
)
from rollkit.registry import ADVANTAGE_ESTIMATORS
from rollkit.validation import (
    check_choice,
    check_finite,
    check_finite_float,
    check_group_ids,
    check_positive,
    check_same_device,
    check_same_shape,
    check_tensor,
    values_readable,
)

__all__ = [
    "dr_grpo_advantages",
    "gpg_advantages",
    "grpo_advantages",
    "lite_ppo_advantages",
    "opo_advantages",
    "passk_advantages",
    "rebn_advantages",
    "remax_advantages",
    "rloo_advantages",
]

_OUT = (ADVANTAGES,)
_GROUP_KEYS = {"rewards": REWARDS, "group_ids": GROUP_IDS}


# --------------------------------------------------------------------------- private helpers


def _check_outcome(rewards: Tensor, group_ids: Tensor) -> None:
    check_tensor("rewards", rewards)
    check_group_ids("group_ids", group_ids)
    check_same_device("group_ids", group_ids, "rewards", rewards)
    check_finite_float("rewards", rewards, ndim=1)
    check_group_ids("group_ids", group_ids, rewards.shape[0])


def _stat_dtype(x: Tensor) -> torch.dtype:
    """The dtype the statistics are computed in: float64, or float32 on MPS (no float64)."""
    return torch.float32 if x.device.type == "mps" else torch.float64


def _take(stat: Tensor, index: Tensor) -> Tensor:
    """``stat[index]`` for a ``[G]`` statistic and ``[B]`` dense group index.

    ``index_select`` rather than advanced indexing: on CPU with several threads under load,
    ``aten::index`` was measured 1000x slower (18 ms vs 7 us for 8192 samples).
    """
    return stat.index_select(0, index)


class _Groups:
    """Group statistics of ``rewards`` computed once, on the min-shifted rewards.

    For the estimators that need more than :func:`rollkit.ops.group_normalize` (a batch
    baseline with a group std, leave-one-out baselines and stds); the same arithmetic.
    """

    def __init__(self, rewards: Tensor, index: Tensor, num: int) -> None:
        self.index, self.num = index, num
        self.rmin = _segment_min(rewards, index, num)
        self.rmax = _segment_max(rewards, index, num)
        # d >= 0, exactly 0 for every member of a constant group
        self.d = rewards - _take(self.rmin, index)
        self.count = _segment_count(index, num, rewards.dtype)  # [G]
        self.n = _take(self.count, index)  # [B] size of each sample's group
        self.centred = self.d - _take(_segment_mean(self.d, index, num), index)  # r - mean_g
        # squares of deviations scaled by the group's largest one (a constant): no overflow
        m = _segment_max(self.centred.detach().abs(), index, num)
        self.m = torch.where(m > 0, m, torch.ones_like(m))  # [G]
        self.q = self.centred / _take(self.m, index)  # in [-1, 1]
        self.ss_q = _segment_sum(self.q.square(), index, num)  # [G] sum of squares / m^2
        self.constant = self.rmin == self.rmax  # [G]

    def std(self, *, unbiased: bool) -> Tensor:
        """``[G]`` std of each group; ``n - 1 <= 0`` (unbiased singleton) gives 0."""
        denom = (self.count - 1) if unbiased else self.count
        return self.m * _safe_sqrt(self.ss_q / denom.clamp(min=1))


def _batch_std(x: Tensor, *, unbiased: bool) -> Tensor:
    """0-dim std of all values of ``x`` (min-shifted, so a constant batch gives exactly 0;
    scaled by the largest deviation before squaring, so it does not overflow)."""
    if x.numel() == 0:
        return x.new_zeros(())
    d = x - x.min()
    e = d - d.mean()
    m = e.detach().abs().max()
    m = torch.where(m > 0, m, torch.ones_like(m))
    denom = max(x.numel() - (1 if unbiased else 0), 1)
    return m * _safe_sqrt((e / m).square().sum() / denom)


def _scale(adv: Tensor, std: Tensor, eps: float) -> Tensor:
    """``adv / (std + eps)`` where ``std > 0``; ``adv`` unchanged where the spread is exactly 0
    (the divisor is 1 there, so that ``eps = 0`` puts no ``0 / 0`` into the backward pass)."""
    pos = std > 0
    return torch.where(pos, adv / torch.where(pos, std + eps, torch.ones_like(std)), adv)


# --------------------------------------------------------------------------- GRPO family


@ADVANTAGE_ESTIMATORS.register("grpo", in_keys=_GROUP_KEYS, out_keys=_OUT)
def grpo_advantages(
    rewards: Tensor,  # [B] float
    group_ids: Tensor,  # [B] int, arbitrary ids
    *,
    mean_level: Literal["group", "batch"] = "group",
    std_level: Literal["group", "batch"] | None = "group",
    unbiased_std: bool = True,
    eps: float = 1e-6,
    leave_one_out: bool = False,
    loo_std: bool = False,
    batch_std: Literal["rewards", "centred"] = "rewards",
) -> Tensor:  # [B] float
    """GRPO group-relative advantage and its variants (Dr.GRPO, LitePPO, RLOO, NeMo-RL LOO).

    Shao et al., 2024, "DeepSeekMath", arXiv:2402.03300 (GRPO, outcome supervision)::

        A_i = (r_i - mean_g(r)) / (std_g(r) + eps)

    The knobs select the baseline ``b_i`` and the scale ``s_i`` of ``A_i = (r_i - b_i) / (s_i + eps)``:

    ===================================  ==========================  ==============================
    setting                              baseline ``b_i``            scale ``s_i``
    ===================================  ==========================  ==============================
    defaults (GRPO)                      group mean                  group std
    ``std_level=None`` (Dr.GRPO)         group mean                  none (``A = r - b``)
    ``std_level="batch"`` (LitePPO)      group mean                  std of the ``B`` rewards (*)
    ``mean_level="batch"``               batch mean                  as chosen
    ``leave_one_out=True`` (RLOO)        mean of the *other* members  as chosen
    ``loo_std=True`` (NeMo-RL)           mean of the other members   std of the other members
    ===================================  ==========================  ==============================

    (*) ``batch_std`` picks what the batch std is taken of: ``"rewards"`` (default) the ``B``
    raw rewards, ``"centred"`` the ``B`` centred rewards ``r_i - b_i`` (see
    :func:`lite_ppo_advantages` for who does which).

    Dr.GRPO: Liu et al., 2025, "Understanding R1-Zero-Like Training", arXiv:2503.20783.
    LitePPO: Liu et al., 2025, "Tricks or Traps? A Deep Dive into RL for LLM Reasoning",
    arXiv:2508.08221. RLOO: Ahmadian et al., 2024, "Back to Basics", arXiv:2402.14740,
    ``A_i = r_i - mean_{j != i} r_j = G/(G-1) (r_i - mean_g r)``. NeMo-RL's leave-one-out
    std is the (biased, ``/(G-1)``) std of the other ``G - 1`` rewards; it needs
    ``unbiased_std=False`` and ``eps=0`` to match NeMo-RL exactly.

    Args:
        rewards: ``[B]`` float outcome rewards (finite).
        group_ids: ``[B]`` integer group ids (any values, any order, any sizes).
        mean_level: ``"group"`` (GRPO) or ``"batch"`` mean baseline.
        std_level: ``"group"``, ``"batch"`` or ``None`` (no scaling).
        unbiased_std: ``True`` divides the variance by ``n - 1`` (verl, TRL and OpenRLHF use
            ``torch.std``, i.e. unbiased); ``False`` by ``n``.
        eps: added to the std: ``(r - b) / (std + eps)``. verl uses 1e-6 (default), TRL 1e-4.
        leave_one_out: RLOO baseline (needs ``mean_level="group"``).
        loo_std: scale by the std of the other members (needs ``leave_one_out=True`` and
            ``std_level="group"``); with ``unbiased_std`` the others' variance is divided by
            ``G - 2``, else by ``G - 1``.
        batch_std: with ``std_level="batch"``: ``"rewards"`` (std of the raw rewards, TRL's
            ``scale_rewards="batch"``) or ``"centred"`` (std of ``r - b``, ROLL's
            ``group_reward_norm(div_std_global=True)``); ignored otherwise.

    Returns:
        ``[B]`` advantages, dtype of ``rewards``.

    Edge cases (one behaviour each): a singleton group gets 0 with a group baseline (and with
    LOO: no other member); a group of identical rewards gets exactly 0 with a group baseline;
    a spread of exactly 0 (constant group, unbiased std of a singleton, the others of a LOO
    sample all equal, a constant batch) leaves ``r - b`` unscaled. Statistics are in float64
    and overflow-free (module docstring): rewards ``[1e30, -1e30, 0]`` in one group give
    ``[1, -1, 0]``. ``group_ids`` and ``rewards`` must share a device; ``meta`` tensors are
    refused by name (grouping reads the ids).

    >>> r = torch.tensor([1.0, 0.0, 0.0, 1.0, 5.0, 5.0, 7.0])
    >>> g = torch.tensor([3, 3, 3, 3, 8, 8, 9])      # a 4-group, a constant 2-group, a singleton
    >>> adv = grpo_advantages(r, g)                 # group std of [1,0,0,1] is sqrt(1/3)
    >>> torch.allclose(adv, torch.tensor([1.0, -1.0, -1.0, 1.0, 0, 0, 0]) * 0.5 / (3**-0.5 + 1e-6))
    True
    >>> adv[4:].tolist()                            # constant group and singleton: exactly 0
    [0.0, 0.0, 0.0]
    """
    _check_outcome(rewards, group_ids)
    check_choice("mean_level", mean_level, ("group", "batch"))
    check_choice("std_level", std_level, ("group", "batch", None))  # type: ignore[arg-type]
    check_choice("batch_std", batch_std, ("rewards", "centred"))
    check_positive("eps", eps, allow_zero=True)
    if leave_one_out and mean_level != "group":
        raise ValueError("leave_one_out: needs mean_level='group' (a leave-one-out baseline is per group)")
    if loo_std and not (leave_one_out and std_level == "group"):
        raise ValueError("loo_std: needs leave_one_out=True and std_level='group'")
    index, num = group_index(group_ids)
    if rewards.numel() == 0:
        return rewards.clone()
    work = _stat_dtype(rewards)
    adv = _grpo(
        rewards.to(work),
        index,
        num,
        mean_level=mean_level,
        std_level=std_level,
        unbiased_std=unbiased_std,
        eps=eps,
        leave_one_out=leave_one_out,
        loo_std=loo_std,
        batch_std=batch_std,
    )
    return adv.to(rewards.dtype)


def _grpo(
    rewards: Tensor,
    index: Tensor,
    num: int,
    *,
    mean_level: str,
    std_level: str | None,
    unbiased_std: bool,
    eps: float,
    leave_one_out: bool,
    loo_std: bool,
    batch_std: str,
) -> Tensor:
    """:func:`grpo_advantages` on checked, non-empty rewards in the statistics dtype."""
    if mean_level == "group" and not leave_one_out and std_level != "batch":  # GRPO, Dr.GRPO
        return _group_normalize(
            rewards, index, num, scale=std_level == "group", unbiased=unbiased_std, eps=eps
        )
    if std_level == "batch" and mean_level == "group" and not leave_one_out:  # LitePPO
        adv = _group_normalize(rewards, index, num, scale=False, unbiased=unbiased_std, eps=eps)
        spread = rewards if batch_std == "rewards" else adv
        return _scale(adv, _batch_std(spread, unbiased=unbiased_std), eps)

    grp = _Groups(rewards, index, num)
    if mean_level == "batch":
        d = rewards - rewards.min()
        adv = d - d.mean()
    else:  # leave-one-out
        # r_i - mean_{j != i} r_j = (n d_i - sum_g d) / (n - 1); 0 for singletons
        dsum = _take(_segment_sum(grp.d, grp.index, grp.num), grp.index)
        adv = torch.where(grp.n > 1, (grp.n * grp.d - dsum) / (grp.n - 1).clamp(min=1), 0.0)

    if std_level is None:
        return adv
    if std_level == "batch":
        spread = rewards if batch_std == "rewards" else adv
        return _scale(adv, _batch_std(spread, unbiased=unbiased_std), eps)
    if not loo_std:
        return _scale(adv, _take(grp.std(unbiased=unbiased_std), grp.index), eps)

    # Std of the other n-1 members. With e = r - mean_g (sum_g e = 0), the others' mean is
    # mean_g - e_i/(n-1) and their sum of squares about it is SS_g - e_i^2 * n/(n-1)
    # (here divided by m_g^2: q = e / m_g).
    n, q = grp.n, grp.q
    ss_others = (_take(grp.ss_q, grp.index) - q.square() * n / (n - 1).clamp(min=1)).clamp(min=0)
    denom = (n - 2) if unbiased_std else (n - 1)
    std_others = _take(grp.m, grp.index) * _safe_sqrt(ss_others / denom.clamp(min=1))
    # Exact zero spread when the others are all equal (tolerance-free, from counts of min/max).
    r = rewards
    at_min = (r == _take(grp.rmin, grp.index)).to(r.dtype)
    at_max = (r == _take(grp.rmax, grp.index)).to(r.dtype)
    n_min = _take(_segment_sum(at_min, grp.index, grp.num), grp.index)
    n_max = _take(_segment_sum(at_max, grp.index, grp.num), grp.index)
    others_equal = (
        (n <= 2)
        | _take(grp.constant, grp.index)
        | ((at_min > 0) & (n_max == n - 1))
        | ((at_max > 0) & (n_min == n - 1))
    )
    std_others = torch.where(others_equal, torch.zeros_like(std_others), std_others)
    return _scale(adv, std_others, eps)


@ADVANTAGE_ESTIMATORS.register("dr-grpo", aliases=("dr_grpo",), in_keys=_GROUP_KEYS, out_keys=_OUT)
def dr_grpo_advantages(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """Dr.GRPO advantage: the group-mean baseline without std scaling, ``A_i = r_i - mean_g(r)``.

    Liu et al., 2025, "Understanding R1-Zero-Like Training: A Critical Perspective",
    arXiv:2503.20783. Dropping GRPO's ``1/std_g`` removes the question-difficulty bias (groups
    with nearly uniform rewards are no longer up-weighted). Equals ``(G-1)/G`` times RLOO.
    Shapes: ``[B]``, ``[B]`` -> ``[B]``. Same as ``grpo_advantages(..., std_level=None)``.

    >>> adv = dr_grpo_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), torch.tensor([0, 0, 0, 1]))
    >>> torch.allclose(adv, torch.tensor([2 / 3, -1 / 3, -1 / 3, 0.0]))
    True
    """
    return grpo_advantages(rewards, group_ids, std_level=None)


@ADVANTAGE_ESTIMATORS.register("lite-ppo", aliases=("lite_ppo",), in_keys=_GROUP_KEYS, out_keys=_OUT)
def lite_ppo_advantages(
    rewards: Tensor,  # [B]
    group_ids: Tensor,  # [B]
    *,
    unbiased_std: bool = True,
    eps: float = 1e-6,
    batch_std: Literal["rewards", "centred"] = "rewards",
) -> Tensor:  # [B]
    """LitePPO advantage: group-mean baseline, batch-level std, ``A_i = (r_i - mean_g r) / (std_B + eps)``.

    Liu et al., 2025, "Tricks or Traps? A Deep Dive into RL for LLM Reasoning",
    arXiv:2508.08221. Unlike GRPO the scale is one std for the whole batch, so it does not
    blow up groups with a tiny spread. Two batch stds are in use, chosen by ``batch_std``::

        "rewards" (default):  std_B = std(r_1, ..., r_B)                        the raw rewards
        "centred":            std_B = std(r_1 - mean_g r, ..., r_B - mean_g r)  the centred rewards

    ``"rewards"`` is the paper's "batch-level standard deviation", TRL's
    ``scale_rewards="batch"`` and the authors' shipped LitePPO in ROLL (``norm_mean_type:
    group``, ``norm_std_type: batch``: ``reward_norm`` divides by ``response_level_rewards.std()``).
    ``"centred"`` is ROLL's older ``group_reward_norm(div_std_global=True)``, which divides the
    group-centred rewards by their own std; it leaves out the spread *between* group means, so
    it is never larger than ``"rewards"`` (equal when every group has the same mean).
    Shapes: ``[B]``, ``[B]`` -> ``[B]``.

    >>> r = torch.tensor([1.0, 0.0, 3.0, 3.0])
    >>> adv = lite_ppo_advantages(r, torch.tensor([0, 0, 1, 1]), eps=0.0)
    >>> torch.allclose(adv, torch.tensor([0.5, -0.5, 0.0, 0.0]) / r.std())
    True
    >>> adv = lite_ppo_advantages(r, torch.tensor([0, 0, 1, 1]), eps=0.0, batch_std="centred")
    >>> torch.allclose(adv, torch.tensor([0.5, -0.5, 0.0, 0.0]) / torch.tensor([0.5, -0.5, 0.0, 0.0]).std())
    True
    """
    return grpo_advantages(
        rewards, group_ids, std_level="batch", unbiased_std=unbiased_std, eps=eps, batch_std=batch_std
    )


@ADVANTAGE_ESTIMATORS.register("rloo", in_keys=_GROUP_KEYS, out_keys=_OUT)
def rloo_advantages(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """RLOO advantage: leave-one-out baseline, ``A_i = r_i - mean_{j != i, j in g} r_j``.

    Ahmadian et al., 2024, "Back to Basics: Revisiting REINFORCE Style Optimization for
    Learning from Human Feedback in LLMs", arXiv:2402.14740. The baseline of a sample excludes
    the sample itself, so it is independent of it (unbiased); ``A_i = G/(G-1) (r_i - mean_g r)``
    and the advantages of a group sum to 0. A singleton has no other member: advantage 0.
    Shapes: ``[B]``, ``[B]`` -> ``[B]``.

    >>> rloo_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), torch.tensor([0, 0, 0, 1])).tolist()
    [1.0, -0.5, -0.5, 0.0]
    """
    return grpo_advantages(rewards, group_ids, std_level=None, leave_one_out=True)


# --------------------------------------------------------------------------- other baselines


@ADVANTAGE_ESTIMATORS.register(
    "remax", in_keys={"rewards": REWARDS, "greedy_rewards": GREEDY_REWARDS}, out_keys=_OUT
)
def remax_advantages(
    rewards: Tensor,  # [B] reward of the sampled response
    greedy_rewards: Tensor,  # [B] reward of the greedy response to the same prompt
) -> Tensor:  # [B]
    """ReMax advantage: the greedy response's reward as baseline, ``A_i = r_i - r_i^greedy``.

    Li et al., 2023, "ReMax: A Simple, Effective, and Efficient Reinforcement Learning Method
    for Aligning Large Language Models", arXiv:2310.10505. Unlike group baselines it needs one
    extra greedy decode per prompt instead of several samples; no group ids, no scaling.

    >>> remax_advantages(torch.tensor([1.0, 0.5]), torch.tensor([0.25, 0.5])).tolist()
    [0.75, 0.0]
    """
    check_finite_float("rewards", rewards, ndim=1)
    check_finite_float("greedy_rewards", greedy_rewards, ndim=1)
    check_same_shape("greedy_rewards", greedy_rewards, "rewards", rewards)
    return rewards - greedy_rewards


@ADVANTAGE_ESTIMATORS.register(
    "opo",
    in_keys={"rewards": REWARDS, "group_ids": GROUP_IDS, "lengths": RESPONSE_LENGTH},
    out_keys=_OUT,
)
def opo_advantages(
    rewards: Tensor,  # [B] float
    group_ids: Tensor,  # [B] int
    lengths: Tensor,  # [B] response lengths in tokens (int or float), > 0
) -> Tensor:  # [B]
    """OPO advantage: length-weighted group baseline, ``A_i = r_i - sum_j l_j r_j / sum_j l_j``.

    Hao et al., 2025, "On-Policy RL with Optimal Reward Baseline", arXiv:2505.23585. The
    variance-minimising baseline weights each reward by its squared gradient norm, which OPO
    approximates by the response length ``l_j``; with equal lengths it is Dr.GRPO's group mean.
    Shapes: ``[B]``, ``[B]``, ``[B]`` -> ``[B]``. Lengths must be positive.

    >>> r, g = torch.tensor([1.0, 0.0, 2.0]), torch.tensor([0, 0, 1])
    >>> opo_advantages(r, g, torch.tensor([1, 3, 5])).tolist()      # baseline (1*1 + 3*0)/4
    [0.75, -0.25, 0.0]
    """
    _check_outcome(rewards, group_ids)
    check_tensor("lengths", lengths)
    check_same_shape("lengths", lengths, "rewards", rewards)
    if lengths.dtype == torch.bool:
        raise ValueError("lengths: expected integer or float token counts, got dtype torch.bool")
    work = _stat_dtype(rewards)
    w = lengths.to(work)
    check_finite("lengths", w)
    if values_readable("lengths", w) and bool((w <= 0).any()):
        raise ValueError(f"lengths: must be > 0, got {int((w <= 0).sum())} non-positive value(s)")
    index, num = group_index(group_ids)
    if rewards.numel() == 0:
        return rewards.clone()
    r = rewards.to(work)
    d = r - _take(_segment_min(r, index, num), index)  # exactly 0 in constant groups
    baseline = _segment_sum(w * d, index, num) / _segment_sum(w, index, num)
    return (d - _take(baseline, index)).to(rewards.dtype)


@ADVANTAGE_ESTIMATORS.register("gpg", in_keys=_GROUP_KEYS, out_keys=_OUT)
def gpg_advantages(
    rewards: Tensor,  # [B] float
    group_ids: Tensor,  # [B] int
    *,
    normalize_std: bool = False,
    unbiased_std: bool = True,
    eps: float = 1e-6,
) -> Tensor:  # [B]
    """GPG advantage: group-mean baseline times the batch correction ``alpha = B / (B - M)``.

    Chu et al., 2025, "GPG: A Simple and Strong Reinforcement Learning Baseline for Model
    Reasoning", arXiv:2504.02546::

        A_i = alpha * (r_i - mean_g r) / F,   alpha = B / (B - M),   F = 1 or std_g r + eps

    ``M`` counts the samples in groups whose rewards are all equal (singletons included):
    they get zero advantage, so the gradient averaged over ``B`` samples is rescaled to the
    ``B - M`` samples that carry signal. ``normalize_std=False`` (the paper's default,
    ``F_norm = 1``) is Dr.GRPO times ``alpha``; ``True`` is GRPO times ``alpha``. When every
    group is constant (``M = B``) all advantages are 0 and ``alpha`` is taken as 1.
    Shapes: ``[B]``, ``[B]`` -> ``[B]``.

    >>> r = torch.tensor([1.0, 0.0, 1.0, 1.0])     # group 0 informative, group 1 constant
    >>> gpg_advantages(r, torch.tensor([0, 0, 1, 1])).tolist()   # alpha = 4 / (4 - 2) = 2
    [1.0, -1.0, 0.0, 0.0]
    """
    _check_outcome(rewards, group_ids)
    check_positive("eps", eps, allow_zero=True)
    index, num = group_index(group_ids)
    if rewards.numel() == 0:
        return rewards.clone()
    r = rewards.to(_stat_dtype(rewards))
    adv = _group_normalize(r, index, num, scale=normalize_std, unbiased=unbiased_std, eps=eps)
    constant = _segment_min(r, index, num) == _segment_max(r, index, num)  # [G]
    num_b = r.shape[0]
    # a product, not a boolean-mask index (which would synchronise with the host)
    num_m = (_segment_count(index, num, r.dtype) * constant).sum()
    alpha = torch.where(num_m < num_b, num_b / (num_b - num_m).clamp(min=1), torch.ones_like(num_m))
    return (adv * alpha).to(rewards.dtype)


def _log_comb(n: Tensor, k: Tensor) -> Tensor:
    """``log C(n, k)`` for ``0 <= k <= n`` (float tensors); garbage elsewhere, mask it."""
    return torch.lgamma(n + 1) - torch.lgamma(k + 1) - torch.lgamma(n - k + 1)


def _comb_ratio(n_top: Tensor, n_bottom: Tensor, k: Tensor) -> Tensor:
    """``C(n_top, k) / C(n_bottom, k)`` with ``n_top <= n_bottom``; 0 where ``n_top < k``."""
    valid = n_top >= k
    top = torch.where(valid, n_top, k)  # keep lgamma arguments legal where masked
    ratio = torch.exp(_log_comb(top, k) - _log_comb(n_bottom, k))
    ratio = torch.where(n_top == n_bottom, torch.ones_like(ratio), ratio)  # exactly 1
    return torch.where(valid, ratio, torch.zeros_like(ratio))


@ADVANTAGE_ESTIMATORS.register("pass@k", aliases=("passk", "pass-at-k"), in_keys=_GROUP_KEYS, out_keys=_OUT)
def passk_advantages(
    rewards: Tensor,  # [B] binary 0/1
    group_ids: Tensor,  # [B] int
    *,
    k: int,
) -> Tensor:  # [B]
    """Pass@k advantage: the analytic group-normalised advantage of the pass@k reward.

    Chen et al., 2025, "Pass@k Training for Adaptively Balancing Exploration and
    Exploitation of Large Reasoning Models", arXiv:2508.10751. For a group of ``N`` binary
    rewards with ``c`` correct (``N - c`` wrong), averaging over all size-``k`` subsets::

        R = 1 - C(N - c, k) / C(N, k)               (expected pass@k of the group)
        s = sqrt(R (1 - R))
        A_correct = (1 - R) / s
        A_wrong   = (1 - R - C(N - c - 1, k - 1) / C(N - 1, k - 1)) / s

    Binomials are evaluated with ``lgamma`` in float64 (vectorised). Unlike GRPO (which it equals for
    ``k = 1`` with a biased std and ``eps = 0``), wrong answers in a group that already solves
    the prompt at pass@k are penalised less, which keeps exploration alive.
    Edge cases: ``R`` in ``{0, 1}`` (no correct answer, or fewer than ``k`` wrong ones) gives 0.
    Raises ``ValueError`` if a group has fewer than ``k`` samples or a reward is not 0/1.
    Shapes: ``[B]``, ``[B]`` -> ``[B]``.

    >>> r = torch.tensor([1.0, 0.0, 0.0, 0.0])      # N=4, c=1, k=2: R = 1 - 3/6 = 1/2
    >>> adv = passk_advantages(r, torch.zeros(4, dtype=torch.long), k=2)
    >>> torch.allclose(adv, torch.tensor([1.0, -1/3, -1/3, -1/3]))  # wrong: (1/2 - 2/3) / (1/2)
    True
    """
    _check_outcome(rewards, group_ids)
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k: must be a positive int, got {k!r}")
    index, num = group_index(group_ids)
    if rewards.numel() == 0:
        return rewards.clone()
    if values_readable("rewards", rewards) and bool(((rewards != 0) & (rewards != 1)).any()):
        bad = rewards[(rewards != 0) & (rewards != 1)][0].item()
        raise ValueError(f"rewards: pass@k needs binary 0/1 rewards, got {bad}")
    # [G]-sized statistics in float64: lgamma differences of large N lose digits in float32
    dtype = _stat_dtype(rewards)
    count = _segment_count(index, num, dtype)  # [G]
    if values_readable("group_ids", group_ids) and bool((count < k).any()):
        raise ValueError(
            f"group_ids: pass@{k} needs at least k={k} samples per group, smallest group has {int(count.min())}"
        )
    correct = _segment_sum(rewards.to(dtype), index, num)
    wrong = count - correct
    kk = torch.full_like(count, float(k))
    mean = 1.0 - _comb_ratio(wrong, count, kk)  # [G]
    std = _safe_sqrt((mean * (1.0 - mean)).clamp(min=0))
    # C(N-c-1, k-1) / C(N-1, k-1): chance that the other k-1 of a subset holding a given wrong
    # sample are all wrong
    tail = _comb_ratio((wrong - 1).clamp(min=0), count - 1, kk - 1)
    tail = torch.where(wrong >= 1, tail, torch.zeros_like(tail))
    a_pos = (1.0 - mean) / std.clamp(min=torch.finfo(dtype).tiny)
    a_neg = (1.0 - mean - tail) / std.clamp(min=torch.finfo(dtype).tiny)
    informative = _take(std > 0, index)
    adv = torch.where(rewards > 0, _take(a_pos, index), _take(a_neg, index))
    return torch.where(informative, adv, torch.zeros_like(adv)).to(rewards.dtype)


@ADVANTAGE_ESTIMATORS.register("rebn", aliases=("batch-norm",), in_keys={"rewards": REWARDS}, out_keys=_OUT)
def rebn_advantages(
    rewards: Tensor,  # [B] float
    *,
    unbiased_std: bool = True,
    eps: float = 1e-6,
) -> Tensor:  # [B]
    """ReBN (return batch normalisation): ``A_i = (r_i - mean_B r) / (std_B r + eps)``.

    REINFORCE with the batch mean as baseline and the batch std as scale: every sample of the
    batch shares one baseline, no groups (the global normalisation of REINFORCE++, Hu et al.,
    2025, arXiv:2501.03262, applied to sequence rewards). Use it for one sample per prompt;
    with several, GRPO/RLOO baselines are prompt-specific. A constant batch gives exactly 0.
    Shapes: ``[B]`` -> ``[B]``.

    >>> adv = rebn_advantages(torch.tensor([1.0, 2.0, 3.0]), eps=0.0)   # std = 1 (unbiased)
    >>> torch.allclose(adv, torch.tensor([-1.0, 0.0, 1.0]))
    True
    """
    check_finite_float("rewards", rewards, ndim=1)
    check_positive("eps", eps, allow_zero=True)
    if rewards.numel() == 0:
        return rewards.clone()
    r = rewards.to(_stat_dtype(rewards))  # statistics in float64, cast back
    d = r - r.min()
    return _scale(d - d.mean(), _batch_std(r, unbiased=unbiased_std), eps).to(rewards.dtype)
