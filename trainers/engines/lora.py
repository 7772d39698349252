"""LoRA policies with peft: wrap a causal LM, export merged or adapter-only weights, save.

The training engines train a peft model unchanged (only the adapters require gradients, so
only they reach the optimizer); what changes is what the rollout engine receives:

    policy = apply_lora(model, rank=16)                      # a peft PeftModelForCausalLM
    train = TorchTrainEngine(policy, lr=1e-4)                # or DeepSpeedTrainEngine (ZeRO 0-2)
    rollout = HFRolloutEngine(copy.deepcopy(model_without_lora), tokenizer)
    ...
    rollout.update_weights(merged_weights(train.model), version)   # W + B A * scale, base names
    vllm_rollout.update_weights(adapter_weights(train.model), version)   # vLLM's LoRA: the adapter
    save_lora(train.model, tokenizer, "out/lora", merged=False)   # adapter + out/lora/base

:func:`merged_weights` is what an engine without LoRA support loads (a plain model's
``state_dict`` names); :func:`adapter_weights` is the adapter alone, named as peft saves it,
which :class:`~trainers.engines.vllm_rollout.VLLMRolloutEngine` built with
``lora=adapter_config(...)`` serves through vLLM's LoRA support (:func:`write_adapter`).
See docs/engines.md.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from trainers.deps import require
from trainers.models import save_model
from trainers.vision import VISION_MODULES, is_vision_model

__all__ = [
    "BASE_SUBDIR",
    "LORA_TARGETS",
    "adapter_config",
    "adapter_weights",
    "apply_lora",
    "is_lora",
    "LORA_EXPORTS",
    "lora_export_weights",
    "merged_weights",
    "save_lora",
    "write_adapter",
]

#: where :func:`save_lora` writes the base model beside an unmerged adapter
BASE_SUBDIR = "base"

#: the linear layers of a Llama / Qwen2 / Mistral decoder block (attention and MLP)
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _check_lora_args(model: Any, rank: Any, alpha: Any, dropout: Any, target_modules: Any) -> tuple[str, ...]:
    if not isinstance(model, torch.nn.Module):
        raise ValueError(
            f"model must be a torch.nn.Module (a transformers causal LM), got {type(model).__name__}"
        )
    if hasattr(model, "peft_config"):
        raise ValueError("model already has peft adapters: pass the plain transformers model")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
        raise ValueError(f"rank must be an int > 0, got {rank!r}")
    if alpha is not None and (
        isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha > 0
    ):
        raise ValueError(f"alpha must be a number > 0 or None, got {alpha!r}")
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout must be a number in [0, 1), got {dropout!r}")
    if isinstance(target_modules, str) or not isinstance(target_modules, Sequence) or not target_modules:
        raise ValueError(
            f"target_modules must be a non-empty sequence of module names, got {target_modules!r}"
        )
    targets = tuple(target_modules)
    if not all(isinstance(t, str) and t for t in targets):
        raise ValueError(f"target_modules must hold non-empty strings, got {targets!r}")
    linear = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    missing = [t for t in targets if t not in linear]
    if missing:
        raise ValueError(
            f"target_modules: {missing} name no nn.Linear of {type(model).__name__} (it has {sorted(linear)})"
        )
    return targets


def is_lora(model: Any) -> bool:
    """Whether ``model`` is a peft LoRA model (what :func:`apply_lora` returns)."""
    return hasattr(model, "peft_config")


def apply_lora(
    model: Any,
    *,
    rank: int,
    alpha: float | None = None,
    dropout: float = 0.0,
    target_modules: Sequence[str] = LORA_TARGETS,
    seed: int = 0,
    value_head: str | None = None,
) -> Any:
    """Wrap a transformers causal LM in peft LoRA adapters; only the adapters are trainable.

    ``value_head``: ``model`` is a critic (a token-classification model) whose head module of
    that name (``"score"``) trains in full beside the adapters (peft ``modules_to_save``).

    Each linear layer named in ``target_modules`` (the last component of its module name)
    computes ``W x + (alpha / rank) * B A x`` with ``A: [rank, in]`` (Kaiming-uniform, drawn
    from ``seed`` without touching the global RNG) and ``B: [out, rank]`` (zeros), so the
    wrapped model starts equal to ``model``. ``alpha=None`` means ``alpha = rank`` (scale 1).
    ``dropout > 0`` drops the adapter's input during training, which makes two log-prob
    passes over the same batch differ (keep 0 for exact PPO ratios).

    ``model`` is modified in place (its linear layers gain adapters) and returned wrapped as
    a ``peft.PeftModelForCausalLM``, which the training engines take as they take ``model``.

    >>> from trainers.models import char_tokenizer, tiny_qwen2
    >>> policy = apply_lora(tiny_qwen2(char_tokenizer()), rank=4)
    >>> sorted({n.split(".")[-3] for n, p in policy.named_parameters() if p.requires_grad})
    ['lora_A', 'lora_B']
    """
    targets = _check_lora_args(model, rank, alpha, dropout, target_modules)
    peft = require("peft")
    config = peft.LoraConfig(
        r=rank,
        lora_alpha=float(rank if alpha is None else alpha),
        lora_dropout=float(dropout),
        target_modules=list(targets),
        bias="none",
        task_type="CAUSAL_LM" if value_head is None else "TOKEN_CLS",
        modules_to_save=None if value_head is None else [value_head],
        # a vision-language model: the language model's projections only (Idefics3's tower has
        # q_proj / k_proj / v_proj too)
        exclude_modules=rf".*\b({'|'.join(VISION_MODULES)})\..*" if is_vision_model(model) else None,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return peft.get_peft_model(model, config)


def _lora_layers(peft_model: Any) -> tuple[Any, dict[str, Any]]:
    """``(base model, {module name: peft LoraLayer})``, after checking the adapters are plain LoRA."""
    peft = require("peft")
    if not isinstance(peft_model, peft.PeftModel):
        raise ValueError(
            f"peft_model must be a peft.PeftModel (see apply_lora), got {type(peft_model).__name__}"
        )
    for name, cfg in peft_model.peft_config.items():
        if not isinstance(cfg, peft.LoraConfig):
            raise ValueError(f"peft_model: adapter {name!r} is {type(cfg).__name__}, not LoRA")
        if cfg.use_dora or cfg.lora_bias or cfg.modules_to_save:
            raise ValueError(
                f"peft_model: adapter {name!r} uses DoRA, lora_bias or modules_to_save, "
                "which merged_weights does not merge"
            )
    base = peft_model.get_base_model()
    layers = {n: m for n, m in base.named_modules() if isinstance(m, peft.tuners.lora.LoraLayer)}
    return base, layers


def _delta(layer: Any) -> Tensor | None:
    """``sum (alpha / r) * B A`` over the layer's active adapters not merged into its weight."""
    if layer.disable_adapters:
        if layer.merged:
            raise ValueError("peft_model: adapters are disabled but merged into the weights: unmerge first")
        return None
    delta = None
    for a in layer.active_adapters:
        if a in layer.lora_A and a not in layer.merged_adapters:
            d = layer.get_delta_weight(a)
            delta = d if delta is None else delta + d
    return delta


