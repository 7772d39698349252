"""Engines from a config: the policy model and the rollout / train engine factories.

Every loop builds its engines here, in process or inside a Ray actor:

* :func:`build_model` loads ``cfg.model`` (``"tiny"``: a random tiny Qwen2 with the character
  tokenizer; ``""``: the embedded default SmolLM2-135M-Instruct; else a checkpoint directory);
* :func:`make_rollout_engine` / :func:`make_train_engine` wrap a model in the engine that
  ``rollout.engine`` / ``train.engine`` names: the builder its line in
  :data:`trainers.config.ROLLOUT_ENGINES` / :data:`~trainers.config.TRAIN_ENGINES` names
  (:func:`engine_builder`), with the config's sampling dtype, optimizer and learning-rate
  schedule; :func:`build_engines` does both (the rollout gets a copy).

The dtype policy, the schedule and the LoRA settings every builder reads are
:mod:`trainers.engines.options` (re-exported here).
"""

from __future__ import annotations

import copy
import importlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from trainers.config import ROLLOUT_ENGINES, TRAIN_ENGINES
from trainers.deps import require
from trainers.engines.base import RolloutEngine, TrainEngine
from trainers.engines.lora import apply_lora
from trainers.engines.options import (
    DTYPES,
    dtype_name,
    fast_bf16,
    lora_targets,
    lr_lambda,
    parse_dtype,
    rollout_dtype,
    train_autocast,
)
from trainers.engines.torch_train import TorchTrainEngine
from trainers.models import char_tokenizer, default_model_path, is_hub_id, load_model, tiny_qwen2
from trainers.vision import (
    freeze_vision,
    is_vision_checkpoint,
    load_vision_model,
    tiny_idefics3,
    tiny_qwen2_vl,
    vision_tokenizer,
)

#: ``model.path`` names of the tiny random vision-language models: (tokenizer family, builder)
TINY_VLMS = {"tiny_vl": ("qwen2_vl", tiny_qwen2_vl), "tiny_idefics3": ("idefics3", tiny_idefics3)}

__all__ = [
    "DTYPES",
    "ROLLOUT_ENGINES",
    "TRAIN_ENGINES",
    "build_engines",
    "build_model",
    "dtype_name",
    "engine_builder",
    "fast_bf16",
    "frozen_reference",
    "lr_lambda",
    "make_rollout_engine",
    "make_train_engine",
    "parse_dtype",
    "rollout_dtype",
    "train_autocast",
]


def tiny_heads(cfg: Any) -> int:
    """``model.tiny_heads``, where 0 picks 4 heads (head size 16), or 2 (head size 32) for a
    rollout engine without head size 16 (vLLM's CPU attention: ``rollout.engine`` vllm or server)."""
    if cfg.model.tiny_heads:
        return int(cfg.model.tiny_heads)
    engine = getattr(getattr(cfg, "rollout", None), "engine", "hf")
    return 4 if ROLLOUT_ENGINES.supports(engine, "head_size_16") else 2


def build_model(cfg: Any, *, max_positions: int = 512) -> tuple[Any, Any]:
    """``(model, tokenizer)`` of ``cfg.model``: the tiny Qwen2 + character tokenizer for
    ``"tiny"`` (``max_positions`` long), the tiny Qwen2-VL for ``"tiny_vl"`` (Idefics3:
    ``"tiny_idefics3"``), else a local Hugging
    Face checkpoint (``""``: the embedded default); a vision-language one with its processor
    attached to the tokenizer and, with ``model.freeze_vision``, its image tower frozen."""
    dtype = parse_dtype(cfg.model.dtype)
    m = cfg.model
    if m.path in TINY_VLMS or (m.path not in ("", "tiny") and is_vision_checkpoint(m.path)):
        if m.path in TINY_VLMS:
            family, make = TINY_VLMS[m.path]
            tok = vision_tokenizer(family)
            model, _ = make(tok, seed=m.tiny_seed, dtype=dtype, max_positions=max(max_positions, 1024))
        else:
            model, tok = load_vision_model(m.path, dtype=dtype)
        if m.freeze_vision:
            freeze_vision(model)
        return model, tok
    if m.path == "tiny":
        tok = char_tokenizer()
        model = tiny_qwen2(
            tok,
            seed=m.tiny_seed,
            heads=tiny_heads(cfg),
            kv_heads=m.tiny_kv_heads,
            dtype=dtype,
            max_positions=max_positions,
        )
        return model, tok
    path = m.path or default_model_path()
    if not Path(path).exists() and not is_hub_id(path):
        raise ValueError(
            f"model.path: {path} does not exist (give a local HF checkpoint directory or a hub name)"
        )
    return load_model(path, dtype=dtype)


def engine_builder(table: Any, name: str) -> Callable[..., Any]:
    """The builder of engine ``name`` in ``table`` (:data:`trainers.config.ROLLOUT_ENGINES` /
    :data:`~trainers.config.TRAIN_ENGINES`): its spec's ``"module:function"``, imported now (the
    configuration names engines without importing them)."""
    spec = table[name]
    module, _, attr = spec.builder.partition(":")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{table.field}={name}: its builder {spec.builder} cannot be loaded ({e})") from None
    if not callable(fn):
        raise ValueError(f"{table.field}={name}: its builder {spec.builder} is not callable")
    return fn


