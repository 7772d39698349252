"""Token entropy of the policy from its logits, and the entropy bonus loss term."""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from rollkit.keys import ENTROPY, ENTROPY_LOSS, RESPONSE_MASK
from rollkit.losses._common import (
    LOW_PRECISION,
    check_token_tensors,
    compute_dtype,
    masked_stat,
    zero_outside,
)
from rollkit.registry import REGULARIZERS
from rollkit.types import LossOutput
from rollkit.validation import check_float, check_ndim, check_positive, check_positive_int

__all__ = ["entropy_bonus", "entropy_from_logits", "entropy_from_logits_chunked"]

# Shifted logits below this are treated as probability 0 (exp(-1e4) == 0 in fp32 and fp64);
# it also turns -inf logits into finite numbers so that 0 * (-inf) never makes a NaN.
_MIN_SHIFTED = -1.0e4


def _entropy_rows(logits: Tensor) -> Tensor:
    z = logits.float() if logits.dtype in LOW_PRECISION else logits
    m = z.detach().amax(dim=-1, keepdim=True)
    # only an all -inf row is special-cased; NaN / +inf maxima propagate (to a NaN entropy)
    all_neg_inf = m == float("-inf")
    m = torch.where(all_neg_inf, torch.zeros_like(m), m)
    s = (z - m).clamp(min=_MIN_SHIFTED)  # [..., V], finite for finite or -inf logits
    e = torch.exp(s)
    total = e.sum(dim=-1)
    h = torch.log(total) - (e * s).sum(dim=-1) / total
    h = torch.where(all_neg_inf.squeeze(-1), torch.zeros_like(h), h)
    return h.to(logits.dtype)


def entropy_from_logits(logits: Tensor) -> Tensor:  # [..., V] -> [...]
    """Entropy of the categorical distribution ``softmax(logits)`` over the last dimension.

        H = -sum_v p_v log p_v = logsumexp(z) - sum_v softmax(z)_v z_v

    computed as ``log S - sum_v e_v s_v / S`` with ``s = z - max(z)``, ``e = exp(s)``,
    ``S = sum_v e_v`` (the logsumexp shift), so it is stable for any logit magnitude. Logits of
    ``-inf`` (masked vocabulary entries) have probability 0 and contribute exactly 0, with a
    finite gradient: there is no ``0 * log 0`` NaN as in ``(softmax * log_softmax).sum()``.
    The result is in ``[0, log V]``. A row whose logits are *all* ``-inf`` is not a
    distribution and gets 0 (finite, so that a masked row never poisons a sum). NaN / +inf
    logits propagate: such a row's entropy (and its gradient) is NaN.

    fp16 / bf16 logits are upcast to float32 inside (fp32 accumulation) and the result is
    cast back to the input dtype: it equals the float32 entropy of the same (low-precision)
    logits up to the rounding of the output (relative error <= 2^-8 for bf16, 2^-11 for fp16).
    The upcast materialises a float32 copy of ``logits``; for a large vocabulary use
    :func:`entropy_from_logits_chunked`.

    The standard entropy bonus of PPO (Schulman et al., 2017, arXiv:1707.06347); see
    :func:`entropy_bonus`.

    Shapes: ``[..., V]`` (e.g. ``[B, T, V]``) -> ``[...]`` (``[B, T]``).

    >>> import math
    >>> h = entropy_from_logits(torch.tensor([[0.0, 0.0, 0.0, 0.0], [0.0, 0.0, float("-inf"), float("-inf")]]))
    >>> torch.allclose(h, torch.tensor([math.log(4), math.log(2)]))
    True
    """
    check_float("logits", logits)
    check_ndim("logits", logits, tuple(range(1, 9)))
    return _entropy_rows(logits)


