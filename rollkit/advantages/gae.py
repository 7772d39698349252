"""Token-level advantage estimators: a mask-aware reverse discounted scan, discounted returns,
GAE, REINFORCE++ and REINFORCE++-baseline.

Masked-token convention (all functions here): a token whose ``mask`` is False is **not a
step**. Padding and, in multi-turn rollouts, environment / tool tokens inside a response are
skipped: the recursion jumps from a valid token straight to the next valid token, their
rewards and values are ignored (they may even be NaN), and the output there is exactly 0.
Inserting masked tokens anywhere in a row therefore leaves the outputs of the valid tokens
unchanged.

Implementation: the valid tokens of each row are compacted to the left with a stable
partition (a permutation, no sort), the reverse scan runs on the dense compacted rows in
chunks of ``chunk_size`` tokens with a ``[C, C]`` matrix of discount powers (one matmul), the
per-chunk carries are combined by the same scan applied recursively to the chunk heads
(depth ``log_C T``, no Python loop over tokens or chunks), and the result is gathered back.
When no row has an interior hole (right-padded single-turn batches) the compaction is the
identity and is skipped.
Only non-negative powers of the discount appear, so ``discount`` in ``[0, 1]`` never
overflows.

Devices: every tensor argument must be on the device of ``mask`` (``ValueError`` naming it;
torch would fail inside an op, or, for a ``meta`` mask, silently return uninitialised memory).
On the ``meta`` device (shape inference) these functions run inside
``rollkit.validation.value_checks(False)`` and return ``meta`` tensors of the right shapes;
with the value checks on they raise a ``ValueError`` naming the argument, since there are no
values to check. :func:`reinforce_pp_baseline_advantages` groups by id and refuses ``meta``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from rollkit import keys as K
from rollkit.ops import _segment_mean, group_index, masked_whiten
from rollkit.registry import ADVANTAGE_ESTIMATORS
from rollkit.validation import (
    check_discount,
    check_finite_float,
    check_finite_under_mask,
    check_float,
    check_group_ids,
    check_int,
    check_mask,
    check_ndim,
    check_positive,
    check_same_device,
    check_same_shape,
    check_scalar,
    check_shape,
    values_readable,
)

__all__ = [
    "discounted_returns",
    "gae_advantages",
    "reinforce_pp_advantages",
    "reinforce_pp_baseline_advantages",
    "reverse_discounted_cumsum",
]

DEFAULT_CHUNK_SIZE = 64


# --------------------------------------------------------------------------- private helpers


def _check_token_tensor(name: str, x: Tensor, mask: Tensor) -> None:
    """``x`` is a float ``[B, T]`` tensor of the shape of the bool ``mask`` (metadata only)."""
    check_ndim(name, x, 2)
    check_float(name, x)
    check_mask("mask", mask)
    check_same_shape(name, x, "mask", mask)


def _check_output_finite(out: Tensor, inputs: list[tuple[str, Tensor]], mask: Tensor) -> None:
    """Value check after the fact, for speed: one reduction of the output; only when it is not
    finite are the inputs checked under the mask, raising ``ValueError`` naming the bad one.
    (Finite inputs whose result overflows are returned as they are.) On the ``meta`` device
    this raises ``ValueError`` naming the first input (no values to check)."""
    if not values_readable(inputs[0][0], inputs[0][1]) or bool(torch.isfinite(out.sum())):
        return
    for name, x in inputs:
        check_finite_under_mask(name, x, mask)


def _check_chunk_size(chunk_size: int) -> None:
    if check_int("chunk_size", chunk_size) < 2:
        raise ValueError(f"chunk_size: must be >= 2, got {chunk_size}")


def _work_dtype(x: Tensor) -> torch.dtype:
    """float64 stays float64; everything else (float32/16, bfloat16) is scanned in float32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _tf32_active(z: Tensor) -> bool:
    return (
        z.is_cuda
        and z.dtype == torch.float32
        and (torch.backends.cuda.matmul.allow_tf32 or torch.get_float32_matmul_precision() != "highest")
    )


