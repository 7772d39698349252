"""Loss aggregation: turn a ``[B, T]`` per-token loss into the scalar to back-propagate.

Every rollkit loss returns a per-token matrix; :func:`aggregate` reduces it with one of five
modes, and takes optional *global* normalisers so that gradient accumulation over
micro-batches and data-parallel sharding give exactly the gradient of the full batch.

The classic bug (in many trainers) is to take a ``token-mean`` per micro-batch and average
those means: micro-batches with few valid tokens then weigh as much as long ones, and the
result depends on how the batch was split. Here, pass the counts of the whole batch::

    norms = global_normalizers(mask_of_the_whole_local_batch)          # all-reduced over ranks
    for mb in micro_batches:                                           # split along B
        out = some_loss(...)
        aggregate(out.loss, mb.mask, "token-mean", **norms).backward()  # sums to the full gradient

Definitions, for per-sample weights ``w_b`` (``1`` when ``weights`` is None), row token
counts ``n_b = sum_t m_bt`` and row sums ``s_b = sum_t m_bt * l_bt``:

===========================  ============================================================
mode                         result
===========================  ============================================================
``token-mean``               ``sum_b w_b s_b / num_tokens``, ``num_tokens = sum_b w_b n_b``
``token-sum``                ``sum_b w_b s_b`` (no normaliser)
``seq-mean-token-sum``       ``sum_b w_b s_b / num_seqs``
``seq-mean-token-mean``      ``sum_b w_b (s_b / n_b) / num_seqs``
``seq-mean-token-sum-norm``  ``sum_b w_b s_b / (num_seqs * norm_length)`` (Dr.GRPO)
===========================  ============================================================

``num_seqs = sum_{b: n_b > 0} w_b`` counts only the rows with at least one valid token (a
fully masked row is not a sequence of this loss: it contributes neither to the numerator nor
to the normaliser). This holds locally and in :func:`global_normalizers` alike.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from rollkit.keys import LOSS, LOSS_OBJECTIVE, RESPONSE_MASK, SAMPLE_WEIGHTS
from rollkit.losses._common import LOW_PRECISION, check_token_tensors, safe_div
from rollkit.registry import AGGREGATIONS
from rollkit.validation import (
    check_choice,
    check_finite,
    check_float,
    check_mask,
    check_ndim,
    check_positive_int,
    check_real,
    check_same_device,
    check_shape,
    values_readable,
)

__all__ = ["AGGREGATION_MODES", "aggregate", "global_normalizers"]

AGGREGATION_MODES: tuple[str, ...] = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)


def _check_weights(weights: Tensor, batch: int, like: Tensor, *, defer: list | None = None) -> None:
    """Metadata checks of ``weights``; the data checks (finite, ``>= 0``) only when
    :func:`~rollkit.validation.value_checks_enabled`, as one device-side flag: appended to
    ``defer`` (checked with the others in one synchronisation) or checked at once."""
    check_float("weights", weights)
    check_shape("weights", weights, [batch])
    check_same_device("weights", weights, "mask", like)
    if not values_readable("weights", weights):
        return
    bad = (~(torch.isfinite(weights) & (weights >= 0))).any()
    if defer is None:
        _raise_if_bad([(bad, lambda: _explain_weights(weights))])
    else:
        defer.append((bad, lambda: _explain_weights(weights)))


def _explain_weights(weights: Tensor) -> None:
    """Raise the detailed error for weights known to be bad (the slow path)."""
    check_finite("weights", weights)
    raise ValueError(f"weights: must be >= 0, got a minimum of {float(weights.min())}")


def _raise_if_bad(pending: list) -> None:
    """One host synchronisation for all the deferred data checks; on failure the first bad
    input's explanation raises its detailed error."""
    if not pending:
        return
    flags = torch.stack([bad.reshape(()).to(device=pending[0][0].device) for bad, _ in pending])
    if bool(flags.any()):
        for bad, explain in pending:
            if bool(bad):
                explain()


