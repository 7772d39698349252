"""Policy losses: the PPO family and off-policy objectives, as per-token loss matrices.

Every loss here has the same contract::

    name(logprobs [B, T], old_logprobs [B, T], advantages [B, T] or [B], mask [B, T] bool,
         [behavior_logprobs [B, T],] *, <keyword-only scalar hyper-parameters>) -> LossOutput

* ``logprobs`` carries the gradient; ``old_logprobs``, ``behavior_logprobs`` and ``advantages``
  are treated as constants (never differentiated, whether or not they require grad).
* Validation reads metadata only (shapes, dtypes, devices, hyper-parameters): no value checks,
  so no device synchronisation, and the losses run on the ``meta`` device (shape inference).
  Non-finite values at *valid* positions propagate instead of being checked: a NaN advantage
  or a NaN / ``+-inf`` log-prob (``logprobs``, ``old_logprobs``, ``behavior_logprobs``) makes
  the loss (and its gradient, and the ratio metrics) NaN at that token. No clamp, clip,
  threshold or mask decision turns such a value into a finite number (see
  ``log_ratio_clamp`` below): a ``-inf`` log-prob, a token the policy cannot produce, is
  as much a sign of a mismatch as a NaN. Check ``torch.isfinite`` of the aggregated loss
  where a silent NaN would hurt.
* Every tensor argument must be on the device of ``logprobs`` (``ValueError`` naming it).
* ``advantages`` of shape ``[B]`` are broadcast over the tokens of each row.
* ``LossOutput.loss`` is ``[B, T]``, exactly ``0`` where ``mask`` is False (values under the
  mask may be anything, in any input, NaN and ``+-inf`` padding included: they never reach the
  loss, the metrics or the gradient).
  Turn it into a scalar with ``rollkit.losses.aggregate(loss, mask, mode)``; the docstring of
  each loss says which aggregation mode reproduces its paper.
* ``LossOutput.metrics`` are detached 0-dim tensors computed over the masked tokens (no
  ``.item()``, no device synchronisation). Over an empty mask, fractions and means are ``0``
  and ``ratio_min`` / ``ratio_max`` / ``ratio_mean`` are ``1``.
* Half-precision inputs (``bfloat16`` / ``float16``) are upcast to ``float32`` inside the loss,
  and the loss is returned in ``float32``: the result equals the ``float32`` computation on the
  same (rounded) input values to float32 round-off (tested to ``1e-6`` relative). The only
  half-precision error is the rounding of the inputs themselves.
* Log-ratios are clamped from above at ``log_ratio_clamp`` (default ``20``; verl clamps to
  ``[-20, 20]``) before ``exp``, so that any finite input gives a finite loss and a finite
  gradient (the gradient is zero beyond the clamp). No lower clamp is needed: ``exp`` of a
  very negative log-ratio underflows harmlessly to 0. ``log_ratio_clamp=None`` turns the
  clamp off (then ``exp`` may overflow for log-ratios above ~88 in float32). The clamp only
  applies to finite log-ratios: a non-finite one (from a NaN / ``+-inf`` log-prob at a valid
  token) becomes NaN, not ``log_ratio_clamp``.

``approx_kl`` is always the k3 estimator of KL(pi_old || pi_theta) over the sampled tokens,
``mean((r - 1) - log r)`` with ``r = pi_theta / pi_old`` (Schulman 2020, "Approximating KL
divergence"): non-negative, unbiased under samples from ``pi_old``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from rollkit.keys import (
    ADVANTAGES,
    BEHAVIOR_LOGPROBS,
    IS_METRICS,
    IS_WEIGHTS,
    LOGPROBS,
    LOSS,
    OLD_LOGPROBS,
    RESPONSE_MASK,
)
from rollkit.losses._common import (
    check_seq_or_token,
    check_token_tensors,
    compute_dtype,
    zero_outside,
)
from rollkit.registry import IS_CORRECTIONS, POLICY_LOSSES
from rollkit.types import LossOutput
from rollkit.validation import (
    check_choice,
    check_float,
    check_in_range,
    check_positive,
    check_real,
    check_same_device,
    check_same_shape,
    check_scalar,
)

__all__ = [
    "cispo",
    "decoupled_ppo",
    "gmpo",
    "gpg",
    "gspo",
    "gspo_token",
    "importance_weights",
    "ppo_clip",
    "raft_pp",
    "sapo",
    "tis",
    "topr",
    "vanilla_pg",
]

_IN_KEYS = {
    "logprobs": LOGPROBS,
    "old_logprobs": OLD_LOGPROBS,
    "advantages": ADVANTAGES,
    "mask": RESPONSE_MASK,
}
_IN_KEYS_OFF = {**_IN_KEYS, "behavior_logprobs": BEHAVIOR_LOGPROBS}
# ppo_clip's optional keyword tensor: read from the batch when the key is present
_IN_KEYS_PPO = {**_IN_KEYS, "is_weights": IS_WEIGHTS}
_OUT_KEYS = (LOSS,)

# --------------------------------------------------------------------------- private helpers


def _check_inputs(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    behavior_logprobs: Tensor | None = None,
) -> None:
    extra = {} if behavior_logprobs is None else {"behavior_logprobs": behavior_logprobs}
    check_token_tensors(mask, logprobs=logprobs, old_logprobs=old_logprobs, **extra)
    check_float("advantages", advantages)
    check_seq_or_token("advantages", advantages, "logprobs", logprobs)
    check_same_device("advantages", advantages, "logprobs", logprobs)


def _check_clip(clip_low: float, clip_high: float) -> None:
    check_in_range("clip_low", clip_low, 0.0, 1.0)
    check_positive("clip_high", clip_high, allow_zero=True)


def _check_clamp(log_ratio_clamp: float | None) -> None:
    if log_ratio_clamp is not None:
        check_positive("log_ratio_clamp", log_ratio_clamp)


def _token_adv(advantages: Tensor, dtype: torch.dtype, mask: Tensor) -> Tensor:
    """``[B, T]`` or ``[B, 1]`` (broadcastable) advantages in the compute dtype, detached;
    ``[B, T]`` advantages are zeroed outside ``mask`` (so NaN / inf padding never propagates)."""
    adv = advantages.detach().to(dtype)
    return adv.unsqueeze(-1) if adv.ndim == 1 else zero_outside(adv, mask)


def _seq_adv(advantages: Tensor, mask: Tensor, lengths: Tensor, dtype: torch.dtype) -> Tensor:
    """``[B]`` sequence advantages: as given, or the masked mean over the row's tokens."""
    adv = advantages.detach().to(dtype)
    if adv.ndim == 1:
        return adv
    zero = torch.zeros((), dtype=dtype, device=adv.device)
    return torch.where(mask, adv, zero).sum(-1) / lengths.clamp(min=1)


def _log_ratio(lp: Tensor, base: Tensor, mask: Tensor, log_ratio_clamp: float | None) -> Tensor:
    """``where(mask, lp - base, 0)``, clamped from above; ``base`` is detached. 0 outside the
    mask; NaN (in value and gradient) where a valid token's log-ratio is not finite."""
    raw = torch.where(mask, lp - base.detach(), torch.zeros((), dtype=lp.dtype, device=lp.device))
    # ``raw - raw`` is 0 where raw is finite and NaN where it is +-inf / NaN: neither the clamp
    # below nor a later clip / threshold can turn a non-finite log-ratio into a finite number
    lr = raw + (raw - raw)
    if log_ratio_clamp is not None:
        lr = lr.clamp(max=log_ratio_clamp)  # one-sided: cheaper, and exp(-big) cannot overflow
    return lr


