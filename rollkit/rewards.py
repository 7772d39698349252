"""Reward shaping: normalisation, clipping, DAPO overlong punishment and truncation masking.

Every function here is pure (inputs are never modified) and vectorised; the one stateful
object, :class:`RunningRewardNormalizer`, keeps its statistics explicitly (``count``, ``mean``,
``m2`` in float64) and checkpoints them with ``state_dict`` / ``load_state_dict``.

Conventions (see ``docs/rewards.md``):

* Standardisation is ``(r - mean) / (std + eps)`` with ``eps = 1e-6`` (the GRPO convention of
  verl / TRL), the *unbiased* (``n - 1``) std by default.
* A degenerate set (a singleton, or all rewards equal) standardises to exactly ``0`` (plus the
  mean when ``shift_mean=False``): it carries no relative signal. This is GRPO's convention for
  zero-variance groups; verl instead gives a singleton group its raw reward.
* NaN / inf rewards raise ``ValueError`` (switch value checks off with
  :func:`rollkit.validation.value_checks`).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from rollkit import keys
from rollkit.ops import _group_normalize, _segment_mean, group_index
from rollkit.registry import REWARD_TRANSFORMS
from rollkit.validation import (
    check_choice,
    check_finite_float,
    check_finite_under_mask,
    check_float,
    check_group_ids,
    check_int,
    check_int_tensor,
    check_mask,
    check_ndim,
    check_positive,
    check_same_device,
    check_same_shape,
    check_scalar,
    values_readable,
)

__all__ = [
    "RunningRewardNormalizer",
    "clip_advantages",
    "clip_rewards",
    "mask_truncated",
    "normalize_rewards",
    "overlong_penalty",
    "token_level_rewards",
]

# --------------------------------------------------------------------------- normalisation


@REWARD_TRANSFORMS.register(
    "normalize",
    aliases=("normalize_rewards", "reward_norm"),
    in_keys={"rewards": keys.REWARDS, "group_ids": keys.GROUP_IDS},
    out_keys=[keys.REWARDS],
)
def normalize_rewards(
    rewards: Tensor,  # [B] float
    group_ids: Tensor | None = None,  # [B] int, required for level="group"
    *,
    level: str = "batch",
    unbiased_std: bool = True,
    eps: float = 1e-6,
    shift_mean: bool = True,
) -> Tensor:  # [B], dtype of rewards
    r"""Standardise rewards over the whole batch or within each group.

    .. math::

        \tilde r_i = \frac{r_i - \mu_{S(i)}}{\sigma_{S(i)} + \epsilon}
        \quad(\text{shift\_mean=True}),\qquad
        \tilde r_i = \frac{r_i - \mu_{S(i)}}{\sigma_{S(i)} + \epsilon} + \mu_{S(i)}
        \quad(\text{shift\_mean=False})

    where :math:`S(i)` is the whole batch (``level="batch"``) or the group of sample ``i``
    (``level="group"``), :math:`\mu` its mean and :math:`\sigma` its standard deviation
    (``n - 1`` divisor if ``unbiased_std``, else ``n``). Statistics are computed in float64,
    with :func:`rollkit.ops.group_normalize` (one group for ``level="batch"``).

    ``level="group"`` is the GRPO outcome normalisation (Shao et al., 2024, DeepSeekMath,
    arXiv:2402.03300); ``level="batch"`` is the global reward whitening of REINFORCE++ (Hu,
    2025, arXiv:2501.03262) and of PPO reward scaling. Unlike
    :func:`rollkit.ops.masked_whiten` (``/ sqrt(var + eps)``) the epsilon is added to the std,
    as verl and TRL do for GRPO.

    Degenerate sets: a singleton set, or a set whose rewards are all equal (``max == min``),
    gives exactly ``0`` (``shift_mean=True``) or its mean (``shift_mean=False``). verl gives a
    singleton group mean 0 / std 1 (i.e. the raw reward); rollkit does not.

    Args:
        rewards: ``[B]`` float sequence rewards (finite).
        group_ids: ``[B]`` int group ids (any values, any order); required iff
            ``level="group"``, ignored (may be None) for ``level="batch"``.
        level: ``"batch"`` or ``"group"``.
        unbiased_std: Bessel-corrected std (default, like ``torch.std``) or population std.
        eps: added to the std, ``>= 0``.
        shift_mean: subtract the mean (True) or keep it (False: only rescale the spread).

    Returns:
        ``[B]`` tensor of the dtype of ``rewards``; a new tensor (the input is not modified).

    >>> r = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 5.0])
    >>> g = torch.tensor([0, 0, 1, 1, 2, 3])
    >>> normalize_rewards(r, g, level="group", unbiased_std=False, eps=0.0)
    tensor([ 1., -1.,  1., -1.,  0.,  0.])
    >>> torch.allclose(normalize_rewards(torch.tensor([1.0, 2.0, 3.0]), eps=0.0), torch.tensor([-1.0, 0.0, 1.0]))
    True
    """
    check_finite_float("rewards", rewards, ndim=1)
    check_choice("level", level, ("batch", "group"))
    check_positive("eps", check_scalar("eps", eps), allow_zero=True)
    n_samples = rewards.shape[0]
    if level == "group":
        if group_ids is None:
            raise ValueError('group_ids: required when level="group"')
        check_group_ids("group_ids", group_ids, n_samples)
        check_same_device("group_ids", group_ids, "rewards", rewards)
        index, num_groups = group_index(group_ids)
    else:
        if group_ids is not None:
            check_group_ids("group_ids", group_ids, n_samples)
            check_same_device("group_ids", group_ids, "rewards", rewards)
        index = torch.zeros(n_samples, dtype=torch.long, device=rewards.device)
        num_groups = 1 if n_samples > 0 else 0
    x = rewards.to(torch.float64)
    y = _group_normalize(x, index, num_groups, scale=True, unbiased=unbiased_std, eps=eps)
    if not shift_mean:
        y = y + _segment_mean(x, index, num_groups).index_select(0, index)
    return y.to(rewards.dtype)


class RunningRewardNormalizer:
    r"""Standardise rewards with running statistics over every reward seen so far.

    State: ``count`` (int), ``mean`` and ``m2`` (sum of squared deviations), all float64,
    merged batch by batch with the exact parallel update of Chan, Golub & LeVeque (1979):

    .. math::

        n = n_a + n_b,\quad \delta = \bar x_b - \bar x_a,\quad
        \bar x = \bar x_a + \delta\, n_b / n,\quad
        M_2 = M_{2,a} + M_{2,b} + \delta^2\, n_a n_b / n

    so that any split of the same rewards into batches gives the same statistics (up to float64
    rounding) as one big batch. ``normalize`` computes

    .. math::

        \tilde r = \operatorname{clip}\Big(\frac{r - \bar x}{\sigma + \epsilon}, -c, c\Big),
        \qquad \sigma = \sqrt{M_2 / (n - 1)} \text{ (unbiased) or } \sqrt{M_2 / n}

    (``+ mean`` when ``shift_mean=False``; no clip when ``clip=None``). This is the running
    normalisation of PPO implementations (Engstrom et al., 2020, arXiv:2005.12729; baselines'
    ``RunningMeanStd`` uses the same merge) and of TRL's ``RunningMoments``, as opposed to
    :func:`normalize_rewards`, which only uses the current batch.

    Edge cases: before any reward is seen (``count == 0``) ``normalize(..., update=False)``
    raises ``ValueError``. With zero running variance (``count == 1`` or all rewards seen so
    far equal) the scaled part is exactly ``0`` (like GRPO's degenerate groups). Updating with
    an empty tensor is a no-op.

    Args:
        unbiased_std: divide ``M2`` by ``n - 1`` (default) or ``n``.
        eps: added to the std, ``>= 0``.
        shift_mean: subtract the running mean (default) or only rescale.
        clip: clamp the normalised rewards to ``[-clip, clip]`` (``None``: no clip).

    >>> norm = RunningRewardNormalizer(unbiased_std=False, eps=0.0)
    >>> norm.update(torch.tensor([0.0, 2.0]))
    >>> norm.normalize(torch.tensor([4.0, 1.0]), update=False)
    tensor([3., 0.])
    >>> norm.state_dict()["count"], norm.state_dict()["mean"]
    (tensor(2), tensor(1., dtype=torch.float64))
    """

    def __init__(
        self,
        *,
        unbiased_std: bool = True,
        eps: float = 1e-6,
        shift_mean: bool = True,
        clip: float | None = None,
    ) -> None:
        check_positive("eps", check_scalar("eps", eps), allow_zero=True)
        if clip is not None:
            check_positive("clip", check_scalar("clip", clip))
        self.unbiased_std = bool(unbiased_std)
        self.eps = float(eps)
        self.shift_mean = bool(shift_mean)
        self.clip = None if clip is None else float(clip)
        self.count = torch.zeros((), dtype=torch.int64)
        self.mean = torch.zeros((), dtype=torch.float64)
        self.m2 = torch.zeros((), dtype=torch.float64)

    # -- statistics
    @property
    def var(self) -> Tensor:
        """Running variance (float64 scalar); 0 while fewer than 2 (unbiased) / 1 rewards seen."""
        n = self.count.to(torch.float64)
        denom = (n - 1.0) if self.unbiased_std else n
        return torch.where(denom > 0, self.m2 / denom.clamp(min=1.0), torch.zeros_like(self.m2))

    @property
    def std(self) -> Tensor:
        """Running standard deviation, ``sqrt(var)``."""
        return self.var.sqrt()

    def update(self, rewards: Tensor) -> None:
        """Merge the rewards of a batch (any shape, every entry counts) into the statistics.
        ``meta`` tensors are refused by name (the statistics are values)."""
        check_finite_float("rewards", rewards)
        if rewards.is_meta:
            raise ValueError("rewards: is on the meta device; running statistics need values")
        n_b = rewards.numel()
        if n_b == 0:
            return
        # batch statistics on the batch's device; only the two float64 scalars move to the CPU
        x = rewards.detach().reshape(-1)
        x = x.to(torch.float64) if x.device.type != "mps" else x.to(torch.float32)
        mean_b = x.mean()
        m2_b = (x - mean_b).square().sum()
        stats = torch.stack([mean_b, m2_b]).to(device="cpu", dtype=torch.float64)  # one transfer
        mean_b, m2_b = stats[0], stats[1]
        n_a = self.count.to(torch.float64)
        n = n_a + n_b
        delta = mean_b - self.mean
        self.mean = self.mean + delta * (n_b / n)
        self.m2 = self.m2 + m2_b + delta.square() * (n_a * n_b / n)
        self.count = self.count + n_b

    def normalize(self, rewards: Tensor, *, update: bool = True) -> Tensor:
        """Normalise ``rewards`` (any shape) with the running statistics.

        With ``update=True`` (default) the batch is merged into the statistics first, then
        normalised with them (the convention of baselines ``VecNormalize``). Returns a new
        tensor of the shape, dtype and device of ``rewards``.
        """
        check_finite_float("rewards", rewards)
        if update:
            self.update(rewards)
        if int(self.count) == 0:
            raise ValueError("rewards: the normalizer has seen no rewards yet; call update() first")
        mean = self.mean.to(rewards.device)
        std = self.std.to(rewards.device)
        if float(self.m2) > 0:
            scale = 1.0 / (std + self.eps)
        else:
            scale = torch.zeros_like(std)
        x = rewards.detach().to(torch.float64)
        y = (x - mean) * scale
        if self.clip is not None:
            y = y.clamp(-self.clip, self.clip)
        if not self.shift_mean:
            y = y + mean
        return y.to(rewards.dtype)

    # -- checkpointing
    def state_dict(self) -> dict[str, Tensor]:
        """``{"count": int64, "mean": float64, "m2": float64}`` 0-dim tensors (copies)."""
        return {"count": self.count.clone(), "mean": self.mean.clone(), "m2": self.m2.clone()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the statistics saved by :meth:`state_dict` (exactly)."""
        missing = {"count", "mean", "m2"} - set(state_dict)
        if missing:
            raise ValueError(f"state_dict: missing keys {sorted(missing)}")
        count = torch.as_tensor(state_dict["count"]).detach().to("cpu")
        if count.is_floating_point() or count.numel() != 1 or int(count) < 0:
            raise ValueError(f"state_dict: 'count' must be a non-negative integer, got {count}")
        mean = torch.as_tensor(state_dict["mean"], dtype=torch.float64).detach().to("cpu").reshape(())
        m2 = torch.as_tensor(state_dict["m2"], dtype=torch.float64).detach().to("cpu").reshape(())
        if not (math.isfinite(float(mean)) and math.isfinite(float(m2))) or float(m2) < 0:
            raise ValueError(f"state_dict: 'mean' must be finite and 'm2' finite and >= 0, got {mean}, {m2}")
        self.count = count.to(torch.int64).reshape(()).clone()
        self.mean = mean.clone()
        self.m2 = m2.clone()

    def __repr__(self) -> str:
        return (
            f"RunningRewardNormalizer(count={int(self.count)}, mean={float(self.mean):.6g}, "
            f"std={float(self.std):.6g}, clip={self.clip})"
        )


# --------------------------------------------------------------------------- clipping


@REWARD_TRANSFORMS.register(
    "clip",
    aliases=("clip_rewards",),
    in_keys={"rewards": keys.REWARDS},
    out_keys=[keys.REWARDS],
)
def clip_rewards(
    rewards: Tensor,  # [B] (or any shape) float
    *,
    low: float,
    high: float,
) -> Tensor:  # same shape and dtype
    r"""Clamp rewards to ``[low, high]``: :math:`\tilde r = \min(\max(r, l), h)`.

    The reward clipping of PPO for LLMs (e.g. OpenRLHF ``--reward_clip_range``; Zheng et al.,
    2023, "Secrets of RLHF in LLMs Part I", arXiv:2307.04964). Unlike :func:`clip_advantages`
    the bounds may be asymmetric. ``low == high`` is allowed (constant output). NaN rewards
    raise; ``low``/``high`` may be ``+-inf`` (one-sided clip).

    >>> clip_rewards(torch.tensor([-3.0, 0.5, 9.0]), low=-1.0, high=2.0)
    tensor([-1.0000,  0.5000,  2.0000])
    """
    check_finite_float("rewards", rewards)
    low = check_scalar("low", low)
    high = check_scalar("high", high)
    if low > high:
        raise ValueError(f"low: must be <= high, got low={low} > high={high}")
    return rewards.clamp(min=low, max=high)


@REWARD_TRANSFORMS.register(
    "clip_advantages",
    in_keys={"advantages": keys.ADVANTAGES},
    out_keys=[keys.ADVANTAGES],
)
def clip_advantages(
    advantages: Tensor,  # [B] or [B, T] float
    *,
    max_abs: float,
) -> Tensor:  # same shape and dtype
    r"""Clamp advantages symmetrically: :math:`\tilde A = \min(\max(A, -c), c)`, ``c = max_abs``.

    Symmetric advantage clipping as in OpenRLHF's ``advantages.clamp(-c, c)`` option (and the
    "advantage clipping" of Zheng et al., 2023, arXiv:2307.04964). Zero-padded positions stay
    zero. ``max_abs`` must be ``> 0`` (``inf`` disables clipping).

    >>> clip_advantages(torch.tensor([[-5.0, 0.3], [2.0, 0.0]]), max_abs=1.0)
    tensor([[-1.0000,  0.3000],
            [ 1.0000,  0.0000]])
    """
    check_finite_float("advantages", advantages)
    max_abs = check_scalar("max_abs", max_abs)
    check_positive("max_abs", max_abs)
    return advantages.clamp(min=-max_abs, max=max_abs)


# --------------------------------------------------------------------------- DAPO overlong


@REWARD_TRANSFORMS.register(
    "overlong_penalty",
    aliases=("dapo_overlong", "soft_overlong_punishment"),
    in_keys={"lengths": keys.RESPONSE_LENGTH},
    out_keys=[keys.OVERLONG_PENALTY],
)
def overlong_penalty(
    lengths: Tensor,  # [B] int, number of generated tokens
    *,
    max_length: int,
    cache_length: int,
    penalty_factor: float = 1.0,
    dtype: torch.dtype | None = None,
) -> Tensor:  # [B] float (<= 0)
    r"""DAPO soft overlong punishment (Yu et al., 2025, arXiv:2503.14476, "Overlong Reward Shaping").

    With :math:`L_{\max}` = ``max_length``, :math:`L_c` = ``cache_length``, factor :math:`k`:

    .. math::

        R(L) = \begin{cases}
          0 & L \le L_{\max} - L_c \\
          k\,\dfrac{(L_{\max} - L_c) - L}{L_c} & L_{\max} - L_c < L \le L_{\max} \\
          -k & L > L_{\max}
        \end{cases}

    The penalty is *added* to the task reward (``rewards + overlong_penalty(...)``); it is
    continuous, linear in the soft window and reaches ``-k`` at ``L = L_max``. ``cache_length=0``
    gives a hard step (0 up to ``L_max``, ``-k`` above). verl's ``overlong_buffer`` computes
    ``min(-(L - (L_max - L_c)) / L_c * k, 0)`` without the ``-k`` floor (its responses
    cannot exceed ``L_max``); here lengths above ``L_max`` are floored at ``-k``.
    Compare :func:`mask_truncated` (DAPO's overlong *filtering*, which drops the tokens instead).

    Args:
        lengths: ``[B]`` integer response lengths, ``>= 0``.
        max_length: :math:`L_{\max} > 0`.
        cache_length: :math:`L_c`, ``0 <= cache_length <= max_length``.
        penalty_factor: :math:`k >= 0`.
        dtype: output float dtype (default: ``torch.get_default_dtype()``).

    >>> overlong_penalty(torch.tensor([10, 16, 18, 20, 25]), max_length=20, cache_length=4)
    tensor([ 0.0000,  0.0000, -0.5000, -1.0000, -1.0000])
    """
    check_ndim("lengths", lengths, 1)
    check_int_tensor("lengths", lengths)
    if lengths.numel() > 0 and values_readable("lengths", lengths) and int(lengths.min()) < 0:
        raise ValueError(f"lengths: must be >= 0, got min {int(lengths.min())}")
    max_length = check_int("max_length", max_length)
    cache_length = check_int("cache_length", cache_length)
    check_positive("max_length", max_length)
    check_positive("cache_length", cache_length, allow_zero=True)
    if cache_length > max_length:
        raise ValueError(f"cache_length: must be <= max_length ({max_length}), got {cache_length}")
    penalty_factor = check_scalar("penalty_factor", penalty_factor)
    check_positive("penalty_factor", penalty_factor, allow_zero=True)
    out_dtype = dtype or torch.get_default_dtype()
    expected = max_length - cache_length
    over = (lengths - expected).to(torch.float64)
    if cache_length > 0:
        soft = -over / cache_length * penalty_factor
    else:
        soft = torch.full_like(over, -penalty_factor)
    pen = torch.where(lengths <= expected, torch.zeros_like(over), soft)
    pen = torch.where(lengths > max_length, torch.full_like(over, -penalty_factor), pen)
    return pen.to(out_dtype)


@REWARD_TRANSFORMS.register(
    "mask_truncated",
    aliases=("overlong_filter",),
    in_keys={"mask": keys.RESPONSE_MASK, "truncated": keys.TRUNCATED},
    out_keys=[keys.RESPONSE_MASK],
)
def mask_truncated(
    mask: Tensor,  # [B, T] bool response mask
    truncated: Tensor,  # [B] bool, True where generation hit the length limit
) -> Tensor:  # [B, T] bool, a new tensor
    r"""DAPO overlong filtering (Yu et al., 2025, arXiv:2503.14476): drop truncated samples' tokens.

    .. math::  m'_{i,t} = m_{i,t} \wedge \lnot \mathrm{truncated}_i

    Truncated responses get no loss (their reward is noise: a correct-but-unfinished answer is
    scored as wrong). The samples stay in the batch, so token-mean aggregation normalises over
    the remaining tokens only. Unlike :func:`overlong_penalty` this changes the mask, not the
    reward. A fully masked row is a valid result; the aggregator owns the empty-mask policy.

    >>> m = torch.tensor([[True, True], [True, False]])
    >>> mask_truncated(m, torch.tensor([True, False]))
    tensor([[False, False],
            [ True, False]])
    """
    check_ndim("mask", mask, 2)
    check_mask("mask", mask)
    check_ndim("truncated", truncated, 1)
    check_mask("truncated", truncated)
    if truncated.shape[0] != mask.shape[0]:
        raise ValueError(f"truncated: has {truncated.shape[0]} entries but mask has {mask.shape[0]} rows")
    check_same_device("truncated", truncated, "mask", mask)
    return mask & ~truncated.unsqueeze(-1)


def token_level_rewards(
    scores: Tensor,  # [B] sequence rewards
    mask: Tensor,  # [B, T] bool response mask
    *,
    kl: Tensor | None = None,  # [B, T] per-token KL estimate
    kl_coef: float = 0.0,
) -> Tensor:  # [B, T] float, 0 where mask is False
    r"""Per-token rewards of a critic (PPO with GAE): the sequence reward on the last response
    token, minus a KL penalty on every token.

    .. math::  r_{b,t} = -\beta \, \mathrm{KL}_{b,t} + [t = \mathrm{last}_b] \, R_b

    where ``last_b`` is row ``b``'s last valid token (masked tokens inside a response, e.g. a
    tool's output, are skipped; InstructGPT's reward, Ouyang et al., 2022,
    arXiv:2203.02155; verl's ``apply_kl_penalty`` and OpenRLHF's ``compute_reward`` build the same
    tensor). A row without valid tokens is all 0 (its score is dropped). Feed the result to
    :func:`rollkit.advantages.gae_advantages`.

    Args:
        scores: ``[B]`` float sequence rewards (after any normalisation or clipping), finite.
        mask: ``[B, T]`` bool.
        kl: optional ``[B, T]`` float KL estimate on ``mask``'s device (required when
            ``kl_coef > 0``), finite under ``mask`` (values outside it are ignored). Whenever it
            is given it is checked, also with ``kl_coef = 0`` (where it does not enter the
            result): a list, an integer tensor, another shape or device, or NaN / ``+-inf`` at a
            valid token raise naming ``kl`` (the finiteness check, as that of ``scores``, is
            skipped inside ``rollkit.validation.value_checks(False)``).
        kl_coef: ``beta >= 0``.

    >>> m = torch.tensor([[True, True, False], [True, True, True]])
    >>> token_level_rewards(torch.tensor([1.0, 0.5]), m)
    tensor([[0.0000, 1.0000, 0.0000],
            [0.0000, 0.0000, 0.5000]])
    >>> token_level_rewards(torch.tensor([1.0, 0.5]), m, kl=torch.full((2, 3), 0.1), kl_coef=0.5)
    tensor([[-0.0500,  0.9500,  0.0000],
            [-0.0500, -0.0500,  0.4500]])
    """
    check_ndim("scores", scores, 1)
    check_ndim("mask", mask, 2)
    check_mask("mask", mask)
    if scores.shape[0] != mask.shape[0]:
        raise ValueError(f"scores: has {scores.shape[0]} entries but mask has {mask.shape[0]} rows")
    check_same_device("scores", scores, "mask", mask)
    check_float("scores", scores)
    check_positive("kl_coef", kl_coef, allow_zero=True)
    if kl is None:
        if kl_coef > 0:
            raise ValueError("kl: required when kl_coef > 0")
    else:
        check_float("kl", kl)
        check_same_shape("kl", kl, "mask", mask)  # and its device
    check_finite_float("scores", scores)
    if kl is not None:
        check_finite_under_mask("kl", kl, mask)
    pos = torch.arange(mask.shape[1], device=mask.device)
    last = torch.where(mask, pos, -1).amax(-1, keepdim=True) if mask.shape[1] else None
    out = torch.zeros(mask.shape, dtype=scores.dtype, device=mask.device)
    if last is not None:  # the score where the position is the row's last valid one
        out = torch.where(pos == last, scores[:, None].expand_as(out), out)
    if kl is not None and kl_coef > 0:
        out = out - kl_coef * torch.where(mask, kl.to(out.dtype), torch.zeros_like(out))
    return torch.where(mask, out, torch.zeros_like(out))
