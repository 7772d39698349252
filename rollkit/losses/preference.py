"""Preference losses on sequence log-probs: DPO (with cDPO / robust label smoothing), IPO,
SimPO and ORPO; and the Bradley-Terry loss of a reward model on its scalar scores.

Every loss takes ``[P]`` sequence log-probs of the chosen and rejected responses of ``P``
pairs (:func:`rollkit.losses.sequence_logprobs` computes them from token log-probs and a
mask) and returns ``LossOutput(loss [P], metrics)``: one loss per pair, not a token matrix.
Reduce it with :func:`aggregate_pairs` (the mean over pairs, with a global pair count for
micro-batches and data-parallel ranks). Metrics are TRL's: ``rewards/chosen``,
``rewards/rejected``, ``rewards/accuracies``, ``rewards/margins`` (means over the pairs of
this call). Guide: ``docs/distillation.md``.

Precision: bfloat16 / float16 inputs are upcast to float32 before any arithmetic (the
differences, the length normalisation, ``logsigmoid``, ORPO's ``log1mexp``): the loss and the
metrics are float32 and equal those of the same values upcast, and the gradient is the float32
one rounded once to the inputs' dtype (``tests/test_half_precision.py``). What 16 bits cannot
hold is the input itself: a summed sequence log-prob of -300 is stored in bfloat16 to +-1 nat
(its ulp is 2), enough to move a DPO margin ``h`` by up to 4. Pass the float32 sums of
:func:`rollkit.losses.sequence_logprobs` (float32 for half-precision token log-probs), not a
16-bit copy of them.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from rollkit.losses._common import compute_dtype
from rollkit.losses.aggregation import aggregate
from rollkit.types import LossOutput
from rollkit.validation import (
    check_finite,
    check_float,
    check_ndim,
    check_positive,
    check_real,
    check_same_device,
    check_same_shape,
    check_tensor,
)

__all__ = ["aggregate_pairs", "bradley_terry", "dpo", "ipo", "orpo", "simpo"]


# --------------------------------------------------------------------------- helpers


def _check_pairs(**tensors: Tensor) -> None:
    """``[P]`` float tensors of one shape and device (the first one is the reference)."""
    (ref_name, ref), *others = tensors.items()
    check_float(ref_name, ref)
    check_ndim(ref_name, ref, 1)
    for name, x in others:
        check_float(name, x)
        check_same_shape(name, x, ref_name, ref)
        check_same_device(name, x, ref_name, ref)


def _check_lengths(ref: Tensor, **lengths: Tensor) -> None:
    for name, n in lengths.items():
        check_tensor(name, n)
        if n.dtype == torch.bool or n.is_complex():
            raise ValueError(f"{name}: expected integer or float token counts, got dtype {n.dtype}")
        check_same_shape(name, n, "chosen_logprobs", ref)
        check_same_device(name, n, "chosen_logprobs", ref)


def _check_smoothing(label_smoothing: float) -> None:
    check_real("label_smoothing", label_smoothing)
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing: must be in [0, 0.5), got {label_smoothing}")


def _cast(dtype: torch.dtype, *xs: Tensor) -> list[Tensor]:
    return [x.to(dtype) for x in xs]


def _mean_logprob(logprobs: Tensor, lengths: Tensor) -> Tensor:
    """``logprobs / max(lengths, 1)``: 0 for an empty response."""
    return logprobs / lengths.to(logprobs.dtype).clamp(min=1)


def _smoothed_sigmoid_loss(z: Tensor, label_smoothing: float, robust: bool = False) -> Tensor:
    """``-(1 - e) log sigma(z) - e log sigma(-z)``; robust: ``(-(1 - e) log sigma(z) + e log sigma(-z)) / (1 - 2e)``."""
    loss = -F.logsigmoid(z)
    if label_smoothing == 0.0:
        return loss
    e = label_smoothing
    if robust:
        return ((1.0 - e) * loss + e * F.logsigmoid(-z)) / (1.0 - 2.0 * e)
    return (1.0 - e) * loss - e * F.logsigmoid(-z)


@torch.no_grad()
def _reward_metrics(chosen_rewards: Tensor, rejected_rewards: Tensor) -> dict[str, Tensor]:
    """TRL's reward metrics, means over the pairs (0 for an empty batch)."""
    if chosen_rewards.numel() == 0:
        zero = torch.zeros((), dtype=chosen_rewards.dtype, device=chosen_rewards.device)
        return {
            k: zero for k in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins")
        }
    c, r = chosen_rewards.detach(), rejected_rewards.detach()
    return {
        "rewards/chosen": c.mean(),
        "rewards/rejected": r.mean(),
        "rewards/accuracies": (c > r).to(c.dtype).mean(),
        "rewards/margins": (c - r).mean(),
    }


