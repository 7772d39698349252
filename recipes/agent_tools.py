r"""A model learns to use a Python tool: arithmetic word problems on CPU, greedy success before and after.

The environment is ``python-tool`` (:class:`trainers.envs.python_tool_env.PythonToolEnv`): a
word problem whose answer is the product of two 3-4 digit numbers ("A warehouse has 347 crates
and each crate holds 1289 bolts. How many bolts ..."), which a 135M model cannot compute in its
head. The model may write a ```` ```python ```` block; rollkit's sandbox runs it (no network, no
files, time and memory limits) and the printed output comes back as ``<result>...</result>``;
the answer goes in ``\boxed{}`` (reward 1 if right).

With no arguments: SmolLM2-135M-Instruct (the embedded default), a short supervised warm-up on
random well-formed actions (``sample_random_action``: a Python call that combines the problem's
two numbers with a *random* operator ``+ - *``, a boxed guess, or a boxed copy of the last
result: it teaches the format, not which operator the problem needs nor that the tool beats a
guess), then RL (StarPO advantages + PPO, the agentic trainer) on CPU. It prints the greedy
success rate of the untrained model, after the warm-up and after RL.

    python recipes/agent_tools.py
    python recipes/agent_tools.py seed=1 train.steps=12
    python recipes/agent_tools.py --help        # every field, its type and default

docs/tools.md has the measured runs.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch

from trainers.config import AgenticConfig, load_config, validate_agentic
from trainers.loops import AgenticTrainer


def recipe_defaults() -> AgenticConfig:
    cfg = AgenticConfig()
    cfg.env.name = "python-tool"
    cfg.env.kwargs = {"digits": [3, 4], "ops": ["mul"], "max_turns": 3, "tool_timeout_s": 5.0}
    cfg.env.max_turns = 3
    cfg.env.max_context = 512
    cfg.rollout.groups_per_step = 4
    cfg.rollout.group_size = 4
    cfg.rollout.max_tokens = 32  # a ```python block with two 4-digit numbers, or a boxed 8-digit answer
    cfg.rollout.temperature = 1.0
    cfg.train.micro_batch_size = 8
    cfg.eval.episodes = 32
    cfg.eval.max_tokens = 32
    cfg.logging.dir = "runs/agent_tools"
    cfg.rollout.dtype = "auto"
    cfg.train.autocast = "auto"
    cfg.warmup.steps = 16
    cfg.warmup.batch_size = 8
    cfg.warmup.lr = 3e-5
    cfg.train.lr = 1e-5
    cfg.train.steps = 6
    cfg.eval.every = 0
    return cfg


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    try:
        cfg = load_config(argv, base=recipe_defaults())
        validate_agentic(cfg)
    except ValueError as e:  # a bad key or value: say which, no traceback
        raise SystemExit(f"error: {e}") from None
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    t0 = time.perf_counter()
    try:
        trainer = AgenticTrainer(cfg)
    except (ValueError, ImportError) as e:
        if os.environ.get("ROLLKIT_DEBUG") == "1":
            raise
        raise SystemExit(f"error: {e}") from None
    with trainer:
        print(
            f"[agent_tools] model {cfg.model.path or 'SmolLM2-135M-Instruct (embedded default)'}, env {cfg.env.name} "
            f"{cfg.env.kwargs}, {cfg.rollout.groups_per_step} groups x {cfg.rollout.group_size} episodes, "
            f"{cfg.train.steps} steps, seed {cfg.seed}; loaded in {time.perf_counter() - t0:.1f}s",
            flush=True,
        )
        untrained = None
        if cfg.eval.before and cfg.warmup.steps and not cfg.checkpoint.resume:
            trainer.prestart()
            untrained = trainer.evaluate()["eval/success_rate"]
            print(f"[eval] untrained greedy success rate {untrained:.3f}", flush=True)
        out = trainer.fit()
    wall = time.perf_counter() - t0
    out["success_untrained"] = untrained
    if untrained is not None:
        print(f"greedy success rate untrained:    {untrained:.3f}")
    before = out["success_before"]
    print(f"greedy success rate before RL:    {before:.3f}" if before is not None else "before RL: n/a")
    print(
        f"greedy success rate after RL:     {out['success_after']:.3f}  ({cfg.eval.episodes} held-out problems)"
    )
    print(f"{out['steps']} steps, {out['seconds_per_step']:.1f} s/step, total {wall:.0f} s")
    print(f"metrics: {out['metrics_file']}")
    return out


if __name__ == "__main__":
    main()
