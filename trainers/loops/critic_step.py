"""A step's critic work inside :class:`~trainers.loops.update.GroupUpdate`: values, GAE, AsyPPO's
masks, the value update.

With ``algorithm.advantage=gae`` (PPO with a learned critic) or ``asyppo`` (AsyPPO's mini-critics)
the group update asks the critic role for the batch's values and trains on::

    V      = critic.values(batch)                        [K, B, T]   (K = 1 for gae)
    r      = token_level_rewards(scores, mask, kl=KL penalty)   the score on the last token,
                                                          - coef * KL_t per token (kl.mode=reward)
    K = 1:  A, R = ADVANTAGE_ESTIMATORS["gae"](token_rewards=r, values=V[0], response_mask)
    K > 1:  A, R, keep_A, keep_H = ADVANTAGE_ESTIMATORS["asyppo"](token_rewards=r,
                                   ensemble_values=V as [B, T, K], response_mask, k, h)
            (GAE over the critics' mean; A masked where they agree most; the entropy bonus
            dropped where they disagree most: the step batch's entropy_keep)
    critic.update(batch, V, R, shards)                   each critic on its shard (AsyPPO), else all

``scores`` are the sequence rewards after the overlong penalty, the reward normalisation and
the clip (the KL penalty enters per token instead of summed into the score). The advantages then
go through the group update's max-length mask, whitening and clip like every estimator's.

Stale samples (the asynchronous trainer) meet the critic as they meet the proximal policy: the
values are computed now, by the current critic, on the tokens as sampled, so the critic's
targets and its clipping are on-critic whatever the policy lag; the policy's side of the lag is
the proximal recompute / correction of the group update (docs/ppo.md).
"""

from __future__ import annotations

from typing import Any

import torch

from rollkit.critics import critic_shards
from rollkit.keys import ENSEMBLE_VALUES, RESPONSE_MASK, RETURNS, TOKEN_REWARDS, VALUES
from rollkit.ops import explained_variance, masked_whiten
from rollkit.registry import ADVANTAGE_ESTIMATORS
from trainers.config import Config
from trainers.engines.step import ENTROPY_KEEP, StepBatch

__all__ = ["CriticStep"]


class CriticStep:
    """One step batch's values, advantages and value update (module docstring); adds
    ``values`` (the ensemble's, ``[B, T]``), ``returns`` and, with AsyPPO, ``entropy_keep`` to
    the batch. The critic role sees the batch's packed view."""

    def __init__(self, cfg: Config, critic: Any, batch: StepBatch, group_ids: torch.Tensor, step: int) -> None:
        self.cfg, self.critic, self.batch, self.group_ids, self.step = cfg, critic, batch, group_ids, step
        self.old_values: torch.Tensor | None = None
        self.returns: torch.Tensor | None = None
        self.shards: torch.Tensor | None = None
        # AsyPPO: [B, T] the tokens whose advantage is kept; reapply after whitening (shape)
        self.advantage_keep: torch.Tensor | None = None

    def advantages(self, rewards: torch.Tensor, metrics: dict[str, float]) -> torch.Tensor:
        """``[B, T]`` advantages of the batch from its per-token ``rewards`` ``[B, T]``
        (:func:`rollkit.rewards.token_level_rewards`; the agentic loop: each turn's reward on its
        last action token); ``critic/*`` (and ``asyppo/*``) into ``metrics``."""
        cfg, b = self.cfg, self.batch
        mask = b[RESPONSE_MASK]
        gamma, lam = (
            float(cfg.algorithm.advantage_kwargs.get(k, d)) for k, d in (("gamma", 1.0), ("lam", 0.95))
        )
        values = self.critic.values(b.view())  # [K, B, T]
        self.old_values = values
        K = values.shape[0]
        inputs = {TOKEN_REWARDS: rewards, RESPONSE_MASK: mask}  # the estimators read them by key
        if K == 1:
            adv, ret = ADVANTAGE_ESTIMATORS.entry("gae").call({**inputs, VALUES: values[0]}, gamma=gamma, lam=lam)
            v = values[0]
            if cfg.critic.whiten_advantages and int(mask.sum()) >= 2:
                adv = masked_whiten(adv, mask)
        else:
            k = cfg.critic
            out = ADVANTAGE_ESTIMATORS.entry("asyppo").call(
                {**inputs, ENSEMBLE_VALUES: values.movedim(0, -1)}, gamma=gamma, lam=lam,
                advantage_mask_frac=k.advantage_mask_frac, entropy_filter_frac=k.entropy_filter_frac,
            )  # fmt: skip
            adv, ret, v = out.advantages, out.returns, out.values
            b[ENTROPY_KEEP], self.advantage_keep = out.entropy_keep, out.advantage_keep
            kept = mask & out.advantage_keep
            if k.whiten_advantages and int(kept.sum()) >= 2:  # over the tokens that keep an advantage
                adv = masked_whiten(adv, kept)
            metrics.update({f"asyppo/{n}": float(x) for n, x in out.metrics.items()})
            self.shards = critic_shards(
                self.group_ids, K, level=cfg.critic.shard_level, seed=cfg.seed * 7919 + self.step
            )
        self.returns = b[RETURNS] = ret
        b[VALUES] = v
        n = mask.sum().clamp(min=1)
        metrics["critic/values_mean"] = float(v[mask].sum() / n)
        metrics["critic/returns_mean"] = float(ret[mask].sum() / n)
        metrics["critic/explained_variance"] = float(explained_variance(v, ret, mask))
        return adv * mask

    def keep(self, adv: torch.Tensor) -> torch.Tensor:
        """``adv`` with AsyPPO's masked tokens at 0 again (after whitening moved them); as is
        for one critic."""
        return adv if self.advantage_keep is None else adv * self.advantage_keep

    def update(self, *, seed: int) -> dict[str, float]:
        """The value update towards this step's returns (after :meth:`advantages`)."""
        if self.old_values is None or self.returns is None:
            raise RuntimeError("CriticStep.update: call advantages() first")
        return self.critic.update(self.batch.view(), self.old_values, self.returns, self.shards, seed=seed)
