"""Masked reductions and segment (group) operations: the vectorised building blocks of rollkit.

Masks are ``torch.bool`` tensors of the shape of the data. Conventions, used everywhere:

* ``masked_mean`` over an empty selection raises ``ValueError`` (a mean of nothing is
  undefined), unless ``empty_value`` is given, which is then returned for empty slices.
* ``masked_var`` states its bias: ``unbiased=True`` divides by ``n - 1`` (Bessel), ``False``
  by ``n``. An unbiased variance needs ``n >= 2``.
* Segment ops take ``index`` (``[B]`` int64 in ``[0, num_segments)``), as returned by
  :func:`group_index`, and reduce along dimension 0 with ``index_add_`` (no Python loops).
  They check their arguments (an ``index`` out of range is a ``ValueError`` naming ``index``,
  a value check skipped inside ``value_checks(False)``); rollkit's estimators call unchecked
  private twins with indices they built themselves.
* Squares are formed in the working dtype (float32 for float32 / 16-bit inputs): a deviation
  above about ``1.8e19`` overflows a float32 variance; pass float64 for such magnitudes.
  :func:`group_normalize` instead scales by the group's largest deviation before squaring,
  so its result never overflows.
* ``meta`` tensors: the masked reductions and segment ops run on ``meta`` (shape inference)
  inside ``rollkit.validation.value_checks(False)``; with the checks on they raise a
  ``ValueError`` naming the argument. :func:`group_index` reads the ids (``torch.unique``) and
  refuses ``meta`` by name.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rollkit.validation import (
    check_float,
    check_group_ids,
    check_int,
    check_int_tensor,
    check_mask,
    check_ndim,
    check_positive,
    check_same_device,
    check_tensor,
    values_readable,
)

__all__ = [
    "broadcast_to_tokens",
    "group_index",
    "group_normalize",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "segment_count",
    "segment_max",
    "segment_mean",
    "segment_min",
    "segment_std",
    "segment_sum",
    "segment_var",
]


def masked_sum(
    x: Tensor, mask: Tensor, dim: int | tuple[int, ...] | None = None, keepdim: bool = False
) -> Tensor:
    """Sum of ``x`` where ``mask`` is True.

    Args:
        x: ``[...]`` float tensor.
        mask: bool tensor of the shape of ``x``.
        dim: dimension(s) to reduce; ``None`` reduces everything to a scalar.

    Masked-out entries are replaced by zero *before* summing (``torch.where``), so a NaN or
    inf under the mask never leaks into the result or its gradient.

    >>> masked_sum(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([True, False, True]))
    tensor(4.)
    """
    check_tensor("x", x)
    check_mask("mask", mask, x, "x")
    z = torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))
    if dim is None:
        return z.sum()
    return z.sum(dim=dim, keepdim=keepdim)


def _count(mask: Tensor, dim, keepdim: bool, dtype: torch.dtype) -> Tensor:
    if dim is None:
        return mask.sum().to(dtype)
    return mask.sum(dim=dim, keepdim=keepdim).to(dtype)


def masked_mean(
    x: Tensor,
    mask: Tensor,
    dim: int | tuple[int, ...] | None = None,
    keepdim: bool = False,
    *,
    empty_value: float | None = None,
) -> Tensor:
    """Mean of ``x`` over the entries where ``mask`` is True.

        mean = sum(x * m) / sum(m)

    Args:
        x: float tensor. mask: bool tensor of the same shape.
        dim: dimension(s) to reduce (``None``: all).
        empty_value: value for a slice with no selected entry. ``None`` (default) raises
            ``ValueError`` if any slice is empty.

    >>> masked_mean(torch.tensor([[1.0, 3.0], [2.0, 0.0]]), torch.tensor([[True, True], [True, False]]), dim=-1)
    tensor([2., 2.])
    """
    total = masked_sum(x, mask, dim, keepdim)
    count = _count(mask, dim, keepdim, total.dtype)
    empty = count == 0
    if empty_value is None:
        if values_readable("mask", mask) and bool(empty.any()):
            where = "" if dim is None else f" ({int(empty.sum())} empty slice(s) along dim={dim})"
            raise ValueError(f"mask: selects no elements{where}; a mean over nothing is undefined")
        return total / count.clamp(min=1)
    return torch.where(empty, torch.full_like(total, empty_value), total / count.clamp(min=1))


def masked_var(
    x: Tensor,
    mask: Tensor,
    dim: int | tuple[int, ...] | None = None,
    keepdim: bool = False,
    *,
    unbiased: bool = True,
) -> Tensor:
    """Variance of ``x`` over the entries where ``mask`` is True.

        var = sum(m * (x - mean)^2) / (n - 1)    if unbiased (default, Bessel's correction)
        var = sum(m * (x - mean)^2) / n          otherwise

    Two-pass (mean first), so it stays accurate when values are large and close together.
    Raises ``ValueError`` if a slice has fewer than 2 (unbiased) or 1 (biased) selected entries.

    >>> masked_var(torch.tensor([1.0, 2.0, 3.0, 100.0]), torch.tensor([True, True, True, False]))
    tensor(1.)
    """
    mean = masked_mean(x, mask, dim, keepdim=True)
    # mask the deviation *before* squaring: NaN/inf under the mask never reach the value or
    # the gradient (``where``'s unused branch would backpropagate ``0 * inf = NaN``)
    dev = torch.where(mask, x - mean, torch.zeros((), dtype=x.dtype, device=x.device))
    ss = dev.square().sum() if dim is None else dev.square().sum(dim=dim, keepdim=keepdim)
    n = _count(mask, dim, keepdim, ss.dtype)
    need = 2 if unbiased else 1
    if values_readable("mask", mask) and bool((n < need).any()):
        raise ValueError(
            f"mask: a {'n-1 (unbiased)' if unbiased else 'n (biased)'} variance needs at least "
            f"{need} selected elements per slice, got {int(n.min())}"
        )
    return ss / (n - (1 if unbiased else 0)).clamp(min=1)


def masked_whiten(
    x: Tensor,
    mask: Tensor,
    *,
    shift_mean: bool = True,
    unbiased: bool = True,
    eps: float = 1e-8,
) -> Tensor:
    """Whiten ``x`` over all entries selected by ``mask``; entries outside the mask become 0.

        y = (x - mean) / sqrt(var + eps)        (shift_mean=True)
        y = (x - mean) / sqrt(var + eps) + mean (shift_mean=False: rescale, keep the mean)

    ``var`` is the masked variance with the given ``unbiased`` flag (verl's ``masked_whiten``
    and TRL's ``whiten`` use the unbiased variance; OpenRLHF's ``masked_normalize`` the biased
    one, ``unbiased=False``). The usual advantage whitening of PPO
    (Schulman et al., 2017, arXiv:1707.06347, as implemented by OpenAI baselines) and of
    REINFORCE++ (Hu, 2025, arXiv:2501.03262). Unlike :func:`group_normalize` the statistics
    are over all selected entries (no groups) and ``eps`` goes under the square root.

    Numerics: the statistics are computed once (one pass for the mean, one for the variance,
    one host synchronisation for the value checks) on the values shifted by one selected entry
    (in float32 for 16-bit inputs; the result has the dtype of ``x``). Entries outside the mask
    are zeroed first, so NaN/inf there reach neither the result nor its gradient. A constant input (zero
    variance) therefore gives exactly 0 (``shift_mean=False``: exactly its mean), also with
    ``eps=0``, instead of ``rounding / sqrt(eps)`` noise, and float32 values far from 0 with a
    small spread keep their precision (the mean's rounding error scales with the spread, not
    with the magnitude: no float64 copy of a ``[B, T]`` tensor is needed). An empty mask raises ``ValueError`` (as
    :func:`masked_mean`), so does a single selected entry with ``unbiased=True``.

    Args:
        x: float tensor, any shape (an integer tensor is rejected: its whitened values are not
            integers). mask: bool tensor of the same shape.
        eps: ``>= 0``, added to the variance.

    >>> y = masked_whiten(torch.tensor([1.0, 2.0, 3.0]), torch.ones(3, dtype=torch.bool))
    >>> torch.allclose(y, torch.tensor([-1.0, 0.0, 1.0]), atol=1e-6)
    True
    >>> masked_whiten(torch.full((3,), 0.1), torch.ones(3, dtype=torch.bool)).tolist()
    [0.0, 0.0, 0.0]
    """
    check_float("x", x)
    check_mask("mask", mask, x, "x")
    check_positive("eps", eps, allow_zero=True)
    work = x if x.dtype in (torch.float64, torch.float32) else x.float()
    zero = torch.zeros((), dtype=work.dtype, device=work.device)
    count = mask.sum()
    need = 2 if unbiased else 1
    if values_readable("mask", mask):
        n_sel = int(count)  # the only host synchronisation
        if n_sel == 0:
            raise ValueError("mask: selects no elements; a mean over nothing is undefined")
        if n_sel < need:
            raise ValueError(
                f"mask: a {'n-1 (unbiased)' if unbiased else 'n (biased)'} variance needs at least "
                f"{need} selected elements per slice, got {n_sel}"
            )
    if work.numel() == 0:
        return x.clone()
    work = torch.where(mask, work, zero)  # garbage under the mask never enters value or gradient
    # shift by one selected entry (a constant, so no gradient): a constant input becomes 0
    # exactly, and |d| <= spread keeps the mean's rounding error relative to the spread
    first = mask.reshape(-1).to(torch.uint8).argmax().reshape(1)
    pivot = work.reshape(-1).index_select(0, first).reshape(()).detach()
    d = torch.where(mask, work - pivot, zero)
    n = count.to(work.dtype)
    mean = d.sum() / n.clamp(min=1)
    dev = torch.where(mask, d - mean, zero)
    var = dev.square().sum() / (n - (1 if unbiased else 0)).clamp(min=1)
    pos = var > 0
    scale = torch.where(pos, torch.rsqrt(torch.where(pos, var + eps, torch.ones_like(var))), zero)
    y = dev * scale
    if not shift_mean:
        y = torch.where(mask, y + (mean + pivot), zero)
    return y.to(x.dtype)


# --------------------------------------------------------------------------- segments


def group_index(group_ids: Tensor) -> tuple[Tensor, int]:
    """Map arbitrary group ids (any order, any values) to dense indices ``0..G-1``.

    Returns ``(index, G)`` with ``index`` ``[B]`` int64. Groups are numbered by sorted id.

    >>> group_index(torch.tensor([7, 3, 7, 9]))
    (tensor([1, 0, 1, 2]), 3)
    """
    return _group_index(group_ids, "group_ids")


def _group_index(ids: Tensor, name: str) -> tuple[Tensor, int]:
    """:func:`group_index` of the argument ``name`` (named in the errors)."""
    check_group_ids(name, ids)
    if ids.is_meta:
        raise ValueError(
            f"{name}: is on the meta device; grouping reads the ids (torch.unique), so "
            "group-wise primitives cannot run on meta"
        )
    uniq, inverse = torch.unique(ids, sorted=True, return_inverse=True)
    return inverse, int(uniq.numel())


_HALF = (torch.float16, torch.bfloat16)


def _work(x: Tensor) -> Tensor:
    """``x`` itself, or its float32 copy for a 16-bit float tensor (rollkit computes statistics
    of 16-bit inputs in float32 and casts the result back)."""
    return x.float() if x.dtype in _HALF else x


def _count_dtype(dtype: torch.dtype) -> torch.dtype:
    """Counts are never 16-bit (bfloat16 rounds 257 to 256)."""
    return torch.float32 if dtype in _HALF else dtype


def _safe_sqrt(v: Tensor) -> Tensor:
    """``sqrt(v)`` for ``v >= 0`` with a finite gradient at ``v == 0`` (taken as 0 there).

    ``sqrt`` has an infinite derivative at 0, and ``torch.where`` backpropagates through its
    unused branch (``0 * inf = NaN``): the square root is taken of 1 where ``v`` is 0. A NaN
    ``v`` (from NaN data) gives NaN, never 0.
    """
    zero = v == 0
    return torch.where(zero, torch.zeros_like(v), torch.where(zero, torch.ones_like(v), v).sqrt())


def _check_segments(name: str, x: Tensor, index: Tensor, num_segments: int) -> int:
    """Validate the arguments of a segment op: ``x`` a tensor with ``x.shape[0]`` rows,
    ``index`` a 1-D integer tensor of that length on ``x``'s device, ``num_segments`` an int
    ``>= 0`` and (a value check, one host synchronisation) every index in
    ``[0, num_segments)``. Returns ``num_segments`` as an int."""
    check_tensor(name, x)
    check_int_tensor("index", index)
    check_ndim("index", index, 1)
    g = check_int("num_segments", num_segments)
    if g < 0:
        raise ValueError(f"num_segments: must be >= 0, got {g}")
    if x.ndim == 0 or index.shape[0] != x.shape[0]:
        rows = "a 0-dim tensor" if x.ndim == 0 else f"{x.shape[0]} rows"
        raise ValueError(f"index: has {index.shape[0]} entries but {name} has {rows}")
    check_same_device("index", index, name, x)
    if index.numel() and values_readable("index", index):
        lo, hi = (int(v) for v in torch.aminmax(index))
        if lo < 0 or hi >= g:
            raise ValueError(f"index: must be in [0, num_segments) = [0, {g}), got values in [{lo}, {hi}]")
    return g


def segment_sum(x: Tensor, index: Tensor, num_segments: int) -> Tensor:
    """``out[g] = sum_{i: index[i] == g} x[i]`` along dimension 0. Shape ``[G, *x.shape[1:]]``.

    16-bit inputs are accumulated in float32 and the result cast back. An empty segment sums
    to 0. ``index`` must be a ``[B]`` integer tensor in ``[0, num_segments)`` on ``x``'s
    device (``ValueError`` naming the argument otherwise).

    >>> segment_sum(torch.tensor([1.0, 2.0, 4.0]), torch.tensor([1, 0, 1]), 3)
    tensor([2., 5., 0.])
    """
    _check_segments("x", x, index, num_segments)
    return _segment_sum(x, index, num_segments)


def _segment_sum(x: Tensor, index: Tensor, num_segments: int) -> Tensor:
    w = _work(x)
    out = torch.zeros((num_segments, *x.shape[1:]), dtype=w.dtype, device=x.device)
    return out.index_add(0, index, w).to(x.dtype)


def _segment_extreme(x: Tensor, index: Tensor, num_segments: int, reduce: str, fill: float) -> Tensor:
    out = torch.full((num_segments, *x.shape[1:]), fill, dtype=x.dtype, device=x.device)
    idx = index.reshape(-1, *([1] * (x.ndim - 1))).expand_as(x)
    return out.scatter_reduce(0, idx, x, reduce=reduce, include_self=True)


def segment_min(x: Tensor, index: Tensor, num_segments: int) -> Tensor:
    """Minimum of each segment along dim 0, ``[G, ...]``; an empty segment gives ``+inf``."""
    _check_segments("x", x, index, num_segments)
    return _segment_min(x, index, num_segments)


def _segment_min(x: Tensor, index: Tensor, num_segments: int) -> Tensor:
    return _segment_extreme(x, index, num_segments, "amin", float("inf"))


def segment_max(x: Tensor, index: Tensor, num_segments: int) -> Tensor:
    """Maximum of each segment along dim 0, ``[G, ...]``; an empty segment gives ``-inf``."""
    _check_segments("x", x, index, num_segments)
    return _segment_max(x, index, num_segments)


def _segment_max(x: Tensor, index: Tensor, num_segments: int) -> Tensor:
    return _segment_extreme(x, index, num_segments, "amax", float("-inf"))


def segment_count(index: Tensor, num_segments: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """Number of members of each segment, ``[G]``, counted exactly (in int64) and then cast to
    ``dtype`` (beware: a 16-bit ``dtype`` cannot hold every count above 256)."""
    _check_segments("index", index, index, num_segments)
    return _segment_count(index, num_segments, dtype)


def _segment_count(index: Tensor, num_segments: int, dtype: torch.dtype = torch.float32) -> Tensor:
    ones = torch.ones(index.shape[0], dtype=torch.int64, device=index.device)
    counts = torch.zeros(num_segments, dtype=torch.int64, device=index.device).index_add_(0, index, ones)
    return counts.to(dtype)


def segment_mean(x: Tensor, index: Tensor, num_segments: int) -> Tensor:
    """Mean of each segment, ``[G, ...]``; an empty segment gives 0 (16-bit: computed in float32)."""
    _check_segments("x", x, index, num_segments)
    return _segment_mean(x, index, num_segments)


def _segment_mean(x: Tensor, index: Tensor, num_segments: int) -> Tensor:
    w = _work(x)
    count = _segment_count(index, num_segments, w.dtype)
    count = count.reshape(-1, *([1] * (x.ndim - 1)))
    return (_segment_sum(w, index, num_segments) / count.clamp(min=1)).to(x.dtype)


def segment_var(x: Tensor, index: Tensor, num_segments: int, *, unbiased: bool) -> Tensor:
    """Variance of each segment along dim 0 (two-pass), ``[G, ...]``.

    ``unbiased=True`` divides by ``n - 1``; a segment with ``n <= 1`` then has variance 0 (a
    singleton has no spread to estimate), which is the convention the estimators document.
    NaN / inf in a segment make its variance NaN (never a silent 0).
    """
    _check_segments("x", x, index, num_segments)
    return _segment_var(x, index, num_segments, unbiased=unbiased)


def _segment_var(x: Tensor, index: Tensor, num_segments: int, *, unbiased: bool) -> Tensor:
    w = _work(x)
    mean = _segment_mean(w, index, num_segments)
    dev2 = (w - mean.index_select(0, index)).square()
    count = _segment_count(index, num_segments, w.dtype).reshape(-1, *([1] * (x.ndim - 1)))
    denom = (count - 1) if unbiased else count
    return (_segment_sum(dev2, index, num_segments) / denom.clamp(min=1)).to(x.dtype)


def segment_std(x: Tensor, index: Tensor, num_segments: int, *, unbiased: bool) -> Tensor:
    """Standard deviation of each segment: ``sqrt(segment_var)`` (gradient 0, not NaN, where
    the variance is 0; NaN where the variance is NaN).

    >>> segment_std(torch.tensor([1.0, 3.0, 5.0]), torch.tensor([0, 0, 1]), 2, unbiased=True)
    tensor([1.4142, 0.0000])
    """
    _check_segments("x", x, index, num_segments)
    return _segment_std(x, index, num_segments, unbiased=unbiased)


def _segment_std(x: Tensor, index: Tensor, num_segments: int, *, unbiased: bool) -> Tensor:
    w = _work(x)
    return _safe_sqrt(_segment_var(w, index, num_segments, unbiased=unbiased)).to(x.dtype)


def group_normalize(
    x: Tensor,  # [B, ...] float
    index: Tensor,  # [B] int64 dense group index in [0, num_groups)
    num_groups: int,
    *,
    scale: bool = True,
    unbiased: bool = True,
    eps: float = 1e-6,
) -> Tensor:  # [B, ...], dtype of x
    """Group-relative normalisation along dim 0: ``(x - mean_g) / (std_g + eps)``, or ``x - mean_g``.

        y_i = (x_i - mean_{g(i)} x) / (std_{g(i)} x + eps)     (scale=True)
        y_i =  x_i - mean_{g(i)} x                             (scale=False)

    The group-relative advantage of GRPO (Shao et al., 2024, DeepSeekMath, arXiv:2402.03300)
    without the reward-specific validation; used by the outcome estimators, GiGPO / StarPO and
    :func:`rollkit.rewards.normalize_rewards`. Unlike :func:`masked_whiten` the statistics are
    per group (``index``, as from :func:`group_index`) and ``eps`` is added to the std, not
    under the square root. ``std`` divides by ``n - 1`` (``unbiased=True``) or ``n``.

    One behaviour per edge case:

    * a group whose values are all (bitwise) equal, and every singleton, gives exactly 0: the
      statistics are computed on ``x - min_g x``, which is exactly 0 there;
    * a spread of exactly 0 leaves ``x - mean_g`` unscaled (so ``eps = 0`` is allowed); an
      unbiased std of a singleton counts as 0 spread;
    * no overflow or underflow: the sum of squares is taken of ``(x - mean_g) / m_g`` with
      ``m_g`` the group's largest absolute deviation (a constant, detached), and
      ``y = q / (std(q) + eps / m_g)`` with ``q = (x - mean_g) / m_g``, which is the formula
      above; spreads of ``1e30`` in float32 or ``1e-30`` do not become 0 (a float32 square
      overflows above about ``1.8e19``);
    * NaN in a group makes that group's result NaN;
    * empty input gives empty output. Arithmetic is in the dtype of ``x`` for float32 /
      float64 (pass float64 for more precision) and in float32 for 16-bit inputs (the result
      is cast back to the dtype of ``x``).

    Differentiable in ``x`` (nothing is detached but ``m_g``, which cancels), with finite
    gradients everywhere: where a group's spread is exactly 0 (constant group, singleton) the
    result is the unscaled ``x - mean_g`` and so is its gradient (a convention: the scaled map
    is not differentiable there); the square root and the division are guarded so that no
    ``0 * inf`` reaches the backward pass.

    Args:
        x: ``[B, ...]`` float; statistics along dimension 0.
        index: ``[B]`` integer group of each row, in ``[0, num_groups)``, on ``x``'s device.
        num_groups: ``G``.
        scale: divide by ``std + eps`` (GRPO) or only centre (Dr.GRPO, ``F_norm = 1``).
        unbiased: Bessel-corrected std (``torch.std``'s default, used by verl and TRL).
        eps: ``>= 0``, added to the std.

    >>> x = torch.tensor([1.0, 0.0, 0.0, 1.0, 5.0, 5.0, 7.0])
    >>> index, G = group_index(torch.tensor([3, 3, 3, 3, 8, 8, 9]))
    >>> y = group_normalize(x, index, G, eps=0.0)     # std of [1, 0, 0, 1] is sqrt(1/3)
    >>> torch.allclose(y[:4], torch.tensor([1.0, -1.0, -1.0, 1.0]) * 0.5 * 3**0.5)
    True
    >>> y[4:].tolist(), group_normalize(x, index, G, scale=False)[:4].tolist()
    ([0.0, 0.0, 0.0], [0.5, -0.5, -0.5, 0.5])
    >>> y = group_normalize(torch.tensor([1e30, -1e30, 0.0]), torch.zeros(3, dtype=torch.long), 1)
    >>> torch.allclose(y, torch.tensor([1.0, -1.0, 0.0]), atol=1e-6)    # float32 squares would overflow
    True
    """
    check_float("x", x)
    _check_segments("x", x, index, num_groups)
    check_positive("eps", eps, allow_zero=True)
    return _group_normalize(x, index, num_groups, scale=scale, unbiased=unbiased, eps=eps)


def _group_normalize(
    x: Tensor, index: Tensor, num_groups: int, *, scale: bool, unbiased: bool, eps: float
) -> Tensor:
    """:func:`group_normalize` without the argument checks (``index`` built by the caller)."""
    w = _work(x)
    d = w - _segment_min(w, index, num_groups).index_select(0, index)  # >= 0, 0 in constant groups
    centred = d - _segment_mean(d, index, num_groups).index_select(0, index)
    if not scale:
        return centred.to(x.dtype)
    # scale by the largest deviation before squaring: q in [-1, 1], sum q^2 in [1, n]
    m = _segment_max(centred.detach().abs(), index, num_groups)
    pos = m > 0  # False for constant groups and singletons (centred is exactly 0 there)
    m = torch.where(pos, m, torch.ones_like(m))
    q = centred / m.index_select(0, index)
    count = _segment_count(index, num_groups, w.dtype).reshape(-1, *([1] * (x.ndim - 1)))
    denom = (count - 1) if unbiased else count
    std_q = _safe_sqrt(_segment_sum(q.square(), index, num_groups) / denom.clamp(min=1))
    den = (std_q + eps / m).index_select(0, index)
    pos = pos.index_select(0, index)
    y = torch.where(pos, q / torch.where(pos, den, torch.ones_like(den)), centred)
    return y.to(x.dtype)


def broadcast_to_tokens(values: Tensor, mask: Tensor) -> Tensor:
    """Spread a ``[B]`` per-sequence value over the ``[B, T]`` tokens of ``mask`` (0 elsewhere).

    A ``[B, T]`` input is returned with masked-out entries zeroed.

    >>> broadcast_to_tokens(torch.tensor([2.0, -1.0]), torch.tensor([[True, False], [True, True]]))
    tensor([[ 2.,  0.],
            [-1., -1.]])
    """
    check_mask("mask", mask)
    if values.ndim == 1:
        if values.shape[0] != mask.shape[0]:
            raise ValueError(f"values: has {values.shape[0]} entries but mask has {mask.shape[0]} rows")
        values = values.unsqueeze(-1).expand(mask.shape)
    elif values.shape != mask.shape:
        raise ValueError(f"values: shape {list(values.shape)} is neither [B] nor mask's {list(mask.shape)}")
    return torch.where(mask, values, torch.zeros((), dtype=values.dtype, device=values.device))
