"""Shared settings of the tiny-model RL tests (in-process and on Ray): RL on the tiny Qwen2
after its supervised warm-up on 1-digit addition, long enough to raise held-out accuracy."""

from trainers.models import TINY_RL_OVERRIDES as RL_OVERRIDES

__all__ = ["RL_OVERRIDES"]