@torch.no_grad()
def _mean(x: Tensor) -> Tensor:
    return x.detach().mean() if x.numel() else torch.zeros((), dtype=x.dtype, device=x.device)


# --------------------------------------------------------------------------- aggregation


def aggregate_pairs(
    loss: Tensor,  # [P] per-pair loss
    *,
    weights: Tensor | None = None,  # [P] >= 0
    num_pairs: float | Tensor | None = None,
    dp_size: int = 1,
) -> Tensor:  # [] scalar
    """The mean of a ``[P]`` per-pair loss, exact under micro-batching with a global pair count.

        result = dp_size * sum_p w_p L_p / num_pairs,       num_pairs = sum_p w_p (default)

    This is :func:`rollkit.losses.aggregate` on ``loss[:, None]`` with an all-True mask and
    ``"seq-mean-token-sum"`` (each pair is a one-token "sequence"), so the same rules hold: a
    global ``num_pairs`` (the number, or the summed weights, of the pairs of the whole batch,
    over micro-batches and data-parallel ranks) makes the sum over micro-batches of their
    results the full-batch mean, value and gradient; ``dp_size`` cancels the gradient
    averaging of DDP / FSDP (pass the world size). Get both for a batch of ``P`` local pairs
    with ``global_normalizers(torch.ones(P, 1, dtype=torch.bool))`` (``"num_seqs"`` is the
    pair count). An empty batch gives 0 with a zero gradient.

    >>> from rollkit.losses import global_normalizers
    >>> loss = torch.tensor([1.0, 2.0, 6.0])
    >>> aggregate_pairs(loss)
    tensor(3.)
    >>> n = global_normalizers(torch.ones(3, 1, dtype=torch.bool))
    >>> aggregate_pairs(loss[:1], num_pairs=n["num_seqs"]) + aggregate_pairs(loss[1:], num_pairs=n["num_seqs"])
    tensor(3.)
    """
    check_float("loss", loss)
    check_ndim("loss", loss, 1)
    if weights is not None:  # named against loss, not aggregate's internal mask
        check_same_device("weights", weights, "loss", loss)
    mask = torch.ones(loss.shape[0], 1, dtype=torch.bool, device=loss.device)
    try:
        return aggregate(
            loss.unsqueeze(-1),
            mask,
            "seq-mean-token-sum",
            weights=weights,
            num_seqs=num_pairs,
            dp_size=dp_size,
        )
    except ValueError as err:  # aggregate's num_seqs is this function's num_pairs: say so
        msg = str(err)
        if msg.startswith("num_seqs: "):
            raise ValueError("num_pairs: " + msg[len("num_seqs: ") :]) from None
        raise


# --------------------------------------------------------------------------- DPO family


