"""The FSDP2 training engine: PyTorch ``fully_shard`` (sharded parameters, gradients and
optimizer state) behind the TrainEngine interface.

:class:`FSDP2TrainEngine` shards every decoder layer and then the root of a Hugging Face causal
LM with :func:`torch.distributed.fsdp.fully_shard` and behaves like
:class:`~trainers.engines.torch_train.TorchTrainEngine` (gloo on CPU, NCCL on GPUs; a
one-process group is started when none exists). See docs/engines.md.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from trainers.engines.compiled import adamw, prepare_model
from trainers.engines.offload import Offloadable, resident, state_tensors
from trainers.engines.options import train_autocast
from trainers.engines.torch_train import response_logprobs
from trainers.models import save_model

__all__ = ["FSDP2TrainEngine"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_MIXED = (None, torch.bfloat16, torch.float16, torch.float32)


def _check_args(
    model: Any,
    lr: Any,
    weight_decay: Any,
    grad_clip: Any,
    dtype: Any,
    device: Any,
    optimizer_factory: Any,
    mixed_precision: Any,
    flags: dict[str, Any],
    logprob_chunk_tokens: Any,
) -> torch.device:
    """The constructor's argument checks (one-line ``ValueError`` naming the argument);
    returns the device."""
    if not isinstance(model, torch.nn.Module):
        raise ValueError(
            f"model must be a torch.nn.Module (a transformers causal LM), got {type(model).__name__}"
        )
    if isinstance(lr, bool) or not (isinstance(lr, (int, float)) and lr > 0 and math.isfinite(lr)):
        raise ValueError(f"lr must be a finite number > 0, got {lr!r}")
    if isinstance(weight_decay, bool) or not (isinstance(weight_decay, (int, float)) and weight_decay >= 0):
        raise ValueError(f"weight_decay must be a number >= 0, got {weight_decay!r}")
    if grad_clip is not None and (
        isinstance(grad_clip, bool) or not (isinstance(grad_clip, (int, float)) and grad_clip > 0)
    ):
        raise ValueError(f"grad_clip must be None or a number > 0, got {grad_clip!r}")
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {_DTYPES}, got {dtype!r}")
    if mixed_precision not in _MIXED:
        raise ValueError(f"mixed_precision must be one of {_MIXED}, got {mixed_precision!r}")
    if optimizer_factory is not None and not callable(optimizer_factory):
        raise ValueError(
            f"optimizer_factory must be a callable params -> optimizer, got {optimizer_factory!r}"
        )
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be a bool, got {value!r}")
    if (
        isinstance(logprob_chunk_tokens, bool)
        or not isinstance(logprob_chunk_tokens, int)
        or logprob_chunk_tokens < 0
    ):
        raise ValueError(f"logprob_chunk_tokens must be an int >= 0, got {logprob_chunk_tokens!r}")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device must be 'cpu' or 'cuda[:i]', got {device!r}") from e
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda[:i]', got {str(device)!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but torch sees no CUDA device")
    return device


def _ensure_process_group(device: torch.device) -> bool:
    """Start a one-process group (gloo on CPU, NCCL on CUDA) in an in-memory store if none
    exists; True if one was started."""
    dist = torch.distributed
    if not dist.is_available():
        raise RuntimeError("FSDP2TrainEngine needs torch.distributed, which this torch build lacks")
    if dist.is_initialized():
        return False
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return True


def _cuda_device(device: torch.device) -> torch.device:
    """``cuda:i`` as given, else ``cuda:LOCAL_RANK`` (0 without a launcher); made current."""
    if device.index is None:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    return device


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks of a Hugging Face causal LM (``model.model.layers`` for
    Llama/Qwen/Mistral, ``transformer.h`` for GPT-2 style), or [] (then only the root is
    sharded, as one unit)."""
    get_decoder = getattr(model, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else None
    for owner in (decoder, getattr(model, "transformer", None), model):
        for attr in ("layers", "h", "blocks"):
            layers = getattr(owner, attr, None) if owner is not None else None
            if isinstance(layers, torch.nn.ModuleList) and len(layers) > 0:
                return list(layers)
    return []


def _to_full(t: Tensor) -> Tensor:
    """A DTensor's full tensor (an all-gather: a collective), a plain tensor as it is."""
    full = getattr(t, "full_tensor", None)
    return full() if callable(full) else t


class _HiddenForward:
    """The root FSDP module seen as ``response_hidden`` wants it (``get_decoder()`` /
    ``get_output_embeddings()``) for the memory-lean log-probs: the decoder call runs the
    *root's* forward (so FSDP2 unshards the root's parameters, the embedding and LM head
    included, and reduce-scatters their gradients after the backward) with one position
    through the LM head, and returns the final hidden states; the LM head is read after that
    forward, when the root's weights are unsharded (FSDP2 keeps the root unsharded until its
    backward)."""

    def __init__(self, model: Any) -> None:
        self._model = model
        self._ran = False
        self.config = getattr(model, "config", None)  # the attention implementation (packed calls)

    def get_decoder(self) -> Callable[..., Any]:
        def forward(**kw: Any) -> Any:
            out = self._model(**kw, logits_to_keep=1, output_hidden_states=True)
            self._ran = True
            return SimpleNamespace(last_hidden_state=out.hidden_states[-1])

        return forward

    def get_output_embeddings(self) -> Any:
        head = self._model.get_output_embeddings()
        if self._ran and isinstance(head.weight, DTensor):  # the root resharded: a forward without gradients
            if torch.is_grad_enabled():
                raise RuntimeError("FSDP2TrainEngine: the LM head is sharded after a forward with gradients")
            self._model.unshard()  # FSDP2TrainEngine.logprobs reshards after use
        return head


class FSDP2TrainEngine(Offloadable):
    """A :class:`~trainers.engines.base.TrainEngine` on PyTorch FSDP2 (``fully_shard``).

    Args:
        model: a transformers causal LM (``Qwen2ForCausalLM``, ``LlamaForCausalLM``, ...).
            Rank 0's weights are broadcast to the other ranks before sharding. Each decoder
            layer is one FSDP unit, the root (embeddings, final norm, LM head) another.
        lr, weight_decay: for the default optimizer ``torch.optim.AdamW(lr, betas=(0.9,
            0.999), weight_decay)`` over the sharded (DTensor) parameters.
        grad_clip: clip the global gradient norm (over all ranks' shards) to this (``None``:
            no clipping; the norm is still reported).
        scheduler: an LR scheduler over the optimizer, or a callable ``optimizer ->
            scheduler``; stepped once per applied :meth:`step`.
        dtype: the sharded parameters' dtype (the optimizer's master weights).
        device: ``"cpu"`` (gloo) or ``"cuda"`` (NCCL, ``cuda:LOCAL_RANK`` unless an index is
            given).
        optimizer_factory: ``params -> optimizer`` instead of the default AdamW; it receives
            the DTensor parameters (elementwise optimizers update shards as whole tensors).
        mixed_precision: FSDP2's ``MixedPrecisionPolicy(param_dtype=...)``: the all-gathered
            weights and the forward / backward compute in this dtype, gradients reduced in
            ``dtype``; ``None``: compute in ``dtype``. Log-probs are float32 either way.
        reshard_after_forward: free each decoder layer's gathered weights after its forward
            (and gather them again in the backward): less memory, one more all-gather per
            layer. The root's stay gathered until its backward (they are needed at once).
        share_prompts: run each distinct prompt of a micro-batch once
            (:func:`~trainers.engines.torch_train.response_logits`).
        logprob_chunk_tokens: ``> 0``: the memory-lean log-probs (no ``[B, T, V]`` logits) of
            :func:`~trainers.engines.torch_train.response_logprobs`, through the root forward.
        packing: padding-free micro-batches (:mod:`trainers.engines.packed`; with ``share_prompts`` a repeated prompt appears once in the packed row).
        compile_backend, fused_optimizer: compiled decoder layers (before sharding), fused AdamW
            (:mod:`trainers.engines.compiled`, as ``TorchTrainEngine``).
        gradient_checkpointing: recompute each decoder layer's activations in the backward
            (the Hugging Face model's non-reentrant checkpointing, enabled before sharding); no
            prompt sharing then (it needs the KV cache).
        cpu_offload: FSDP2's ``CPUOffloadPolicy`` (``train.fsdp2_cpu_offload``): the sharded
            parameters, their gradients and the optimizer state live on the host (pinned on
            CUDA) and the optimizer steps there; each unit's shards are copied to the device
            for its all-gather. On a CPU device it changes nothing but the code path.

    Gradients: every :meth:`backward` reduce-scatters the layers' gradients into each rank's
    shard, *averaged* over ranks (as DDP / DeepSpeed / TorchTrainEngine), and sums them over
    micro-batches: with ``rollkit.losses.global_normalizers`` (whose ``dp_size`` cancels the
    average) ``k`` micro-batches on ``n`` ranks give the full-batch gradient. ``step`` returns
    ``{"grad_norm", "lr", "skipped"}`` (a non-finite norm skips the update, as the torch engine).

    Collectives (every rank must call them, in the same order): :meth:`logprobs` with
    gradients and :meth:`backward` (every rank the same number of micro-batches), :meth:`step`,
    :meth:`export_weights` (consume the whole iterator), :meth:`save_model`,
    :meth:`state_dict`, :meth:`load_state_dict`.

    :meth:`offload` / :meth:`onload` (``placement.offload_train``): the local shards of the
    parameters, gradients and optimizer state, and the buffers, to the host and back
    (:mod:`trainers.engines.offload`; gathered weights are freed first).
    """

    #: the root module's forward unshards the parameters: callers (a critic's values) must run
    #: the whole model, not its decoder or head on their own
    root_forward_only = True

    def __init__(
        self,
        model: Any,
        *,
        lr: float = 1e-5,
        weight_decay: float = 0.0,
        grad_clip: float | None = 1.0,
        scheduler: Any = None,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        optimizer_factory: Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer] | None = None,
        mixed_precision: torch.dtype | None = None,
        reshard_after_forward: bool = True,
        share_prompts: bool = True,
        logprob_chunk_tokens: int = 0,
        packing: bool = False,
        compile_backend: str | None = None,
        fused_optimizer: bool = False,
        gradient_checkpointing: bool = False,
        cpu_offload: bool = False,
    ) -> None:
        flags = {
            "reshard_after_forward": reshard_after_forward,
            "share_prompts": share_prompts,
            "packing": packing,
            "gradient_checkpointing": gradient_checkpointing,
            "cpu_offload": cpu_offload,
        }
        device = _check_args(
            model, lr, weight_decay, grad_clip, dtype, device, optimizer_factory, mixed_precision, flags,
            logprob_chunk_tokens,
        )  # fmt: skip
        self.owns_process_group = _ensure_process_group(device)
        if device.type == "cuda":
            device = _cuda_device(device)
        dist = torch.distributed
        self.device = device
        self.world_size, self.rank = dist.get_world_size(), dist.get_rank()
        self.grad_clip, self.dtype, self.mixed_precision = grad_clip, dtype, mixed_precision
        self.share_prompts = share_prompts and not gradient_checkpointing  # checkpointing: no KV cache
        self.logprob_chunk_tokens, self.packing, self.cpu_offload = logprob_chunk_tokens, packing, cpu_offload
        prepare_model(model, packing=packing, compile_backend=compile_backend)
        if gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self._arch = (type(model), getattr(model, "config", None))  # for save_model's unsharded skeleton
        model = model.to(device=device, dtype=dtype)
        if self.world_size > 1:
            with torch.no_grad():
                for t in model.state_dict().values():
                    dist.broadcast(t, src=0)
        self.model = self._shard(model, reshard_after_forward)
        self.model.train()
        params = [p for p in self.model.parameters() if p.requires_grad]
        if optimizer_factory is not None:
            optimizer = optimizer_factory(params)
        else:
            optimizer = adamw(params, lr=lr, weight_decay=weight_decay, fused=fused_optimizer)
        self.optimizer = optimizer
        if callable(scheduler) and not hasattr(scheduler, "step"):
            scheduler = scheduler(optimizer)
        self.scheduler = scheduler
        self.global_step = 0

    def _shard(self, model: torch.nn.Module, reshard_after_forward: bool) -> Any:
        """``fully_shard`` each decoder layer, then the root, over a 1-D mesh of the world."""
        mesh = init_device_mesh(self.device.type, (self.world_size,))
        mp = MixedPrecisionPolicy(param_dtype=self.mixed_precision, reduce_dtype=self.dtype)
        kw = {"mesh": mesh, "mp_policy": mp}
        if self.cpu_offload:
            kw["offload_policy"] = CPUOffloadPolicy(pin_memory=self.device.type == "cuda")
        for layer in _decoder_layers(model):
            fully_shard(layer, reshard_after_forward=reshard_after_forward, **kw)
        # The root's weights (embeddings, final norm, LM head) are needed again at once by the
        # backward (and by the lean log-probs' LM head): keep them gathered until then.
        return fully_shard(model, reshard_after_forward=False, **kw)

    def _fsdp_modules(self) -> Iterator[Any]:
        return (m for m in self.model.modules() if isinstance(m, FSDPModule))

    def _reshard(self) -> None:
        """Free any gathered weights (a forward without backward leaves the root gathered)."""
        for m in self._fsdp_modules():
            m.reshard()

    def _offload_tensors(self) -> list[Tensor]:
        self._reshard()  # only the shards stay: no gathered weights to move
        return state_tensors(self.model, [self.optimizer])

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
        """``[B, T]`` float32 log-probs of the response tokens (the last ``T`` columns), 0
        where ``response_mask`` is False; with ``with_entropy`` also the ``[B, T]`` entropy.
        Same definition as ``TorchTrainEngine.logprobs``; the forward all-gathers each
        layer's shards (a collective with several ranks)."""
        chunk = self.logprob_chunk_tokens
        out = response_logprobs(
            _HiddenForward(self.model) if chunk else self.model,
            input_ids,
            attention_mask,
            response_mask,
            temperature=temperature,
            with_entropy=with_entropy,
            top_k=top_k,
            top_p=top_p,
            share_prompts=self.share_prompts,
            device=self.device,
            chunk_tokens=chunk,
            packed=self.packing,
            inputs=inputs,
        )
        if not torch.is_grad_enabled():
            # No backward will reshard what this forward gathered (the root, and every layer
            # with reshard_after_forward=False): free it now, or a later step would leave
            # stale gathered weights for the next forward.
            self._reshard()
        return out

    @resident
    def backward(self, loss: Tensor) -> None:
        """Accumulate ``d loss / d params`` for one micro-batch (reduce-scattered into this
        rank's shards, averaged over ranks, summed over micro-batches)."""
        if not isinstance(loss, Tensor) or loss.dim() != 0:
            shape = list(loss.shape) if isinstance(loss, Tensor) else type(loss).__name__
            raise ValueError(f"loss must be a scalar tensor, got {shape} (use rollkit.losses.aggregate)")
        loss.backward()

    def zero_grad(self) -> None:
        """Discard the accumulated (sharded) gradients."""
        self.optimizer.zero_grad(set_to_none=True)

    @resident
    def step(self) -> dict[str, float]:
        """Clip by the global gradient norm, optimizer step, scheduler step, zero_grad.

        Returns ``{"grad_norm": norm before clipping, "lr": lr used, "skipped": 0 or 1}``; a
        non-finite norm skips the update (gradients dropped, scheduler not stepped). The norm
        is reduced over all ranks' shards (a collective)."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        max_norm = self.grad_clip if self.grad_clip is not None else math.inf
        norm = float(_to_full(torch.nn.utils.clip_grad_norm_(params, max_norm))) if params else 0.0
        lr = float(self.optimizer.param_groups[0]["lr"])
        self._reshard()  # the update applies to the shards: no gathered copy may outlive it
        if not math.isfinite(norm):
            self.zero_grad()
            return {"grad_norm": norm, "lr": lr, "skipped": 1.0}
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        self.zero_grad()
        self.global_step += 1
        return {"grad_norm": norm, "lr": lr, "skipped": 0.0}

    # ------------------------------------------------------------------ weights / checkpoints

    @resident
    def export_weights(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, Tensor]]:
        """``(name, full tensor)`` for every parameter, named as in the model's ``state_dict``
        (a tied ``lm_head.weight`` appears once, as the embedding), for ``update_weights``.

        Each tensor is all-gathered from the shards (``DTensor.full_tensor()``) one parameter
        at a time, a fresh copy: a collective, so **every rank must iterate the whole
        generator**, in order (rank 0 pushing to the rollout engine, the others draining it)."""
        self._reshard()
        for name, p in self.model.named_parameters():
            with torch.no_grad():  # never across a yield: a generator left unfinished would restore
                t = _to_full(p.detach())  # the caller's grad mode when it is collected, at any time
                t = t if dtype is None else t.to(dtype)
            yield name, t

    @resident
    def save_model(self, path: str | Path, tokenizer: Any = None) -> Path:
        """The policy as a Hugging Face model directory, written by rank 0 from the gathered
        weights (:meth:`export_weights`: every rank must call this)."""
        weights = {k: v.cpu() for k, v in self.export_weights()}
        if self.rank == 0:
            cls, config = self._arch
            with torch.device("meta"):
                skeleton = cls(config)  # the unsharded class (the FSDP one is FSDP<name>)
            save_model(skeleton, tokenizer, path, state_dict=weights)
        return Path(path)

    def _options(self) -> Any:
        return StateDictOptions(full_state_dict=True)

    @resident
    def state_dict(self) -> dict[str, Any]:
        """``{"model", "optimizer", "scheduler", "global_step"}`` for resuming: the full
        (unsharded) model and optimizer state, the same on every rank, as CPU copies
        (``torch.distributed.checkpoint.state_dict`` with ``full_state_dict=True``), so a
        checkpoint resumes on any number of ranks. A collective. Each rank briefly holds the
        whole state: for models too large for that, save sharded with
        ``torch.distributed.checkpoint`` (``full_state_dict=False``) instead."""
        self._reshard()
        opts = self._options()
        model = get_model_state_dict(self.model, options=opts)
        optim = get_optimizer_state_dict(self.model, self.optimizer, options=opts)
        return {
            "model": _cpu_copy(model),
            "optimizer": _cpu_copy(optim),
            "scheduler": None if self.scheduler is None else self.scheduler.state_dict(),
            "global_step": self.global_step,
        }

    @resident
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` on every rank (strict about model keys); a collective."""
        if not isinstance(state, dict) or "model" not in state or "optimizer" not in state:
            raise ValueError("state must be a dict from FSDP2TrainEngine.state_dict()")
        self._reshard()
        opts = self._options()
        set_model_state_dict(self.model, state["model"], options=opts)
        set_optimizer_state_dict(
            self.model, self.optimizer, optim_state_dict=state["optimizer"], options=opts
        )
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        self.global_step = int(state.get("global_step", 0))


def _cpu_copy(obj: Any) -> Any:
    """Tensors inside dicts / lists replaced by detached CPU copies."""
    if isinstance(obj, Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _cpu_copy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
        return type(obj)(_cpu_copy(v) for v in obj)
    return obj


def build_fsdp2_train(cfg: Any, model: Any, *, device: str, **common: Any) -> FSDP2TrainEngine:
    """``train.engine=fsdp2`` over ``model`` with the settings every engine takes (``common``) and
    ``train.fsdp2_cpu_offload``; an explicit ``train.autocast`` is refused (FSDP2 has mixed_precision)."""
    train_autocast(cfg, device)  # rejects an explicit autocast
    t = cfg.train
    return FSDP2TrainEngine(
        model,
        gradient_checkpointing=bool(t.gradient_checkpointing),
        cpu_offload=bool(t.fsdp2_cpu_offload),
        device=device,
        **common,
    )
