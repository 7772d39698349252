"""Engines from a config: the dtype policy, the policy model, and the rollout / train engine factories.

Every loop builds its engines here, in process or inside a Ray actor:

* :func:`build_model` loads ``cfg.model`` (``"tiny"``: a random tiny Qwen2 with the character
  tokenizer; ``""``: the embedded default SmolLM2-135M-Instruct; else a checkpoint directory);
* :func:`make_rollout_engine` / :func:`make_train_engine` wrap a model in the engine that
  ``rollout.engine`` / ``train.engine`` names, with the config's sampling dtype, optimizer and
  learning-rate schedule; :func:`build_engines` does both (the rollout gets a copy).

The dtype policy: ``rollout.dtype`` and ``train.autocast`` may say ``auto``, which picks
bfloat16 where its matmuls are fast (:func:`fast_bf16`: CUDA with bf16, or a CPU with AMX
tiles) and the model's dtype elsewhere. ``ROLLKIT_FAST_BF16=0`` forces the "not fast" answer
(float32 on any CPU) and ``=1`` the fast one, so one machine can exercise both paths.
"""

from __future__ import annotations

import copy
import math
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from trainers.config import ROLLOUT_ENGINES, TRAIN_ENGINES, server_addresses
from trainers.deps import require
from trainers.engines.base import RolloutEngine, TrainEngine
from trainers.engines.deepspeed_train import DeepSpeedTrainEngine
from trainers.engines.fsdp2_train import FSDP2TrainEngine
from trainers.engines.hf_rollout import HFRolloutEngine
from trainers.engines.lora import adapter_config, apply_lora
from trainers.engines.megatron_train import MegatronTrainEngine
from trainers.engines.server_rollout import ServerRolloutEngine
from trainers.engines.torch_train import TorchTrainEngine
from trainers.engines.vllm_rollout import VLLMRolloutEngine
from trainers.models import char_tokenizer, default_model_path, is_hub_id, load_model, save_model, tiny_qwen2
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
    "fast_bf16",
    "frozen_reference",
    "lr_lambda",
    "make_rollout_engine",
    "make_server_engine",
    "make_train_engine",
    "parse_dtype",
    "rollout_dtype",
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
    model is float32, for the torch engine)."""
    a = cfg.train.autocast
    if a == "off":
        return None
    if a == "auto":
        engine = cfg.train.engine
        ok = engine == "torch" or (engine == "megatron" and device.startswith("cuda"))
        ok = ok and cfg.model.dtype == "float32" and fast_bf16(device)
        return torch.bfloat16 if ok else None
    if a not in ("bfloat16", "float16"):
        raise ValueError(f"train.autocast must be off, auto, bfloat16 or float16, got {a!r}")
    if cfg.train.engine not in ("torch", "megatron"):
        raise ValueError(
            f"train.autocast={a} applies to the torch and megatron engines; with train.engine={cfg.train.engine} "
            "set model.dtype=bfloat16 (DeepSpeed's own bf16 mode)"
        )
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


def tiny_heads(cfg: Any) -> int:
    """``model.tiny_heads``, where 0 picks 4 heads (head size 16), or 2 (head size 32) for a vLLM
    rollout (``rollout.engine`` vllm or server): vLLM's CPU attention has no head size 16."""
    if cfg.model.tiny_heads:
        return int(cfg.model.tiny_heads)
    engine = getattr(getattr(cfg, "rollout", None), "engine", "hf")
    return 2 if engine in ("vllm", "server") else 4


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


def _lora_targets(cfg: Any) -> tuple[str, ...]:
    return tuple(s.strip() for s in cfg.train.lora_targets.split(",") if s.strip())


def _rollout_lora(cfg: Any) -> dict[str, Any] | None:
    """The adapter config a vLLM rollout engine serves (``rollout.lora_weights=adapter``), else None."""
    t = cfg.train
    if not t.lora_rank or _lora_export(cfg) != "adapter":
        return None
    return adapter_config(t.lora_rank, t.lora_alpha or None, _lora_targets(cfg))


def _lora_export(cfg: Any) -> str:
    """``rollout.lora_weights`` where the config has one (offline configs have no rollout)."""
    return getattr(getattr(cfg, "rollout", None), "lora_weights", "merged")


def make_rollout_engine(cfg: Any, model: Any, tokenizer: Any, *, device: str) -> RolloutEngine:
    """The ``rollout.engine`` engine over ``model`` (used as is: pass a copy). vLLM loads from
    a directory: the model and tokenizer are saved to a private temporary directory first,
    which lives as long as the engine (``engine.model_dir``)."""
    r = cfg.rollout
    if r.engine == "hf":
        if r.tensor_parallel_size != 1:
            raise ValueError(
                f"rollout.tensor_parallel_size={r.tensor_parallel_size}: the hf engine runs on one device"
            )
        return HFRolloutEngine(
            model, tokenizer, device=device, dtype=rollout_dtype(cfg, device), max_batch_size=r.max_batch_size
        )
    if r.engine == "vllm":
        tmp = tempfile.TemporaryDirectory(prefix="rollkit-vllm-")
        save_model(model, tokenizer, tmp.name)
        eng = VLLMRolloutEngine(
            tmp.name,
            dtype=dtype_name(rollout_dtype(cfg, device)),
            gpu_memory_utilization=r.gpu_memory_utilization,
            max_model_len=r.max_model_len,
            seed=cfg.seed,
            lora=_rollout_lora(cfg),
            tensor_parallel_size=r.tensor_parallel_size,
        )
        eng.model_dir = tmp  # removed with the engine
        return eng
    if r.engine == "server":
        return make_server_engine(cfg, model, tokenizer, device=device)
    raise ValueError(f"rollout.engine must be one of {ROLLOUT_ENGINES}, got {r.engine!r}")


