"""The training half of an RLVR step, shared by the sync and async loops.

:class:`GroupUpdate` takes the kept groups ``(prompt, n generations, n rewards)`` and runs::

    pack (the rollout's log-probs are the old ones) -> [old / proximal recompute on the trainer,
    mismatch correction weights] -> [DAPO soft overlong penalty] -> [reference log-probs, KL as
    a reward penalty (adaptive coefficient) or a loss term] -> [running / batch reward
    normalisation, per domain] -> [reward clip] -> advantages (registry name) -> [max-length
    mask] -> [advantage whitening] -> [advantage clip] -> the learner's PPO update (every train
    rank); first of all a colocated rollout sleeps and an offloaded train state comes back
    (``placement.offload``, ``placement.offload_train``)

The bracketed ROLL options (``reward.overlong_*``, ``algorithm.kl.target``,
``algorithm.reward_clip``, ``filter.max_len_mask``, ``algorithm.whiten_advantages``,
``algorithm.advantage_clip``) are off by default; docs/trainer.md lists them. The sync,
tail-batching and async loops all train through this class, so they share them.

In a multi-domain run (``data.domains``) the reward normalisations keep statistics per domain
(the prompts' :attr:`~trainers.data.Prompt.domain`), the group advantages stay within groups,
and :func:`domain_metrics` reports each domain's reward, accuracy, length, truncation and
advantage size.
"""

from __future__ import annotations

from typing import Any

import torch

from rollkit.losses.kl import AdaptiveKLController
from rollkit.ops import masked_whiten
from rollkit.registry import ADVANTAGE_ESTIMATORS
from rollkit.rewards import (
    RunningRewardNormalizer,
    clip_advantages,
    clip_rewards,
    mask_truncated,
    normalize_rewards,
    overlong_penalty,
    token_level_rewards,
)
from trainers.config import Config, critic_needed
from trainers.domains import domain_masks
from trainers.engines.base import PackedBatch, batch_logprobs, pack_generations
from trainers.learner import apply_correction, loss_mask, needs_recompute, rollout_kl
from trainers.loops.collect import Group
from trainers.loops.common import Timer
from trainers.loops.critic_step import CriticStep
from trainers.roles import Roles

__all__ = ["GroupUpdate", "domain_metrics"]


def domain_metrics(
    domains: list[str], rewards: torch.Tensor, gens: list[Any], adv: torch.Tensor, mask: torch.Tensor
) -> dict[str, float]:
    """Per-domain metrics of a batch: ``domain/<d>/reward`` (mean task reward),
    ``domain/<d>/accuracy`` (share of samples with reward >= 1, i.e. fully solved),
    ``domain/<d>/response_length``, ``domain/<d>/truncated_frac`` (stopped by ``max_tokens``),
    ``domain/<d>/advantage_abs_mean`` (over the domain's response tokens) and
    ``domain/<d>/samples``. ``domains`` ``[B]`` names each sample's domain (``""``: none, no
    metrics); ``rewards`` ``[B]``; ``adv`` and ``mask`` ``[B, T]``."""
    out: dict[str, float] = {}
    lens = torch.tensor([len(g.token_ids) for g in gens], dtype=torch.float64)
    trunc = torch.tensor([g.finish_reason == "length" for g in gens], dtype=torch.float64)
    for d, sel in domain_masks(domains).items():
        if not d:
            continue
        r = rewards[sel].double()
        out[f"domain/{d}/reward"] = float(r.mean())
        out[f"domain/{d}/accuracy"] = float((r >= 1).double().mean())
        out[f"domain/{d}/response_length"] = float(lens[sel].mean())
        out[f"domain/{d}/truncated_frac"] = float(trunc[sel].mean())
        out[f"domain/{d}/advantage_abs_mean"] = float(adv[sel].abs().sum() / mask[sel].sum().clamp(min=1))
        out[f"domain/{d}/samples"] = float(sel.sum())
    return out


