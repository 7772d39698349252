"""The production training engine: DeepSpeed ZeRO (stages 0-3) behind the TrainEngine interface.

:class:`DeepSpeedTrainEngine` wraps a Hugging Face causal LM in a ``deepspeed.DeepSpeedEngine``
with a **torch** optimizer and behaves like :class:`~trainers.engines.torch_train.TorchTrainEngine`::

    lp = engine.logprobs(mb.input_ids, mb.attention_mask, mb.response_mask, temperature=T)
    engine.backward(rollkit.losses.aggregate(loss, mb.response_mask, "token-mean", **norms))
    metrics = engine.step()                      # {"grad_norm", "lr", "skipped"}
    rollout.update_weights(engine.export_weights(), version)

Gradient accumulation is rollkit's (``k`` backwards, one step, global normalisers), not
DeepSpeed's. On CPU this module sets ``DS_ACCELERATOR=cpu`` when it is unset and no CUDA device
is visible: import it before anything imports deepspeed. With several ranks, ``backward``
(ZeRO-2/3), ``step``, ``export_weights`` (ZeRO-3: every rank drains the iterator),
``save_model``, ``state_dict`` and ``load_state_dict`` are collectives. The stages, the
accumulation contract, process groups, export and checkpoints: docs/engines.md ("DeepSpeed").
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from trainers.deps import require
from trainers.engines.base import size_groups
from trainers.engines.compiled import adamw, prepare_model
from trainers.engines.lora import is_lora, lora_export_weights, save_lora
from trainers.engines.offload import Offloadable, reachable_tensors, resident, state_tensors
from trainers.engines.options import lora_export, train_autocast
from trainers.engines.torch_train import response_logprobs
from trainers.models import save_model

__all__ = ["DeepSpeedTrainEngine", "build_ds_config", "import_deepspeed"]

if "DS_ACCELERATOR" not in os.environ and not torch.cuda.is_available():
    # DeepSpeed picks its accelerator once, at import: without CUDA use the CPU one.
    os.environ["DS_ACCELERATOR"] = "cpu"

ZERO_STAGES = (0, 1, 2, 3)
#: ZeRO-3 export gathers parameters in groups of at most this many elements (one parameter
#: alone when it is larger), so a full copy of the model never exists at once.
EXPORT_GROUP_NUMEL = 1 << 24
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: settings the accumulation contract relies on; ``ds_config`` may repeat them, not change them
_FIXED = {"gradient_accumulation_steps": 1, "managed_gradient_accumulation": False}


def import_deepspeed() -> Any:
    """Import deepspeed (with ``DS_ACCELERATOR=cpu`` set above when there is no CUDA) or
    raise ``ImportError`` naming the extra to install."""
    return require("deepspeed")


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """Recursive dict merge: ``over`` wins, nested dicts are merged key by key."""
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


def build_ds_config(
    zero_stage: int,
    *,
    grad_clip: float | None,
    dtype: torch.dtype,
    ds_config: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The DeepSpeed config the engine passes to ``deepspeed.initialize``.

    ``gradient_accumulation_steps=1`` and ``managed_gradient_accumulation=False`` (the caller
    owns the accumulation boundary: see the module docstring), ZeRO ``stage``,
    ``gradient_clipping`` (``0`` for none), ``bf16`` / ``fp16`` from ``dtype`` (fp16 with
    dynamic loss scaling), a client (torch) optimizer allowed under ZeRO, and no progress
    printing. ``ds_config`` is merged over it recursively (its values win), except that it may
    not change the accumulation settings nor name an ``optimizer`` / ``scheduler`` (pass
    torch objects to the engine instead).

    >>> build_ds_config(3, grad_clip=1.0, dtype=torch.float32)["zero_optimization"]["stage"]
    3
    >>> cfg = build_ds_config(2, grad_clip=None, dtype=torch.bfloat16,
    ...                       ds_config={"zero_optimization": {"overlap_comm": False}})
    >>> cfg["bf16"]["enabled"], cfg["gradient_clipping"], cfg["zero_optimization"]
    (True, 0.0, {'stage': 2, 'overlap_comm': False})
    """
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,
        **_FIXED,
        "gradient_clipping": float(grad_clip) if grad_clip is not None else 0.0,
        "zero_optimization": {"stage": int(zero_stage)},
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": dtype == torch.bfloat16},
        "fp16": {"enabled": dtype == torch.float16, "loss_scale": 0, "initial_scale_power": 16},
        "steps_per_print": 2**62,
        "wall_clock_breakdown": False,
    }
    if ds_config is None:
        return cfg
    if not isinstance(ds_config, dict):
        raise TypeError(f"ds_config must be a dict or None, got {type(ds_config).__name__}")
    for key, use in (
        ("optimizer", "optimizer= or optimizer_factory= (a torch optimizer)"),
        ("scheduler", "scheduler= (a torch LR scheduler)"),
        ("gradient_clipping", "grad_clip="),
        ("bf16", "dtype=torch.bfloat16"),
        ("fp16", "dtype=torch.float16"),
    ):
        if key in ds_config:
            raise ValueError(f"ds_config must not contain {key!r}: pass {use} to DeepSpeedTrainEngine")
    for key, want in _FIXED.items():
        if key in ds_config and ds_config[key] != want:
            raise ValueError(
                f"ds_config[{key!r}] must be {want!r} (got {ds_config[key]!r}): rollkit owns gradient "
                "accumulation (backward per micro-batch, step once; see DeepSpeedTrainEngine)"
            )
    zero = ds_config.get("zero_optimization", {})
    if isinstance(zero, dict) and "stage" in zero and zero["stage"] != zero_stage:
        raise ValueError(
            f"ds_config['zero_optimization']['stage'] = {zero['stage']!r} disagrees with "
            f"zero_stage={zero_stage}: pass the stage as zero_stage"
        )
    return _merge(cfg, ds_config)


