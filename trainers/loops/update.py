"""The training half of an RLVR step, shared by the sync and async loops.

:class:`GroupUpdate` takes the kept groups ``(prompt, n generations, n rewards)`` and runs::

    pack (the rollout's log-probs are the old ones) -> [old / proximal recompute on the trainer,
    mismatch correction weights] -> [reference log-probs, KL as a reward penalty or a loss term]
    -> [running reward normalisation] -> advantages (registry name) -> [colocated rollout sleeps]
    -> the learner's PPO update (every train rank)
"""

from __future__ import annotations

from typing import Any

import torch

from rollkit.registry import ADVANTAGE_ESTIMATORS, REGULARIZERS
from rollkit.rewards import RunningRewardNormalizer
from trainers.config import Config
from trainers.engines.base import PackedBatch, batch_logprobs, pack_generations
from trainers.learner import apply_correction, needs_recompute
from trainers.loops.collect import Group
from trainers.loops.common import Timer
from trainers.roles import Roles

__all__ = ["GroupUpdate"]


class GroupUpdate:
    """Advantages and the PPO update of a step's groups (module docstring).

    State: the running reward normaliser (``algorithm.reward_normalizer``), checkpointed with the loop.
    """

    def __init__(self, cfg: Config, roles: Roles, pad_id: int) -> None:
        self.cfg, self.roles, self.pad_id = cfg, roles, pad_id
        self.adv_entry = ADVANTAGE_ESTIMATORS.entry(cfg.algorithm.advantage)
        self.normalizer = RunningRewardNormalizer() if cfg.algorithm.reward_normalizer else None

    def __call__(
        self, groups: list[Group], step: int, timer: Timer, *, recompute: bool = False
    ) -> dict[str, float]:
        """Train on ``groups`` at ``step``; returns the update's metrics. ``recompute``: take the
        old log-probs from the trainer's current weights (the proximal policy) and keep the
        rollout's as ``behavior_logprobs`` (asynchronous training with stale samples); also done
        when ``algorithm.correction`` asks for it (``recompute_old``, or a correction level)."""
        cfg, a, n = self.cfg, self.cfg.algorithm, self.cfg.rollout.n
        batch = pack_generations([g for _, gs, _ in groups for g in gs], self.pad_id)
        metrics: dict[str, float] = {}
        if recompute or needs_recompute(a.correction):
            self.recompute_proximal(batch, timer)
            metrics.update(apply_correction(batch, a.correction))
        mask = batch.response_mask
        group_ids = torch.arange(len(groups)).repeat_interleave(n)
        rewards = torch.tensor([r for _, _, rs in groups for r in rs], dtype=torch.float32)
        ref_lp = None
        if self.roles.reference is not None:
            with timer("reference"):
                ref_lp = self._logprobs(self.roles.reference, batch)
            kl_tok = (
                REGULARIZERS.entry("kl")
                .call(
                    {"logprobs": batch.old_logprobs, "ref_logprobs": ref_lp, "response_mask": mask},
                    estimator=a.kl.estimator,
                    coef=1.0,
                )
                .loss
            )
            metrics["kl/rollout"] = float(kl_tok.sum() / mask.sum().clamp(min=1))
            if a.kl.mode == "reward":
                rewards = rewards - a.kl.coef * kl_tok.sum(-1)
        if self.normalizer is not None:
            rewards = self.normalizer.normalize(rewards)
        adv = self.adv_entry.call(
            {
                "rewards": rewards,
                "group_ids": group_ids,
                "response_mask": mask,
                "response_length": mask.sum(-1),
            },
            **a.advantage_kwargs,
        )
        adv = adv[0] if isinstance(adv, tuple) else adv
        adv = (adv[:, None] if adv.dim() == 1 else adv) * mask
        metrics["advantage/abs_mean"] = float(adv.abs().sum() / mask.sum().clamp(min=1))
        if self.roles.offload:
            with timer("offload"):
                self.roles.sleep_rollout()
        with timer("train"):
            metrics.update(self.roles.learner.update(batch, adv, ref_lp, seed=cfg.seed * 7919 + step))
        return metrics

    def _logprobs(self, policy: Any, batch: PackedBatch) -> torch.Tensor:
        r = self.cfg.rollout
        return batch_logprobs(
            policy,
            batch,
            temperature=r.temperature,
            top_k=r.top_k,
            top_p=r.top_p,
            micro_batch_size=self.cfg.train.micro_batch_size,
        )

    def recompute_proximal(self, batch: PackedBatch, timer: Timer) -> None:
        """``old_logprobs`` <- the learner's current log-probs; ``behavior_logprobs`` <- the rollout's."""
        learner = self.roles.learner
        policy = getattr(learner, "engine", learner)  # in process: the engine; on Ray: the train group
        if not hasattr(policy, "logprobs") and not hasattr(policy, "batch_logprobs"):
            raise ValueError(
                "asynchronous.recompute_logprobs / algorithm.correction: the learner has neither an in-process "
                "train engine nor batch_logprobs; set asynchronous.recompute_logprobs=false and "
                "algorithm.correction.level=off, recompute_old=false"
            )
        with timer("recompute"):
            proximal = self._logprobs(policy, batch)
        batch.behavior_logprobs = batch.old_logprobs
        batch.old_logprobs = proximal * batch.response_mask

    def state_dict(self) -> dict[str, Any]:
        return {"normalizer": None if self.normalizer is None else self.normalizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.normalizer is not None and state.get("normalizer") is not None:
            self.normalizer.load_state_dict(state["normalizer"])
