"""rollkit policy losses and advantage estimators in verl's registries (verl 0.9.1).

:func:`register_policy_loss` puts a rollkit policy loss into verl's ``POLICY_LOSS_REGISTRY``
(picked with ``actor_rollout_ref.actor.policy_loss.loss_mode``) and :func:`register_advantage`
a rollkit estimator into ``ADV_ESTIMATOR_REGISTRY`` (``algorithm.adv_estimator``). The
functions read verl's own settings: ``clip_ratio`` / ``clip_ratio_low`` / ``clip_ratio_high``
/ ``clip_ratio_c``, ``loss_agg_mode``, ``global_batch_info`` (read, never written) and
``norm_adv_by_std_in_grpo``, and report verl's metric names. :func:`verl_policy_loss` and
:func:`verl_advantage` build the same functions without registering them (no verl needed).
See ``docs/integrations.md#verl``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from rollkit.integrations import clip_hyper, require, uses_behavior
from rollkit.losses import aggregate
from rollkit.registry import ADVANTAGE_ESTIMATORS, POLICY_LOSSES

__all__ = ["register_advantage", "register_policy_loss", "verl_advantage", "verl_policy_loss"]

AGG_MODES = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)
_SETTINGS = ("clip_ratio_low", "clip_ratio_high", "clip_ratio_c")


def _setting(config: Any, name: str, default: Any = None) -> Any:
    value = getattr(config, name, None) if config is not None else None
    return default if value is None else value


def _verl_clip(name: str, hyper: dict[str, Any], config: Any) -> dict[str, Any]:
    """verl's clip settings as rollkit keywords: clip_ratio_low / _high (default clip_ratio),
    and clip_ratio_c as the dual clip of the losses that have one (verl's vanilla always uses it)."""
    ratio = _setting(config, "clip_ratio", 0.2)
    low = _setting(config, "clip_ratio_low", ratio)
    high = _setting(config, "clip_ratio_high", ratio)
    dual = (
        _setting(config, "clip_ratio_c", 3.0)
        if name in ("ppo", "ppo-clip", "grpo", "decoupled-ppo")
        else None
    )
    return clip_hyper(name, hyper, low=low, high=high, dual=dual, settings=_SETTINGS)


def _metrics(out_metrics: dict[str, Tensor], log_prob: Tensor, old_log_prob: Tensor, mask: Tensor) -> dict:
    """verl's names: pg_clipfrac, ppo_kl (k1, mean of old - new), pg_clipfrac_lower (dual clip)."""
    with torch.no_grad():
        diff = (old_log_prob - log_prob).masked_fill(~mask, 0.0)
        ppo_kl = diff.sum() / mask.sum().clamp(min=1)
    metrics = {
        "actor/pg_clipfrac": float(out_metrics.get("clip_frac", torch.zeros(()))),
        "actor/ppo_kl": float(ppo_kl),
        "actor/pg_clipfrac_lower": float(out_metrics.get("dual_clip_frac", torch.zeros(()))),
    }
    metrics.update({f"actor/rollkit/{k}": float(v) for k, v in out_metrics.items()})
    return metrics


def verl_policy_loss(name: str = "ppo", **hyper: Any) -> Callable[..., tuple[Tensor, dict[str, float]]]:
    """A verl ``PolicyLossFn`` running rollkit's policy loss ``name``.

    The clip range comes from verl's actor config at each call (``clip_ratio_low`` /
    ``clip_ratio_high``, ``clip_ratio_c`` as ``dual_clip`` for the PPO family); ``hyper`` holds
    the other rollkit keywords. Aggregation is ``loss_agg_mode`` with the global normalisers of
    ``config.global_batch_info`` (``dp_size``, ``batch_num_tokens``, ``global_batch_size``,
    ``loss_scale_factor``); ``rollout_is_weights`` multiply the per-token loss, as in verl.
    Returns ``(pg_loss, metrics)`` with verl's metric names (floats) plus ``actor/rollkit/*``.
    """
    POLICY_LOSSES.get(name)  # unknown names fail here, not in the first step
    if uses_behavior(name):
        raise ValueError(
            f"{name!r} needs the rollout log-probs, which verl 0.9.1's ppo_loss does not pass: "
            "use verl's rollout correction (rollout_is_weights) with 'ppo' or 'cispo'"
        )
    _verl_clip(name, hyper, None)  # a clip keyword in hyper fails here

    def compute_policy_loss(
        old_log_prob: Tensor,
        log_prob: Tensor,
        advantages: Tensor,
        response_mask: Tensor,
        loss_agg_mode: str = "token-mean",
        config: Any = None,
        rollout_is_weights: Tensor | None = None,
    ) -> tuple[Tensor, dict[str, float]]:
        if loss_agg_mode not in AGG_MODES:
            raise ValueError(f"loss_agg_mode: {loss_agg_mode!r} is not one of {AGG_MODES}")
        mask = response_mask.bool()
        out = POLICY_LOSSES.get(name)(
            log_prob, old_log_prob, advantages, mask, **_verl_clip(name, hyper, config)
        )
        loss = out.loss if rollout_is_weights is None else out.loss * rollout_is_weights.detach()
        info = dict(_setting(config, "global_batch_info", {}))  # a copy: verl's config is never written
        pg_loss = aggregate(
            loss,
            mask,
            loss_agg_mode,
            num_tokens=info.get("batch_num_tokens"),
            num_seqs=info.get("global_batch_size"),
            norm_length=info.get("loss_scale_factor"),
            dp_size=int(info.get("dp_size") or 1),
        )
        return pg_loss, _metrics(out.metrics, log_prob, old_log_prob, mask)

    compute_policy_loss.__name__ = f"rollkit_{name}"
    return compute_policy_loss


def _group_ids(index: Any, n: int) -> Tensor:
    """verl's ``uid`` array (any hashable ids) as dense group ids ``[B]``."""
    if index is None:
        raise ValueError(
            "index: a rollkit group estimator needs verl's uid array (data.non_tensor_batch['uid'])"
        )
    seen: dict[Any, int] = {}
    ids = [seen.setdefault(u, len(seen)) for u in list(index)]
    if len(ids) != n:
        raise ValueError(f"index: {len(ids)} ids for {n} responses")
    return torch.tensor(ids)


def verl_advantage(name: str = "grpo", **kwargs: Any) -> Callable[..., tuple[Tensor, Tensor]]:
    """A verl advantage estimator running rollkit's outcome estimator ``name``.

    Called as verl's ``compute_advantage`` calls registered estimators (``token_level_rewards``,
    ``response_mask``, ``index`` = the ``uid`` array, ``config`` = the algorithm config). For
    ``"grpo"``, ``norm_adv_by_std_in_grpo`` (keyword, else ``config.norm_adv_by_std_in_grpo``)
    selects the std scaling and ``epsilon`` (default 1e-6, verl's) is rollkit's ``eps``.
    Returns ``(advantages, returns)``, both ``[B, T]`` (the sequence advantage on every valid token).
    """
    ADVANTAGE_ESTIMATORS.get(name)
    if name == "grpo" and {"std_level", "eps"} & set(kwargs):
        raise ValueError("std_level / eps: set verl's algorithm.norm_adv_by_std_in_grpo instead")

    def compute_advantage(
        token_level_rewards: Tensor,
        response_mask: Tensor,
        index: Any = None,
        epsilon: float = 1e-6,
        norm_adv_by_std_in_grpo: bool | None = None,
        config: Any = None,
        **_: Any,
    ) -> tuple[Tensor, Tensor]:
        scores = token_level_rewards.sum(-1)
        groups = _group_ids(index, scores.shape[0]).to(scores.device)
        kw = dict(kwargs)
        if name == "grpo":
            norm = norm_adv_by_std_in_grpo
            norm = _setting(config, "norm_adv_by_std_in_grpo", True) if norm is None else norm
            kw.update(eps=epsilon, std_level="group" if norm else None)
        with torch.no_grad():
            adv = ADVANTAGE_ESTIMATORS.get(name)(scores, groups, **kw)
        adv = adv.to(scores.dtype)[:, None] * response_mask
        return adv, adv

    compute_advantage.__name__ = f"rollkit_{name}"
    return compute_advantage


def register_policy_loss(verl_name: str, name: str = "ppo", **hyper: Any) -> Callable[..., Any]:
    """Register :func:`verl_policy_loss` ``(name, **hyper)`` in verl under ``verl_name``."""
    core = require("verl.trainer.ppo.core_algos")
    return core.register_policy_loss(verl_name)(verl_policy_loss(name, **hyper))


def register_advantage(verl_name: str, name: str = "grpo", **kwargs: Any) -> Callable[..., Any]:
    """Register :func:`verl_advantage` ``(name, **kwargs)`` in verl under ``verl_name``."""
    core = require("verl.trainer.ppo.core_algos")
    return core.register_adv_est(verl_name)(verl_advantage(name, **kwargs))
