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
import warnings
from typing import Any

import torch
from torch import Tensor

from rollkit.packing import PackedLayout, pack_tokens, packed_layout, response_positions
from trainers.deps import require

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


_VARLEN_BROKEN: list[str] = []  # why this torch's varlen_attn could not be called (then the loop serves)


def _varlen_kernel() -> Any:
    if _VARLEN_BROKEN:
        return None
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
    groups = kwargs.get("rollkit_prefix_groups")
    if groups is not None:
        return _prefix_attention(
            query, key, value, groups, dropout, scaling, kwargs.get("sliding_window")
        ), None
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        sdpa_attention_forward = require("transformers.integrations.sdpa_attention").sdpa_attention_forward
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
        try:
            out = kernel(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1), cu, cu,
                         max_len, max_len, scale=scaling, window_size=(-1, 0), enable_gqa=gqa)  # fmt: skip
            return out.unsqueeze(0), None
        except TypeError as e:  # an older torch's varlen_attn without these arguments: the loop below
            _VARLEN_BROKEN.append(str(e))
            warnings.warn(
                f"train.packing: torch's varlen_attn refused the call ({e}); using the exact loop",
                stacklevel=2,
            )
    sdpa = torch.nn.functional.scaled_dot_product_attention
    kw = {"dropout_p": dropout, "is_causal": True, "scale": scaling, "enable_gqa": gqa}
    parts = [
        sdpa(query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], **kw)
        for a, b in itertools.pairwise(cu.tolist())
        if b > a
    ]
    out = torch.cat(parts, dim=2) if parts else query[:, :, :0]
    return out.transpose(1, 2).contiguous(), None


def _prefix_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    groups: list,
    dropout: float,
    scaling: float | None,
    window: Any,
) -> Tensor:  # [1, N, H, D]
    """Attention of a prefix-shared packed row (:class:`PackedCall` with shared prompts): for
    each group ``(ps, pe, [(rs, re), ...])`` the prompt ``ps:pe`` attends causally to itself, and
    each response ``rs:re`` to the whole prompt and causally to itself (never to the group's
    other responses): exactly each sample's causal attention over its own prompt + response."""
    if window is not None:
        raise ValueError(
            "train.packing: sliding-window attention layers are not supported by the packed attention"
        )
    if query.shape[0] != 1:
        raise ValueError(f"train.packing: a packed call has one row, got a batch of {query.shape[0]}")
    sdpa = torch.nn.functional.scaled_dot_product_attention
    kw = {"dropout_p": dropout, "scale": scaling, "enable_gqa": query.shape[1] != key.shape[1]}
    parts = []
    for ps, pe, segs in groups:
        parts.append(sdpa(query[:, :, ps:pe], key[:, :, ps:pe], value[:, :, ps:pe], is_causal=True, **kw))
        for rs, re in segs:
            if re == rs:
                continue
            r, p = re - rs, pe - ps
            k = torch.cat([key[:, :, ps:pe], key[:, :, rs:re]], dim=2)
            v = torch.cat([value[:, :, ps:pe], value[:, :, rs:re]], dim=2)
            allowed = torch.ones(r, p + r, dtype=torch.bool, device=query.device)
            allowed[:, p:] = torch.ones(r, r, dtype=torch.bool, device=query.device).tril_()
            parts.append(sdpa(query[:, :, rs:re], k, v, attn_mask=allowed, **kw))
    return torch.cat(parts, dim=2).transpose(1, 2).contiguous()