class _Layout(NamedTuple):
    """Where each row's valid tokens go when compacted to the left."""

    mask: Tensor  # [B, T] bool
    dest: Tensor | None  # [B, T] int64 permutation per row; None when compaction is the identity
    tail: Tensor | None  # [B, T] bool, compacted positions >= n_valid; None with dest
    n_valid: Tensor  # [B] int64 number of valid tokens per row


def _mask_is_cheap_to_read(mask: Tensor) -> bool:
    """Reading a CPU tensor's values is free; elsewhere it synchronises with the host."""
    return mask.device.type == "cpu"


def _layout(mask: Tensor) -> _Layout:
    """Stable partition of each row: valid tokens first (in order), then masked ones.

    Fast path: if no row has a hole (every row is a right-padded prefix, the usual single-turn
    case) the compaction is the identity and no index is built. Deciding that reads the mask,
    which is free on CPU but a host synchronisation on an accelerator, so it is only done on
    CPU: elsewhere the general path (also exact for right-padded rows) always runs. Temporaries
    are updated in place: on CPU, fresh multi-MB allocations (page faults) cost more than the
    arithmetic.
    """
    T = mask.shape[1]
    if T <= 1 or (
        _mask_is_cheap_to_read(mask) and not bool(torch.gt(mask[:, 1:], mask[:, :-1]).any())
    ):  # no False -> True step
        return _Layout(mask, None, None, mask.sum(dim=1))
    # cumsum in int32 (a bool -> int64 cumsum is ~10x slower on CPU), then int64 indices
    count = mask.cumsum(dim=1, dtype=torch.int32 if T < 2**31 - 1 else torch.int64).long()
    n_valid = count[:, -1:].clone()
    t = torch.arange(T, device=mask.device)
    dest = torch.sub(t, count).add_(n_valid)  # int64; masked token: n_valid + #masked tokens before it
    dest = torch.where(mask, count.sub_(1), dest, out=dest)  # valid token: #valid tokens before it
    tail = t >= n_valid
    return _Layout(mask, dest, tail, n_valid.squeeze(1))


def _compact(x: Tensor, lay: _Layout) -> Tensor:
    """A new tensor: the valid entries of each row moved to the left (in order), zeros after them."""
    if lay.dest is None:
        return torch.where(lay.mask, x, torch.zeros((), dtype=x.dtype, device=x.device))
    return torch.empty_like(x).scatter_(1, lay.dest, x).masked_fill_(lay.tail, 0)


def _expand(y: Tensor, lay: _Layout, out: Tensor | None = None) -> Tensor:
    """Inverse of :func:`_compact` for a scan result ``y`` (a temporary of ours, returned as is
    when the compaction is the identity; else gathered into ``out``, a free temporary of ours of
    the same shape, if given). Masked tokens map to compacted positions ``>= n_valid``, where a
    reverse scan of a zero tail is exactly 0, so no masking pass is needed."""
    if lay.dest is None:
        return y
    return torch.gather(y, 1, lay.dest, out=out) if out is not None else y.gather(1, lay.dest)


def _add_at_last(z: Tensor, lay: _Layout, values: Tensor) -> Tensor:
    """In place: ``z[b, n_valid[b] - 1] += values[b]`` for rows with a valid token."""
    if z.shape[1] == 0:
        return z
    idx = (lay.n_valid - 1).clamp(min=0).unsqueeze(1)
    vals = torch.where(lay.n_valid > 0, values.to(z.dtype), torch.zeros((), dtype=z.dtype, device=z.device))
    return z.scatter_add_(1, idx, vals.unsqueeze(1))


def _discount_matrix(n: int, discount: float, dtype: torch.dtype, device: torch.device) -> Tensor:
    """``W[j, i] = discount ** (j - i)`` for ``j >= i`` else 0, so that ``z @ W`` is the reverse
    discounted cumsum of a length-``n`` row. Powers are taken in float64 (``0 ** 0 = 1``)."""
    idx = torch.arange(n, device=device, dtype=torch.float64)
    expo = idx[:, None] - idx[None, :]  # j - i
    base = torch.tensor(float(discount), dtype=torch.float64, device=device)
    w = torch.where(
        expo >= 0, base.pow(expo.clamp(min=0)), torch.zeros((), dtype=torch.float64, device=device)
    )
    return w.to(dtype)


