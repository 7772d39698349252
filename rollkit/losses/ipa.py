"""IPA: importance ratios, masks and the clipped policy loss over *interaction chunks*.

IPA ("Interaction-Perceptive Agentic Policy Optimization") is the agentic RL algorithm of
Wang et al. 2025, "Let It Flow: Agentic Crafting on Rock and Roll, Building the ROME Model
within an Open Agentic Learning Ecosystem", arXiv:2512.24873. It assigns credit and takes
importance ratios over *interaction chunks* instead of single tokens: one chunk is a model
turn (its action tokens) together with what it caused in the environment. In a multi-turn
batch a chunk is identified by ``chunk_ids`` ``[B, T]`` (the turn index of each action token,
``TrajectoryBatch.step_ids``); the chunk-level return is :func:`rollkit.advantages.ipa_advantages`.

**Provenance.** The paper's own equations could not be consulted when this module was written
(only third-party summaries of arXiv:2512.24873 were reachable). The formulas follow ROLL's
implementation (github.com/alibaba/ROLL, the authors' framework): the chunk ratio is
``ratio_type="segment"`` of ``roll/pipeline/agentic/agentic_actor_pg_worker.py``, i.e.
``exp(compute_segment_masked_mean(log_ratio, response_mask))`` of
``roll/pipeline/agentic/utils.py`` (the geometric mean of the token ratios of the chunk),
fed to ROLL's PPO surrogate (``pg_variant="ppo"``). ``reduce="sum"`` (the exact product of the
chunk's token ratios) is offered beside it; it is not ROLL's default.

Shapes: ``logprobs``, ``old_logprobs``, ``mask``, ``chunk_ids`` are ``[B, T]``; ``advantages``
``[B, T]`` or ``[B]``. Chunks are the ``(row, chunk_id)`` pairs of the valid tokens: two rows
never share a chunk, and the values of ``chunk_ids`` under a False mask do not matter. A chunk
need not be contiguous (ROLL's segments are contiguous runs of the mask, which is the same
thing when each turn's action tokens are contiguous, as in rollkit's trajectory layout).
``chunk_ids=None`` makes the whole row one chunk (the sequence-level ratio of GSPO).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from rollkit.keys import STEP_IDS
from rollkit.losses._common import check_seq_or_token, check_token_tensors, compute_dtype, zero_outside
from rollkit.losses.policy import (
    _IN_KEYS,
    _OUT_KEYS,
    _check_clamp,
    _check_clip,
    _check_inputs,
    _clip_metrics,
    _clipped_loss,
    _counts,
    _log_ratio,
    _ratio_metrics,
    _token_adv,
)
from rollkit.registry import POLICY_LOSSES
from rollkit.types import LossOutput
from rollkit.validation import (
    check_choice,
    check_float,
    check_int_tensor,
    check_mask,
    check_positive,
    check_same_device,
    check_same_shape,
)

__all__ = ["chunk_index", "chunk_log_ratio", "chunk_clip_mask", "chunk_mask", "ipa_loss"]

_REDUCES = ("mean", "sum")


def _check_chunk_ids(chunk_ids: Tensor | None, mask: Tensor) -> None:
    """``mask`` a ``[B, T]`` bool tensor (the check of :func:`chunk_log_ratio`'s mask), and
    ``chunk_ids`` ``None`` or an integer tensor of its shape on its device."""
    check_mask("mask", mask)
    if mask.ndim != 2:
        raise ValueError(f"mask: expected shape [B, T], got {list(mask.shape)}")
    if chunk_ids is not None:
        check_int_tensor("chunk_ids", chunk_ids)
        check_same_shape("chunk_ids", chunk_ids, "mask", mask)  # and its device


def chunk_index(chunk_ids: Tensor | None, mask: Tensor) -> tuple[Tensor, Tensor, int]:
    """Dense index of the interaction chunks: ``(index [B, T], valid [C], C)``.

        index[b, t] = index[b', t']  <=>  b = b'  and  chunk_ids[b, t] = chunk_ids[b', t']
                                           (both tokens valid)

    Valid tokens of one ``(row, chunk_id)`` pair share an index in ``[0, C)``; the invalid
    tokens of each row form one extra unit (``valid[c]`` False), never merged with a chunk, so
    the values of ``chunk_ids`` under a False ``mask`` do not matter. ``chunk_ids=None``: one
    chunk per non-empty row. Numbered by sorted ``(row, chunk_id)``, so relabelling the ids of
    a row order-preservingly changes nothing.

    Args:
        chunk_ids: ``[B, T]`` int (e.g. the turn of each token) on ``mask``'s device, or ``None``.
        mask: ``[B, T]`` bool, the action tokens. As everywhere in rollkit, anything else (``None``,
            a list, a ``uint8`` or float mask, a ``[T]`` mask) is refused naming ``mask``.

    >>> ids = torch.tensor([[0, 0, -1, 1], [5, 5, 5, 5]])
    >>> m = torch.tensor([[True, True, False, True], [True, True, False, False]])
    >>> idx, valid, n = chunk_index(ids, m)
    >>> idx.tolist(), valid.tolist(), n
    ([[1, 1, 0, 2], [4, 4, 3, 3]], [False, True, True, False, True], 5)
    """
    _check_chunk_ids(chunk_ids, mask)
    b, t = mask.shape
    if mask.numel() == 0:
        empty = torch.zeros(0, dtype=torch.bool, device=mask.device)
        return torch.zeros(mask.shape, dtype=torch.int64, device=mask.device), empty, 0
    if mask.is_meta:  # shapes only (no values to sort): two units per row, its invalid then its valid tokens
        rows = torch.arange(b, device=mask.device).unsqueeze(-1).expand(b, t)
        valid = torch.arange(2 * b, device=mask.device) % 2 == 1
        return 2 * rows + mask.to(torch.int64), valid, 2 * b
    zero = torch.zeros((), dtype=torch.int64, device=mask.device)
    ids = zero.expand(b, t) if chunk_ids is None else torch.where(mask, chunk_ids.to(torch.int64), zero)
    rows = torch.arange(b, device=mask.device).unsqueeze(-1).expand(b, t)
    keys = torch.stack([rows.reshape(-1), mask.reshape(-1).to(torch.int64), ids.reshape(-1)])
    uniq, inv = torch.unique(keys, dim=1, return_inverse=True)
    return inv.view(b, t), uniq[1].bool(), int(uniq.shape[1])


def _chunk_reduce(lr: Tensor, mask: Tensor, index: Tensor, n: int, reduce: str) -> Tensor:
    """``[C]`` sum (or mean) of the token values ``lr`` (0 outside the mask) of each chunk."""
    flat = index.reshape(-1)
    sums = torch.zeros(n, dtype=lr.dtype, device=lr.device).index_add(0, flat, lr.reshape(-1))
    if reduce == "sum":
        return sums
    counts = torch.zeros(n, dtype=lr.dtype, device=lr.device).index_add(
        0, flat, mask.reshape(-1).to(lr.dtype)
    )
    return sums / counts.clamp(min=1)


def chunk_log_ratio(
    logprobs: Tensor,  # [B, T], carries the gradient
    old_logprobs: Tensor,  # [B, T]
    mask: Tensor,  # [B, T] bool
    chunk_ids: Tensor | None = None,  # [B, T] int
    *,
    reduce: str = "mean",
    log_ratio_clamp: float | None = 20.0,
) -> Tensor:  # [B, T]: log rho_c of each token's chunk, 0 outside the mask
    """Chunk-level log importance ratio, on every token of the chunk (IPA, arXiv:2512.24873).

    With ``d_t = logprobs_t - old_logprobs_t`` over the valid tokens and ``c(t)`` the chunk of
    token ``t``::

        reduce="mean":   log rho_c = (1/|c|) sum_{t in c} d_t      rho_c = (prod_{t in c} r_t)^(1/|c|)
        reduce="sum":    log rho_c =         sum_{t in c} d_t      rho_c =  prod_{t in c} r_t
        out[b, t] = min(log rho_{c(t)}, log_ratio_clamp)   on valid tokens, 0 elsewhere

    ``"mean"`` (the geometric mean of the chunk's token ratios) is what ROLL computes for
    ``ratio_type="segment"`` (``compute_segment_masked_mean`` of the token log-ratios in
    ``roll/pipeline/agentic/utils.py``); the paper's own equation was not available to check
    it against (see the module docstring). ``"sum"`` is the exact importance weight of the
    chunk's action, whose variance grows with the chunk's length. ``old_logprobs`` is treated as
    a constant; the gradient reaches every token of the chunk:
    ``d log rho_c / d logprobs_s = 1/|c|`` (mean) or ``1`` (sum) for ``s`` in ``c``.

    A NaN / ``+-inf`` log-prob at a valid token makes its whole chunk NaN (no clamp turns it
    into a number); values under a False mask never matter. Half-precision inputs are computed
    in float32.

    Args:
        logprobs: ``[B, T]`` float. old_logprobs: ``[B, T]`` float. mask: ``[B, T]`` bool.
        chunk_ids: ``[B, T]`` int (turn index of each token) or ``None`` (one chunk per row).
        reduce: ``"mean"`` or ``"sum"``.
        log_ratio_clamp: upper clamp (> 0) of ``log rho_c`` before any ``exp``, or ``None``.

    >>> lp = torch.tensor([[-1.0, -1.0, 0.0, -2.0]])
    >>> old = torch.tensor([[-1.1, -1.3, 0.0, -1.9]])
    >>> m = torch.tensor([[True, True, False, True]])
    >>> ids = torch.tensor([[0, 0, -1, 1]])
    >>> chunk_log_ratio(lp, old, m, ids)          # chunk 0: mean(0.1, 0.3); chunk 1: -0.1
    tensor([[ 0.2000,  0.2000,  0.0000, -0.1000]])
    >>> chunk_log_ratio(lp, old, m, ids, reduce="sum")
    tensor([[ 0.4000,  0.4000,  0.0000, -0.1000]])
    """
    check_token_tensors(mask, logprobs=logprobs, old_logprobs=old_logprobs)
    check_choice("reduce", reduce, _REDUCES)
    _check_clamp(log_ratio_clamp)
    index, _, n = chunk_index(chunk_ids, mask)
    dtype = compute_dtype(logprobs)
    lr = _log_ratio(logprobs.to(dtype), old_logprobs.to(dtype), mask, None)
    if n == 0:
        return lr
    per_chunk = _chunk_reduce(lr, mask, index, n, reduce)
    if log_ratio_clamp is not None:
        per_chunk = per_chunk.clamp(max=log_ratio_clamp)
    return zero_outside(per_chunk.index_select(0, index.reshape(-1)).view(mask.shape), mask)


def chunk_clip_mask(
    chunk_log_ratio: Tensor,  # [B, T] log rho_c per token (from chunk_log_ratio)
    advantages: Tensor,  # [B, T] or [B]
    mask: Tensor,  # [B, T] bool
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
) -> Tensor:  # [B, T] bool: tokens whose chunk the PPO clip drops
    """Tokens whose chunk is *clipped* by IPA's surrogate (they pass no gradient).

        clipped_t = valid_t and ( (A_t > 0 and rho_c(t) > 1 + clip_high)
                                  or (A_t < 0 and rho_c(t) < 1 - clip_low) )

    Because ``rho_c`` is one number per chunk, a chunk with a constant advantage (the
    chunk-level advantages of :func:`rollkit.advantages.ipa_advantages`) is clipped as a whole:
    every one of its tokens, or none. This is exactly where :func:`ipa_loss` has a zero
    gradient; it is reported there as ``clip_frac``. It is computed by :func:`ipa_loss`'s own
    comparison (``-A clip(rho) > -A rho``, on ``rho = exp(chunk_log_ratio)`` in the same
    dtype), so it is that set bit for bit, also where rounding decides.

    Non-finite values follow the policy losses (no value is checked, so no device
    synchronisation, and the mask runs on ``meta``): a NaN ``log rho_c`` (which
    :func:`chunk_log_ratio` gives a chunk with a NaN / ``+-inf`` log-prob) or a NaN advantage
    is **not clipped** (False), as in :func:`ipa_loss`, whose loss and gradient are then NaN at
    that token: the NaN propagates instead of vanishing silently (:func:`chunk_mask` keeps such
    a chunk for the same reason). ``+inf`` / ``-inf`` are ordered as usual (clipped with a
    positive / negative advantage). Values under a False mask never matter.

    Args:
        chunk_log_ratio: ``[B, T]`` float, ``log rho_c`` on every token (0 outside the mask).
        advantages: ``[B, T]`` or ``[B]`` float, on the device of ``chunk_log_ratio``.
        mask: ``[B, T]`` bool. clip_low: in ``[0, 1]``. clip_high: ``>= 0``.

    >>> lr = torch.tensor([[0.2, 0.2, 0.0, -0.1]])
    >>> m = torch.tensor([[True, True, False, True]])
    >>> chunk_clip_mask(lr, torch.tensor([[0.9, 0.9, 0.0, 1.0]]), m).tolist()   # e^0.2 > 1.2
    [[True, True, False, False]]
    >>> chunk_clip_mask(torch.tensor([[float("nan"), 0.5]]), torch.ones(1), torch.ones(1, 2, dtype=torch.bool))
    tensor([[False,  True]])
    """
    check_token_tensors(mask, chunk_log_ratio=chunk_log_ratio)
    check_float("advantages", advantages)
    check_seq_or_token("advantages", advantages, "chunk_log_ratio", chunk_log_ratio)
    check_same_device("advantages", advantages, "chunk_log_ratio", chunk_log_ratio)
    _check_clip(clip_low, clip_high)
    with torch.no_grad():
        dtype = compute_dtype(chunk_log_ratio)
        adv = _token_adv(advantages, dtype, mask)
        # ipa_loss's own comparison on the same float values, not a log-domain twin that
        # rounding could make disagree with it (exp(1e-9) is 1 in float32, 1e-9 > 0 is not)
        ratio = chunk_log_ratio.detach().to(dtype).exp()
        _, clipped, _ = _clipped_loss(ratio, adv, clip_low, clip_high, None)
        return mask & clipped


def chunk_mask(
    chunk_log_ratio: Tensor,  # [B, T] log rho_c per token
    mask: Tensor,  # [B, T] bool
    *,
    low: float | None = None,
    high: float | None = None,
) -> Tensor:  # [B, T] bool: the tokens kept
    """Chunk-level rejection: keep a chunk only if its ratio lies in ``[low, high]``.

        keep_t = valid_t and not (rho_c(t) < low) and not (rho_c(t) > high)

    A whole interaction chunk is dropped or kept (the keep-mask is constant on each chunk), the
    chunk analogue of token masking (IcePop) and sequence masking (verl's ``rollout_rs``).
    AND it into the loss mask. A NaN ratio is kept (so it propagates into the loss instead of
    vanishing silently). For the rollout-engine mismatch (``pi_old`` vs the behaviour policy)
    the same rejection per turn is :func:`rollkit.correction.correction_weights` with
    ``level="segment"`` / ``mask_level="segment"`` and ``segment_ids`` = the chunk ids
    (ROLL's ``train_infer_correction`` at the ``"segment"`` level).

    Args:
        chunk_log_ratio: ``[B, T]`` float, ``log rho_c`` on every token. mask: ``[B, T]`` bool.
        low, high: bounds on ``rho_c`` (> 0, ``low <= high``), or ``None`` (not applied).

    >>> lr = torch.tensor([[0.2, 0.2, 0.0, -0.1]])
    >>> m = torch.tensor([[True, True, False, True]])
    >>> chunk_mask(lr, m, low=0.95, high=1.1).tolist()     # e^0.2 = 1.22 > 1.1: chunk 0 dropped
    [[False, False, False, False]]
    >>> chunk_mask(lr, m, high=1.5).tolist()
    [[True, True, False, True]]
    """
    check_token_tensors(mask, chunk_log_ratio=chunk_log_ratio)
    for name, v in (("low", low), ("high", high)):
        if v is not None:
            check_positive(name, v)
    if low is not None and high is not None and low > high:
        raise ValueError(f"low: must be <= high ({high}), got {low}")
    lr = chunk_log_ratio.detach()
    keep = mask.clone()
    if high is not None:
        keep &= ~(lr > math.log(high))
    if low is not None:
        keep &= ~(lr < math.log(low))
    return keep


@POLICY_LOSSES.register(
    "ipa",
    aliases=("chunk-ppo", "ipa-chunk"),
    in_keys={**_IN_KEYS, "chunk_ids": STEP_IDS},
    out_keys=_OUT_KEYS,
)
def ipa_loss(
    logprobs: Tensor,  # [B, T], carries the gradient
    old_logprobs: Tensor,  # [B, T]
    advantages: Tensor,  # [B, T] or [B]
    mask: Tensor,  # [B, T] bool
    chunk_ids: Tensor | None = None,  # [B, T] int: the interaction chunk (turn) of each token
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    reduce: str = "mean",
    log_ratio_clamp: float | None = 20.0,
) -> LossOutput:
    """IPA's policy loss: PPO's clipped surrogate with a *chunk-level* ratio (arXiv:2512.24873).

        rho_c = exp( (1/|c|) sum_{t in c} (logprobs_t - old_logprobs_t) )     (reduce="mean")
        L_t   = max( -A_t rho_c(t), -A_t clip(rho_c(t), 1 - clip_low, 1 + clip_high) )

    with ``c(t)`` the interaction chunk of token ``t`` (``(row, chunk_ids)``; see
    :func:`chunk_log_ratio`, which also has ``reduce="sum"``, the exact chunk ratio). Every
    token of a chunk sees the same ratio, so the trust region is per interaction chunk: a chunk
    whose ratio left it (with the advantage's sign) passes no gradient at all
    (:func:`chunk_clip_mask`), where PPO drops single tokens and GSPO whole responses. Inside
    the region the gradient is ``d L_t / d logprobs_s = -A_t rho_c / |c|`` for every ``s`` in
    ``c(t)`` (``reduce="mean"``), so a chunk's tokens share its credit.

    Provenance: the ratio is ROLL's ``ratio_type="segment"`` and the surrogate ROLL's
    ``pg_variant="ppo"`` (``roll/pipeline/agentic/agentic_actor_pg_worker.py``), which ROLL
    aggregates with its ``loss_agg_mode`` (``"token-mean"`` by default); the paper's own
    equations were not available to check these against (see the module docstring).
    ``chunk_ids=None`` gives one chunk per row, i.e. :func:`rollkit.losses.gspo`'s loss matrix
    (with ``[B]`` advantages); chunks of one token each give :func:`rollkit.losses.ppo_clip`.

    Registered in ``POLICY_LOSSES`` as ``"ipa"`` (aliases ``"chunk-ppo"``, ``"ipa-chunk"``),
    reading ``chunk_ids`` from the batch key ``"step_ids"`` (``TrajectoryBatch.step_ids``);
    without it the whole response is one chunk. Pair it with the chunk-level advantages of
    ``ADVANTAGE_ESTIMATORS["ipa"]`` (:func:`rollkit.advantages.ipa_advantages`).

    Args:
        logprobs: ``[B, T]`` float, carries the gradient. old_logprobs: ``[B, T]`` float.
        advantages: ``[B, T]`` or ``[B]`` float (constants). mask: ``[B, T]`` bool.
        chunk_ids: ``[B, T]`` int or ``None``.
        clip_low: in ``[0, 1]``. clip_high: ``>= 0``. reduce: ``"mean"`` or ``"sum"``.
        log_ratio_clamp: upper clamp of ``log rho_c`` before ``exp`` (> 0), or ``None``.

    Returns:
        ``LossOutput(loss [B, T], metrics)``, ``loss`` 0 outside the mask; metrics:
        ``clip_frac`` (``_low`` / ``_high``: valid tokens of clipped chunks, by the sign of the
        advantage), ``chunk_ratio_mean`` / ``chunk_ratio_min`` / ``chunk_ratio_max`` (over the
        chunks; 1 if none), ``num_chunks``, and the token-level ``ratio_mean`` / ``ratio_min``
        / ``ratio_max`` / ``approx_kl`` (k3) of the other policy losses.

    >>> lp = torch.tensor([[-1.0, -1.0, 0.0, -2.0]], requires_grad=True)
    >>> old = torch.tensor([[-1.1, -1.3, 0.0, -1.9]])
    >>> m = torch.tensor([[True, True, False, True]])
    >>> adv = torch.tensor([[0.9, 0.9, 0.0, 1.0]])
    >>> out = ipa_loss(lp, old, adv, m, torch.tensor([[0, 0, -1, 1]]))
    >>> out.loss                     # chunk 0: rho = e^0.2 > 1.2, clipped at -0.9 * 1.2
    tensor([[-1.0800, -1.0800,  0.0000, -0.9048]], grad_fn=<WhereBackward0>)
    >>> out.loss.sum().backward()
    >>> lp.grad                      # no gradient through the clipped chunk
    tensor([[ 0.0000,  0.0000,  0.0000, -0.9048]])
    """
    _check_inputs(logprobs, old_logprobs, advantages, mask)
    _check_clip(clip_low, clip_high)
    clr = chunk_log_ratio(
        logprobs, old_logprobs, mask, chunk_ids, reduce=reduce, log_ratio_clamp=log_ratio_clamp
    )
    dtype = clr.dtype
    adv = _token_adv(advantages, dtype, mask)
    loss, clipped, _ = _clipped_loss(clr.exp(), adv, clip_low, clip_high, None)
    loss = zero_outside(loss, mask)
    with torch.no_grad():
        count, n = _counts(mask, dtype)
        metrics = _clip_metrics(clipped & mask, adv, count)
        tok = _log_ratio(logprobs.detach().to(dtype), old_logprobs.to(dtype), mask, log_ratio_clamp)
        metrics.update(_ratio_metrics(tok, mask, n))
        metrics.update(_chunk_metrics(clr.detach(), mask, chunk_ids))
    return LossOutput(loss, metrics)


def _chunk_metrics(clr: Tensor, mask: Tensor, chunk_ids: Tensor | None) -> dict[str, Tensor]:
    """``chunk_ratio_mean`` / ``_min`` / ``_max`` over the valid chunks, and ``num_chunks``."""
    index, valid, n = chunk_index(chunk_ids, mask)
    one = torch.ones((), dtype=clr.dtype, device=clr.device)
    if n == 0 or mask.is_meta or not mask.any():  # meta: shapes only, the metrics are placeholders
        return {
            "chunk_ratio_mean": one,
            "chunk_ratio_min": one,
            "chunk_ratio_max": one,
            "num_chunks": 0 * one,
        }
    per = torch.zeros(n, dtype=clr.dtype, device=clr.device).scatter(0, index.reshape(-1), clr.reshape(-1))
    per = per[valid].exp()
    return {
        "chunk_ratio_mean": per.mean(),
        "chunk_ratio_min": per.min(),
        "chunk_ratio_max": per.max(),
        "num_chunks": torch.tensor(float(per.numel()), dtype=clr.dtype, device=clr.device),
    }
