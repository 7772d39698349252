"""A rollkit policy loss and advantage estimator inside TRL's ``GRPOTrainer`` (TRL 1.16.0).

:func:`grpo_trainer_class` returns a ``GRPOTrainer`` subclass whose ``_compute_loss`` runs a
rollkit policy loss, and optionally whose advantages come from a rollkit estimator instead of
TRL's group normalisation. It reads the trainer's own ``GRPOConfig`` (``loss_type``,
``epsilon`` / ``epsilon_high`` / ``delta``, ``beta``, ``importance_sampling_level``,
``top_entropy_quantile``, ``off_policy_mask_threshold``, the vLLM importance-sampling ratio,
``scale_rewards``) and refuses what rollkit cannot honour. :func:`trl_loss` is the loss
computation itself, a function of tensors. See ``docs/integrations.md#trl``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from rollkit.integrations import clip_hyper, loss_params, require, uses_behavior
from rollkit.losses import aggregate
from rollkit.losses.kl import kl_k3
from rollkit.registry import ADVANTAGE_ESTIMATORS, POLICY_LOSSES

__all__ = ["TRLLossSetup", "grpo_trainer_class", "trl_advantage_kwargs", "trl_loss", "trl_loss_setup"]

# TRL loss_type -> (rollkit aggregation mode, divided by the accumulation steps)
AGGREGATION = {
    "grpo": "seq-mean-token-mean",
    "bnpo": "token-mean",
    "dr_grpo": "seq-mean-token-sum-norm",
    "dapo": "token-mean",
    "cispo": "token-mean",
    "luspo": "seq-mean-token-sum",
}
SEQUENCE_LOSSES = ("gspo", "gspo-token", "gspo_token")


@dataclass(frozen=True)
class TRLLossSetup:
    """The rollkit side of a ``GRPOConfig``: which loss, its keywords, and TRL's extra terms."""

    name: str
    hyper: dict[str, Any]
    loss_type: str
    beta: float = 0.0
    bias_correction_kl: bool = False
    sequence_level: bool = False
    max_completion_length: int | None = None


def _cispo_hyper(name: str, hyper: dict[str, Any], args: Any) -> dict[str, Any]:
    """TRL's CISPO caps the ratio at the *absolute* value ``epsilon_high``; rollkit's at
    ``1 + clip_high``, with no lower bound: ``clip_high = epsilon_high - 1``."""
    if args.loss_type != "cispo":
        raise ValueError(f"loss_type={args.loss_type!r}: rollkit's 'cispo' needs loss_type='cispo' (its cap)")
    cap = args.epsilon_high if args.epsilon_high is not None else args.epsilon
    if cap < 1.0:
        raise ValueError(
            f"epsilon_high={cap}: with loss_type='cispo' it is the absolute ratio cap, must be >= 1"
        )
    if args.delta is not None:
        raise ValueError(f"delta={args.delta}: CISPO has no two-sided clip")
    out = clip_hyper(
        name, hyper, low=None, high=cap - 1.0, dual=None, settings=("epsilon", "epsilon_high", "delta")
    )
    out["clip_low"] = None
    return out


def trl_loss_setup(args: Any, name: str = "ppo", **hyper: Any) -> TRLLossSetup:
    """Map a TRL ``GRPOConfig`` onto rollkit's policy loss ``name``, refusing what does not map.

    ``epsilon`` / ``epsilon_high`` -> ``clip_low`` / ``clip_high`` (``cispo``: see
    :func:`_cispo_hyper`), ``delta`` -> ``dual_clip``; ``log_ratio_clamp`` defaults to ``None``
    (TRL clamps nothing). ``loss_type`` picks the aggregation (:data:`AGGREGATION`);
    ``importance_sampling_level="sequence"`` requires a sequence-level loss (``gspo``).
    """
    POLICY_LOSSES.get(name)
    if args.loss_type not in AGGREGATION:
        raise ValueError(
            f"loss_type={args.loss_type!r}: TRL's own loss; with a rollkit loss use one of {sorted(AGGREGATION)}"
        )
    if args.loss_type == "cispo" and name != "cispo":
        raise ValueError(
            f"loss_type='cispo' means TRL's CISPO cap; with rollkit's {name!r} use 'dapo' (same aggregation)"
        )
    sequence = args.importance_sampling_level == "sequence"
    if sequence != (name in SEQUENCE_LOSSES):
        raise ValueError(
            f"importance_sampling_level={args.importance_sampling_level!r} does not match rollkit's {name!r} "
            "(use 'sequence' with 'gspo' / 'gspo-token', 'token' otherwise)"
        )
    if uses_behavior(name) and getattr(args, "vllm_importance_sampling_correction", False) and args.use_vllm:
        raise ValueError(
            f"vllm_importance_sampling_correction=True: rollkit's {name!r} corrects for the rollout engine itself"
        )
    if name == "cispo":
        kw = _cispo_hyper(name, hyper, args)
    else:
        high = args.epsilon_high if args.epsilon_high is not None else args.epsilon
        settings = ("epsilon", "epsilon_high", "delta")
        kw = clip_hyper(name, hyper, low=args.epsilon, high=high, dual=args.delta, settings=settings)
    if "log_ratio_clamp" in loss_params(name):
        kw.setdefault("log_ratio_clamp", None)
    return TRLLossSetup(
        name=name,
        hyper=kw,
        loss_type=args.loss_type,
        beta=float(args.beta),
        bias_correction_kl=bool(getattr(args, "use_bias_correction_kl", False)),
        sequence_level=sequence,
        max_completion_length=args.max_completion_length,
    )