def _matmul(z: Tensor, w: Tensor) -> Tensor:
    if _tf32_active(z):  # TF32 would cut float32 matmuls to ~10 mantissa bits: do it in float64
        return (z.double() @ w.double()).to(z.dtype)
    return z @ w


def _dense_reverse_scan(z: Tensor, discount: float, chunk_size: int) -> Tensor:
    """``y[:, t] = sum_{s >= t} discount**(s - t) * z[:, s]`` on a dense ``[B, L]`` tensor."""
    B, L = z.shape
    if L == 0:
        return z.clone()
    if L <= chunk_size:
        return _matmul(z, _discount_matrix(L, discount, z.dtype, z.device))
    C = chunk_size
    n_chunks = -(-L // C)
    pad = n_chunks * C - L
    if pad:
        z = torch.nn.functional.pad(z, (0, pad))
    w = _discount_matrix(C, discount, z.dtype, z.device)
    local = _matmul(z.reshape(B * n_chunks, C), w).reshape(B, n_chunks, C)  # in-chunk scans
    # value at the start of each chunk: heads[c] + discount**C * start[c + 1], the same scan again
    start = _dense_reverse_scan(local[:, :, 0], float(discount) ** C, C)  # [B, n]
    carry = torch.nn.functional.pad(start[:, 1:], (0, 1))  # start of the next chunk, 0 after the last
    base = torch.tensor(float(discount), dtype=torch.float64, device=z.device)
    decay = base.pow(torch.arange(C, 0, -1, device=z.device, dtype=torch.float64)).to(z.dtype)
    local.addcmul_(carry.unsqueeze(-1), decay)  # y = local + carry * discount**(C - i), in place
    return local.reshape(B, n_chunks * C)[:, :L]


def _masked_reverse_scan(name: str, x: Tensor, mask: Tensor, discount: float, chunk_size: int) -> Tensor:
    """The reverse discounted scan of ``x`` (argument ``name``, already checked against ``mask``)
    over the valid tokens: compact, scan, expand, check the output, cast back to ``x.dtype``."""
    _check_chunk_size(chunk_size)
    lay = _layout(mask)
    z = _compact(x.to(_work_dtype(x)), lay)
    y = _expand(_dense_reverse_scan(z, discount, chunk_size), lay)
    _check_output_finite(y, [(name, x)], mask)
    return y.to(x.dtype)


def _check_seq_inputs(
    rewards: Tensor, mask: Tensor, kl: Tensor | None, kl_coef: float, gamma: float, eps: float
) -> None:
    check_ndim("mask", mask, 2)
    check_mask("mask", mask)
    check_shape("rewards", rewards, [mask.shape[0]])
    check_same_device("rewards", rewards, "mask", mask)
    check_finite_float("rewards", rewards)
    check_positive("kl_coef", check_scalar("kl_coef", kl_coef), allow_zero=True)
    if kl is not None:
        check_shape("kl", kl, list(mask.shape))
        _check_token_tensor("kl", kl, mask)
        if kl_coef > 0:
            check_finite_under_mask("kl", kl, mask)
    elif kl_coef > 0:
        raise ValueError("kl: a [B, T] per-token KL estimate is required when kl_coef > 0")
    check_discount("gamma", gamma)
    check_positive("eps", eps, allow_zero=True)


def _reinforce_pp_core(
    rewards: Tensor,
    mask: Tensor,
    kl: Tensor | None,
    kl_coef: float,
    gamma: float,
    whiten: bool,
    eps: float,
    unbiased_std: bool,
    chunk_size: int,
) -> Tensor:
    lay = _layout(mask)
    dtype = rewards.dtype if kl is None else torch.promote_types(rewards.dtype, kl.dtype)
    work = torch.float64 if dtype == torch.float64 else torch.float32
    # token rewards in compacted space: -kl_coef * KL, plus the sequence reward on the last valid token
    if kl is not None and kl_coef != 0:
        z = _compact(kl.to(work), lay).mul_(-kl_coef)
    else:
        z = torch.zeros(mask.shape, dtype=work, device=mask.device)
    _add_at_last(z, lay, rewards.to(work))
    returns = _expand(_dense_reverse_scan(z, float(gamma), chunk_size), lay).to(dtype)
    if not whiten:
        return returns
    return masked_whiten(returns, mask, unbiased=unbiased_std, eps=eps)


# --------------------------------------------------------------------------- public API


def reverse_discounted_cumsum(
    x: Tensor,  # [B, T] float
    mask: Tensor,  # [B, T] bool: the steps; False tokens are skipped
    *,
    discount: float,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> Tensor:  # [B, T], 0 where mask is False
    r"""Mask-aware reverse discounted cumulative sum over the valid tokens of each row.

        y_t = x_t + discount * y_{n(t)}    for mask_t = True,   y_t = 0 otherwise,

    where ``n(t)`` is the next position after ``t`` with ``mask`` True (``y`` after the last
    valid token is 0). Equivalently ``y_t = sum_{s >= t, valid} discount**k(t, s) * x_s`` with
    ``k(t, s)`` the number of valid tokens in ``[t, s)``. This is the discounted "reward-to-go"
    of Sutton & Barto (2018), the scan under GAE (Schulman et al., 2016, arXiv:1506.02438).

    What distinguishes it from ``torch.cumsum``-style or per-token-loop scans (verl, OpenRLHF,
    TRL): masked tokens are *not steps* (the discount is not applied across them, their ``x`` is
    ignored and may be NaN), and it is a vectorised, chunked scan (valid tokens compacted by a
    stable partition, ``[C, C]`` discount-power matmuls inside chunks, the chunk carries
    combined by the same scan applied recursively) with no Python loop over tokens. Only
    non-negative powers of ``discount`` are formed, so it is stable for any ``discount`` in
    ``[0, 1]``; ``discount = 0`` returns ``x`` on the mask.

    Args:
        x: ``[B, T]`` float values. float64 is scanned in float64, other float dtypes in
            float32; the output has the dtype of ``x``. On CUDA with TF32 matmuls enabled the
            float32 matmuls are done in float64, so TF32 never degrades the result.
        mask: ``[B, T]`` bool; a fully masked row gives a zero row.
        discount: in ``[0, 1]``.
        chunk_size: tokens per chunk ``C`` (an int ``>= 2``; 32-128 is fastest).

    Returns:
        ``[B, T]`` tensor, exactly 0 where ``mask`` is False. Differentiable w.r.t. ``x``.

    >>> x = torch.tensor([[1.0, 5.0, 1.0, 1.0, 0.0]])
    >>> mask = torch.tensor([[True, False, True, True, False]])
    >>> reverse_discounted_cumsum(x, mask, discount=0.5)
    tensor([[1.7500, 0.0000, 1.5000, 1.0000, 0.0000]])
    """
    _check_token_tensor("x", x, mask)
    check_discount("discount", discount)
    return _masked_reverse_scan("x", x, mask, float(discount), chunk_size)


@ADVANTAGE_ESTIMATORS.register(
    "discounted-returns",
    in_keys={"token_rewards": K.TOKEN_REWARDS, "mask": K.RESPONSE_MASK},
    out_keys=(K.RETURNS,),
)
def discounted_returns(
    token_rewards: Tensor,  # [B, T] float
    mask: Tensor,  # [B, T] bool
    *,
    gamma: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> Tensor:  # [B, T] returns, 0 where mask is False
    r"""Discounted return-to-go of per-token rewards over the valid tokens (Monte-Carlo return).

        G_t = r_t + gamma * G_{n(t)},  G = 0 after the last valid token and where mask is False

    (Sutton & Barto, *Reinforcement Learning: An Introduction*, 2018, eq. 3.9; the return used
    by REINFORCE, Williams 1992.) Unlike :func:`gae_advantages` there is no critic and no
    baseline; unlike OpenRLHF's ``get_cumulative_returns`` masked tokens are skipped rather
    than treated as zero-reward steps (so ``gamma`` is not applied across tool tokens).

    Args:
        token_rewards: ``[B, T]`` float; entries where ``mask`` is False are ignored.
        mask: ``[B, T]`` bool.
        gamma: discount in ``[0, 1]``.

    Returns:
        ``[B, T]`` returns.

    >>> r = torch.tensor([[0.0, 0.0, 1.0], [2.0, 0.0, 0.0]])
    >>> m = torch.tensor([[True, True, True], [True, False, False]])
    >>> discounted_returns(r, m, gamma=0.9)
    tensor([[0.8100, 0.9000, 1.0000],
            [2.0000, 0.0000, 0.0000]])
    """
    _check_token_tensor("token_rewards", token_rewards, mask)
    check_discount("gamma", gamma)
    return _masked_reverse_scan("token_rewards", token_rewards, mask, float(gamma), chunk_size)


@ADVANTAGE_ESTIMATORS.register(
    "gae",
    in_keys={
        "token_rewards": K.TOKEN_REWARDS,
        "values": K.VALUES,
        "mask": K.RESPONSE_MASK,
        "bootstrap_value": "bootstrap_value",  # optional [B]: absent from the batch -> None
    },
    out_keys=(K.ADVANTAGES, K.RETURNS),
)
def gae_advantages(
    token_rewards: Tensor,  # [B, T] float
    values: Tensor,  # [B, T] float, critic V(s_t)
    mask: Tensor,  # [B, T] bool
    *,
    gamma: float = 1.0,
    lam: float = 0.95,
    bootstrap_value: Tensor | None = None,  # [B] V of the state after the last valid token
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> tuple[Tensor, Tensor]:  # advantages [B, T], returns [B, T]
    r"""Generalized Advantage Estimation (Schulman, Moritz, Levine, Jordan & Abbeel, 2016,
    arXiv:1506.02438), with masked tokens skipped.

        delta_t = r_t + gamma * V_{n(t)} - V_t
        A_t     = delta_t + gamma * lam * A_{n(t)}
        R_t     = A_t + V_t                                    (the critic's lambda-return target)

    ``n(t)`` is the next valid token. After the last valid token ``V = bootstrap_value`` (a
    truncated episode) or 0 (a terminated one, the default) and ``A = 0``. Advantages and
    returns are exactly 0 where ``mask`` is False, and are **not** whitened (whiten with
    :func:`rollkit.ops.masked_whiten` if wanted; verl and OpenRLHF whiten inside their GAE).

    ``lam = 1`` gives the Monte-Carlo advantage ``G_t - V_t``; ``lam = 0`` the one-step TD error.
    Differs from OpenRLHF (masked tokens are steps with ``V = r = 0``) and from older verl
    (``values[t + 1]`` even when token ``t + 1`` is a tool token); recent verl also skips
    observation tokens but leaves the carried advantage on them instead of 0.

    Args:
        token_rewards: ``[B, T]`` float (e.g. a KL penalty per token plus the score on the last
            token); ignored where ``mask`` is False.
        values: ``[B, T]`` float critic values; ignored where ``mask`` is False.
        mask: ``[B, T]`` bool; a fully masked row gives zeros (its bootstrap is ignored).
        gamma, lam: in ``[0, 1]``.
        bootstrap_value: optional ``[B]`` float, ``V`` of the state after each row's last valid
            token.

    Returns:
        ``(advantages, returns)``, both ``[B, T]`` in the promoted dtype of the inputs.

    >>> r = torch.tensor([[0.0, 0.0, 1.0]])
    >>> v = torch.tensor([[0.5, 0.5, 0.5]])
    >>> m = torch.ones(1, 3, dtype=torch.bool)
    >>> adv, ret = gae_advantages(r, v, m, gamma=1.0, lam=1.0)
    >>> adv
    tensor([[0.5000, 0.5000, 0.5000]])
    >>> ret
    tensor([[1., 1., 1.]])
    """
    _check_token_tensor("token_rewards", token_rewards, mask)
    _check_token_tensor("values", values, mask)
    check_discount("gamma", gamma)
    check_discount("lam", lam)
    _check_chunk_size(chunk_size)
    dtype = torch.promote_types(token_rewards.dtype, values.dtype)
    if bootstrap_value is not None:
        check_shape("bootstrap_value", bootstrap_value, [mask.shape[0]])
        check_same_device("bootstrap_value", bootstrap_value, "mask", mask)
        check_finite_float("bootstrap_value", bootstrap_value)
        dtype = torch.promote_types(dtype, bootstrap_value.dtype)
    work = torch.float64 if dtype == torch.float64 else torch.float32
    lay = _layout(mask)
    # compacted space; temporaries updated in place. Beyond n_valid everything is 0.
    delta = _compact(token_rewards.to(work), lay)  # r, becomes delta below
    v = _compact(values.to(work), lay)
    delta[:, :-1].add_(v[:, 1:], alpha=float(gamma))  # + gamma * V(next valid token)
    if bootstrap_value is not None:  # + gamma * V(after the last valid token)
        _add_at_last(delta, lay, bootstrap_value.to(work) * float(gamma))
    delta.sub_(v)
    adv = _dense_reverse_scan(delta, float(gamma) * float(lam), chunk_size)
    ret = v.add_(adv)
    # reuse the freed temporaries as the outputs of the gathers (fresh pages are slow on CPU);
    # gather(out=...) does not support autograd, so only without gradients
    reuse = not adv.requires_grad and adv.is_contiguous()
    advantages = _expand(adv, lay, out=delta if reuse else None)
    returns = _expand(ret, lay, out=adv if reuse else None)
    _check_output_finite(advantages, [("token_rewards", token_rewards), ("values", values)], mask)
    return advantages.to(dtype), returns.to(dtype)


@ADVANTAGE_ESTIMATORS.register(
    "reinforce++",
    aliases=("reinforce_plus_plus",),
    in_keys={"rewards": K.REWARDS, "mask": K.RESPONSE_MASK, "kl": K.KL},
    out_keys=(K.ADVANTAGES,),
)
def reinforce_pp_advantages(
    rewards: Tensor,  # [B] sequence rewards
    mask: Tensor,  # [B, T] bool
    *,
    kl: Tensor | None = None,  # [B, T] per-token KL estimate, e.g. logprobs - ref_logprobs
    kl_coef: float = 0.0,
    gamma: float = 1.0,
    whiten: bool = True,
    eps: float = 1e-8,
    unbiased_std: bool = False,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> Tensor:  # [B, T] advantages, 0 where mask is False
    r"""REINFORCE++ advantages (Hu, 2025, arXiv:2501.03262): a critic-free, token-level return
    with a per-token KL penalty, whitened over the whole batch.

        r_t = -kl_coef * KL_t + [t = last valid token] * R          (R = rewards[b])
        G_t = r_t + gamma * G_{n(t)}
        A_t = (G_t - mean(G)) / sqrt(var(G) + eps)                  (over all valid tokens of the batch)

    ``var`` is the biased (``/ n``) variance by default, as in OpenRLHF's reference
    implementation (``unbiased_std=True`` gives verl's ``/ (n - 1)``). Unlike GRPO/RLOO there is
    no per-prompt baseline (see :func:`reinforce_pp_baseline_advantages`); unlike GAE no critic.
    Masked tokens are skipped (no step, no KL, output 0). A row without valid tokens drops its
    reward. With ``whiten=True`` an all-False ``mask`` raises ``ValueError``; a single valid
    token in the whole batch (zero variance) gets advantage 0 with the default
    ``unbiased_std=False``, while ``unbiased_std=True`` raises ``ValueError`` (an ``n - 1``
    variance needs two tokens).

    Args:
        rewards: ``[B]`` float sequence rewards.
        mask: ``[B, T]`` bool response mask.
        kl: optional ``[B, T]`` float per-token KL estimate (required when ``kl_coef > 0``).
        kl_coef: KL penalty coefficient ``>= 0``.
        gamma: discount in ``[0, 1]``.
        whiten: whiten the returns over all valid tokens of the batch.
        eps: added to the variance before the square root.
        unbiased_std: divide the variance by ``n - 1`` instead of ``n`` (named as the
            ``unbiased_std`` of the other estimators).

    Returns:
        ``[B, T]`` advantages.

    >>> rewards = torch.tensor([1.0, 0.0])
    >>> mask = torch.tensor([[True, True, False], [True, True, True]])
    >>> reinforce_pp_advantages(rewards, mask, whiten=False)
    tensor([[1., 1., 0.],
            [0., 0., 0.]])
    >>> adv = reinforce_pp_advantages(rewards, mask)   # mean 0.4, biased std 0.4899 over 5 tokens
    >>> torch.allclose(adv[0, :2], torch.tensor([1.2247, 1.2247]), atol=1e-4)
    True
    """
    _check_seq_inputs(rewards, mask, kl, kl_coef, gamma, eps)
    _check_chunk_size(chunk_size)
    return _reinforce_pp_core(rewards, mask, kl, kl_coef, gamma, whiten, eps, unbiased_std, chunk_size)


@ADVANTAGE_ESTIMATORS.register(
    "reinforce++-baseline",
    aliases=("reinforce_plus_plus_baseline",),
    in_keys={"rewards": K.REWARDS, "group_ids": K.GROUP_IDS, "mask": K.RESPONSE_MASK, "kl": K.KL},
    out_keys=(K.ADVANTAGES,),
)
def reinforce_pp_baseline_advantages(
    rewards: Tensor,  # [B] sequence rewards
    group_ids: Tensor,  # [B] int, samples of the same prompt share an id
    mask: Tensor,  # [B, T] bool
    *,
    kl: Tensor | None = None,  # [B, T] per-token KL estimate
    kl_coef: float = 0.0,
    gamma: float = 1.0,
    whiten: bool = True,
    eps: float = 1e-8,
    unbiased_std: bool = False,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> Tensor:  # [B, T] advantages, 0 where mask is False
    r"""REINFORCE++-baseline (Hu, 2025, arXiv:2501.03262; OpenRLHF's ``reinforce_baseline``):
    REINFORCE++ on group-mean-centred rewards.

        R'_b = R_b - mean_{b' in group(b)} R_b'                      (no division by the group std)
        r_t  = -kl_coef * KL_t + [t = last valid token] * R'_b
        G_t  = r_t + gamma * G_{n(t)},   A = whiten(G) over all valid tokens of the batch

    As in OpenRLHF, the group mean is subtracted from the *sequence* reward first, the KL
    penalty then enters per token (not centred by the group), and the returns are whitened
    globally (biased variance by default). Unlike GRPO the spread is normalised once over the
    batch instead of per group, so low-variance prompts are not up-weighted. verl's version
    instead sums KL into the score before centring, broadcasts the centred score to all
    tokens and gives a singleton group a zero baseline.

    Groups: any ids, any order, any sizes. A singleton group's baseline is its own reward, so
    its centred reward is 0 (only the KL term remains). Zero-variance groups give exactly 0
    before KL (the group mean is computed in float64, so float32 round-off is not whitened up).
    Other edge cases as in :func:`reinforce_pp_advantages`.

    Args:
        rewards: ``[B]`` float. group_ids: ``[B]`` int. mask: ``[B, T]`` bool.
        kl, kl_coef, gamma, whiten, eps, unbiased_std: as in :func:`reinforce_pp_advantages`.

    Returns:
        ``[B, T]`` advantages.

    >>> rewards = torch.tensor([1.0, 0.0, 0.5])
    >>> gid = torch.tensor([0, 0, 1])
    >>> mask = torch.tensor([[True, True], [True, False], [True, True]])
    >>> reinforce_pp_baseline_advantages(rewards, gid, mask, whiten=False)
    tensor([[ 0.5000,  0.5000],
            [-0.5000,  0.0000],
            [ 0.0000,  0.0000]])
    """
    _check_seq_inputs(rewards, mask, kl, kl_coef, gamma, eps)
    check_group_ids("group_ids", group_ids, mask.shape[0])
    check_same_device("group_ids", group_ids, "mask", mask)
    _check_chunk_size(chunk_size)
    index, n_groups = group_index(group_ids)
    # float64 centring: a constant group gives exactly 0 (in float32 the round-off of its mean,
    # ~1e-7, would be amplified ~1e4x by whitening with eps = 1e-8)
    r64 = rewards.double()
    centred = (r64 - _segment_mean(r64, index, n_groups).index_select(0, index)).to(rewards.dtype)
    return _reinforce_pp_core(centred, mask, kl, kl_coef, gamma, whiten, eps, unbiased_std, chunk_size)