def _ensure_process_group(device: torch.device) -> bool:
    """Start a one-process group (gloo on CPU, NCCL on CUDA) if none exists, and set the
    ``LOCAL_RANK`` that DeepSpeed requires when no launcher set it; True if a group was started.
    """
    dist = torch.distributed
    if not dist.is_available():
        raise RuntimeError("DeepSpeedTrainEngine needs torch.distributed, which this torch build lacks")
    started = False
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        started = True
        # DeepSpeed caches a clone of the world group; one from a world that has since been
        # destroyed (e.g. by an in-process vLLM engine's shutdown) is no longer registered
        groups = sys.modules.get("deepspeed.utils.groups")
        if groups is not None and getattr(groups, "_WORLD_GROUP", None) is not None:
            groups._WORLD_GROUP = None
    if "LOCAL_RANK" not in os.environ and "OMPI_COMM_WORLD_LOCAL_RANK" not in os.environ:
        if device.type == "cuda" and dist.get_world_size() > 1:
            raise ValueError(
                "LOCAL_RANK is not set: with several GPU ranks start them with torchrun / the deepspeed "
                "launcher, or set LOCAL_RANK (the GPU index of this rank on its node)"
            )
        # CPU: the local rank only names the device ("cpu"); one process: rank 0.
        os.environ["LOCAL_RANK"] = str(dist.get_rank()) if device.type == "cpu" else "0"
    return started