def dpo(
    chosen_logprobs: Tensor,  # [P] log pi_theta(y_w | x), carries the gradient
    rejected_logprobs: Tensor,  # [P] log pi_theta(y_l | x), carries the gradient
    ref_chosen_logprobs: Tensor,  # [P] log pi_ref(y_w | x)
    ref_rejected_logprobs: Tensor,  # [P] log pi_ref(y_l | x)
    *,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    robust: bool = False,
) -> LossOutput:
    """DPO (Rafailov et al. 2023, arXiv:2305.18290), with cDPO / robust label smoothing.

        h = (log pi(y_w) - log pi_ref(y_w)) - (log pi(y_l) - log pi_ref(y_l))
        L = -log sigma(beta h)                                                    (DPO)
        L = -(1 - e) log sigma(beta h) - e log sigma(-beta h)                     (cDPO, e = label_smoothing)
        L = (-(1 - e) log sigma(beta h) + e log sigma(-beta h)) / (1 - 2e)       (robust=True, rDPO)

    cDPO (Mitchell 2023, "A note on DPO with noisy preferences") treats each label as flipped
    with probability ``e``: a smoothed cross-entropy whose optimum is a finite margin. rDPO
    (Chowdhury et al. 2024, arXiv:2403.00409) debiases the loss for flip rate ``e`` instead
    (TRL's ``loss_type="robust"``). With ``e = 0`` all three are DPO (TRL's ``"sigmoid"``).

    Sequence log-probs are sums over the response tokens (``sequence_logprobs(...,
    reduction="sum")``); the reference ones are constants (detached). Reduce with
    :func:`aggregate_pairs` (the paper's mean over pairs).

    Args:
        chosen_logprobs, rejected_logprobs: ``[P]`` policy sequence log-probs.
        ref_chosen_logprobs, ref_rejected_logprobs: ``[P]`` reference sequence log-probs.
        beta: ``> 0``, the KL coefficient. label_smoothing: in ``[0, 0.5)``.
        robust: rDPO's unbiased form instead of cDPO's.

    Returns:
        ``LossOutput(loss [P], metrics)``; metrics (means over the pairs): ``rewards/chosen``
        (``beta (log pi(y_w) - log pi_ref(y_w))``), ``rewards/rejected``,
        ``rewards/accuracies`` (fraction with chosen reward > rejected), ``rewards/margins``,
        ``logps/chosen``, ``logps/rejected``.

    >>> out = dpo(torch.tensor([-10.0]), torch.tensor([-12.0]), torch.tensor([-11.0]), torch.tensor([-11.0]), beta=0.5)
    >>> torch.allclose(out.loss, -torch.nn.functional.logsigmoid(torch.tensor([1.0])))   # h = 1 + 1
    True
    >>> float(out.metrics["rewards/margins"])                                          # beta h
    1.0
    """
    _check_pairs(
        chosen_logprobs=chosen_logprobs,
        rejected_logprobs=rejected_logprobs,
        ref_chosen_logprobs=ref_chosen_logprobs,
        ref_rejected_logprobs=ref_rejected_logprobs,
    )
    check_positive("beta", beta)
    _check_smoothing(label_smoothing)
    dtype = compute_dtype(chosen_logprobs)
    c, r, rc, rr = _cast(
        dtype, chosen_logprobs, rejected_logprobs, ref_chosen_logprobs, ref_rejected_logprobs
    )
    chosen_ratio, rejected_ratio = c - rc.detach(), r - rr.detach()
    loss = _smoothed_sigmoid_loss(beta * (chosen_ratio - rejected_ratio), label_smoothing, robust)
    metrics = _reward_metrics(beta * chosen_ratio, beta * rejected_ratio)
    metrics.update({"logps/chosen": _mean(c), "logps/rejected": _mean(r)})
    return LossOutput(loss, metrics)


