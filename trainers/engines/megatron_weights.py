"""Weights of the Llama family (Llama, Qwen2, SmolLM2) between Hugging Face and Megatron-Core.

Megatron-Core (its local, TransformerEngine-free layer spec) names and shapes a decoder layer's
weights differently from a Hugging Face ``LlamaForCausalLM`` / ``Qwen2ForCausalLM``, and splits
them over ``tp`` tensor-parallel ranks and ``pp`` pipeline stages. The mapping, for layer ``i``
(``j = i - stage * layers / pp`` on its stage) and tensor-parallel rank ``r``::

    model.embed_tokens.weight [V, H]         -> embedding.word_embeddings.weight  rows r of V' / tp (stage 0)
    ...layers.i.input_layernorm.weight       -> decoder.layers.j.input_layernorm.weight       (replicated)
    ...self_attn.{q,k,v}_proj.{weight,bias}  -> decoder.layers.j.self_attention.linear_qkv.*  (fused, below)
    ...self_attn.o_proj.weight [H, nq d]     -> ...self_attention.linear_proj.weight  columns r of tp
    ...post_attention_layernorm.weight       -> decoder.layers.j.pre_mlp_layernorm.weight     (replicated)
    ...mlp.{gate,up}_proj.weight [I, H]      -> ...mlp.linear_fc1.weight [2 I / tp, H] = [gate_r; up_r]
    ...mlp.down_proj.weight [H, I]           -> ...mlp.linear_fc2.weight  columns r of tp
    model.norm.weight                        -> decoder.final_layernorm.weight                  (last stage)
    lm_head.weight [V, H] (untied)           -> output_layer.weight  rows r of V' / tp          (last stage)

The fused QKV weight is grouped by key-value head: with ``g`` key-value heads, ``q = nq / g``
query heads per group and head size ``d``, it is ``[g, (q + 2) d, H]`` flattened, each group
its ``q`` query heads then its key head then its value head, and rank ``r`` holds groups
``r g / tp .. (r + 1) g / tp``. The gate and up halves of ``linear_fc1`` are split *separately*
(each rank's shard is its rows of ``gate`` stacked on its rows of ``up``), so SwiGLU's
``silu(gate) * up`` pairs the right rows on every rank. The vocabulary is padded to ``V'``, a
multiple of ``tp`` (zero rows; their logits are cut before any softmax).

:func:`to_megatron` builds one rank's shard from Hugging Face weights and :func:`to_hf` merges
the shards back: the round trip is exact (only copies and concatenations). Pure functions over
tensors; :mod:`trainers.engines.megatron_train` calls them.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = ["Layout", "hf_names", "is_sharded", "layout_of", "megatron_names", "pairs", "to_hf", "to_megatron"]

_FAMILIES = ("llama", "qwen2")


def _rope_theta(config: Any) -> float:
    params = getattr(config, "rope_parameters", None) or {}
    scaling = getattr(config, "rope_scaling", None) or {}
    kind = params.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    if kind not in (None, "default"):
        raise ValueError(
            f"train.engine=megatron: rope_type {kind!r} of the model's config is not mapped "
            "(only the default RoPE is)"
        )
    return float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))


@dataclass(frozen=True)
class Layout:
    """A Llama-family model's shapes and its split over ``tp`` x ``pp`` ranks.

    ``padded_vocab``: the vocabulary rounded up to a multiple of ``tp``; ``qkv_bias``: q / k / v
    carry biases (Qwen2); ``tied``: the LM head is the input embedding."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    padded_vocab: int
    tied: bool
    qkv_bias: bool
    norm_eps: float
    rope_theta: float
    max_positions: int
    tp: int = 1
    pp: int = 1

    @property
    def layers_per_stage(self) -> int:
        return self.layers // self.pp

    def stage_layers(self, stage: int) -> range:
        """The global indices of the decoder layers on pipeline stage ``stage``."""
        n = self.layers_per_stage
        return range(stage * n, (stage + 1) * n)


