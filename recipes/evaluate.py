"""Evaluate a model on held-out prompts without training: greedy accuracy, pass@k and mean@k.

Reads the same config as the RLVR recipes (``--config run.yaml``, e.g. the ``config.yaml`` a
run wrote, and ``key=value`` overrides), builds only the rollout engine and the reward pool,
and reports on the held-out prompts (``data.domains``' eval sets, or the single domain's):
greedy accuracy overall, per ``data_source`` and per domain, and with ``eval.n > 1`` pass@k /
mean@k (the unbiased estimator of Chen et al. 2021) for each ``k`` of ``eval.k`` (default 1 and
n), overall and per domain. The metrics go to stdout and, as JSON, to ``--out``
(default ``<logging.dir>/eval.json``).

    python recipes/evaluate.py --model runs/rlvr_multidomain/model \\
        --config runs/rlvr_multidomain/config.yaml eval.n=8 eval.temperature=1.0
    python recipes/evaluate.py --model runs/rlvr_qwen/model eval.n=16 eval.k='[1, 4, 16]'
    python recipes/evaluate.py --help

Defaults are :func:`recipes.rlvr_qwen.recipe_defaults` with ``eval.n=8``; ``rollout.engine``
``hf`` (default) or ``vllm``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from recipes import rlvr_qwen
from trainers.config import ROLLOUT_ENGINES, Config, load_config, validate
from trainers.domains import run_prompts
from trainers.engines.build import build_model, make_rollout_engine
from trainers.loops.common import Codec
from trainers.loops.evaluation import held_out_metrics
from trainers.models import is_hub_id
from trainers.roles import build_verifier, reward_pool


@dataclass
class EvalRoles:
    """What the evaluation needs of the roles: the rollout engine and the reward pool."""

    rollout: Any
    rewards: Any


def eval_defaults() -> Config:
    cfg = rlvr_qwen.recipe_defaults()
    cfg.eval.n = 8
    cfg.logging.dir = "runs/evaluate"
    return cfg


def _args(argv: list[str]) -> tuple[list[str], str | None]:
    """``argv`` without ``--out PATH``, and that path."""
    out, rest, i = None, [], 0
    while i < len(argv):
        if argv[i] == "--out" and i + 1 < len(argv):
            out, i = argv[i + 1], i + 2
        elif argv[i].startswith("--out="):
            out, i = argv[i].split("=", 1)[1], i + 1
        else:
            rest, i = [*rest, argv[i]], i + 1
    return rest, out


def main(argv: list[str] | None = None) -> dict[str, float]:
    argv, out_path = _args(sys.argv[1:] if argv is None else list(argv))
    try:
        cfg = load_config(argv, base=eval_defaults())
        if not is_hub_id(cfg.model.path):
            os.environ.setdefault("HF_HUB_OFFLINE", "1")
        validate(cfg)
        if ROLLOUT_ENGINES[cfg.rollout.engine].remote or cfg.ray.enabled:
            local = ROLLOUT_ENGINES.having(lambda s: not s.remote)
            raise ValueError(f"rollout.engine={cfg.rollout.engine!r}: the evaluation runs {local} in this process")
        _, held = run_prompts(cfg)
        if not held:
            raise ValueError("data.eval_size: no held-out prompts to evaluate")
    except (ValueError, ImportError) as e:
        raise rlvr_qwen._fail(e) from None
    t0 = time.perf_counter()
    model, tok = build_model(cfg)
    rollout = make_rollout_engine(cfg, model, tok, device=cfg.train.device)
    pool = reward_pool(cfg, build_verifier(cfg))
    try:
        metrics = held_out_metrics(
            EvalRoles(rollout, pool),
            Codec(tok, cfg.data.chat_template),
            held,
            cfg,
            progress=cfg.logging.progress,
        )
    finally:
        pool.close()
    metrics["eval/seconds"] = time.perf_counter() - t0
    metrics["eval/prompts"] = float(len(held))
    for k in sorted(metrics):
        print(f"{k}: {metrics[k]:.4f}")
    path = Path(out_path or Path(cfg.logging.dir) / "eval.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(metrics, indent=1, sort_keys=True))
    print(f"written: {path}")
    return metrics


if __name__ == "__main__":
    main()
