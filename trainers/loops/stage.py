"""The update stage every RL trainer shares: a step's scored batch to one policy update.

:meth:`UpdateStage.run` takes the step batch (:class:`~trainers.engines.step.StepBatch`: the
packed samples, the rollout's log-probs as the old ones) and the pipeline's :class:`Credit` (how
its rewards are laid out) and runs, each stage adding its keys to the batch::

    [a colocated rollout sleeps, an offloaded train state comes back] -> [old / proximal recompute
    on the trainer (old_logprobs, behavior_logprobs), mismatch correction weights (is_weights,
    token_keep)] -> [reference log-probs, kl/rollout (ref_logprobs, kl); KL as a reward penalty
    (adaptive coefficient) or a loss term] -> [the credit's reward shaping] -> advantages: the
    credit's (a registry estimator) or GAE over the critic's values (values, returns,
    entropy_keep) -> [the credit's advantage shaping (token_keep)] -> [advantage whitening] ->
    [advantage clip] (advantages) -> [the critic's value update; its warm-up holds the policy]
    -> the learner's PPO update on the step batch (every train rank)

The credit is the only part a pipeline writes: :class:`~trainers.loops.update.SequenceCredit`
(RLVR: one reward per sample, the overlong penalty, per-domain reward normalisation, the
max-length mask), :class:`~trainers.loops.distill.DistillCredit` (``distill.mode=rl``: the
teacher's per-token scores, plus the RLVR credit's task advantages) and
:class:`~trainers.loops.agentic.TrajectoryCredit` (agents: episode, turn and state-group
rewards; the KL penalty per turn). The bracketed options
(``algorithm.correction``, ``algorithm.kl.*``, ``algorithm.whiten_advantages``,
``algorithm.advantage_clip``, the critic) therefore mean the same in every trainer.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from rollkit.keys import (
    ADVANTAGES,
    BEHAVIOR_LOGPROBS,
    KL,
    OLD_LOGPROBS,
    REF_LOGPROBS,
    RESPONSE_LENGTH,
    RESPONSE_MASK,
    STEP_IDS,
)
from rollkit.losses.kl import AdaptiveKLController
from rollkit.ops import masked_whiten
from rollkit.registry import ADVANTAGE_ESTIMATORS
from rollkit.rewards import clip_advantages
from trainers.config.algorithm import RLVR_ADVANTAGE_INPUTS
from trainers.engines.base import batch_logprobs
from trainers.engines.step import StepBatch
from trainers.learner import apply_correction, needs_recompute, rollout_kl
from trainers.loops.common import Timer
from trainers.loops.critic_step import CriticStep
from trainers.roles import Roles

__all__ = ["Credit", "UpdateStage", "row_advantages"]


#: what a row-level estimator reads from the step batch (by key; the config's check of the
#: estimator uses the same list); the KL penalty is already in the rewards (kl.mode=reward), so
#: an estimator's optional ``kl`` input is not given it
ROW_ADVANTAGE_INPUTS = RLVR_ADVANTAGE_INPUTS


def row_advantages(entry: Any, batch: Any, kwargs: dict[str, Any]) -> torch.Tensor:
    """``[B, T]`` advantages of the registry estimator ``entry`` over one reward per row: it
    reads :data:`ROW_ADVANTAGE_INPUTS` from ``batch`` (a step batch or any mapping with
    ``rewards``, ``group_ids`` ``[B]`` and ``response_mask`` ``[B, T]``; ``response_length``
    defaults to the mask's row sums); a per-row result is broadcast over the row's tokens, 0 off
    the response."""
    mask = batch[RESPONSE_MASK]
    inputs = {k: batch.get(k) for k in ROW_ADVANTAGE_INPUTS}
    if inputs[RESPONSE_LENGTH] is None:
        inputs[RESPONSE_LENGTH] = mask.sum(-1)
    out = entry.call(inputs, **kwargs)
    out = out[0] if isinstance(out, tuple) else out
    return (out[:, None] if out.dim() == 1 else out) * mask


class Credit(Protocol):
    """A pipeline's rewards and how they become advantages (module docstring). ``group_ids``
    ``[B]``: the rows' groups (the critic's AsyPPO shards)."""

    group_ids: torch.Tensor

    def penalize(self, kl_penalty: torch.Tensor, *, critic: bool, metrics: dict[str, float]) -> None:
        """``algorithm.kl.mode=reward``: take the ``[B, T]`` per-token penalty off the rewards
        (with a ``critic``, where its token rewards take it)."""

    def shape_rewards(self, metrics: dict[str, float]) -> None:
        """The pipeline's reward shaping after the KL penalty, before the advantages."""

    def advantages(self, entry: Any, kwargs: dict[str, Any], metrics: dict[str, float]) -> torch.Tensor:
        """``[B, T]`` advantages of the registry estimator ``entry`` (0 off the response)."""

    def token_rewards(self) -> torch.Tensor:
        """``[B, T]`` per-token rewards for GAE over a critic's values."""

    def shape_advantages(self, batch: StepBatch, adv: torch.Tensor, metrics: dict[str, float]) -> torch.Tensor:
        """The pipeline's own masks on ``adv`` (before whitening and clip; e.g. ``token_keep``)."""

    def report(self, adv: torch.Tensor, metrics: dict[str, float]) -> None:
        """The pipeline's metrics of the final advantages."""