def layout_of(config: Any, tp: int = 1, pp: int = 1) -> Layout:
    """The :class:`Layout` of a Hugging Face Llama / Qwen2 config, checked against ``tp`` / ``pp``
    (one-line errors naming ``train.megatron_tp`` / ``train.megatron_pp``)."""
    family = getattr(config, "model_type", None)
    if family not in _FAMILIES:
        raise ValueError(
            f"train.engine=megatron: model_type {family!r} is not mapped (supported: {', '.join(_FAMILIES)})"
        )
    if getattr(config, "hidden_act", "silu") != "silu":
        raise ValueError(f"train.engine=megatron: hidden_act {config.hidden_act!r} is not mapped (only silu)")
    if family == "llama" and (getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False)):
        raise ValueError("train.engine=megatron: Llama with attention_bias / mlp_bias is not mapped")
    heads, hidden = int(config.num_attention_heads), int(config.hidden_size)
    kv = int(getattr(config, "num_key_value_heads", None) or heads)
    layers = int(config.num_hidden_layers)
    if kv % tp:
        raise ValueError(f"train.megatron_tp: {tp} does not divide the model's {kv} key-value heads")
    if layers % pp:
        raise ValueError(f"train.megatron_pp: {pp} does not divide the model's {layers} layers")
    vocab = int(config.vocab_size)
    return Layout(
        layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=kv,
        head_dim=int(getattr(config, "head_dim", None) or hidden // heads),
        intermediate=int(config.intermediate_size),
        vocab=vocab,
        padded_vocab=math.ceil(vocab / tp) * tp,
        tied=bool(getattr(config, "tie_word_embeddings", False)),
        qkv_bias=family == "qwen2",
        norm_eps=float(config.rms_norm_eps),
        rope_theta=_rope_theta(config),
        max_positions=int(getattr(config, "max_position_embeddings", 4096)),
        tp=tp,
        pp=pp,
    )


# --------------------------------------------------------------------------- names


def _layer_pairs(lay: Layout, i: int, j: int) -> Iterator[tuple[tuple[str, ...], str]]:
    """``(hf names, megatron name)`` of layer ``i`` (local index ``j``)."""
    h, m = f"model.layers.{i}.", f"decoder.layers.{j}."
    yield (h + "input_layernorm.weight",), m + "input_layernorm.weight"
    yield tuple(f"{h}self_attn.{x}_proj.weight" for x in "qkv"), m + "self_attention.linear_qkv.weight"
    if lay.qkv_bias:
        yield tuple(f"{h}self_attn.{x}_proj.bias" for x in "qkv"), m + "self_attention.linear_qkv.bias"
    yield (h + "self_attn.o_proj.weight",), m + "self_attention.linear_proj.weight"
    yield (h + "post_attention_layernorm.weight",), m + "pre_mlp_layernorm.weight"
    yield (h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight"), m + "mlp.linear_fc1.weight"
    yield (h + "mlp.down_proj.weight",), m + "mlp.linear_fc2.weight"


def pairs(lay: Layout, stage: int) -> list[tuple[tuple[str, ...], str]]:
    """``(hf names, megatron name)`` of every weight pipeline stage ``stage`` holds, in
    Hugging Face ``named_parameters`` order (the tied LM head is not repeated; an untied one on
    the last stage; a tied one with ``pp > 1`` is the last stage's copy of the embedding)."""
    out: list[tuple[tuple[str, ...], str]] = []
    if stage == 0:
        out.append((("model.embed_tokens.weight",), "embedding.word_embeddings.weight"))
    for j, i in enumerate(lay.stage_layers(stage)):
        out.extend(_layer_pairs(lay, i, j))
    if stage == lay.pp - 1:
        out.append((("model.norm.weight",), "decoder.final_layernorm.weight"))
        if not lay.tied:
            out.append((("lm_head.weight",), "output_layer.weight"))
        elif lay.pp > 1:
            out.append((("model.embed_tokens.weight",), "output_layer.weight"))
    return out


def hf_names(lay: Layout) -> list[str]:
    """The Hugging Face parameter names of the whole model, in ``named_parameters`` order."""
    names: list[str] = []
    for stage in range(lay.pp):
        for hf, meg in pairs(lay, stage):
            if not (stage and meg == "output_layer.weight" and lay.tied):
                names.extend(hf)
    return names


def megatron_names(lay: Layout, stage: int) -> list[str]:
    """The Megatron parameter names stage ``stage`` holds (every tensor-parallel rank the same)."""
    return [meg for _, meg in pairs(lay, stage)]


# --------------------------------------------------------------------------- split / merge


def _kind(meg: str) -> str:
    for suffix, kind in (
        ("word_embeddings.weight", "vocab"),
        ("output_layer.weight", "vocab"),
        ("linear_qkv.weight", "qkv"),
        ("linear_qkv.bias", "qkv"),
        ("linear_proj.weight", "cols"),
        ("linear_fc2.weight", "cols"),
        ("linear_fc1.weight", "fc1"),
    ):
        if meg.endswith(suffix):
            return kind
    return "replicated"


def is_sharded(meg: str) -> bool:
    """Whether Megatron weight ``meg`` is split over the tensor-parallel ranks (else replicated)."""
    return _kind(meg) != "replicated"


def _split(kind: str, hf: Sequence[Tensor], lay: Layout, r: int) -> Tensor:
    tp = lay.tp
    if kind == "replicated":
        return hf[0].clone()
    if kind == "vocab":
        w = hf[0]
        if lay.padded_vocab > lay.vocab:
            w = torch.cat([w, w.new_zeros(lay.padded_vocab - lay.vocab, *w.shape[1:])])
        return w.chunk(tp)[r].clone()
    if kind == "cols":
        return hf[0].chunk(tp, dim=1)[r].clone()
    if kind == "fc1":
        gate, up = hf
        return torch.cat([gate.chunk(tp)[r], up.chunk(tp)[r]])
    q, k, v = hf  # qkv
    g, d = lay.kv_heads, lay.head_dim
    rest = q.shape[1:]
    grouped = torch.cat([q.reshape(g, -1, *rest), k.reshape(g, d, *rest), v.reshape(g, d, *rest)], 1)
    return grouped.chunk(tp)[r].reshape(-1, *rest).clone()


def _merge(kind: str, shards: Sequence[Tensor], lay: Layout) -> list[Tensor]:
    if kind == "replicated":
        return [shards[0]]
    if kind == "vocab":
        return [torch.cat(list(shards))[: lay.vocab]]
    if kind == "cols":
        return [torch.cat(list(shards), dim=1)]
    if kind == "fc1":
        halves = [s.chunk(2) for s in shards]
        return [torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])]
    g, d = lay.kv_heads, lay.head_dim  # qkv
    rest = shards[0].shape[1:]
    grouped = torch.cat([s.reshape(g // lay.tp, -1, *rest) for s in shards])  # [g, (q + 2) d, ...]
    q, k, v = grouped.split([grouped.shape[1] - 2 * d, d, d], dim=1)
    return [q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)]


def to_megatron(hf: Mapping[str, Tensor], lay: Layout, *, stage: int = 0, rank: int = 0) -> dict[str, Tensor]:
    """Pipeline stage ``stage``, tensor-parallel rank ``rank``'s Megatron weights from a Hugging
    Face state dict (``lm_head.weight`` may be absent when tied). A missing weight is a one-line
    ``KeyError`` naming it."""
    out: dict[str, Tensor] = {}
    for names, meg in pairs(lay, stage):
        missing = [n for n in names if n not in hf]
        if missing:
            raise KeyError(f"train.engine=megatron: the Hugging Face weights lack {missing[0]!r}")
        out[meg] = _split(_kind(meg), [hf[n] for n in names], lay, rank)
    return out


def merge(meg: str, shards: Sequence[Tensor], lay: Layout) -> list[Tensor]:
    """One Megatron weight's tensor-parallel shards (rank 0 first) as its Hugging Face tensors, in
    the order of its names in :func:`pairs` (a fused QKV: q, k, v; a fused gate/up: gate, up)."""
    return _merge(_kind(meg), shards, lay)


def to_hf(stage_shards: Mapping[str, Sequence[Tensor]], lay: Layout, stage: int) -> dict[str, Tensor]:
    """Merge one pipeline stage's weights, ``{megatron name: [shard of rank 0, ..., rank tp-1]}``,
    into Hugging Face names (the inverse of :func:`to_megatron`; a tied model's last-stage copy of
    the embedding is left out)."""
    out: dict[str, Tensor] = {}
    for names, meg in pairs(lay, stage):
        if stage and lay.tied and meg == "output_layer.weight":
            continue
        for name, t in zip(names, _merge(_kind(meg), stage_shards[meg], lay), strict=True):
            out[name] = t
    return out