def unwrap_hf(model: Any) -> Any:
    """The Hugging Face model under a DeepSpeed engine (``.module``) or a peft wrapper."""
    model = getattr(model, "module", model)
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def enable_packing(model: Any) -> str:
    """Make ``model`` (a transformers model, under DeepSpeed / peft / FSDP2 wrappers) run packed
    calls; returns its attention implementation afterwards. Idempotent."""
    masking = require("transformers.masking_utils")
    require("transformers").AttentionInterface.register(PACKED_ATTENTION, packed_attention_forward)
    masking.AttentionMaskInterface.register(PACKED_ATTENTION, masking.sdpa_mask)
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
    ``position_ids``, the varlen keyword arguments or the prefix groups, the attention
    placeholder), ``keep`` the ``M`` packed positions that predict a response token (row-major
    over ``response_mask``; with shared prompts a prompt's last token predicts the first response
    token of every row of its group), ``targets [1, M]`` the tokens they predict, and
    ``response_mask`` to scatter back. ``shared``: whether the prefix-shared layout was used."""

    def __init__(
        self,
        model: Any,
        input_ids: Tensor,
        attention_mask: Tensor,
        response_mask: Tensor,
        *,
        share: bool = False,
    ) -> None:
        B, L = input_ids.shape
        T = response_mask.shape[1]
        self.response_mask = response_mask.to(input_ids.device, torch.bool)
        self.shape = (B, T)
        impl = getattr(getattr(unwrap_hf(model), "config", None), "_attn_implementation", None)
        if impl not in NATIVE_VARLEN and impl != PACKED_ATTENTION:
            raise RuntimeError(
                f"packed forward on a model whose attention is {impl!r}: call enable_packing first"
            )
        # rollkit_packed ignores the mask of a packed call; a 4D tensor makes transformers skip
        # building one (an [N, N] mask is what packing avoids). flash_attention_* take None.
        placeholder = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=input_ids.device)
        self.shared = (
            share and impl == PACKED_ATTENTION and B > 1 and self._share(input_ids, attention_mask, T)
        )
        if self.shared:
            self.kwargs["attention_mask"] = placeholder
            return
        self.layout: PackedLayout = packed_layout(attention_mask)
        pos = response_positions(self.layout, L - T, self.response_mask)
        self.keep = pos[self.response_mask]  # [M]
        ids = pack_tokens(input_ids, self.layout)  # [1, N]
        self.targets = ids[:, self.keep + 1]  # [1, M]
        cu = self.layout.cu_seqlens
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

    def _share(self, input_ids: Tensor, attention_mask: Tensor, T: int) -> bool:
        """The prefix-shared layout, when rows repeat a prompt (and the packed attention is not
        the CUDA varlen kernel, which takes one sequence per sample): each distinct prompt once,
        then the responses of its rows, each attending to that prompt and to itself
        (:func:`_prefix_attention`). Same per-sample attention and positions as the padded path;
        the prompt costs ``U / B`` of its compute (``U`` distinct prompts). False: not shared."""
        B, L = input_ids.shape
        P = L - T
        if input_ids.is_cuda and _varlen_kernel() is not None:
            return False
        am = attention_mask.to(torch.bool)
        prompts = torch.cat([input_ids[:, :P], am[:, :P].to(input_ids.dtype)], 1)
        _, inv = torch.unique(prompts, dim=0, return_inverse=True)
        members: dict[int, list[int]] = {}
        for b, u in enumerate(inv.tolist()):
            members.setdefault(u, []).append(b)
        if len(members) == B:
            return False
        dev = input_ids.device
        inverse = torch.full((B, L), -1, dtype=torch.int64, device=dev)
        order, groups, n = [], [], 0
        for rows in members.values():
            r0 = rows[0]
            pcols = am[r0, :P].nonzero().squeeze(1)
            order.append(r0 * L + pcols)
            inverse[r0, pcols] = torch.arange(n, n + len(pcols), device=dev)
            ps, pe = n, n + len(pcols)
            n, segs = pe, []
            for b in rows:
                inverse[b, :P] = inverse[r0, :P]
                rcols = am[b, P:].nonzero().squeeze(1) + P
                order.append(b * L + rcols)
                inverse[b, rcols] = torch.arange(n, n + len(rcols), device=dev)
                segs.append((n, n + len(rcols)))
                n += len(rcols)
            groups.append((ps, pe, segs))
        flat = torch.cat(order)
        rank = (am.cumsum(-1) - 1).reshape(-1)
        pred = inverse[:, P - 1 : P - 1 + T]  # the column that predicts response token t
        if bool((pred[self.response_mask] < 0).any()):
            raise ValueError("response_mask: a response token is set where the attention mask has padding")
        self.keep = pred[self.response_mask]
        self.targets = input_ids[:, P:][self.response_mask].unsqueeze(0)
        self.kwargs = {
            "input_ids": input_ids.reshape(-1)[flat].unsqueeze(0),
            "position_ids": rank[flat].unsqueeze(0),
            "rollkit_prefix_groups": groups,
            "use_cache": False,
        }
        return True


def packed_call(
    model: Any, input_ids: Tensor, attention_mask: Tensor, response_mask: Tensor, *, share: bool = False
) -> PackedCall:
    """:class:`PackedCall` of a micro-batch in the layout of ``trainers.engines.base.pack``;
    ``share``: each distinct prompt once (the prefix-shared layout) where rows repeat one."""
    return PackedCall(model, input_ids, attention_mask, response_mask, share=share)


def scatter_response(values: Tensor, call: PackedCall) -> Tensor:  # [1, M] or [M] -> [B, T]
    """The ``M`` per-response-token values back to ``[B, T]``, 0 off the response mask
    (differentiable)."""
    flat = values.reshape(-1)
    out = torch.zeros(call.shape, dtype=flat.dtype, device=flat.device)
    return out.masked_scatter(call.response_mask.to(flat.device), flat)
