"""The data sections: ``data`` (prompts: a file or a procedural task, or several domains),
its domain entries (:class:`DomainSpec`), and what a vision-language policy cannot combine with."""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from trainers.config.algorithm import critic_needed
from trainers.config.capabilities import ROLLOUT_ENGINES, TRAIN_ENGINES
from trainers.config.engines import TINY_VLM_NAMES
from trainers.config.fields import setting
from trainers.models import is_hub_id
from trainers.vision import checkpoint_config, is_vision_checkpoint

__all__ = ["DOMAIN_KEYS", "TASK_NAMES", "DataConfig", "DomainSpec", "domain_specs"]


@dataclass
class DataConfig:
    """Prompts: a JSONL / Parquet file (verl-style fields) or a procedural task."""

    # procedural task when train_file is empty: "addition", or "shapes" (images: trainers.domains.shapes_task)
    task: str = "addition"
    digits: int = 2  # operand digits of the addition task (1 or 2)
    train_file: str = ""  # JSONL, Parquet, a datasets directory (save_to_disk) or a hub dataset name
    eval_file: str = ""
    train_split: str = "train"  # the split of a datasets directory / hub dataset
    eval_split: str = "test"
    eval_size: int = setting(100, ge=0)  # held-out prompts (procedural task)
    chat_template: Literal["auto", "on", "off"] = (
        "auto"  # "auto": use the tokenizer's chat template if it has one; "on"; "off"
    )
    # several domains in one run (docs/domains.md; ROLL's domain_interleave_probs): a mapping
    # name -> {weight, task | train_file, verifier, ...} (keys: DOMAIN_KEYS). Each step draws an
    # exact integer quota of prompts per domain from the weights; each domain's verifier scores
    # its prompts. {}: one domain (task / train_file and reward.verifier above)
    domains: dict = field(default_factory=dict)


#: the keys of one ``data.domains`` entry (:class:`DomainSpec`'s fields but ``name``)
DOMAIN_KEYS = (
    "weight",
    "task",
    "task_options",
    "train_file",
    "train_split",
    "eval_file",
    "eval_split",
    "eval_size",
    "verifier",
    "verifier_options",
)


#: procedural tasks a domain may name (``trainers.domains.TASKS``)
TASK_NAMES = ("addition", "functions", "formats", "choice", "shapes")


@dataclass(frozen=True)
class DomainSpec:
    """One checked ``data.domains`` entry. Prompts come from ``train_file`` (and ``eval_file``,
    else the first ``eval_size`` records are held out), from the procedural ``task`` (with
    ``task_options``), or, with neither, from the records of ``data.train_file`` whose
    ``domain`` field names this domain. ``verifier`` ("" = ``reward.verifier``) with
    ``verifier_options`` scores them; ``weight`` sets the domain's share of each step."""

    name: str
    weight: float = 1.0
    task: str = ""
    task_options: dict = field(default_factory=dict)
    train_file: str = ""
    train_split: str = "train"
    eval_file: str = ""
    eval_split: str = "test"
    eval_size: int | None = None  # held out from train_file / the task (None: data.eval_size, a task's own)
    verifier: str = ""
    verifier_options: dict = field(default_factory=dict)


def _domain_field(where: str, key: str, value: Any, default: Any) -> Any:
    """``value`` checked against the type of ``default`` (a one-line error naming ``where.key``)."""
    if isinstance(default, dict):
        if not isinstance(value, dict):
            raise ValueError(f"{where}.{key}: expected a mapping, got {value!r}")
        return dict(value)
    if isinstance(default, float):
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not math.isfinite(value)
            or value <= 0
        ):
            raise ValueError(f"{where}.{key}: expected a number > 0, got {value!r}")
        return float(value)
    if isinstance(default, int) or key == "eval_size":
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{where}.{key}: expected an int >= 0, got {value!r}")
        return value
    if not isinstance(value, str):
        raise ValueError(f"{where}.{key}: expected a string, got {value!r}")
    return value