def make_server_engine(cfg: Any, model: Any, tokenizer: Any, *, device: str) -> ServerRolloutEngine:
    """``rollout.engine=server``: a :class:`~trainers.engines.server_rollout.ServerRolloutEngine`
    over ``rollout.servers`` (which then get ``model``'s weights, version 0) or over
    ``rollout.num_servers`` local ``vllm serve`` processes of ``model``. The model, the server
    logs and the weight files live in ``rollout.server_dir`` (``""``: a temporary directory that
    lives as long as the engine, ``engine.model_dir``)."""
    r = cfg.rollout
    tmp = None
    if r.server_dir:
        run = Path(r.server_dir)
        run.mkdir(parents=True, exist_ok=True)
    else:
        tmp = tempfile.TemporaryDirectory(prefix="rollkit-servers-")
        run = Path(tmp.name)
    model_path = save_model(model, tokenizer, run / "model")
    dtype = dtype_name(rollout_dtype(cfg, device))
    kw = dict(
        tokenizer=tokenizer,
        timeout_s=r.server_timeout_s,
        request_timeout_s=r.server_request_timeout_s,
        weights_dir=run / "weights",
        dtype=dtype,
        # vLLM's CPU sampler cannot rewind a seeded generator over a split prefill (see
        # trainers.engines.requests.VLLMRequestEngine): CPU servers sample unseeded
        seeded=torch.cuda.is_available(),
    )
    addresses = server_addresses(r.servers)
    if addresses:
        eng = ServerRolloutEngine(addresses, model_path=model_path, **kw)
        eng.update_weights(model.named_parameters(), version=0)
    else:
        eng = ServerRolloutEngine.launch(
            model_path,
            num_servers=r.num_servers,
            run_dir=run,
            startup_timeout_s=r.server_startup_timeout_s,
            server_kw=dict(
                max_model_len=r.max_model_len,
                seed=cfg.seed,
                kv_cache_gib=r.server_kv_cache_gib,
                tensor_parallel_size=r.tensor_parallel_size,
            ),
            **kw,
        )
    eng.model_dir = tmp  # removed with the engine
    return eng


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
            target_modules=_lora_targets(cfg),
            seed=cfg.seed,
            value_head="score" if task == "value" else None,
        )
    kw = dict(
        lr=t.lr,
        weight_decay=t.weight_decay,
        grad_clip=t.grad_clip,
        scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lam),
        dtype=dtype,
        device=device,
    )
    kw["logprob_chunk_tokens"] = t.logprob_chunk_tokens
    kw["packing"] = bool(t.packing)
    kw["compile_backend"] = t.compile_backend if t.compile else None
    kw["fused_optimizer"] = bool(t.fused_optimizer)
    ckpt = bool(t.gradient_checkpointing)  # train.gradient_checkpointing, every engine
    if t.engine == "torch":
        master = bool(t.master_weights) and dtype in (torch.bfloat16, torch.float16)
        autocast = train_autocast(cfg, device)
        eng: Any = TorchTrainEngine(
            model, autocast=autocast, master_weights=master, gradient_checkpointing=ckpt, **kw
        )
        eng.lora_export = _lora_export(cfg)
        return eng
    if t.engine == "deepspeed":
        train_autocast(cfg, device)  # rejects an explicit autocast
        eng = DeepSpeedTrainEngine(model, zero_stage=t.zero_stage, gradient_checkpointing=ckpt, **kw)
        eng.lora_export = _lora_export(cfg)
        return eng
    if t.engine == "fsdp2":
        train_autocast(cfg, device)  # rejects an explicit autocast (FSDP2 has mixed_precision)
        return FSDP2TrainEngine(
            model, gradient_checkpointing=ckpt, cpu_offload=bool(t.fsdp2_cpu_offload), **kw
        )
    if t.engine == "megatron":
        return MegatronTrainEngine(
            model,
            tp=t.megatron_tp,
            pp=t.megatron_pp,
            autocast=train_autocast(cfg, device),
            gradient_checkpointing=bool(t.gradient_checkpointing),
            seed=cfg.seed,
            **{k: v for k, v in kw.items() if k not in ("packing", "compile_backend")},
        )
    raise ValueError(f"train.engine must be one of {TRAIN_ENGINES}, got {t.engine!r}")


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