def _base_weights(peft_model: Any, *, merge: bool, dtype: torch.dtype | None) -> Iterator[tuple[str, Tensor]]:
    base, layers = _lora_layers(peft_model)
    for name, p in base.named_parameters():  # tied weights once, as the first name
        if any(part.startswith("lora_") for part in name.split(".")):
            continue
        if hasattr(p, "ds_status"):
            raise ValueError(f"peft_model: {name} is a ZeRO-3 partitioned parameter; use ZeRO 0-2 with LoRA")
        owner, _, leaf = name.rpartition(".")
        t = p.detach()
        if owner.endswith(".base_layer") and owner[: -len(".base_layer")] in layers:
            owner = owner[: -len(".base_layer")]
            if merge and leaf == "weight":
                with torch.no_grad():
                    delta = _delta(layers[owner])
                if delta is not None:
                    t = t + delta.to(t.dtype)
            name = f"{owner}.{leaf}"
        yield name, (t if dtype is None else t.to(dtype))


def merged_weights(peft_model: Any, dtype: torch.dtype | None = None) -> Iterator[tuple[str, Tensor]]:
    """``(name, tensor)`` of the full model with the active LoRA adapters merged, for a rollout
    engine without LoRA support (``update_weights``) or a plain ``save_pretrained``.

    Each adapted weight is ``W + (alpha / r) * B A`` (peft's ``get_delta_weight``), computed
    per layer into a new tensor: the training model is not modified. Names are the base
    model's ``state_dict`` keys (``model.layers.0.self_attn.q_proj.weight``: no
    ``base_model.model.`` prefix, no ``base_layer``, no ``lora_`` keys), one per parameter,
    a tied ``lm_head.weight`` once as the embedding (as ``TorchTrainEngine.export_weights``).
    Other tensors are detached views of the live parameters unless ``dtype`` asks for a
    cast: consume them before the next optimizer step. ZeRO-3 partitioned models are refused.

    >>> from trainers.models import char_tokenizer, tiny_qwen2
    >>> policy = apply_lora(tiny_qwen2(char_tokenizer()), rank=4)
    >>> merged = dict(merged_weights(policy))  # rollout.update_weights(merged.items(), version=1)
    >>> set(tiny_qwen2(char_tokenizer()).state_dict()) - set(merged)  # the tied head: the embedding
    {'lm_head.weight'}
    """
    return _base_weights(peft_model, merge=True, dtype=dtype)


