"""Multi-domain RLVR (ROLL's first feature): three domains in one run, each with its own verifier.

With no arguments: SmolLM2-135M-Instruct (the embedded default; no network) on three built-in
domains of ``trainers.domains.TASKS``, equal weights, each step 2 prompts of each x 8 samples:

* ``arithmetic``: ``a+b`` with two-digit operands, scored by Math-Verify;
* ``code``: "Write a Python function f(x) that returns 3 * x + 1.", the program run against
  five asserts in the sandbox (the ``code`` verifier);
* ``format``: a short question with an IFEval constraint (no commas, quoted, an end phrase, a
  keyword, fewer than N words), the ``ifeval`` verifier.

Greedy held-out accuracy per domain before and after, per-domain metrics every step
(``domain/<name>/*`` in metrics.jsonl, TensorBoard and the plot), and the model. Measured
figures: docs/domains.md ("The recipe").

    python recipes/rlvr_multidomain.py
    python recipes/rlvr_multidomain.py seed=1 train.steps=40
    python recipes/rlvr_multidomain.py eval.n=8          # + pass@1 / pass@8 / mean@k per domain
    python recipes/rlvr_multidomain.py --config my_domains.yaml   # your own data.domains
    python recipes/rlvr_multidomain.py --help

A domain in YAML (docs/domains.md lists every key)::

    data:
      domains:
        math: {train_file: math.parquet, verifier: math_verify, weight: 2}
        code: {train_file: code.jsonl, verifier: code, verifier_options: {timeout_s: 5}}
        chat: {task: formats, verifier: ifeval, weight: 0.5}
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from recipes import rlvr_qwen
from trainers.config import Config

DOMAINS = {
    "arithmetic": {"task": "addition", "verifier": "math_verify", "eval_size": 40},
    "code": {"task": "functions", "verifier": "code", "eval_size": 30},
    "format": {"task": "formats", "verifier": "ifeval", "eval_size": 39},
}


def recipe_defaults() -> Config:
    """:func:`recipes.rlvr_qwen.recipe_defaults` with the three domains, 6 prompts x 8 samples,
    32 new tokens, 24 steps at lr 2e-5, worker processes for the rewards (the sandbox runs while the model generates)."""
    cfg = rlvr_qwen.recipe_defaults()
    cfg.data.domains = {k: dict(v) for k, v in DOMAINS.items()}
    cfg.rollout.prompts_per_step = 6
    cfg.rollout.n = 8
    cfg.rollout.max_tokens = 32
    cfg.eval.max_tokens = 32
    cfg.train.steps = 24
    cfg.train.lr = 2e-5
    cfg.train.micro_batch_size = 16
    cfg.reward.backend = "process"
    cfg.reward.num_workers = 2
    cfg.reward.timeout_s = 30.0
    cfg.reward.code_timeout_s = 5.0
    cfg.logging.dir = "runs/rlvr_multidomain"
    return cfg


def main(argv: list[str] | None = None) -> dict:
    out = rlvr_qwen.main(argv, base=recipe_defaults())
    before, after = out.get("eval_before") or {}, out.get("eval_after") or {}
    names = sorted({k.split("/")[2] for k in after if k.startswith("eval/domain/")})
    print("held-out accuracy per domain (greedy):")
    for d in names:
        b = before.get(f"eval/domain/{d}/accuracy")
        a = after.get(f"eval/domain/{d}/accuracy")
        print(f"  {d:12s} {'n/a' if b is None else f'{b:.3f}'} -> {a:.3f}")
    for k in sorted(after):
        if "pass@" in k or "mean@" in k:
            print(f"  {k}: {before.get(k, float('nan')):.3f} -> {after[k]:.3f}")
    return out


if __name__ == "__main__":
    main()
