"""A cell body for models that need a starting accuracy: supervised warm-up, then RL.

``recipes/ablate.py --sft-steps N`` runs :func:`warm_start_fit` in each cell. See
docs/ablations.md.
"""

from __future__ import annotations

from typing import Any

import torch

from trainers.config import Config
from trainers.data import build_prompts
from trainers.engines import TorchTrainEngine
from trainers.engines.build import build_engines
from trainers.learner import supervised_warmup
from trainers.loops import SyncTrainer

__all__ = ["warm_start_fit"]


def warm_start_fit(
    cfg: Config, *, sft_steps: int, sft_lr: float = 3e-3, sft_batch_size: int = 64
) -> dict[str, Any]:
    """Supervised warm-up, then RL: the cell body for models that need a starting accuracy.

    Builds the embedded engines (:func:`trainers.sync_trainer.build_engines`), runs
    ``sft_steps`` steps of :func:`~trainers.sync_trainer.supervised_warmup` (its own AdamW at
    ``sft_lr``, batches of ``sft_batch_size`` train prompts, seeded by ``cfg.seed``), pushes
    the weights to the rollout engine, then builds the :class:`~trainers.sync_trainer.SyncTrainer`
    (so a KL reference is the warmed-up policy) and returns ``fit()``'s summary. The tiny
    model of the tests learns 1-digit addition this way (docs/trainer.md).
    """
    if sft_steps < 0:
        raise ValueError(f"sft_steps must be >= 0, got {sft_steps}")
    rollout, train, tok = build_engines(cfg)
    if sft_steps and not isinstance(getattr(train, "model", None), torch.nn.Module):
        raise ValueError(
            f"sft_steps: the warm-up trains train.model in place; train.engine={cfg.train.engine!r} has none"
        )
    if sft_steps:
        train_prompts, _ = build_prompts(cfg)
        sft = TorchTrainEngine(train.model, lr=sft_lr, grad_clip=cfg.train.grad_clip, device=cfg.train.device)
        loss = supervised_warmup(
            sft,
            tok,
            train_prompts,
            steps=sft_steps,
            batch_size=sft_batch_size,
            seed=cfg.seed,
            chat_template=cfg.data.chat_template if cfg.data.chat_template != "auto" else "off",
        )
        print(f"[sft] {sft_steps} warm-up steps, last loss {loss:.3f}", flush=True)
        rollout.update_weights(train.export_weights(), version=0)
    return SyncTrainer(cfg, rollout=rollout, train=train, tokenizer=tok).fit()
