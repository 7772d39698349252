"""Token log-probs and entropy under the rollout's processed sampling distribution.

The trainer must score sampled tokens under the distribution they were sampled from:
temperature, then top-k, then top-p, renormalised over the kept tokens (the *sampling replay*).
:func:`token_logprobs` does it from ``[..., V]`` logits; :func:`lean_token_logprobs` does it
from the final hidden states and the LM head, chunk by chunk, without ever holding the
``[N, V]`` logits. Guide and formulas: ``docs/logprobs.md``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from rollkit.validation import (
    InvalidTypeError,
    check_float,
    check_int,
    check_int_tensor,
    check_positive,
    check_positive_int,
    check_real,
    values_readable,
)

__all__ = ["lean_token_logprobs", "outside_support", "support_mask", "token_logprobs"]


# ----------------------------------------------------------------------------- validation


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for every float dtype but float64 (kept, for gradcheck and references)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check_sampling(temperature: object, top_k: object, top_p: object) -> tuple[float, int, float]:
    check_positive("temperature", temperature)  # type: ignore[arg-type]
    k = check_int("top_k", top_k)
    p = check_real("top_p", top_p)
    if not 0.0 < p <= 1.0:
        raise ValueError(f"top_p: must be in (0, 1], got {top_p}")
    return float(temperature), k, p  # type: ignore[arg-type]


def _check_tokens(tokens: object, lead: tuple[int, ...], V: int, what: str) -> Tensor:
    check_int_tensor("tokens", tokens)
    assert isinstance(tokens, Tensor)
    if tuple(tokens.shape) != lead:
        raise ValueError(
            f"tokens: shape {list(tokens.shape)} does not match the leading dims {list(lead)} of {what}"
        )
    if tokens.numel() and values_readable("tokens", tokens):
        lo, hi = int(tokens.min()), int(tokens.max())
        if lo < 0 or hi >= V:
            raise ValueError(
                f"tokens: must be in [0, {V}) (the vocabulary of {what}), got values in [{lo}, {hi}]"
            )
    return tokens


def _check_logits(logits: object) -> Tensor:
    check_float("logits", logits)  # type: ignore[arg-type]
    assert isinstance(logits, Tensor)
    if logits.ndim < 1 or logits.shape[-1] < 1:
        raise ValueError(f"logits: expected shape [..., V] with V >= 1, got {list(logits.shape)}")
    return logits


def _check_orderable(logits: Tensor) -> None:
    """``logits`` hold no NaN and no ``+inf`` (``-inf``, a banned token, is fine): the kept set
    sorts and softmaxes them, and either one makes the set meaningless without an error.
    A data check (one host synchronisation), skipped inside ``value_checks(False)``."""
    if not logits.numel() or not values_readable("logits", logits):
        return
    nan, pos_inf = torch.isnan(logits), torch.isposinf(logits)
    bad = nan | pos_inf
    if bool(bad.any()):
        first = tuple(int(i) for i in bad.nonzero()[0].tolist())
        raise ValueError(
            f"logits: contains {int(nan.sum())} NaN and {int(pos_inf.sum())} +inf values (first at "
            f"index {first}), for which the kept set is undefined (-inf, a banned token, is allowed)"
        )


# ----------------------------------------------------------------------------- the replay


def _kept(z: Tensor, top_k: int, top_p: float) -> Tensor | None:
    """``[n, V]`` float32 tempered logits -> ``[n, V]`` bool kept set (None: all kept).

    Mirrors vLLM's ``apply_top_k_top_p_pytorch`` operation for operation (ascending sort,
    top-k by the k-th largest value with ties kept, top-p removes the tokens whose ascending
    cumulative probability is ``<= 1 - top_p``, the most likely token always kept), so the
    kept set is bit-identical to vLLM's on the same logits and device.
    """
    V = z.shape[-1]
    use_k = 0 < top_k < V
    if top_p >= 1.0:
        if not use_k:
            return None
        return z >= torch.topk(z, top_k, dim=-1).values[..., -1:]
    zs, idx = torch.sort(z, dim=-1)  # ascending
    if use_k:
        zs = zs.masked_fill(zs < zs[..., V - top_k : V - top_k + 1], float("-inf"))
    cum = torch.cumsum(zs.softmax(dim=-1), dim=-1)
    del zs
    # vLLM compares with 1 - p computed in float32 from a float32 p: same threshold here
    thr = 1.0 - float(torch.tensor(top_p, dtype=torch.float32))
    remove = cum <= thr
    del cum
    remove[..., -1] = False  # at least one token (the most likely) is kept
    # (top-k removals are -inf in the sorted row: probability 0, cum == 0 <= thr: removed)
    return ~remove.scatter(-1, idx, remove)


def _kept_with_tokens(z: Tensor, tok: Tensor, top_k: int, top_p: float) -> tuple[Tensor | None, Tensor]:
    """The kept set with each row's sampled token added, and the ``[n]`` bool "was outside"."""
    kept = _kept(z, top_k, top_p)
    if kept is None:
        return None, torch.zeros(tok.shape, dtype=torch.bool, device=z.device)
    col = tok.unsqueeze(-1)
    outside = ~kept.gather(-1, col).squeeze(-1)
    return kept.scatter(-1, col, True), outside


