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
* Dtypes: sums (:func:`masked_sum`, :func:`segment_sum`) and extremes (:func:`segment_min`,
  :func:`segment_max`) take float or integer tensors; means, variances, standard deviations,
  whitening and normalisation take floating-point tensors only (an integer mean is not an
  integer: ``InvalidTypeError``, a ``ValueError`` and ``TypeError``, naming ``x``; pass
  ``x.float()``). Bool and complex tensors are refused everywhere. 16-bit float statistics
  are computed in float32 and cast back.
* Numerics: no intermediate overflows or underflows for finite float input. Each slice
  (segment) is divided by a power of two near its largest magnitude (exact: the rounding is
  that of the unscaled arithmetic) before it is summed or squared, and the result multiplied
  back, so a sum, mean or variance is the float64 result rounded to the dtype (to float32
  accuracy) whenever that result is representable, and ``+-inf`` only when it is not: values
  of ``3e38`` average to ``3e38``, a spread of ``1e19`` has a float32 variance of ``1e38``,
  not ``inf`` or NaN. Variances are taken of the deviations from the slice's minimum, so
  values far from 0 with a small spread keep their precision.
* Non-finite input: masked-out entries never matter (even NaN / inf). A selected NaN makes
  its slice's sum, mean, variance, min and max NaN; a selected ``+-inf`` makes a sum or mean
  ``+-inf`` (NaN if both signs), a variance NaN, and is ordered as usual by min / max.
* ``dim``: an int or a tuple of distinct ints in ``[-x.ndim, x.ndim)``, or ``None`` (every
  dimension); anything else raises naming ``dim`` (an out-of-range one a ``ValueError`` that
  gives ``x.ndim``, a non-int an ``InvalidTypeError``).
* ``meta`` tensors: the masked reductions and segment ops run on ``meta`` (shape inference)
  inside ``rollkit.validation.value_checks(False)``; with the checks on they raise a
  ``ValueError`` naming the argument. :func:`group_index` reads the ids (``torch.unique``) and
  refuses ``meta`` by name. :func:`broadcast_to_tokens` and :func:`explained_variance` read no
  value (no check, no host synchronisation) and run on ``meta`` with the checks on or off.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rollkit.validation import (
    check_dim,
    check_float,
    check_group_ids,
    check_int,
    check_int_tensor,
    check_mask,
    check_ndim,
    check_positive,
    check_real_tensor,
    check_same_device,
    check_same_shape,
    check_tensor,
    values_readable,
)

