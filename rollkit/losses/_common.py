"""Private helpers shared by the loss modules: input checks, masking, dtypes, safe division.

Nothing here is public API; the helpers exist so that every loss validates ``[B, T]`` inputs
with the same messages and treats masked-out entries (even NaN / inf padding) the same way.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rollkit.ops import masked_mean
from rollkit.validation import check_float, check_mask, check_ndim, check_same_shape

#: Half-precision dtypes that losses upcast to float32 before accumulating.
LOW_PRECISION = (torch.float16, torch.bfloat16)


def compute_dtype(x: Tensor) -> torch.dtype:
    """The dtype a loss computes in: ``x``'s, promoted to at least float32."""
    return torch.promote_types(x.dtype, torch.float32)


def check_token_tensors(mask: Tensor, **tensors: Tensor) -> None:
    """Validate ``[B, T]`` float tensors and their bool ``mask``.

    The first keyword tensor is the reference: float and 2-D; every other one must be float
    with the reference's shape; ``mask`` a bool tensor of the same shape. Errors name the
    argument (``"old_logprobs: shape [2, 4] does not match logprobs shape [2, 3]"``).
    """
    (ref_name, ref), *others = tensors.items()
    check_float(ref_name, ref)
    check_ndim(ref_name, ref, 2)
    for name, x in others:
        check_float(name, x)
        check_same_shape(name, x, ref_name, ref)
    check_mask("mask", mask, ref, ref_name)


def check_seq_or_token(name: str, x: Tensor, ref_name: str, ref: Tensor) -> None:
    """``x`` is ``[B]`` (one value per row of ``ref``) or ``ref``'s ``[B, T]`` shape."""
    if x.ndim == 1:
        if x.shape[0] != ref.shape[0]:
            raise ValueError(f"{name}: has {x.shape[0]} entries but {ref_name} has {ref.shape[0]} rows")
    elif x.shape != ref.shape:
        raise ValueError(f"{name}: shape {list(x.shape)} is neither [B] nor {ref_name}' {list(ref.shape)}")


def zero_outside(x: Tensor, mask: Tensor) -> Tensor:
    """``where(mask, x, 0)``: exactly 0 (and no gradient) where ``mask`` is False."""
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))


def masked_stat(x: Tensor, mask: Tensor) -> Tensor:
    """Detached mean of ``x`` over ``mask`` (0 for an empty mask): a loss metric."""
    return masked_mean(x.detach(), mask, empty_value=0.0)


def safe_div(num: Tensor, den: Tensor) -> Tensor:
    """``num / den``, and exactly 0 (with a zero gradient) where ``den == 0``."""
    ok = den > 0
    return torch.where(ok, num / torch.where(ok, den, torch.ones_like(den)), torch.zeros_like(num))