class UpdateStage:
    """Recompute, correction, reference / KL, advantages or critic, learner (module docstring).

    State: the adaptive KL controller (``algorithm.kl.target``), checkpointed with the loop.
    """

    def __init__(self, cfg: Any, roles: Roles) -> None:
        self.cfg, self.roles = cfg, roles
        a = cfg.algorithm
        self.critic = roles.critic  # an estimator that reads values (gae / asyppo): the learned critic role
        # the registry estimator; none with a critic (GAE over its values, CriticStep)
        self.adv_entry = None if self.critic is not None else ADVANTAGE_ESTIMATORS.entry(a.advantage)
        self.kl_ctrl = (
            AdaptiveKLController(a.kl.coef, target=a.kl.target, horizon=a.kl.horizon) if a.kl.target else None
        )
        self.critic_step: CriticStep | None = None

    def run(
        self, batch: StepBatch, credit: Credit, step: int, timer: Timer, *, recompute: bool = False
    ) -> dict[str, float]:
        """Train on the step batch ``batch`` with ``credit`` at ``step``; returns the update's
        metrics. ``recompute``: take the old log-probs from the trainer's current weights (the
        proximal policy) and keep the rollout's as ``behavior_logprobs`` (stale samples); also
        done when ``algorithm.correction`` asks for it. The batch's ``step_ids`` (the agentic
        turns), when present, are the correction's segments."""
        a = self.cfg.algorithm
        metrics: dict[str, float] = {}
        if self.roles.offload:  # the device passes from the rollout to the learner (roles.sleep_rollout)
            with timer("offload"):
                self.roles.sleep_rollout()
        if recompute or needs_recompute(a.correction):
            self.recompute_proximal(batch, timer)
            metrics.update(apply_correction(batch, a.correction, segment_ids=batch.get(STEP_IDS)))
        self._reference(batch, credit, timer, metrics)
        credit.shape_rewards(metrics)
        adv = self._advantages(batch, credit, step, timer, metrics)
        adv = credit.shape_advantages(batch, adv, metrics)
        adv = self._shape_advantages(batch, adv, metrics)
        if self.critic is not None:
            adv = self.critic_step.keep(adv)  # AsyPPO's advantage mask survives the whitening
        batch[ADVANTAGES] = adv
        mask = batch[RESPONSE_MASK]
        metrics["advantage/abs_mean"] = float(adv.abs().sum() / mask.sum().clamp(min=1))
        credit.report(adv, metrics)
        if self.critic is not None:
            with timer("critic_train"):
                metrics.update(self.critic_step.update(seed=self.cfg.seed * 7919 + step))
            if step < self.cfg.critic.warmup_steps:  # critic warm-up: the policy waits
                metrics["critic/warmup"] = 1.0
                return metrics
        with timer("train"):
            metrics.update(self.roles.learner.update(batch, seed=self.cfg.seed * 7919 + step))
        return metrics

    def _reference(self, batch: StepBatch, credit: Credit, timer: Timer, metrics: dict[str, float]) -> None:
        """With a reference: its ``[B, T]`` log-probs (``ref_logprobs``, for the loss's KL term),
        the per-token KL estimate (``kl``) and ``kl/rollout``; ``kl.mode=reward``: the credit
        takes ``coef x KL`` per token off its rewards."""
        if self.roles.reference is None:
            return
        a = self.cfg.algorithm
        with timer("reference"):
            batch[REF_LOGPROBS] = self._logprobs(self.roles.reference, batch)
        kl_tok, metrics["kl/rollout"] = rollout_kl(
            batch[OLD_LOGPROBS], batch[REF_LOGPROBS], batch[RESPONSE_MASK], a.kl.estimator
        )
        batch[KL] = kl_tok
        if a.kl.mode == "reward":
            coef = a.kl.coef if self.kl_ctrl is None else self.kl_ctrl.value
            credit.penalize(coef * kl_tok, critic=self.critic is not None, metrics=metrics)
        if self.kl_ctrl is not None:  # this step's coefficient; the next from this step's KL
            metrics["kl/coef"] = self.kl_ctrl.value
            self.kl_ctrl.update(metrics["kl/rollout"], n_steps=batch.batch_size)

    def _advantages(
        self, batch: StepBatch, credit: Credit, step: int, timer: Timer, metrics: dict[str, float]
    ) -> torch.Tensor:
        """``[B, T]`` advantages: the credit's registry estimator, or GAE over the critic's values."""
        if self.critic is None:
            return credit.advantages(self.adv_entry, self.cfg.algorithm.advantage_kwargs, metrics)
        # PPO / AsyPPO: GAE over the critic's values (trainers.loops.critic_step)
        self.critic_step = CriticStep(self.cfg, self.critic, batch, credit.group_ids, step)
        rewards = credit.token_rewards()
        with timer("values"):
            return self.critic_step.advantages(rewards, metrics)

    def _shape_advantages(self, batch: StepBatch, adv: torch.Tensor, metrics: dict[str, float]) -> torch.Tensor:
        """``algorithm.whiten_advantages`` then ``algorithm.advantage_clip`` of ``adv`` ``[B, T]``."""
        a, mask = self.cfg.algorithm, batch[RESPONSE_MASK]
        if a.whiten_advantages:
            sel = batch.loss_mask
            if int(sel.sum()) >= 2:  # the unbiased variance needs two tokens
                adv = masked_whiten(adv, sel) * mask
        if a.advantage_clip:
            metrics["advantage/clipped_frac"] = float(
                ((adv.abs() > a.advantage_clip) & mask).sum() / mask.sum().clamp(min=1)
            )
            adv = clip_advantages(adv, max_abs=a.advantage_clip)
        return adv

    def _logprobs(self, policy: Any, batch: StepBatch) -> torch.Tensor:
        r = self.cfg.rollout
        return batch_logprobs(
            policy,
            batch.view(),
            temperature=r.temperature,
            top_k=r.top_k,
            top_p=r.top_p,
            micro_batch_size=self.cfg.train.micro_batch_size,
        )

    def recompute_proximal(self, batch: StepBatch, timer: Timer) -> None:
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
        batch[BEHAVIOR_LOGPROBS] = batch[OLD_LOGPROBS]
        batch[OLD_LOGPROBS] = proximal * batch[RESPONSE_MASK]

    def state_dict(self) -> dict[str, Any]:
        return {} if self.kl_ctrl is None else {"kl_ctrl": self.kl_ctrl.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.kl_ctrl is not None and state.get("kl_ctrl") is not None:
            self.kl_ctrl.load_state_dict(state["kl_ctrl"])
