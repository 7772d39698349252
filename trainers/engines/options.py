"""What every engine builder reads from a config: the dtype policy, the learning-rate schedule and
the LoRA settings.

The dtype policy: ``rollout.dtype`` and ``train.autocast`` may say ``auto``, which picks
bfloat16 where its matmuls are fast (:func:`fast_bf16`: CUDA with bf16, or a CPU with AMX
tiles) and the model's dtype elsewhere. ``ROLLKIT_FAST_BF16=0`` forces the "not fast" answer
(float32 on any CPU) and ``=1`` the fast one, so one machine can exercise both paths.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any

import torch

from trainers.config import TRAIN_ENGINES
from trainers.config.engines import check_autocast
from trainers.engines.lora import adapter_config

__all__ = [
    "DTYPES",
    "dtype_name",
    "fast_bf16",
    "lora_export",
    "lora_targets",
    "lr_lambda",
    "parse_dtype",
    "rollout_dtype",
    "rollout_lora",
    "train_autocast",
]

#: dtype names of the config -> torch dtypes
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(name: str, field: str = "model.dtype") -> torch.dtype:
    """The torch dtype called ``name`` (``float32``, ``bfloat16`` or ``float16``)."""
    try:
        return DTYPES[name]
    except (KeyError, TypeError):
        raise ValueError(f"{field} must be float32, bfloat16 or float16, got {name!r}") from None


def dtype_name(dtype: torch.dtype) -> str:
    """The config name of a torch dtype (``torch.bfloat16`` -> ``"bfloat16"``)."""
    return {v: k for k, v in DTYPES.items()}[dtype]


def fast_bf16(device: str) -> bool:
    """Whether bfloat16 matmuls are fast on ``device``: CUDA with bf16 support, or a CPU with
    AMX tiles (measured on this project's CPUs: 4-9x float32 for a 2048x576x1536 matmul).
    ``ROLLKIT_FAST_BF16=0`` / ``=1`` overrides the answer (tests exercise both paths)."""
    force = os.environ.get("ROLLKIT_FAST_BF16", "")
    if force in ("0", "1"):
        return force == "1"
    if str(device).startswith("cuda"):
        return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    amx = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(amx is not None and amx())


def rollout_dtype(cfg: Any, device: str) -> torch.dtype:
    """``rollout.dtype`` resolved (``""``: ``model.dtype``; ``"auto"``: bfloat16 if fast)."""
    d = cfg.rollout.dtype
    if d == "":
        return parse_dtype(cfg.model.dtype)
    if d == "auto":
        return torch.bfloat16 if fast_bf16(device) else parse_dtype(cfg.model.dtype)
    if d not in DTYPES:
        raise ValueError(f"rollout.dtype must be '', auto, float32, bfloat16 or float16, got {d!r}")
    return DTYPES[d]


def train_autocast(cfg: Any, device: str) -> torch.dtype | None:
    """``train.autocast`` resolved to a dtype or None (``"auto"``: bfloat16 if fast and the
    model is float32, for an engine that autocasts: the torch engine, Megatron on CUDA)."""
    a = cfg.train.autocast
    if a == "off":
        return None
    where = TRAIN_ENGINES[cfg.train.engine].autocast  # "any", "cuda" or "none"
    if a == "auto":
        ok = where == "any" or (where == "cuda" and device.startswith("cuda"))
        ok = ok and cfg.model.dtype == "float32" and fast_bf16(device)
        return torch.bfloat16 if ok else None
    if a not in ("bfloat16", "float16"):
        raise ValueError(f"train.autocast must be off, auto, bfloat16 or float16, got {a!r}")
    check_autocast(cfg.train)  # the config's rule, for a config never validated
    return DTYPES[a]


def lr_lambda(cfg: Any) -> Callable[[int], float]:
    """The learning-rate factor per optimizer step: linear warm-up over ``train.warmup_steps``,
    then constant or cosine decay to 0 at ``train.steps`` (``train.lr_schedule``)."""
    warm, total, kind = cfg.train.warmup_steps, max(cfg.train.steps, 1), cfg.train.lr_schedule
    if kind not in ("constant", "cosine"):
        raise ValueError(f"train.lr_schedule must be constant or cosine, got {kind!r}")

    def f(step: int) -> float:  # step counts optimizer steps
        if warm and step < warm:
            return (step + 1) / warm
        if kind == "cosine":
            return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warm) / max(1, total - warm))))
        return 1.0

    return f


def lora_targets(cfg: Any) -> tuple[str, ...]:
    return tuple(s.strip() for s in cfg.train.lora_targets.split(",") if s.strip())


def rollout_lora(cfg: Any) -> dict[str, Any] | None:
    """The adapter config a vLLM rollout engine serves (``rollout.lora_weights=adapter``), else None."""
    t = cfg.train
    if not t.lora_rank or lora_export(cfg) != "adapter":
        return None
    return adapter_config(t.lora_rank, t.lora_alpha or None, lora_targets(cfg))


def lora_export(cfg: Any) -> str:
    """``rollout.lora_weights`` where the config has one (offline configs have no rollout)."""
    return getattr(getattr(cfg, "rollout", None), "lora_weights", "merged")
