"""Ensembles of mini-critics (AsyPPO): data shards, the ensemble value, disagreement masks.

Asymmetric PPO (Liu, Obando-Ceron, Lu, He, Wang, Su, Zheng, Castro, Courville & Pan, 2025,
"Asymmetric Proximal Policy Optimization: mini-critics boost LLM reasoning",
arXiv:2510.01656, ICLR 2026) trains ``K`` small critics (e.g. two Qwen3-1.7B critics for a
Qwen3-14B actor) instead of one critic of the actor's size, and uses their disagreement to
reshape the PPO loss. Its tensor parts are pure functions and live here; the trainer owns the
critic models and calls them directly:

* :func:`critic_shards` splits a batch among the critics: the responses of every prompt are
  dealt to the critics as evenly as possible, so each critic trains on disjoint data but sees
  every prompt (the paper's "group-level non-overlapping division");
* :func:`ensemble_values` averages the ``K`` critics' values (the value GAE uses) and gives
  their standard deviation ``sigma_t``, the per-token disagreement;
* :func:`disagreement_masks` turns ``sigma`` into the paper's two indicators: no advantage on
  the tokens where the critics agree most (the lowest ``k`` fraction of ``sigma``), no entropy
  bonus on the tokens where they disagree most (the highest ``h`` fraction);
* :func:`asyppo_advantages` chains the last two with GAE: a step's advantages, returns and
  masks from the critics' values in one call; :func:`asyppo_estimator` is the same registered
  as the advantage estimator ``"asyppo"`` (``ADVANTAGE_ESTIMATORS``), reading the batch key
  ``ensemble_values`` ``[B, T, C]`` (batch-first, as every batch key).

The guide, with the paper's formulas, its defaults and the readings chosen where it is
ambiguous, is docs/critics.md.
"""

from __future__ import annotations

from fractions import Fraction
from typing import NamedTuple

import torch
from torch import Tensor

from rollkit import keys as K
from rollkit.advantages.gae import gae_advantages
from rollkit.losses._common import compute_dtype
from rollkit.ops import group_index
from rollkit.registry import ADVANTAGE_ESTIMATORS
from rollkit.validation import (
    InvalidTypeError,
    check_choice,
    check_finite_under_mask,
    check_float,
    check_group_ids,
    check_in_range,
    check_int,
    check_mask,
    check_ndim,
    check_same_device,
    check_same_shape,
    values_readable,
)

__all__ = [
    "DEFAULT_ADVANTAGE_MASK_FRAC",
    "DEFAULT_ENTROPY_FILTER_FRAC",
    "SHARD_LEVELS",
    "AsyPPOAdvantages",
    "DisagreementMasks",
    "asyppo_advantages",
    "asyppo_estimator",
    "critic_shards",
    "disagreement_masks",
    "ensemble_values",
]

#: ``level`` values of :func:`critic_shards`.
SHARD_LEVELS = ("response", "prompt")

#: The paper's ``k``: the fraction of valid tokens, lowest inter-critic std first, whose
#: advantage is masked (its best value, "bottom 20% by value-std", Fig. 5b and Fig. 10).
DEFAULT_ADVANTAGE_MASK_FRAC = 0.2

#: The paper's ``h``: the fraction of valid tokens, highest inter-critic std first, left out
#: of the entropy bonus (its best value in the sensitivity study, Fig. 10).
DEFAULT_ENTROPY_FILTER_FRAC = 0.2

# fractions are read as the nearest ratio with a denominator up to this (exact integer counts)
_MAX_DENOMINATOR = 10**6


