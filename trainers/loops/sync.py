"""The synchronous RLVR trainer: collect, train, push weights, on the roles of :mod:`trainers.roles`.

:meth:`SyncTrainer.step` is the whole RL step; docs/trainer.md walks through it. The parts:
a collector (:mod:`trainers.loops.collect`: groups with dynamic-sampling refills, per-request
length budgets, or RollPacker tail batching), :class:`~trainers.loops.update.GroupUpdate`
(advantages and the one PPO update), the roles (rollout, learner, reference, reward pool; in
process or on Ray), and the shared evaluation, checkpoint and fit driver.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import torch

from trainers.config import Config, validate
from trainers.data import Prompt
from trainers.loops.collect import GroupCollector, TailCollector
from trainers.loops.common import (
    Timer,
    loop_state,
    memory_metrics,
    read_checkpoint,
    restore_loop_state,
    run_fit,
    write_checkpoint,
)
from trainers.loops.evaluation import greedy_accuracy, held_out_metrics
from trainers.loops.parts import attach, build_parts

__all__ = ["SyncTrainer", "greedy_accuracy"]


class SyncTrainer:
    """Synchronous RLVR: ``fit()`` = evaluate, ``train.steps`` x :meth:`step`, evaluate, plot.

    Args:
        cfg: the configuration.
        rollout, train, tokenizer, model, reward_fn, reference: the roles, as
            :func:`trainers.roles.build_roles` takes them (default: built from ``cfg``).
        train_prompts, eval_prompts: default :func:`trainers.data.build_prompts`.

    :meth:`close` (or ``with SyncTrainer(...) as tr``) stops the reward workers and the Ray
    actors the trainer started.
    """

    def __init__(
        self,
        cfg: Config,
        *,
        rollout: Any = None,
        train: Any = None,
        tokenizer: Any = None,
        model: Any = None,
        train_prompts: list[Prompt] | None = None,
        eval_prompts: list[Prompt] | None = None,
        reward_fn: Any = None,
        reference: Any = None,
    ) -> None:
        validate(cfg)
        self.cfg = cfg
        attach(
            self,
            build_parts(
                cfg,
                train_prompts=train_prompts,
                eval_prompts=eval_prompts,
                rollout=rollout,
                train=train,
                tokenizer=tokenizer,
                model=model,
                reward_fn=reward_fn,
                reference=reference,
            ),
        )
        self.tail = (
            TailCollector(cfg, self.rollout, self.rewards, self.codec, self.train_prompts, self.maker)
            if cfg.tail_batching.enabled
            else None
        )
        self.collector = self.tail or GroupCollector(
            cfg, self.rollout, self.rewards, self.codec, self.iterator, self.maker
        )
        self.global_step = 0
        torch.manual_seed(cfg.seed)
        random.seed(cfg.seed)

    def step(self) -> dict[str, float]:
        """One RL step; returns its metrics."""
        timer, t_start = Timer(), time.perf_counter()
        # generate n samples per prompt, scoring each as it finishes (dynamic sampling refills)
        groups, metrics, lengths = self.collector.collect(self.global_step, timer)
        if groups:
            # [reference / KL] -> advantages -> the PPO update on every train rank
            metrics.update(self.update(groups, self.global_step, timer))
            with timer("weight_sync"):  # wake a colocated rollout, load the new weights into it
                self.roles.push_weights(version=self.global_step + 1)
        self.global_step += 1
        metrics.update(timer.metrics(t_start))
        metrics["throughput/rollout_tokens_per_s"] = sum(lengths) / max(timer.t["rollout"], 1e-9)
        metrics.update(self.roles.reward_metrics())
        metrics.update(self.roles.rollout_metrics())
        metrics.update(memory_metrics())
        return metrics

    def evaluate(self, prompts: list[Prompt] | None = None) -> dict[str, float]:
        """Greedy accuracy on the held-out prompts, overall, per ``data_source`` and per domain;
        pass@k / mean@k with ``eval.n > 1`` (:func:`trainers.loops.evaluation.held_out_metrics`)."""
        prompts = self.eval_prompts if prompts is None else prompts
        return held_out_metrics(self.roles, self.codec, prompts, self.cfg, progress=self.cfg.logging.progress)

    def fit(self, steps: int | None = None) -> dict[str, Any]:
        """Evaluate, train ``steps`` (default ``train.steps``; counted from the current step up to
        that total), evaluate; returns a summary (:func:`trainers.loops.common.run_fit`)."""
        return run_fit(self, steps)

    # ------------------------------------------------------------------ checkpoints

    @property
    def last_tail_batch(self) -> Any:
        """The latest tail-batching round's batch (prompt ids, round), or None."""
        return None if self.tail is None else self.tail.last_batch

    def state_dict(self) -> dict[str, Any]:
        return {**loop_state(self), "tail": None if self.tail is None else self.tail.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        restore_loop_state(self, state)
        if self.tail is not None and state.get("tail") is not None:  # else the queue starts empty
            self.tail.load_state_dict(state["tail"])

    def save_model(self, path: str | Path) -> Path:
        """The trained policy and tokenizer as a Hugging Face model directory at ``path``."""
        return self.learner.save_model(path, self.tok)

    def save_checkpoint(self, directory: str | Path | None = None) -> Path:
        """Write ``<checkpoint.dir>/step_<k>/trainer.pt``; returns the step directory."""
        ck = self.cfg.checkpoint
        return write_checkpoint(
            self.state_dict(), directory or ck.dir, self.global_step, keep=ck.keep, resume=ck.resume
        )

    def load_checkpoint(self, path: str | Path) -> None:
        """Restore a checkpoint (a ``step_<k>`` directory, or ``"auto"``: the latest under
        ``checkpoint.dir``) and push its weights to the rollout engine."""
        self.load_state_dict(read_checkpoint(path, self.cfg.checkpoint.dir))
        self.rollout.update_weights(self.learner.export_weights(), version=self.global_step)

    # ------------------------------------------------------------------ shutdown

    def close(self) -> None:
        """Stop the reward workers and the Ray actors / placement groups this trainer started
        (engines passed in are the caller's). Idempotent."""
        self.roles.close()

    def __enter__(self) -> SyncTrainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