def ipo(
    chosen_logprobs: Tensor,  # [P], carries the gradient
    rejected_logprobs: Tensor,  # [P], carries the gradient
    ref_chosen_logprobs: Tensor,  # [P]
    ref_rejected_logprobs: Tensor,  # [P]
    chosen_lengths: Tensor | None = None,  # [P] token counts
    rejected_lengths: Tensor | None = None,  # [P]
    *,
    beta: float = 0.1,
) -> LossOutput:
    """IPO (Azar et al. 2023, "A General Theoretical Paradigm to Understand Learning from
    Human Preferences", arXiv:2310.12036, eq. 17): a squared loss towards a finite margin.

        h = (log pi(y_w) - log pi_ref(y_w)) / n_w - (log pi(y_l) - log pi_ref(y_l)) / n_l
        L = (h - 1 / (2 beta))^2

    ``n_w`` / ``n_l`` are ``chosen_lengths`` / ``rejected_lengths`` (token counts, clamped to
    ``>= 1``); without them ``n = 1`` (the paper's equation as written, on whatever sequence
    log-probs are passed). TRL's ``loss_type="ipo"`` normalises by the completion length,
    which the IPO authors confirmed is what their results use: pass summed log-probs and the
    lengths. Unlike DPO's logistic loss, the squared loss does not push the margin to
    infinity on deterministic preferences: ``beta`` sets the target ``1 / (2 beta)``.

    Returns:
        ``LossOutput(loss [P], metrics)``; metrics: ``rewards/chosen`` (``beta`` times the
        chosen log-ratio, summed, as TRL logs it), ``rewards/rejected``,
        ``rewards/accuracies``, ``rewards/margins``, ``logps/chosen``, ``logps/rejected``.

    >>> out = ipo(torch.tensor([-4.0]), torch.tensor([-9.0]), torch.tensor([-5.0]), torch.tensor([-8.0]),
    ...           torch.tensor([2]), torch.tensor([4]), beta=0.5)
    >>> float(out.loss)                         # h = 1/2 + 1/4, (0.75 - 1)^2
    0.0625
    """
    _check_pairs(
        chosen_logprobs=chosen_logprobs,
        rejected_logprobs=rejected_logprobs,
        ref_chosen_logprobs=ref_chosen_logprobs,
        ref_rejected_logprobs=ref_rejected_logprobs,
    )
    if (chosen_lengths is None) != (rejected_lengths is None):
        missing = "chosen_lengths" if chosen_lengths is None else "rejected_lengths"
        raise ValueError(f"{missing}: pass both chosen_lengths and rejected_lengths, or neither")
    if chosen_lengths is not None:
        _check_lengths(chosen_logprobs, chosen_lengths=chosen_lengths, rejected_lengths=rejected_lengths)
    check_positive("beta", beta)
    dtype = compute_dtype(chosen_logprobs)
    c, r, rc, rr = _cast(
        dtype, chosen_logprobs, rejected_logprobs, ref_chosen_logprobs, ref_rejected_logprobs
    )
    chosen_ratio, rejected_ratio = c - rc.detach(), r - rr.detach()
    if chosen_lengths is not None:
        h = _mean_logprob(chosen_ratio, chosen_lengths) - _mean_logprob(rejected_ratio, rejected_lengths)
    else:
        h = chosen_ratio - rejected_ratio
    loss = (h - 1.0 / (2.0 * beta)) ** 2
    metrics = _reward_metrics(beta * chosen_ratio, beta * rejected_ratio)
    metrics.update({"logps/chosen": _mean(c), "logps/rejected": _mean(r)})
    return LossOutput(loss, metrics)


# --------------------------------------------------------------------------- reference-free


def simpo(
    chosen_logprobs: Tensor,  # [P] summed log pi_theta(y_w | x), carries the gradient
    rejected_logprobs: Tensor,  # [P] summed log pi_theta(y_l | x)
    chosen_lengths: Tensor,  # [P] token counts |y_w|
    rejected_lengths: Tensor,  # [P] |y_l|
    *,
    beta: float = 2.0,
    gamma: float = 0.5,
    label_smoothing: float = 0.0,
) -> LossOutput:
    """SimPO (Meng et al. 2024, arXiv:2405.14734): length-normalised, reference-free, with a margin.

        r_w = beta / |y_w| * log pi(y_w),   r_l = beta / |y_l| * log pi(y_l)
        L = -log sigma(r_w - r_l - gamma)                         (label_smoothing e: as cDPO)

    The implicit reward is the *average* log-prob (no reference model, so no second forward
    pass), and ``gamma > 0`` asks for a margin between them. Takes summed sequence log-probs
    and the token counts (clamped to ``>= 1``), so a sum cannot be mistaken for a mean. This is
    TRL's CPOTrainer with ``loss_type="simpo"`` (its ``simpo_gamma`` is ``gamma``). The paper's
    settings: ``beta`` 2.0-10, ``gamma / beta`` 0.3-0.8 depending on the model.

    Returns:
        ``LossOutput(loss [P], metrics)``; metrics: ``rewards/chosen`` (``r_w``),
        ``rewards/rejected``, ``rewards/accuracies``, ``rewards/margins``, ``logps/chosen``,
        ``logps/rejected`` (mean per-token log-probs).

    >>> out = simpo(torch.tensor([-4.0]), torch.tensor([-12.0]), torch.tensor([4]), torch.tensor([6]),
    ...             beta=2.0, gamma=1.0)
    >>> torch.allclose(out.loss, -torch.nn.functional.logsigmoid(torch.tensor([1.0])))  # -2 + 4 - 1
    True
    """
    _check_pairs(chosen_logprobs=chosen_logprobs, rejected_logprobs=rejected_logprobs)
    _check_lengths(chosen_logprobs, chosen_lengths=chosen_lengths, rejected_lengths=rejected_lengths)
    check_positive("beta", beta)
    gamma = check_real("gamma", gamma)
    if not math.isfinite(gamma):
        raise ValueError(f"gamma: must be finite, got {gamma}")
    _check_smoothing(label_smoothing)
    dtype = compute_dtype(chosen_logprobs)
    c, r = _cast(dtype, chosen_logprobs, rejected_logprobs)
    c_avg, r_avg = _mean_logprob(c, chosen_lengths), _mean_logprob(r, rejected_lengths)
    loss = _smoothed_sigmoid_loss(beta * (c_avg - r_avg) - gamma, label_smoothing)
    metrics = _reward_metrics(beta * c_avg, beta * r_avg)
    metrics.update({"logps/chosen": _mean(c_avg), "logps/rejected": _mean(r_avg)})
    return LossOutput(loss, metrics)