class DisagreementMasks(NamedTuple):
    """What :func:`disagreement_masks` returns (unpack it as
    ``advantage_keep, entropy_keep, metrics = ...``).

    Attributes:
        advantage_keep: ``[B, T]`` bool, the paper's ``I^A_t``: False on the valid tokens whose
            inter-critic std is among the lowest ``advantage_mask_frac`` (critics agree) and
            outside ``mask``. Multiply the advantages by it.
        entropy_keep: ``[B, T]`` bool, the paper's ``I^H_t``: False on the valid tokens whose
            std is among the highest ``entropy_filter_frac`` (critics disagree) and outside
            ``mask``. Zero the entropy bonus of the other tokens with it.
        metrics: detached 0-dim float tensors, all 0 for an empty ``mask``:
            ``"advantage_masked_frac"`` and ``"entropy_filtered_frac"`` (fractions of the valid
            tokens), ``"value_std_mean"`` and ``"value_std_max"`` (of ``std`` over ``mask``).
    """

    advantage_keep: Tensor
    entropy_keep: Tensor
    metrics: dict[str, Tensor]


# --------------------------------------------------------------------------- critic_shards


def critic_shards(
    group_ids: Tensor,  # [B] integer: the prompt (group) of each sample
    num_critics: int,
    *,
    level: str = "response",
    seed: int | None = None,
) -> Tensor:  # [B] int64 critic index in 0..num_critics-1
    """The critic (``0..K-1``) that trains on each sample: AsyPPO's non-overlapping data division.

    AsyPPO (Liu et al., 2025, arXiv:2510.01656, Sec. 4.1) trains mini-critic ``m`` only on its
    own disjoint subset ``D_m`` of the batch,

        L_critic = sum_m E_{(s_t, R_t) ~ D_m} [ (V(s_t; phi_m) - R_t)^2 ],

    and divides *at the group level*: the responses of each prompt are split uniformly among
    the critics, so that every critic sees every prompt (that has at least ``K`` responses:
    the critics stay calibrated to the same prompts, "perceptual synchrony") but on different
    responses (diversity).

    ``level="response"`` (the paper's): the samples are ordered by group and dealt to the
    critics like cards, ``K`` at a time, continuing from one group to the next. Within every
    group the critics' counts differ by at most 1 (a group of ``n`` samples gives each critic
    ``n // K`` or ``n // K + 1``), and so do the totals over the batch; every critic gets
    data whenever ``B >= K``. ``level="prompt"``: whole groups go to one critic each, the
    groups dealt the same way (the critics' *group* counts differ by at most 1; their sample
    counts follow the group sizes). Groups may come in any order and have any sizes.

    ``seed=None`` deals deterministically: groups by increasing id, samples of a group in batch
    order, starting at critic 0. An int ``seed`` shuffles the group order and the samples
    within each group and starts at a random critic (a fixed ``torch.Generator``, so the
    same seed gives the same shards); pass e.g. the training step to vary the shards across
    steps. The balance guarantees hold either way.

    Args:
        group_ids: ``[B]`` integer group (prompt) ids, any values, any order.
        num_critics: ``K >= 1``.
        level: ``"response"`` or ``"prompt"``.
        seed: ``None`` or an int (any, e.g. ``base_seed * 7919 + step``).

    Returns:
        ``[B]`` int64 on the device of ``group_ids``; ``critic_shards(...) == m`` selects the
        training samples of critic ``m``.

    >>> gid = torch.tensor([7, 7, 7, 3, 3, 3, 3, 9])
    >>> critic_shards(gid, 2)
    tensor([0, 1, 0, 0, 1, 0, 1, 1])
    >>> critic_shards(gid, 2, level="prompt")
    tensor([1, 1, 1, 0, 0, 0, 0, 0])
    """
    check_group_ids("group_ids", group_ids)
    k = check_int("num_critics", num_critics)
    if k < 1:
        raise ValueError(f"num_critics: must be >= 1, got {num_critics}")
    check_choice("level", level, SHARD_LEVELS)
    if seed is not None:
        check_int("seed", seed)
    device = group_ids.device
    n = group_ids.shape[0]
    if n == 0:
        return torch.zeros(0, dtype=torch.int64, device=device)
    index, num_groups = group_index(group_ids)  # dense 0..G-1 by sorted id
    offset = 0
    within = None  # the order of the samples of a group: batch order, or shuffled
    if seed is not None:
        gen = torch.Generator().manual_seed(int(seed) % 2**64)
        group_perm = torch.randperm(num_groups, generator=gen).to(device)
        within = torch.randperm(n, generator=gen).to(device)
        offset = int(torch.randint(k, (1,), generator=gen))
        index = group_perm[index]
    if level == "prompt":
        return (index + offset) % k
    if within is None:
        order = torch.sort(index, stable=True).indices
    else:
        order = within[torch.sort(index[within], stable=True).indices]
    position = torch.empty_like(order)
    position[order] = torch.arange(n, device=device)
    return (position + offset) % k


