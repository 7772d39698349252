"""Dynamic-sampling filters: pure functions that return a keep-mask ``[B]`` bool.

A filter never drops data itself: it returns ``keep`` (True = keep the sample) and the caller
selects (``batch[keep]``), re-samples to refill the batch (DAPO dynamic sampling), or logs.
Combine filters with :func:`combine_keep` (logical AND) and report what was kept with
:func:`filter_metrics`.

Group filters (:func:`zero_variance_filter`, :func:`accuracy_band_filter`) keep or drop a
group as a whole and take arbitrary ``group_ids`` (any values, any order, singletons).
Per-sample filters (:func:`length_filter`, :func:`staleness_filter`) decide each sample alone.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from rollkit import keys
from rollkit.ops import _segment_max, _segment_mean, _segment_min, _segment_sum, group_index
from rollkit.registry import FILTERS
from rollkit.validation import (
    check_choice,
    check_finite,
    check_finite_float,
    check_group_ids,
    check_int,
    check_int_tensor,
    check_mask,
    check_ndim,
    check_positive,
    check_same_device,
    check_scalar,
    values_readable,
)

__all__ = [
    "accuracy_band_filter",
    "combine_keep",
    "filter_metrics",
    "length_filter",
    "staleness_filter",
    "zero_variance_filter",
]


@FILTERS.register(
    "zero_variance",
    aliases=("dapo", "dynamic_sampling", "zero_variance_filter"),
    in_keys={"rewards": keys.REWARDS, "group_ids": keys.GROUP_IDS},
    out_keys=[keys.KEEP],
)
def zero_variance_filter(
    rewards: Tensor,  # [B] float
    group_ids: Tensor,  # [B] int
    *,
    atol: float = 1e-6,
) -> Tensor:  # [B] bool keep-mask
    r"""DAPO dynamic sampling (Yu et al., 2025, arXiv:2503.14476): drop groups with no reward spread.

    .. math::  \mathrm{keep}_i = \big(\max_{j \in g(i)} r_j - \min_{j \in g(i)} r_j > \mathrm{atol}\big)

    A group whose rewards are all equal (all correct / all wrong with 0/1 rewards) has zero
    GRPO advantage, so it contributes no gradient and only dilutes the batch. rollkit tests the
    *range* ``max - min`` against ``atol`` (not ``std > 0``): it is exactly invariant to the std
    bias convention and to group size, and needs no square root. For a group of ``n`` samples
    ``std <= range`` and ``range <= 2 * sqrt(n) * std``, so ``range > atol`` is an ``atol`` test
    on the spread. **Singleton groups are dropped** (a single sample has no variance and a zero
    group-relative advantage); verl's DAPO recipe keeps them (``std > 0 or len == 1``).
    ROLL's ``std_filter`` drops groups with ``std < std_threshold``.
    Compare :func:`accuracy_band_filter`, which filters on the group *mean*.

    Args:
        rewards: ``[B]`` finite float rewards (NaN/inf raise).
        group_ids: ``[B]`` int group ids.
        atol: tolerance ``>= 0``; ``atol=0`` keeps any group with two distinct rewards.

    Returns:
        ``[B]`` bool; every member of a group gets the same value.

    >>> r = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5])
    >>> zero_variance_filter(r, torch.tensor([7, 7, 3, 3, 9]))
    tensor([False, False,  True,  True, False])
    """
    check_finite_float("rewards", rewards, ndim=1)
    check_group_ids("group_ids", group_ids, rewards.shape[0])
    check_same_device("group_ids", group_ids, "rewards", rewards)
    atol = check_scalar("atol", atol)
    check_positive("atol", atol, allow_zero=True)
    index, num_groups = group_index(group_ids)
    r64 = rewards.to(torch.float64)
    spread = _segment_max(r64, index, num_groups) - _segment_min(r64, index, num_groups)
    return (spread > atol).index_select(0, index)


@FILTERS.register(
    "accuracy_band",
    aliases=("difficulty", "accuracy_band_filter", "pass_rate"),
    in_keys={"accuracy": keys.ACCURACY, "group_ids": keys.GROUP_IDS},
    out_keys=[keys.KEEP],
)
def accuracy_band_filter(
    accuracy: Tensor,  # [B] float in [0, 1] (or bool / int 0/1)
    group_ids: Tensor,  # [B] int
    *,
    low: float = 0.0,
    high: float = 1.0,
    inclusive: str = "neither",
) -> Tensor:  # [B] bool keep-mask
    r"""Difficulty band-pass on each group's mean accuracy (pass rate).

    .. math::

        p_g = \frac{1}{|g|}\sum_{j \in g} a_j,\qquad
        \mathrm{keep}_i = \big(\mathrm{low} \;\lessdot\; p_{g(i)} \;\lessdot\; \mathrm{high}\big)

    where each :math:`\lessdot` is ``<=`` or ``<`` according to ``inclusive`` (``"both"``,
    ``"neither"``, ``"left"``, ``"right"``, like ``pandas.Series.between``). The defaults
    (``low=0, high=1, inclusive="neither"``) keep ``0 < p < 1``: they drop the all-wrong and
    all-correct groups, which for 0/1 accuracies is the DAPO zero-variance rule (Yu et al., 2025,
    arXiv:2503.14476). Narrower bands (e.g. ``low=0.2, high=0.8, inclusive="both"``) are the
    online difficulty filters of PRIME (Cui et al., 2025, arXiv:2502.01456) and Polaris (2025);
    OpenRLHF's ``--dynamic_filtering`` keeps ``min < mean < max`` (``inclusive="neither"``). Unlike :func:`zero_variance_filter` this tests the *mean*, so a
    group of non-binary scores ``[0.5, 0.5]`` is kept by the default band.

    Means are computed in float64; a singleton group's mean is its own accuracy (no special
    case). Note that a pass rate like ``1/3`` is not exactly representable: put band edges
    between attainable pass rates (``k / n``) to avoid tie-breaking by rounding.

    Args:
        accuracy: ``[B]`` values in ``[0, 1]`` (bool or int 0/1 accepted); others raise.
        group_ids: ``[B]`` int group ids.
        low, high: band edges, ``0 <= low <= high <= 1``.
        inclusive: which edges are included.

    >>> acc = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0])
    >>> accuracy_band_filter(acc, torch.tensor([0, 0, 1, 1, 2, 2]))
    tensor([False, False,  True,  True, False, False])
    """
    check_ndim("accuracy", accuracy, 1)
    if accuracy.is_complex():
        raise ValueError(f"accuracy: expected a real tensor, got dtype {accuracy.dtype}")
    check_group_ids("group_ids", group_ids, accuracy.shape[0])
    check_same_device("group_ids", group_ids, "accuracy", accuracy)
    check_choice("inclusive", inclusive, ("both", "neither", "left", "right"))
    low = check_scalar("low", low)
    high = check_scalar("high", high)
    if not (0.0 <= low <= high <= 1.0):
        raise ValueError(f"low, high: must satisfy 0 <= low <= high <= 1, got low={low}, high={high}")
    acc = accuracy.to(torch.float64)
    if acc.numel() > 0 and values_readable("accuracy", acc):
        check_finite("accuracy", acc)
        if bool(((acc < 0) | (acc > 1)).any()):
            raise ValueError(
                f"accuracy: values must be in [0, 1], got min {float(acc.min())}, max {float(acc.max())}"
            )
    index, num_groups = group_index(group_ids)
    p = _segment_mean(acc, index, num_groups)
    above = p >= low if inclusive in ("both", "left") else p > low
    below = p <= high if inclusive in ("both", "right") else p < high
    return (above & below).index_select(0, index)


@FILTERS.register(
    "length",
    aliases=("length_filter",),
    in_keys={"lengths": keys.RESPONSE_LENGTH},
    out_keys=[keys.KEEP],
)
def length_filter(
    lengths: Tensor,  # [B] int
    *,
    min_length: int | None = None,
    max_length: int | None = None,
) -> Tensor:  # [B] bool keep-mask
    r"""Keep samples whose length lies in ``[min_length, max_length]`` (both inclusive).

    .. math::  \mathrm{keep}_i = (L_{\min} \le L_i \le L_{\max})

    ``None`` leaves a side open (both ``None``: keep everything). A per-sample filter: unlike
    the group filters, members of one group may be split. To remove the tokens of truncated
    samples but keep them in the batch, use :func:`rollkit.rewards.mask_truncated`; to
    penalise length, :func:`rollkit.rewards.overlong_penalty`.

    >>> length_filter(torch.tensor([0, 5, 10, 11]), min_length=1, max_length=10)
    tensor([False,  True,  True, False])
    """
    check_ndim("lengths", lengths, 1)
    check_int_tensor("lengths", lengths)
    min_length = None if min_length is None else check_int("min_length", min_length)
    max_length = None if max_length is None else check_int("max_length", max_length)
    if min_length is not None and max_length is not None and min_length > max_length:
        raise ValueError(f"min_length: must be <= max_length, got {min_length} > {max_length}")
    keep = torch.ones(lengths.shape, dtype=torch.bool, device=lengths.device)
    if min_length is not None:
        keep = keep & (lengths >= min_length)
    if max_length is not None:
        keep = keep & (lengths <= max_length)
    return keep


@FILTERS.register(
    "staleness",
    aliases=("staleness_filter", "freshness"),
    in_keys={"policy_version": keys.POLICY_VERSION},
    out_keys=[keys.KEEP],
)
def staleness_filter(
    policy_version: Tensor,  # [B] int
    *,
    current_version: int,
    max_staleness: float,
) -> Tensor:  # [B] bool keep-mask
    r"""Asynchronous-RL freshness filter: keep samples at most ``max_staleness`` versions old.

    .. math::  \mathrm{keep}_i = (v_{\mathrm{cur}} - v_i \le \eta)

    With ``max_staleness = 0`` only on-policy samples survive; ``inf`` keeps all. This is the
    staleness bound ``eta`` of AReaL (Fu et al., 2025, arXiv:2505.24298), applied as a filter
    rather than as a throttle on the rollout workers. A sample with ``v_i > current_version``
    (from the future) means the versions are out of sync and raises ``ValueError``.

    Args:
        policy_version: ``[B]`` int weights version that generated each sample.
        current_version: version of the policy being trained.
        max_staleness: ``>= 0`` (float, so ``math.inf`` works).

    >>> staleness_filter(torch.tensor([5, 4, 2, 3]), current_version=5, max_staleness=2)
    tensor([ True,  True, False,  True])
    """
    check_ndim("policy_version", policy_version, 1)
    check_int_tensor("policy_version", policy_version)
    current_version = check_int("current_version", current_version)
    max_staleness = check_scalar("max_staleness", max_staleness)
    check_positive("max_staleness", max_staleness, allow_zero=True)
    if policy_version.numel() > 0 and values_readable("policy_version", policy_version):
        newest = int(policy_version.max())
        if newest > current_version:
            raise ValueError(
                f"policy_version: contains version {newest} > current_version {current_version} "
                "(a sample from a future policy)"
            )
    if math.isinf(max_staleness):
        return torch.ones(policy_version.shape, dtype=torch.bool, device=policy_version.device)
    age = current_version - policy_version
    return age <= math.floor(max_staleness)


# --------------------------------------------------------------------------- helpers


def combine_keep(*keeps: Tensor) -> Tensor:
    """Logical AND of keep-masks (all ``[B]`` bool of one shape); returns a new tensor.

    >>> combine_keep(torch.tensor([True, True, False]), torch.tensor([True, False, True]))
    tensor([ True, False, False])
    """
    if not keeps:
        raise ValueError("keeps: need at least one keep-mask")
    first = keeps[0]
    check_ndim("keeps[0]", first, 1)
    check_mask("keeps[0]", first)
    out = first.clone()
    for i, k in enumerate(keeps[1:], start=1):
        check_mask(f"keeps[{i}]", k, first, "keeps[0]")
        out = out & k
    return out


def filter_metrics(keep: Tensor, group_ids: Tensor | None = None) -> dict[str, Tensor]:
    r"""Summary of a keep-mask, as 0-dim detached tensors on the device of ``keep``.

    Without ``group_ids`` nothing is read back to the host (no device sync); with
    ``group_ids`` the group count of :func:`rollkit.ops.group_index` (``torch.unique``) costs
    one synchronisation.

    * ``kept_fraction``: :math:`\frac{1}{B}\sum_i \mathrm{keep}_i` (0 for an empty batch),
    * ``num_kept``: number of kept samples (int64),
    * with ``group_ids``: ``kept_group_fraction`` and ``num_groups_kept``, where a group counts
      as kept if *any* of its members is kept (for the group filters: all of them), and
      ``num_groups``.

    >>> m = filter_metrics(torch.tensor([True, True, False, False]), torch.tensor([0, 0, 1, 1]))
    >>> float(m["kept_fraction"]), float(m["kept_group_fraction"]), int(m["num_groups_kept"])
    (0.5, 0.5, 1)
    """
    check_ndim("keep", keep, 1)
    check_mask("keep", keep)
    n = keep.shape[0]
    num_kept = keep.sum()
    out = {
        "kept_fraction": (num_kept.to(torch.float32) / max(n, 1)).detach(),
        "num_kept": num_kept.detach(),
    }
    if group_ids is not None:
        check_group_ids("group_ids", group_ids, n)
        check_same_device("group_ids", group_ids, "keep", keep)
        index, num_groups = group_index(group_ids)
        kept_per_group = _segment_sum(keep.to(torch.int64), index, num_groups)
        g_kept = (kept_per_group > 0).sum()
        out["num_groups"] = torch.tensor(num_groups, dtype=torch.int64, device=keep.device)
        out["num_groups_kept"] = g_kept.detach()
        out["kept_group_fraction"] = (g_kept.to(torch.float32) / max(num_groups, 1)).detach()
    return out
