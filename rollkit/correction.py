"""Training-inference mismatch correction: importance weights, rejection masks, diagnostics.

The rollout engine (vLLM, the transformers engine) reports ``behavior_logprobs`` (mu) of the
sampled tokens; the trainer recomputes ``old_logprobs`` (pi_old) and, during the update, the
current ``logprobs`` (pi_theta). This module turns ``(pi_old, mu)`` into per-token weights
and a keep-mask (:func:`correction_weights`, once per batch), chooses between the decoupled
and bypass modes (:func:`correct`), and measures the mismatch (:func:`mismatch_metrics`,
with exact micro-batch / data-parallel reductions through :func:`mismatch_stats` and
:func:`reduce_mismatch_stats`). Everything is a pure function of tensors, computed in log
space under ``no_grad``.

The guide, with the formulas, the thresholds and a comparison with verl, TRL, OpenRLHF and
AReaL, is docs/correction.md.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from rollkit.losses._common import check_token_tensors, compute_dtype
from rollkit.validation import (
    check_choice,
    check_int_tensor,
    check_positive,
    check_same_shape,
)

__all__ = [
    "LEVELS",
    "SAFE_LOG_WEIGHT",
    "Correction",
    "correct",
    "correction_weights",
    "mismatch_metrics",
    "mismatch_stats",
    "reduce_correction_stats",
    "reduce_mismatch_stats",
    "stat_reduce_op",
]

#: Aggregation levels of :func:`correction_weights` (for ``level`` and ``mask_level``).
LEVELS = ("token", "sequence", "geometric", "segment")

#: Upper clamp of every log-weight / log-ratio before ``exp`` (verl's safety bound): ``e^20 ~
#: 4.9e8``, and its square ``e^40``, are finite in float32, so no weight or metric overflows.
SAFE_LOG_WEIGHT = 20.0

_F64 = torch.float64


@dataclass(frozen=True)
class Correction:
    """What :func:`correction_weights` returns.

    Attributes:
        weights: ``[B, T]`` detached weights in the compute dtype (float32 for half inputs);
            exactly ``0`` outside ``mask`` and on rejected tokens / rows / segments.
        keep: ``[B, T]`` bool, ``mask`` and not rejected: AND it into the loss mask.
        metrics: detached 0-dim tensors (see :func:`correction_weights`).
        stats: the sufficient statistics of ``metrics`` (sums, counts, maxima); merge the
            stats of micro-batches / ranks with :func:`reduce_correction_stats`.
    """

    weights: Tensor
    keep: Tensor
    metrics: dict[str, Tensor]
    stats: dict[str, Tensor] = field(default_factory=dict)


# --------------------------------------------------------------------------- validation


def _check_bound(name: str, value: float | None) -> float | None:
    """``None`` or a finite-or-inf number > 0, returned as its log."""
    if value is None:
        return None
    check_positive(name, value)
    return math.log(value)


def _check_options(
    level: str,
    mask_level: str,
    segment_ids: Tensor | None,
    mask: Tensor,
    truncate: float | None,
    mask_low: float | None,
    mask_high: float | None,
    seq_k3_max: float | None,
    reject: str,
) -> None:
    check_choice("level", level, LEVELS)
    check_choice("mask_level", mask_level, LEVELS)
    check_choice("reject", reject, ("token", "sequence"))
    needs_segments = "segment" in (level, mask_level)
    if segment_ids is None and needs_segments:
        raise ValueError("segment_ids: required when level or mask_level is 'segment'")
    if segment_ids is not None:
        if not needs_segments:
            raise ValueError("segment_ids: only used with level='segment' or mask_level='segment'")
        check_int_tensor("segment_ids", segment_ids)
        check_same_shape("segment_ids", segment_ids, "mask", mask)
    _check_bound("truncate", truncate)
    _check_bound("mask_low", mask_low)
    _check_bound("mask_high", mask_high)
    if seq_k3_max is not None:
        check_positive("seq_k3_max", seq_k3_max)
    if mask_low is not None and mask_high is not None and mask_low > mask_high:
        raise ValueError(f"mask_low: must be <= mask_high ({mask_high}), got {mask_low}")


# --------------------------------------------------------------------------- units


def _segment_index(segment_ids: Tensor, mask: Tensor) -> tuple[Tensor, int]:
    """``[B, T]`` dense index of the ``(row, segment)`` units of the valid tokens, and their
    number. Invalid tokens form one extra unit per row (never merged with a valid one), so the
    values of ``segment_ids`` under a False mask do not matter."""
    b, t = mask.shape
    if mask.numel() == 0:
        return torch.zeros(mask.shape, dtype=torch.int64, device=mask.device), 0
    rows = torch.arange(b, device=mask.device).unsqueeze(-1).expand(b, t)
    seg = torch.where(
        mask, segment_ids.to(torch.int64), torch.zeros((), dtype=torch.int64, device=mask.device)
    )
    keys = torch.stack([rows.reshape(-1), seg.reshape(-1), mask.reshape(-1).to(torch.int64)])
    uniq, inv = torch.unique(keys, dim=1, return_inverse=True)
    return inv.view(b, t), uniq.shape[1]


def _unit_sum(x: Tensor, level: str, seg: tuple[Tensor, int] | None) -> Tensor:
    """Sum of ``x`` (accumulated in float64) over each token's unit, broadcast to ``[B, T]``."""
    if level == "token":
        return x.to(_F64)
    if level in ("sequence", "geometric"):
        return x.sum(-1, keepdim=True, dtype=_F64).expand(x.shape)
    assert seg is not None
    inv, g = seg
    sums = torch.zeros(g, dtype=_F64, device=x.device).index_add_(0, inv.reshape(-1), x.reshape(-1).to(_F64))
    return sums[inv]


