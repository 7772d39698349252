"""The training half of an RLVR step, shared by the sync, tail-batching, async and distillation loops.

:class:`GroupUpdate` takes the kept groups ``(prompt, n generations, n rewards)``, builds the
step batch (:class:`~trainers.engines.step.StepBatch`: the packed samples, the rollout's
log-probs as the old ones, ``rewards`` and ``group_ids``) and runs the shared update stage
(:class:`~trainers.loops.stage.UpdateStage`: recompute / correction, reference / KL, advantages
or critic, whitening, clip, learner) with the RLVR :class:`SequenceCredit`: one reward per
sample, plus [DAPO soft overlong penalty] (before the KL penalty) -> [running / batch reward
normalisation, per domain] -> [reward clip] (before the advantages) and [max-length mask]
(before the whitening).

The bracketed ROLL options (``reward.overlong_*``, ``algorithm.kl.target``,
``algorithm.reward_clip``, ``filter.max_len_mask``, ``algorithm.whiten_advantages``,
``algorithm.advantage_clip``) are off by default; docs/trainer.md lists them.

In a multi-domain run (``data.domains``) the reward normalisations keep statistics per domain
(the prompts' :attr:`~trainers.data.Prompt.domain`), the group advantages stay within groups,
and :func:`domain_metrics` reports each domain's reward, accuracy, length, truncation and
advantage size.
"""

from __future__ import annotations

from typing import Any

import torch

from rollkit.keys import GROUP_IDS, RESPONSE_MASK, REWARDS
from rollkit.rewards import (
    RunningRewardNormalizer,
    clip_rewards,
    mask_truncated,
    normalize_rewards,
    overlong_penalty,
    token_level_rewards,
)
from trainers.config import Config
from trainers.domains import domain_masks
from trainers.engines.base import pack_generations
from trainers.engines.step import StepBatch
from trainers.loops.collect import Group
from trainers.loops.common import Timer
from trainers.loops.stage import UpdateStage, row_advantages
from trainers.roles import Roles

__all__ = ["GroupUpdate", "SequenceCredit", "domain_metrics"]


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


class SequenceCredit:
    """The RLVR credit of the shared update stage (:class:`~trainers.loops.stage.Credit`): one
    reward per sample (the step batch's ``rewards`` ``[B]`` and ``group_ids`` ``[B]``: the
    prompt's group), the DAPO overlong penalty added at once (``reward.overlong_buffer``), the
    KL penalty summed into the reward (or per token with a critic), the running / batch
    normalisation per domain and the clip, the registry estimator over the rows, the max-length
    mask (``token_keep``), per-domain metrics. The shaped rewards replace the batch's
    ``rewards``; the task rewards stay here for the metrics."""

    def __init__(
        self, update: GroupUpdate, batch: StepBatch, gens: list[Any], domains: list[str], metrics: dict[str, float]
    ) -> None:
        cfg = update.cfg
        self.update, self.batch, self.gens, self.domains = update, batch, gens, domains
        self.mask, self.group_ids = batch[RESPONSE_MASK], batch[GROUP_IDS]
        self.task_rewards = rewards = batch[REWARDS]
        self.kl_penalty: torch.Tensor | None = None  # [B, T] with a critic (kl.mode=reward)
        if cfg.reward.overlong_buffer:  # DAPO soft overlong punishment, added to the task reward
            pen = overlong_penalty(
                torch.tensor([len(g.token_ids) for g in gens], dtype=torch.int64),
                max_length=cfg.rollout.max_tokens,
                cache_length=cfg.reward.overlong_buffer,
                penalty_factor=cfg.reward.overlong_penalty,
                dtype=torch.float32,
            )
            batch[REWARDS] = rewards + pen
            metrics["reward/overlong_penalty_mean"] = float(pen.mean())
            metrics["reward/overlong_frac"] = float((pen < 0).float().mean())

    @property
    def rewards(self) -> torch.Tensor:
        """``[B]`` the rewards as shaped so far (the batch's ``rewards``)."""
        return self.batch[REWARDS]

    def penalize(self, kl_penalty: torch.Tensor, *, critic: bool, metrics: dict[str, float]) -> None:
        if critic:  # a critic's token rewards take it per token
            self.kl_penalty = kl_penalty
        else:
            self.batch[REWARDS] = self.rewards - kl_penalty.sum(-1)

    def shape_rewards(self, metrics: dict[str, float]) -> None:
        a = self.update.cfg.algorithm
        rewards = self.update.normalize(self.rewards, self.domains)
        if a.reward_clip:
            metrics["reward/clipped_frac"] = float((rewards.abs() > a.reward_clip).float().mean())
            rewards = clip_rewards(rewards, low=-a.reward_clip, high=a.reward_clip)
        self.batch[REWARDS] = rewards

    def advantages(self, entry: Any, kwargs: dict[str, Any], metrics: dict[str, float]) -> torch.Tensor:
        return row_advantages(entry, self.batch, kwargs)

    def token_rewards(self) -> torch.Tensor:
        pen = self.kl_penalty
        return token_level_rewards(self.rewards, self.mask, kl=pen, kl_coef=0.0 if pen is None else 1.0)

    def shape_advantages(self, batch: StepBatch, adv: torch.Tensor, metrics: dict[str, float]) -> torch.Tensor:
        """``filter.max_len_mask``: no loss on truncated samples (into ``token_keep``)."""
        if self.update.cfg.filter.max_len_mask:  # DAPO overlong filtering
            truncated = torch.tensor([g.finish_reason == "length" for g in self.gens], dtype=torch.bool)
            batch.keep_tokens(mask_truncated(batch[RESPONSE_MASK], truncated))
            metrics["filter/max_len_masked_frac"] = float(truncated.float().mean())
        return adv

    def report(self, adv: torch.Tensor, metrics: dict[str, float]) -> None:
        metrics.update(domain_metrics(self.domains, self.task_rewards, self.gens, adv, self.mask))


