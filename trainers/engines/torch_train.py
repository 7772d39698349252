"""The embedded-default training engine: plain PyTorch, one process or data parallel over gloo.

:class:`TorchTrainEngine` wraps a Hugging Face causal LM and an optimizer:

    lp = engine.logprobs(batch.input_ids, batch.attention_mask, batch.response_mask, temperature=T)
    out = rollkit.losses.ppo_clip(lp, batch.old_logprobs, adv, batch.response_mask)
    engine.backward(rollkit.losses.aggregate(out.loss, batch.response_mask, "token-mean", **norms))
    metrics = engine.step()                      # clip, optimizer step, scheduler, zero_grad
    rollout.update_weights(engine.export_weights(), version)

Gradient accumulation: call ``logprobs`` + ``backward`` once per micro-batch, then ``step``
once. With rollkit's global normalisers (``norms = rollkit.losses.global_normalizers(mask
of the whole batch)``) passed to every micro-batch's ``aggregate``, the accumulated gradient
is the full-batch gradient, whatever the split.

Data parallel: when :mod:`torch.distributed` is initialised with more than one rank (gloo on
CPU, NCCL on GPUs), the engine broadcasts rank 0's weights at construction and, in
:meth:`step`, all-reduces the accumulated gradients and divides them by the world size before
clipping: the gradient *average* of DDP, taken once per step (so micro-batches need no
``no_sync``). rollkit's ``global_normalizers`` returns ``dp_size`` to cancel that average:
pass it to ``aggregate`` and every rank's loss is a share of the *global* batch loss. Every
rank must call :meth:`step` (it is a collective). Sharded parameters: the DeepSpeed engine
(ZeRO 1-3) and :class:`trainers.engines.fsdp2_train.FSDP2TrainEngine` (FSDP2).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from rollkit.logprobs import lean_token_logprobs
from rollkit.logprobs import token_logprobs as replay_logprobs
from rollkit.losses import entropy_from_logits
from trainers.engines.base import position_ids_from_mask
from trainers.engines.compiled import adamw, prepare_model
from trainers.engines.lora import is_lora, lora_export_weights, save_lora
from trainers.engines.offload import Offloadable, resident, state_tensors
from trainers.engines.options import lora_export, train_autocast
from trainers.engines.packed import PackedCall, packed_call, scatter_response
from trainers.engines.precision import MasterWeights
from trainers.models import save_model
from trainers.vision import position_ids as vision_position_ids
from trainers.vision import text_only_response, to_device, vision_base

__all__ = [
    "TorchTrainEngine",
    "packed_hidden",
    "response_hidden",
    "response_logits",
    "response_logprobs",
    "token_logprobs",
    "used_response_width",
]


def token_logprobs(
    logits: Tensor,  # [B, T, V]
    tokens: Tensor,  # [B, T]
    temperature: float = 1.0,
) -> Tensor:  # [B, T] float32
    """``log_softmax(logits / temperature)`` gathered at ``tokens``, in float32.

    Computed as ``z[token] - logsumexp(z)`` (stable, and without materialising the
    ``[B, T, V]`` log-softmax beyond ``z`` itself).
    """
    z = logits.float()
    if temperature != 1.0:
        z = z / temperature
    return z.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(z, dim=-1)


def response_logits(
    model: Any,
    input_ids: Tensor,  # [B, P + T] (layout of trainers.engines.base.pack)
    attention_mask: Tensor,  # [B, P + T]
    T: int,
    *,
    share_prompts: bool = True,
    inputs: dict[str, Tensor] | None = None,
) -> Tensor:  # [B, T, V]
    """The logits that predict the ``T`` response tokens: row ``b``, column ``t`` holds the
    logits at position ``P - 1 + t`` (which predict token ``P + t``).

    Prompt sharing (``share_prompts``): in RL batches the ``n`` samples of a prompt repeat it
    token for token. The distinct prompts (rows of ``input_ids[:, :P]`` with their mask) go
    through the model once, with the KV cache on; the cache is gathered to the ``B`` rows
    (an index, so the backward sums the rows' gradients into the shared prompt), and the
    responses run on top of it. Attention sees exactly the same keys and values at the same
    positions as in one forward over the whole sequence, so the logits and gradients are the
    same up to float rounding (tested to 1e-5), while the prompt costs ``U / B`` of the
    compute (``U`` distinct prompts). Used when there are fewer distinct prompts than rows;
    otherwise, and with ``share_prompts=False``, one ordinary forward over ``[B, P + T]``
    (only the last ``T + 1`` positions go through the LM head).

    ``inputs``: the rows' image inputs (a vision-language model, :mod:`trainers.vision`):
    passed to the forward with the model's own positions (M-RoPE); no prompt sharing then.
    """
    B, L = input_ids.shape
    P = L - T
    if inputs:
        ids = text_only_response(model, input_ids, T)
        pos = vision_position_ids(model, ids, attention_mask, inputs)
        out = model(input_ids=ids, attention_mask=attention_mask, position_ids=pos, use_cache=False,
                    logits_to_keep=T + 1, **inputs)  # fmt: skip
        return out.logits[:, :-1]
    pos = position_ids_from_mask(attention_mask)
    if share_prompts and B > 1 and T > 0:
        uniq, inv = torch.unique(
            torch.cat([input_ids[:, :P], attention_mask[:, :P].to(input_ids.dtype)], 1),
            dim=0,
            return_inverse=True,
        )
        if uniq.shape[0] < B:
            p_ids, p_mask = uniq[:, :P], uniq[:, P:].to(attention_mask.dtype)
            head = model(
                input_ids=p_ids,
                attention_mask=p_mask,
                position_ids=position_ids_from_mask(p_mask),
                use_cache=True,
                logits_to_keep=1,
            )
            cache = head.past_key_values
            cache.batch_select_indices(inv)  # [U, ...] -> [B, ...], differentiable gather
            tail = model(
                input_ids=input_ids[:, P:],
                attention_mask=attention_mask,
                position_ids=pos[:, P:],
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=T,
            )
            return torch.cat([head.logits[inv], tail.logits[:, :-1]], dim=1)
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=pos,
        use_cache=False,
        logits_to_keep=T + 1,
    )
    return out.logits[:, :-1]


def _zero_outside(out: Tensor | tuple[Tensor, ...], mask: Tensor) -> Tensor | tuple[Tensor, ...]:
    """Log-probs (and entropy) with 0 where ``mask`` is False."""
    if isinstance(out, tuple):
        return tuple(t.masked_fill(~mask, 0.0) for t in out)
    return out.masked_fill(~mask, 0.0)


def response_hidden(
    model: Any,
    input_ids: Tensor,  # [B, P + T]
    attention_mask: Tensor,  # [B, P + T]
    T: int,
    inputs: dict[str, Tensor] | None = None,
) -> tuple[Tensor, Any]:  # [B, T, H], the LM head module
    """The final hidden states that predict the ``T`` response tokens (positions ``P - 1 + t``)
    and the LM head, for :func:`rollkit.logprobs.lean_token_logprobs`: one forward of the
    decoder (``get_decoder()`` of a Hugging Face causal LM; a DeepSpeed engine's ``module``),
    no logits. ``inputs``: image inputs (:func:`response_logits`), through the multimodal base
    model (``model.model``) instead of the text decoder."""
    get_decoder, get_head = _decoder_and_head(model)
    if get_head() is None:
        raise ValueError(
            f"train.logprob_chunk_tokens: {type(getattr(model, 'module', model)).__name__} has no LM head "
            "(get_output_embeddings() is None); set train.logprob_chunk_tokens=0"
        )
    if inputs:
        ids = text_only_response(model, input_ids, T)
        pos = vision_position_ids(model, ids, attention_mask, inputs)
        out = vision_base(model)(input_ids=ids, attention_mask=attention_mask, position_ids=pos,
                                 use_cache=False, **inputs)  # fmt: skip
    else:
        out = get_decoder()(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids_from_mask(attention_mask),
            use_cache=False,
        )
    L = input_ids.shape[1]
    return out.last_hidden_state[:, L - T - 1 : L - 1], get_head()


def _decoder_and_head(model: Any) -> tuple[Any, Any]:
    hf = getattr(model, "module", model)
    get_decoder, get_head = getattr(hf, "get_decoder", None), getattr(hf, "get_output_embeddings", None)
    if get_decoder is None or get_head is None:
        raise ValueError(
            f"train.logprob_chunk_tokens: {type(hf).__name__} has no get_decoder() / get_output_embeddings() "
            "(a Hugging Face causal LM); set train.logprob_chunk_tokens=0"
        )
    return get_decoder, get_head


def packed_hidden(model: Any, call: PackedCall) -> tuple[Tensor, Any]:  # [1, M, H], the LM head module
    """:func:`response_hidden` of a packed micro-batch (:mod:`trainers.engines.packed`): the
    final hidden states at the ``M`` packed positions that predict a response token."""
    get_decoder, get_head = _decoder_and_head(model)
    out = get_decoder()(**call.kwargs)
    return out.last_hidden_state[:, call.keep], get_head()


def used_response_width(input_ids: Tensor, response_mask: Tensor) -> tuple[int, int]:
    """``(T, T_used)``: the response width of ``response_mask`` ``[B, T]`` (checked against
    ``input_ids`` ``[B, L]``: the response is the last ``T`` columns, after at least one prompt
    token) and the columns up to the last one any row uses (at least 1). The trailing unused
    columns (a micro-batch of short responses in a batch padded to a longer one) can be cut
    before a forward and restored as zeros: the other positions do not attend to them (causal)."""
    B, L = input_ids.shape
    T = response_mask.shape[1]
    if response_mask.shape[0] != B or T >= L:
        raise ValueError(
            f"response_mask {list(response_mask.shape)} does not fit input_ids {[B, L]} "
            "(the response is the last T columns, after at least one prompt token)"
        )
    used = response_mask.any(0).nonzero()
    return T, int(used[-1]) + 1 if len(used) else 1


def _lean_matmul_dtype(autocast: torch.dtype | None, hidden_dtype: torch.dtype) -> torch.dtype | None:
    """The lean path's matmul precision: the plain path's (the autocast dtype, else the hidden
    states' own bf16 / fp16; ``None``, float32, otherwise)."""
    if autocast is not None:
        return autocast
    return hidden_dtype if hidden_dtype in (torch.bfloat16, torch.float16) else None


def response_logprobs(
    model: Any,
    input_ids: Tensor,  # [B, L]
    attention_mask: Tensor,  # [B, L]
    response_mask: Tensor,  # [B, T]
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    top_k: int = -1,
    top_p: float = 1.0,
    share_prompts: bool = True,
    autocast: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    chunk_tokens: int = 0,
    packed: bool = False,
    fused: bool | str = False,
    inputs: dict[str, Tensor] | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """The training engines' ``logprobs``: ``[B, T]`` float32 log-probs of the response tokens
    (the last ``T`` columns of ``input_ids``), 0 where ``response_mask`` is False, and with
    ``with_entropy`` the ``[B, T]`` entropy of the tempered distribution (with gradient).

    ``logprobs[b, t] = log_softmax(logits[b, L - T - 1 + t] / temperature)[input_ids[b, L - T + t]]``;
    the logits come from :func:`response_logits` on ``model`` (a module, or a DeepSpeed
    engine), under ``torch.autocast(autocast)`` when ``autocast`` is a dtype. Response columns
    past the longest response of these rows are not computed (long-tail batches are padded
    to the batch's longest response; a micro-batch of short ones costs only their length).

    With ``top_k > 0`` or ``top_p < 1`` the rollout's truncation is replayed on these logits
    (:func:`rollkit.logprobs.token_logprobs`): the log-probs and entropy are those of the
    processed distribution the rollout engine sampled from and reported, so that an on-policy
    ratio is 1 (without the replay it is the kept mass ``Z < 1``).

    ``chunk_tokens > 0``: the memory-lean path. The decoder's final hidden states go through
    :func:`rollkit.logprobs.lean_token_logprobs` with the LM head's weight, ``chunk_tokens``
    positions at a time (the backward recomputes each chunk's logits), so the ``[B, T, V]``
    logits never exist: peak extra memory ``O(chunk_tokens x V)``. Same values and gradients up
    to float rounding (the LM head's matmuls run in the autocast dtype, or in the hidden
    states' own low precision, like the plain path's; the softmax in float32); no prompt
    sharing on this path.

    ``packed``: the padding-free path (:mod:`trainers.engines.packed`; the model must have been
    through :func:`~trainers.engines.packed.enable_packing`): the rows' real tokens run as one
    packed row with per-sample positions and attention, only the ``M`` positions that predict a
    response token go through the LM head (plain or lean), and the results are scattered back
    to ``[B, T]``: the same values and gradients up to float rounding. With ``share_prompts``
    the rows that repeat a prompt share one copy of it in the packed row (each response attends
    to it and to itself; :class:`trainers.engines.packed.PackedCall`), except on CUDA where the
    varlen kernel runs one sequence per sample.

    ``fused`` (with ``chunk_tokens > 0``): the lean head's per-chunk softmax statistics and
    logit gradients compiled (:func:`rollkit.logprobs.lean_token_logprobs`' ``fused``: ``True``
    or a ``torch.compile`` backend name).

    ``inputs``: the rows' image inputs (a vision-language model; :mod:`trainers.vision`),
    collated (:func:`trainers.vision.collate`): the forward gets them and the model's own
    positions (Qwen2-VL's M-RoPE); plain and lean heads as for text; no prompt sharing and no
    packing with images.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    L = input_ids.shape[1]
    T, T_used = used_response_width(input_ids, response_mask)
    dev = torch.device(device)
    if T_used < T:
        out = response_logprobs(
            model,
            input_ids[:, : L - T + T_used],
            attention_mask[:, : L - T + T_used],
            response_mask[:, :T_used],
            temperature=temperature,
            with_entropy=with_entropy,
            top_k=top_k,
            top_p=top_p,
            share_prompts=share_prompts,
            autocast=autocast,
            device=device,
            chunk_tokens=chunk_tokens,
            packed=packed,
            fused=fused,
            inputs=inputs,
        )
        pad = (0, T - T_used)
        if with_entropy:
            return torch.nn.functional.pad(out[0], pad), torch.nn.functional.pad(out[1], pad)
        return torch.nn.functional.pad(out, pad)
    input_ids, attention_mask = input_ids.to(dev), attention_mask.to(dev)
    mask = response_mask.to(dev, dtype=torch.bool)
    tokens = input_ids[:, L - T :]
    inputs = to_device(inputs, dev)
    if packed and inputs:
        raise ValueError("train.packing: not supported with image inputs yet (set train.packing=false)")
    if packed:
        return _packed_logprobs(model, input_ids, attention_mask, mask, temperature=temperature,
                                with_entropy=with_entropy, top_k=top_k, top_p=top_p, autocast=autocast,
                                device=dev, chunk_tokens=chunk_tokens, fused=fused, share=share_prompts)  # fmt: skip
    if chunk_tokens > 0:
        with torch.autocast(dev.type, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            hidden, head = response_hidden(model, input_ids, attention_mask, T, inputs)
        sampling = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "with_entropy": with_entropy}
        mdt = _lean_matmul_dtype(autocast, hidden.dtype)
        out = lean_token_logprobs(hidden, head.weight, tokens, bias=head.bias, chunk_tokens=chunk_tokens,
                                  matmul_dtype=mdt, fused=fused, **sampling)  # fmt: skip
        return _zero_outside(out, mask)
    with torch.autocast(dev.type, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        logits = response_logits(model, input_ids, attention_mask, T, share_prompts=share_prompts, inputs=inputs)
    out = _logit_outputs(logits, tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                         with_entropy=with_entropy)  # fmt: skip
    return _zero_outside(out, mask)


def _logit_outputs(
    logits: Tensor, tokens: Tensor, *, temperature: float, top_k: int, top_p: float, with_entropy: bool
) -> Tensor | tuple[Tensor, Tensor]:
    """Log-probs of ``tokens`` (and the entropy) from ``[..., V]`` logits: the rollout's top-k /
    top-p replayed where it truncates (:func:`rollkit.logprobs.token_logprobs`), else the plain
    tempered log-softmax (:func:`token_logprobs`, :func:`rollkit.losses.entropy_from_logits`)."""
    if 0 < top_k < logits.shape[-1] or top_p < 1.0:
        return replay_logprobs(logits, tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                               with_entropy=with_entropy)  # fmt: skip
    lp = token_logprobs(logits, tokens, temperature)
    if not with_entropy:
        return lp
    z = logits.float() / temperature if temperature != 1.0 else logits.float()
    return lp, entropy_from_logits(z)


def _packed_logprobs(
    model: Any,
    input_ids: Tensor,
    attention_mask: Tensor,
    mask: Tensor,
    *,
    temperature: float,
    with_entropy: bool,
    top_k: int,
    top_p: float,
    autocast: torch.dtype | None,
    device: torch.device,
    chunk_tokens: int,
    fused: bool | str = False,
    share: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """:func:`response_logprobs` on the packed path: ``[1, M]`` results scattered to ``[B, T]``;
    ``share``: rows that repeat a prompt share one copy of it (the prefix-shared layout)."""
    call = packed_call(model, input_ids, attention_mask, mask, share=share)
    sampling = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "with_entropy": with_entropy}
    with torch.autocast(device.type, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        if chunk_tokens > 0:
            hidden, head = packed_hidden(model, call)
        else:
            logits = model(**call.kwargs, logits_to_keep=call.keep).logits  # [1, M, V]
    if chunk_tokens > 0:
        mdt = _lean_matmul_dtype(autocast, hidden.dtype)
        out = lean_token_logprobs(hidden, head.weight, call.targets, bias=head.bias, chunk_tokens=chunk_tokens,
                                  matmul_dtype=mdt, fused=fused, **sampling)  # fmt: skip
    else:
        out = _logit_outputs(logits, call.targets, **sampling)
    if isinstance(out, tuple):
        return tuple(scatter_response(o, call) for o in out)
    return scatter_response(out, call)


class TorchTrainEngine(Offloadable):
    """A :class:`~trainers.engines.base.TrainEngine` in plain PyTorch.

    Args:
        model: a transformers causal LM (``Qwen2ForCausalLM``, ``LlamaForCausalLM``, ...).
        optimizer: an optimizer over ``model``'s parameters, or None to build one with
            ``optimizer_factory(params)`` (default: ``AdamW(lr, betas=(0.9, 0.999),
            weight_decay)``).
        lr, weight_decay: for the default optimizer.
        grad_clip: clip the global gradient norm to this (``None``: no clipping; the norm
            is still reported).
        scheduler: an LR scheduler over the optimizer, or a callable ``optimizer ->
            scheduler``; stepped once per :meth:`step`.
        dtype: the model's parameter dtype (log-probs are computed in float32 anyway).
        device: where the model is trained.
        gradient_checkpointing: recompute activations in the backward (non-reentrant).
        autocast: mixed precision for the forward (and so the backward) of :meth:`logprobs`:
            ``torch.bfloat16`` or ``torch.float16`` runs the matmuls in that dtype under
            ``torch.autocast`` while the parameters, gradients and optimizer state stay in
            ``dtype`` (float32 master weights); the log-softmax is still taken in float32.
            ``None`` (default): no autocast. On CPUs with AMX / AVX512-BF16 bfloat16 matmuls
            are several times faster than float32 (measured in docs/engines.md).
        share_prompts: run each distinct prompt of a micro-batch through the model once and
            let its samples attend to that prompt's keys/values (:func:`response_logits`):
            with ``n`` samples per prompt the prompt tokens cost ``1/n`` as much, forward and
            backward, for the same log-probs and gradients. Off under gradient checkpointing.
        process_group: the data-parallel group (default: the world, if initialised).
        logprob_chunk_tokens: ``> 0``: log-probs and entropy through the memory-lean path of
            :func:`response_logprobs` (no ``[B, T, V]`` logits), that many positions per chunk.
        packing: padding-free micro-batches (:mod:`trainers.engines.packed`): each
            micro-batch's real tokens run as one packed row (per-sample positions and
            attention), the same log-probs and gradients; with ``share_prompts`` the rows that
            repeat a prompt share one copy of it in the packed row.
        compile_backend: ``torch.compile`` each decoder layer with this backend (``"inductor"``;
            ``None``: eager), :func:`trainers.engines.compiled.compile_layers`; on CUDA also the
            lean head's per-chunk softmax (``fused`` of :func:`rollkit.logprobs.lean_token_logprobs`).
        fused_optimizer: the default AdamW with ``fused=True`` where the device has the kernel.
        master_weights: ``dtype`` bf16 / fp16 parameters with float32 master weights
            (:class:`trainers.engines.precision.MasterWeights`): forward and backward on the
            low-precision parameters with no autocast casts, gradients accumulated and the
            optimizer stepped in float32, the parameters rounded from the masters after each step.

    A step whose gradient norm is not finite is skipped (no update, gradients zeroed,
    ``metrics["skipped"] == 1``).

    :meth:`offload` / :meth:`onload` (``placement.offload_train``): the parameters, gradients,
    optimizer state, buffers and float32 masters to the host and back
    (:mod:`trainers.engines.offload`); a method that needs them onloads first.
    """

    #: a LoRA policy's :meth:`export_weights`: ``"merged"`` (full weights, any rollout engine)
    #: or ``"adapter"`` (the adapter alone, for vLLM's LoRA support); set it on the engine
    lora_export: str = "merged"

    def __init__(
        self,
        model: Any,
        *,
        optimizer: torch.optim.Optimizer | None = None,
        optimizer_factory: Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer] | None = None,
        lr: float = 1e-5,
        weight_decay: float = 0.0,
        grad_clip: float | None = 1.0,
        scheduler: Any = None,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        gradient_checkpointing: bool = False,
        autocast: torch.dtype | None = None,
        share_prompts: bool = True,
        process_group: Any = None,
        logprob_chunk_tokens: int = 0,
        packing: bool = False,
        compile_backend: str | None = None,
        fused_optimizer: bool = False,
        master_weights: bool = False,
    ) -> None:
        if autocast not in (None, torch.bfloat16, torch.float16):
            raise ValueError(f"autocast must be None, torch.bfloat16 or torch.float16, got {autocast!r}")
        self.autocast = autocast
        self.device = torch.device(device)
        self.model = model.to(device=self.device, dtype=dtype)
        self.share_prompts = share_prompts
        self.packing = bool(packing)
        prepare_model(self.model, packing=self.packing, compile_backend=compile_backend)
        # the compiled lean head where it pays (a GPU); the CPU keeps the eager chunked path
        self.fused_head = compile_backend if compile_backend and self.device.type == "cuda" else False
        if (
            isinstance(logprob_chunk_tokens, bool)
            or not isinstance(logprob_chunk_tokens, int)
            or logprob_chunk_tokens < 0
        ):
            raise ValueError(f"logprob_chunk_tokens must be an int >= 0, got {logprob_chunk_tokens!r}")
        self.logprob_chunk_tokens = logprob_chunk_tokens
        self._ckpt = gradient_checkpointing
        if gradient_checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.model.train()
        params = [p for p in self.model.parameters() if p.requires_grad]
        self._master = MasterWeights(params) if master_weights else None
        if self._master is not None:
            if autocast is not None:
                raise ValueError(
                    "master_weights: the parameters are already low precision; use autocast=None"
                )
            params = self._master.params  # the optimizer steps the float32 masters
        if optimizer is None:
            if optimizer_factory is not None:
                optimizer = optimizer_factory(params)
            else:
                optimizer = adamw(params, lr=lr, weight_decay=weight_decay, fused=fused_optimizer)
        self.optimizer = optimizer
        if callable(scheduler) and not hasattr(scheduler, "step"):
            scheduler = scheduler(optimizer)
        self.scheduler = scheduler
        self.grad_clip = grad_clip
        self.global_step = 0
        dist = torch.distributed
        self._group = process_group
        self._world, self._rank = 1, 0
        if dist.is_available() and dist.is_initialized():
            self._world = dist.get_world_size(process_group)
            self._rank = dist.get_rank(process_group)
        if self._world > 1:
            src = dist.get_global_rank(process_group, 0) if process_group is not None else 0
            with torch.no_grad():
                for t in self.model.state_dict().values():
                    dist.broadcast(t, src=src, group=process_group)

    @property
    def world_size(self) -> int:
        return self._world

    def _offload_tensors(self) -> list[Tensor]:
        master = [] if self._master is None else self._master.params
        return state_tensors(
            self.model, [self.optimizer], [*master, *(m.grad for m in master if m.grad is not None)]
        )

    # ------------------------------------------------------------------ forward / backward

    @resident
    def logprobs(
        self,
        input_ids: Tensor,  # [B, L]
        attention_mask: Tensor,  # [B, L]
        response_mask: Tensor,  # [B, T]
        *,
        temperature: float = 1.0,
        with_entropy: bool = False,
        top_k: int = -1,
        top_p: float = 1.0,
        inputs: dict[str, Tensor] | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """``[B, T]`` float32 log-probs of the response tokens, the last ``T`` columns.

        ``logprobs[b, t] = log_softmax(logits[b, L - T - 1 + t] / temperature)[input_ids[b, L - T + t]]``
        (the layout of :func:`trainers.engines.base.pack`), 0 where ``response_mask`` is
        False. Only the last ``T + 1`` positions go through the LM head. With
        ``with_entropy``, also the ``[B, T]`` entropy of the tempered distribution (with
        gradient; 0 outside the mask). ``temperature`` must be the rollout's to compare with
        its log-probs, and ``top_k`` / ``top_p`` its truncation (replayed, see
        :func:`response_logprobs`). ``inputs``: the rows' image inputs (a vision-language model,
        :mod:`trainers.vision`). Runs with gradients unless called under ``torch.no_grad()``.
        """
        return response_logprobs(
            self.model,
            input_ids,
            attention_mask,
            response_mask,
            temperature=temperature,
            with_entropy=with_entropy,
            top_k=top_k,
            top_p=top_p,
            share_prompts=self.share_prompts and not self._ckpt,
            autocast=self.autocast,
            device=self.device,
            chunk_tokens=self.logprob_chunk_tokens,
            packed=self.packing,
            fused=self.fused_head,
            inputs=inputs,
        )

    @resident
    def backward(self, loss: Tensor) -> None:
        """Accumulate ``d loss / d params`` (one micro-batch; the caller scales the loss)."""
        if loss.dim() != 0:
            raise ValueError(
                f"loss must be a scalar, got shape {list(loss.shape)} (use rollkit.losses.aggregate)"
            )
        loss.backward()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def _trained(self) -> list[Tensor]:
        """What the optimizer steps: the model's parameters, or their float32 masters."""
        return self._master.params if self._master is not None else list(self.model.parameters())

    def _allreduce_grads(self) -> None:
        dist = torch.distributed
        grads = [p.grad for p in self._trained() if p.grad is not None]
        by_dtype: dict[torch.dtype, list[Tensor]] = {}
        for g in grads:
            by_dtype.setdefault(g.dtype, []).append(g)
        for gs in by_dtype.values():
            flat = torch.cat([g.reshape(-1) for g in gs])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self._group)
            flat.div_(self._world)
            off = 0
            for g in gs:
                g.copy_(flat[off : off + g.numel()].view_as(g))
                off += g.numel()

    @resident
    def step(self) -> dict[str, float]:
        """All-reduce (if data parallel), clip, optimizer step, scheduler step, zero_grad.

        Returns ``{"grad_norm": norm before clipping, "lr": lr used, "skipped": 0 or 1}``.
        Parameters that received no gradient are left to the optimizer (AdamW still decays
        them if ``weight_decay > 0``; with the default 0 they do not move).
        """
        if self._world > 1:
            for p in self._trained():
                if p.requires_grad and p.grad is None:
                    p.grad = torch.zeros_like(p)  # every rank must contribute to the same all-reduce
            self._allreduce_grads()
        params = [p for p in self._trained() if p.grad is not None]
        max_norm = self.grad_clip if self.grad_clip is not None else math.inf
        if params:
            norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        else:
            norm = 0.0
        lr = float(self.optimizer.param_groups[0]["lr"])
        if not math.isfinite(norm):
            self.zero_grad()
            return {"grad_norm": norm, "lr": lr, "skipped": 1.0}
        self.optimizer.step()
        if self._master is not None:
            self._master.copy_to_model()
        if self.scheduler is not None:
            self.scheduler.step()
        self.zero_grad()
        self.global_step += 1
        return {"grad_norm": norm, "lr": lr, "skipped": 0.0}

    # ------------------------------------------------------------------ weights / checkpoints

    @resident
    def save_model(self, path: str | Path, tokenizer: Any = None) -> Path:
        """The policy as a Hugging Face model directory (``save_pretrained`` of the model and
        ``tokenizer``), written by rank 0 (:func:`trainers.models.save_model`)."""
        if self._rank == 0:
            if is_lora(self.model):  # LoRA: the merged model (plain transformers checkpoint)
                save_lora(self.model, tokenizer, path, merged=True)
            else:
                save_model(self.model, tokenizer, path)
        return Path(path)

    @resident
    def export_weights(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, Tensor]]:
        """``(name, tensor)`` for every parameter, named as in the model's ``state_dict``.

        Tied weights appear once (``model.embed_tokens.weight``, not ``lm_head.weight``).
        Tensors are detached views of the live parameters (no copy) unless ``dtype`` asks
        for a cast: consume them before the next :meth:`step`. A LoRA model (peft) exports the
        merged weights ``W + B A * scale`` under the base model's names
        (:func:`trainers.engines.lora.merged_weights`), or with ``lora_export = "adapter"`` the
        adapter alone (:func:`trainers.engines.lora.adapter_weights`).
        """
        if is_lora(self.model):
            yield from lora_export_weights(self.model, self.lora_export, dtype)
            return
        for name, p in self.model.named_parameters():
            t = p.detach()
            yield name, (t if dtype is None else t.to(dtype))

    @resident
    def state_dict(self) -> dict[str, Any]:
        """``{"model", "optimizer", "scheduler", "global_step"}``. The tensors are the live
        ones (as with ``nn.Module.state_dict``): ``torch.save`` or ``copy.deepcopy`` them."""
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": None if self.scheduler is None else self.scheduler.state_dict(),
            "global_step": self.global_step,
            "master": None if self._master is None else [m.detach() for m in self._master.params],
        }

    @resident
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (strict about model keys)."""
        self.model.load_state_dict(state["model"], strict=True)
        if self._master is not None:
            if state.get("master") is not None:
                with torch.no_grad():
                    for m, saved in zip(self._master.params, state["master"], strict=True):
                        m.copy_(saved)
            else:  # a checkpoint without masters: start them from the (rounded) weights
                self._master.copy_from_model()
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        self.global_step = int(state.get("global_step", 0))


def build_torch_train(cfg: Any, model: Any, *, device: str, **common: Any) -> TorchTrainEngine:
    """``train.engine=torch`` over ``model`` with the settings every engine takes (``common``:
    :func:`trainers.engines.build.make_train_engine`), the config's autocast, float32 master
    weights (``train.master_weights`` over a 16-bit model) and activation checkpointing."""
    t, dtype = cfg.train, common["dtype"]
    eng = TorchTrainEngine(
        model,
        autocast=train_autocast(cfg, device),
        master_weights=bool(t.master_weights) and dtype in (torch.bfloat16, torch.float16),
        gradient_checkpointing=bool(t.gradient_checkpointing),
        device=device,
        **common,
    )
    eng.lora_export = lora_export(cfg)
    return eng