def _normalizer(name: str, value: float | Tensor, like: Tensor, defer: list) -> Tensor:
    """A global normaliser as a 0-dim tensor of ``like``'s dtype/device, validated.

    A tensor normaliser is never read on the host here: its shape is checked, and its value
    (finite, ``>= 0``) only when value checks are enabled, as a flag appended to ``defer``."""
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise ValueError(
                f"{name}: expected a scalar (0-dim or 1-element tensor), got shape {list(value.shape)}"
            )
        t = value.detach().reshape(()).to(dtype=like.dtype, device=like.device)
        if values_readable(name, t):

            def explain(t: Tensor = t) -> None:
                raise ValueError(f"{name}: must be finite and >= 0, got {float(t)}")

            defer.append((~(torch.isfinite(t) & (t >= 0)), explain))
        return t
    v = check_real(name, value)
    if not (v >= 0 and v != float("inf")):
        raise ValueError(f"{name}: must be finite and >= 0, got {value}")
    return torch.tensor(v, dtype=like.dtype, device=like.device)


def aggregate(
    loss: Tensor,  # [B, T] per-token loss
    mask: Tensor,  # [B, T] bool
    mode: str = "token-mean",
    *,
    weights: Tensor | None = None,  # [B] per-sample weights >= 0
    num_tokens: float | Tensor | None = None,
    num_seqs: float | Tensor | None = None,
    norm_length: int | None = None,
    dp_size: int = 1,
) -> Tensor:  # [] scalar
    """Reduce a ``[B, T]`` per-token loss to a scalar, locally or with global normalisers.

    With ``w_b`` the sample weights (1 if ``weights`` is None), ``n_b = sum_t m_bt`` and
    ``s_b = sum_t m_bt l_bt``::

        token-mean               sum_b w_b s_b / num_tokens                  num_tokens = sum_b w_b n_b
        token-sum                sum_b w_b s_b
        seq-mean-token-sum       sum_b w_b s_b / num_seqs                    num_seqs = sum_{b: n_b>0} w_b
        seq-mean-token-mean      sum_b w_b (s_b / n_b) / num_seqs
        seq-mean-token-sum-norm  sum_b w_b s_b / (num_seqs * norm_length)     (Dr.GRPO)

    and the result is multiplied by ``dp_size``.

    ``token-mean`` is the DAPO choice (Yu et al., 2025, arXiv:2503.14476: every token counts
    the same, long answers are not down-weighted); ``seq-mean-token-mean`` is the original
    GRPO (Shao et al., 2024, arXiv:2402.03300), which gives each sequence equal weight and so
    a length bias; ``seq-mean-token-sum-norm`` is Dr.GRPO (Liu et al., 2025,
    arXiv:2503.20783), which divides by a *constant* (``norm_length``, e.g. the maximum
    response length) instead of each sequence's length.

    **Weights** are sample weights in the sense of a weighted average: ``w_b`` scales both
    sample ``b``'s contribution and its share of the normaliser, so scaling every weight by
    the same constant changes nothing (``token-sum`` excepted). To multiply a loss by
    un-normalised weights (importance weights, say), multiply ``loss`` itself.

    **Global normalisers.** Without them, the normalisers are those of this (micro-)batch.
    With ``num_tokens`` / ``num_seqs`` of the *whole* batch (summed over micro-batches and
    data-parallel ranks, weighted as above; :func:`global_normalizers` computes them), the
    sum over micro-batches (split along ``B``) of their aggregates is exactly the aggregate
    of the full batch, and so are the gradients. Normalisers a mode does not use are ignored,
    so a single ``**global_normalizers(...)`` dict works for every mode. ``dp_size`` undoes the
    averaging of gradients over ranks that DDP / FSDP / DeepSpeed do (pass the world size;
    ``global_normalizers`` returns it); keep it 1 when gradients are summed.

    ``norm_length`` defaults to ``T`` (``loss.shape[-1]``, verl's default); pass a constant
    (the maximum response length) for Dr.GRPO and whenever micro-batches are padded to
    different lengths, or the split is not exact.

    Edge cases: an empty normaliser (fully masked batch, or all weights zero) gives exactly
    ``0`` with a zero gradient, never NaN; values of ``loss`` under ``mask == False`` (even
    NaN or inf) never reach the result or the gradient. Low-precision (fp16/bf16) losses are
    accumulated and returned in float32. Tensor normalisers are never converted to Python
    numbers; the data checks of ``weights`` and tensor normalisers (finite, ``>= 0``) cost one
    device synchronisation per call, and none inside ``rollkit.validation.value_checks(False)``.

    Args:
        loss: ``[B, T]`` float per-token loss.
        mask: ``[B, T]`` bool, True for tokens that count.
        mode: one of :data:`AGGREGATION_MODES`.
        weights: optional ``[B]`` float per-sample weights, finite and ``>= 0``.
        num_tokens: global (weighted) valid-token count, for ``token-mean``.
        num_seqs: global (weighted) count of non-empty sequences, for the ``seq-mean-*`` modes.
        norm_length: constant length normaliser of ``seq-mean-token-sum-norm`` (``> 0``).
        dp_size: multiplier that cancels a mean-reduction of gradients over ``dp_size`` ranks.

    Returns:
        A 0-dim tensor.

    >>> loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    >>> mask = torch.tensor([[True, True, True], [True, False, False]])
    >>> aggregate(loss, mask, "token-mean")          # (1 + 2 + 3 + 4) / 4
    tensor(2.5000)
    >>> aggregate(loss, mask, "seq-mean-token-mean")  # (2 + 4) / 2
    tensor(3.)
    >>> aggregate(loss, mask, "seq-mean-token-sum-norm", norm_length=5)  # (6 + 4) / (2 * 5)
    tensor(1.)
    >>> # micro-batches + global normalisers = the full-batch value (and gradient)
    >>> n = global_normalizers(mask)
    >>> parts = [aggregate(loss[i : i + 1], mask[i : i + 1], "token-mean", **n) for i in range(2)]
    >>> torch.allclose(sum(parts), aggregate(loss, mask, "token-mean"))
    True
    """
    check_choice("mode", mode, AGGREGATION_MODES)
    check_token_tensors(mask, loss=loss)
    if check_positive_int("dp_size", dp_size, allow_zero=True) < 1:
        raise ValueError(f"dp_size: must be an integer >= 1, got {dp_size}")
    dp_size = int(dp_size)
    if norm_length is not None:
        norm_length = check_positive_int("norm_length", norm_length)

    for name, value in (("num_tokens", num_tokens), ("num_seqs", num_seqs)):
        if value is not None and not isinstance(value, Tensor):  # unused ones too: "x" is never valid
            v = check_real(name, value)
            if not (v >= 0 and v != float("inf")):
                raise ValueError(f"{name}: must be finite and >= 0, got {value}")

    x = loss.float() if loss.dtype in LOW_PRECISION else loss
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    x = torch.where(mask, x, zero)
    row_sum = x.sum(dim=-1)  # [B]
    row_count = mask.sum(dim=-1).to(x.dtype)  # [B]
    pending: list = []  # deferred data checks: one host synchronisation at the end
    if weights is not None:
        _check_weights(weights, loss.shape[0], mask, defer=pending)
        w = weights.to(x.dtype)
    else:
        w = torch.ones_like(row_count)

    if mode == "token-sum":
        out = (w * row_sum).sum()
    elif mode == "token-mean":
        den = (
            (w * row_count).sum() if num_tokens is None else _normalizer("num_tokens", num_tokens, x, pending)
        )
        out = safe_div((w * row_sum).sum(), den)
    else:
        nonempty = row_count > 0
        if num_seqs is None:
            den = torch.where(nonempty, w, zero).sum()
        else:
            den = _normalizer("num_seqs", num_seqs, x, pending)
        if mode == "seq-mean-token-mean":
            per_seq = safe_div(row_sum, row_count)
        else:
            per_seq = row_sum
        if mode == "seq-mean-token-sum-norm":
            den = den * float(loss.shape[-1] if norm_length is None else norm_length)
        out = safe_div((w * per_seq).sum(), den)
    _raise_if_bad(pending)
    return out * dp_size if dp_size != 1 else out