def _log1mexp(x: Tensor) -> Tensor:
    """``log(1 - exp(x))`` for ``x <= 0``, accurate on both sides of ``-log 2``."""
    t = -math.log(2.0)
    # each branch gets inputs on which it is finite, so the unused one leaves no NaN gradient
    near = torch.log(-torch.expm1(torch.where(x > t, x, torch.full_like(x, t))))
    far = torch.log1p(-torch.exp(torch.where(x > t, torch.full_like(x, t), x)))
    return torch.where(x > t, near, far)


def orpo(
    chosen_logprobs: Tensor,  # [P] summed log pi_theta(y_w | x), carries the gradient
    rejected_logprobs: Tensor,  # [P] summed log pi_theta(y_l | x)
    chosen_lengths: Tensor,  # [P] token counts
    rejected_lengths: Tensor,  # [P]
    *,
    beta: float = 0.1,
    nll_weight: float = 1.0,
) -> LossOutput:
    """ORPO (Hong et al. 2024, arXiv:2403.07691): SFT on the chosen response plus an odds-ratio term.

        a_w = log pi(y_w) / |y_w|,   a_l = log pi(y_l) / |y_l|          (mean token log-probs)
        log odds(y) = a - log(1 - exp(a))
        L = nll_weight * (-a_w) - beta * log sigma(log odds(y_w) - log odds(y_l))

    No reference model: the SFT term keeps the policy on the chosen answers, the odds-ratio
    term pushes the rejected ones down (``beta`` is the paper's ``lambda``). The odds-ratio
    part is TRL's ``ORPOTrainer.odds_ratio_loss`` (``losses = beta * log sigma(...)``, which
    TRL subtracts). TRL's SFT term is the token-mean NLL over all chosen tokens of the batch,
    not the per-pair mean ``-a_w`` of the paper used here: to reproduce TRL, pass
    ``nll_weight=0`` and add ``aggregate(sft_nll(chosen_token_logprobs, chosen_mask).loss,
    chosen_mask, "token-mean")``. An average log-prob of exactly 0 (probability 1) has
    infinite odds.

    Returns:
        ``LossOutput(loss [P], metrics)``; metrics: ``rewards/chosen`` (``beta a_w``, as TRL),
        ``rewards/rejected``, ``rewards/accuracies``, ``rewards/margins``, ``nll_loss`` (mean
        ``-a_w``), ``log_odds_ratio`` (mean ``log sigma(...)``), ``log_odds_chosen`` (mean log
        odds difference).

    >>> out = orpo(torch.tensor([-2.0]), torch.tensor([-6.0]), torch.tensor([2]), torch.tensor([3]), beta=0.5)
    >>> a_w, a_l = -1.0, -2.0
    >>> lor = (a_w - math.log(1 - math.exp(a_w))) - (a_l - math.log(1 - math.exp(a_l)))
    >>> expected = 1.0 - 0.5 * math.log(1 / (1 + math.exp(-lor)))
    >>> abs(float(out.loss) - expected) < 1e-6
    True
    """
    _check_pairs(chosen_logprobs=chosen_logprobs, rejected_logprobs=rejected_logprobs)
    _check_lengths(chosen_logprobs, chosen_lengths=chosen_lengths, rejected_lengths=rejected_lengths)
    check_positive("beta", beta)
    check_positive("nll_weight", nll_weight, allow_zero=True)
    if not math.isfinite(nll_weight):
        raise ValueError(f"nll_weight: must be finite, got {nll_weight}")
    dtype = compute_dtype(chosen_logprobs)
    c, r = _cast(dtype, chosen_logprobs, rejected_logprobs)
    a_w, a_l = _mean_logprob(c, chosen_lengths), _mean_logprob(r, rejected_lengths)
    log_odds = (a_w - a_l) - (_log1mexp(a_w) - _log1mexp(a_l))
    ratio = F.logsigmoid(log_odds)
    nll = -a_w
    loss = nll_weight * nll - beta * ratio
    metrics = _reward_metrics(beta * a_w, beta * a_l)
    metrics.update(
        {"nll_loss": _mean(nll), "log_odds_ratio": _mean(ratio), "log_odds_chosen": _mean(log_odds)}
    )
    return LossOutput(loss, metrics)