def _unit_log_weight(
    lr: Tensor, valid: Tensor, level: str, seg: tuple[Tensor, int] | None, dtype: torch.dtype
) -> Tensor:
    """Per-token log-weight at ``level`` (``lr`` is 0 outside ``valid``), in ``dtype``."""
    total = _unit_sum(lr, level, seg)
    if level == "geometric":
        total = total / valid.sum(-1, keepdim=True).clamp(min=1).to(_F64)
    return total.to(dtype)


def _unit_any(flags: Tensor, level: str, seg: tuple[Tensor, int] | None) -> Tensor:
    """Whether any token of each token's unit is flagged, broadcast to ``[B, T]``."""
    if level == "token":
        return flags
    if level in ("sequence", "geometric"):
        return flags.any(-1, keepdim=True).expand(flags.shape)
    return _unit_sum(flags, level, seg) > 0


# --------------------------------------------------------------------------- weights


def _safe_log_ratio(a: Tensor, b: Tensor, mask: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """``(lr, ok, bad)``: ``lr = a - b`` where ``ok`` (valid and finite), else exactly 0;
    ``bad`` marks the valid tokens whose log-ratio is NaN / +-inf."""
    raw = a.to(dtype) - b.to(dtype)
    ok = mask & torch.isfinite(raw)
    lr = torch.where(ok, raw, torch.zeros((), dtype=dtype, device=raw.device))
    return lr, ok, mask & ~ok


def _rejections(
    lr: Tensor,
    ok: Tensor,
    bad: Tensor,
    mask: Tensor,
    logm: Tensor,
    *,
    mask_level: str,
    level: str,
    seg: tuple[Tensor, int] | None,
    log_low: float | None,
    log_high: float | None,
    seq_k3_max: float | None,
    reject: str,
) -> Tensor:
    """``[B, T]`` bool: the valid tokens that are dropped."""
    rejected = bad | _unit_any(bad, level, seg) | _unit_any(bad, mask_level, seg)
    if log_high is not None:
        rejected = rejected | (logm > log_high)
    if log_low is not None:
        rejected = rejected | (logm < log_low)
    if seq_k3_max is not None:
        k3 = torch.where(ok, torch.expm1(lr.clamp(max=SAFE_LOG_WEIGHT)) - lr, torch.zeros_like(lr))
        mean_k3 = k3.sum(-1, keepdim=True, dtype=_F64) / ok.sum(-1, keepdim=True).clamp(min=1)
        rejected = rejected | (mean_k3 > seq_k3_max)
    rejected = rejected & mask
    if reject == "sequence":
        rejected = mask & rejected.any(-1, keepdim=True)
    return rejected


@torch.no_grad()
def correction_weights(
    old_logprobs: Tensor,
    behavior_logprobs: Tensor,
    mask: Tensor,
    *,
    level: str = "token",
    segment_ids: Tensor | None = None,
    truncate: float | None = 2.0,
    mask_low: float | None = None,
    mask_high: float | None = None,
    seq_k3_max: float | None = None,
    reject: str = "token",
    mask_level: str | None = None,
) -> Correction:
    """Truncated / rejection-sampled importance weights ``pi_old / mu`` for the rollout mismatch.

    With ``d_t = old_logprobs_t - behavior_logprobs_t`` (``log pi_old - log mu``) over the valid
    tokens, the log-weight of a *unit* (a token, a row, or a ``(row, segment)`` turn) is::

        level="token":      log w_t = d_t                                     (TIS, IcePop)
        level="sequence":   log w_i = sum_t d_t            on every token of row i
        level="geometric":  log w_i = mean_t d_t           on every token of row i
        level="segment":    log w_s = sum_{t in s} d_t     on every token of segment s of row i

        weight = exp(min(log w, log truncate, 20))        (truncate=None: only the safety 20)
        rejected unit: w_m < mask_low  or  w_m > mask_high (w_m: the weight at ``mask_level``,
                       untruncated; default mask_level = level)
        rejected row:  mean_t k3_t > seq_k3_max, k3_t = (e^d_t - 1) - d_t
        reject="sequence": a row with any rejected token is rejected whole

    ``weights = 0`` and ``keep = False`` on rejected tokens; the trainer multiplies its
    ``[B, T]`` loss by ``weights`` and ANDs ``keep`` into its loss mask, so a rejected token
    leaves both the numerator and the normaliser (verl's convention; TRL, OpenRLHF and AReaL
    keep rejected tokens in the normaliser, see docs/correction.md).

    Modes. *Decoupled* (three policies, Hilton et al. 2022 arXiv:2110.00641; AReaL, Fu et al.
    2025 arXiv:2505.24298; verl "rollout_corr"): these weights correct mu -> pi_old, and the
    PPO ratio of the loss is ``pi_theta / pi_old``. *Bypass* (no recomputation): ``pi_old :=
    mu``, the weights are 1 and the PPO ratio ``pi_theta / mu`` carries the correction; see
    :func:`correct`, which returns the right anchor for either mode.

    Token truncation with ``C = 2`` is TIS (Yao et al. 2025, "Your Efficient RL Framework
    Secretly Brings You Off-Policy RL Training", fengyao.notion.site/off-policy-rl); token
    masking outside ``[0.5, 5]`` is IcePop (Ling team 2025: ``truncate=None, mask_low=0.5,
    mask_high=5``); verl's rollout correction (Rollout Importance Sampling ``rollout_is`` /
    Rejection Sampling ``rollout_rs``) has the token / sequence / geometric levels and the
    mean-k3 row rejection (``seq_k3_max``); OpenRLHF's ``seq-mask-tis`` is ``level="token",
    truncate=None, mask_level="geometric", mask_low=0.5, mask_high=5``; TRL's
    ``vllm_importance_sampling_mode`` ``token_truncate`` / ``token_mask`` / ``sequence_truncate``
    / ``sequence_mask`` with cap ``C`` is ``level`` in token / sequence with ``truncate=C`` or
    ``truncate=None, mask_high=C``.

    Numerics: computed in the compute dtype (float32 for half inputs) with row and segment sums
    accumulated in float64 (so padding columns do not change them); every log-weight is clamped
    at ``SAFE_LOG_WEIGHT = 20`` before ``exp``, so weights are finite for any finite input and
    ``loss * weights`` never has a NaN gradient. Values under ``mask == False`` (NaN and inf
    included) never matter. A valid token whose log-ratio is NaN / +-inf is rejected (with its
    unit at the sequence / geometric / segment levels) and counted in ``nonfinite_frac``: it
    is the sign of a broken engine, logged instead of propagated into the update. Empty rows get
    weight 0 and keep False. With ``old == behavior`` and the defaults, ``weights`` are 1 and
    ``keep == mask`` at every level. Weights depend only on their own row, so computing them per
    micro-batch of rows equals computing them on the whole batch.

    Args:
        old_logprobs: ``[B, T]`` float, pi_old (the trainer's recomputation).
        behavior_logprobs: ``[B, T]`` float, mu (the rollout engine's log-probs).
        mask: ``[B, T]`` bool, the valid (generated) tokens.
        level: ``"token"``, ``"sequence"``, ``"geometric"`` or ``"segment"``.
        segment_ids: ``[B, T]`` int turn id per token; required when ``level`` or
            ``mask_level`` is ``"segment"`` (and refused otherwise).
        truncate: cap ``C > 0`` on the weight (TIS), or ``None``.
        mask_low, mask_high: rejection bounds (> 0, ``mask_low <= mask_high``) or ``None``.
        seq_k3_max: reject rows whose mean per-token k3 exceeds it (> 0), or ``None``.
        reject: ``"token"`` (drop the rejected units) or ``"sequence"`` (drop the whole row of
            any rejected token).
        mask_level: the level whose weight the rejection bounds test (default ``level``).

    Returns:
        :class:`Correction` with ``metrics``: ``weight_mean`` (mean weight over kept tokens; 1
        if none), ``weight_max``, ``weight_ess_frac`` (``(sum w)^2 / (n sum w^2)`` over kept
        tokens), ``truncated_frac`` (valid tokens whose weight hit the cap),
        ``masked_token_frac`` (valid tokens not kept), ``masked_seq_frac`` (non-empty rows with
        no kept token), ``nonfinite_frac``.

    >>> old = torch.tensor([[-1.0, -1.0, -2.0]])
    >>> beh = torch.tensor([[-2.0, -1.0, -1.0]])
    >>> m = torch.tensor([[True, True, True]])
    >>> c = correction_weights(old, beh, m)                 # token TIS, C = 2
    >>> torch.allclose(c.weights, torch.tensor([[2.0, 1.0, math.exp(-1.0)]]))
    True
    >>> c = correction_weights(old, beh, m, truncate=None, mask_low=0.5, mask_high=2.0)   # IcePop-style
    >>> c.keep.tolist(), round(float(c.metrics["masked_token_frac"]), 4)
    ([[False, True, False]], 0.6667)
    >>> correction_weights(old, beh, m, level="geometric").weights.tolist()
    [[1.0, 1.0, 1.0]]
    """
    check_token_tensors(mask, old_logprobs=old_logprobs, behavior_logprobs=behavior_logprobs)
    mask_level = level if mask_level is None else mask_level
    _check_options(level, mask_level, segment_ids, mask, truncate, mask_low, mask_high, seq_k3_max, reject)
    dtype = compute_dtype(old_logprobs)
    lr, ok, bad = _safe_log_ratio(old_logprobs, behavior_logprobs, mask, dtype)
    seg = _segment_index(segment_ids, mask) if segment_ids is not None else None
    logw = _unit_log_weight(lr, ok, level, seg, dtype)
    logm = logw if mask_level == level else _unit_log_weight(lr, ok, mask_level, seg, dtype)
    rejected = _rejections(
        lr,
        ok,
        bad,
        mask,
        logm,
        mask_level=mask_level,
        level=level,
        seg=seg,
        log_low=_check_bound("mask_low", mask_low),
        log_high=_check_bound("mask_high", mask_high),
        seq_k3_max=seq_k3_max,
        reject=reject,
    )
    keep = mask & ~rejected
    log_cap = _check_bound("truncate", truncate)
    cap = SAFE_LOG_WEIGHT if log_cap is None else min(log_cap, SAFE_LOG_WEIGHT)
    zero = torch.zeros((), dtype=dtype, device=lr.device)
    weights = torch.where(keep, logw.clamp(max=cap).exp(), zero)
    truncated = keep & (logw > log_cap) if log_cap is not None else torch.zeros_like(keep)
    stats = _correction_stats(weights, keep, mask, truncated, bad)
    return Correction(weights, keep, reduce_correction_stats([stats]), stats)


def _correction_stats(
    weights: Tensor, keep: Tensor, mask: Tensor, truncated: Tensor, bad: Tensor
) -> dict[str, Tensor]:
    nonempty = mask.any(-1)
    max_w = weights.max() if weights.numel() else torch.zeros((), dtype=weights.dtype, device=weights.device)
    return {
        "n_valid": mask.sum(),
        "n_kept": keep.sum(),
        "n_truncated": truncated.sum(),
        "n_nonfinite": bad.sum(),
        "n_rows": nonempty.sum(),
        "n_rows_rejected": (nonempty & ~keep.any(-1)).sum(),
        "sum_weight": weights.sum(dtype=_F64),
        "sum_weight_sq": (weights * weights).sum(dtype=_F64),
        "max_weight": max_w.to(_F64),
    }


# --------------------------------------------------------------------------- modes


def correct(
    mode: str,
    behavior_logprobs: Tensor,
    mask: Tensor,
    old_logprobs: Tensor | None = None,
    **options,
) -> tuple[Tensor, Correction]:
    """The PPO anchor and the correction for one batch, in the ``"decoupled"`` or ``"bypass"`` mode.

    Returns ``(anchor_logprobs, correction)``: the trainer's PPO ratio is
    ``exp(logprobs - anchor_logprobs)``, its loss is multiplied by ``correction.weights`` and its
    mask ANDed with ``correction.keep``.

    * ``"decoupled"`` (three policies: mu -> pi_old -> pi_theta; Hilton et al. 2022, AReaL):
      ``old_logprobs`` is required; the anchor is ``old_logprobs`` and the correction is
      :func:`correction_weights` ``(old_logprobs, behavior_logprobs, mask, **options)``.
    * ``"bypass"`` (two policies, no recomputation of pi_old; verl's ``bypass_mode``): the
      anchor is ``behavior_logprobs`` (``pi_old := mu``), the weights are 1 on ``mask`` and
      ``keep == mask``: the PPO ratio ``pi_theta / mu`` (clipped) carries the whole correction.
      ``old_logprobs`` must be ``None`` and the rejection options (``mask_low``, ``mask_high``,
      ``seq_k3_max``) are refused: they need pi_old; ``level`` / ``truncate`` etc. are ignored.

    >>> beh = torch.tensor([[-1.0, -2.0]]); m = torch.tensor([[True, False]])
    >>> anchor, c = correct("bypass", beh, m)
    >>> anchor is beh, c.weights.tolist(), c.keep.tolist()
    (True, [[1.0, 0.0]], [[True, False]])
    >>> anchor, c = correct("decoupled", beh, m, old_logprobs=beh - 1.0, truncate=None)
    >>> round(float(c.weights[0, 0]), 4)
    0.3679
    """
    check_choice("mode", mode, ("decoupled", "bypass"))
    if mode == "decoupled":
        if old_logprobs is None:
            raise ValueError("old_logprobs: required in mode='decoupled' (use mode='bypass' without it)")
        return old_logprobs, correction_weights(old_logprobs, behavior_logprobs, mask, **options)
    if old_logprobs is not None:
        raise ValueError("old_logprobs: must be None in mode='bypass' (pi_old := behavior_logprobs)")
    for name in ("mask_low", "mask_high", "seq_k3_max"):
        if options.get(name) is not None:
            raise ValueError(f"{name}: rejection needs old_logprobs; use mode='decoupled'")
    check_token_tensors(mask, behavior_logprobs=behavior_logprobs)
    dtype = compute_dtype(behavior_logprobs)
    with torch.no_grad():
        weights = mask.to(dtype)
        none = torch.zeros_like(mask)
        stats = _correction_stats(weights, mask, mask, none, none)
    return behavior_logprobs, Correction(weights, mask, reduce_correction_stats([stats]), stats)


# --------------------------------------------------------------------------- statistics


def stat_reduce_op(key: str) -> str:
    """How a statistic of :func:`mismatch_stats` / ``Correction.stats`` is merged across pieces:
    ``"min"`` for ``min_*`` keys, ``"max"`` for ``max_*``, else ``"sum"`` (use the matching
    ``torch.distributed.ReduceOp`` in an ``all_reduce``)."""
    if key.startswith("min_"):
        return "min"
    if key.startswith("max_"):
        return "max"
    return "sum"


def _merge(stats: Sequence[dict[str, Tensor]]) -> dict[str, Tensor]:
    if not stats:
        raise ValueError("stats: need at least one dict of statistics")
    keys = stats[0].keys()
    for s in stats[1:]:
        if s.keys() != keys:
            raise ValueError(f"stats: every dict must have the keys {sorted(keys)}, got {sorted(s.keys())}")
    out = {}
    for k in keys:
        vals = torch.stack([s[k].detach() for s in stats])
        op = stat_reduce_op(k)
        out[k] = vals.amin() if op == "min" else vals.amax() if op == "max" else vals.sum()
    return out


def _ratio(num: Tensor, den: Tensor, empty: float) -> Tensor:
    """``num / den`` as float32, ``empty`` where ``den == 0``."""
    num, den = num.to(_F64), den.to(_F64)
    out = torch.where(den > 0, num / den.clamp(min=1e-300), torch.full_like(num, empty))
    return out.to(torch.float32)


def reduce_correction_stats(stats: Sequence[dict[str, Tensor]]) -> dict[str, Tensor]:
    """``Correction.metrics`` of the union of pieces, from their ``Correction.stats``: equal to
    the metrics of one call on the whole batch (up to float64 round-off).

    >>> m = torch.tensor([[True, True], [True, False]]); lp = torch.zeros(2, 2)
    >>> parts = [correction_weights(lp[i:i+1], lp[i:i+1] - 1.0, m[i:i+1]).stats for i in range(2)]
    >>> float(reduce_correction_stats(parts)["truncated_frac"])
    1.0
    """
    s = _merge(stats)
    n_kept, sw, sw2 = s["n_kept"], s["sum_weight"], s["sum_weight_sq"]
    return {
        "weight_mean": _ratio(sw, n_kept, 1.0),
        "weight_max": s["max_weight"].to(torch.float32),
        "weight_ess_frac": _ratio(sw * sw, n_kept.to(_F64) * sw2, 1.0),
        "truncated_frac": _ratio(s["n_truncated"], s["n_valid"], 0.0),
        "masked_token_frac": _ratio(s["n_valid"] - n_kept, s["n_valid"], 0.0),
        "masked_seq_frac": _ratio(s["n_rows_rejected"], s["n_rows"], 0.0),
        "nonfinite_frac": _ratio(s["n_nonfinite"], s["n_valid"], 0.0),
    }


_LOG_HALF, _LOG_TWO = math.log(0.5), math.log(2.0)
_LOG_09, _LOG_11 = math.log(0.9), math.log(1.1)


@torch.no_grad()
def mismatch_stats(trainer_logprobs: Tensor, behavior_logprobs: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """Sufficient statistics of :func:`mismatch_metrics` for one piece of a batch.

    Counts are int64, sums float64 (``sum_*``), extremes of the log-ratio ``min_*`` / ``max_*``
    (``+inf`` / ``-inf`` over an empty piece). Merge pieces (micro-batches, or ranks through
    ``torch.distributed.all_reduce`` with the op of :func:`stat_reduce_op`) and turn them into
    metrics with :func:`reduce_mismatch_stats`: the result equals the whole batch's metrics.

    >>> lp = torch.tensor([[-1.0, -2.0], [-1.0, -1.0]]); beh = lp - 0.1
    >>> m = torch.tensor([[True, True], [True, False]])
    >>> whole = mismatch_metrics(lp, beh, m)
    >>> parts = reduce_mismatch_stats([mismatch_stats(lp[:1], beh[:1], m[:1]), mismatch_stats(lp[1:], beh[1:], m[1:])])
    >>> all(torch.allclose(whole[k], parts[k]) for k in whole)
    True
    """
    check_token_tensors(mask, trainer_logprobs=trainer_logprobs, behavior_logprobs=behavior_logprobs)
    dtype = compute_dtype(trainer_logprobs)
    lr, ok, bad = _safe_log_ratio(trainer_logprobs, behavior_logprobs, mask, dtype)
    zero = torch.zeros((), dtype=dtype, device=lr.device)
    e = lr.clamp(max=SAFE_LOG_WEIGHT)
    w = torch.where(ok, e.exp(), zero)
    inf = torch.full((), math.inf, dtype=dtype, device=lr.device)
    if lr.numel():
        lo = torch.where(ok, lr, inf).amin()
        hi = torch.where(ok, lr, -inf).amax()
    else:
        lo, hi = inf, -inf
    absd = lr.abs()
    return {
        "n_valid": mask.sum(),
        "n": ok.sum(),
        "n_nonfinite": bad.sum(),
        "sum_neg_log_ratio": (-lr).sum(dtype=_F64),
        "sum_abs_log_ratio": absd.sum(dtype=_F64),
        "sum_k3": torch.where(ok, torch.expm1(e) - lr, zero).sum(dtype=_F64),
        "sum_ratio": w.sum(dtype=_F64),
        "sum_ratio_sq": (w * w).sum(dtype=_F64),
        "sum_mult_prob_error": torch.where(ok, absd.clamp(max=SAFE_LOG_WEIGHT).exp(), zero).sum(dtype=_F64),
        "n_out_0.5_2": (ok & ((lr < _LOG_HALF) | (lr > _LOG_TWO))).sum(),
        "n_out_0.9_1.1": (ok & ((lr < _LOG_09) | (lr > _LOG_11))).sum(),
        "min_log_ratio": lo.to(_F64),
        "max_log_ratio": hi.to(_F64),
    }


def reduce_mismatch_stats(stats: Sequence[dict[str, Tensor]]) -> dict[str, Tensor]:
    """:func:`mismatch_metrics` of the union of pieces, from their :func:`mismatch_stats`."""
    s = _merge(stats)
    n = s["n"]
    empty = n == 0
    lo = s["min_log_ratio"].clamp(max=SAFE_LOG_WEIGHT)
    hi = s["max_log_ratio"].clamp(max=SAFE_LOG_WEIGHT)
    one = torch.ones((), dtype=_F64, device=lo.device)
    absmax = torch.maximum(s["max_log_ratio"].abs(), s["min_log_ratio"].abs())
    sr = s["sum_ratio"]
    return {
        "k1": _ratio(s["sum_neg_log_ratio"], n, 0.0),
        "k3": _ratio(s["sum_k3"], n, 0.0),
        "ess_frac": _ratio(sr * sr, n.to(_F64) * s["sum_ratio_sq"], 1.0),
        "ratio_out_0.5_2": _ratio(s["n_out_0.5_2"], n, 0.0),
        "ratio_out_0.9_1.1": _ratio(s["n_out_0.9_1.1"], n, 0.0),
        "ratio_min": torch.where(empty, one, lo.exp()).to(torch.float32),
        "ratio_max": torch.where(empty, one, hi.exp()).to(torch.float32),
        "ratio_mean": _ratio(sr, n, 1.0),
        "mult_prob_error": _ratio(s["sum_mult_prob_error"], n, 1.0),
        "logp_abs_diff_mean": _ratio(s["sum_abs_log_ratio"], n, 0.0),
        "logp_abs_diff_max": torch.where(empty, 0 * one, absmax).to(torch.float32),
        "nonfinite_frac": _ratio(s["n_nonfinite"], s["n_valid"], 0.0),
    }


def mismatch_metrics(trainer_logprobs: Tensor, behavior_logprobs: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """Diagnostics of the trainer / rollout-engine mismatch over the valid tokens.

    With ``d_t = log pi_t - log mu_t`` (``pi`` = ``trainer_logprobs``, ``mu`` =
    ``behavior_logprobs``) and ``r_t = e^{d_t}`` over the ``n`` valid tokens whose ``d_t`` is
    finite::

        k1                = mean(-d_t)                 KL(mu || pi), k1 estimator (may be < 0)
        k3                = mean((r_t - 1) - d_t)      KL(mu || pi), k3 estimator (>= 0)
        ess_frac          = (sum r)^2 / (n sum r^2)    effective sample size / n, in (0, 1]
        ratio_out_0.5_2   = share of r_t outside [0.5, 2];   ratio_out_0.9_1.1: outside [0.9, 1.1]
        ratio_min / ratio_max / ratio_mean
        mult_prob_error   = mean(exp|d_t|)             NeMo-RL's token_mult_prob_error (>= 1)
        logp_abs_diff_mean / logp_abs_diff_max = mean / max |d_t|   (TRL's sampling_logp_difference)
        nonfinite_frac    = share of valid tokens whose d_t is NaN / +-inf (left out of the rest)

    Both KL estimators are of ``KL(mu || pi)``, the direction the samples (drawn from ``mu``)
    estimate without bias (Schulman 2020, "Approximating KL divergence"). NeMo-RL computes
    ``token_mult_prob_error`` as the masked mean of ``exp(|generation_logprobs -
    prev_logprobs|)`` (its ``ClippedPGLossFn``; docs/guides/grpo.md "Metrics"): 1 when the
    engines agree. Exponentials use ``d_t`` clamped at ``SAFE_LOG_WEIGHT``. Over no valid
    token: KLs, shares and differences 0; ``ess_frac``, ratios and ``mult_prob_error`` 1.
    Prefix the keys as you like (the trainers log ``mismatch/<key>``).

    >>> lp = torch.tensor([[-1.0, -2.0, -3.0]])
    >>> out = mismatch_metrics(lp, lp, torch.tensor([[True, True, False]]))
    >>> float(out["k3"]), float(out["ess_frac"]), float(out["mult_prob_error"])
    (0.0, 1.0, 1.0)
    """
    return reduce_mismatch_stats([mismatch_stats(trainer_logprobs, behavior_logprobs, mask)])