def adapter_weights(peft_model: Any, dtype: torch.dtype | None = None) -> Iterator[tuple[str, Tensor]]:
    """``(name, tensor)`` of the LoRA adapter alone, named as peft writes
    ``adapter_model.safetensors`` (``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``,
    adapter name dropped) for engines that load adapters (vLLM's ``LoRARequest``). Detached
    views unless ``dtype`` casts. Only the default adapter's (``peft_model.active_adapter``)."""
    _lora_layers(peft_model)
    peft = require("peft")
    state = peft.get_peft_model_state_dict(peft_model, adapter_name=peft_model.active_adapter)
    for name, t in state.items():
        t = t.detach()
        yield name, (t if dtype is None else t.to(dtype))


#: what a training engine's ``export_weights`` gives for a LoRA policy (``engine.lora_export``)
LORA_EXPORTS = ("merged", "adapter")


def lora_export_weights(
    peft_model: Any, lora_export: str, dtype: torch.dtype | None = None
) -> Iterator[tuple[str, Tensor]]:
    """:func:`merged_weights` (``lora_export="merged"``, for any rollout engine) or
    :func:`adapter_weights` (``"adapter"``, for a vLLM engine built with ``lora=``)."""
    if lora_export == "merged":
        return merged_weights(peft_model, dtype)
    if lora_export == "adapter":
        return adapter_weights(peft_model, dtype)
    raise ValueError(f"lora_export: expected one of {LORA_EXPORTS}, got {lora_export!r}")


@contextlib.contextmanager
def _base_path(peft_model: Any, path: Path) -> Iterator[None]:
    """Point every adapter config's ``base_model_name_or_path`` at ``path`` while saving."""
    configs = peft_model.peft_config.values()
    old = [c.base_model_name_or_path for c in configs]
    try:
        for c in configs:
            c.base_model_name_or_path = str(path)
        yield
    finally:
        for c, o in zip(configs, old, strict=True):
            c.base_model_name_or_path = o