# --------------------------------------------------------------------------- ensemble_values


def ensemble_values(
    values: Tensor,  # [K, B, T] float: the value of every critic at every token
    mask: Tensor,  # [B, T] bool
    *,
    unbiased: bool = False,
) -> tuple[Tensor, Tensor]:  # mean [B, T], std [B, T]; 0 where mask is False
    r"""The ensemble value (mean over the critics) and the critics' disagreement (their std).

        V_bar(s_t) = 1/K sum_m V_m(s_t)
        sigma_t    = sqrt( 1/(K - ddof) sum_m (V_m(s_t) - V_bar(s_t))^2 )

    AsyPPO (Liu et al., 2025, arXiv:2510.01656, Sec. 4.1) computes GAE with ``V_bar`` (the mean
    beat the minimum in its ablation, Fig. 9d) and gates the loss with ``sigma_t``
    (:func:`disagreement_masks`). Every critic evaluates *every* sample here; only their
    training data is sharded (:func:`critic_shards`).

    Which std: the population std (``ddof = 0``, numpy's ``np.std``) by default, defined for
    ``K = 1`` (``sigma = 0``); ``unbiased=True`` divides by ``K - 1`` (``torch.std``'s
    default; needs ``K >= 2``). The paper does not say which; it does not matter to AsyPPO,
    whose masks depend only on the *ranking* of ``sigma`` (the two differ by the constant
    factor ``sqrt(K / (K - 1))``, ``sqrt 2`` for the paper's two critics).

    Args:
        values: ``[K, B, T]`` float, ``K >= 1``; entries outside ``mask`` are ignored (may be
            NaN / inf). Half precision is computed in float32.
        mask: ``[B, T]`` bool, on the device of ``values``.
        unbiased: divide by ``K - 1`` instead of ``K``.

    Returns:
        ``(mean, std)``, both ``[B, T]`` in ``values``' dtype promoted to float32, exactly 0
        where ``mask`` is False, and detached: these are baselines and statistics, not
        something to differentiate (the critics train on their own losses).

    >>> v = torch.tensor([[[1.0, 2.0, 9.0]], [[3.0, 2.0, float("nan")]]])  # K=2, B=1, T=3
    >>> mean, std = ensemble_values(v, torch.tensor([[True, True, False]]))
    >>> mean
    tensor([[2., 2., 0.]])
    >>> std
    tensor([[1., 0., 0.]])
    """
    check_ndim("values", values, 3)
    check_float("values", values)
    check_mask("mask", mask)
    check_ndim("mask", mask, 2)
    if tuple(mask.shape) != tuple(values.shape[1:]):
        raise ValueError(
            f"mask: shape {list(mask.shape)} does not match values shape {list(values.shape)} "
            "(expected [B, T] for values [K, B, T])"
        )
    check_same_device("mask", mask, "values", values)
    if not isinstance(unbiased, bool):
        raise InvalidTypeError(f"unbiased: expected a bool, got {type(unbiased).__name__}")
    k = values.shape[0]
    if k == 0:
        raise ValueError(f"values: needs at least one critic (K >= 1), got shape {list(values.shape)}")
    if unbiased and k < 2:
        raise ValueError("unbiased: the unbiased std divides by K - 1 and needs K >= 2 critics, got K = 1")
    with torch.no_grad():
        zero = torch.zeros((), dtype=compute_dtype(values), device=values.device)
        v = torch.where(mask, values.to(zero.dtype), zero)  # [K, B, T], 0 outside the mask
        mean = v.mean(dim=0)
        dev = v - mean
        # scaled two-pass std: no overflow of the squares for large values
        scale = dev.abs().amax(dim=0)
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        std = scale * ((dev / safe).square().sum(dim=0) / (k - int(unbiased))).sqrt()
        if values_readable("values", values) and not bool(torch.isfinite(std.sum() + mean.sum())):
            check_finite_under_mask("values", values, mask.expand_as(values))
    return mean, std


