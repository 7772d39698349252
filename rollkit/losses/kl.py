"""KL(pi_theta || pi_ref) per token: estimators, a KL loss term, a KL reward penalty, controllers.

Sign convention (Schulman, 2020, "Approximating KL divergence",
http://joschu.net/blog/kl-approx.html): tokens are sampled from pi_theta and

    log r = ref_logprobs - logprobs          (r = pi_ref / pi_theta)

    k1 = -log r           = logprobs - ref_logprobs    unbiased for KL, can be < 0, high variance
    k2 = 0.5 * (log r)^2                               biased, >= 0, its gradient is the right one
    k3 = (r - 1) - log r                               unbiased, >= 0, low variance ("low_var_kl")

All three have expectation (k1, k3) or approximately (k2) KL(pi_theta || pi_ref) under
pi_theta. Their *gradients* differ: as a loss term on on-policy samples, only k2's expected
gradient is the gradient of KL(pi_theta || pi_ref) (the gradient of k1 has zero mean, that of k3
is the gradient of the reverse KL(pi_ref || pi_theta) to first order). The straight-through
variants ``"k1+"`` / ``"k3+"`` (verl's ``kl_penalty="k3+"``, ``"low_var_kl+"``) return the
value of k1 / k3 with the gradient of k2: ``k2 - sg(k2) + sg(k)``, computed as
``sg(d) * z + sg(k)`` with ``d = logprobs - ref_logprobs`` and ``z = (logprobs -
sg(logprobs)) - (ref_logprobs - sg(ref_logprobs))``, a zero with the derivative of ``d`` (the
same value and first derivative, without forming ``k2 = d^2 / 2``, whose overflow made ``inf -
inf = NaN``).

Non-finite log-probs (NaN, ``+-inf``) are not clamped into finite numbers: an estimate with a
non-finite log-prob is NaN (k3, k3+, k1+) or the infinite / NaN difference itself (k1, k2), in
value and gradient. Finite log-ratios beyond ``+-MAX_LOG_RATIO`` are clamped by k3 as
documented. The loss terms below read no values (no device synchronisation), so a NaN / inf
log-prob at a valid token shows up as a non-finite loss there; entries where ``mask`` is
False are ignored (zeroed first).

Numerics: finite log-probs of any magnitude give the float64 result rounded to the dtype
(``inf`` only where that result is out of range), never NaN: k2 is ``(0.5 d) d`` (``d^2``
alone overflows float32 above ``1.8e19``), k3 clamps a log-ratio that overflows (``3e38 -
(-3e38)``) like any other beyond 20, the straight-through gradient is ``d`` clamped to the
dtype's largest finite value. The loss terms fold ``coef`` in before squaring (``coef * k2 =
(2 coef h) h`` with ``h = logprobs / 2 - ref_logprobs / 2``, which cannot overflow), so
``coef = 0.001`` times a huge k2 is finite when the float64 product is, and ``coef = 0``
gives exactly 0 for finite input (not ``0 * inf = NaN``).

Half precision (bfloat16 / float16 inputs): every estimate is the float32 one of the same
values rounded once to the inputs' dtype, value and gradient. k2 and k3 compute in float32
and cast back; k1, the k1+ value and the straight-through gradient ``d`` are one subtraction
in the inputs' dtype, which torch carries out in float32 and rounds once. The loss terms (:func:`kl_loss`, :func:`kl_penalty`,
:func:`apply_kl_penalty`) upcast first and return float32, equal to the upcast inputs' result
(tested in ``tests/test_half_precision.py``).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from rollkit.keys import KL_LOSS, LOGPROBS, REF_LOGPROBS, RESPONSE_MASK
from rollkit.losses._common import check_token_tensors, compute_dtype, masked_stat, zero_outside
from rollkit.ops import masked_mean
from rollkit.registry import KL_ESTIMATORS, REGULARIZERS
from rollkit.types import LossOutput
from rollkit.validation import (
    InvalidTypeError,
    check_choice,
    check_finite,
    check_float,
    check_positive,
    check_real,
    check_same_device,
    check_same_shape,
)

__all__ = [
    "AdaptiveKLController",
    "FixedKLController",
    "KL_ESTIMATOR_NAMES",
    "MAX_LOG_RATIO",
    "apply_kl_penalty",
    "kl_estimate",
    "kl_k1",
    "kl_k1_plus",
    "kl_k2",
    "kl_k3",
    "kl_k3_plus",
    "kl_loss",
    "kl_penalty",
]

#: ``|log r|`` is clamped to this before ``exp`` in k3 (as verl does), so that ``r`` stays
#: finite (e^20 ~ 4.9e8) and so does the gradient. This holds because k3 computes in at least
#: float32 (half-precision inputs are upcast first): in float16 itself ``exp`` would overflow
#: (to inf, and a NaN gradient) for log-ratios above ~11.1.
MAX_LOG_RATIO = 20.0


def _check_pair(logprobs: Tensor, ref_logprobs: Tensor) -> None:
    check_float("logprobs", logprobs)
    check_float("ref_logprobs", ref_logprobs)
    check_same_shape("ref_logprobs", ref_logprobs, "logprobs", logprobs)


def _zero_with_grad_of_d(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """``(logprobs - sg(logprobs)) - (ref_logprobs - sg(ref_logprobs))``: exactly 0 for finite
    inputs (also where ``logprobs - ref_logprobs`` overflows), NaN for non-finite ones (which
    then propagate), with the derivative of ``d = logprobs - ref_logprobs``."""
    return (logprobs - logprobs.detach()) - (ref_logprobs - ref_logprobs.detach())


def _finite(g: Tensor) -> Tensor:
    """``g`` clamped to the dtype's finite range (NaN stays NaN)."""
    big = torch.finfo(g.dtype).max
    return g.clamp(-big, big)