__all__ = [
    "broadcast_to_tokens",
    "explained_variance",
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
        x: ``[...]`` float or integer tensor (integers are summed in int64, as ``torch.sum``
            does: exact unless the sum leaves int64's range, where it wraps around; bool and
            complex are refused).
        mask: bool tensor of the shape of ``x``.
        dim: dimension(s) to reduce; ``None`` reduces everything to a scalar.

    Masked-out entries are replaced by zero *before* summing (``torch.where``), so a NaN or
    inf under the mask never leaks into the result or its gradient.

    Numerics: a float slice is divided by a power of two near its largest magnitude before
    it is summed (exact), so finite values whose partial sums would overflow (``3e38 + 3e38
    - 3e38 - 3e38``) still give the float64 sum rounded; ``+-inf`` only when the sum itself is
    beyond the dtype's range.

    >>> masked_sum(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([True, False, True]))
    tensor(4.)
    """
    check_real_tensor("x", x)
    check_mask("mask", mask, x, "x")
    dims = check_dim("dim", dim, x.ndim)
    z = torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))
    if not z.is_floating_point():
        return z.sum() if dims is None else z.sum(dim=dims, keepdim=keepdim)
    z, dims, keep = _flat(z, dims, keepdim)
    p = _slice_scale(z, dims)
    return _squeeze((z / p).sum(dim=dims, keepdim=True) * p, dims, keep)


def _flat(x: Tensor, dims: tuple[int, ...] | None, keepdim: bool) -> tuple[Tensor, tuple[int, ...], bool]:
    """``(x, dims, keepdim)`` with ``dims=None`` (or a 0-dim ``x``) turned into a reduction of
    dimension 0 of the flattened ``x`` (a 0-dim result, as ``x.sum()``)."""
    if dims is None or x.ndim == 0:
        return x.reshape(-1), (0,), False
    return x, dims, keepdim


def _squeeze(x: Tensor, dims: tuple[int, ...], keepdim: bool) -> Tensor:
    return x if keepdim else x.squeeze(dims)


_EXP_BITS = {
    torch.float64: (torch.int64, 0x7FF0000000000000),
    torch.float32: (torch.int32, 0x7F800000),
    torch.float16: (torch.int16, 0x7C00),
    torch.bfloat16: (torch.int16, 0x7F80),
}


def _pow2(m: Tensor) -> Tensor:
    """For ``m >= 0`` (detached): the largest power of two ``p <= m``, so ``m / p`` is in
    ``[1, 2)`` and dividing by ``p`` is exact. ``p`` is the dtype's smallest normal number
    where ``m`` is 0 or subnormal, and 1 where ``m`` is inf or NaN (nothing to scale: the
    non-finite values propagate). Read from the exponent bits: no ``log2`` / ``exp2``
    rounding, the same on every device."""
    int_dtype, bits = _EXP_BITS[m.dtype]
    p = (m.contiguous().view(int_dtype) & bits).view(m.dtype)  # mantissa (and sign) cleared
    tiny = torch.full((), torch.finfo(m.dtype).tiny, dtype=m.dtype, device=m.device)
    p = torch.where(p == 0, tiny, p)
    return torch.where(torch.isinf(p), torch.ones_like(p), p)


def _slice_scale(z: Tensor, dims: tuple[int, ...]) -> Tensor:
    """Per-slice power-of-two scale of ``z`` (zero outside the mask) over ``dims``, keepdim
    shape, detached; ones for an empty ``z`` (nothing to scale, and ``amax`` refuses it)."""
    if z.numel() == 0:
        return torch.ones_like(z.sum(dim=dims, keepdim=True))
    return _pow2(z.detach().abs().amax(dim=dims, keepdim=True))


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
        x: float tensor (an integer one is refused: its mean is not an integer; pass
            ``x.float()``). mask: bool tensor of the same shape.
        dim: dimension(s) to reduce (``None``: all).
        empty_value: value for a slice with no selected entry. ``None`` (default) raises
            ``ValueError`` if any slice is empty.

    Numerics: computed on the slice divided by a power of two near its largest magnitude
    (exact), so it never overflows (``|mean| <= max |x|``): finite input gives the float64
    mean rounded to the dtype (16-bit inputs: computed in float32, cast back).

    >>> masked_mean(torch.tensor([[1.0, 3.0], [2.0, 0.0]]), torch.tensor([[True, True], [True, False]]), dim=-1)
    tensor([2., 2.])
    """
    check_float("x", x)
    check_mask("mask", mask, x, "x")
    dims = check_dim("dim", dim, x.ndim)
    w = _work(x)
    z = torch.where(mask, w, torch.zeros((), dtype=w.dtype, device=w.device))
    z, rdims, keep = _flat(z, dims, keepdim)
    m = mask.reshape(z.shape)
    p = _slice_scale(z, rdims)
    count = m.sum(dim=rdims, keepdim=True).to(w.dtype)
    mean = (z / p).sum(dim=rdims, keepdim=True) / count.clamp(min=1) * p
    mean, count = _squeeze(mean, rdims, keep), _squeeze(count, rdims, keep)
    empty = count == 0
    if empty_value is None:
        if values_readable("mask", mask) and bool(empty.any()):
            where = "" if dim is None else f" ({int(empty.sum())} empty slice(s) along dim={dim})"
            raise ValueError(f"mask: selects no elements{where}; a mean over nothing is undefined")
        return mean.to(x.dtype)
    return torch.where(empty, torch.full_like(mean, empty_value), mean).to(x.dtype)


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

    Raises ``ValueError`` if a slice has fewer than 2 (unbiased) or 1 (biased) selected
    entries; ``x`` must be a float tensor.

    Numerics: two-pass, on the slice divided by a power of two near its largest magnitude
    (exact) and shifted by its minimum (so values far from 0 with a small spread keep their
    precision), then multiplied back: no intermediate overflow or underflow. Finite input
    gives the float64 variance rounded to the dtype (to float32 accuracy; 16-bit inputs are
    computed in float32 and cast back), ``inf`` only where that variance exceeds the dtype's
    range (a spread of ``1e19`` has a float32 variance of ``~1e38``; ``1e20`` overflows). A
    selected NaN or ``+-inf`` makes the slice's variance NaN.

    >>> masked_var(torch.tensor([1.0, 2.0, 3.0, 100.0]), torch.tensor([True, True, True, False]))
    tensor(1.)
    """
    check_float("x", x)
    check_mask("mask", mask, x, "x")
    dims = check_dim("dim", dim, x.ndim)
    w = _work(x)
    zero = torch.zeros((), dtype=w.dtype, device=w.device)
    z = torch.where(mask, w, zero)
    z, rdims, keep = _flat(z, dims, keepdim)
    m = mask.reshape(z.shape)
    n = m.sum(dim=rdims, keepdim=True).to(w.dtype)
    need = 2 if unbiased else 1
    if values_readable("mask", mask) and bool((n < need).any()):
        raise ValueError(
            f"mask: a {'n-1 (unbiased)' if unbiased else 'n (biased)'} variance needs at least "
            f"{need} selected elements per slice, got {int(n.min())}"
        )
    p = _slice_scale(z, rdims)
    y = z / p  # |y| < 2
    if y.numel():
        lo = torch.where(m, y.detach(), torch.full_like(y, float("inf"))).amin(dim=rdims, keepdim=True)
    else:
        lo = torch.zeros_like(p)
    # mask the deviation *before* squaring: NaN/inf under the mask never reach the value or
    # the gradient (``where``'s unused branch would backpropagate ``0 * inf = NaN``)
    d = torch.where(m, y - lo, zero)  # in [0, 4]
    dev = torch.where(m, d - d.sum(dim=rdims, keepdim=True) / n.clamp(min=1), zero)
    v = dev.square().sum(dim=rdims, keepdim=True) / (n - (1 if unbiased else 0)).clamp(min=1)
    return _squeeze(v * p * p, rdims, keep).to(x.dtype)


def _scalar_dtype(device: torch.device) -> torch.dtype:
    """float64 for 0-dim statistics (cheap), float32 on MPS (which has no float64)."""
    return torch.float32 if device.type == "mps" else torch.float64


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
    one host synchronisation for the value checks) on the selected values divided by a power
    of two near their largest magnitude (exact) and shifted by one selected entry (in float32
    for 16-bit inputs; the result has the dtype of ``x``); the 0-dim factor ``1 / sqrt(var +
    eps)`` is formed in float64 (float32 on MPS). So no intermediate overflows or underflows:
    finite input of any magnitude (``1e38``, ``1e-30``) gives the float64 result rounded, to
    float32 accuracy. Entries outside the mask are zeroed first, so NaN/inf there reach
    neither the result nor its gradient; a selected NaN or ``+-inf`` makes the result NaN. A
    constant input (zero variance) gives exactly 0 (``shift_mean=False``: exactly its mean),
    also with ``eps=0``, instead of ``rounding / sqrt(eps)`` noise, and float32 values far
    from 0 with a small spread keep their precision (the mean's rounding error scales with
    the spread, not with the magnitude: no float64 copy of a ``[B, T]`` tensor is needed). An
    empty mask raises ``ValueError`` (as :func:`masked_mean`), so does a single selected entry
    with ``unbiased=True``.

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
    z = torch.where(mask, work, zero)  # garbage under the mask never enters value or gradient
    p = _pow2(z.detach().abs().amax())  # a power of two: y = z / p is exact, |y| < 2
    y = z / p
    # shift by one selected entry (a constant, so no gradient): a constant input becomes 0
    # exactly, and |d| <= spread keeps the mean's rounding error relative to the spread
    first = mask.reshape(-1).to(torch.uint8).argmax().reshape(1)
    pivot = y.reshape(-1).index_select(0, first).reshape(()).detach()
    d = torch.where(mask, y - pivot, zero)
    n = count.to(work.dtype)
    mean = d.sum() / n.clamp(min=1)
    dev = torch.where(mask, d - mean, zero)
    v = dev.square().sum() / (n - (1 if unbiased else 0)).clamp(min=1)  # var / p^2, <= 16
    # 1 / sqrt(var + eps) in units of 1 / p: 1 / sqrt(v + eps / p^2), in float64 (a scalar)
    sd = _scalar_dtype(work.device)
    pos = v > 0
    v64 = torch.where(pos, v, torch.ones_like(v)).to(sd)
    inv = torch.rsqrt(v64 + eps / p.to(sd).square())
    scale = torch.where(pos, inv.to(work.dtype), zero)
    out = dev * scale
    if not shift_mean:
        out = torch.where(mask, out + (mean + pivot) * p, zero)
    return out.to(x.dtype)


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


def _check_segments(name: str, x: Tensor, index: Tensor, num_segments: int, *, floating: bool = False) -> int:
    """Validate the arguments of a segment op: ``x`` a float (``floating``) or float / integer
    tensor with ``x.shape[0]`` rows, ``index`` a 1-D integer tensor of that length on ``x``'s
    device, ``num_segments`` an int ``>= 0`` and (a value check, one host synchronisation)
    every index in ``[0, num_segments)``. Returns ``num_segments`` as an int."""
    if floating:
        check_float(name, x)
    else:
        check_real_tensor(name, x)
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

    ``x`` is a float or integer tensor; integers are summed exactly in int64 and the result
    is int64, as ``torch.sum`` does (an int8 segment of ``100 + 100`` is ``200``, not ``-56``;
    only an int64 overflow, beyond ``9.2e18``, wraps around). 16-bit float inputs are
    accumulated in float32 and the result cast back. An empty segment sums to 0. ``index``
    must be a ``[B]`` integer tensor in ``[0, num_segments)`` on ``x``'s device
    (``ValueError`` naming the argument otherwise).

    Numerics: a float segment is divided by a power of two near its largest magnitude before
    it is summed (exact), so finite values whose partial sums would overflow still give the
    float64 sum rounded (``inf`` only if the sum itself is out of range).

    >>> segment_sum(torch.tensor([1.0, 2.0, 4.0]), torch.tensor([1, 0, 1]), 3)
    tensor([2., 5., 0.])
    """
    _check_segments("x", x, index, num_segments)
    if not x.is_floating_point():
        return _segment_sum(x.to(torch.int64), index, num_segments)
    w = _work(x)
    p = _segment_scale(w, index, num_segments)
    return (_segment_sum(w / p.index_select(0, index), index, num_segments) * p).to(x.dtype)


def _segment_sum(x: Tensor, index: Tensor, num_segments: int) -> Tensor:
    w = _work(x)
    out = torch.zeros((num_segments, *x.shape[1:]), dtype=w.dtype, device=x.device)
    return out.index_add(0, index, w).to(x.dtype)


def _segment_scale(w: Tensor, index: Tensor, num_segments: int) -> Tensor:
    """``[G, ...]`` power of two near each segment's largest magnitude (detached; see
    :func:`_pow2`), for overflow-free sums and squares."""
    return _pow2(_segment_extreme(w.detach().abs(), index, num_segments, "amax"))


def _segment_extreme(x: Tensor, index: Tensor, num_segments: int, reduce: str) -> Tensor:
    """Per-segment ``amin`` / ``amax`` along dim 0; an empty segment holds the reduction's
    identity (``+-inf``, or the integer dtype's largest / smallest value: no overflow)."""
    if x.is_floating_point():
        fill = float("inf") if reduce == "amin" else float("-inf")
    else:
        info = torch.iinfo(x.dtype)
        fill = info.max if reduce == "amin" else info.min
    out = torch.full((num_segments, *x.shape[1:]), fill, dtype=x.dtype, device=x.device)
    idx = index.reshape(-1, *([1] * (x.ndim - 1))).expand_as(x)
    return out.scatter_reduce(0, idx, x, reduce=reduce, include_self=True)


def _nan_segments(x: Tensor, out: Tensor, index: Tensor, num_segments: int) -> Tensor:
    """``out`` with NaN in every segment that holds a NaN of ``x`` (scatter's NaN handling is
    device-dependent; this makes it the same everywhere)."""
    if not x.is_floating_point():
        return out
    has_nan = _segment_sum(torch.isnan(x).to(torch.int32), index, num_segments) > 0
    return torch.where(has_nan, torch.full_like(out, float("nan")), out)


def segment_min(x: Tensor, index: Tensor, num_segments: int) -> Tensor:
    """Minimum of each segment along dim 0, ``[G, ...]``, in the dtype of ``x`` (float or
    integer).

    An empty segment gives the identity of ``min``: ``+inf`` for floats, the dtype's largest
    value for integers (``torch.iinfo(x.dtype).max``; integer extremes never overflow); tell
    it from a segment of ``+inf`` with :func:`segment_count`. Non-finite values: ``+-inf``
    are ordered as usual (a segment holding ``-inf`` has minimum ``-inf``), and a NaN makes
    its segment's minimum NaN (on every device).

    >>> segment_min(torch.tensor([3, -7, 5]), torch.tensor([0, 0, 2]), 3).tolist()
    [-7, 9223372036854775807, 5]
    """
    _check_segments("x", x, index, num_segments)
    return _nan_segments(x, _segment_min(x, index, num_segments), index, num_segments)


def _segment_min(x: Tensor, index: Tensor, num_segments: int) -> Tensor:
    return _segment_extreme(x, index, num_segments, "amin")


def segment_max(x: Tensor, index: Tensor, num_segments: int) -> Tensor:
    """Maximum of each segment along dim 0, ``[G, ...]``, in the dtype of ``x`` (float or
    integer). An empty segment gives ``-inf`` for floats, the dtype's smallest value for
    integers (``torch.iinfo(x.dtype).min``); non-finite values as :func:`segment_min`."""
    _check_segments("x", x, index, num_segments)
    return _nan_segments(x, _segment_max(x, index, num_segments), index, num_segments)


def _segment_max(x: Tensor, index: Tensor, num_segments: int) -> Tensor:
    return _segment_extreme(x, index, num_segments, "amax")


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
    """Mean of each segment, ``[G, ...]``; an empty segment gives 0. ``x`` must be a float
    tensor (an integer mean is not an integer: ``InvalidTypeError`` naming ``x``).

    Numerics: each segment is divided by a power of two near its largest magnitude (exact)
    before it is summed: no overflow, the float64 mean rounded to the dtype for finite input
    (16-bit: computed in float32, cast back).

    >>> segment_mean(torch.tensor([3e38, 3e38, 1.0]), torch.tensor([0, 0, 1]), 2)
    tensor([3.0000e+38, 1.0000e+00])
    """
    _check_segments("x", x, index, num_segments, floating=True)
    return _segment_mean(x, index, num_segments)


def _segment_mean(x: Tensor, index: Tensor, num_segments: int) -> Tensor:
    w = _work(x)
    p = _segment_scale(w, index, num_segments)
    return (_plain_segment_mean(w / p.index_select(0, index), index, num_segments) * p).to(x.dtype)


def _plain_segment_mean(w: Tensor, index: Tensor, num_segments: int) -> Tensor:
    """Segment mean without the scaling, for values known to be in a small range."""
    count = _segment_count(index, num_segments, w.dtype).reshape(-1, *([1] * (w.ndim - 1)))
    return _segment_sum(w, index, num_segments) / count.clamp(min=1)


def segment_var(x: Tensor, index: Tensor, num_segments: int, *, unbiased: bool) -> Tensor:
    """Variance of each segment along dim 0 (two-pass), ``[G, ...]``; ``x`` a float tensor.

    ``unbiased=True`` divides by ``n - 1``; a segment with ``n <= 1`` then has variance 0 (a
    singleton has no spread to estimate), which is the convention the estimators document.
    NaN / inf in a segment make its variance NaN (never a silent 0).

    Numerics: computed on each segment divided by a power of two near its largest magnitude
    (exact) and shifted by its minimum, then multiplied back: no intermediate overflow, the
    float64 variance rounded to the dtype for finite input (``inf`` only where that variance
    is beyond the dtype's range; a spread of ``1e19`` gives ``~1e38`` in float32).
    """
    _check_segments("x", x, index, num_segments, floating=True)
    return _segment_var(x, index, num_segments, unbiased=unbiased)


def _segment_moments(w: Tensor, index: Tensor, num_segments: int, *, unbiased: bool) -> tuple[Tensor, Tensor]:
    """``(v, p)`` with ``var = v * p * p``: the variance of each segment of ``w / p`` (``p`` a
    power of two near the segment's largest magnitude, so ``|w / p| < 2``), computed on the
    values shifted by the segment's minimum (``d`` in ``[0, 4]``, exactly 0 in a constant
    segment)."""
    p = _segment_scale(w, index, num_segments)
    y = w / p.index_select(0, index)
    d = y - _segment_min(y.detach(), index, num_segments).index_select(0, index)
    count = _segment_count(index, num_segments, w.dtype).reshape(-1, *([1] * (w.ndim - 1)))
    dev = d - (_segment_sum(d, index, num_segments) / count.clamp(min=1)).index_select(0, index)
    denom = (count - 1) if unbiased else count
    return _segment_sum(dev.square(), index, num_segments) / denom.clamp(min=1), p


def _segment_var(x: Tensor, index: Tensor, num_segments: int, *, unbiased: bool) -> Tensor:
    v, p = _segment_moments(_work(x), index, num_segments, unbiased=unbiased)
    return (v * p * p).to(x.dtype)


def segment_std(x: Tensor, index: Tensor, num_segments: int, *, unbiased: bool) -> Tensor:
    """Standard deviation of each segment: ``sqrt(segment_var)`` (gradient 0, not NaN, where
    the variance is 0; NaN where the variance is NaN). Taken as ``p * sqrt(v)`` (see
    :func:`segment_var`), so a std of ``3e38`` is finite even though its variance is not.

    >>> segment_std(torch.tensor([1.0, 3.0, 5.0]), torch.tensor([0, 0, 1]), 2, unbiased=True)
    tensor([1.4142, 0.0000])
    """
    _check_segments("x", x, index, num_segments, floating=True)
    return _segment_std(x, index, num_segments, unbiased=unbiased)


def _segment_std(x: Tensor, index: Tensor, num_segments: int, *, unbiased: bool) -> Tensor:
    v, p = _segment_moments(_work(x), index, num_segments, unbiased=unbiased)
    return (_safe_sqrt(v) * p).to(x.dtype)


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
    # divide each group by a power of two near its largest magnitude (exact, detached): the
    # difference below cannot overflow (3e38 - (-3e38)), and nothing else changes
    p = _segment_scale(w, index, num_groups)
    pb = p.index_select(0, index)
    w = w / pb
    d = w - _segment_min(w, index, num_groups).index_select(0, index)  # >= 0, 0 in constant groups
    centred = d - _plain_segment_mean(d, index, num_groups).index_select(0, index)
    if not scale:
        return (centred * pb).to(x.dtype)
    # scale by the largest deviation before squaring: q in [-1, 1], sum q^2 in [1, n]
    m = _segment_max(centred.detach().abs(), index, num_groups)
    pos = m > 0  # False for constant groups and singletons (centred is exactly 0 there)
    m = torch.where(pos, m, torch.ones_like(m))
    q = centred / m.index_select(0, index)
    count = _segment_count(index, num_groups, w.dtype).reshape(-1, *([1] * (x.ndim - 1)))
    denom = (count - 1) if unbiased else count
    std_q = _safe_sqrt(_segment_sum(q.square(), index, num_groups) / denom.clamp(min=1))
    den = (std_q + eps / (m * p)).index_select(0, index)
    pos = pos.index_select(0, index)
    y = torch.where(pos, q / torch.where(pos, den, torch.ones_like(den)), centred * pb)
    return y.to(x.dtype)


def broadcast_to_tokens(values: Tensor, mask: Tensor) -> Tensor:
    """Spread a ``[B]`` per-sequence value over the ``[B, T]`` tokens of ``mask`` (0 elsewhere).

    A ``[B, T]`` input is returned with masked-out entries zeroed. ``values`` must be a
    tensor and ``mask`` a ``[B, T]`` bool tensor on its device: a list, ``None`` or a non-bool
    mask is an ``InvalidTypeError`` (a ``ValueError`` and a ``TypeError``) naming the
    argument, a mask of another shape a ``ValueError`` naming ``mask`` and ``[B, T]``.

    >>> broadcast_to_tokens(torch.tensor([2.0, -1.0]), torch.tensor([[True, False], [True, True]]))
    tensor([[ 2.,  0.],
            [-1., -1.]])
    """
    check_tensor("values", values)
    check_mask("mask", mask)
    if mask.ndim != 2:
        raise ValueError(f"mask: expected shape [B, T], got {list(mask.shape)}")
    check_same_device("values", values, "mask", mask)
    if values.ndim == 1:
        if values.shape[0] != mask.shape[0]:
            raise ValueError(f"values: has {values.shape[0]} entries but mask has {mask.shape[0]} rows")
        values = values.unsqueeze(-1).expand(mask.shape)
    elif values.shape != mask.shape:
        raise ValueError(f"values: shape {list(values.shape)} is neither [B] nor mask's {list(mask.shape)}")
    return torch.where(mask, values, torch.zeros((), dtype=values.dtype, device=values.device))


def explained_variance(pred: Tensor, target: Tensor, mask: Tensor) -> Tensor:
    """How much of the variance of ``target`` the predictions ``pred`` explain, over ``mask``.

        EV = 1 - Var(target - pred) / Var(target)          (biased variances over the masked entries)

    The critic diagnostic of PPO (OpenAI baselines' ``explained_variance``; verl's
    ``critic/vf_explained_var``, OpenRLHF's): 1 is a perfect critic, 0 one no better than the
    mean of the targets, negative one worse than that; never above 1. 0-dim float64 (the
    variances are taken in float64, each of the values shifted by their smallest selected
    one, so that constant targets have a variance of exactly 0); ``NaN`` when the masked
    targets are constant (``Var(target) = 0``), when no entry is selected, or when a selected
    entry is NaN / ``+-inf``. Entries outside ``mask`` never matter (NaN included).

    A diagnostic, not a check: nothing is read on the host (no device synchronisation), so it
    runs on ``meta`` tensors (a 0-dim ``meta`` result, for shape inference), with the value
    checks on or off. Every argument must be a tensor on ``target``'s device, ``pred`` and
    ``target`` float tensors of one shape, ``mask`` a bool tensor of that shape (``ValueError``
    / ``TypeError`` naming the argument otherwise).

    Args:
        pred, target: float tensors of one shape (e.g. ``[B, T]`` values and returns).
        mask: bool tensor of that shape.

    >>> m = torch.ones(4, dtype=torch.bool)
    >>> explained_variance(torch.tensor([0.0, 1.0, 2.0, 3.0]), torch.tensor([0.0, 1.0, 2.0, 4.0]), m)
    tensor(0.9143, dtype=torch.float64)
    >>> explained_variance(torch.zeros(4), torch.ones(4), m)     # constant targets
    tensor(nan, dtype=torch.float64)
    """
    check_float("pred", pred)
    check_float("target", target)
    check_same_shape("pred", pred, "target", target)  # and its device
    check_mask("mask", mask, target, "target")
    m = mask.reshape(-1)
    t = target.detach().reshape(-1).to(torch.float64)
    e = t - pred.detach().reshape(-1).to(torch.float64)
    n = m.sum().to(torch.float64)
    var_t, var_e = _biased_var64(t, m, n), _biased_var64(e, m, n)
    ok = (n > 0) & (var_t != 0)  # a NaN variance stays NaN below
    nan = torch.full((), float("nan"), dtype=torch.float64, device=t.device)
    return torch.where(ok, 1 - var_e / torch.where(ok, var_t, torch.ones_like(var_t)), nan)


def _biased_var64(x: Tensor, m: Tensor, n: Tensor) -> Tensor:
    """0-dim biased variance of the float64 values ``x`` where ``m``, for ``n = m.sum() > 0``:
    two-pass on the values shifted by their smallest selected one (exactly 0 for constant
    values); NaN if a selected value is NaN or ``+-inf``. Data-independent (runs on ``meta``)."""
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    inf = torch.full((), float("inf"), dtype=x.dtype, device=x.device)
    # NaN-propagating minimum (amin of a NaN is NaN); +inf where nothing is selected
    lo = torch.where(m, x, inf).amin() if x.numel() else inf
    d = torch.where(m, x - torch.where(torch.isfinite(lo), lo, zero), zero)
    nonfinite = torch.where(m, ~torch.isfinite(x), False).any()
    mean = d.sum() / n.clamp(min=1)
    v = torch.where(m, d - mean, zero).square().sum() / n.clamp(min=1)
    return torch.where(nonfinite, torch.full_like(v, float("nan")), v)
