"""Shared settings of the tiny-model RL tests (in-process and on Ray): RL on the tiny Qwen2
after its supervised warm-up on 1-digit addition, long enough to raise held-out accuracy."""

RL_OVERRIDES = [
    "train.lr=5e-4",
    "train.steps=25",
    "rollout.prompts_per_step=8",
    "rollout.n=8",
    "rollout.temperature=1.0",
    "rollout.max_tokens=4",
    "eval.max_tokens=4",
    "train.micro_batch_size=64",
    "eval.before=true",
]