def domain_specs(cfg: Any) -> list[DomainSpec]:
    """The checked ``data.domains`` entries of ``cfg``, in the order written; ``[]`` for a run with
    one domain. A bad entry raises ``ValueError`` naming ``data.domains.<name>.<key>``."""
    raw = cfg.data.domains
    if not isinstance(raw, dict):
        raise ValueError(f"data.domains: expected a mapping name -> settings, got {raw!r}")
    defaults = DomainSpec("_")
    out = []
    for name, entry in raw.items():
        where = f"data.domains.{name}"
        if not isinstance(name, str) or not name or not all(ch.isalnum() or ch in "_-." for ch in name):
            raise ValueError(f"data.domains: a domain name must be letters, digits, _ - or ., got {name!r}")
        if entry is None:
            entry = {}
        if not isinstance(entry, dict):
            raise ValueError(f"{where}: expected a mapping of {', '.join(DOMAIN_KEYS)}, got {entry!r}")
        unknown = sorted(set(entry) - set(DOMAIN_KEYS))
        if unknown:
            raise ValueError(f"{where}: unknown keys {unknown}; known: {', '.join(DOMAIN_KEYS)}")
        values = {k: _domain_field(where, k, v, getattr(defaults, k)) for k, v in entry.items()}
        spec = DomainSpec(name, **values)
        if spec.task and spec.train_file:
            raise ValueError(f"{where}: give task or train_file, not both")
        if spec.task and spec.task not in TASK_NAMES:
            raise ValueError(f"{where}.task: unknown task {spec.task!r}; known: {', '.join(TASK_NAMES)}")
        if not spec.task and not spec.train_file and not cfg.data.train_file:
            raise ValueError(
                f"{where}: no prompts: set its task or train_file, or data.train_file with records "
                f"whose 'domain' field is {name!r}"
            )
        if spec.eval_file and not spec.train_file:
            raise ValueError(f"{where}.eval_file: set {where}.train_file too")
        for key in ("train_file", "eval_file"):
            f = getattr(spec, key)
            if f and not Path(f).exists() and not is_hub_id(f):
                raise ValueError(f"{where}.{key}: no such file, directory or hub dataset name: {f}")
        out.append(spec)
    return out


def check_data(c: Any) -> None:
    """``data``: its files exist, a procedural task is known; with ``data.domains``, what a run
    with several domains cannot combine with."""
    d = c.data
    if domain_specs(c):
        if d.eval_file:
            raise ValueError("data.eval_file: with data.domains give each domain's eval_file instead")
        if c.tail_batching.enabled:
            raise ValueError(
                "tail_batching.enabled: its prompt queue has no domain quotas yet; set data.domains={} "
                "or tail_batching.enabled=false"
            )
        return
    for name, f in (("data.train_file", d.train_file), ("data.eval_file", d.eval_file)):
        if f and not Path(f).exists() and not is_hub_id(f):
            raise ValueError(f"{name}: no such file, directory or hub dataset name: {f}")
    if d.eval_file and not d.train_file:
        raise ValueError(
            "data.eval_file: set data.train_file too (the procedural task has its own held-out split)"
        )
    if not d.train_file:
        for name, value, known in (
            ("data.task", d.task, ("addition", "shapes")),
            ("data.digits", d.digits, (1, 2, 3)),
        ):
            if value not in known:
                raise ValueError(f"{name} must be one of {', '.join(map(str, known))}, got {value!r}")


def _qwen_vl(path: str) -> bool:
    """Whether ``model.path`` is a Qwen2-VL-family model (``tiny_vl`` or its config's model_type)."""
    return path == "tiny_vl" or str(checkpoint_config(path).get("model_type", "")).startswith("qwen2")


def check_vision(c: Any) -> None:
    """What a vision-language policy (``model.path=tiny_vl`` or a checkpoint with a
    ``vision_config``) cannot do yet, by name."""
    if not (c.model.path in TINY_VLM_NAMES or (c.model.path and is_vision_checkpoint(c.model.path))):
        return
    rollout, train = ROLLOUT_ENGINES[c.rollout.engine], TRAIN_ENGINES[c.train.engine]
    refused = [
        (not rollout.images, f"rollout.engine={rollout.name}",
         f"{rollout.notes.get('images', 'it takes no images')}; use rollout.engine={ROLLOUT_ENGINES.having(lambda s: s.images)}"),
        (c.train.packing, "train.packing", "packed micro-batches do not carry image inputs yet"),
        (critic_needed(c), f"algorithm.advantage={c.algorithm.advantage}",
         "the critic's value forward does not take image inputs yet"),
        (c.train.logprob_chunk_tokens > 0 and not train.lean_head_images, "train.logprob_chunk_tokens",
         train.notes.get("lean_head_images", f"train.engine={train.name}'s lean head takes no image inputs")),
        (rollout.qwen2_vl_needs_torchvision and _qwen_vl(c.model.path) and importlib.util.find_spec("torchvision") is None,
         f"rollout.engine={rollout.name}", f"its Qwen2-VL model needs torchvision, which is not installed; use "
         f"rollout.engine={ROLLOUT_ENGINES.having(lambda s: s.images and not s.qwen2_vl_needs_torchvision)}, or an Idefics3 / SmolVLM model (model.path=tiny_idefics3)"),
    ]  # fmt: skip
    for bad, field_, why in refused:
        if bad:
            raise ValueError(f"{field_}: not with a vision-language model ({c.model.path}): {why}")