def _ratio(setup: TRLLossSetup, logps: Tensor, old: Tensor, mask: Tensor) -> Tensor:
    """TRL's ``coef_1``: the token ratio ``[B, T]``, or the sequence ratio ``[B, 1]``."""
    log_ratio = logps - old
    if setup.sequence_level:
        m = mask.to(log_ratio.dtype)
        return ((log_ratio * m).sum(-1) / m.sum(-1).clamp(min=1.0)).exp().unsqueeze(-1)
    return log_ratio.exp()


@torch.no_grad()
def _clip_metrics(setup: TRLLossSetup, ratio: Tensor, adv: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """TRL's clip metrics, as TRL defines them (``ratio`` is TRL's ``coef_1``)."""
    adv = adv.unsqueeze(1) if adv.dim() == 1 else adv
    if ratio.shape[1] == 1:  # sequence level: one value per sequence
        mask = torch.ones_like(ratio)

    def mean(flags: Tensor) -> Tensor:
        return (flags * mask).sum() / mask.sum().clamp(min=1.0)

    hyper = setup.hyper
    if setup.name == "cispo":
        return {"cispo_clip_ratio": mean(((ratio > 1.0 + hyper["clip_high"]) & (adv > 0)).float())}
    if "clip_low" not in hyper:
        return {}
    low = (ratio < 1.0 - hyper["clip_low"]) & (adv < 0)
    high = (ratio > 1.0 + hyper["clip_high"]) & (adv > 0)
    return {
        "clip_ratio/low_mean": mean(low.float()),
        "clip_ratio/high_mean": mean(high.float()),
        "clip_ratio/region_mean": mean((low | high).float()),
    }


def _normaliser(setup: TRLLossSetup, inputs: dict, mask: Tensor, window: dict[str, int]) -> dict[str, Any]:
    """``aggregate``'s keywords reproducing TRL's normaliser of ``loss_type`` (accumulation included)."""
    accum = window["grad_accum_steps"]
    if setup.loss_type in ("dapo", "cispo"):
        n = inputs["num_items_in_batch"].clamp(min=1.0) / window["num_processes"]
        return {"num_tokens": n * accum / window["steps_per_generation"]}
    if setup.loss_type == "bnpo":
        return {"num_tokens": mask.sum().clamp(min=1.0) * accum}
    out: dict[str, Any] = {"num_seqs": mask.shape[0] * accum}
    if setup.loss_type == "dr_grpo":
        out["norm_length"] = setup.max_completion_length
    return out


def trl_loss(
    setup: TRLLossSetup,
    per_token_logps: Tensor,
    inputs: dict[str, Any],
    mask: Tensor,
    *,
    entropy_mask: Tensor | None = None,
    off_policy_mask: Tensor | None = None,
    grad_accum_steps: int = 1,
    steps_per_generation: int = 1,
    num_processes: int = 1,
) -> tuple[Tensor, dict[str, Tensor]]:
    """TRL's GRPO loss with rollkit's policy loss: ``(loss, metrics)``.

    In TRL's order: the rollkit per-token loss, times the off-policy mask, the entropy mask and
    TRL's vLLM importance-sampling ratio (``inputs["importance_sampling_ratio"]``, when present),
    plus ``beta`` times the k3 KL to ``inputs["ref_per_token_logps"]`` (times the ratio with
    ``use_bias_correction_kl``); then ``loss_type``'s aggregation over ``mask``. In evaluation
    pass ``grad_accum_steps = steps_per_generation = 1``. ``metrics`` carry TRL's names.
    """
    old = inputs.get("old_per_token_logps")
    old = per_token_logps.detach() if old is None else old
    bool_mask = mask.bool()
    extra = ()
    if uses_behavior(setup.name):
        if inputs.get("sampling_per_token_logps") is None:
            raise ValueError(
                f"sampling_per_token_logps: rollkit's {setup.name!r} needs the vLLM log-probs (use_vllm=True)"
            )
        extra = (inputs["sampling_per_token_logps"],)
    adv = inputs["advantages"]
    out = POLICY_LOSSES.get(setup.name)(per_token_logps, old, adv, bool_mask, *extra, **setup.hyper)
    per_token = out.loss
    for factor in (off_policy_mask, entropy_mask, inputs.get("importance_sampling_ratio")):
        if factor is not None:
            per_token = per_token * factor
    metrics = {f"rollkit/{k}": v for k, v in out.metrics.items()}
    metrics.update(_clip_metrics(setup, _ratio(setup, per_token_logps.detach(), old, mask), adv, mask))
    if setup.beta != 0.0:
        kl = kl_k3(per_token_logps, inputs["ref_per_token_logps"], clamp=None)
        if setup.bias_correction_kl:
            kl = kl * _ratio(setup, per_token_logps, old, mask)
        per_token = per_token + setup.beta * kl
        with torch.no_grad():
            metrics["kl"] = (kl * mask).sum() / mask.sum().clamp(min=1.0)
    window = {"grad_accum_steps": grad_accum_steps, "steps_per_generation": steps_per_generation}
    window["num_processes"] = num_processes
    mode = AGGREGATION[setup.loss_type]
    loss = aggregate(per_token, bool_mask, mode, **_normaliser(setup, inputs, mask, window))
    return loss, metrics


def trl_advantage_kwargs(args: Any, name: str, **kwargs: Any) -> dict[str, Any]:
    """The keywords of rollkit estimator ``name`` under a ``GRPOConfig``: for ``"grpo"``,
    ``scale_rewards`` ("group" / "batch" / "none") is ``std_level`` and ``eps`` is TRL's 1e-4;
    other estimators need ``scale_rewards="none"`` (they do their own scaling)."""
    ADVANTAGE_ESTIMATORS.get(name)
    if getattr(args, "multi_objective_aggregation", "sum_then_normalize") != "sum_then_normalize":
        raise ValueError("multi_objective_aggregation: a rollkit estimator needs 'sum_then_normalize'")
    if name != "grpo":
        if args.scale_rewards != "none":
            raise ValueError(
                f"scale_rewards={args.scale_rewards!r}: rollkit's {name!r} scales itself, set 'none'"
            )
        return dict(kwargs)
    if "std_level" in kwargs:
        raise ValueError("std_level: set GRPOConfig.scale_rewards instead")
    levels = {"group": "group", "batch": "batch", "none": None}
    if args.scale_rewards not in levels:
        raise ValueError(f"scale_rewards={args.scale_rewards!r}: not one of {sorted(levels)}")
    return {"eps": 1e-4, **kwargs, "std_level": levels[args.scale_rewards]}


def _refuse_unsupported(trainer: Any) -> None:
    if getattr(trainer, "_entropy_bonus_enabled", False):
        raise ValueError("entropy_coef: TRL's entropy bonus is not added by the rollkit loss; set it to 0")
    if getattr(trainer, "aux_loss_enabled", False):
        raise ValueError(
            "output_router_logits: the MoE router auxiliary loss is not added by the rollkit loss"
        )


class _RollkitGRPOMixin:
    """The methods :func:`grpo_trainer_class` puts before ``GRPOTrainer``'s."""

    rollkit_policy_loss: str = "ppo"
    rollkit_hyper: ClassVar[dict[str, Any]] = {}
    rollkit_advantage: str | None = None
    rollkit_advantage_kwargs: ClassVar[dict[str, Any]] = {}

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _refuse_unsupported(self)
        self._rollkit = trl_loss_setup(self.args, self.rollkit_policy_loss, **self.rollkit_hyper)
        self._rollkit_adv_kw = None
        if self.rollkit_advantage is not None:
            self._rollkit_adv_kw = trl_advantage_kwargs(
                self.args, self.rollkit_advantage, **self.rollkit_advantage_kwargs
            )
        self._rollkit_rewards = None

    def _rollkit_masks(self, inputs: dict, logps: Tensor, entropies: Tensor, mask: Tensor) -> tuple:
        entropy_mask = off_policy_mask = None
        if self.top_entropy_quantile < 1.0:
            entropy_mask = self.get_high_entropy_mask(entropies, mask, 1 - self.top_entropy_quantile)
        if self.off_policy_mask_threshold is not None:
            old = inputs.get("old_per_token_logps")
            old = logps.detach() if old is None else old
            adv = inputs["advantages"]
            off_policy_mask = self.get_off_policy_mask(
                advantages=adv.unsqueeze(1) if adv.dim() == 1 else adv,
                per_token_logps=logps,
                sampling_per_token_logps=inputs.get("sampling_per_token_logps", old),
                mask=mask,
                off_policy_threshold=self.off_policy_mask_threshold,
            )
        return entropy_mask, off_policy_mask

    def _compute_loss(self, model: Any, inputs: dict[str, Any]) -> Tensor:
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        input_ids = torch.cat([inputs["prompt_ids"], completion_ids], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], completion_mask], dim=1)
        mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
        logps, entropies, _ = self._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, completion_ids.size(1), compute_entropy=True
        )
        entropy_mask, off_policy_mask = self._rollkit_masks(inputs, logps, entropies, mask)
        train = self.model.training
        loss, metrics = trl_loss(
            self._rollkit,
            logps,
            inputs,
            mask,
            entropy_mask=entropy_mask,
            off_policy_mask=off_policy_mask,
            grad_accum_steps=self.current_gradient_accumulation_steps if train else 1,
            steps_per_generation=self.args.steps_per_generation if train else 1,
            num_processes=self.accelerator.num_processes,
        )
        with torch.no_grad():
            metrics["entropy"] = (entropies * mask).sum() / mask.sum().clamp(min=1.0)
        log = self._metrics["train" if train else "eval"]
        for k, v in metrics.items():
            log[k].append(self.accelerator.gather(v.detach().reshape(1)).mean().item())
        return loss

    def _calculate_rewards(
        self, inputs: Any, prompts: Any, completions: Any, completion_ids_list: Any
    ) -> Tensor:
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self._rollkit_rewards = rewards_per_func
        return rewards_per_func

    def _generate_and_score_completions(self, inputs: Any) -> dict[str, Any]:
        out = super()._generate_and_score_completions(inputs)
        if self._rollkit_adv_kw is None:
            return out
        per_func = self._rollkit_rewards
        if torch.isnan(per_func).all(dim=1).any():
            raise ValueError(
                "rewards: a completion got None from every reward function; rollkit estimators need a reward"
            )
        rewards = (per_func * self.reward_weights.to(per_func.device).unsqueeze(0)).nansum(dim=1)
        group = self.num_generations if self.model.training else self.num_generations_eval
        group_ids = torch.arange(rewards.numel(), device=rewards.device) // group
        adv = ADVANTAGE_ESTIMATORS.get(self.rollkit_advantage)(rewards, group_ids, **self._rollkit_adv_kw)
        local = out["advantages"]
        start = self.accelerator.process_index * local.shape[0]
        out["advantages"] = adv[start : start + local.shape[0]].to(local.dtype)
        logged = self._logs["advantages"]
        for _ in range(min(adv.numel(), len(logged))):
            logged.pop()
        logged.extend(adv.tolist())
        return out


