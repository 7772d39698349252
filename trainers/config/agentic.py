"""The agentic trainer's own sections: ``env`` (the environment and its episode limits), its
``rollout`` (sampling and scheduling of episodes), ``warmup`` and ``eval``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from trainers.config.capabilities import ROLLOUT_ENGINES
from trainers.config.engines import RolloutDtype, RolloutEngineConfig
from trainers.config.fields import setting

__all__ = ["AGENTIC_MODES", "AgenticEvalConfig", "AgenticRolloutConfig", "EnvConfig", "WarmupConfig"]

AGENTIC_MODES = ("lockstep", "async")


@dataclass
class EnvConfig:
    """The environment: a registered name (``frozenlake``, ``sokoban``, ``calculator``,
    ``gem:<id>``) or ``"module:attr"``, its keyword arguments, and the episode limits."""

    name: str = "frozenlake"
    kwargs: dict = field(default_factory=lambda: {"size": 3, "hole_prob": 0.0, "max_turns": 6})
    max_turns: int = setting(6, ge=1)
    max_context: int = setting(1024, ge=1)  # tokens per episode, prompt included
    chat_template: Literal["auto", "on", "off"] = "auto"  # "auto": if the tokenizer has one
    system_prompt: str = ""
    deadline_s: float = 30.0  # per reset / step; past it the env counts as hung and is replaced
    start_method: str = "forkserver"


@dataclass
class AgenticRolloutConfig(RolloutEngineConfig):
    """Sampling and scheduling. A step trains ``groups_per_step x group_size`` trajectories;
    ``async`` launches ``num_env_groups`` task groups (``0``: ``groups_per_step``) of
    ``group_size + redundancy`` episodes and keeps the first finishers."""

    # a name of trainers.config.ROLLOUT_ENGINES: "hf" (transformers), "vllm" (in process) or
    # "server" (vllm serve over HTTP)
    engine: str = setting("hf", registry=ROLLOUT_ENGINES)
    mode: Literal["lockstep", "async"] = "async"
    # "trajectory": an episode is one sequence (its horizon ends at env.max_context); "turn": each
    # turn is a sample of its own, its context the window of the last env.max_context - max_tokens
    # tokens (the prompt + the most recent whole action/observation pairs): long horizons
    sample_per: Literal["trajectory", "turn"] = "trajectory"
    groups_per_step: int = setting(4, ge=1)
    group_size: int = setting(4, ge=1)
    num_env_groups: int = setting(0, ge=0)
    redundancy: int = setting(0, ge=0)
    temperature: float = setting(1.0, gt=0)  # training needs sampling
    top_p: float = setting(1.0, gt=0, le=1)
    top_k: int = setting(-1, ge=-1)  # -1 or 0: off
    max_tokens: int = setting(16, ge=1)  # per turn
    max_batch_size: int | None = setting(None, ge=1)
    # rollout weights' dtype: "" = model.dtype; "auto" = bfloat16 where its matmuls are fast
    # (CUDA with bf16, CPUs with AMX), else model.dtype; or "float32" / "bfloat16" / "float16"
    dtype: RolloutDtype = ""
    max_staleness: int = setting(
        0, ge=0
    )  # 0: synchronous; >= 1: overlap collection with training, per-turn bound
    max_attempts: int = setting(
        0, ge=0
    )  # episodes launched per group before it is abandoned (0: 3 x launched)
    # an injected training-inference mismatch for experiments: > 0: the rollout engine samples
    # at this temperature while the trainer's log-probs use rollout.temperature. 0: off
    engine_temperature: float = setting(0.0, ge=0)


@dataclass
class WarmupConfig:
    """Optional supervised warm-up on well-formed random actions (teaches a tiny random model
    the action format, so that RL has successes to learn from). ``steps = 0``: off."""

    steps: int = 0
    batch_size: int = 16
    lr: float = 3e-3
    bare: bool = False  # target the action without \\boxed{} (the built-in games accept a bare word)


@dataclass
class AgenticEvalConfig:
    """Greedy success rate on ``episodes`` fixed tasks (seeds ``seed .. seed + episodes - 1``,
    disjoint from the training seeds), before training, every ``every`` steps and after."""

    episodes: int = setting(32, ge=1)
    every: int = 0
    before: bool = True
    max_tokens: int = 16
    seed: int = 1_000_000_000
