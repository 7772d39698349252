"""Value (critic) loss of PPO, with the optional clipping of the value update."""

from __future__ import annotations

import torch
from torch import Tensor

from rollkit.keys import OLD_VALUES, RESPONSE_MASK, RETURNS, VALUE_LOSS, VALUES
from rollkit.losses._common import check_token_tensors, compute_dtype, masked_stat, zero_outside
from rollkit.ops import _pow2
from rollkit.registry import VALUE_LOSSES
from rollkit.types import LossOutput
from rollkit.validation import check_positive

__all__ = ["value_loss"]


def _mean_square(e: Tensor, mask: Tensor) -> Tensor:
    """Detached mean of ``e^2`` over ``mask`` (0 for an empty mask), without overflow: the
    squares are taken of ``e / p``, ``p`` a power of two near the largest ``|e|`` (exact), so
    the mean is ``inf`` only where it is beyond the dtype's range, not where one square is."""
    e = zero_outside(e.detach(), mask)
    p = _pow2(e.abs().amax()) if e.numel() else torch.ones((), dtype=e.dtype, device=e.device)
    q = e / p
    return (masked_stat(q * q, mask) * p) * p


@VALUE_LOSSES.register(
    "clipped",
    aliases=("value_loss", "ppo-value"),
    in_keys={"values": VALUES, "old_values": OLD_VALUES, "returns": RETURNS, "mask": RESPONSE_MASK},
    out_keys=[VALUE_LOSS],
)
def value_loss(
    values: Tensor,  # [B, T] critic predictions, carries the gradient
    old_values: Tensor,  # [B, T] critic predictions at rollout time
    returns: Tensor,  # [B, T] return targets
    mask: Tensor,  # [B, T] bool
    *,
    clip_range: float | None = 0.2,
    coef: float = 0.5,
) -> LossOutput:
    """Clipped PPO value loss: ``L_t = coef * max((V_t - R_t)^2, (V_clip_t - R_t)^2)``.

        V_clip_t = old_V_t + clip(V_t - old_V_t, -clip_range, clip_range)

    and ``L_t = coef * (V_t - R_t)^2`` (plain MSE) when ``clip_range`` is None. The
    pessimistic max of the clipped and unclipped errors is the value clipping of OpenAI
    baselines' PPO2 (Schulman et al., 2017, arXiv:1707.06347, as implemented; analysed by
    Engstrom et al., 2020, arXiv:2005.12729, who found it does not help in general). The
    default ``coef = 0.5`` is the ``0.5 * max(...)`` of baselines / verl / OpenRLHF / TRL.

    Differences: verl (``compute_value_loss``) computes exactly this with ``0.5`` and
    ``cliprange_value`` (default 0.5 in its critic config); OpenRLHF's ``ValueLoss`` clips the
    same way when ``clip_eps`` is set and is plain MSE otherwise, also times 0.5; TRL's PPO
    trainer also uses ``0.5 * max(...)`` and multiplies by ``vf_coef`` (0.1) on top; here any
    extra value-loss weight is folded into ``coef``. Aggregation (token-mean, ...) is left to
    :func:`rollkit.losses.aggregate`.

    Registered in ``rollkit.registry.VALUE_LOSSES`` as ``"clipped"`` (alias ``"value_loss"``;
    ``clip_range=None`` gives the plain MSE), writing ``"value_loss"``.

    Returns ``LossOutput(loss [B, T] (0 where mask is False), metrics)`` with the detached
    0-dim metrics ``"vf_clipfrac"`` (fraction of valid tokens where the clipped error is
    strictly larger, i.e. the clipped branch is used), ``"vf_mse"`` (token-mean unclipped
    squared error) and ``"values_mean"``; all 0 for a fully masked batch. Entries under
    ``mask == False`` (even NaN / inf padding) reach neither the loss nor the gradient.
    ``returns`` and ``old_values`` are targets (detached: they never receive a gradient), and
    half-precision inputs are upcast: the loss is float32 (``compute_dtype``).

    Numerics: the errors are formed as ``V / 2 - R / 2`` and ``coef`` multiplies them before
    they are squared, so finite inputs of any magnitude give the float64 loss rounded to the
    dtype, ``inf`` only where it is beyond the dtype's range (``coef = 0.5`` and an error of
    ``2e19``: ``2e38``, not ``inf``; ``coef = 0``: exactly 0, not ``0 * inf = NaN``), and the
    metrics are overflow-free means (``values_mean`` of ``3e38`` and ``-3e38`` is 0, not NaN).
    ``V_clip`` is ``V`` itself where the clip is inactive (not ``old_V + (V - old_V)``, which
    rounds to ``old_V``'s precision), so an inactive clip never counts in ``vf_clipfrac``.

    >>> v = torch.tensor([[1.0, 0.0]], requires_grad=True)
    >>> out = value_loss(v, torch.tensor([[0.0, 0.0]]), torch.tensor([[0.0, 1.0]]), torch.tensor([[True, True]]))
    >>> out.loss   # 0.5 * max(1, 0.2^2) and 0.5 * max(1, 1)
    tensor([[0.5000, 0.5000]], grad_fn=<WhereBackward0>)
    >>> out.metrics["vf_clipfrac"]
    tensor(0.)
    """
    check_token_tensors(mask, values=values, old_values=old_values, returns=returns)
    check_positive("coef", coef, allow_zero=True)
    if clip_range is not None:
        check_positive("clip_range", clip_range)

    # Upcast half precision (float32 loss, as the policy losses), treat the targets as constants,
    # and zero the masked-out entries first, so that NaN / inf padding never reaches the gradient.
    dtype = compute_dtype(values)
    values = zero_outside(values.to(dtype), mask)
    old_values, returns = (zero_outside(x.detach().to(dtype), mask) for x in (old_values, returns))
    # Half errors h = V/2 - R/2 cannot overflow for finite inputs (V - R can: 3e38 - (-3e38)).
    h_u = values / 2 - returns / 2
    a_u = h_u.abs()
    if clip_range is None:
        a, h = a_u, h_u
        clipped_used = torch.zeros_like(mask)
    else:
        # V itself where the clip is inactive: old + (V - old) would round to a multiple of
        # old's ulp (|old| = 1e30, V = 1e20: 0 in float32), clamp's gradient on the same set
        delta = values - old_values
        inside = delta.abs() <= clip_range
        v_clip = torch.where(inside, values, old_values + delta.clamp(-clip_range, clip_range))
        h_c = v_clip / 2 - returns / 2
        a_c = h_c.abs()
        a = torch.maximum(a_u, a_c)
        clipped_used = a_c > a_u
        h = torch.where(clipped_used, h_c, h_u)
    sq = (a * a) * 4  # max((V - R)^2, (V_clip - R)^2), rounded exactly as the plain square
    # coef * sq where the square is finite: bit for bit the usual formula. Where it overflowed:
    # the value (4 coef a) a (coef folded in first: the float64 loss rounded, 0 for coef = 0)
    # with the gradient 2 coef (V_used - R) = 4 coef h (clamped to the finite range), passed
    # straight through h (autograd through a * a would add two halves of it and overflow).
    big = torch.finfo(sq.dtype).max
    grad = ((4.0 * coef) * h.detach()).clamp(-big, big)
    over = grad * ((h - h.detach()) * 2) + (((4.0 * coef) * a) * a).detach()
    loss = zero_outside(torch.where(torch.isinf(sq), over, coef * sq), mask)
    metrics = {
        "vf_clipfrac": masked_stat(clipped_used.to(values.dtype), mask),
        "vf_mse": _mean_square(2 * h_u, mask),
        "values_mean": masked_stat(values, mask),
    }
    return LossOutput(loss, metrics)