def _skip_shm_comm_build(deepspeed: Any) -> None:
    """On CPU, DeepSpeed's communication backend JIT-compiles a shared-memory all-reduce op
    (minutes of C++ compilation) when it is first created; the op only serves
    ``inference_all_reduce``, never training, so mark it unavailable (DeepSpeed keeps this
    dict for the process, and reads it only when it builds the op)."""
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def _detached_copy(obj: Any) -> Any:
    """Tensors inside dicts / lists / tuples replaced by detached copies (DeepSpeed's optimizer
    state holds live, partly non-leaf tensors, which ``copy.deepcopy`` refuses)."""
    if isinstance(obj, Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _detached_copy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
        return type(obj)(_detached_copy(v) for v in obj)
    return obj


def _check_chunk_tokens(logprob_chunk_tokens: Any) -> None:
    if (
        isinstance(logprob_chunk_tokens, bool)
        or not isinstance(logprob_chunk_tokens, int)
        or logprob_chunk_tokens < 0
    ):
        raise ValueError(f"logprob_chunk_tokens must be an int >= 0, got {logprob_chunk_tokens!r}")


def _check_args(
    model: Any,
    zero_stage: Any,
    lr: Any,
    weight_decay: Any,
    grad_clip: Any,
    dtype: Any,
    optimizer: Any,
    optimizer_factory: Any,
    device: Any,
) -> torch.device:
    """The constructor's argument checks; returns the device."""
    if isinstance(zero_stage, bool) or not isinstance(zero_stage, int) or zero_stage not in ZERO_STAGES:
        raise ValueError(f"zero_stage must be one of {ZERO_STAGES}, got {zero_stage!r}")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module (a transformers causal LM), got {type(model)}")
    if not (isinstance(lr, (int, float)) and lr > 0 and math.isfinite(lr)):
        raise ValueError(f"lr must be a finite number > 0, got {lr!r}")
    if not (isinstance(weight_decay, (int, float)) and weight_decay >= 0):
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay!r}")
    if grad_clip is not None and not (isinstance(grad_clip, (int, float)) and grad_clip > 0):
        raise ValueError(f"grad_clip must be None or > 0, got {grad_clip!r}")
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {_DTYPES}, got {dtype!r}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if optimizer is not None and optimizer_factory is not None:
        raise ValueError("pass optimizer or optimizer_factory, not both")
    device = torch.device(device)
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {str(device)!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but torch sees no CUDA device")
    return device


def _deepspeed_for(device: torch.device) -> Any:
    """deepspeed, checked to run on ``device``'s accelerator (DS_ACCELERATOR)."""
    deepspeed = import_deepspeed()
    acc = require("deepspeed.accelerator").get_accelerator().device_name()
    if (acc == "cpu") != (device.type == "cpu"):
        raise ValueError(
            f"device={str(device)!r} but DeepSpeed's accelerator is {acc!r}: set DS_ACCELERATOR="
            f"{'cpu' if device.type == 'cpu' else 'cuda'} before deepspeed is first imported"
        )
    if device.type == "cpu":
        _skip_shm_comm_build(deepspeed)
    return deepspeed


class DeepSpeedTrainEngine(Offloadable):
    """A :class:`~trainers.engines.base.TrainEngine` on DeepSpeed ZeRO, stages 0 to 3.

    Args:
        model: a transformers causal LM (``Qwen2ForCausalLM``, ``LlamaForCausalLM``, ...).
            Its weights are used as they are on rank 0 (DeepSpeed broadcasts them).
        zero_stage: 0, 1, 2 or 3 (see the module docstring).
        lr, weight_decay: for the default optimizer ``torch.optim.AdamW(lr, betas=(0.9,
            0.999), weight_decay)``.
        grad_clip: clip the global gradient norm to this (``None``: no clipping).
        optimizer: a torch optimizer over ``model``'s parameters, or None to build one with
            ``optimizer_factory(params)`` or the default AdamW. DeepSpeed wraps it: under ZeRO
            it steps the rank's flat fp32 partition of each parameter group (elementwise
            optimizers such as Adam(W)/SGD give the same update as on the whole tensors).
        scheduler: an LR scheduler over ``optimizer``, or a callable ``optimizer ->
            scheduler``; stepped by the engine once per applied :meth:`step`.
        dtype: ``torch.float32``, or ``torch.bfloat16`` / ``torch.float16`` for DeepSpeed's
            mixed precision (low-precision weights and gradients, fp32 master weights in the
            optimizer; fp16 with dynamic loss scaling). Log-probs are float32 either way.
        device: ``"cpu"`` or ``"cuda"`` (DeepSpeed places the model on ``cuda:LOCAL_RANK``).
        gradient_checkpointing: recompute activations in the backward (non-reentrant).
        logprob_chunk_tokens: ``> 0``: the memory-lean log-probs of
            :func:`trainers.engines.torch_train.response_logprobs` (ZeRO 0-2).
        share_prompts: run each distinct prompt of a micro-batch once (as
            :func:`~trainers.engines.torch_train.response_logits`); off under checkpointing.
        packing: padding-free micro-batches (:mod:`trainers.engines.packed`; with ``share_prompts`` a repeated prompt appears once in the packed row).
        compile_backend, fused_optimizer: compiled decoder layers, fused AdamW
            (:mod:`trainers.engines.compiled`, as ``TorchTrainEngine``).
        ds_config: a DeepSpeed config dict merged over :func:`build_ds_config` (e.g.
            ``{"zero_optimization": {"offload_param": ...}}``).

    ``step`` returns ``{"grad_norm", "lr", "skipped"}``: the global gradient norm before
    clipping (across ranks and partitions), the learning rate used, and 1 when the norm was
    not finite and the update skipped (no parameter or optimizer-state change, gradients
    discarded, scheduler not stepped; DeepSpeed then reports the norm as ``inf`` under ZeRO).

    :meth:`offload` / :meth:`onload` (``placement.offload_train``, every stage): rollkit's own
    storage mover (:mod:`trainers.engines.offload`) over the module's parameters, gradients and
    buffers, the torch optimizer's state and every tensor DeepSpeed's optimizer holds (flat
    bit16 / fp32 partitions, gradient buffers). DeepSpeed's ``offload_states()`` covers ZeRO 1-3
    only and moves to ``"cpu"``, which on the CPU accelerator is where the states already are.
    """

    #: a LoRA policy's :meth:`export_weights`: ``"merged"`` (full weights, any rollout engine)
    #: or ``"adapter"`` (the adapter alone, for vLLM's LoRA support); set it on the engine
    lora_export: str = "merged"

    def __init__(
        self,
        model: Any,
        *,
        zero_stage: int = 2,
        lr: float = 1e-5,
        weight_decay: float = 0.0,
        grad_clip: float | None = 1.0,
        optimizer: torch.optim.Optimizer | None = None,
        optimizer_factory: Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer] | None = None,
        scheduler: Any = None,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        gradient_checkpointing: bool = False,
        share_prompts: bool = True,
        ds_config: dict[str, Any] | None = None,
        logprob_chunk_tokens: int = 0,
        packing: bool = False,
        compile_backend: str | None = None,
        fused_optimizer: bool = False,
    ) -> None:
        device = _check_args(
            model, zero_stage, lr, weight_decay, grad_clip, dtype, optimizer, optimizer_factory, device
        )
        _check_chunk_tokens(logprob_chunk_tokens)
        if zero_stage == 3 and is_lora(model):
            raise ValueError(
                "model: a LoRA (peft) model needs zero_stage <= 2 (the merged export reads whole weights)"
            )
        if logprob_chunk_tokens and zero_stage == 3:
            raise ValueError(
                "logprob_chunk_tokens: the memory-lean log-probs apply the LM head outside its module's "
                "forward, where ZeRO-3 keeps the weight partitioned; use zero_stage <= 2 or logprob_chunk_tokens=0"
            )
        self.logprob_chunk_tokens = logprob_chunk_tokens
        # ZeRO-0 in fp32 steps the torch optimizer as it is, and DeepSpeed would clip without
        # reporting the norm: the engine clips itself there (see _pre_step_hook).
        self._plain = zero_stage == 0 and dtype == torch.float32
        cfg = build_ds_config(
            zero_stage, grad_clip=None if self._plain else grad_clip, dtype=dtype, ds_config=ds_config
        )

        deepspeed = _deepspeed_for(device)
        self.owns_process_group = _ensure_process_group(device)

        self.zero_stage = zero_stage
        self.grad_clip = grad_clip
        self.dtype = dtype
        self.share_prompts, self.packing = share_prompts, bool(packing)
        prepare_model(model, packing=self.packing, compile_backend=compile_backend)
        self._ckpt = gradient_checkpointing
        if device.type == "cpu":
            model = model.to("cpu")  # on GPUs DeepSpeed moves it to cuda:LOCAL_RANK
        if gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        params = [p for p in model.parameters() if p.requires_grad]
        if optimizer is None:
            if optimizer_factory is not None:
                optimizer = optimizer_factory(params)
            else:
                optimizer = adamw(params, lr=lr, weight_decay=weight_decay, fused=fused_optimizer)
        self.optimizer = optimizer  # the torch optimizer; DeepSpeed wraps it (self.engine.optimizer)
        self.engine, _, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, config=cfg, dist_init_required=False
        )
        self.model = self.engine.module
        self.device = torch.device(self.engine.device)
        if callable(scheduler) and not hasattr(scheduler, "step"):
            scheduler = scheduler(optimizer)
        self.scheduler = scheduler
        self.global_step = 0
        dist = torch.distributed
        self.world_size = dist.get_world_size()
        self.rank = dist.get_rank()
        # ZeRO-0 in fp32 steps the torch optimizer directly, without computing a norm or
        # checking for overflow: a step pre-hook (after DeepSpeed's all-reduce) does both.
        self._norm: float | None = None
        if self._plain:
            if self.engine.optimizer is not optimizer:
                raise RuntimeError("DeepSpeed wrapped the optimizer of a ZeRO-0 fp32 engine unexpectedly")
            optimizer.register_step_pre_hook(self._pre_step_hook)

    def _offload_tensors(self) -> list[Tensor]:
        wrapper = self.engine.optimizer
        extra = reachable_tensors(wrapper) if wrapper is not self.optimizer else []
        return state_tensors(self.model, [self.optimizer], extra)

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
        where ``response_mask`` is False; with ``with_entropy`` also the ``[B, T]`` entropy of
        the processed distribution. Same definition as ``TorchTrainEngine.logprobs``; the
        forward runs through the DeepSpeed engine (ZeRO-3 gathers each layer's weights)."""
        return response_logprobs(
            self.engine,
            input_ids,
            attention_mask,
            response_mask,
            temperature=temperature,
            with_entropy=with_entropy,
            top_k=top_k,
            top_p=top_p,
            share_prompts=self.share_prompts and not self._ckpt,
            device=self.device,
            chunk_tokens=self.logprob_chunk_tokens,
            packed=self.packing,
            inputs=inputs,
        )

    @resident
    def backward(self, loss: Tensor) -> None:
        """Accumulate ``d loss / d params`` for one micro-batch, unscaled (the caller's loss
        is already its share of the batch: no division by an accumulation step count)."""
        if not isinstance(loss, Tensor) or loss.dim() != 0:
            shape = list(loss.shape) if isinstance(loss, Tensor) else type(loss).__name__
            raise ValueError(f"loss must be a scalar tensor, got {shape} (use rollkit.losses.aggregate)")
        self.engine.backward(loss, scale_wrt_gas=False)

    @resident
    def zero_grad(self) -> None:
        """Discard the accumulated gradient (including ZeRO-1/2/3's reduced partitions).

        :meth:`step` already does this; call it only to drop micro-batches already
        back-propagated. With several ranks, every rank must call it."""
        self.engine.zero_grad()
        opt = self.engine.optimizer
        if self.zero_stage in (1, 2):
            # The ZeRO-1/2 optimizer keeps the reduced partitions between backwards; drop them
            # as its own overflow path does.
            opt.zero_grad(set_to_none=True)
            opt._release_preflattened_grad_buffers()
            for k in list(opt.averaged_gradients.keys()):
                opt.averaged_gradients[k] = None
            for k in list(opt.all_grad_tensors.keys()):  # the sums over micro-batches so far
                opt.all_grad_tensors[k] = None
        elif self.zero_stage == 3:
            # micro_step_id 0: the next backward overwrites the gradient partitions.
            opt.zero_grad(set_to_none=True)
            opt.averaged_gradients = {}
        elif not self._plain:
            opt.zero_grad()

    @torch.no_grad()
    def _pre_step_hook(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        max_norm = self.grad_clip if self.grad_clip is not None else math.inf
        norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm)) if params else 0.0
        self._norm = norm
        if not math.isfinite(norm):  # torch optimizers skip parameters without a gradient
            for p in params:
                p.grad = None

    @resident
    def step(self) -> dict[str, float]:
        """Finish the gradient reduction, clip, optimizer step, scheduler step, zero the
        gradient (every rank must call it).

        Returns ``{"grad_norm": global norm before clipping, "lr": lr used, "skipped": 0 or
        1}`` (module and class docstrings).
        """
        lr = float(self.optimizer.param_groups[0]["lr"])
        self._norm = None
        self.engine.step()
        if self._plain:
            norm = self._norm if self._norm is not None else 0.0
            skipped = not math.isfinite(norm)
        else:
            skipped = not self.engine.was_step_applied()
            got = self.engine.get_global_grad_norm()
            norm = float(got) if got is not None else float("nan")
            if skipped:
                norm = norm if not math.isfinite(norm) else float("inf")
        if skipped:
            return {"grad_norm": norm, "lr": lr, "skipped": 1.0}
        if self.scheduler is not None:
            self.scheduler.step()
        self.global_step += 1
        return {"grad_norm": norm, "lr": lr, "skipped": 0.0}

    # ------------------------------------------------------------------ weights / checkpoints

    def _param_groups(self) -> Iterator[list[tuple[str, torch.nn.Parameter]]]:
        return size_groups(self.model.named_parameters(), lambda np: int(getattr(np[1], "ds_numel", np[1].numel())),
                           EXPORT_GROUP_NUMEL)

    @resident
    def save_model(self, path: str | Path, tokenizer: Any = None) -> Path:
        """The policy as a Hugging Face model directory, written by rank 0 from the gathered
        weights (:meth:`export_weights`; ZeRO-3: every rank must call this)."""
        if is_lora(self.model):  # ZeRO 0-2 (refused with ZeRO-3): the merged model
            if self.rank == 0:
                save_lora(self.model, tokenizer, path, merged=True)
            return Path(path)
        weights = {k: v.clone() for k, v in self.export_weights()}
        if self.rank == 0:
            save_model(self.engine.module, tokenizer, path, state_dict=weights)
        return Path(path)

    @resident
    def export_weights(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, Tensor]]:
        """``(name, full tensor)`` for every parameter, named as in the model's ``state_dict``
        (a tied ``lm_head.weight`` appears once, as the embedding), for ``update_weights``.

        ZeRO-0/1/2: every rank holds the full weights; the tensors are detached views of the
        live parameters (no copy unless ``dtype`` asks for a cast): consume them before the
        next :meth:`step`. ZeRO-3: the parameters are gathered with
        ``deepspeed.zero.GatheredParameters`` a group of at most :data:`EXPORT_GROUP_NUMEL`
        elements at a time, copied, and released, so the peak extra memory is one group plus
        what the consumer keeps; this is a collective: **every rank must iterate the whole
        generator**, in the same order (rank 0 pushing to the rollout engine and the others
        draining it with ``for _ in engine.export_weights(): pass``). Each gather is an
        all-gather of the group's shards, so exporting costs about one forward's weight
        traffic.
        """
        if is_lora(self.model):  # merged (base names) or the adapter alone: lora_export
            yield from lora_export_weights(self.model, self.lora_export, dtype)
            return
        if self.zero_stage != 3:
            for name, p in self.model.named_parameters():
                t = p.detach()
                yield name, (t if dtype is None else t.to(dtype))
            return
        import deepspeed

        for group in self._param_groups():
            with deepspeed.zero.GatheredParameters([p for _, p in group], modifier_rank=None):
                out = [(n, p.detach().to(dtype or p.dtype, copy=True)) for n, p in group]
            yield from out

    def _model_state(self) -> dict[str, Tensor]:
        state = {n: t.clone() if self.zero_stage != 3 else t for n, t in self.export_weights()}
        names = {n for n, _ in self.model.named_parameters()}
        for n, t in self.model.state_dict().items():  # persistent buffers (never partitioned)
            if n not in names and n not in state and not self._is_param_alias(n):
                state[n] = t.detach().clone()
        return state

    def _is_param_alias(self, name: str) -> bool:
        return name in self._aliases()

    def _aliases(self) -> set[str]:
        """state_dict names that are another name of a parameter (tied weights)."""
        if not hasattr(self, "_alias_cache"):
            first: dict[int, str] = {}
            aliases = set()
            for n, p in self.model.named_parameters(remove_duplicate=False):
                if id(p) in first:
                    aliases.add(n)
                else:
                    first[id(p)] = n
            self._alias_cache = aliases
        return self._alias_cache

    @resident
    def state_dict(self) -> dict[str, Any]:
        """``{"model", "optimizer", "scheduler", "global_step", "zero_stage", "world_size",
        "rank"}``, for resuming.

        ``model`` holds full (gathered, copied) weights named as in the model's
        ``state_dict`` (tied aliases left out) and the persistent buffers: the same on every
        rank. All tensors are copies (``torch.save`` it as it is). ``optimizer`` is this rank's DeepSpeed optimizer state: under ZeRO-1/2/3 the
        rank's partition of the fp32 master weights and of the torch optimizer's state (loss
        scaler included), under ZeRO-0 the torch optimizer's ``state_dict``. So a checkpoint
        resumes exactly with the same ZeRO stage and the same number of ranks, each rank
        loading its own ``state_dict`` (save one file per rank); with another world size only
        the model weights carry over (see :meth:`load_state_dict`). A collective under
        ZeRO-3 (every rank must call it).
        """
        return {
            "model": self._model_state(),
            "optimizer": _detached_copy(self.engine.optimizer.state_dict()),
            "scheduler": None if self.scheduler is None else self.scheduler.state_dict(),
            "global_step": self.global_step,
            "zero_stage": self.zero_stage,
            "world_size": self.world_size,
            "rank": self.rank,
        }

    @resident
    def load_state_dict(self, state: dict[str, Any], *, load_optimizer: bool = True) -> None:
        """Restore :meth:`state_dict` (every rank calls it, with its own rank's state).

        The model weights are always loaded (strict about names and shapes). The optimizer
        state needs the same ZeRO stage and world size (and this rank's own state);
        otherwise ``ValueError`` — pass ``load_optimizer=False`` to start a fresh optimizer
        from the loaded weights instead.
        """
        if not isinstance(state, dict) or "model" not in state:
            raise ValueError("state must be a dict from DeepSpeedTrainEngine.state_dict()")
        if load_optimizer:
            got = (state.get("zero_stage"), state.get("world_size"), state.get("rank"))
            want = (self.zero_stage, self.world_size, self.rank)
            if got != want:
                raise ValueError(
                    f"optimizer state saved with (zero_stage, world_size, rank) = {got}, this engine has "
                    f"{want}: load each rank's own state with the same stage and world size, or pass "
                    "load_optimizer=False to keep only the weights"
                )
        self._load_model(state["model"])
        if load_optimizer:
            if self.zero_stage == 0:
                self.engine.optimizer.load_state_dict(state["optimizer"])
            else:
                sd_list = [None] * self.world_size
                sd_list[self.rank] = state["optimizer"]
                self.engine.optimizer.load_state_dict(
                    sd_list, load_optimizer_states=True, load_from_fp32_weights=True
                )
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        self.global_step = int(state.get("global_step", 0))

    @torch.no_grad()
    def _load_model(self, weights: dict[str, Tensor]) -> None:
        params = dict(self.model.named_parameters())
        buffers = {n: b for n, b in self.model.named_buffers() if n in self.model.state_dict()}
        aliases = self._aliases()
        unknown = [n for n in weights if n not in params and n not in buffers and n not in aliases]
        missing = [n for n in params if n not in weights]
        if unknown or missing:
            raise KeyError(f"load_state_dict: unknown model keys {unknown[:5]}, missing {missing[:5]}")
        for n, p in params.items():
            shape = tuple(getattr(p, "ds_shape", p.shape))  # ZeRO-3: the full shape
            if tuple(weights[n].shape) != shape:
                raise ValueError(
                    f"load_state_dict: {n!r} has shape {list(weights[n].shape)}, expected {list(shape)}"
                )
        for n, t in weights.items():
            if n in buffers:
                buffers[n].copy_(t)
        if self.zero_stage != 3:
            for n, p in params.items():
                p.copy_(weights[n])
        else:
            import deepspeed

            for group in self._param_groups():
                with deepspeed.zero.GatheredParameters([p for _, p in group], modifier_rank=0):
                    for n, p in group:
                        p.copy_(weights[n])
        refresh = getattr(self.engine.optimizer, "refresh_fp32_params", None)
        if callable(refresh):  # the fp32 master weights (ZeRO partitions, mixed precision) follow
            refresh()


def build_deepspeed_train(cfg: Any, model: Any, *, device: str, **common: Any) -> DeepSpeedTrainEngine:
    """``train.engine=deepspeed`` (ZeRO ``train.zero_stage``) over ``model`` with the settings every
    engine takes (``common``); an explicit ``train.autocast`` is refused (DeepSpeed's own bf16 mode)."""
    train_autocast(cfg, device)  # rejects an explicit autocast
    t = cfg.train
    eng = DeepSpeedTrainEngine(
        model,
        zero_stage=t.zero_stage,
        gradient_checkpointing=bool(t.gradient_checkpointing),
        device=device,
        **common,
    )
    eng.lora_export = lora_export(cfg)
    return eng