# --------------------------------------------------------------------------- disagreement_masks


def _count(n_valid: Tensor, frac: float) -> Tensor:
    """``floor(frac * n_valid)`` exactly, on the device (``frac`` read as a ratio of ints)."""
    q = Fraction(frac).limit_denominator(_MAX_DENOMINATOR)
    return n_valid * q.numerator // q.denominator


def _kth(sorted_flat: Tensor, pad: float, index: Tensor) -> Tensor:
    """``sorted_flat[index]``, with ``pad`` one past the end (index may equal its length)."""
    padded = torch.cat([sorted_flat, sorted_flat.new_full((1,), pad)])
    return padded[index]


def disagreement_masks(
    std: Tensor,  # [B, T] float >= 0: the inter-critic std (ensemble_values)
    mask: Tensor,  # [B, T] bool: the valid (response) tokens
    *,
    advantage_mask_frac: float = DEFAULT_ADVANTAGE_MASK_FRAC,
    entropy_filter_frac: float = DEFAULT_ENTROPY_FILTER_FRAC,
) -> DisagreementMasks:
    r"""AsyPPO's advantage mask and entropy filter from the critics' disagreement ``sigma``.

    AsyPPO (Liu et al., 2025, arXiv:2510.01656, Sec. 4.2) reshapes the PPO objective with two
    indicators computed over the states (valid tokens) of the batch ``O``:

        I^A_t = 0  if sigma_t in Low_k(sigma(O)),   else 1
        I^H_t = 0  if sigma_t in Top_h(sigma(O)),   else 1
        J(theta) = E 1/|o| sum_t [ I^A_t * min(r_t A_t, clip(r_t, 1-eps, 1+eps) A_t)
                                   + beta * I^H_t * H[pi_theta(.|s_t)] ]

    Where the critics agree (low ``sigma``) the state's future is already well modelled and its
    gradient adds little but overfitting, so its advantage is masked; where they disagree most
    (high ``sigma``) the state is loosely tied to the outcome and an entropy bonus there drives
    spurious exploration, so it is left out of the entropy term.

    ``Low_k`` / ``Top_h`` as implemented (the paper gives no tie or rounding rule): with ``n``
    valid tokens, ``m = floor(k * n)``, and ``s_(0) <= s_(1) <= ...`` the sorted valid ``sigma``,
    a token's advantage is masked iff ``sigma_t < s_(m)`` (the ``m``-th smallest; nothing when
    ``m = 0``, everything when ``m = n``): exactly ``m`` tokens without ties, and tokens tied at
    the boundary are all kept, so never more than ``k * n``. The entropy filter mirrors it from
    the top with ``h``. Hence ``K = 1`` (``sigma = 0`` everywhere, all tied) masks and filters
    nothing for fractions below 1: the loss is plain PPO's. The fractions count the valid tokens of this call: pass the whole
    batch (not one micro-batch) to match the paper's batch-level ranking.

    Use (faithful to the ``1/|o|`` of the objective, whose denominator still counts the masked
    tokens): multiply the advantages by ``advantage_keep`` and zero the entropy bonus outside
    ``entropy_keep``, and aggregate both with the unchanged response ``mask``; ANDing the
    indicators into the aggregation mask instead would also shrink the denominators.

    Args:
        std: ``[B, T]`` float, finite and ``>= 0`` under ``mask`` (ignored outside it).
        mask: ``[B, T]`` bool; an empty mask gives all-False masks and zero metrics.
        advantage_mask_frac: the paper's ``k`` in ``[0, 1]`` (default 0.2, its best value).
        entropy_filter_frac: the paper's ``h`` in ``[0, 1]`` (default 0.2).

    Returns:
        :class:`DisagreementMasks` ``(advantage_keep, entropy_keep, metrics)``.

    >>> std = torch.tensor([[0.1, 0.5, 0.9, 0.3, 0.7], [0.2, 0.4, 0.6, 0.8, 1.0]])
    >>> adv_keep, ent_keep, metrics = disagreement_masks(std, torch.ones(2, 5, dtype=torch.bool))
    >>> adv_keep
    tensor([[False,  True,  True,  True,  True],
            [False,  True,  True,  True,  True]])
    >>> ent_keep
    tensor([[ True,  True, False,  True,  True],
            [ True,  True,  True,  True, False]])
    >>> metrics["advantage_masked_frac"]
    tensor(0.2000)
    """
    check_ndim("std", std, 2)
    check_float("std", std)
    check_mask("mask", mask)
    check_same_shape("mask", mask, "std", std)
    check_in_range("advantage_mask_frac", advantage_mask_frac, 0.0, 1.0)
    check_in_range("entropy_filter_frac", entropy_filter_frac, 0.0, 1.0)
    check_finite_under_mask("std", std, mask)
    if values_readable("std", std) and bool((mask & (std < 0)).any()):
        raise ValueError("std: must be >= 0 under the mask (an inter-critic standard deviation)")
    with torch.no_grad():
        flat = std.detach().reshape(-1)
        valid = mask.reshape(-1)
        n_valid = valid.sum()
        inf = float("inf")
        m_low = _count(n_valid, float(advantage_mask_frac))
        m_high = _count(n_valid, float(entropy_filter_frac))
        ascending = torch.sort(torch.where(valid, flat, flat.new_full((), inf))).values
        descending = torch.sort(torch.where(valid, flat, flat.new_full((), -inf)), descending=True).values
        low = _kth(ascending, inf, m_low)  # the m_low-th smallest valid std (0-based)
        high = _kth(descending, -inf, m_high)  # the m_high-th largest
        advantage_keep = mask & ~(std < low)
        entropy_keep = mask & ~(std > high)
        count = n_valid.clamp(min=1).to(torch.float32)
        zero = torch.zeros((), dtype=torch.float32, device=std.device)
        sel = torch.where(mask, std.detach().to(torch.float32), zero)
        metrics = {
            "advantage_masked_frac": (mask & ~advantage_keep).sum().to(torch.float32) / count,
            "entropy_filtered_frac": (mask & ~entropy_keep).sum().to(torch.float32) / count,
            "value_std_mean": sel.sum() / count,
            "value_std_max": sel.amax() if sel.numel() else zero,
        }
    return DisagreementMasks(advantage_keep, entropy_keep, metrics)