def _logprob_entropy(
    z: Tensor, tok: Tensor, kept: Tensor | None, with_entropy: bool
) -> tuple[Tensor, Tensor | None]:
    """``[..., V]`` float32 tempered logits -> ``[...]`` log-probs of ``tok`` and entropy,
    both of the softmax renormalised over ``kept`` (differentiable in ``z``)."""
    # shifted by the row max (always kept), so that a peaked row keeps its tiny entropy and
    # log-prob near 0 accurately: lse - sum q z would cancel two large numbers
    s = z - _row_max(z.detach())
    sm = s if kept is None else s.masked_fill(~kept, float("-inf"))
    lse = torch.logsumexp(sm, dim=-1)
    lp = s.gather(-1, tok.unsqueeze(-1)).squeeze(-1) - lse
    if not with_entropy:
        return lp, None
    q = torch.exp(sm - lse.unsqueeze(-1))
    # q * s with q == 0 (outside the kept set, or a -inf logit) contributes exactly 0
    ent = lse - (q * torch.where(q > 0, s, 0.0)).sum(-1)
    return lp, ent


def _row_max(z: Tensor) -> Tensor:
    """``[..., 1]`` row max, 0 where it is not finite (an all ``-inf`` row)."""
    m = z.amax(dim=-1, keepdim=True)
    return torch.where(torch.isfinite(m), m, 0.0)


def support_mask(
    logits: Tensor,  # [..., V]
    *,
    temperature: float = 1.0,
    top_k: int = -1,
    top_p: float = 1.0,
) -> Tensor:  # [..., V] bool
    """The kept set of the processed sampling distribution: temperature, then top-k, then top-p.

    ``z = logits / temperature`` (in float32). Top-k keeps the tokens with ``z >= z_(k)``, the
    k-th largest value (ties with it are kept); top-p then sorts the remaining tokens in
    ascending order and removes those whose ascending cumulative probability is
    ``<= 1 - top_p``, keeping at least the most likely token. This is vLLM's
    ``apply_top_k_top_p_pytorch`` (vllm/v1/sample/ops/topk_topp_sampler.py) operation for
    operation, so the set is bit-identical to vLLM's on the same logits and device; it equals
    ``trainers.engines.hf_rollout.process_logits`` (descending sort, removes the tokens whose
    strictly-more-likely mass is ``>= top_p``) in exact arithmetic, i.e. up to float rounding
    at the boundary and the order among tied values. ``top_k <= 0`` or ``>= V`` and
    ``top_p >= 1`` switch the filter off. No gradient (a bool tensor). ``-inf`` logits (banned
    tokens) are never kept unless the filter is off; NaN or ``+inf`` ones raise a
    ``ValueError`` (a data check, skipped inside ``rollkit.validation.value_checks(False)``).

    Shapes: ``[..., V]`` -> ``[..., V]`` bool. Sorting costs a ``[..., V]`` float32 and int64
    copy; call it on chunks of rows for a large batch.

    >>> support_mask(torch.tensor([[3.0, 2.0, 2.0, 0.0]]), top_k=2).tolist()
    [[True, True, True, False]]
    >>> support_mask(torch.tensor([[2.0, 1.0, 0.0, -1.0]]), top_p=0.5).tolist()
    [[True, False, False, False]]
    """
    logits = _check_logits(logits)
    t, k, p = _check_sampling(temperature, top_k, top_p)
    _check_orderable(logits)
    with torch.no_grad():
        z = logits.to(_compute_dtype(logits.dtype))
        kept = _kept(z / t if t != 1.0 else z, k, p)
    return torch.ones_like(logits, dtype=torch.bool) if kept is None else kept


