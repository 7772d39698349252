"""Padding-free ("packed") forwards for the training engines (``train.packing``).

A micro-batch of ``B`` padded rows ``[B, P + T]`` runs as **one row of ``N`` real tokens**:
:func:`rollkit.packing.packed_layout` gathers each row's real tokens end to end, the position
ids restart at 0 for every sample (so each sample sees the positions it has in the padded
layout, ``cumsum(attention_mask) - 1``), and the attention stays inside each sample
(block-diagonal causal attention over the cumulative lengths ``cu_seqlens``). Only the ``M``
positions that predict a response token go through the LM head (or the value head):
:func:`rollkit.packing.response_positions`. The outputs are scattered back to ``[B, T]``, so
the caller sees exactly the padded path's log-probs (tested equal, values and gradients, in
float32). Compute: ``sum_b len_b`` tokens instead of ``B (P + T)``, and attention
``sum_b len_b^2`` instead of ``B (P + T)^2``.

Attention. A Hugging Face model keeps its attention implementation; :func:`enable_packing`
switches ``sdpa`` / ``eager`` models to ``"rollkit_packed"`` (registered with transformers'
``AttentionInterface``), which runs

* packed calls (the forward got ``cu_seq_lens_q``): on CUDA in bf16 / fp16, PyTorch's
  flash-attention varlen kernel (``torch.nn.attention.varlen.varlen_attn``, causal) where this
  torch has it; otherwise (CPU, float32) an exact loop of causal
  ``scaled_dot_product_attention`` over the samples (``O(N)`` memory, no ``[N, N]`` mask);
* every other call (generation, the padded path): transformers' ``sdpa`` attention with the
  ``sdpa`` mask, unchanged.

``flash_attention_2/3/4`` models are left as they are: transformers' flash path reads the same
``cu_seq_lens_q`` / ``max_length_q`` keyword arguments. Other implementations (``flex_attention``,
paged) are refused with a one-line error naming ``train.packing``. Sliding-window layers are
refused too (the varlen loop is full causal).
"""

from __future__ import annotations

import contextlib
import itertools
from typing import Any

import torch
from torch import Tensor

from rollkit.packing import PackedLayout, pack_tokens, packed_layout, response_positions

__all__ = [
    "PACKED_ATTENTION",
    "PackedCall",
    "enable_packing",
    "packed_attention_forward",
    "packed_call",
    "scatter_response",
    "unwrap_hf",
]

PACKED_ATTENTION = "rollkit_packed"
NATIVE_VARLEN = ("flash_attention_2", "flash_attention_3", "flash_attention_4")


def _varlen_kernel() -> Any:
    with contextlib.suppress(ImportError, AttributeError):
        from torch.nn.attention.varlen import varlen_attn

        return varlen_attn
    return None


