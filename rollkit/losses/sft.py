"""Supervised fine-tuning: the token NLL as a ``[B, T]`` loss matrix, and sequence log-probs.

:func:`sft_nll` follows the contract of the policy losses (a per-token matrix, aggregated by
:func:`rollkit.losses.aggregate`), so every aggregation mode and the global normalisers apply.
:func:`sequence_logprobs` reduces token log-probs to the ``[B]`` sequence log-probs that the
preference losses of :mod:`rollkit.losses.preference` take. Guide: ``docs/distillation.md``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rollkit.losses._common import check_token_tensors, compute_dtype, safe_div, zero_outside
from rollkit.types import LossOutput
from rollkit.validation import check_choice

__all__ = ["SEQUENCE_REDUCTIONS", "sequence_logprobs", "sft_nll"]

#: The reductions of :func:`sequence_logprobs`.
SEQUENCE_REDUCTIONS: tuple[str, ...] = ("sum", "mean")


def sft_nll(
    logprobs: Tensor,  # [B, T] log pi_theta of the target tokens; carries the gradient
    mask: Tensor,  # [B, T] bool
) -> LossOutput:
    """Negative log-likelihood of the target tokens, per token (maximum likelihood / SFT).

        L_t = -log pi_theta(y_t)      on valid tokens, 0 elsewhere

    The caller picks the weighting with :func:`rollkit.losses.aggregate`: ``"token-mean"`` is
    the usual cross-entropy over every target token of the batch (Hugging Face's
    ``CrossEntropyLoss`` with ``num_items_in_batch``), ``"seq-mean-token-mean"`` gives each
    sequence the same weight, ``"seq-mean-token-sum"`` sums each sequence's NLL (the negative
    sequence log-likelihood). With the global normalisers of
    :func:`rollkit.losses.global_normalizers`, micro-batching gives exactly the full-batch
    gradient (the bug that Hugging Face fixed with ``num_items_in_batch``).

    Values under ``mask == False`` (even NaN / inf) never reach the loss, the metrics or the
    gradient; half-precision input is computed in float32.

    Args:
        logprobs: ``[B, T]`` float, log-probs of the target tokens
            (``logits.log_softmax(-1).gather(-1, ids[..., None]).squeeze(-1)``).
        mask: ``[B, T]`` bool, True for target tokens (False for the prompt and padding).

    Returns:
        ``LossOutput(loss [B, T], metrics)``; metrics: ``nll`` (mean over valid tokens, 0 over
        an empty mask) and ``ppl`` (``exp(nll)``, a float64 scalar: finite up to a mean NLL of
        709.78, where a float32 one would overflow to ``inf`` past 88.72; float32 on MPS,
        which has no float64).

    >>> from rollkit.losses import aggregate
    >>> lp = torch.tensor([[-1.0, -2.0, 9.0], [-3.0, 9.0, 9.0]], requires_grad=True)
    >>> m = torch.tensor([[True, True, False], [True, False, False]])
    >>> out = sft_nll(lp, m)
    >>> out.loss
    tensor([[1., 2., 0.],
            [3., 0., 0.]], grad_fn=<WhereBackward0>)
    >>> aggregate(out.loss, m, "token-mean").item()            # (1 + 2 + 3) / 3
    2.0
    >>> aggregate(out.loss, m, "seq-mean-token-mean").item()   # (1.5 + 3) / 2
    2.25
    """
    check_token_tensors(mask, logprobs=logprobs)
    lp = zero_outside(logprobs.to(compute_dtype(logprobs)), mask)
    loss = -lp
    with torch.no_grad():
        n = mask.sum().to(loss.dtype)
        nll = safe_div(loss.detach().sum(), n)
        # float32's exp overflows past 88.72; float64's past 709.78 (MPS has no float64)
        ppl = nll.to(torch.float32 if nll.device.type == "mps" else torch.float64).exp()
    return LossOutput(zero_outside(loss, mask), {"nll": nll, "ppl": ppl})


def sequence_logprobs(
    logprobs: Tensor,  # [B, T]
    mask: Tensor,  # [B, T] bool
    *,
    reduction: str = "sum",
) -> Tensor:  # [B]
    """Sequence log-probs from token log-probs: the masked sum or mean over each row.

        reduction="sum":   log pi(y) = sum_t m_t log pi(y_t)
        reduction="mean":  (1 / n) sum_t m_t log pi(y_t),   n = sum_t m_t   (0 for an empty row)

    ``"sum"`` is the log-likelihood that DPO (Rafailov et al. 2023) uses; ``"mean"`` is the
    length-normalised one of SimPO and ORPO (which take sums and lengths instead, see
    :mod:`rollkit.losses.preference`) and of TRL's IPO. The gradient flows to ``logprobs``;
    values under the mask never matter, so the result does not depend on the padding.

    Args:
        logprobs: ``[B, T]`` float. mask: ``[B, T]`` bool.
        reduction: ``"sum"`` or ``"mean"``.

    Returns:
        ``[B]`` in the compute dtype (float32 for half-precision input).

    >>> lp = torch.tensor([[-1.0, -2.0, float("nan")], [-3.0, 0.0, 0.0]])
    >>> m = torch.tensor([[True, True, False], [True, False, False]])
    >>> sequence_logprobs(lp, m)
    tensor([-3., -3.])
    >>> sequence_logprobs(lp, m, reduction="mean")
    tensor([-1.5000, -3.0000])
    """
    check_token_tensors(mask, logprobs=logprobs)
    check_choice("reduction", reduction, SEQUENCE_REDUCTIONS)
    total = zero_outside(logprobs.to(compute_dtype(logprobs)), mask).sum(-1)
    if reduction == "sum":
        return total
    return safe_div(total, mask.sum(-1).to(total.dtype))
