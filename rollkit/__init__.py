"""rollkit: reinforcement-learning building blocks for LLM post-training.

Pure functions over tensors and TensorDict batches: advantage estimators, policy losses,
KL / entropy terms, loss aggregation, reward shaping, dynamic-sampling filters, the
training-inference mismatch correction, token log-probs with the sampling replay.

Submodules are imported lazily, so ``import rollkit`` costs next to nothing; ``rollkit.ops``
etc. load (with torch) on first access::

    from rollkit.advantages import grpo_advantages
    from rollkit.losses import ppo_clip, aggregate
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_SUBMODULES = (
    "advantages",
    "buffer",
    "correction",
    "critics",
    "domains",
    "filters",
    "keys",
    "logprobs",
    "losses",
    "ops",
    "packing",
    "registry",
    "rewards",
    "scheduling",
    "td",
    "testing",
    "trajectory",
    "types",
    "validation",
)

__all__ = ["__version__", *_SUBMODULES]


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"rollkit.{name}")
    raise AttributeError(f"module 'rollkit' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