def packed_attention_forward(
    module: Any,
    query: Tensor,  # [1, H, N, D]
    key: Tensor,  # [1, H_kv, N, D]
    value: Tensor,  # [1, H_kv, N, D]
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:  # [1, N, H, D]
    """transformers' attention-function signature. With ``cu_seq_lens_q`` (``[S + 1]`` int32,
    the packed row's cumulative sample lengths): causal attention within each sample,

        out[i] = softmax_{j in seq(i), j <= i}(q_i . k_j * scaling) v_j

    (the dense equivalent is :func:`rollkit.packing.varlen_attention_mask`); ``attention_mask``
    is ignored then (the packed call passes a placeholder). Without it: transformers' ``sdpa``
    attention, for every ordinary call of the same model."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)  # fmt: skip
    if kwargs.get("sliding_window") is not None:
        raise ValueError(
            "train.packing: sliding-window attention layers are not supported by the packed attention"
        )
    if query.shape[0] != 1:
        raise ValueError(f"train.packing: a packed call has one row, got a batch of {query.shape[0]}")
    gqa = query.shape[1] != key.shape[1]
    kernel = _varlen_kernel()
    if kernel is not None and query.is_cuda and query.dtype in (torch.bfloat16, torch.float16):
        max_len = int(kwargs.get("max_length_q") or int(cu.diff().max()))
        out = kernel(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1), cu, cu,
                     max_len, max_len, scale=scaling, window_size=(-1, 0), enable_gqa=gqa)  # fmt: skip
        return out.unsqueeze(0), None
    sdpa = torch.nn.functional.scaled_dot_product_attention
    kw = {"dropout_p": dropout, "is_causal": True, "scale": scaling, "enable_gqa": gqa}
    parts = [
        sdpa(query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], **kw)
        for a, b in itertools.pairwise(cu.tolist())
        if b > a
    ]
    out = torch.cat(parts, dim=2) if parts else query[:, :, :0]
    return out.transpose(1, 2).contiguous(), None


def unwrap_hf(model: Any) -> Any:
    """The Hugging Face model under a DeepSpeed engine (``.module``) or a peft wrapper."""
    model = getattr(model, "module", model)
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def enable_packing(model: Any) -> str:
    """Make ``model`` (a transformers model, under DeepSpeed / peft / FSDP2 wrappers) run packed
    calls; returns its attention implementation afterwards. Idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(PACKED_ATTENTION, packed_attention_forward)
    AttentionMaskInterface.register(PACKED_ATTENTION, sdpa_mask)
    hf = unwrap_hf(model)
    config = getattr(hf, "config", None)
    impl = getattr(config, "_attn_implementation", None)
    if impl in NATIVE_VARLEN or impl == PACKED_ATTENTION:
        return impl
    if impl not in ("sdpa", "eager", None):
        raise ValueError(
            f"train.packing: the model's attention implementation {impl!r} has no packed path "
            "(use sdpa, eager or flash_attention_2, or train.packing=false)"
        )
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        layer_types = getattr(config, "layer_types", None) or []
        if "sliding_attention" in layer_types:
            raise ValueError(
                "train.packing: the model has sliding-window attention layers (set train.packing=false)"
            )
    hf.set_attn_implementation(PACKED_ATTENTION)
    return PACKED_ATTENTION


class PackedCall:
    """One micro-batch's packed row: ``kwargs`` for the model call (``input_ids [1, N]``,
    ``position_ids``, the varlen keyword arguments, the attention placeholder), ``keep`` the
    ``M`` packed positions that predict a response token (row-major over ``response_mask``),
    ``targets [1, M]`` the tokens they predict, and ``response_mask`` to scatter back."""

    def __init__(self, model: Any, input_ids: Tensor, attention_mask: Tensor, response_mask: Tensor) -> None:
        B, L = input_ids.shape
        T = response_mask.shape[1]
        self.layout: PackedLayout = packed_layout(attention_mask)
        self.response_mask = response_mask.to(input_ids.device, torch.bool)
        pos = response_positions(self.layout, L - T, self.response_mask)
        self.keep = pos[self.response_mask]  # [M]
        ids = pack_tokens(input_ids, self.layout)  # [1, N]
        self.targets = ids[:, self.keep + 1]  # [1, M]
        cu = self.layout.cu_seqlens
        impl = getattr(getattr(unwrap_hf(model), "config", None), "_attn_implementation", None)
        if impl not in NATIVE_VARLEN and impl != PACKED_ATTENTION:
            raise RuntimeError(
                f"packed forward on a model whose attention is {impl!r}: call enable_packing first"
            )
        # rollkit_packed ignores the mask of a packed call; a 4D tensor makes transformers skip
        # building one (an [N, N] mask is what packing avoids). flash_attention_* take None.
        placeholder = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=input_ids.device)
        self.kwargs = {
            "input_ids": ids,
            "attention_mask": placeholder if impl == PACKED_ATTENTION else None,
            "position_ids": self.layout.position_ids,
            "cu_seq_lens_q": cu,
            "cu_seq_lens_k": cu,
            "max_length_q": self.layout.max_seqlen,
            "max_length_k": self.layout.max_seqlen,
            "use_cache": False,
        }
        self.shape = (B, T)


def packed_call(model: Any, input_ids: Tensor, attention_mask: Tensor, response_mask: Tensor) -> PackedCall:
    """:class:`PackedCall` of a micro-batch in the layout of ``trainers.engines.base.pack``."""
    return PackedCall(model, input_ids, attention_mask, response_mask)


def scatter_response(values: Tensor, call: PackedCall) -> Tensor:  # [1, M] or [M] -> [B, T]
    """The ``M`` per-response-token values back to ``[B, T]``, 0 off the response mask
    (differentiable)."""
    flat = values.reshape(-1)
    out = torch.zeros(call.shape, dtype=flat.dtype, device=flat.device)
    return out.masked_scatter(call.response_mask.to(flat.device), flat)
