"""A drop-in for OpenRLHF's ``PolicyLoss`` (OpenRLHF 0.11.2) running a rollkit policy loss.

:class:`RollkitPolicyLoss` takes OpenRLHF's constructor settings and ``forward`` signature
and returns its five outputs; :meth:`RollkitPolicyLoss.from_openrlhf` copies the settings of
the ``PolicyLoss`` that ``ActorPPOTrainer`` built. No OpenRLHF import is needed. See
``docs/integrations.md#openrlhf``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from rollkit.integrations import clip_hyper, uses_behavior
from rollkit.losses import aggregate
from rollkit.registry import POLICY_LOSSES

__all__ = ["RollkitPolicyLoss"]

_SETTINGS = ("clip_eps_low", "clip_eps_high", "dual_clip")
_DEFAULT_LOSS = {"ppo": "ppo", "gspo": "gspo"}


class RollkitPolicyLoss(torch.nn.Module):
    """OpenRLHF's ``PolicyLoss`` with a rollkit loss: same settings, forward and outputs.

    ``name`` is the rollkit loss (default: ``policy_loss_type``'s, ``"ppo"`` or ``"gspo"``);
    ``clip_eps_low`` / ``clip_eps_high`` / ``dual_clip`` become its clip keywords,
    ``token_level_loss`` picks ``token-mean`` or ``seq-mean-token-mean`` (forced for GSPO, as
    OpenRLHF does), ``hyper`` holds the other rollkit keywords. OpenRLHF's train/rollout
    correction (``is_correction_level`` other than ``"off"``) is refused.

    ``forward`` returns ``(loss, clip_ratio, ppo_kl, vllm_kl, is_filter_ratio)``: ``ppo_kl`` is
    OpenRLHF's k1 ``mean(old - new)``, the last two are ``None`` (no correction).
    """

    def __init__(
        self,
        clip_eps_low: float = 0.2,
        clip_eps_high: float = 0.2,
        dual_clip: float | None = None,
        token_level_loss: bool = True,
        policy_loss_type: str = "ppo",
        is_correction_level: str = "off",
        *,
        name: str | None = None,
        **hyper: Any,
    ) -> None:
        super().__init__()
        if policy_loss_type not in _DEFAULT_LOSS:
            raise ValueError(f"policy_loss_type: {policy_loss_type!r} is not one of {sorted(_DEFAULT_LOSS)}")
        if is_correction_level != "off":
            raise ValueError(
                f"is_correction_level={is_correction_level!r}: OpenRLHF's train/rollout correction is not "
                "mapped; use 'off' with a rollkit off-policy loss ('tis', 'decoupled-ppo')"
            )
        self.name = name or _DEFAULT_LOSS[policy_loss_type]
        self.hyper = clip_hyper(
            self.name, hyper, low=clip_eps_low, high=clip_eps_high, dual=dual_clip, settings=_SETTINGS
        )
        self.mode = "token-mean" if token_level_loss and policy_loss_type != "gspo" else "seq-mean-token-mean"
        self.uses_behavior = uses_behavior(self.name)

    @classmethod
    def from_openrlhf(cls, policy_loss: Any, name: str | None = None, **hyper: Any) -> RollkitPolicyLoss:
        """The settings of an ``openrlhf.models.loss.PolicyLoss`` with rollkit's loss ``name``."""
        return cls(
            policy_loss.clip_eps_low,
            policy_loss.clip_eps_high,
            policy_loss.dual_clip,
            policy_loss.token_level_loss,
            policy_loss.policy_loss_type,
            policy_loss.is_correction_level,
            name=name,
            **hyper,
        )

    def forward(
        self,
        log_probs: Tensor,
        old_log_probs: Tensor,
        advantages: Tensor,
        action_mask: Tensor | None = None,
        rollout_log_probs: Tensor | None = None,
        dp_size: int = 1,
        batch_num_tokens: float | None = None,
        global_batch_size: float | None = None,
    ) -> tuple[Tensor, Tensor, Tensor, None, None]:
        mask = torch.ones_like(log_probs, dtype=torch.bool) if action_mask is None else action_mask.bool()
        extra = ()
        if self.uses_behavior:
            if rollout_log_probs is None:
                raise ValueError(
                    f"rollout_log_probs: rollkit's {self.name!r} needs them (OpenRLHF passes them with vLLM)"
                )
            extra = (rollout_log_probs,)
        out = POLICY_LOSSES.get(self.name)(log_probs, old_log_probs, advantages, mask, *extra, **self.hyper)
        loss = aggregate(
            out.loss,
            mask,
            self.mode,
            num_tokens=batch_num_tokens,
            num_seqs=global_batch_size,
            dp_size=dp_size,
        )
        with torch.no_grad():
            ppo_kl = (old_log_probs - log_probs).masked_fill(~mask, 0.0).sum() / mask.sum().clamp(min=1)
        clip_ratio = out.metrics.get("clip_frac", torch.zeros((), device=loss.device))
        return loss, clip_ratio, ppo_kl, None, None