def entropy_from_logits_chunked(
    logits: Tensor,  # [..., V]
    *,
    chunk_size: int = 1024,
    checkpoint_chunks: bool = True,
) -> Tensor:  # [...]
    """:func:`entropy_from_logits`, computed ``chunk_size`` rows (of the flattened
    ``B * T`` positions) at a time, to bound the float32 temporaries to ``[chunk_size, V]``.

        H = concat_c entropy_from_logits(logits.reshape(-1, V)[c * chunk : (c + 1) * chunk])

    Same formula, same edge cases and the same values as the unchunked function (each row
    is reduced independently, so the chunking changes nothing but the peak memory). The loop
    is over ``ceil(B*T / chunk_size)`` fixed-size chunks, not over samples. When the logits
    require grad and ``checkpoint_chunks`` is True, each chunk is wrapped in
    :func:`torch.utils.checkpoint.checkpoint`, so the backward pass also keeps only one
    chunk's temporaries alive (it recomputes them) instead of ``[B*T, V]`` float32 buffers.
    Same idea as verl's ``entropy_from_logits_with_chunking``, which is forward-only.

    Shapes: ``[..., V]`` -> ``[...]``.

    >>> logits = torch.randn(2, 5, 7, generator=torch.Generator().manual_seed(0))
    >>> torch.allclose(entropy_from_logits_chunked(logits, chunk_size=3), entropy_from_logits(logits))
    True
    """
    check_float("logits", logits)
    check_ndim("logits", logits, tuple(range(1, 9)))
    chunk_size = check_positive_int("chunk_size", chunk_size)
    lead = logits.shape[:-1]
    flat = logits.reshape(-1, logits.shape[-1])
    use_ckpt = checkpoint_chunks and torch.is_grad_enabled() and logits.requires_grad
    parts = []
    for start in range(0, flat.shape[0], chunk_size):
        chunk = flat[start : start + chunk_size]
        if use_ckpt:
            parts.append(checkpoint(_entropy_rows, chunk, use_reentrant=False))
        else:
            parts.append(_entropy_rows(chunk))
    if not parts:
        return logits.new_zeros(lead)
    return torch.cat(parts).reshape(lead)


@REGULARIZERS.register(
    "entropy",
    aliases=("entropy_bonus", "entropy-bonus"),
    in_keys={"entropy": ENTROPY, "mask": RESPONSE_MASK},
    out_keys=[ENTROPY_LOSS],
)
def entropy_bonus(
    entropy: Tensor,  # [B, T] per-token entropy (with grad)
    mask: Tensor,  # [B, T] bool
    *,
    coef: float = 0.01,
) -> LossOutput:
    """Entropy bonus as a loss term: ``L_t = -coef * H_t``, 0 where mask is False.

    Minimising it maximises the policy entropy (Schulman et al., 2017, arXiv:1707.06347, the
    ``c2 * S[pi]`` term of the PPO objective; Williams & Peng, 1991). Unlike the KL terms it
    needs no reference model, only the full-vocabulary logits (see
    :func:`entropy_from_logits`). verl's ``entropy_coeff`` (default 0 in recent versions) and
    OpenRLHF's ``entropy_loss_coef`` play the role of ``coef``; aggregate with
    :func:`rollkit.losses.aggregate` like the policy loss.

    Metrics: ``"entropy"``, the token-mean entropy over the mask (0 for an empty mask).
    Half-precision entropies are upcast: the loss is float32 (``compute_dtype``), as for the
    policy losses; values under the mask (even NaN / inf) reach neither loss nor gradient.
    Registered in ``rollkit.registry.REGULARIZERS`` as ``"entropy"``: reads the ``"entropy"``
    key (``[B, T]``, e.g. written by ``entropy_from_logits``) and writes ``"entropy_loss"``.

    >>> out = entropy_bonus(torch.tensor([[1.0, 2.0]]), torch.tensor([[True, False]]), coef=0.1)
    >>> out.loss
    tensor([[-0.1000,  0.0000]])
    >>> out.metrics["entropy"]
    tensor(1.)
    """
    check_token_tensors(mask, entropy=entropy)
    check_positive("coef", coef, allow_zero=True)
    entropy = entropy.to(compute_dtype(entropy))
    loss = zero_outside(-coef * entropy, mask)
    return LossOutput(loss, {"entropy": masked_stat(entropy, mask)})