def global_normalizers(
    mask: Tensor,  # [B, T] bool: the whole local batch (all micro-batches of this rank)
    weights: Tensor | None = None,  # [B]
    *,
    group: Any = None,
) -> dict[str, Any]:
    """The global normalisers of :func:`aggregate`, summed over data-parallel ranks.

        num_tokens = sum over ranks of sum_b w_b n_b
        num_seqs   = sum over ranks of sum_{b: n_b > 0} w_b
        dp_size    = world size of ``group`` (1 without torch.distributed)

    Call it once per optimisation step on the mask (and weights) of the whole local batch,
    *before* splitting it into micro-batches, then pass the result to every micro-batch's
    ``aggregate(..., **norms)``. When :mod:`torch.distributed` is initialised the counts are
    all-reduced (SUM) over ``group`` (default: the world), which is a collective: every rank
    must call it. Counts are float64 (exact up to 2**53 tokens). ``dp_size`` is there to
    cancel the gradient *averaging* of DDP / FSDP / DeepSpeed; if your trainer sums gradients
    over ranks, drop it (``norms.pop("dp_size")``) or set it to 1.

    Returns:
        ``{"num_tokens": Tensor[], "num_seqs": Tensor[], "dp_size": int}``.

    >>> m = torch.tensor([[True, True, False], [False, False, False], [True, False, False]])
    >>> n = global_normalizers(m)
    >>> (float(n["num_tokens"]), float(n["num_seqs"]), n["dp_size"])
    (3.0, 2.0, 1)
    """
    check_ndim("mask", mask, 2)
    check_mask("mask", mask)
    count = mask.sum(dim=-1).to(torch.float64)
    if weights is not None:
        _check_weights(weights, mask.shape[0], mask)
        w = weights.detach().to(torch.float64)
    else:
        w = torch.ones_like(count)
    counts = torch.stack([(w * count).sum(), torch.where(count > 0, w, torch.zeros_like(w)).sum()])
    dp_size = 1
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=group)
        dp_size = dist.get_world_size(group)
    return {"num_tokens": counts[0], "num_seqs": counts[1], "dp_size": dp_size}


