"""Distillation from a teacher: the sampled-token reverse KL (on-policy distillation) and the
forward KL, reverse KL and generalised JSD over the teacher's top-k tokens.

Every loss returns ``LossOutput(loss [B, T], metrics)`` (zero where ``mask`` is False), to be
aggregated with :func:`rollkit.losses.aggregate`; the teacher is never differentiated. The
guide, with the formulas, the tail-mass convention and the micro-batching point, is
``docs/distillation.md``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from rollkit.losses._common import check_token_tensors, compute_dtype, masked_stat, zero_outside
from rollkit.types import LossOutput
from rollkit.validation import (
    check_choice,
    check_float,
    check_in_range,
    check_mask,
    check_ndim,
    check_positive,
    check_real,
    check_same_device,
    check_same_shape,
    check_shape,
    values_readable,
)

__all__ = [
    "TAIL_MODES",
    "distill_token_rewards",
    "gather_topk_logprobs",
    "on_policy_distill",
    "topk_forward_kl",
    "topk_jsd",
    "topk_reverse_kl",
]

#: How the top-k divergences treat the probability mass outside the teacher's top-k.
TAIL_MODES: tuple[str, ...] = ("bucket", "renormalize")

# log(pi_teacher / pi_student) is clamped to this before ``exp`` in the k3 metric.
_MAX_LOG_RATIO = 20.0


# --------------------------------------------------------------------------- sampled token


def _check_sampled(logprobs: Tensor, teacher_logprobs: Tensor, mask: Tensor, coef: float) -> None:
    check_token_tensors(mask, logprobs=logprobs, teacher_logprobs=teacher_logprobs)
    check_same_device("teacher_logprobs", teacher_logprobs, "logprobs", logprobs)
    check_same_device("mask", mask, "logprobs", logprobs)
    check_real("coef", coef)
    if not math.isfinite(coef):
        raise ValueError(f"coef: must be finite, got {coef}")


def _advantage(logprobs: Tensor, teacher_logprobs: Tensor, mask: Tensor, coef: float) -> Tensor:
    """``coef * (teacher - student)``, detached, in the compute dtype, 0 outside the mask."""
    dtype = compute_dtype(logprobs)
    diff = teacher_logprobs.detach().to(dtype) - logprobs.detach().to(dtype)
    return zero_outside(coef * diff, mask)


@torch.no_grad()
def distill_token_rewards(
    logprobs: Tensor,  # [B, T] log pi_student of the sampled tokens
    teacher_logprobs: Tensor,  # [B, T] log pi_teacher of the same tokens
    mask: Tensor,  # [B, T] bool
    *,
    coef: float = 1.0,
) -> Tensor:  # [B, T]
    """Per-token distillation rewards: minus the sampled-token reverse KL to the teacher.

        A_t = coef * (log pi_teacher(y_t) - log pi_student(y_t))       (detached; 0 off the mask)

    The student samples ``y ~ pi_student``, the teacher scores the same tokens; ``-A_t / coef``
    is the single-sample (k1) estimate of the per-token reverse KL(pi_student || pi_teacher),
    so ``E[A_t] = -coef * KL`` at each position. Use it as a dense per-token reward or
    advantage (discount 0, no baseline, as in Thinking Machines' "On-Policy Distillation",
    Lu et al. 2025), alone or added to a task advantage, with any policy loss of
    :mod:`rollkit.losses.policy` (``ppo_clip`` with ``old_logprobs`` / ``tis`` with the
    engine's log-probs for the off-policy correction). :func:`on_policy_distill` is the loss
    built from it. On-policy distillation: Agarwal et al. 2024 (GKD, arXiv:2306.13649), Gu et
    al. 2024 (MiniLLM, arXiv:2306.08543).

    ``logprobs`` is the student policy that sampled (the rollout engine's or the trainer's
    recomputed old log-probs). A NaN / ``+-inf`` log-prob at a valid token gives a non-finite
    reward there (nothing is clamped); values under the mask never matter.

    Args:
        logprobs: ``[B, T]`` float. teacher_logprobs: ``[B, T]`` float. mask: ``[B, T]`` bool.
        coef: finite scale (the reverse-KL coefficient).

    Returns:
        ``[B, T]`` detached, in the compute dtype (float32 for half-precision input).

    >>> student = torch.tensor([[-1.0, -2.0, -0.5]])
    >>> teacher = torch.tensor([[-0.5, -3.0, 7.0]])
    >>> distill_token_rewards(student, teacher, torch.tensor([[True, True, False]]))
    tensor([[ 0.5000, -1.0000,  0.0000]])
    """
    _check_sampled(logprobs, teacher_logprobs, mask, coef)
    return _advantage(logprobs, teacher_logprobs, mask, coef)


def on_policy_distill(
    logprobs: Tensor,  # [B, T] log pi_student of the sampled tokens; carries the gradient
    teacher_logprobs: Tensor,  # [B, T]
    mask: Tensor,  # [B, T] bool
    *,
    coef: float = 1.0,
) -> LossOutput:
    """On-policy distillation as a policy-gradient loss on the sampled-token reverse KL.

        A_t = sg(coef * (log pi_teacher(y_t) - log pi_student(y_t)))       (distill_token_rewards)
        L_t = -A_t * log pi_student(y_t)

    Gradient: ``coef * (log pi_s(y_t) - log pi_t(y_t)) * grad log pi_s(y_t)``, the
    score-function gradient of the per-token reverse KL(pi_student || pi_teacher) estimated on
    the sampled token (its expectation under ``y_t ~ pi_student`` is ``coef`` times the
    gradient of ``KL(pi_s(.|ctx_t) || pi_t(.|ctx_t))`` at fixed context: ``E[grad log pi] =
    0`` removes the ``+1`` of the exact derivative). Each token is its own reward (discount
    0), as in Lu et al. 2025 (Thinking Machines, "On-Policy Distillation"); GKD (Agarwal et al.
    2024, arXiv:2306.13649) and MiniLLM (Gu et al. 2024, arXiv:2306.08543) minimise the same
    reverse KL on student samples. Only the teacher's log-prob of the sampled token is needed
    (one number per token): the top-k losses below need the teacher's top-k.

    Compared with ``vanilla_pg(logprobs, logprobs.detach(), A, mask)`` this is the same loss
    with the advantage built in. For samples from an older student (several updates per batch,
    or an asynchronous engine), take ``A = distill_token_rewards(old_logprobs, ...)`` and a
    clipped or importance-weighted policy loss instead.

    Aggregation: ``"token-mean"`` (every token weighs the same; Thinking Machines and verl's
    default); pass the global normalisers when micro-batching (``docs/distillation.md``).

    Returns:
        ``LossOutput(loss [B, T], metrics)``; metrics over valid tokens: ``reverse_kl`` (k1,
        mean of ``log pi_s - log pi_t``, may be < 0 on a batch), ``reverse_kl_k3`` (mean of
        ``(r - 1) - log r`` with ``r = pi_t / pi_s``, >= 0, log-ratio clamped at 20),
        ``advantage_mean``.

    >>> lp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    >>> teacher = torch.tensor([[-0.5, -3.0]])
    >>> out = on_policy_distill(lp, teacher, torch.tensor([[True, True]]))
    >>> out.loss.sum().backward()
    >>> lp.grad                                   # log pi_s - log pi_t
    tensor([[-0.5000,  1.0000]])
    >>> round(float(out.metrics["reverse_kl"]), 4)
    0.25
    """
    _check_sampled(logprobs, teacher_logprobs, mask, coef)
    dtype = compute_dtype(logprobs)
    adv = _advantage(logprobs, teacher_logprobs, mask, coef)
    lp = zero_outside(logprobs.to(dtype), mask)
    loss = zero_outside(-adv * lp, mask)
    with torch.no_grad():
        log_r = zero_outside(teacher_logprobs.to(dtype) - lp.detach(), mask)
        k3 = torch.expm1(log_r.clamp(max=_MAX_LOG_RATIO)) - log_r
        metrics = {
            "reverse_kl": masked_stat(-log_r, mask),
            "reverse_kl_k3": masked_stat(k3, mask),
            "advantage_mean": masked_stat(adv, mask),
        }
    return LossOutput(loss, metrics)


# --------------------------------------------------------------------------- top-k


def gather_topk_logprobs(
    logits: Tensor,  # [B, T, V] student logits
    topk_ids: Tensor,  # [B, T, K] int: the teacher's top-k token ids
    *,
    temperature: float = 1.0,
) -> Tensor:  # [B, T, K]
    """The student's log-probs of the teacher's top-k tokens, normalised over the full vocabulary.

        out[b, t, k] = log_softmax(logits[b, t] / temperature)[topk_ids[b, t, k]]

    This is the first argument of :func:`topk_forward_kl`, :func:`topk_reverse_kl` and
    :func:`topk_jsd`. The normalisation is over all ``V`` tokens (not over the top-k), so that
    ``1 - sum_k exp(out)`` is the student's mass outside the teacher's top-k (the tail).
    Half-precision logits are computed in float32. Apply the temperature the teacher's top-k
    were computed with (TRL's GKD divides both logits by the same ``temperature``).

    Precision: the normaliser is ``m + log sum_v exp(x_v - m)`` (``m`` the row max, kept out of
    the rounded sum, and ``torch.sum``'s cascade / tree summation), so that the tail implied by
    float32 output is accurate to a few ulps; torch's CPU ``log_softmax`` can be off by ~1e-4
    at ``V = 150k``, which the bucket tail of the top-k losses would inherit. The gradient is
    ``log_softmax``'s; the ``[B, T, V]`` input (the logits / temperature, in float32) is
    saved for the backward instead of a ``[B, T, V]`` output, and there is no double backward.
    ``topk_ids`` outside ``[0, V)`` raise a ``ValueError`` (a data check: skipped inside
    ``rollkit.validation.value_checks(False)``).

    >>> logits = torch.tensor([[[2.0, 1.0, 0.0]]])
    >>> ids = torch.tensor([[[0, 2]]])
    >>> gather_topk_logprobs(logits, ids).exp()
    tensor([[[0.6652, 0.0900]]])
    """
    check_float("logits", logits)
    check_ndim("logits", logits, 3)
    check_ndim("topk_ids", topk_ids, 3)
    if topk_ids.is_floating_point() or topk_ids.dtype == torch.bool:
        raise ValueError(f"topk_ids: expected an integer tensor, got dtype {topk_ids.dtype}")
    if topk_ids.shape[:2] != logits.shape[:2]:
        raise ValueError(
            f"topk_ids: shape {list(topk_ids.shape)} does not match logits' [B, T] {list(logits.shape[:2])}"
        )
    check_same_device("topk_ids", topk_ids, "logits", logits)
    V = logits.shape[-1]
    if V < 1:
        raise ValueError(f"logits: expected shape [B, T, V] with V >= 1, got {list(logits.shape)}")
    if topk_ids.numel() and values_readable("topk_ids", topk_ids):
        lo, hi = torch.stack(torch.aminmax(topk_ids)).tolist()  # one host synchronisation
        if lo < 0 or hi >= V:
            raise ValueError(
                f"topk_ids: must be in [0, {V}) (the vocabulary of logits), got values in [{lo}, {hi}]"
            )
    check_positive("temperature", temperature)
    x = logits.to(compute_dtype(logits))
    if temperature != 1.0:
        x = x / temperature
    return _TopkLogprobs.apply(x, topk_ids.long())


class _TopkLogprobs(torch.autograd.Function):
    """``log_softmax(x).gather(-1, ids)`` with an accurate normaliser (same value in exact
    arithmetic, same gradient ``scatter(g) - softmax(x) * sum_k g_k``).

        m = max_v x_v,   ls = log sum_v exp(x_v - m),   out_k = (x_k - m) - ls

    torch's CPU ``log_softmax`` accumulates each vector lane in sequence: on a confident row
    the small terms are rounded away against the large one, and the normaliser (hence the
    tail ``1 - sum_k exp(out_k)`` of every top-k) is off by up to ~1e-4 at ``V = 150k`` in
    float32. ``torch.sum``'s cascade (CPU) / tree (CUDA) summation, and ``m`` kept out of the
    rounded ``ls``, bring it to a few ulps. Saves ``x`` itself (no ``[.., V]`` output is
    kept), and the backward forms its one ``[.., V]`` gradient in place. No double backward."""

    @staticmethod
    def forward(ctx, x: Tensor, ids: Tensor) -> Tensor:  # type: ignore[override]
        m = x.amax(-1, keepdim=True)
        m = torch.where(torch.isfinite(m), m, 0.0)  # a row of -inf (or with +inf): NaN, as log_softmax
        ls = (x - m).exp_().sum(-1, keepdim=True).log_()
        ctx.save_for_backward(x, ids, m, ls)
        return (x.gather(-1, ids) - m) - ls

    @staticmethod
    @once_differentiable
    def backward(ctx, g: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        x, ids, m, ls = ctx.saved_tensors
        gx = (x - m).sub_(ls).exp_().mul_(-g.sum(-1, keepdim=True))
        return gx.scatter_add_(-1, ids, g), None


def _check_topk(student: Tensor, teacher: Tensor, mask: Tensor, tail: str) -> None:
    check_float("student_topk_logprobs", student)
    check_ndim("student_topk_logprobs", student, 3)
    check_float("teacher_topk_logprobs", teacher)
    check_same_shape("teacher_topk_logprobs", teacher, "student_topk_logprobs", student)
    if student.shape[-1] < 1:
        raise ValueError("student_topk_logprobs: needs at least one top-k entry (K >= 1), got K = 0")
    check_mask("mask", mask)
    check_shape("mask", mask, list(student.shape[:2]))
    check_same_device("teacher_topk_logprobs", teacher, "student_topk_logprobs", student)
    check_same_device("mask", mask, "student_topk_logprobs", student)
    check_choice("tail", tail, TAIL_MODES)


def _tail_floor(k: int, dtype: torch.dtype) -> float:
    """The level ``tau`` at or below which the bucket tail of ``K`` log-probs computed in
    ``dtype`` (the compute dtype: float32 for 16-bit inputs) is taken as 0 (:func:`topk_forward_kl`).

        tau = (1 + ln K) * eps,    eps = max(machine epsilon of dtype, float32's)

    A log-prob ``x_k`` rounded to float32 is off by at most ``eps / 2 * |x_k|`` (half an ulp),
    and the normaliser it was computed with by about ``eps / 2``; to first order the tail
    ``1 - sum_k exp(x_k)`` is then off by at most ``eps / 2 * sum_k p_k (1 + |x_k|)``, which
    is ``<= eps / 2 * (1 + ln K)`` for ``K >= 3``. ``tau`` is about twice that bound: a
    smaller tail is rounding residue, not mass. float64 inputs get float32's ``eps`` (they are
    the reference of a float32 run, which must compute the same loss), and so do bfloat16 /
    float16 inputs, which are upcast before any arithmetic: their loss is that of the same
    values in float32 (see "Precision" in :func:`topk_forward_kl`)."""
    eps = max(torch.finfo(dtype).eps, torch.finfo(torch.float32).eps)
    return (1.0 + math.log(k)) * eps


def _log1mexp(a: Tensor) -> Tensor:
    """``log(1 - exp(a))`` for ``a < 0`` (``-inf`` included), accurate for every ``a``: the
    ``log(-expm1(a))`` branch above ``-ln 2``, ``log1p(-exp(a))`` below (Maechler 2012).
    Both branches are finite for ``a < 0``, so neither sends a NaN into the other's gradient."""
    return torch.where(a > -math.log(2.0), torch.log(-torch.expm1(a)), torch.log1p(-torch.exp(a)))


def _bucket_tail(x: Tensor, floor: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``(mass, log mass)`` of the tail outside a top-k of log-probs ``x`` (``[..., K]`` ->
    ``[..., 1]`` each, in ``dtype``).

        lse = logsumexp_k x_k,   T = 1 - exp(lse) = -expm1(lse),   log T = log1mexp(lse)

    computed in float64 (float32 on MPS, which has none), so the tail of float32 inputs is
    exact to float64 rounding; a tail ``T <= floor`` (rounding residue, or ``<= 0``) has mass
    0 and log ``log floor``. A row of ``-inf`` (no mass on the top-k) has ``T = 1``. Every
    branch that is not selected is fed a safe value (the "double where"), so the gradient is
    finite wherever the inputs are (-inf included)."""
    work = torch.float32 if x.device.type == "mps" else torch.float64
    x = x.to(work)
    dead = torch.isneginf(x).all(-1, keepdim=True)
    lse = torch.where(dead, -math.inf, torch.where(dead, 0.0, x).logsumexp(-1, keepdim=True))
    tail = -torch.expm1(lse)
    ok = tail > floor
    log_tail = _log1mexp(torch.where(ok, lse, -1.0))
    mass = torch.where(ok, tail, 0.0)
    log_mass = torch.where(ok, log_tail, math.log(floor))
    return mass.to(dtype), log_mass.to(dtype)


def _distributions(student: Tensor, teacher: Tensor, mask: Tensor, tail: str):
    """Probabilities and log-probabilities of the student and the teacher over the top-k
    (+ tail) outcomes: ``(p_s, log_s, p_t, log_t)``, each ``[B, T, K(+1)]``, in the compute
    dtype. Masked-out positions are replaced by a uniform distribution (so that NaN padding
    never reaches a value or a gradient); the teacher is detached."""
    dtype = compute_dtype(student)
    k = student.shape[-1]
    m = mask.unsqueeze(-1)
    fill = torch.full((), -math.log(k), dtype=dtype, device=student.device)
    s = torch.where(m, student.to(dtype), fill)
    t = torch.where(m, teacher.detach().to(dtype), fill)
    if tail == "renormalize":
        log_s = s - s.logsumexp(-1, keepdim=True)
        log_t = t - t.logsumexp(-1, keepdim=True)
        return log_s.exp(), log_s, log_t.exp(), log_t
    # the floor of the compute dtype, not of the inputs' storage dtype: 16-bit inputs are
    # upcast above, and their loss is the float32 loss of the same values (bfloat16's eps would
    # drop a confident student's tail, and with it most of the gradient)
    floor = _tail_floor(k, dtype)
    tail_s, log_tail_s = _bucket_tail(s, floor, dtype)
    tail_t, log_tail_t = _bucket_tail(t, floor, dtype)
    p_s = torch.cat([s.exp(), tail_s], -1)
    p_t = torch.cat([t.exp(), tail_t], -1)
    return p_s, torch.cat([s, log_tail_s], -1), p_t, torch.cat([t, log_tail_t], -1)


def _kl(p: Tensor, log_p: Tensor, log_q: Tensor) -> Tensor:
    """``sum_i p_i (log p_i - log q_i)`` over the last dim, with ``0 log 0 = 0`` (also in the
    gradient: an outcome of probability 0 contributes nothing, even where its log is -inf)."""
    pos = p > 0
    diff = torch.where(pos, log_p - log_q, torch.zeros((), dtype=p.dtype, device=p.device))
    return (p * diff).sum(-1)


@torch.no_grad()
def _topk_metrics(loss: Tensor, student: Tensor, teacher: Tensor, mask: Tensor, name: str):
    def mass(x: Tensor) -> Tensor:
        return masked_stat(zero_outside(x.detach().to(loss.dtype), mask.unsqueeze(-1)).exp().sum(-1), mask)

    return {
        name: masked_stat(loss, mask),
        "student_topk_mass": mass(student),
        "teacher_topk_mass": mass(teacher),
    }


def _divergence(
    student: Tensor, teacher: Tensor, mask: Tensor, beta: float, tail: str, name: str
) -> LossOutput:
    _check_topk(student, teacher, mask, tail)
    check_in_range("beta", beta, 0.0, 1.0)
    p_s, log_s, p_t, log_t = _distributions(student, teacher, mask, tail)
    if beta == 0.0:
        per_token = _kl(p_t, log_t, log_s)  # KL(teacher || student): forward
    elif beta == 1.0:
        per_token = _kl(p_s, log_s, log_t)  # KL(student || teacher): reverse
    else:
        # -inf (an outcome one model cannot produce) is raised to the dtype's minimum here, so
        # that an outcome impossible under both gives a finite log M and no NaN gradient
        low = torch.finfo(log_s.dtype).min
        log_m = torch.logaddexp(
            log_s.clamp(min=low) + math.log1p(-beta), log_t.clamp(min=low) + math.log(beta)
        )
        per_token = beta * _kl(p_t, log_t, log_m) + (1.0 - beta) * _kl(p_s, log_s, log_m)
    loss = zero_outside(per_token, mask)
    return LossOutput(loss, _topk_metrics(loss, student, teacher, mask, name))


def topk_forward_kl(
    student_topk_logprobs: Tensor,  # [B, T, K], carries the gradient
    teacher_topk_logprobs: Tensor,  # [B, T, K]
    mask: Tensor,  # [B, T] bool
    *,
    tail: str = "bucket",
) -> LossOutput:
    """Forward KL(teacher || student) per token, over the teacher's top-k tokens and a tail.

        L_t = sum_k p_t,k (log p_t,k - log p_s,k)  [+ p_t,tail (log p_t,tail - log p_s,tail)]

    with ``p_.,k = exp(*_topk_logprobs[..., k])`` (both normalised over the full vocabulary;
    see :func:`gather_topk_logprobs`) and the tail convention ``tail``:

    * ``"bucket"`` (default): one more outcome, "any other token", of mass
      ``p_.,tail = 1 - sum_k p_.,k`` for each model. The loss is the exact KL between the two
      distributions coarsened to ``K + 1`` outcomes: ``>= 0``, ``<=`` the full-vocabulary KL
      (data processing), equal to it when the top-k covers the vocabulary, and the tail term
      penalises a student that puts too much (or too little) mass outside the teacher's top-k.
      TRL's server distillation ``loss_add_tail=True`` is this convention.

      Precision: ``p_.,tail = -expm1(lse)`` and ``log p_.,tail = log1mexp(lse)``, ``lse =
      logsumexp_k log p_.,k``, are computed in float64 from the inputs (float32 on MPS), so
      float32 inputs give the loss and gradient of float64 to float32 rounding. A tail
      ``<= tau = (1 + ln K) * eps`` (``eps``: float32's machine epsilon, whatever the inputs'
      dtype) is within float32's rounding of the log-probs and their normaliser and is taken
      as 0: probability 0 (no term, no gradient) and, as the other model's log, ``log tau``.
      A teacher whose top-k hold all the mass (``K = V``) then adds no tail term to the forward
      KL; a student that puts mass ``m`` where the teacher's tail is 0 pays ``m log(m / tau)``
      in the reverse KL (``+inf`` in exact arithmetic). The loss is ``>= -tau``.
    * ``"renormalize"``: both restricted to the top-k and renormalised over it (the KL of the
      conditionals given "the token is in the teacher's top-k"); it ignores how much mass the
      student puts outside.

    Half precision: bfloat16 / float16 inputs are upcast to float32 before any arithmetic
    (either tail): the loss (float32) is that of the same values in float32, and the gradient
    the float32 one rounded once to the inputs' dtype. What 16-bit storage costs is in the
    values themselves: rounding ``log p_k`` moves the tail it implies by up to ``eps16 / 2 *
    sum_k p_k |log p_k|``, small next to a confident student's tail at small ``K`` (top-1
    0.99-0.9999, ``K = 2``: 0.7% of it in bfloat16, median) but not at large ``K`` (a tail of
    ~1e-4 at ``K = 32``: 8.5%, median). Keep the top-k log-probs in float32 where that matters.

    verl's ``forward_kl_topk`` sums the top-k terms without a tail or renormalisation (not a
    divergence: it can be negative, and verl clamps it at 0); rollkit offers the two
    conventions above, which are divergences. Mode-covering: the student is pushed to put
    mass on every token the teacher likes (the GKD paper's ``beta = 0``; supervised KD).

    Args:
        student_topk_logprobs: ``[B, T, K]``, the student's log-probs of the teacher's top-k
            tokens (the only differentiated input).
        teacher_topk_logprobs: ``[B, T, K]``, the teacher's log-probs of them (detached).
        mask: ``[B, T]`` bool.
        tail: ``"bucket"`` or ``"renormalize"``.

    Returns:
        ``LossOutput(loss [B, T], metrics)``, in the compute dtype (float32 for 16-bit
        inputs); metrics over valid tokens: ``kl``, ``student_topk_mass``,
        ``teacher_topk_mass`` (means of ``sum_k p_.,k``).

    >>> teacher = torch.log(torch.tensor([[[0.6, 0.3]]]))          # tail 0.1
    >>> student = torch.log(torch.tensor([[[0.5, 0.3]]])).requires_grad_()   # tail 0.2
    >>> out = topk_forward_kl(student, teacher, torch.tensor([[True]]))
    >>> expected = 0.6 * math.log(0.6 / 0.5) + 0.1 * math.log(0.1 / 0.2)
    >>> abs(float(out.loss.detach()) - expected) < 1e-6
    True
    """
    return _divergence(student_topk_logprobs, teacher_topk_logprobs, mask, 0.0, tail, "kl")


def topk_reverse_kl(
    student_topk_logprobs: Tensor,  # [B, T, K], carries the gradient
    teacher_topk_logprobs: Tensor,  # [B, T, K]
    mask: Tensor,  # [B, T] bool
    *,
    tail: str = "bucket",
) -> LossOutput:
    """Reverse KL(student || teacher) per token, over the teacher's top-k tokens and a tail.

        L_t = sum_k p_s,k (log p_s,k - log p_t,k)  [+ p_s,tail (log p_s,tail - log p_t,tail)]

    Same inputs, ``tail`` convention and precision as :func:`topk_forward_kl`. Mode-seeking (the GKD
    paper's ``beta = 1``, MiniLLM's objective): the student concentrates on the teacher's
    likely tokens. Computed exactly over the ``K (+1)`` outcomes, unlike the sampled-token
    estimate of :func:`on_policy_distill`, which needs only one teacher log-prob per token
    but is noisier. The tail bucket matters here: without it (``"renormalize"``), a student
    that puts its mass outside the teacher's top-k is not penalised for it.

    Returns:
        ``LossOutput(loss [B, T], metrics)``; metrics: ``kl``, ``student_topk_mass``,
        ``teacher_topk_mass``.

    >>> teacher = torch.log(torch.tensor([[[0.6, 0.3]]]))
    >>> student = torch.log(torch.tensor([[[0.5, 0.3]]]))
    >>> out = topk_reverse_kl(student, teacher, torch.tensor([[True]]))
    >>> expected = 0.5 * math.log(0.5 / 0.6) + 0.2 * math.log(0.2 / 0.1)
    >>> abs(float(out.loss) - expected) < 1e-6
    True
    """
    return _divergence(student_topk_logprobs, teacher_topk_logprobs, mask, 1.0, tail, "kl")


def topk_jsd(
    student_topk_logprobs: Tensor,  # [B, T, K], carries the gradient
    teacher_topk_logprobs: Tensor,  # [B, T, K]
    mask: Tensor,  # [B, T] bool
    *,
    beta: float = 0.5,
    tail: str = "bucket",
) -> LossOutput:
    """Generalised Jensen-Shannon divergence per token (GKD, Agarwal et al. 2024, arXiv:2306.13649).

        M = beta * P_t + (1 - beta) * P_s
        L_t = beta * KL(P_t || M) + (1 - beta) * KL(P_s || M)          0 < beta < 1
        L_t = KL(P_t || P_s)  (forward)  if beta = 0;   KL(P_s || P_t)  (reverse)  if beta = 1

    over the teacher's top-k tokens and a tail (same inputs, ``tail`` convention and
    precision as :func:`topk_forward_kl`). This is TRL's ``generalized_jsd_loss`` (GKDTrainer; the same
    ``beta`` and the same special cases), per token instead of reduced: with ``K = V`` (the
    full vocabulary) the two agree to float round-off. ``beta = 0.5`` is the symmetric JSD,
    bounded by ``log 2``.

    Limits: the formula for ``0 < beta < 1`` tends to 0 at both ends, and
    ``L / beta -> KL(P_t || P_s)`` as ``beta -> 0``, ``L / (1 - beta) -> KL(P_s || P_t)`` as
    ``beta -> 1``: the special cases at 0 and 1 are the limits of the *rescaled* divergence,
    so the loss scale jumps there (as in TRL).

    Returns:
        ``LossOutput(loss [B, T], metrics)``; metrics: ``jsd``, ``student_topk_mass``,
        ``teacher_topk_mass``.

    >>> teacher = torch.log(torch.tensor([[[0.5, 0.5]]]))
    >>> student = torch.log(torch.tensor([[[1.0, 1e-30]]]))
    >>> out = topk_jsd(student, teacher, torch.tensor([[True]]), beta=0.5)
    >>> expected = 0.5 * (0.5 * math.log(0.5 / 0.75) + 0.5 * math.log(0.5 / 0.25)) + 0.5 * math.log(1 / 0.75)
    >>> abs(float(out.loss) - expected) < 1e-6
    True
    """
    return _divergence(student_topk_logprobs, teacher_topk_logprobs, mask, beta, tail, "jsd")