# --------------------------------------------------------------------------- reward model


def bradley_terry(
    chosen_rewards: Tensor,  # [P] r(x, y_w), the reward model's scores, carry the gradient
    rejected_rewards: Tensor,  # [P] r(x, y_l)
    *,
    margin: float | Tensor = 0.0,  # a number, or [P] per pair
) -> LossOutput:
    """The Bradley-Terry loss of a reward model (Bradley & Terry 1952; InstructGPT, Ouyang et
    al. 2022, arXiv:2203.02155, eq. 1), with the optional margin of Llama 2 (Touvron et al.
    2023, arXiv:2307.09288, eq. 2).

        P(y_w > y_l | x) = sigma(r(x, y_w) - r(x, y_l))                 (Bradley-Terry model)
        L = -log sigma(r_w - r_l - m)

    The negative log-likelihood of the human preference under the Bradley-Terry model of
    pairwise comparisons: the reward model's scalar scores of the chosen and rejected
    responses are its logits. ``margin`` ``m`` asks for a gap (Llama 2 uses a per-pair margin
    that grows with the rating of the preference): a number, or a ``[P]`` tensor, a constant
    (detached). Computed as ``-logsigmoid`` (finite value and gradient at any score gap, no
    ``log(0)``), in float32 for 16-bit scores. This is TRL's ``RewardTrainer`` loss (without
    its ``center_rewards_coefficient`` term). InstructGPT averages over all ``C(K, 2)`` pairs
    of a prompt's ``K`` ranked responses: pass every pair, reduce with
    :func:`aggregate_pairs` (its ``weights`` can give each prompt the same total weight).

    Gradient: ``dL/dr_w = -sigma(m - (r_w - r_l)) = -dL/dr_l``.

    Args:
        chosen_rewards, rejected_rewards: ``[P]`` float scores of the chosen and rejected
            responses.
        margin: finite, a number or a ``[P]`` float tensor.

    Returns:
        ``LossOutput(loss [P], metrics)``; metrics (means over the pairs): ``rewards/chosen``,
        ``rewards/rejected``, ``rewards/accuracies`` (fraction with ``r_w > r_l``; the margin
        is not subtracted), ``rewards/margins`` (mean ``r_w - r_l``).

    >>> out = bradley_terry(torch.tensor([2.0, 0.0]), torch.tensor([1.0, 0.0]), margin=1.0)
    >>> torch.allclose(out.loss, -torch.nn.functional.logsigmoid(torch.tensor([0.0, -1.0])))
    True
    >>> float(out.metrics["rewards/accuracies"]), float(out.metrics["rewards/margins"])
    (0.5, 0.5)
    """
    _check_pairs(chosen_rewards=chosen_rewards, rejected_rewards=rejected_rewards)
    if isinstance(margin, Tensor):
        check_float("margin", margin)
        check_same_shape("margin", margin, "chosen_rewards", chosen_rewards)
        check_same_device("margin", margin, "chosen_rewards", chosen_rewards)
        check_finite("margin", margin)
    else:
        margin = check_real("margin", margin)
        if not math.isfinite(margin):
            raise ValueError(f"margin: must be finite, got {margin}")
    dtype = compute_dtype(chosen_rewards)
    c, r = _cast(dtype, chosen_rewards, rejected_rewards)
    m = margin.detach().to(dtype) if isinstance(margin, Tensor) else margin
    loss = -F.logsigmoid(c - r - m)
    return LossOutput(loss, _reward_metrics(c, r))