# --------------------------------------------------------------------------- registry


def _bind(mode: str):
    def fn(
        loss: Tensor,
        mask: Tensor,
        weights: Tensor | None = None,
        *,
        num_tokens: float | Tensor | None = None,
        num_seqs: float | Tensor | None = None,
        norm_length: int | None = None,
        dp_size: int = 1,
    ) -> Tensor:
        return aggregate(
            loss,
            mask,
            mode,
            weights=weights,
            num_tokens=num_tokens,
            num_seqs=num_seqs,
            norm_length=norm_length,
            dp_size=dp_size,
        )

    fn.__name__ = fn.__qualname__ = "aggregate_" + mode.replace("-", "_")
    fn.__doc__ = (
        f"``aggregate(loss, mask, {mode!r}, weights=weights, **kwargs)``: [B, T] loss -> scalar "
        "(see :func:`rollkit.losses.aggregate`)."
    )
    return fn


# The registered wrappers take ``weights`` as an optional tensor argument (batch key
# ``"sample_weights"``, used when present) and write the scalar to ``"loss_objective"``, so
# that in a TensorDict pipeline the [B, T] ``"loss"`` they read is not overwritten.
_IN_KEYS = {"loss": LOSS, "mask": RESPONSE_MASK, "weights": SAMPLE_WEIGHTS}
for _mode in AGGREGATION_MODES:
    AGGREGATIONS.register(_mode, _bind(_mode), in_keys=_IN_KEYS, out_keys=[LOSS_OBJECTIVE])
del _mode