def _token_log_ratio(
    logprobs: Tensor, old_logprobs: Tensor, mask: Tensor, log_ratio_clamp: float | None
) -> tuple[torch.dtype, Tensor]:
    """Check ``log_ratio_clamp``; return the compute dtype and the clamped log-ratio of
    ``logprobs`` to (detached) ``old_logprobs``, 0 outside the mask."""
    _check_clamp(log_ratio_clamp)
    dtype = compute_dtype(logprobs)
    return dtype, _log_ratio(logprobs.to(dtype), old_logprobs.to(dtype), mask, log_ratio_clamp)


def _clip_fracs(f_low: Tensor, f_high: Tensor) -> dict[str, Tensor]:
    """``clip_frac`` (= low + high), ``clip_frac_low`` and ``clip_frac_high`` metrics."""
    return {"clip_frac": f_low + f_high, "clip_frac_low": f_low, "clip_frac_high": f_high}


def _frac(flags: Tensor, count: Tensor) -> Tensor:
    return torch.count_nonzero(flags).to(count.dtype) / count


def _counts(mask: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``(max(n, 1) as dtype, n)`` with ``n`` the number of valid tokens."""
    n = torch.count_nonzero(mask)
    return n.clamp(min=1).to(dtype), n


def _ratio_metrics(lr: Tensor, mask: Tensor, n: Tensor) -> dict[str, Tensor]:
    """Ratio statistics and k3 approx-KL (call under ``no_grad``).

    ``lr`` must be 0 outside the mask, so that ``expm1(lr)`` and ``expm1(lr) - lr`` are 0
    there: the sums over the whole tensor are the sums over the mask. Near on-policy
    (``lr ~ 0``) these small terms are summed directly, instead of ``sum(r) - numel - sum(lr)``,
    whose float32 sums cancel catastrophically on large batches.
    """
    cnt = n.clamp(min=1).to(lr.dtype)
    d = torch.expm1(lr)  # r - 1, accurate near r = 1
    sum_d = d.sum()
    mean_lr = lr.sum() / cnt
    # the mean lies between the extremes, so filling the padding with it leaves min/max intact
    if lr.numel():
        lo, hi = torch.aminmax(torch.where(mask, lr, mean_lr))
    else:  # an empty batch ([0, T] or [B, 0]): the documented empty-mask values
        lo = hi = torch.zeros((), dtype=lr.dtype, device=lr.device)
    return {
        "ratio_mean": 1.0 + sum_d / cnt,  # 1 over an empty mask (sum_d == 0)
        "ratio_max": hi.exp(),  # exp(0) = 1 over an empty mask
        "ratio_min": lo.exp(),
        "approx_kl": ((d - lr).sum() / cnt).clamp(min=0),  # k3 >= 0
    }


def _count_by_sign(flags: Tensor, adv: Tensor) -> tuple[Tensor, Tensor]:
    """Numbers of ``flags`` (False outside the mask) where ``adv < 0`` and where ``adv > 0``.

    With per-sequence advantages (``adv`` of shape ``[B, 1]``) the flags are summed per row
    first, so the sign split costs ``[B]`` work instead of two more ``[B, T]`` passes.
    """
    if adv.shape[-1] == 1 and flags.shape[-1] != 1:
        per_row = torch.count_nonzero(flags, dim=-1)
        a = adv.squeeze(-1)
        return (per_row * (a < 0)).sum(), (per_row * (a > 0)).sum()
    return torch.count_nonzero(flags & (adv < 0)), torch.count_nonzero(flags & (adv > 0))


def _clipped_loss(
    ratio: Tensor, adv: Tensor, clip_low: float, clip_high: float, dual_clip: float | None
) -> tuple[Tensor, Tensor, Tensor | None]:
    """PPO's pessimistic surrogate ``max(-A r, -A clip(r))`` (+ dual clip where A < 0).

    Returns ``(loss, clipped, dual)``: ``clipped`` marks where the clipped branch is strictly
    larger (the gradient is zero), ``dual`` where the dual clip is active (or None). Both are
    False wherever ``ratio == 1`` or ``A == 0`` (so outside the mask).
    """
    surr = -adv * ratio
    surr_clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(surr, surr_clipped)
    clipped = surr_clipped > surr
    dual = None
    if dual_clip is not None:
        bound = -adv * dual_clip
        dual = (adv < 0) & (loss > bound)
        loss = torch.where(dual, bound, loss)
    return loss, clipped, dual


def _clip_metrics(
    clipped: Tensor, adv: Tensor, count: Tensor, dual: Tensor | None = None
) -> dict[str, Tensor]:
    """Fractions of valid tokens where the clip (or the dual clip) zeroes the gradient."""
    low, high = _count_by_sign(clipped, adv)
    f_low, f_high = low.to(count.dtype) / count, high.to(count.dtype) / count
    out = _clip_fracs(f_low, f_high)
    if dual is not None:
        out["dual_clip_frac"] = _frac(dual, count)
    return out


# --------------------------------------------------------------------------- IS correction


@torch.no_grad()
def importance_weights(
    logprobs: Tensor,
    behavior_logprobs: Tensor,
    mask: Tensor,
    *,
    level: str = "token",
    mode: str = "truncate",
    cap: float | None = 2.0,
    lower: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Truncated / masked importance weights that correct for a rollout-engine mismatch.

    With ``log w_t = logprobs_t - behavior_logprobs_t`` (``logprobs`` is usually the trainer's
    recomputed ``old_logprobs``, ``behavior_logprobs`` the rollout engine's)::

        level="token":      w_t = exp(log w_t)                           (TIS, IcePop)
        level="sequence":   w_i = exp(sum_t log w_t)   on every token of row i   (MIS)
        level="geometric":  w_i = exp(mean_t log w_t)  on every token of row i
        mode="truncate":    w <- clip(w, lower, cap)            (a bound that is None is not applied)
        mode="mask":        w <- w * 1[lower <= w <= cap]        (tokens / rows outside are dropped)

    Truncated IS is from Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You
    Off-Policy RL Training" (fengyao.notion.site blog; the TIS fix, cap ``C = 2``); the
    sequence-level and masking variants follow verl's ``rollout_is`` options ("MIS": masked
    sequence-level weights) and IcePop (Ling team 2025, token masking outside ``[0.5, 5]``:
    ``mode="mask", lower=0.5, cap=5.0``). Unlike the ratio of a PPO loss, these weights are
    constants (computed under ``no_grad``): multiply any ``[B, T]`` loss matrix by them, or pass
    them as ``ppo_clip(..., is_weights=w)``. The sequence-level weight is a product of ``T``
    ratios, so it has a much larger variance than the token one; the geometric one is the
    length-normalised compromise.

    Weights are computed in log space (a bound is applied to ``log w`` before ``exp``), so they
    never overflow. Outside ``mask`` the weight is ``0``. Empty rows get no weight at all. A
    NaN / ``+-inf`` log-prob at a valid token gives a NaN weight (of that token, or of the whole
    row at the sequence / geometric levels), in both modes: it is neither truncated to a bound
    nor masked to 0.

    Registered in ``rollkit.registry.IS_CORRECTIONS`` as ``"importance_weights"`` (alias
    ``"rollout-is"``), reading ``logprobs`` from the ``"old_logprobs"`` key and writing
    ``"is_weights"`` (which ``ppo``'s entry reads) and ``"is_metrics"``.

    Args:
        logprobs: ``[B, T]`` target-policy log-probs (typically ``old_logprobs``).
        behavior_logprobs: ``[B, T]`` log-probs reported by the rollout engine.
        mask: ``[B, T]`` bool.
        level: ``"token"``, ``"sequence"`` or ``"geometric"``.
        mode: ``"truncate"`` or ``"mask"``.
        cap: upper bound (> 0) or ``None``. lower: lower bound (>= 0, <= cap) or ``None``.

    Returns:
        ``(weights [B, T] detached, metrics)`` with ``is_weight_mean`` (mean final weight over
        valid tokens), ``truncated_frac`` (``mode="truncate"``) or ``masked_frac``
        (``mode="mask"``): the fraction of valid tokens whose weight was bounded or dropped.

    >>> old = torch.tensor([[-1.0, -1.0, -2.0]])
    >>> beh = torch.tensor([[-2.0, -1.0, -1.0]])
    >>> m = torch.tensor([[True, True, True]])
    >>> w, met = importance_weights(old, beh, m, cap=2.0)
    >>> torch.allclose(w, torch.tensor([[2.0, 1.0, math.exp(-1.0)]]))
    True
    >>> w, _ = importance_weights(old, beh, m, level="geometric")
    >>> torch.allclose(w, torch.ones(1, 3))
    True
    """
    check_token_tensors(mask, logprobs=logprobs, behavior_logprobs=behavior_logprobs)
    check_choice("level", level, ("token", "sequence", "geometric"))
    check_choice("mode", mode, ("truncate", "mask"))
    if cap is not None:
        check_positive("cap", cap)
    if lower is not None:
        check_positive("lower", lower, allow_zero=True)
        if cap is not None and lower > cap:
            raise ValueError(f"lower: must be <= cap ({cap}), got {lower}")
    dtype = compute_dtype(logprobs)
    logw = _log_ratio(logprobs.to(dtype), behavior_logprobs.to(dtype), mask, None)
    if level != "token":
        total = logw.sum(-1, keepdim=True)
        if level == "geometric":
            total = total / mask.sum(-1, keepdim=True).clamp(min=1).to(dtype)
        logw = total.expand_as(logw)
    log_hi = math.log(cap) if cap is not None else None
    log_lo = (math.log(lower) if lower > 0 else -math.inf) if lower is not None else None
    count, _ = _counts(mask, dtype)
    if mode == "truncate":
        clamped = logw.clamp(log_lo, log_hi) if (log_lo is not None or log_hi is not None) else logw
        w = zero_outside(clamped.exp(), mask)
        changed = mask & (clamped != logw)
        metrics = {"truncated_frac": _frac(changed, count)}
    else:
        keep = mask  # "not outside the bounds", so that a NaN log-weight is kept (and propagates)
        if log_hi is not None:
            keep = keep & ~(logw > log_hi)
        if log_lo is not None:
            keep = keep & ~(logw < log_lo)
        safe = logw.clamp(max=log_hi) if log_hi is not None else logw
        w = zero_outside(safe.exp(), keep)
        metrics = {"masked_frac": _frac(mask & ~keep, count)}
    metrics["is_weight_mean"] = w.sum() / count
    return w, metrics


# ``logprobs`` is the policy the weights correct *towards*: the trainer's old_logprobs.
IS_CORRECTIONS.register(
    "importance_weights",
    importance_weights,
    aliases=("rollout-is", "rollout_is"),
    in_keys={"logprobs": OLD_LOGPROBS, "behavior_logprobs": BEHAVIOR_LOGPROBS, "mask": RESPONSE_MASK},
    out_keys=[IS_WEIGHTS, IS_METRICS],
)


# --------------------------------------------------------------------------- PPO


@POLICY_LOSSES.register("ppo", aliases=("ppo-clip", "grpo"), in_keys=_IN_KEYS_PPO, out_keys=_OUT_KEYS)
def ppo_clip(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    log_ratio_clamp: float | None = 20.0,
    is_weights: Tensor | None = None,
) -> LossOutput:
    """PPO's clipped surrogate (Schulman et al. 2017, arXiv:1707.06347), per token.

        r_t = exp(logprobs_t - old_logprobs_t)
        L_t = max(-A_t r_t, -A_t clip(r_t, 1 - clip_low, 1 + clip_high))
        L_t = min(L_t, -A_t c)          where A_t < 0, if dual_clip = c    (dual clip)
        L_t = w_t * L_t                 if is_weights = w (constants, e.g. truncated IS)

    Gradient: ``-w_t A_t r_t grad log pi_t`` inside the trust region, zero where the clip
    is active (``r > 1 + clip_high`` with ``A > 0``, ``r < 1 - clip_low`` with ``A < 0``) and
    where the dual clip is active (``r > c`` with ``A < 0``).

    ``clip_high > clip_low`` is DAPO's "clip-higher" (Yu et al. 2025, arXiv:2503.14476; they use
    0.2 / 0.28). ``dual_clip`` (Ye et al. 2020, arXiv:1912.09729) bounds the loss of negative
    advantages at ``-A c`` (``c > 1``, commonly 3); it never changes tokens with ``A >= 0``.
    Compared with CISPO, clipped tokens pass *no* gradient; compared with GSPO, the ratio
    and the clip are per token. GRPO's loss is this one (its KL term is separate, see
    ``rollkit.losses.kl``).

    Aggregation: verl / OpenRLHF default to ``"token-mean"``; the original GRPO paper uses
    ``"seq-mean-token-mean"``; Dr. GRPO a constant normaliser.

    Args:
        logprobs: ``[B, T]``, carries the gradient. old_logprobs: ``[B, T]``.
        advantages: ``[B, T]`` or ``[B]``. mask: ``[B, T]`` bool.
        clip_low: in ``[0, 1]``. clip_high: ``>= 0``. dual_clip: ``> 1`` or ``None``.
        log_ratio_clamp: upper clamp of the log-ratio before ``exp`` (verl: 20), ``None``: none.
        is_weights: optional ``[B, T]`` weights (detached), e.g. from :func:`importance_weights`.
            Registered under the batch key ``"is_weights"``: a TensorDict pipeline reads it
            when the batch has it (the ``IS_CORRECTIONS`` entry ``"importance_weights"``
            writes it) and uses ``None`` otherwise.

    Returns:
        ``LossOutput(loss [B, T], metrics)``; metrics: ``clip_frac``, ``clip_frac_low``,
        ``clip_frac_high``, (``dual_clip_frac``), ``ratio_mean``, ``ratio_min``, ``ratio_max``,
        ``approx_kl`` (k3).

    >>> lp = torch.tensor([[-1.0, -1.0]], requires_grad=True)
    >>> old = torch.tensor([[-1.0, -1.5]])
    >>> out = ppo_clip(lp, old, torch.tensor([1.0]), torch.tensor([[True, True]]))
    >>> torch.allclose(out.loss, torch.tensor([[-1.0, -1.2]]))     # r = [1, e^0.5]: 2nd is clipped
    True
    >>> out.loss.sum().backward()
    >>> torch.allclose(lp.grad, torch.tensor([[-1.0, 0.0]]))
    True
    """
    _check_inputs(logprobs, old_logprobs, advantages, mask)
    _check_clip(clip_low, clip_high)
    if dual_clip is not None and not check_real("dual_clip", dual_clip) > 1.0:
        raise ValueError(f"dual_clip: must be > 1 (or None), got {dual_clip}")
    if is_weights is not None:
        check_float("is_weights", is_weights)
        check_same_shape("is_weights", is_weights, "logprobs", logprobs)
    dtype, lr = _token_log_ratio(logprobs, old_logprobs, mask, log_ratio_clamp)
    ratio = lr.exp()
    adv = _token_adv(advantages, dtype, mask)
    loss, clipped, dual = _clipped_loss(ratio, adv, clip_low, clip_high, dual_clip)
    if is_weights is not None:
        loss = loss * is_weights.detach().to(dtype)
    loss = zero_outside(loss, mask)
    with torch.no_grad():
        count, n = _counts(mask, dtype)
        metrics = _clip_metrics(clipped, adv, count, dual)
        metrics.update(_ratio_metrics(lr, mask, n))
    return LossOutput(loss, metrics)


# --------------------------------------------------------------------------- sequence-level


def _seq_log_ratio(lr: Tensor, lengths: Tensor) -> Tensor:
    return lr.sum(-1) / lengths.clamp(min=1)


@POLICY_LOSSES.register("gspo", in_keys=_IN_KEYS, out_keys=_OUT_KEYS)
def gspo(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    log_ratio_clamp: float | None = 20.0,
) -> LossOutput:
    """GSPO: a clipped *sequence-level* ratio (Zheng et al. 2025, arXiv:2507.18071).

        s_i = exp( (1/|y_i|) sum_t (logprobs_it - old_logprobs_it) )      (geometric mean of r_it)
        L_i = max(-A_i s_i, -A_i clip(s_i, 1 - clip_low, 1 + clip_high))
        loss[i, t] = L_i   on every valid token t of row i

    Gradient: ``d L_i / d logprobs_it = -A_i s_i / |y_i|`` for every token of an unclipped
    sequence; a clipped sequence passes no gradient at all (the whole response is dropped,
    unlike PPO which drops single tokens). The clip ranges are the paper's (3e-4 / 4e-4: the
    sequence ratio is a mean of log-ratios, so it moves far less than a token ratio).

    Aggregation: every sequence weighs the same in the paper, ``(1/G) sum_i L_i``. Since
    ``L_i`` sits on each of the ``|y_i|`` valid tokens, ``aggregate(loss, mask,
    "seq-mean-token-mean")`` reproduces the paper exactly (and gives the gradient above, divided
    by the number of non-empty rows). ``"token-mean"`` instead weights sequences by length.

    Advantages are sequence-level: ``[B]`` as given, ``[B, T]`` reduced by a masked mean over
    the row (identical for GRPO-style advantages). Empty rows give ``s_i = 1`` and a zero loss.
    :func:`gspo_token` is the variant with per-token advantages. Compared with :func:`gmpo`, the
    clip is on the sequence ratio (GMPO clips each token's log-ratio before the mean).
    verl's ``gspo`` computes the GSPO-token form; with sequence-level advantages both agree.

    Returns ``LossOutput(loss [B, T], metrics)``; ``clip_frac`` (``_low`` / ``_high``) counts
    the valid *tokens* of clipped sequences; ``ratio_*`` and ``approx_kl`` are over tokens;
    ``seq_ratio_mean`` / ``seq_ratio_min`` / ``seq_ratio_max`` over non-empty rows.

    >>> lp = torch.tensor([[-1.0, -2.0], [-1.0, 0.0]], requires_grad=True)
    >>> m = torch.tensor([[True, True], [True, False]])
    >>> out = gspo(lp, lp.detach(), torch.tensor([1.0, -1.0]), m)
    >>> out.loss
    tensor([[-1., -1.],
            [ 1.,  0.]], grad_fn=<WhereBackward0>)
    """
    _check_inputs(logprobs, old_logprobs, advantages, mask)
    _check_clip(clip_low, clip_high)
    dtype, lr = _token_log_ratio(logprobs, old_logprobs, mask, log_ratio_clamp)
    lengths = mask.sum(-1).to(dtype)
    seq_lr = _seq_log_ratio(lr, lengths)
    s = seq_lr.exp()
    adv = _seq_adv(advantages, mask, lengths, dtype)
    seq_loss, clipped, _ = _clipped_loss(s, adv, clip_low, clip_high, None)
    loss = zero_outside(seq_loss.unsqueeze(-1).expand_as(lr), mask)
    with torch.no_grad():
        count, n = _counts(mask, dtype)
        # a clipped sequence drops all of its tokens: count them
        dropped = clipped * lengths
        f_low = (dropped * (adv < 0)).sum() / count
        f_high = (dropped * (adv > 0)).sum() / count
        metrics = _clip_fracs(f_low, f_high)
        metrics.update(_seq_metrics(lr, s, mask, lengths, n))
    return LossOutput(loss, metrics)


def _seq_metrics(lr: Tensor, s: Tensor, mask: Tensor, lengths: Tensor, n: Tensor) -> dict[str, Tensor]:
    """Token ratio metrics plus ``seq_ratio_*`` over the non-empty rows (``s`` is ``[B]``)."""
    metrics = _ratio_metrics(lr, mask, n)
    rows = lengths > 0
    n_rows = rows.sum().clamp(min=1).to(s.dtype)
    one = torch.ones((), dtype=s.dtype, device=s.device)
    metrics["seq_ratio_mean"] = torch.where(rows.any(), (s * rows).sum() / n_rows, one)
    if s.numel():
        lo, hi = torch.aminmax(torch.where(rows, s, metrics["seq_ratio_mean"]))
    else:
        lo = hi = one
    metrics["seq_ratio_min"], metrics["seq_ratio_max"] = lo, hi
    return metrics


@POLICY_LOSSES.register("gspo-token", aliases=("gspo_token",), in_keys=_IN_KEYS, out_keys=_OUT_KEYS)
def gspo_token(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    log_ratio_clamp: float | None = 20.0,
) -> LossOutput:
    """GSPO-token (Zheng et al. 2025, arXiv:2507.18071, section 4.3): per-token advantages.

        s_it = sg(s_i) * pi_theta(y_it) / sg(pi_theta(y_it))     (value s_i, gradient s_i grad log pi_it)
        L_it = max(-A_it s_it, -A_it clip(s_it, 1 - clip_low, 1 + clip_high))

    with ``s_i`` the sequence ratio of :func:`gspo`. Numerically ``s_it = s_i``, so the clip
    decision is per sequence; the gradient is ``-A_it s_i grad log pi_it``. With a constant
    advantage per row and ``"seq-mean-token-mean"`` aggregation the gradient equals GSPO's
    (the paper's remark); per-token advantages (e.g. multi-turn credit assignment) are the
    reason for this variant. Aggregate with ``"seq-mean-token-mean"`` as for GSPO.

    Metrics as :func:`gspo`.

    >>> lp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    >>> out = gspo_token(lp, lp.detach(), torch.tensor([[1.0, 3.0]]), torch.tensor([[True, True]]))
    >>> out.loss.sum().backward()
    >>> torch.allclose(lp.grad, torch.tensor([[-1.0, -3.0]]))
    True
    """
    _check_inputs(logprobs, old_logprobs, advantages, mask)
    _check_clip(clip_low, clip_high)
    _check_clamp(log_ratio_clamp)
    dtype = compute_dtype(logprobs)
    # zeroed outside the mask, so that padding (even NaN / inf) never reaches the gradient
    lp = zero_outside(logprobs.to(dtype), mask)
    lengths = mask.sum(-1).to(dtype)
    lr = _log_ratio(lp, old_logprobs.to(dtype), mask, log_ratio_clamp)
    seq_lr = _seq_log_ratio(lr, lengths).detach()
    s = seq_lr.exp()
    # value s_i, gradient s_i * grad log pi_it (lp - sg(lp) is 0)
    s_tok = s.unsqueeze(-1) * (1.0 + (lp - lp.detach()))
    adv = _token_adv(advantages, dtype, mask)
    loss, clipped, _ = _clipped_loss(s_tok, adv, clip_low, clip_high, None)
    loss = zero_outside(loss, mask)
    with torch.no_grad():
        count, n = _counts(mask, dtype)
        metrics = _clip_metrics(clipped & mask, adv, count)
        metrics.update(_seq_metrics(lr, s, mask, lengths, n))
    return LossOutput(loss, metrics)


@POLICY_LOSSES.register("gmpo", in_keys=_IN_KEYS, out_keys=_OUT_KEYS)
def gmpo(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float = 0.4,
    clip_high: float = 0.4,
    log_ratio_clamp: float | None = 20.0,
) -> LossOutput:
    """GMPO: geometric mean of token-clipped ratios (Zhao et al. 2025, arXiv:2507.20673).

        l_it = log r_it,   c_it = clip(l_it, -clip_low, clip_high)        (clip in log space)
        g_it = sgn(A_i) * min(sgn(A_i) l_it, sgn(A_i) c_it)               (pessimistic side)
        rho_i = exp( (1/|y_i|) sum_t g_it )                               (geometric mean)
        L_i = -A_i rho_i,    loss[i, t] = L_i on every valid token

    Gradient: ``-A_i rho_i / |y_i| grad log pi_it`` for tokens whose log-ratio is inside the
    log-space band (or on the optimistic side of it), zero for clipped tokens. Unlike
    :func:`gspo` (which clips the *sequence* ratio, dropping the whole response), GMPO drops
    single tokens, and unlike PPO the per-token objective is a geometric, not arithmetic, mean,
    which is less sensitive to outlier ratios; hence its much wider band (the paper's
    ``(e^-0.4, e^0.4)``, i.e. ``clip_low = clip_high = 0.4`` in log space; unlike PPO these
    bounds are on ``log r``, not on ``r``).

    Aggregation: the paper averages sequences, ``(1/G) sum_i L_i``: use
    ``"seq-mean-token-mean"``. Advantages are sequence-level as in :func:`gspo`.

    Returns ``LossOutput``; ``clip_frac`` (``_low`` / ``_high``) counts valid tokens where the
    token clip is active (zero gradient), plus ``ratio_*`` / ``approx_kl`` over tokens and
    ``seq_ratio_mean`` / ``_min`` / ``_max`` (of ``rho``) over non-empty rows.

    >>> lp = torch.tensor([[-1.0, -1.0]], requires_grad=True)
    >>> old = torch.tensor([[-1.0, -2.0]])            # log-ratios [0, 1]: the 2nd is clipped to 0.4
    >>> out = gmpo(lp, old, torch.tensor([1.0]), torch.tensor([[True, True]]))
    >>> torch.allclose(out.loss, torch.full((1, 2), -math.exp(0.2)))
    True
    """
    _check_inputs(logprobs, old_logprobs, advantages, mask)
    check_positive("clip_low", clip_low, allow_zero=True)
    check_positive("clip_high", clip_high, allow_zero=True)
    dtype, lr = _token_log_ratio(logprobs, old_logprobs, mask, log_ratio_clamp)
    lengths = mask.sum(-1).to(dtype)
    adv = _seq_adv(advantages, mask, lengths, dtype)
    sgn = torch.sign(adv).unsqueeze(-1)
    signed, signed_clipped = sgn * lr, sgn * lr.clamp(-clip_low, clip_high)
    g = sgn * torch.minimum(signed, signed_clipped)
    rho = _seq_log_ratio(g, lengths).exp()
    loss = zero_outside((-adv * rho).unsqueeze(-1).expand_as(lr), mask)
    with torch.no_grad():
        count, n = _counts(mask, dtype)
        # the clipped branch is strictly smaller: the token passes no gradient (False outside the mask)
        metrics = _clip_metrics(signed_clipped < signed, sgn, count)
        metrics.update(_seq_metrics(lr, rho, mask, lengths, n))
    return LossOutput(loss, metrics)


# --------------------------------------------------------------------------- REINFORCE family


def _weighted_pg(lp: Tensor, weight: Tensor, mask: Tensor) -> Tensor:
    """``where(mask, -weight * log pi, 0)`` with ``weight`` a constant (includes A).

    ``lp`` is zeroed outside the mask *before* the product: otherwise the backward of the
    product would compute ``0 * weight`` there, a NaN gradient for NaN / inf padding."""
    return zero_outside(-weight * zero_outside(lp, mask), mask)


@POLICY_LOSSES.register("cispo", in_keys=_IN_KEYS, out_keys=_OUT_KEYS)
def cispo(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float | None = None,
    clip_high: float = 0.28,
    log_ratio_clamp: float | None = 20.0,
) -> LossOutput:
    """CISPO (MiniMax-M1, MiniMax 2025, arXiv:2506.13585): clip the IS weight, keep the gradient.

        r_t = exp(logprobs_t - old_logprobs_t)
        L_t = -sg(clip(r_t, 1 - clip_low, 1 + clip_high)) * A_t * logprobs_t

    Gradient: ``-clip(r_t) A_t grad log pi_t`` on *every* token: a clipped token keeps its
    gradient, only its weight is capped (PPO zeroes it). At ``r = 1`` this is the vanilla
    policy gradient. The paper imposes no lower bound (``clip_low=None``: the weight is in
    ``[0, 1 + clip_high]``) and tunes ``clip_high``; rollkit's default ``0.28`` is DAPO's upper
    clip, not a value from the paper. The loss *value* is ``-w A log pi`` (not comparable with
    PPO's ``-A r``); only its gradient is meaningful.

    Metrics: ``clip_frac`` / ``clip_frac_low`` / ``clip_frac_high`` (fraction of valid tokens
    whose weight was capped, whatever the sign of A), ``ratio_*``, ``approx_kl`` (k3).

    >>> lp = torch.tensor([[-1.0, -1.0]], requires_grad=True)
    >>> old = torch.tensor([[-1.0, -2.0]])                      # r = [1, e]: 2nd capped at 1.28
    >>> out = cispo(lp, old, torch.tensor([1.0]), torch.tensor([[True, True]]))
    >>> out.loss.sum().backward()
    >>> torch.allclose(lp.grad, torch.tensor([[-1.0, -1.28]]))
    True
    """
    _check_inputs(logprobs, old_logprobs, advantages, mask)
    if clip_low is not None:
        check_in_range("clip_low", clip_low, 0.0, 1.0)
    check_positive("clip_high", clip_high, allow_zero=True)
    _check_clamp(log_ratio_clamp)
    dtype = compute_dtype(logprobs)
    lp = logprobs.to(dtype)
    lr = _log_ratio(lp, old_logprobs.to(dtype), mask, log_ratio_clamp).detach()
    ratio = lr.exp()
    lo = 1.0 - clip_low if clip_low is not None else None
    weight = ratio.clamp(lo, 1.0 + clip_high)
    adv = _token_adv(advantages, dtype, mask)
    loss = _weighted_pg(lp, weight * adv, mask)
    with torch.no_grad():
        count, n = _counts(mask, dtype)
        # ratio == 1 outside the mask, so these flags need no "& mask"
        f_high = _frac(ratio > 1.0 + clip_high, count)
        f_low = _frac(ratio < lo, count) if lo is not None else torch.zeros_like(f_high)
        metrics = _clip_fracs(f_low, f_high)
        metrics.update(_ratio_metrics(lr, mask, n))
    return LossOutput(loss, metrics)


@POLICY_LOSSES.register("topr", in_keys=_IN_KEYS, out_keys=_OUT_KEYS)
def topr(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    positive_weight: float = 1.0,
    negative_weight: float = 1.0,
    level: str = "sequence",
) -> LossOutput:
    """TOPR: Tapered Off-Policy REINFORCE (Le Roux et al. 2025, arXiv:2503.14286).

        positive (A_i >= 0):  L_t = -positive_weight * A_t * logprobs_t                   (no IS)
        negative (A_i <  0):  L_t = -negative_weight * sg(clip(rho, 0, 1)) * A_t * logprobs_t
        rho = pi_theta(y_i) / mu(y_i) = exp(sum_t log r_it)   (level="sequence", the paper's)
        rho = r_it                                           (level="token")

    with ``mu`` = ``old_logprobs`` (the policy the data came from). Gradient: plain SFT-like
    ``-A grad log pi`` on positive samples (fast learning even on unlikely positives), and a
    truncated-IS, stop-gradient weight on negatives, which tapers their push-down to zero as
    the sample becomes unlikely under pi_theta (so the objective stays bounded off-policy).
    Unlike PPO nothing is clipped on positives; unlike CISPO/TIS, positives get no IS weight
    at all.

    Positive / negative: the paper splits on the sign of ``R(tau) - c`` (reward minus the
    REINFORCE baseline, ``R >= c`` being positive); here the split is on the sign of
    ``advantages`` (``A = 0`` counts as positive and contributes nothing). Pass raw rewards as
    ``advantages`` for the baseline-free version. With ``[B, T]`` advantages the split uses the
    row's masked mean advantage (per-token split at ``level="token"``).
    ``positive_weight`` / ``negative_weight`` rescale the two sets (the paper's dataset
    re-weighting, e.g. to balance positive and negative examples).

    Aggregation: the paper sums log-probabilities over the trajectory and averages
    trajectories: ``"seq-mean-token-sum"``. ``rho`` is never larger than 1, so it cannot
    overflow. Metrics: ``positive_frac`` (valid tokens in positive samples),
    ``truncated_frac`` (valid tokens of negatives with ``rho < 1``), ``is_weight_mean`` (mean
    weight of negative tokens, 0 if none), ``ratio_*`` / ``approx_kl`` (token level).

    >>> lp = torch.tensor([[-1.0, -1.0], [-1.0, -1.0]], requires_grad=True)
    >>> old = torch.tensor([[-2.0, -2.0], [-0.5, -1.0]])           # row 2: log rho = -0.5
    >>> m = torch.ones(2, 2, dtype=torch.bool)
    >>> out = topr(lp, old, torch.tensor([1.0, -1.0]), m)
    >>> out.loss.sum().backward()
    >>> torch.allclose(lp.grad, torch.tensor([[-1.0, -1.0], [math.exp(-0.5)] * 2]))
    True
    """
    _check_inputs(logprobs, old_logprobs, advantages, mask)
    check_positive("positive_weight", positive_weight, allow_zero=True)
    check_positive("negative_weight", negative_weight, allow_zero=True)
    check_choice("level", level, ("sequence", "token"))
    dtype = compute_dtype(logprobs)
    lp = logprobs.to(dtype)
    lr = _log_ratio(lp, old_logprobs.to(dtype), mask, None).detach()
    adv = _token_adv(advantages, dtype, mask)
    if level == "sequence":
        log_rho = lr.sum(-1, keepdim=True)
        if advantages.ndim == 1:
            sign_src = adv
        else:
            sign_src = _seq_adv(advantages, mask, mask.sum(-1).to(dtype), dtype).unsqueeze(-1)
    else:
        log_rho = lr
        sign_src = adv
    rho = log_rho.clamp(max=0.0).exp()
    neg = sign_src < 0
    weight = torch.where(neg, negative_weight * rho, torch.full_like(rho, positive_weight))
    loss = _weighted_pg(lp, weight * adv, mask)
    with torch.no_grad():
        count, n = _counts(mask, dtype)
        if log_rho.shape[-1] == 1 and mask.shape[-1] != 1:
            # sequence level: one decision per row, weight the rows by their lengths
            tok = mask.sum(-1, keepdim=True).to(dtype)
        else:  # token level: per-token flags ([B, 1] signs broadcast over the [B, T] mask)
            tok = mask.to(dtype)
        neg_tok = neg * tok
        n_neg = neg_tok.sum()
        metrics = {
            "positive_frac": (tok.sum() - n_neg) / count,
            "truncated_frac": (neg_tok * (log_rho < 0)).sum() / count,
            "is_weight_mean": (neg_tok * rho).sum() / n_neg.clamp(min=1),
        }
        lr_c = lr.clamp(-20.0, 20.0)
        metrics.update(_ratio_metrics(lr_c, mask, n))
    return LossOutput(loss, metrics)


@POLICY_LOSSES.register("tis", aliases=("truncated-is",), in_keys=_IN_KEYS_OFF, out_keys=_OUT_KEYS)
def tis(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    behavior_logprobs: Tensor,
    *,
    cap: float | None = 2.0,
    lower: float | None = None,
    level: str = "token",
    mode: str = "truncate",
    log_ratio_clamp: float | None = 20.0,
) -> LossOutput:
    """Policy gradient with truncated importance sampling (Yao et al. 2025, the "TIS" fix).

        w_t = min(pi_old(y_t) / mu(y_t), cap)        (constant; see importance_weights)
        L_t = -w_t * A_t * r_t,    r_t = exp(logprobs_t - old_logprobs_t)  (no clip)

    ``mu`` = ``behavior_logprobs`` (rollout engine, e.g. vLLM), ``pi_old`` = ``old_logprobs``
    (the trainer's recomputation of the same weights). Gradient: ``-w_t A_t r_t grad log pi``;
    at ``logprobs == old_logprobs`` (one on-policy step) this is ``-w_t A_t grad log pi``, the
    vanilla policy gradient corrected for the engine/trainer mismatch. Compared with
    ``ppo_clip(..., is_weights=w)`` there is no trust-region clip on ``r``; compared with
    :func:`decoupled_ppo` the same but unclipped; compared with :func:`cispo`, the weight
    corrects the *behaviour* mismatch, not the policy change. ``level`` / ``mode`` /
    ``lower`` select the sequence-level, geometric and masked (MIS / IcePop) variants.

    Yao et al. apply the same weight to a PPO loss (``ppo_clip(..., is_weights=w)``);
    verl's ``rollout_is`` defaults to a token-level cap of 2, as here.

    Aggregation: any (``"token-mean"`` as verl). Metrics: ``is_weight_mean``,
    ``truncated_frac`` / ``masked_frac``, ``ratio_*`` and ``approx_kl`` of pi_theta vs pi_old.

    >>> lp = torch.tensor([[-1.0, -1.0]], requires_grad=True)
    >>> beh = torch.tensor([[-3.0, -1.0]])                  # pi_old / mu = [e^2, 1] -> [2, 1]
    >>> out = tis(lp, lp.detach(), torch.tensor([1.0]), torch.tensor([[True, True]]), beh)
    >>> out.loss.sum().backward()
    >>> torch.allclose(lp.grad, torch.tensor([[-2.0, -1.0]]))
    True
    """
    _check_inputs(logprobs, old_logprobs, advantages, mask, behavior_logprobs)
    w, w_metrics = importance_weights(
        old_logprobs, behavior_logprobs, mask, level=level, mode=mode, cap=cap, lower=lower
    )
    dtype, lr = _token_log_ratio(logprobs, old_logprobs, mask, log_ratio_clamp)
    adv = _token_adv(advantages, dtype, mask)
    ratio = lr.exp()
    loss = zero_outside(-(w * adv) * ratio, mask)
    with torch.no_grad():
        _, n = _counts(mask, dtype)
        metrics = dict(w_metrics)
        metrics.update(_ratio_metrics(lr, mask, n))
    return LossOutput(loss, metrics)


@POLICY_LOSSES.register("decoupled-ppo", aliases=("decoupled_ppo",), in_keys=_IN_KEYS_OFF, out_keys=_OUT_KEYS)
def decoupled_ppo(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    behavior_logprobs: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    behavior_cap: float | None = 5.0,
    behavior_mode: str = "truncate",
    log_ratio_clamp: float | None = 20.0,
) -> LossOutput:
    """Decoupled PPO (Hilton et al. 2022, arXiv:2110.00641; AReaL, Fu et al. 2025, arXiv:2505.24298).

        w_t = sg(pi_prox(y_t) / mu(y_t))  bounded by behavior_cap (truncated or masked)
        r_t = pi_theta(y_t) / pi_prox(y_t)
        L_t = w_t * max(-A_t r_t, -A_t clip(r_t, 1 - clip_low, 1 + clip_high))

    ``old_logprobs`` are the *proximal* policy (the trust-region centre, e.g. the weights
    before this update) and ``behavior_logprobs`` the (possibly several versions stale)
    policy that generated the sample. Decoupling lets the trust region follow the learner
    while the off-policyness is corrected by ``w``. Gradient: as :func:`ppo_clip`, times ``w``.
    This is exactly ``ppo_clip(..., is_weights=importance_weights(old, behavior, mask,
    mode=behavior_mode, cap=behavior_cap)[0])``.

    ``behavior_mode="truncate"`` caps the weight at ``behavior_cap``; ``"mask"`` drops tokens
    above it, which is what AReaL does with ``behav_imp_weight_cap``. ``behavior_cap=None``
    applies no bound (Hilton et al.'s plain decoupled objective; ``exp`` may overflow for
    log-weights above ~88). The default 5.0 is a common choice in AReaL's configs, not a
    value from the papers.

    Aggregation: ``"token-mean"`` (AReaL). Metrics: :func:`ppo_clip`'s plus ``is_weight_mean``
    and ``truncated_frac`` / ``masked_frac``.

    >>> lp = torch.tensor([[-1.0, -1.0]], requires_grad=True)
    >>> beh = torch.tensor([[-1.0, -2.0]])                   # w = [1, e]
    >>> out = decoupled_ppo(lp, lp.detach(), torch.tensor([1.0]), torch.tensor([[True, True]]), beh)
    >>> torch.allclose(out.loss, torch.tensor([[-1.0, -math.e]]))
    True
    """
    _check_inputs(logprobs, old_logprobs, advantages, mask, behavior_logprobs)
    check_choice("behavior_mode", behavior_mode, ("truncate", "mask"))
    if behavior_cap is not None:
        check_positive("behavior_cap", behavior_cap)
    w, w_metrics = importance_weights(
        old_logprobs, behavior_logprobs, mask, level="token", mode=behavior_mode, cap=behavior_cap
    )
    out = ppo_clip(
        logprobs,
        old_logprobs,
        advantages,
        mask,
        clip_low=clip_low,
        clip_high=clip_high,
        dual_clip=dual_clip,
        log_ratio_clamp=log_ratio_clamp,
        is_weights=w,
    )
    out.metrics.update(w_metrics)
    return out


@POLICY_LOSSES.register("raft++", aliases=("raft-pp", "raftpp"), in_keys=_IN_KEYS, out_keys=_OUT_KEYS)
def raft_pp(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    threshold: float = 0.0,
    log_ratio_clamp: float | None = 20.0,
) -> LossOutput:
    """RAFT++ (Xiong et al. 2025, arXiv:2504.11343): PPO's clipped ratio on accepted samples only.

        accept_i = 1[A_i > threshold]                       (rejection sampling)
        L_t = accept_i * max(-r_t, -clip(r_t, 1 - clip_low, 1 + clip_high))

    RAFT trains on the accepted (correct) samples with a plain likelihood loss; RAFT++ adds
    PPO's importance ratio and clip. The accepted samples get weight 1 (not their advantage),
    the rejected ones contribute nothing. Gradient: ``-r_t grad log pi_t`` on accepted tokens
    inside the band, zero when ``r > 1 + clip_high``.

    Acceptance: the paper accepts samples with a positive (maximal, 0/1) reward. Pass the
    ``[B]`` rewards (or ``rewards - 0.5``) as ``advantages`` to reproduce that; with GRPO
    advantages, ``A > 0`` accepts the samples above their group mean (and drops all-correct
    groups). With ``[B, T]`` advantages the test is per token.

    Aggregation: the paper averages over accepted samples; use ``"token-mean"`` with the mask
    ``mask & accepted`` (or a global normaliser counting accepted tokens), since the full mask
    would also count rejected tokens. Metrics: ``accepted_frac`` (valid tokens accepted),
    ``clip_frac``, ``ratio_*``, ``approx_kl``. A non-finite advantage (or log-prob) at a valid
    token is neither accepted nor rejected: the loss there is non-finite (as in every loss
    here), not a silent 0 or a silent acceptance.

    >>> lp = torch.tensor([[-1.0], [-1.0]], requires_grad=True)
    >>> out = raft_pp(lp, lp.detach(), torch.tensor([1.0, 0.0]), torch.ones(2, 1, dtype=torch.bool))
    >>> torch.allclose(out.loss, torch.tensor([[-1.0], [0.0]]))
    True
    """
    _check_inputs(logprobs, old_logprobs, advantages, mask)
    _check_clip(clip_low, clip_high)
    check_scalar("threshold", threshold)  # +-inf allowed (accept all / none), NaN not
    dtype, lr = _token_log_ratio(logprobs, old_logprobs, mask, log_ratio_clamp)
    ratio = lr.exp()
    adv = _token_adv(advantages, dtype, mask)
    acc = mask & (adv > threshold)
    surr = -torch.minimum(ratio, ratio.clamp(1.0 - clip_low, 1.0 + clip_high))
    loss = zero_outside(surr, acc)
    # a non-finite advantage or ratio is neither accepted nor rejected: surr * adv puts a
    # non-finite number (NaN for a NaN) in the value and the gradient
    bad = mask & ~(torch.isfinite(adv) & torch.isfinite(surr))
    loss = torch.where(bad, surr * adv, loss)
    with torch.no_grad():
        count, n = _counts(mask, dtype)
        metrics = {
            "accepted_frac": _frac(acc, count),
            "clip_frac": _frac(acc & (ratio > 1.0 + clip_high), count),
        }
        metrics.update(_ratio_metrics(lr, mask, n))
    return LossOutput(loss, metrics)


@POLICY_LOSSES.register(
    "vanilla-pg", aliases=("reinforce", "vanilla_pg", "pg"), in_keys=_IN_KEYS, out_keys=_OUT_KEYS
)
def vanilla_pg(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
) -> LossOutput:
    """Vanilla policy gradient / REINFORCE (Williams 1992; no arXiv id), on-policy.

        L_t = -A_t * logprobs_t            gradient: -A_t grad log pi_t

    The on-policy surrogate: no ratio, no clip, no IS, so it is only correct for samples
    drawn from the current policy (one gradient step per batch). ``old_logprobs`` is accepted
    (and shape-checked) for a uniform signature but unused. It is the reference that every
    other loss here reduces to at ``logprobs == old_logprobs`` (up to the aggregation).
    Metrics: none (nothing is clipped or weighted; ``metrics`` is an empty dict).

    >>> lp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    >>> out = vanilla_pg(lp, lp.detach(), torch.tensor([2.0]), torch.tensor([[True, False]]))
    >>> out.loss
    tensor([[2., 0.]], grad_fn=<WhereBackward0>)
    """
    _check_inputs(logprobs, old_logprobs, advantages, mask)
    dtype = compute_dtype(logprobs)
    lp = logprobs.to(dtype)
    loss = _weighted_pg(lp, _token_adv(advantages, dtype, mask), mask)
    return LossOutput(loss, {})


@POLICY_LOSSES.register("gpg", in_keys=_IN_KEYS, out_keys=_OUT_KEYS)
def gpg(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    alpha: float = 1.0,
) -> LossOutput:
    """GPG: Group Policy Gradient (Chu et al. 2025, arXiv:2504.02546).

        L_t = -alpha * A_t * logprobs_t

    GPG is REINFORCE on group-relative advantages (``A = r - mean_group(r)``, no std
    normalisation: ``rollkit.advantages``) with no ratio, no clip, no KL and no reference
    model, plus a gradient correction ``alpha = B / (B - M)`` where ``M`` counts the samples
    whose advantage is zero (groups with identical rewards), so that those samples do not
    dilute the batch gradient. ``alpha`` depends on the *global* batch (all micro-batches and
    ranks), so it is a scalar the caller computes, not something derived from this
    micro-batch. With ``alpha=1`` this is :func:`vanilla_pg`. The paper aggregates with
    ``"token-mean"``.

    >>> lp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    >>> out = gpg(lp, lp.detach(), torch.tensor([1.0]), torch.tensor([[True, True]]), alpha=2.0)
    >>> torch.allclose(out.loss, torch.tensor([[2.0, 4.0]]))
    True
    """
    _check_inputs(logprobs, old_logprobs, advantages, mask)
    check_positive("alpha", alpha)
    dtype = compute_dtype(logprobs)
    lp = logprobs.to(dtype)
    loss = _weighted_pg(lp, alpha * _token_adv(advantages, dtype, mask), mask)
    return LossOutput(loss, {})


@POLICY_LOSSES.register("sapo", in_keys=_IN_KEYS, out_keys=_OUT_KEYS)
def sapo(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
    log_ratio_clamp: float | None = 20.0,
) -> LossOutput:
    """SAPO: Soft Adaptive Policy Optimization (Gao et al. 2025, Qwen, arXiv:2511.20347).

        tau_t = tau_pos if A_t > 0 else tau_neg
        f(r) = (4 / tau) * sigmoid(tau * (r - 1))
        L_t = -A_t * f(r_t),    r_t = exp(logprobs_t - old_logprobs_t)

    Gradient: ``-A_t g_t r_t grad log pi_t`` with the soft gate
    ``g_t = 4 sigmoid(tau (r - 1)) (1 - sigmoid(tau (r - 1)))``: ``g = 1`` at ``r = 1`` (the
    vanilla policy gradient) and decays smoothly as ``r`` leaves 1, instead of PPO's hard cut
    at ``1 +/- eps``. ``tau_neg > tau_pos`` damps negative-advantage tokens faster (the paper's
    defaults 1.0 / 1.05). Unlike GSPO the gate is per token, so a few off-policy tokens do not
    silence their whole sequence. Aggregation: ``"token-mean"`` (verl's default with SAPO).

    Metrics: ``gate_mean`` (mean ``g`` over valid tokens), ``ratio_*``, ``approx_kl``.

    >>> lp = torch.tensor([[-1.0]], requires_grad=True)
    >>> out = sapo(lp, lp.detach(), torch.tensor([1.0]), torch.tensor([[True]]))
    >>> torch.allclose(out.loss, torch.tensor([[-2.0]]))       # -(4 / 1) * sigmoid(0)
    True
    >>> out.loss.sum().backward()
    >>> torch.allclose(lp.grad, torch.tensor([[-1.0]]))
    True
    """
    _check_inputs(logprobs, old_logprobs, advantages, mask)
    check_positive("tau_pos", tau_pos)
    check_positive("tau_neg", tau_neg)
    dtype, lr = _token_log_ratio(logprobs, old_logprobs, mask, log_ratio_clamp)
    ratio = lr.exp()
    adv = _token_adv(advantages, dtype, mask)
    tau = torch.where(adv > 0, tau_pos, tau_neg).to(dtype)
    sig = torch.sigmoid(tau * (ratio - 1.0))
    loss = zero_outside((-4.0 * adv / tau) * sig, mask)
    with torch.no_grad():
        count, n = _counts(mask, dtype)
        # the gate is exactly 1 outside the mask (r = 1): subtract those entries
        gate_sum = (4.0 * sig * (1.0 - sig)).sum(dtype=torch.float64) - (mask.numel() - n)
        metrics = {"gate_mean": (gate_sum / count).to(dtype)}
        metrics.update(_ratio_metrics(lr, mask, n))
    return LossOutput(loss, metrics)
