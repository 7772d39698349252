"""The sections of the offline and distillation pipelines: ``data`` and ``offline`` of the
offline trainer (SFT, preference losses, reward models), ``distill`` of the distillation trainer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rollkit.registry import AGGREGATIONS
from trainers.config.fields import setting

__all__ = [
    "DISTILL_MODES",
    "OFFLINE_LOSSES",
    "PREFERENCE_LOSSES",
    "REFERENCE_LOSSES",
    "TEACHER_PLACEMENTS",
    "DistillSettings",
    "OfflineAlgorithmConfig",
    "OfflineDataConfig",
]

#: ``offline.loss`` choices
OFFLINE_LOSSES = ("sft", "dpo", "ipo", "simpo", "orpo", "rm")
#: the losses that train the policy on pairs
PREFERENCE_LOSSES = ("dpo", "ipo", "simpo", "orpo")
#: the preference losses that need a reference policy
REFERENCE_LOSSES = ("dpo", "ipo")
#: ``distill.mode`` choices
DISTILL_MODES = ("loss", "rl")
#: ``distill.teacher_placement`` choices
TEACHER_PLACEMENTS = ("process", "ray")


@dataclass
class OfflineDataConfig:
    """The examples: ``train_file`` (JSONL / Parquet; prompt + completion for SFT, prompt +
    chosen + rejected for the preference losses), ``eval_file`` or the first ``eval_size``
    records of ``train_file`` held out."""

    train_file: str = ""
    eval_file: str = ""
    eval_size: int = setting(20, ge=0)
    digits: int = 1  # recipes: the generated addition pairs when train_file is empty
    chat_template: Literal["auto", "on", "off"] = (
        "auto"  # "auto": the tokenizer's chat template if it has one
    )


@dataclass
class OfflineAlgorithmConfig:
    """The loss: ``sft`` (token NLL, ``aggregation``), ``dpo`` / ``ipo`` / ``simpo`` / ``orpo``
    (mean over pairs), or ``rm`` (a reward model, Bradley-Terry loss, mean over pairs).
    ``batch_size`` examples or pairs per optimizer step."""

    loss: Literal["sft", "dpo", "ipo", "simpo", "orpo", "rm"] = "sft"
    batch_size: int = setting(16, ge=1)
    aggregation: str = setting("token-mean", registry=AGGREGATIONS)  # sft: a rollkit aggregation name
    beta: float = setting(0.1, gt=0)  # dpo / ipo / orpo; SimPO's paper uses 2.0-10
    label_smoothing: float = 0.0  # dpo (cDPO), simpo
    gamma: float = 0.5  # simpo's target margin
    nll_weight: float = 1.0  # orpo's SFT term


@dataclass
class DistillSettings:
    """The teacher and the distillation objective (:mod:`trainers.loops.distill`)."""

    teacher: str = "tiny"  # an HF checkpoint directory, "tiny" (tiny Qwen2), or "" (the embedded default)
    teacher_dtype: Literal["", "float32", "bfloat16", "float16"] = ""  # "": model.dtype
    teacher_tiny_seed: int = 0  # teacher="tiny": its initial weights' seed
    teacher_warmup_steps: int = setting(0, ge=0)  # supervised steps of the teacher on the train prompts
    teacher_warmup_lr: float = 3e-3
    teacher_placement: Literal["process", "ray"] = "process"  # or "ray": a Ray actor of its own
    teacher_chunk_tokens: int = setting(
        0, ge=0
    )  # > 0: memory-lean teacher log-probs, this many positions per chunk
    teacher_cpus: float = setting(1.0, gt=0)  # teacher_placement=ray: CPUs of the teacher's bundle
    teacher_gpus: float | None = setting(
        None, ge=0
    )  # teacher_placement=ray: its GPUs (None: 1 if the cluster has GPUs)
    mode: Literal["loss", "rl"] = (
        "loss"  # "loss": on_policy_distill; "rl": distill_token_rewards as advantages, PPO update
    )
    coef: float = 1.0  # the reverse-KL coefficient
    task_coef: float = 0.0  # mode="rl": + task_coef x the verifier's advantages (algorithm.advantage)