def outside_support(
    logits: Tensor,  # [..., V]
    tokens: Tensor,  # [...] int
    *,
    temperature: float = 1.0,
    top_k: int = -1,
    top_p: float = 1.0,
) -> Tensor:  # [...] bool
    """Which ``tokens`` fall outside :func:`support_mask` of ``logits`` (``[...]`` bool).

    A sampled token outside the trainer's kept set means that the trainer's logits differ
    from the sampler's near the top-k / top-p boundary (numerics, a different kernel or
    precision). :func:`token_logprobs` then adds the token to the set instead of giving it
    ``-inf``; the count of such tokens is worth logging (it should be a tiny fraction).
    Same checks as :func:`support_mask` (NaN / ``+inf`` logits raise), and ``tokens`` must be
    in ``[0, V)``.

    >>> outside_support(torch.tensor([[2.0, 1.0, 0.0, -1.0]]), torch.tensor([1]), top_p=0.5)
    tensor([True])
    """
    logits = _check_logits(logits)
    tokens = _check_tokens(tokens, tuple(logits.shape[:-1]), logits.shape[-1], "logits")
    kept = support_mask(logits, temperature=temperature, top_k=top_k, top_p=top_p)
    return ~kept.gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)


def token_logprobs(
    logits: Tensor,  # [..., V] any float dtype
    tokens: Tensor,  # [...] int
    *,
    temperature: float = 1.0,
    top_k: int = -1,
    top_p: float = 1.0,
    with_entropy: bool = False,
    return_outside: bool = False,
) -> Tensor | tuple[Tensor, ...]:
    """Log-probs of ``tokens`` (and the entropy) under the processed sampling distribution.

        z = logits / temperature,   S = support_mask(logits) ∪ {token}
        logprob = z[token] - logsumexp_{v in S} z_v
        entropy = -sum_{v in S} q_v log q_v,   q_v = exp(z_v - logsumexp_{u in S} z_u)

    The replay of the rollout's sampler (temperature, top-k, top-p, renormalised over the kept
    tokens; see :func:`support_mask`), so that the trainer's ``logprobs`` and the engine's
    ``behavior_logprobs`` describe the same distribution; without it, the importance ratio of
    a top-p sampler is biased (the motivation of the top-p replay in prime-rl and slime). With
    no truncation it is ``log_softmax(logits / temperature).gather(tokens)``.

    **The sampled token is always in the set.** The trainer's logits differ slightly from the
    sampler's, so a sampled token can fall just outside the trainer's top-k / top-p set; it is
    then added to the set (finite log-prob) rather than given ``-inf``, and the entropy is
    that of the same renormalised distribution. ``return_outside=True`` also returns the
    ``[...]`` bool mask of those tokens (see :func:`outside_support`).

    The choice of the set is a constant of the forward (no gradient through it); the
    gradient is that of the log-softmax renormalised over ``S``:
    ``d logprob / d z_v = 1[v = token] - q_v``, ``d entropy / d z_v = -q_v (log q_v + entropy)``.
    Computed in float32 whatever the dtype of ``logits`` (float64 stays float64). This materialises float32
    ``[..., V]`` temporaries (and sorts them for top-p); for a large vocabulary compute from
    the hidden states with :func:`lean_token_logprobs` instead.

    Returns ``logprobs`` (``[...]`` float32, float64 for float64 logits), or the tuple ``(logprobs, entropy)`` with
    ``with_entropy``, with ``outside`` appended when ``return_outside``.

    >>> logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    >>> lp = token_logprobs(logits, torch.tensor([0]), top_k=2)  # renormalised over {0, 1}
    >>> torch.allclose(lp, torch.log_softmax(torch.tensor([2.0, 1.0]), -1)[:1])
    True
    >>> lp, ent, outside = token_logprobs(logits, torch.tensor([1]), top_p=0.5, with_entropy=True, return_outside=True)
    >>> outside.tolist(), bool(torch.isfinite(lp).all())
    ([True], True)
    """
    logits = _check_logits(logits)
    t, k, p = _check_sampling(temperature, top_k, top_p)
    tok = _check_tokens(tokens, tuple(logits.shape[:-1]), logits.shape[-1], "logits").long()
    z = logits.to(_compute_dtype(logits.dtype))
    if t != 1.0:
        z = z / t
    with torch.no_grad():
        kept, outside = _kept_with_tokens(z.detach(), tok, k, p)
    lp, ent = _logprob_entropy(z, tok, kept, with_entropy)
    out: tuple[Tensor, ...] = (lp,) if ent is None else (lp, ent)
    if return_outside:
        out = (*out, outside)
    return out[0] if len(out) == 1 else out


