"""Value (critic) loss of PPO, with the optional clipping of the value update."""

from __future__ import annotations

import torch
from torch import Tensor

from rollkit.keys import OLD_VALUES, RESPONSE_MASK, RETURNS, VALUE_LOSS, VALUES
from rollkit.losses._common import check_token_tensors, compute_dtype, masked_stat, zero_outside
from rollkit.registry import VALUE_LOSSES
from rollkit.types import LossOutput
from rollkit.validation import check_positive

__all__ = ["value_loss"]


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
    unclipped = (values - returns).square()
    if clip_range is None:
        per_token = unclipped
        clipped_used = torch.zeros_like(mask)
    else:
        v_clip = old_values + (values - old_values).clamp(-clip_range, clip_range)
        clipped = (v_clip - returns).square()
        per_token = torch.maximum(unclipped, clipped)
        clipped_used = clipped > unclipped
    loss = zero_outside(coef * per_token, mask)
    metrics = {
        "vf_clipfrac": masked_stat(clipped_used.to(unclipped.dtype), mask),
        "vf_mse": masked_stat(unclipped, mask),
        "values_mean": masked_stat(values, mask),
    }
    return LossOutput(loss, metrics)