def make_rollout_engine(cfg: Any, model: Any, tokenizer: Any, *, device: str) -> RolloutEngine:
    """The ``rollout.engine`` engine over ``model`` (used as is: pass a copy), built by the builder
    its line in :data:`trainers.config.ROLLOUT_ENGINES` names (``hf``:
    :func:`~trainers.engines.hf_rollout.build_hf_rollout`, ``vllm``:
    :func:`~trainers.engines.vllm_rollout.build_vllm_rollout`, ``server``:
    :func:`~trainers.engines.server_rollout.build_server_rollout`)."""
    return engine_builder(ROLLOUT_ENGINES, cfg.rollout.engine)(cfg, model, tokenizer, device=device)


def make_train_engine(cfg: Any, model: Any, *, device: str, task: str = "policy") -> TrainEngine:
    """The ``train.engine`` engine over ``model`` (``torch``, ``deepspeed`` with
    ``train.zero_stage``, ``fsdp2``, or ``megatron`` with ``train.megatron_tp`` / ``megatron_pp``), with the config's optimizer settings and LR schedule.
    ``task="value"``: ``model`` is a critic (:func:`trainers.critic.value_model`); with LoRA its
    value head trains in full beside the adapters."""
    t, dtype, lam = cfg.train, parse_dtype(cfg.model.dtype), lr_lambda(cfg)
    if t.lora_rank:
        model = apply_lora(
            model,
            rank=t.lora_rank,
            alpha=t.lora_alpha or None,
            dropout=t.lora_dropout,
            target_modules=lora_targets(cfg),
            seed=cfg.seed,
            value_head="score" if task == "value" else None,
        )
    common = dict(
        lr=t.lr,
        weight_decay=t.weight_decay,
        grad_clip=t.grad_clip,
        scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lam),
        dtype=dtype,
        logprob_chunk_tokens=t.logprob_chunk_tokens,
        packing=bool(t.packing),
        compile_backend=t.compile_backend if t.compile else None,
        fused_optimizer=bool(t.fused_optimizer),
    )
    return engine_builder(TRAIN_ENGINES, t.engine)(cfg, model, device=device, **common)


def build_engines(
    cfg: Any, *, model: Any = None, tokenizer: Any = None, max_positions: int = 512
) -> tuple[RolloutEngine, TrainEngine, Any]:
    """``(rollout, train, tokenizer)`` in this process: ``rollout.engine`` / ``train.engine``
    over ``model`` (default :func:`build_model`); the rollout gets a copy of the weights."""
    if model is None:
        model, tokenizer = build_model(cfg, max_positions=max_positions)
    elif tokenizer is None:
        raise ValueError("tokenizer: required with model")
    rollout = make_rollout_engine(cfg, copy.deepcopy(model), tokenizer, device=cfg.train.device)
    return rollout, make_train_engine(cfg, model, device=cfg.train.device), tokenizer


def _hf_class(engine: Any) -> Any:
    """The transformers class of a training engine's model (through FSDP2's wrapper class and a
    peft model's base); ``AutoModelForCausalLM`` for an engine without one (Megatron)."""
    model = getattr(engine, "model", None)
    base = getattr(model, "get_base_model", None)
    model = base() if callable(base) else model
    for cls in type(model).__mro__ if model is not None else ():
        if cls.__module__.startswith("transformers.") and hasattr(cls, "from_pretrained"):
            return cls
    return require("transformers").AutoModelForCausalLM


def frozen_reference(engine: Any, *, dtype: torch.dtype | None = None, packing: bool = False) -> Any:
    """A frozen copy of an in-process training engine's *current* weights behind the
    ``logprobs`` of :class:`TorchTrainEngine` (the KL reference, DPO's reference).

    A torch engine: a shallow copy with a deep copy of its model (eval, no gradients; its autocast
    and lean head kept). Any other engine (DeepSpeed, FSDP2, Megatron: their forward runs on the
    live, possibly sharded weights) is exported (``export_weights``: whole tensors under Hugging
    Face names; a LoRA policy's merged weights) into a fresh Hugging Face model of the same config
    behind a :class:`TorchTrainEngine` with ``dtype`` weights (``None``: the exported dtype)."""
    if type(engine) is TorchTrainEngine:
        ref = copy.copy(engine)
        ref.model = copy.deepcopy(engine.model).eval().requires_grad_(False)
        return ref
    if not hasattr(engine, "export_weights"):
        raise ValueError(
            f"reference: cannot copy {type(engine).__name__} (no export_weights); pass a reference engine"
        )
    config = getattr(engine, "_hf_config", None) or engine.model.config
    cls = _hf_class(engine)
    hf = cls.from_config(config) if hasattr(cls, "from_config") else cls(config)
    weights = dict(engine.export_weights())
    dtype = dtype or next(iter(weights.values())).dtype
    missing, unexpected = hf.load_state_dict(weights, strict=False)
    tied = (
        {k for k in missing if k.endswith("lm_head.weight")}
        if getattr(config, "tie_word_embeddings", False)
        else set()
    )
    if unexpected or set(missing) - tied:
        raise ValueError(f"reference: {type(engine).__name__}'s exported weights do not fit {cls.__name__}: "
                         f"missing {sorted(set(missing) - tied)[:3]}, unexpected {sorted(unexpected)[:3]}")  # fmt: skip
    device = getattr(engine, "device", "cpu")
    ref = TorchTrainEngine(hf, dtype=dtype, device=device, packing=packing)
    ref.model.eval().requires_grad_(False)
    return ref