class GroupUpdate(UpdateStage):
    """The shared update stage over a step's groups (module docstring).

    State: the running reward normaliser (``algorithm.reward_normalizer``, one per domain with
    ``data.domains``) and the stage's adaptive KL controller, checkpointed with the loop.
    """

    def __init__(self, cfg: Config, roles: Roles, pad_id: int) -> None:
        super().__init__(cfg, roles)
        self.pad_id = pad_id
        self.normalizer = RunningRewardNormalizer() if cfg.algorithm.reward_normalizer else None
        self.domain_normalizers: dict[str, RunningRewardNormalizer] = {}  # data.domains: one per domain

    def __call__(
        self, groups: list[Group], step: int, timer: Timer, *, recompute: bool = False
    ) -> dict[str, float]:
        """Train on ``groups`` at ``step``; returns the update's metrics. ``recompute``: take the
        old log-probs from the trainer's current weights (the proximal policy) and keep the
        rollout's as ``behavior_logprobs`` (asynchronous training with stale samples); also done
        when ``algorithm.correction`` asks for it (``recompute_old``, or a correction level)."""
        batch = self.step_batch(groups)
        metrics: dict[str, float] = {}
        credit = SequenceCredit(self, batch, *self.samples(groups), metrics)
        metrics.update(self.run(batch, credit, step, timer, recompute=recompute))
        return metrics

    def step_batch(self, groups: list[Group]) -> StepBatch:
        """The step batch of ``groups``: the packed generations (their log-probs the old ones),
        ``rewards`` ``[B]`` (float32) and ``group_ids`` ``[B]`` (each group's index)."""
        batch = pack_generations([g for _, gs, _ in groups for g in gs], self.pad_id)
        return StepBatch.from_packed(
            batch,
            **{
                REWARDS: torch.tensor([r for _, _, rs in groups for r in rs], dtype=torch.float32),
                GROUP_IDS: torch.arange(len(groups)).repeat_interleave(self.cfg.rollout.n),
            },
        )

    def samples(self, groups: list[Group]) -> tuple[list[Any], list[str]]:
        """``(generations, domains)`` of ``groups`` in the step batch's row order."""
        n = self.cfg.rollout.n
        return [g for _, gs, _ in groups for g in gs], [p.domain for p, _, _ in groups for _ in range(n)]

    def normalize(self, rewards: torch.Tensor, domains: list[str]) -> torch.Tensor:
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

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "normalizer": None if self.normalizer is None else self.normalizer.state_dict(),
            **super().state_dict(),
        }
        if self.domain_normalizers:
            state["domain_normalizers"] = {d: z.state_dict() for d, z in self.domain_normalizers.items()}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        if self.normalizer is not None and state.get("normalizer") is not None:
            self.normalizer.load_state_dict(state["normalizer"])
        for d, z in state.get("domain_normalizers", {}).items():
            self.domain_normalizers.setdefault(d, RunningRewardNormalizer()).load_state_dict(z)