# ----------------------------------------------------------------------------- lean path


def _chunk_logits(h: Tensor, w: Tensor, b: Tensor | None, temperature: float, cdt: torch.dtype) -> Tensor:
    """``[n, H]`` hidden rows -> ``[n, V]`` tempered logits in ``cdt`` (the same ops in the
    forward and in the backward's recomputation, so both see bit-identical values). ``w`` is
    in the matmul's dtype: ``cdt``, or a low precision whose product is then upcast."""
    z = h.to(w.dtype) @ w.T
    if z.dtype != cdt:
        z = z.to(cdt)
    if b is not None:
        z = z + b
    if temperature != 1.0:
        z = z / temperature
    return z


def _grad_z(z: Tensor, tok: Tensor, kept: Tensor | None, lse: Tensor, ent: Tensor | None, g_lp: Tensor,
            g_ent: Tensor | None) -> Tensor:  # fmt: skip
    """``[n, V]`` gradient w.r.t. the tempered logits of ``sum(g_lp * lp + g_ent * ent)``, from
    the shifted logits ``z`` (overwritten) and the logsumexp ``lse`` of the kept ones."""
    logq = z.sub_(lse.unsqueeze(-1))
    if kept is not None:
        logq = logq.masked_fill_(~kept, float("-inf"))
    q = torch.exp(logq)
    g = q * (-g_lp).unsqueeze(-1)
    if g_ent is not None and ent is not None:
        # d ent / d z_v = -q_v (log q_v + ent), 0 where q_v == 0
        logq.add_(ent.unsqueeze(-1)).masked_fill_(q == 0, 0.0).mul_(q).mul_(g_ent.unsqueeze(-1))
        g.sub_(logq)
    return g.scatter_add_(-1, tok.unsqueeze(-1), g_lp.unsqueeze(-1))