# --------------------------------------------------------------------------- asyppo_advantages


class AsyPPOAdvantages(NamedTuple):
    """What :func:`asyppo_advantages` returns.

    Attributes:
        advantages: ``[B, T]`` GAE advantages on the ensemble value, times ``advantage_keep``
            (0 where the critics agree most and outside ``mask``).
        returns: ``[B, T]`` the critics' regression targets ``A + V_bar`` (of the *unmasked*
            advantages: the mask gates the policy, not the critics), 0 outside ``mask``.
        values: ``[B, T]`` the ensemble value ``V_bar`` (:func:`ensemble_values`).
        std: ``[B, T]`` the inter-critic std ``sigma``.
        advantage_keep: ``[B, T]`` bool, the paper's ``I^A_t`` (:func:`disagreement_masks`).
        entropy_keep: ``[B, T]`` bool, the paper's ``I^H_t``.
        metrics: :func:`disagreement_masks`' metrics.
    """

    advantages: Tensor
    returns: Tensor
    values: Tensor
    std: Tensor
    advantage_keep: Tensor
    entropy_keep: Tensor
    metrics: dict[str, Tensor]


def asyppo_advantages(
    token_rewards: Tensor,  # [B, T] float
    values: Tensor,  # [K, B, T] float: every critic's value at every token
    mask: Tensor,  # [B, T] bool
    *,
    gamma: float = 1.0,
    lam: float = 0.95,
    advantage_mask_frac: float = DEFAULT_ADVANTAGE_MASK_FRAC,
    entropy_filter_frac: float = DEFAULT_ENTROPY_FILTER_FRAC,
    unbiased: bool = False,
) -> AsyPPOAdvantages:
    """AsyPPO's advantages in one call: :func:`ensemble_values`, GAE on the mean, the masks.

        V_bar, sigma = ensemble_values(values, mask)
        A, R         = gae_advantages(token_rewards, V_bar, mask, gamma, lam)
        keep_A, keep_H, metrics = disagreement_masks(sigma, mask, k, h)
        advantages   = A * keep_A

    (Liu et al., 2025, arXiv:2510.01656, Sec. 4.1-4.2; see the three functions for the
    formulas and docs/critics.md for the readings chosen.) ``returns`` are GAE's ``A + V_bar``
    from the unmasked ``A``: the critics regress on every token of their shard. Post-process
    the advantages (whitening, clipping) *before* applying ``advantage_keep`` again, or a
    whitening over ``mask`` shifts the masked zeros to ``-mean / std``. Pass the whole step's
    batch: the masks rank the std over the valid tokens of this call.

    Args:
        token_rewards: ``[B, T]`` per-token rewards (e.g. the score on the last valid token).
        values: ``[K, B, T]`` the critics' values, ``K >= 1`` (``K = 1``: plain GAE, nothing
            masked unless a fraction is 1).
        mask: ``[B, T]`` bool.
        gamma, lam: GAE's discount and lambda (:func:`rollkit.advantages.gae_advantages`).
        advantage_mask_frac, entropy_filter_frac: the paper's ``k`` and ``h``.
        unbiased: the std's divisor ``K - 1`` instead of ``K`` (same masks).

    >>> r = torch.tensor([[0.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
    >>> v = torch.tensor([[[0.2, 0.4, 0.6], [0.5, 0.5, 0.0]], [[0.2, 0.6, 0.8], [0.1, 0.3, 0.0]]])
    >>> m = torch.tensor([[True, True, True], [True, True, False]])
    >>> out = asyppo_advantages(r, v, m, lam=1.0)  # K = 2 critics, 5 valid tokens: mask 1, filter 1
    >>> out.values
    tensor([[0.2000, 0.5000, 0.7000],
            [0.3000, 0.4000, 0.0000]])
    >>> out.advantage_keep  # the lowest std (0.0, where the critics agree)
    tensor([[False,  True,  True],
            [ True,  True, False]])
    >>> out.entropy_keep  # the highest std (0.2)
    tensor([[ True,  True,  True],
            [False,  True, False]])
    >>> round(out.advantages[0, 0].item(), 4), round(out.returns[0, 0].item(), 4)
    (0.0, 1.0)
    """
    mean, std = ensemble_values(values, mask, unbiased=unbiased)
    check_float("token_rewards", token_rewards)
    check_same_shape("token_rewards", token_rewards, "mask", mask)
    adv, returns = gae_advantages(token_rewards, mean.to(token_rewards.dtype), mask, gamma=gamma, lam=lam)
    keep_a, keep_h, metrics = disagreement_masks(
        std, mask, advantage_mask_frac=advantage_mask_frac, entropy_filter_frac=entropy_filter_frac
    )
    advantages = torch.where(keep_a, adv, torch.zeros((), dtype=adv.dtype, device=adv.device))
    return AsyPPOAdvantages(advantages, returns, mean, std, keep_a, keep_h, metrics)