class GroupUpdate:
    """Advantages and the PPO update of a step's groups (module docstring).

    State: the running reward normaliser (``algorithm.reward_normalizer``) and the adaptive KL
    controller (``algorithm.kl.target``), checkpointed with the loop.
    """

    def __init__(self, cfg: Config, roles: Roles, pad_id: int) -> None:
        self.cfg, self.roles, self.pad_id = cfg, roles, pad_id
        a = cfg.algorithm
        # the registry estimator; none with a critic (GAE over its values, CriticStep)
        self.adv_entry = None if critic_needed(cfg) else ADVANTAGE_ESTIMATORS.entry(a.advantage)
        self.normalizer = RunningRewardNormalizer() if a.reward_normalizer else None
        self.domain_normalizers: dict[str, RunningRewardNormalizer] = {}  # data.domains: one per domain
        self.kl_ctrl = (
            AdaptiveKLController(a.kl.coef, target=a.kl.target, horizon=a.kl.horizon) if a.kl.target else None
        )
        self.critic = roles.critic  # algorithm.advantage=gae / asyppo: the learned critic role
        self.critic_step: CriticStep | None = None

    def __call__(
        self, groups: list[Group], step: int, timer: Timer, *, recompute: bool = False
    ) -> dict[str, float]:
        """Train on ``groups`` at ``step``; returns the update's metrics. ``recompute``: take the
        old log-probs from the trainer's current weights (the proximal policy) and keep the
        rollout's as ``behavior_logprobs`` (asynchronous training with stale samples); also done
        when ``algorithm.correction`` asks for it (``recompute_old``, or a correction level)."""
        cfg, a, n = self.cfg, self.cfg.algorithm, self.cfg.rollout.n
        gens = [g for _, gs, _ in groups for g in gs]
        batch = pack_generations(gens, self.pad_id)
        metrics: dict[str, float] = {}
        if self.roles.offload:  # the device passes from the rollout to the learner (roles.sleep_rollout)
            with timer("offload"):
                self.roles.sleep_rollout()
        if recompute or needs_recompute(a.correction):
            self.recompute_proximal(batch, timer)
            metrics.update(apply_correction(batch, a.correction))
        mask = batch.response_mask
        group_ids = torch.arange(len(groups)).repeat_interleave(n)
        rewards = torch.tensor([r for _, _, rs in groups for r in rs], dtype=torch.float32)
        task_rewards, domains = rewards, [p.domain for p, _, _ in groups for _ in range(n)]
        if cfg.reward.overlong_buffer:  # DAPO soft overlong punishment, added to the task reward
            pen = overlong_penalty(
                torch.tensor([len(g.token_ids) for g in gens], dtype=torch.int64),
                max_length=cfg.rollout.max_tokens,
                cache_length=cfg.reward.overlong_buffer,
                penalty_factor=cfg.reward.overlong_penalty,
                dtype=torch.float32,
            )
            rewards = rewards + pen
            metrics["reward/overlong_penalty_mean"] = float(pen.mean())
            metrics["reward/overlong_frac"] = float((pen < 0).float().mean())
        ref_lp, kl_pen = None, None  # kl_pen: [B, T] the KL reward penalty per token (kl.mode=reward)
        if self.roles.reference is not None:
            with timer("reference"):
                ref_lp = self._logprobs(self.roles.reference, batch)
            kl_tok, metrics["kl/rollout"] = rollout_kl(batch.old_logprobs, ref_lp, mask, a.kl.estimator)
            if a.kl.mode == "reward":
                coef = a.kl.coef if self.kl_ctrl is None else self.kl_ctrl.value
                kl_pen = coef * kl_tok
                if self.critic is None:  # a critic's token rewards take it per token (CriticStep)
                    rewards = rewards - kl_pen.sum(-1)
            if self.kl_ctrl is not None:  # this step's coefficient; the next from this step's KL
                metrics["kl/coef"] = self.kl_ctrl.value
                self.kl_ctrl.update(metrics["kl/rollout"], n_steps=len(rewards))
        rewards = self._normalize(rewards, domains)
        if a.reward_clip:
            metrics["reward/clipped_frac"] = float((rewards.abs() > a.reward_clip).float().mean())
            rewards = clip_rewards(rewards, low=-a.reward_clip, high=a.reward_clip)
        adv = self._advantages(batch, rewards, kl_pen, group_ids, step, timer, metrics)
        adv = self._shape_advantages(batch, gens, adv, metrics)
        if self.critic is not None:
            adv = self.critic_step.keep(adv)  # AsyPPO's advantage mask survives the whitening
        metrics["advantage/abs_mean"] = float(adv.abs().sum() / mask.sum().clamp(min=1))
        metrics.update(domain_metrics(domains, task_rewards, gens, adv, mask))
        if self.critic is not None:
            with timer("critic_train"):
                metrics.update(self.critic_step.update(seed=cfg.seed * 7919 + step))
            if step < cfg.critic.warmup_steps:  # critic warm-up: the policy waits
                metrics["critic/warmup"] = 1.0
                return metrics
        with timer("train"):
            metrics.update(self.roles.learner.update(batch, adv, ref_lp, seed=cfg.seed * 7919 + step))
        return metrics

    def _advantages(
        self,
        batch: PackedBatch,
        rewards: torch.Tensor,
        kl_pen: torch.Tensor | None,
        group_ids: torch.Tensor,
        step: int,
        timer: Timer,
        metrics: dict[str, float],
    ) -> torch.Tensor:
        """``[B, T]`` advantages of the sequence ``rewards`` ``[B]``: the registry estimator, or
        with a critic GAE over its values (the KL penalty ``kl_pen`` ``[B, T]`` per token)."""
        mask = batch.response_mask
        if self.critic is not None:  # PPO / AsyPPO: GAE over the critic's values (trainers.loops.critic_step)
            self.critic_step = CriticStep(self.cfg, self.critic, batch, group_ids, step)
            tok = token_level_rewards(rewards, mask, kl=kl_pen, kl_coef=0.0 if kl_pen is None else 1.0)
            with timer("values"):
                return self.critic_step.advantages(tok, metrics)
        adv = self.adv_entry.call(
            {
                "rewards": rewards,
                "group_ids": group_ids,
                "response_mask": mask,
                "response_length": mask.sum(-1),
            },
            **self.cfg.algorithm.advantage_kwargs,
        )
        adv = adv[0] if isinstance(adv, tuple) else adv
        return (adv[:, None] if adv.dim() == 1 else adv) * mask

    def _normalize(self, rewards: torch.Tensor, domains: list[str]) -> torch.Tensor:
        """``algorithm.reward_normalizer`` (running) then ``algorithm.batch_reward_norm`` of
        ``rewards`` ``[B]``, each over the samples of one domain at a time (one domain, ``""``,
        without ``data.domains``)."""
        a = self.cfg.algorithm
        if not (a.reward_normalizer or a.batch_reward_norm):
            return rewards
        out = rewards.clone()
        for d, sel in domain_masks(domains).items():
            r = rewards[sel]
            if a.reward_normalizer:
                if d:
                    r = self.domain_normalizers.setdefault(d, RunningRewardNormalizer()).normalize(r)
                else:
                    r = self.normalizer.normalize(r)
            if a.batch_reward_norm:
                r = normalize_rewards(r, level="batch")
            out[sel] = r
        return out

    def _shape_advantages(
        self, batch: PackedBatch, gens: list[Any], adv: torch.Tensor, metrics: dict[str, float]
    ) -> torch.Tensor:
        """``filter.max_len_mask`` (into ``batch.keep``), then ``algorithm.whiten_advantages`` and
        ``algorithm.advantage_clip`` of ``adv`` ``[B, T]``; their metrics go into ``metrics``."""
        cfg, a = self.cfg, self.cfg.algorithm
        mask = batch.response_mask
        if cfg.filter.max_len_mask:  # DAPO overlong filtering: no loss on truncated samples
            truncated = torch.tensor([g.finish_reason == "length" for g in gens], dtype=torch.bool)
            kept = mask_truncated(mask, truncated)
            batch.keep = kept if batch.keep is None else batch.keep & kept
            metrics["filter/max_len_masked_frac"] = float(truncated.float().mean())
        if a.whiten_advantages:
            sel = loss_mask(batch)
            if int(sel.sum()) >= 2:  # the unbiased variance needs two tokens
                adv = masked_whiten(adv, sel) * mask
        if a.advantage_clip:
            metrics["advantage/clipped_frac"] = float(
                ((adv.abs() > a.advantage_clip) & mask).sum() / mask.sum().clamp(min=1)
            )
            adv = clip_advantages(adv, max_abs=a.advantage_clip)
        return adv

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
        state: dict[str, Any] = {
            "normalizer": None if self.normalizer is None else self.normalizer.state_dict()
        }
        if self.kl_ctrl is not None:
            state["kl_ctrl"] = self.kl_ctrl.state_dict()
        if self.domain_normalizers:
            state["domain_normalizers"] = {d: z.state_dict() for d, z in self.domain_normalizers.items()}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.normalizer is not None and state.get("normalizer") is not None:
            self.normalizer.load_state_dict(state["normalizer"])
        if self.kl_ctrl is not None and state.get("kl_ctrl") is not None:
            self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        for d, z in state.get("domain_normalizers", {}).items():
            self.domain_normalizers.setdefault(d, RunningRewardNormalizer()).load_state_dict(z)