def grpo_trainer_class(
    policy_loss: str = "ppo",
    *,
    advantage: str | None = None,
    advantage_kwargs: dict[str, Any] | None = None,
    base: type | None = None,
    **hyper: Any,
) -> type:
    """A subclass of TRL's ``GRPOTrainer`` (or of ``base``, a subclass of it) with rollkit inside.

    ``policy_loss``: a rollkit policy loss name; ``hyper``: its keywords other than the clip
    range (which comes from ``GRPOConfig``). ``advantage``: a rollkit outcome estimator name
    replacing TRL's group normalisation (``advantage_kwargs``: its keywords; see
    :func:`trl_advantage_kwargs`). The settings are checked when the trainer is built::

        Trainer = grpo_trainer_class("ppo", advantage="rloo")
        trainer = Trainer(model=..., reward_funcs=..., args=GRPOConfig(..., scale_rewards="none"))
    """
    if base is None:
        base = require("trl").GRPOTrainer
    POLICY_LOSSES.get(policy_loss)
    if advantage is not None:
        ADVANTAGE_ESTIMATORS.get(advantage)
    attrs = {
        "rollkit_policy_loss": policy_loss,
        "rollkit_hyper": dict(hyper),
        "rollkit_advantage": advantage,
        "rollkit_advantage_kwargs": dict(advantage_kwargs or {}),
    }
    return type(f"Rollkit{base.__name__}", (_RollkitGRPOMixin, base), attrs)