@ADVANTAGE_ESTIMATORS.register(
    "asyppo",
    in_keys={"token_rewards": K.TOKEN_REWARDS, "ensemble_values": K.ENSEMBLE_VALUES, "mask": K.RESPONSE_MASK},
    out_keys=(K.ADVANTAGES, K.RETURNS, K.VALUES, "values_std", K.ADVANTAGE_KEEP, K.ENTROPY_KEEP, "asyppo_metrics"),
)
def asyppo_estimator(
    token_rewards: Tensor,  # [B, T] float
    ensemble_values: Tensor,  # [B, T, C] float: critic c's value at every token
    mask: Tensor,  # [B, T] bool
    *,
    gamma: float = 1.0,
    lam: float = 0.95,
    advantage_mask_frac: float = DEFAULT_ADVANTAGE_MASK_FRAC,
    entropy_filter_frac: float = DEFAULT_ENTROPY_FILTER_FRAC,
    unbiased: bool = False,
) -> AsyPPOAdvantages:
    """The advantage estimator ``"asyppo"``: :func:`asyppo_advantages` over batch-first values.

        asyppo_estimator(r, V, mask, ...) = asyppo_advantages(r, V.movedim(-1, 0), mask, ...)

    with ``V`` ``[B, T, C]`` (the batch key ``ensemble_values``: ``C >= 1`` critics' values;
    every batch key leads with ``B``), so a registry caller reads it by key like every
    estimator. It needs a learned critic ensemble, as ``"gae"`` needs one critic: a trainer
    runs it where an estimator reads ``values`` or ``ensemble_values``
    (``trainers.config.critic_needed``). Liu et al., 2025, arXiv:2510.01656.

    Args:
        token_rewards: ``[B, T]`` per-token rewards.
        ensemble_values: ``[B, T, C]`` float.
        mask: ``[B, T]`` bool.
        gamma, lam, advantage_mask_frac, entropy_filter_frac, unbiased: as
            :func:`asyppo_advantages`.

    Returns:
        :class:`AsyPPOAdvantages` (out keys ``advantages``, ``returns``, ``values``,
        ``values_std``, ``advantage_keep``, ``entropy_keep``, ``asyppo_metrics``).

    >>> r = torch.tensor([[0.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
    >>> v = torch.tensor([[[0.2, 0.4, 0.6], [0.5, 0.5, 0.0]], [[0.2, 0.6, 0.8], [0.1, 0.3, 0.0]]])
    >>> m = torch.tensor([[True, True, True], [True, True, False]])
    >>> out = ADVANTAGE_ESTIMATORS.entry("asyppo").call(
    ...     {"token_rewards": r, "ensemble_values": v.movedim(0, -1), "response_mask": m}, lam=1.0)
    >>> torch.equal(out.advantages, asyppo_advantages(r, v, m, lam=1.0).advantages)
    True
    """
    check_ndim("ensemble_values", ensemble_values, 3)
    check_same_device("ensemble_values", ensemble_values, "mask", mask)
    check_same_device("token_rewards", token_rewards, "mask", mask)
    for name, x in (("ensemble_values", ensemble_values), ("token_rewards", token_rewards), ("mask", mask)):
        if x.is_meta:  # the disagreement masks rank the critics' std: they read values
            raise ValueError(
                f"{name}: is on the meta device; asyppo's disagreement masks rank the critics' values, "
                "so there is no shape-only run"
            )
    return asyppo_advantages(
        token_rewards,
        ensemble_values.movedim(-1, 0),
        mask,
        gamma=gamma,
        lam=lam,
        advantage_mask_frac=advantage_mask_frac,
        entropy_filter_frac=entropy_filter_frac,
        unbiased=unbiased,
    )