def save_lora(peft_model: Any, tokenizer: Any, path: str | Path, *, merged: bool) -> Path:
    """Write a LoRA policy to the directory ``path``; returns it.

    * ``merged=True``: a plain transformers model with the adapters merged
      (:func:`merged_weights`) and the tokenizer: ``AutoModelForCausalLM.from_pretrained(path)``
      and vLLM load it as any checkpoint.
    * ``merged=False``: the adapter, with its base model in ``path / "base"``: ``path`` holds
      peft's ``adapter_config.json`` + ``adapter_model.safetensors`` and the tokenizer, with
      ``base_model_name_or_path`` set to the absolute path of ``path / "base"``, which holds
      the base weights (unmerged) and the tokenizer as a plain checkpoint.
      ``peft.AutoPeftModelForCausalLM.from_pretrained(path)`` gives the peft model back and
      ``AutoModelForCausalLM.from_pretrained(path)`` (with peft installed) the base with the
      adapter attached; vLLM serves ``path / "base"`` with ``enable_lora=True`` and
      ``LoRARequest(name, id, lora_path=str(path))``. (The base cannot share the adapter's
      directory: vLLM loads every ``*.safetensors`` there as model weights.) Moving the
      directory breaks only the absolute ``base_model_name_or_path``.

    The training model is not modified (the saved config is restored after writing).
    """
    if not isinstance(merged, bool):
        raise ValueError(f"merged must be True or False, got {merged!r}")
    base, _ = _lora_layers(peft_model)
    path = Path(path).resolve()
    state = {k: v.clone() for k, v in _base_weights(peft_model, merge=merged, dtype=None)}
    with torch.device("meta"):
        plain = type(base)(base.config)  # the architecture without adapters, no memory
    plain.generation_config = base.generation_config
    if merged:
        return save_model(plain, tokenizer, path, state_dict=state)
    save_model(plain, tokenizer, path / BASE_SUBDIR, state_dict=state)
    with _base_path(peft_model, path / BASE_SUBDIR):
        peft_model.save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return path


#: ``base_model.model.<module>.lora_A.weight`` / ``lora_B``: the names of :func:`adapter_weights`
ADAPTER_NAME = re.compile(r"base_model\.model\.(.+)\.lora_([AB])\.weight")


def adapter_config(
    rank: int, alpha: float | None = None, target_modules: Sequence[str] = LORA_TARGETS
) -> dict:
    """The ``adapter_config.json`` of a plain LoRA adapter (peft's ``LoraConfig`` fields that
    vLLM and peft read): rank ``r``, ``lora_alpha`` (``None``: ``rank``, scale 1), the adapted
    module names; no bias, DoRA, rsLoRA or extra saved modules (what :func:`apply_lora` makes).

    >>> adapter_config(16, 32.0, ("q_proj", "v_proj"))["target_modules"]
    ['q_proj', 'v_proj']
    """
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"rank must be an int >= 1, got {rank!r}")
    if alpha is not None and not (isinstance(alpha, (int, float)) and alpha > 0):
        raise ValueError(f"alpha must be > 0 or None, got {alpha!r}")
    targets = sorted({str(t) for t in target_modules})
    if not targets:
        raise ValueError("target_modules: name at least one module")
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": float(rank if alpha is None else alpha),
        "target_modules": targets,
        "lora_dropout": 0.0,
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
    }


def write_adapter(named_tensors: Iterable[tuple[str, Tensor]], config: dict, path: str | Path) -> Path:
    """Write a LoRA adapter directory (``adapter_model.safetensors`` + ``adapter_config.json``,
    peft's layout) from :func:`adapter_weights`-named tensors and an :func:`adapter_config`;
    returns ``path``. Every name must be an adapter name (``...lora_A.weight`` /
    ``...lora_B.weight``, both of each module), every ``lora_A`` ``[r, in]`` and ``lora_B``
    ``[out, r]`` with the config's ``r`` (``KeyError`` / ``ValueError`` naming the tensor)."""
    from safetensors.torch import save_file

    r = int(config["r"])
    tensors: dict[str, Tensor] = {}
    halves: dict[str, set[str]] = {}
    for name, t in named_tensors:
        m = ADAPTER_NAME.fullmatch(name)
        if m is None:
            raise KeyError(f"write_adapter: {name!r} is not a LoRA adapter tensor (...lora_A/lora_B.weight)")
        if t.dim() != 2 or (t.shape[0] if m.group(2) == "A" else t.shape[1]) != r:
            raise ValueError(f"write_adapter: {name!r} has shape {list(t.shape)}, expected rank {r}")
        tensors[name] = t.detach().to("cpu").contiguous()
        halves.setdefault(m.group(1), set()).add(m.group(2))
    unpaired = sorted(k for k, v in halves.items() if v != {"A", "B"})
    if not tensors or unpaired:
        raise KeyError(
            f"write_adapter: every module needs lora_A and lora_B; unpaired: {unpaired[:3] or 'no tensors'}"
        )
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps(config, indent=1))
    return path