def _plain_stats(z: Tensor, tok: Tensor, with_entropy: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """A chunk's ``(lp, ent, lse, shift)`` without truncation: the forward of
    :class:`_LeanLogprobs` as one function, for ``torch.compile`` to fuse (``fused``)."""
    m = _row_max(z)
    s = z - m
    lse = torch.logsumexp(s, dim=-1)
    lp = s.gather(-1, tok.unsqueeze(-1)).squeeze(-1) - lse
    if with_entropy:
        q = torch.exp(s - lse.unsqueeze(-1))
        ent = lse - (q * torch.where(q > 0, s, 0.0)).sum(-1)
    else:
        ent = torch.zeros_like(lse)
    return lp, ent, lse, m.squeeze(-1)


def _plain_grad(z: Tensor, tok: Tensor, shift: Tensor, lse: Tensor, ent: Tensor | None, g_lp: Tensor,
                g_ent: Tensor | None) -> Tensor:  # fmt: skip
    """:func:`_grad_z` without truncation, out of place (for ``torch.compile``)."""
    logq = z - (shift + lse).unsqueeze(-1)
    q = torch.exp(logq)
    g = q * (-g_lp).unsqueeze(-1)
    if g_ent is not None and ent is not None:
        g = g - torch.where(q > 0, (logq + ent.unsqueeze(-1)) * q, 0.0) * g_ent.unsqueeze(-1)
    return g.scatter_add(-1, tok.unsqueeze(-1), g_lp.unsqueeze(-1))


_FUSED: dict[tuple[str, str], Any] = {}


def _fused(name: str, backend: str) -> Any:
    """The compiled :func:`_plain_stats` / :func:`_plain_grad` (one compilation per backend,
    dynamic in the chunk length)."""
    key = (name, backend)
    if key not in _FUSED:
        fn = _plain_stats if name == "stats" else _plain_grad
        _FUSED[key] = torch.compile(fn, backend=backend, dynamic=True)
    return _FUSED[key]


class _LeanLogprobs(torch.autograd.Function):
    """Chunked forward; the backward recomputes each chunk's logits (nothing ``[N, V]`` saved)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, tok, temperature, top_k, top_p, with_entropy, chunk, mdt, fused):  # type: ignore[override]
        cdt = _compute_dtype(torch.promote_types(hidden.dtype, weight.dtype))
        w = weight.to(mdt or cdt)
        b = None if bias is None else bias.to(cdt)
        N = hidden.shape[0]
        lp = torch.empty(N, dtype=cdt, device=hidden.device)
        ent = torch.zeros(N, dtype=cdt, device=hidden.device)
        lse_all = torch.empty(N, dtype=cdt, device=hidden.device)
        shift = torch.empty(N, dtype=cdt, device=hidden.device)
        outside = torch.zeros(N, dtype=torch.bool, device=hidden.device)
        for s in range(0, N, chunk):
            z = _chunk_logits(hidden[s : s + chunk], w, b, temperature, cdt)
            kept, outside[s : s + chunk] = _kept_with_tokens(z, tok[s : s + chunk], top_k, top_p)
            if fused and kept is None:  # one compiled function over the chunk's logits
                sl = slice(s, s + chunk)
                lp[sl], ent[sl], lse_all[sl], shift[sl] = _fused("stats", fused)(z, tok[sl], with_entropy)
                del z
                continue
            m = _row_max(z)
            shift[s : s + chunk] = m.squeeze(-1)
            sm = z.sub_(m) if kept is None else z.sub_(m).masked_fill_(~kept, float("-inf"))
            lse = torch.logsumexp(sm, dim=-1)
            lse_all[s : s + chunk] = lse
            lp[s : s + chunk] = sm.gather(-1, tok[s : s + chunk].unsqueeze(-1)).squeeze(-1) - lse
            if with_entropy:  # -sum q log q = lse - sum q s, with q * s := 0 where q == 0
                q = torch.exp(sm - lse.unsqueeze(-1))
                ent[s : s + chunk] = lse - q.mul_(sm.masked_fill_(q == 0, 0.0)).sum(-1)
            del z, sm, kept
        ctx.save_for_backward(hidden, weight, bias, tok, shift, lse_all, ent if with_entropy else None)
        ctx.sampling = (temperature, top_k, top_p, chunk, mdt, fused)
        ctx.mark_non_differentiable(outside)
        if not with_entropy:
            ctx.mark_non_differentiable(ent)
        return lp, ent, outside

    @staticmethod
    def backward(ctx, g_lp, g_ent, _g_outside):  # type: ignore[override]
        hidden, weight, bias, tok, shift, lse, ent = ctx.saved_tensors
        temperature, top_k, top_p, chunk, mdt, fused = ctx.sampling
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        cdt = lse.dtype
        w = weight.to(mdt or cdt)
        b = None if bias is None else bias.to(cdt)
        gh = torch.empty_like(hidden) if need_h else None
        gw = torch.zeros(weight.shape, dtype=cdt, device=weight.device) if need_w else None
        gb = torch.zeros_like(b) if need_b and b is not None else None
        for s in range(0, hidden.shape[0], chunk):
            h = hidden[s : s + chunk]
            z = _chunk_logits(h, w, b, temperature, cdt)
            kept, _ = _kept_with_tokens(z, tok[s : s + chunk], top_k, top_p)
            ge = None if ent is None else g_ent[s : s + chunk]
            e = None if ent is None else ent[s : s + chunk]
            if fused and kept is None:
                sl = slice(s, s + chunk)
                g = _fused("grad", fused)(z, tok[sl], shift[sl], lse[sl], e, g_lp[sl], ge)
            else:
                z.sub_(shift[s : s + chunk].unsqueeze(-1))
                g = _grad_z(z, tok[s : s + chunk], kept, lse[s : s + chunk], e, g_lp[s : s + chunk], ge)
            del z, kept
            if temperature != 1.0:
                g.div_(temperature)
            if gb is not None:
                gb.add_(g.sum(0))
            if mdt is not None:  # the two matmuls in the low precision, like autograd's under autocast
                g = g.to(mdt)
            if gh is not None:
                gh[s : s + chunk] = g @ w
            if gw is not None and mdt is None:
                gw.addmm_(g.T, h.to(w.dtype))
            elif gw is not None:
                gw.add_(g.T @ h.to(mdt))
        gw = None if gw is None else gw.to(weight.dtype)
        gb = None if gb is None else gb.to(bias.dtype)
        return gh, gw, gb, None, None, None, None, None, None, None, None


def lean_token_logprobs(
    hidden: Tensor,  # [..., H] final hidden states (after the final norm)
    weight: Tensor,  # [V, H] LM head
    tokens: Tensor,  # [...] int
    *,
    bias: Tensor | None = None,  # [V]
    temperature: float = 1.0,
    top_k: int = -1,
    top_p: float = 1.0,
    with_entropy: bool = False,
    chunk_tokens: int = 256,
    return_outside: bool = False,
    matmul_dtype: torch.dtype | None = None,
    fused: bool | str = False,
) -> Tensor | tuple[Tensor, ...]:
    """:func:`token_logprobs` of ``hidden @ weight.T (+ bias)``, without the ``[N, V]`` logits.

        logits_c = hidden_c @ weight.T (+ bias)   for each chunk c of chunk_tokens rows
        out_c = token_logprobs(logits_c, tokens_c, temperature, top_k, top_p)

    The ``N`` positions (all leading dims flattened) are processed ``chunk_tokens`` rows at a
    time by a :class:`torch.autograd.Function` whose forward keeps only the ``[N]`` logsumexp
    (and entropy), and whose backward recomputes each chunk's logits and kept set, forms the
    ``[chunk, V]`` gradient of the renormalised log-softmax (and entropy), and accumulates the
    gradients of ``hidden``, ``weight`` and ``bias``: the extra memory is ``O(chunk_tokens x V)``,
    never ``[N, V]`` (plus a ``[V, H]`` copy of ``weight`` in the matmul's dtype where it differs
    and the ``[V, H]`` float32 gradient accumulator). Same values and gradients as the plain path
    up to float rounding (each row is independent; the chunking changes only the peak memory),
    same sampled-token rule and same returns (``logprobs``, ``entropy`` with ``with_entropy``,
    ``outside`` with ``return_outside``). By default inputs of any float dtype are upcast to
    float32 per chunk (float64 stays float64), the matmuls included; gradients come back in the
    inputs' dtypes. ``matmul_dtype=torch.bfloat16`` (or ``float16``) runs the three matmuls of a
    chunk (logits, and the backward's ``dlogits @ W`` and ``dlogits.T @ hidden``) in that
    precision, as the plain path does under autocast (its logits are bf16, upcast for the
    softmax), while the softmax, the entropy and the ``weight`` gradient's accumulation stay
    float32: on a GPU, float32 matmuls are several times slower than bf16 ones (an H100:
    ``docs/benchmarks.md``). No double backward.
    The default ``chunk_tokens=256`` keeps a chunk's float32 logits at 50 MB for a 49k
    vocabulary (about 9x less peak memory than the plain path at 2048 tokens, see
    ``docs/benchmarks.md``); larger chunks trade memory for fewer, larger matmuls.

    The chunked loss over the LM head is the idea of Liger Kernel's fused linear cross entropy
    (Hsu et al., 2024, arXiv:2410.10989) and of Cut Your Losses in Large-Vocabulary Language
    Models (Wijmans et al., 2024, arXiv:2411.09009); here with the sampling replay of
    :func:`support_mask` and the entropy.

    ``fused``: ``True`` (inductor) or a ``torch.compile`` backend name: each chunk's softmax
    statistics (row max, logsumexp, the token's log-prob, the entropy) and, in the backward,
    its ``[chunk, V]`` logit gradient are one compiled function each (dynamic in the chunk
    length), so the ``[chunk, V]`` logits are read in a few fused passes instead of one per
    elementwise op: the GPU path (a CUDA GPU with Triton). Chunks with a top-k / top-p
    truncation keep the eager code; the matmuls are the same. Same values and gradients up to
    float rounding (tested). The first call compiles (seconds to a minute).

    >>> g = torch.Generator().manual_seed(0)
    >>> hidden, weight = torch.randn(2, 5, 8, generator=g), torch.randn(11, 8, generator=g)
    >>> tokens = torch.randint(0, 11, (2, 5), generator=g)
    >>> lean = lean_token_logprobs(hidden, weight, tokens, top_k=4, top_p=0.9, chunk_tokens=3)
    >>> plain = token_logprobs(hidden @ weight.T, tokens, top_k=4, top_p=0.9)
    >>> torch.allclose(lean, plain, atol=1e-6)
    True
    """
    check_float("hidden", hidden)
    check_float("weight", weight)
    if hidden.ndim < 1:
        raise ValueError(f"hidden: expected shape [..., H], got {list(hidden.shape)}")
    if weight.ndim != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"weight: expected shape [V, H] with H = {hidden.shape[-1]} (hidden's last dim), got {list(weight.shape)}"
        )
    V = weight.shape[0]
    if bias is not None:
        check_float("bias", bias)
        if tuple(bias.shape) != (V,):
            raise ValueError(f"bias: expected shape [{V}] (weight's V), got {list(bias.shape)}")
    t, k, p = _check_sampling(temperature, top_k, top_p)
    chunk = check_positive_int("chunk_tokens", chunk_tokens)
    if matmul_dtype not in (None, torch.float32, torch.float64, torch.bfloat16, torch.float16):
        raise ValueError(f"matmul_dtype: expected None or a float dtype, got {matmul_dtype!r}")
    if matmul_dtype in (torch.float32, torch.float64):
        matmul_dtype = None  # the compute dtype's own matmul
    if not isinstance(fused, (bool, str)):
        raise InvalidTypeError(
            f"fused: expected a bool or a torch.compile backend name, got {type(fused).__name__}"
        )
    backend = "inductor" if fused is True else (fused or "")
    lead = tuple(hidden.shape[:-1])
    tok = _check_tokens(tokens, lead, V, "weight").long().reshape(-1)
    lp, ent, outside = _LeanLogprobs.apply(
        hidden.reshape(-1, hidden.shape[-1]),
        weight,
        bias,
        tok,
        t,
        k,
        p,
        bool(with_entropy),
        chunk,
        matmul_dtype,
        backend,
    )
    out: tuple[Tensor, ...] = (lp.reshape(lead),)
    if with_entropy:
        out = (*out, ent.reshape(lead))
    if return_outside:
        out = (*out, outside.reshape(lead))
    return out[0] if len(out) == 1 else out