def _k2_grad_with_value_of(k: Tensor, logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """Value ``k``, gradient of ``k2 = d^2 / 2``: ``sg(d) * z + sg(k)`` with ``z`` a zero with the
    derivative of ``d`` (:func:`_zero_with_grad_of_d`): the value is exactly ``k`` for finite
    inputs (also where ``d^2``, or ``d`` itself, overflows) and NaN for non-finite ones. Where
    ``d`` overflows (``|d| > 3.4e38`` in float32) the gradient is the dtype's largest value."""
    d = (logprobs - ref_logprobs).detach()
    return _finite(d) * _zero_with_grad_of_d(logprobs, ref_logprobs) + k.detach()


@KL_ESTIMATORS.register(
    "k1", aliases=["kl"], in_keys={"logprobs": LOGPROBS, "ref_logprobs": REF_LOGPROBS}, out_keys=["kl"]
)
def kl_k1(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k1 estimator of KL(pi_theta || pi_ref) per token: ``logprobs - ref_logprobs``.

        k1 = -log r = log pi_theta(y_t) - log pi_ref(y_t)

    Schulman (2020), "Approximating KL divergence". Unbiased, but can be negative and has the
    highest variance of the three; the usual *reward* penalty (Ziegler et al., 2019,
    arXiv:1909.08593; verl ``kl_penalty="kl"``, OpenRLHF ``k1``). As a loss its gradient is
    ``grad log pi_theta``, zero in expectation: use ``"k1+"`` or ``"k2"`` in a loss instead.

    Shapes: ``[*]`` and ``[*]`` -> ``[*]``.

    >>> kl_k1(torch.tensor([-1.0, -2.0]), torch.tensor([-2.0, -1.0]))
    tensor([ 1., -1.])
    """
    _check_pair(logprobs, ref_logprobs)
    return logprobs - ref_logprobs


@KL_ESTIMATORS.register(
    "k2", aliases=["mse"], in_keys={"logprobs": LOGPROBS, "ref_logprobs": REF_LOGPROBS}, out_keys=["kl"]
)
def kl_k2(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k2 estimator of KL(pi_theta || pi_ref) per token: ``0.5 * (logprobs - ref_logprobs)^2``.

        k2 = 0.5 * (log r)^2,   log r = ref_logprobs - logprobs

    Schulman (2020), "Approximating KL divergence". Always ``>= 0`` and low variance, biased
    for large KL; its gradient ``(log pi_theta - log pi_ref) * grad log pi_theta`` is, in
    expectation on-policy, the gradient of KL(pi_theta || pi_ref), which is why the
    straight-through ``"k1+"`` / ``"k3+"`` borrow it. verl ``kl_penalty="mse"``.

    Half-precision inputs are computed in float32 and the result is cast back to the input
    dtype (as :func:`kl_k3`): one rounding, so the value is the float32 one rounded to the
    dtype (in bfloat16 itself, ``d`` and ``d * d`` were rounded twice, up to ~3 half-ulps off);
    the gradient is ``d`` rounded once.

    Shapes: ``[*]`` and ``[*]`` -> ``[*]``.

    >>> kl_k2(torch.tensor([-1.0, -2.0]), torch.tensor([-2.0, -1.0]))
    tensor([0.5000, 0.5000])
    """
    _check_pair(logprobs, ref_logprobs)
    out_dtype = torch.promote_types(logprobs.dtype, ref_logprobs.dtype)
    dtype = torch.promote_types(out_dtype, torch.float32)
    d = logprobs.to(dtype) - ref_logprobs.to(dtype)
    # not 0.5 * d^2: d^2 overflows float32 for |d| > 1.8e19, k2 only above 2.6e19
    return ((0.5 * d) * d).to(out_dtype)


def kl_k3(logprobs: Tensor, ref_logprobs: Tensor, *, clamp: float | None = 10.0) -> Tensor:
    """k3 ("low-variance") estimator of KL(pi_theta || pi_ref) per token.

        k3 = (r - 1) - log r,   log r = clamp(ref_logprobs - logprobs, -20, 20),  then
        k3 = min(k3, clamp)     unless clamp is None

    Schulman (2020), "Approximating KL divergence"; the GRPO KL term (Shao et al., 2024,
    arXiv:2402.03300) and verl's ``low_var_kl``. Unbiased and ``>= 0`` (``x - 1 >= log x``),
    ``0`` iff ``logprobs == ref_logprobs``; lower variance than k1. The log-ratio is clamped
    to ``[-MAX_LOG_RATIO, MAX_LOG_RATIO] = [-20, 20]`` so that ``exp`` stays finite; the value
    is then clamped to ``[0, clamp]`` (verl clamps to ``[-10, 10]``; k3 is never negative, so
    this is the same). Clamped tokens pass no gradient. A non-finite log-prob (NaN or
    ``+-inf``) is not clamped: the estimate is NaN there; finite log-probs whose difference
    overflows are clamped like any other large log-ratio. Half-precision inputs are
    computed in float32 (so the clamp keeps ``exp`` and the gradient finite) and the result is
    cast back to the input dtype.

    Shapes: ``[*]`` and ``[*]`` -> ``[*]``.

    >>> import math
    >>> k = kl_k3(torch.tensor([0.0, -1.0]), torch.tensor([-1.0, -1.0]))
    >>> torch.allclose(k, torch.tensor([math.exp(-1.0) - 1.0 + 1.0, 0.0]))
    True
    """
    _check_pair(logprobs, ref_logprobs)
    if clamp is not None:
        check_positive("clamp", clamp)
    out_dtype = torch.promote_types(logprobs.dtype, ref_logprobs.dtype)
    dtype = torch.promote_types(out_dtype, torch.float32)
    raw = ref_logprobs.to(dtype) - logprobs.to(dtype)
    # NaN where a log-prob is not finite, so the clamp cannot turn +-inf into +-20; 0 where both
    # are finite, also where their difference overflows (3e38 - (-3e38) is clamped like 21)
    lp, ref = logprobs.to(dtype), ref_logprobs.to(dtype)
    log_r = raw.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO) + ((lp - lp) + (ref - ref))
    k = torch.expm1(log_r) - log_r
    k = k if clamp is None else k.clamp(max=clamp)
    return k.to(out_dtype)


def kl_k1_plus(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """Straight-through k1: the value of k1, the gradient of k2.

        k1+ = k2 - sg(k2) + sg(k1)

    verl ``kl_penalty="k1+"``. Use it as a KL *loss* when you want to log an unbiased KL value
    but need the gradient of KL(pi_theta || pi_ref) (which k1's own gradient is not).

    Shapes: ``[*]`` and ``[*]`` -> ``[*]``.

    >>> lp = torch.tensor([-1.0, -2.0], requires_grad=True)
    >>> k = kl_k1_plus(lp, torch.tensor([-2.0, -1.0]))
    >>> k.detach()
    tensor([ 1., -1.])
    >>> k.sum().backward(); lp.grad   # d k2 / d logprobs = logprobs - ref_logprobs
    tensor([ 1., -1.])
    """
    _check_pair(logprobs, ref_logprobs)
    return _k2_grad_with_value_of(logprobs - ref_logprobs, logprobs, ref_logprobs)


def kl_k3_plus(logprobs: Tensor, ref_logprobs: Tensor, *, clamp: float | None = 10.0) -> Tensor:
    """Straight-through k3: the value of :func:`kl_k3` (clamped as there), the gradient of k2.

        k3+ = k2 - sg(k2) + sg(k3)

    verl ``kl_penalty="k3+"`` / ``"low_var_kl+"``. Low-variance, non-negative value, and the
    gradient of KL(pi_theta || pi_ref) in expectation; unlike clamped k3, every token passes
    gradient (the k2 gradient is not clamped).

    Shapes: ``[*]`` and ``[*]`` -> ``[*]``.

    >>> lp = torch.tensor([0.0, -1.0], requires_grad=True)
    >>> ref = torch.tensor([-1.0, -1.0])
    >>> torch.allclose(kl_k3_plus(lp, ref), kl_k3(lp, ref))
    True
    """
    _check_pair(logprobs, ref_logprobs)
    return _k2_grad_with_value_of(kl_k3(logprobs, ref_logprobs, clamp=clamp), logprobs, ref_logprobs)


_IN = {"logprobs": LOGPROBS, "ref_logprobs": REF_LOGPROBS}
KL_ESTIMATORS.register("k3", kl_k3, aliases=["low_var_kl"], in_keys=_IN, out_keys=["kl"])
KL_ESTIMATORS.register("k1+", kl_k1_plus, aliases=["kl+"], in_keys=_IN, out_keys=["kl"])
KL_ESTIMATORS.register("k3+", kl_k3_plus, aliases=["low_var_kl+"], in_keys=_IN, out_keys=["kl"])

#: Canonical estimator names (aliases: ``kl`` = k1, ``mse`` = k2, ``low_var_kl`` = k3, ``kl+``
#: = k1+, ``low_var_kl+`` = k3+; ``k2+`` is k2 itself).
KL_ESTIMATOR_NAMES: tuple[str, ...] = ("k1", "k2", "k3", "k1+", "k3+")
_ALIASES = {"kl": "k1", "mse": "k2", "low_var_kl": "k3", "kl+": "k1+", "low_var_kl+": "k3+", "k2+": "k2"}


def kl_estimate(
    logprobs: Tensor,  # [*]
    ref_logprobs: Tensor,  # [*]
    *,
    estimator: str = "k3",
    clamp: float | None = 10.0,
) -> Tensor:  # [*]
    """Per-token KL(pi_theta || pi_ref) with the estimator named ``estimator``.

    One of ``"k1"``, ``"k2"``, ``"k3"``, ``"k1+"``, ``"k3+"`` (or the verl aliases ``"kl"``,
    ``"mse"``, ``"low_var_kl"``, ``"kl+"``, ``"low_var_kl+"``, ``"k2+"``); see
    :func:`kl_k1`, :func:`kl_k2`, :func:`kl_k3` and the straight-through :func:`kl_k1_plus`,
    :func:`kl_k3_plus` (Schulman, 2020). ``clamp`` is used by k3 and k3+ only.

    >>> kl_estimate(torch.tensor([-1.0]), torch.tensor([-2.0]), estimator="mse")
    tensor([0.5000])
    """
    name = _ALIASES.get(estimator, estimator)
    check_choice("estimator", name, [*KL_ESTIMATOR_NAMES, *_ALIASES])
    if name == "k1":
        return kl_k1(logprobs, ref_logprobs)
    if name == "k2":
        return kl_k2(logprobs, ref_logprobs)
    if name == "k3":
        return kl_k3(logprobs, ref_logprobs, clamp=clamp)
    if name == "k1+":
        return kl_k1_plus(logprobs, ref_logprobs)
    return kl_k3_plus(logprobs, ref_logprobs, clamp=clamp)


def _check_token_inputs(logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor) -> None:
    check_token_tensors(mask, logprobs=logprobs, ref_logprobs=ref_logprobs)


def _masked_kl(
    logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor, *, coef: float, estimator: str, clamp: float | None
) -> tuple[Tensor, Tensor]:
    """``(k, coef * k)``: the validated per-token estimate and its product with ``coef``, on
    inputs zeroed outside the mask, so that padding (even NaN / inf) never reaches a value or
    a gradient. Computed (and returned) in ``compute_dtype`` (float32 for half-precision
    inputs); ``ref_logprobs`` is detached (a constant). ``coef * k`` is formed without an
    intermediate overflow (:func:`_coef_times`)."""
    _check_token_inputs(logprobs, ref_logprobs, mask)
    check_positive("coef", coef, allow_zero=True)
    name = _ALIASES.get(estimator, estimator)
    check_choice("estimator", name, [*KL_ESTIMATOR_NAMES, *_ALIASES])
    dtype = compute_dtype(logprobs)
    lp = zero_outside(logprobs.to(dtype), mask)
    ref = zero_outside(ref_logprobs.detach().to(dtype), mask)
    k = kl_estimate(lp, ref, estimator=name, clamp=clamp)
    return k, _coef_times(k, lp, ref, name, float(coef))


def _coef_times(k: Tensor, logprobs: Tensor, ref_logprobs: Tensor, name: str, coef: float) -> Tensor:
    """``coef * k`` (value and gradient) for the estimator ``name`` whose estimate is ``k``,
    with ``coef`` folded in before anything is squared: ``h = logprobs / 2 - ref_logprobs / 2``
    never overflows for finite inputs, ``coef * k1 = 2 coef h``, ``coef * k2 = (2 coef h) h``,
    the straight-through gradient ``coef * d = 2 coef h`` (clamped to the finite range). So
    the product is the float64 one rounded, and exactly 0 for ``coef = 0`` and finite inputs
    (NaN for non-finite ones, as ``0 * k``)."""
    if name == "k3":
        return coef * k
    h = logprobs / 2 - ref_logprobs / 2
    g = (2.0 * coef) * h
    if name == "k1":
        return g
    z = _zero_with_grad_of_d(logprobs, ref_logprobs)
    if name == "k2":
        # coef * (0.5 d) d (bit for bit coef * k) where k is finite; where it overflowed, the
        # value (2 coef h) h with the gradient coef * d (clamped to the finite range: autograd
        # through g * h would add two halves of it and overflow first). d is zeroed there, so
        # no infinite derivative meets where's zero gradient (0 * inf = NaN).
        fin = torch.isfinite(k.detach())
        d = torch.where(fin, logprobs - ref_logprobs, torch.zeros((), dtype=h.dtype, device=h.device))
        return torch.where(fin, coef * ((0.5 * d) * d), _finite(g.detach()) * z + (g * h).detach())
    value = g if name == "k1+" else coef * k
    return _finite(g.detach()) * z + value.detach()


@REGULARIZERS.register(
    "kl",
    aliases=("kl_loss", "kl-loss"),
    in_keys={"logprobs": LOGPROBS, "ref_logprobs": REF_LOGPROBS, "mask": RESPONSE_MASK},
    out_keys=[KL_LOSS],
)
def kl_loss(
    logprobs: Tensor,  # [B, T], carries the gradient
    ref_logprobs: Tensor,  # [B, T]
    mask: Tensor,  # [B, T] bool
    *,
    estimator: str = "k3",
    coef: float = 1.0,
    clamp: float | None = 10.0,
) -> LossOutput:
    """KL(pi_theta || pi_ref) as a loss term: ``L_t = coef * k(logprobs_t, ref_logprobs_t)``.

    The GRPO way of regularising towards the reference (Shao et al., 2024, arXiv:2402.03300,
    with k3 and beta = 0.04; verl ``use_kl_loss`` with ``kl_loss_coef=0.001``,
    ``kl_loss_type="low_var_kl"``), as opposed to :func:`apply_kl_penalty`, which subtracts
    the KL from the rewards (PPO-RLHF, Ziegler et al., 2019). For the gradient of the true KL
    prefer ``"k3+"`` / ``"k2"`` (see the module docstring). Aggregate with
    :func:`rollkit.losses.aggregate` like any other loss and add it to the policy loss.

    Registered in ``rollkit.registry.REGULARIZERS`` as ``"kl"`` (writes ``"kl_loss"``).

    Returns ``LossOutput(loss [B, T] (0 where mask is False), metrics)`` with metrics
    ``"kl"`` (token-mean of the estimate over the mask, before ``coef``) and ``"kl_coef"``.
    A fully masked batch gives a zero loss and ``kl = 0``. ``ref_logprobs`` is a constant
    (detached: it never receives a gradient). As the policy losses, half-precision inputs are
    upcast and the loss is returned in float32.

    >>> lp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    >>> out = kl_loss(lp, torch.tensor([[-1.0, -1.0]]), torch.tensor([[True, False]]), estimator="k2")
    >>> out.loss
    tensor([[0., 0.]], grad_fn=<WhereBackward0>)
    >>> out.metrics["kl"]
    tensor(0.)
    """
    k, coef_k = _masked_kl(logprobs, ref_logprobs, mask, coef=coef, estimator=estimator, clamp=clamp)
    loss = zero_outside(coef_k, mask)
    metrics = {
        "kl": masked_stat(k, mask),
        "kl_coef": torch.tensor(float(coef), dtype=k.dtype, device=k.device),
    }
    return LossOutput(loss, metrics)


def kl_penalty(
    logprobs: Tensor,  # [B, T] (usually the rollout / old policy's log-probs)
    ref_logprobs: Tensor,  # [B, T]
    mask: Tensor,  # [B, T] bool
    *,
    coef: float,
    estimator: str = "k1",
    clamp: float | None = 10.0,
) -> Tensor:  # [B, T]
    """Per-token KL penalty ``coef * k(logprobs, ref_logprobs)``, zero where mask is False.

    The term that PPO-RLHF subtracts from the rewards (Ziegler et al., 2019,
    arXiv:1909.08593; Ouyang et al., 2022, arXiv:2203.02155): ``r_t - coef * KL_t``. It is a
    plain tensor function (gradients flow through ``logprobs`` if it has them; ``ref_logprobs``
    is detached); :func:`apply_kl_penalty` builds the penalised rewards from it without
    gradient. Half-precision inputs are upcast: the result is float32 (``compute_dtype``).

    >>> kl_penalty(torch.tensor([[-1.0, -1.0]]), torch.tensor([[-2.0, 0.0]]), torch.tensor([[True, False]]), coef=0.1)
    tensor([[0.1000, 0.0000]])
    """
    _, coef_k = _masked_kl(logprobs, ref_logprobs, mask, coef=coef, estimator=estimator, clamp=clamp)
    return zero_outside(coef_k, mask)


def _last_token_index(mask: Tensor) -> Tensor:
    """Index of the last True of each row (0 for an empty row). ``[B]`` int64."""
    T = mask.shape[-1]
    pos = torch.arange(T, device=mask.device).expand_as(mask)
    return torch.where(mask, pos, torch.full_like(pos, -1)).amax(dim=-1).clamp(min=0)


def apply_kl_penalty(
    rewards: Tensor,  # [B] sequence rewards, or [B, T] token rewards
    logprobs: Tensor,  # [B, T] log-probs of the sampling (old) policy
    ref_logprobs: Tensor,  # [B, T]
    mask: Tensor,  # [B, T] bool
    *,
    coef: float,
    estimator: str = "k1",
    clamp: float | None = 10.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Penalised token rewards ``r_t - coef * KL_t`` for PPO-RLHF (no gradient).

        token_rewards[b, t] = R_b * [t == last valid token of b] - coef * k(logprobs, ref_logprobs)[b, t]

    (Ziegler et al., 2019, arXiv:1909.08593; Stiennon et al., 2020, arXiv:2009.01325). A
    ``[B]`` reward is placed on the last valid token of its row (the last True of ``mask``,
    which also handles interior holes); a ``[B, T]`` reward is used as is (masked). The
    result is detached and exactly 0 where ``mask`` is False; a row with no valid token has
    nowhere to put its reward and is all zero (so is every row when ``T = 0``: the result is
    ``[B, 0]``). ``coef`` must be ``>= 0`` (a negative one would turn the penalty into a
    bonus); ``rewards`` must be finite (a value check) and on the device of ``mask``.

    Metrics (detached 0-dim tensors): ``"kl"``, the mean over non-empty rows of the per-row
    token-mean KL (what verl / OpenRLHF feed to :class:`AdaptiveKLController`);
    ``"kl_seq_sum"``, the mean over non-empty rows of the per-row summed KL (the sequence KL
    of Ziegler et al. / TRL); ``"kl_coef"``. 0 when no row has a token.

    >>> rewards = torch.tensor([1.0, 0.0])
    >>> lp = torch.tensor([[-1.0, -1.0, 0.0], [-1.0, -1.0, 0.0]])
    >>> ref = torch.tensor([[-2.0, -1.0, 0.0], [-1.0, -3.0, 0.0]])
    >>> mask = torch.tensor([[True, True, False], [True, True, True]])
    >>> tr, m = apply_kl_penalty(rewards, lp, ref, mask, coef=0.5)
    >>> tr
    tensor([[-0.5000,  1.0000,  0.0000],
            [ 0.0000, -1.0000,  0.0000]])
    >>> torch.allclose(m["kl"], torch.tensor((0.5 + 2 / 3) / 2))
    True
    """
    _check_token_inputs(logprobs, ref_logprobs, mask)
    check_positive("coef", coef, allow_zero=True)
    check_float("rewards", rewards)
    check_same_device("rewards", rewards, "mask", mask)
    check_finite("rewards", rewards)
    with torch.no_grad():
        lp, ref = logprobs.detach(), ref_logprobs.detach()
        pen = kl_penalty(lp, ref, mask, coef=1.0, estimator=estimator, clamp=clamp)
        # coef folded in before squaring (k2 times a small coef stays finite where it should)
        pen_c = pen if coef == 1.0 else kl_penalty(lp, ref, mask, coef=coef, estimator=estimator, clamp=clamp)
        B, T = mask.shape
        zero = torch.zeros((), dtype=pen.dtype, device=pen.device)
        if rewards.ndim == 1:
            if rewards.shape[0] != B:
                raise ValueError(f"rewards: has {rewards.shape[0]} entries but mask has {B} rows")
            placed = torch.zeros((B, T), dtype=pen.dtype, device=pen.device)
            if T > 0:  # with T = 0 no row has a token to carry its reward
                last = _last_token_index(mask)
                placed = placed.scatter(1, last.unsqueeze(1), rewards.detach().to(pen.dtype).unsqueeze(1))
        elif rewards.shape == mask.shape:
            placed = rewards.detach().to(pen.dtype)
        else:
            raise ValueError(
                f"rewards: expected shape [B]={[B]} or [B, T]={[B, T]}, got {list(rewards.shape)}"
            )
        token_rewards = torch.where(mask, placed - pen_c, zero)
        nonempty = mask.any(-1)
        # overflow-free sums and means (rollkit.ops): huge per-token KLs of both signs (k1)
        # must not turn a representable row sum into inf - inf = NaN
        row_mean = masked_mean(pen, mask, dim=-1, empty_value=0.0)
        # the mean over rows of the row sums is the token mean times tokens per row: no row
        # sum is formed (one could overflow though their mean does not)
        n_rows, n_tokens = nonempty.sum().to(pen.dtype), mask.sum().to(pen.dtype)
        seq_sum = masked_mean(pen, mask, empty_value=0.0) * (n_tokens / n_rows.clamp(min=1))
        metrics = {
            "kl": masked_mean(row_mean, nonempty, empty_value=0.0),
            "kl_seq_sum": seq_sum,
            "kl_coef": torch.tensor(float(coef), dtype=pen.dtype, device=pen.device),
        }
    return token_rewards, metrics


# --------------------------------------------------------------------------- controllers


def _as_float(name: str, x: float | Tensor) -> float:
    """A finite real scalar from a number or a real 1-element tensor (any device but meta);
    every other input raises naming ``name`` (a wrong type or dtype: ``InvalidTypeError``)."""
    if isinstance(x, Tensor):
        if x.is_complex() or x.dtype == torch.bool:
            raise InvalidTypeError(
                f"{name}: expected a real number or a real 1-element tensor, got dtype {x.dtype}"
            )
        if x.numel() != 1:
            raise ValueError(f"{name}: expected a number or a 1-element tensor, got shape {list(x.shape)}")
        if x.is_meta:
            raise ValueError(f"{name}: is on the meta device, which holds no value to read")
        v = float(x.detach().reshape(()).to(torch.float64))
    else:
        v = check_real(name, x)
    if not math.isfinite(v):
        raise ValueError(f"{name}: must be finite, got {v}")
    return v


def _check_n_steps(n_steps: object) -> float:
    """``n_steps``: a finite real number ``>= 0`` (the number of samples the KL was measured
    on; ``check_positive``'s messages)."""
    n = check_real("n_steps", n_steps)
    check_positive("n_steps", n_steps, allow_zero=True)
    if not math.isfinite(n):
        raise ValueError(f"n_steps: must be finite, got {n_steps}")
    return n


class FixedKLController:
    """A constant KL coefficient, with the interface of :class:`AdaptiveKLController`.

    >>> ctl = FixedKLController(0.05)
    >>> ctl.update(3.0, n_steps=256)
    0.05
    """

    def __init__(self, coef: float) -> None:
        check_positive("coef", coef, allow_zero=True)
        self.value = float(coef)

    def update(self, current_kl: float | Tensor, n_steps: int) -> float:
        """No-op (the arguments are checked as :meth:`AdaptiveKLController.update` checks
        them); returns the coefficient."""
        _as_float("current_kl", current_kl)
        _check_n_steps(n_steps)
        return self.value

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_positive("state['value']", _as_float("state['value']", state["value"]), allow_zero=True)
        self.value = float(state["value"])

    def __repr__(self) -> str:
        return f"FixedKLController(coef={self.value})"


class AdaptiveKLController:
    """Adaptive KL coefficient of Ziegler et al. (2019, arXiv:1909.08593), section 2.2.

        e     = clip(current_kl / target - 1, -0.2, 0.2)
        beta <- beta * (1 + e * n_steps / horizon)

    A proportional controller that drives the observed KL towards ``target``: the coefficient
    grows when the KL is above target, shrinks when below, by at most a factor ``1 +- 0.2 *
    n_steps / horizon`` per update. ``n_steps`` is the number of samples (episodes) the KL was
    measured on (the batch size in verl / OpenRLHF / TRL). ``current_kl`` is the sequence KL in
    the paper; verl and OpenRLHF pass the token-mean KL (``metrics["kl"]`` of
    :func:`apply_kl_penalty`), TRL the summed one (``metrics["kl_seq_sum"]``). Its state is
    ``value``; save it with :meth:`state_dict`.

    >>> ctl = AdaptiveKLController(0.1, target=6.0, horizon=10000)
    >>> ctl.update(12.0, n_steps=500)   # error clipped to 0.2: 0.1 * (1 + 0.2 * 0.05)
    0.101
    >>> ctl.state_dict()
    {'value': 0.101, 'target': 6.0, 'horizon': 10000.0}
    """

    def __init__(self, init_coef: float, target: float, horizon: float) -> None:
        check_positive("init_coef", init_coef, allow_zero=True)
        check_positive("target", target)
        check_positive("horizon", horizon)
        self.value = float(init_coef)
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, current_kl: float | Tensor, n_steps: int) -> float:
        """Update the coefficient from the KL measured on ``n_steps`` samples; return it.

        ``current_kl``: a finite real number, or a real 1-element tensor (read with one host
        synchronisation; ``meta`` refused). ``n_steps``: a finite number in ``[0, 5 *
        horizon]``: beyond, an error of ``-0.2`` would make the factor ``1 + e * n_steps /
        horizon`` negative, and with it the coefficient. Anything else raises naming the
        argument."""
        kl = _as_float("current_kl", current_kl)
        n = _check_n_steps(n_steps)
        if n > 5.0 * self.horizon:
            raise ValueError(
                f"n_steps: must be at most 5 * horizon = {5.0 * self.horizon} (a larger step can make "
                f"the coefficient negative: 1 - 0.2 * n_steps / horizon < 0), got {n_steps}"
            )
        error = min(max(kl / self.target - 1.0, -0.2), 0.2)
        self.value = self.value * (1.0 + error * n / self.horizon)
        return self.value

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_positive("state['value']", _as_float("state['value']", state["value"]), allow_zero=True)
        self.value = float(state["value"])
        if "target" in state:
            check_positive("state['target']", _as_float("state['target']", state["target"]))
            self.target = float(state["target"])
        if "horizon" in state:
            check_positive("state['horizon']", _as_float("state['horizon']", state["horizon"]))
            self.horizon = float(state["horizon"])

    def __repr__(self) -> str:
        return f"AdaptiveKLController(value={self.value}, target={self.target}, horizon={self.horizon})"
