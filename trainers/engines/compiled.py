"""Compiled decoder layers and a fused optimizer for the training engines (``train.compile``,
``train.fused_optimizer``).

``compile_layers(model)`` puts each decoder layer of a Hugging Face causal LM (or value model)
under ``torch.compile`` in place (``nn.Module.compile``: the module keeps its parameters, names
and state-dict keys; the first call of each new shape family compiles), "regional" compilation
as torchtitan applies it per transformer block: one layer's graph is compiled once and reused
by every layer, so compile time does not grow with depth. ``dynamic=True`` marks the sequence
length dynamic from the start (RL micro-batches change length every call; without it every new
length would recompile). The packed attention (``trainers.engines.packed``) splits its samples
with a Python loop over ``cu_seqlens``: there dynamo breaks the graph and the loop runs eagerly
between the compiled projections and MLP.

``adamw(params, lr, weight_decay, fused)``: ``torch.optim.AdamW`` with ``fused=True`` where this
torch has a fused kernel for the parameters' device (CUDA; CPU since torch 2.4), else the
default (``foreach``) implementation; the update rule is the same, the rounding differs.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import Any

import torch

from trainers.engines.packed import enable_packing, unwrap_hf

__all__ = ["COMPILE_BACKENDS", "adamw", "compile_layers", "decoder_layers", "prepare_model"]

COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")


def decoder_layers(model: Any) -> Any:
    """The ``nn.ModuleList`` of decoder layers of ``model`` (through DeepSpeed / peft wrappers)."""
    hf = unwrap_hf(model)
    for owner in (getattr(hf, "model", None), getattr(hf, "base_model", None), hf):
        layers = getattr(owner, "layers", None)
        if isinstance(layers, torch.nn.ModuleList) and len(layers):
            return layers
    raise ValueError(f"train.compile: {type(hf).__name__} has no decoder layers (model.layers) to compile")


def compile_layers(model: Any, *, backend: str = "inductor", dynamic: bool = True) -> int:
    """``torch.compile`` each decoder layer of ``model`` in place; returns how many. Idempotent
    (a compiled layer is left as it is)."""
    if backend not in COMPILE_BACKENDS:
        raise ValueError(f"train.compile_backend must be one of {COMPILE_BACKENDS}, got {backend!r}")
    layers = decoder_layers(model)
    for layer in layers:
        if getattr(layer, "_compiled_call_impl", None) is None:
            layer.compile(backend=backend, dynamic=dynamic)
    return len(layers)


def _has_fused(device: torch.device) -> bool:
    if "fused" not in inspect.signature(torch.optim.AdamW).parameters:
        return False
    from torch.optim.optimizer import _get_fused_kernels_supported_devices

    return device.type in _get_fused_kernels_supported_devices()


def adamw(
    params: Iterable[torch.nn.Parameter], *, lr: float, weight_decay: float, fused: bool = False
) -> torch.optim.Optimizer:
    """AdamW(lr, betas=(0.9, 0.999), weight_decay), fused where asked and available."""
    params = list(params)
    kw: dict[str, Any] = {"lr": lr, "betas": (0.9, 0.999), "weight_decay": weight_decay}
    if fused and params and _has_fused(params[0].device) and all(p.is_floating_point() for p in params):
        kw["fused"] = True
    return torch.optim.AdamW(params, **kw)


def prepare_model(model: Any, *, packing: bool = False, compile_backend: str | None = None) -> None:
    """What an engine does to its model for ``packing`` (:func:`trainers.engines.packed.enable_packing`)
    and ``compile_backend`` (:func:`compile_layers`; ``None``: no compilation)."""
    if packing:
        enable_packing(model)
    if compile_backend:
        compile_layers(model, backend=compile_backend)
