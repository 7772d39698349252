"""Padding-free ("packed") micro-batches: bin packing, the packed layout, gather / scatter.

A padded batch spends compute on its padding: prompts left-padded to ``P`` and responses
right-padded to ``T`` give ``B (P + T)`` positions of which only ``sum_b len_b`` are real. A
*packed* micro-batch concatenates the real tokens of several samples end to end into one row
of ``N = sum_b len_b`` tokens, restarts the position ids at 0 for every sample and keeps the
attention inside each sample (block-diagonal causal attention, described by the cumulative
lengths ``cu_seqlens`` that flash-attn's ``flash_attn_varlen_func`` and PyTorch's varlen
attention take). Packing without cross-contamination follows Krell, Kosec, Perez & Fitzgibbon
(2021), "Efficient sequence packing without cross-contamination: accelerating large language
models without impacting performance", arXiv:2107.02027.

The pure parts live here; the training engine owns the model call:

* :func:`pack_bins` chooses which samples share a packed row: first-fit decreasing bin
  packing of the sample lengths into rows of at most ``budget`` tokens;
* :func:`packed_layout` describes one bin's packed row from the rows' ``attention_mask``:
  where each real token comes from, ``cu_seqlens``, the restarting ``position_ids``;
* :func:`pack_tokens` / :func:`unpack_tokens` gather ``[B, L, ...]`` into ``[1, N, ...]``
  and scatter back (both differentiable);
* :func:`response_positions` maps each response token to the packed position whose logits
  predict it, so the packed logits give the padded path's ``[B, T, V]``;
* :func:`varlen_attention_mask` is the exact ``[N, N]`` block-diagonal causal mask, the CPU
  fallback when no varlen attention kernel is available.

Token layout (``trainers.engines.base.pack``)::

    input_ids       [B, P + T]   <pad> <pad> p0 p1 p2 | r0 r1 r2 <pad>
    attention_mask  [B, P + T]     0     0   1  1  1  |  1  1  1   0
    response_mask   [B, T]                             |  1  1  1   0

The log-prob of response token ``t`` comes from the logits at column ``P - 1 + t``; position
ids are ``cumsum(attention_mask) - 1``, so a sample's positions do not depend on its padding
and the packed row (positions restarting at 0 per sample) computes the same logits.

The guide, with a worked example and a transformers model call, is docs/packing.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from rollkit.validation import (
    InvalidTypeError,
    check_int_tensor,
    check_mask,
    check_ndim,
    check_positive_int,
    check_real,
    check_same_device,
    check_shape,
    check_tensor,
    values_readable,
)

__all__ = [
    "PackedLayout",
    "pack_bins",
    "pack_tokens",
    "packed_layout",
    "response_positions",
    "unpack_tokens",
    "varlen_attention_mask",
]


class PackedLayout(NamedTuple):
    """What :func:`packed_layout` returns: the packed row of the ``B`` rows of one bin.

    Attributes:
        indices: ``[N]`` int64, the flat positions (``b * L + column``) in the ``[B, L]``
            tensor of the real tokens, row after row, each row's in column order.
        cu_seqlens: ``[B + 1]`` int32, ``0, len_0, len_0 + len_1, ..., N``: sample ``b``
            occupies packed positions ``cu_seqlens[b] : cu_seqlens[b + 1]`` (the argument of
            flash-attn's ``flash_attn_varlen_func``, for queries and keys alike).
        position_ids: ``[1, N]`` int64, restarting at 0 for every sample: the position of a
            token is the number of real tokens before it in its row (``cumsum(mask) - 1`` of
            the padded layout, on the real tokens).
        max_seqlen: the longest sample (0 when ``N = 0``), a Python int.
        seq_ids: ``[N]`` int64, the row (sample) each packed token comes from.
        shape: ``(B, L)``, the padded shape (:func:`unpack_tokens` scatters back into it).
    """

    indices: Tensor
    cu_seqlens: Tensor
    position_ids: Tensor
    max_seqlen: int
    seq_ids: Tensor
    shape: tuple[int, int]


# --------------------------------------------------------------------------- pack_bins


def pack_bins(
    lengths: Tensor,  # [B] integer: the number of real tokens of each sample
    budget: int,
    *,
    max_rows: int | None = None,
) -> list[Tensor]:  # one int64 tensor of sample indices per bin
    """First-fit decreasing (FFD) bin packing of samples into packed rows of ``<= budget`` tokens.

    The samples are taken longest first (a stable sort: equal lengths in index order); each
    goes into the first open bin, in the order the bins were opened, that still has room for
    it (``sum of its lengths + length <= budget``, and fewer than ``max_rows`` samples when
    given); if none has, it opens a new bin. A sample longer than ``budget`` gets a bin of its
    own, which nothing else joins. Deterministic: the same lengths give the same bins.

    Quality (Johnson 1973, "Near-optimal bin packing algorithms", MIT PhD thesis; Johnson,
    Demers, Ullman, Garey & Graham 1974, "Worst-case performance bounds for simple
    one-dimensional packing algorithms", SIAM J. Comput. 3(4)): with every length within the
    budget and no ``max_rows``, FFD uses at most ``11/9 OPT + 6/9`` bins, ``OPT`` the fewest
    possible (Johnson proved ``11/9 OPT + 4``; the tight additive constant ``6/9`` is Dósa's,
    2007). Krell et al. (2021, arXiv:2107.02027) pack LLM training sequences this way
    ("shortest-pack-first histogram packing" is their faster variant). Cost: ``O(B log B)``
    for the sort and ``O(B * bins)`` for the placement, in Python on the CPU (the lengths are
    read once); fine for the thousands of samples of an RL step.

    Args:
        lengths: ``[B]`` integer tensor of sample lengths ``>= 0`` (e.g.
            ``attention_mask.sum(-1)``).
        budget: the token capacity of a packed row, an int ``>= 1``.
        max_rows: ``None`` or an int ``>= 1``: at most this many samples per bin.

    Returns:
        A list of ``[n_i]`` int64 tensors on the device of ``lengths``, one per bin in the
        order opened (the first holds the longest sample); each lists its sample indices in
        increasing order. Every index in ``0..B-1`` appears in exactly one bin; ``B = 0``
        gives ``[]``.

    >>> pack_bins(torch.tensor([5, 3, 7, 2, 4, 1]), 8)
    [tensor([2, 5]), tensor([0, 1]), tensor([3, 4])]
    >>> pack_bins(torch.tensor([5, 3, 7, 2, 4, 1]), 8, max_rows=1)[:2]
    [tensor([2]), tensor([0])]
    >>> pack_bins(torch.tensor([10, 3]), 8)  # 10 > budget: alone
    [tensor([0]), tensor([1])]
    """
    check_ndim("lengths", lengths, 1)
    check_int_tensor("lengths", lengths)
    cap = check_positive_int("budget", budget)
    rows = None if max_rows is None else check_positive_int("max_rows", max_rows)
    if lengths.is_meta:
        raise ValueError("lengths: is on the meta device; pack_bins must read the lengths")
    lens = [int(v) for v in lengths.tolist()]
    if lens and min(lens) < 0:
        raise ValueError(f"lengths: must be >= 0, got {min(lens)}")
    order = sorted(range(len(lens)), key=lambda i: (-lens[i], i))
    room: list[int] = []  # free tokens of each bin; -1: closed (an oversized sample)
    members: list[list[int]] = []
    for i in order:
        n = lens[i]
        target = -1
        if n <= cap:
            for j, free in enumerate(room):
                if free >= n and (rows is None or len(members[j]) < rows):
                    target = j
                    break
        if target < 0:
            room.append(cap - n if n <= cap else -1)
            members.append([i])
        else:
            room[target] -= n
            members[target].append(i)
    return [torch.tensor(sorted(m), dtype=torch.int64, device=lengths.device) for m in members]


# --------------------------------------------------------------------------- packed_layout


def _real_tokens(name: str, attention_mask: Tensor) -> Tensor:
    """``attention_mask`` as bool: a bool mask, or an integer one of 0 / 1 (Hugging Face's)."""
    check_ndim(name, attention_mask, 2)
    if attention_mask.dtype == torch.bool:
        return attention_mask
    try:
        check_int_tensor(name, attention_mask)
    except InvalidTypeError:
        raise InvalidTypeError(
            f"{name}: expected a torch.bool or integer 0/1 mask, got dtype {attention_mask.dtype}"
        ) from None
    if values_readable(name, attention_mask):
        bad = (attention_mask != 0) & (attention_mask != 1)
        if bool(bad.any()):
            first = tuple(int(i) for i in bad.nonzero()[0].tolist())
            raise ValueError(f"{name}: an integer mask must hold 0 / 1, got a value at index {first}")
    return attention_mask != 0


def packed_layout(
    attention_mask: Tensor,  # [B, L] bool, or integer 0 / 1: the real tokens of one bin's rows
) -> PackedLayout:
    """The packed row of a bin: the real tokens of its ``B`` rows end to end, ``N`` in all.

    With ``len_b = sum_l mask[b, l]`` and ``cu_b = len_0 + ... + len_{b-1}``, real token ``l``
    of row ``b`` (the ``k``-th real token of the row, ``k = cumsum(mask[b])[l] - 1``) goes to
    packed position ``cu_b + k`` with position id ``k``:

        indices[cu_b + k]      = b * L + l
        position_ids[0, cu_b + k] = k          (= trainers' cumsum(mask) - 1 on real tokens)
        seq_ids[cu_b + k]      = b
        cu_seqlens             = [0, cu_1, ..., cu_B = N]

    The mask may have any pattern (left-padded prompts, right-padded responses, holes); only
    the order of the real tokens within a row is kept. A row without real tokens is an empty
    sample (``cu_seqlens`` repeats a value).

    Args:
        attention_mask: ``[B, L]`` bool, or an integer tensor of 0 / 1 (the Hugging Face
            ``attention_mask``; other values raise ``ValueError``). Not on the ``meta``
            device: ``N`` depends on the values.

    Returns:
        A :class:`PackedLayout` on the device of ``attention_mask``.

    >>> lay = packed_layout(torch.tensor([[0, 1, 1, 1, 0], [1, 1, 1, 1, 1]]))
    >>> lay.indices.tolist(), lay.cu_seqlens.tolist(), lay.max_seqlen
    ([1, 2, 3, 5, 6, 7, 8, 9], [0, 3, 8], 5)
    >>> lay.position_ids.tolist(), lay.seq_ids.tolist()
    ([[0, 1, 2, 0, 1, 2, 3, 4]], [0, 0, 0, 1, 1, 1, 1, 1])
    """
    check_tensor("attention_mask", attention_mask)
    if attention_mask.is_meta:
        raise ValueError("attention_mask: is on the meta device; the packed length depends on its values")
    real = _real_tokens("attention_mask", attention_mask)
    B, L = real.shape
    device = real.device
    lens = real.sum(-1, dtype=torch.int64)  # [B]
    indices = real.reshape(-1).nonzero().squeeze(1)  # [N] row-major: rows in order
    rank = real.cumsum(-1, dtype=torch.int64) - 1  # [B, L]
    position_ids = rank.reshape(-1).index_select(0, indices).unsqueeze(0)
    cu = torch.zeros(B + 1, dtype=torch.int64, device=device)
    torch.cumsum(lens, 0, out=cu[1:])
    seq_ids = torch.repeat_interleave(torch.arange(B, device=device), lens, output_size=indices.shape[0])
    max_seqlen = int(lens.max()) if B > 0 else 0
    return PackedLayout(indices, cu.to(torch.int32), position_ids, max_seqlen, seq_ids, (B, L))


def _check_layout(layout: object) -> PackedLayout:
    if not isinstance(layout, PackedLayout):
        raise InvalidTypeError(f"layout: expected a PackedLayout, got {type(layout).__name__}")
    return layout


# --------------------------------------------------------------------------- gather / scatter


def pack_tokens(
    x: Tensor,  # [B, L, ...] any dtype: per-token values of the padded rows
    layout: PackedLayout,
) -> Tensor:  # [1, N, ...]
    """Gather the real tokens of ``x`` into the packed row: ``out[0, i] = x.flatten(0, 1)[indices[i]]``.

    Differentiable (an ``index_select``): the gradient flows back to the real tokens of ``x``;
    padding positions get zero gradient.

    Args:
        x: ``[B, L, ...]``, ``(B, L) == layout.shape``, on the device of the layout (e.g.
            ``input_ids``, embeddings, per-token values).
        layout: from :func:`packed_layout`.

    Returns:
        ``[1, N, ...]`` of the dtype of ``x``.

    >>> ids = torch.tensor([[0, 5, 6], [7, 8, 9]])
    >>> pack_tokens(ids, packed_layout(ids != 0))
    tensor([[5, 6, 7, 8, 9]])
    """
    lay = _check_layout(layout)
    check_tensor("x", x)
    if x.ndim < 2 or tuple(x.shape[:2]) != tuple(lay.shape):
        raise ValueError(f"x: expected shape [{lay.shape[0]}, {lay.shape[1]}, ...], got {list(x.shape)}")
    check_same_device("x", x, "layout.indices", lay.indices)
    return x.flatten(0, 1).index_select(0, lay.indices).unsqueeze(0)


def unpack_tokens(
    y: Tensor,  # [1, N, ...]: per-token values of the packed row
    layout: PackedLayout,
    shape: Sequence[int] | None = None,
    *,
    fill: float = 0,
) -> Tensor:  # [B, L, ...]
    """Scatter the packed row back into the padded ``[B, L, ...]``; ``fill`` at the padding.

        out.flatten(0, 1)[indices[i]] = y[0, i],   out = fill elsewhere

    The inverse of :func:`pack_tokens` on the real tokens. Differentiable with respect to
    ``y`` (an out-of-place ``index_copy``): the gradient of ``out`` at the real tokens flows
    back to ``y``; the gradient at the padding is dropped.

    Args:
        y: ``[1, N, ...]`` (e.g. the packed logits or log-probs), ``N = layout.indices.shape[0]``,
            on the device of the layout.
        layout: from :func:`packed_layout`.
        shape: ``None`` (``layout.shape``), ``(B, L)`` or the full ``(B, L, ...)``; must agree
            with the layout (and with ``y.shape[2:]``).
        fill: the value at the padding positions (a real number; ``-inf`` allowed).

    Returns:
        ``[B, L, ...]`` of the dtype of ``y``.

    >>> ids = torch.tensor([[0, 5, 6], [7, 8, 9]])
    >>> lay = packed_layout(ids != 0)
    >>> unpack_tokens(pack_tokens(ids, lay) * 10, lay, fill=-1)
    tensor([[-1, 50, 60],
            [70, 80, 90]])
    """
    lay = _check_layout(layout)
    check_tensor("y", y)
    n = lay.indices.shape[0]
    if y.ndim < 2 or y.shape[0] != 1 or y.shape[1] != n:
        raise ValueError(f"y: expected shape [1, {n}, ...], got {list(y.shape)}")
    check_same_device("y", y, "layout.indices", lay.indices)
    fill_value = check_real("fill", fill)
    B, L = lay.shape
    if shape is not None:
        if isinstance(shape, Tensor) or not isinstance(shape, Sequence):
            raise InvalidTypeError(
                f"shape: expected a tuple (B, L) or (B, L, ...), got {type(shape).__name__}"
            )
        want = [B, L, *y.shape[2:]]
        got = list(shape)
        if not (got == want[:2] or got == want):
            raise ValueError(f"shape: {got} does not match the layout's [{B}, {L}] and y's trailing dims")
    rest = tuple(y.shape[2:])
    out = y.new_full((B * L, *rest), fill_value)
    return out.index_copy(0, lay.indices, y[0]).reshape(B, L, *rest)


# --------------------------------------------------------------------------- response_positions


def response_positions(
    layout: PackedLayout,
    prompt_len: int,
    response_mask: Tensor,  # [B, T] bool
) -> Tensor:  # [B, T] int64: packed position, -1 where response_mask is False
    """The packed position whose output predicts each response token; ``-1`` off the mask.

    In the padded layout the log-prob of response token ``t`` of row ``b`` (column ``P + t``)
    comes from the logits at column ``P - 1 + t``. That column is a real token whenever
    response token ``t`` is: every row's prompt ends at column ``P - 1`` (prompts are
    left-padded to ``P``, at least one token each), so for ``t = 0`` it is the last prompt
    token, and for ``t >= 1`` it is response token ``t - 1``, real because responses are
    right-padded (multi-turn tool tokens are real too: ``response_mask`` False but
    ``attention_mask`` True). The left padding only shifts where a row starts, never this
    column. So

        pos[b, t] = the packed index of (b, P - 1 + t)   if response_mask[b, t], else -1

    and ``logits_packed[0, pos]`` equals the padded path's ``logits[:, P - 1:-1]`` on the
    response mask, ``[B, T, V]`` (gather at ``pos.clamp(min=0)`` and mask). Since ``(b, P +
    t)`` is real as well and follows in the same sample, ``pos + 1`` is the packed index of
    the response token itself: ``packed_ids[0, pos + 1]`` are the target tokens.

    Args:
        layout: from :func:`packed_layout` of the ``[B, P + T']`` attention mask.
        prompt_len: ``P >= 1``, the padded prompt width.
        response_mask: ``[B, T]`` bool with ``P + T <= L`` (the response region is columns
            ``P .. P + T - 1``), on the device of the layout. Where it is True both columns
            ``P - 1 + t`` and ``P + t`` of the row must be real tokens of the layout
            (``ValueError`` naming ``response_mask`` otherwise; skipped inside
            ``value_checks(False)``).

    Returns:
        ``[B, T]`` int64 on the device of the layout.

    >>> am = torch.tensor([[0, 1, 1, 1, 0], [1, 1, 1, 1, 1]])  # P = 2, T = 3
    >>> lay = packed_layout(am)
    >>> response_positions(lay, 2, am[:, 2:].bool())
    tensor([[ 0,  1, -1],
            [ 4,  5,  6]])
    """
    lay = _check_layout(layout)
    P = check_positive_int("prompt_len", prompt_len)
    B, L = lay.shape
    check_mask("response_mask", response_mask)
    check_shape("response_mask", response_mask, (B, None))
    check_same_device("response_mask", response_mask, "layout.indices", lay.indices)
    T = response_mask.shape[1]
    if P + T > L:
        raise ValueError(f"prompt_len: prompt_len + T = {P} + {T} exceeds the layout's row length {L}")
    n = lay.indices.shape[0]
    inverse = torch.full((B * L,), -1, dtype=torch.int64, device=lay.indices.device)
    inverse[lay.indices] = torch.arange(n, device=inverse.device)
    inverse = inverse.reshape(B, L)
    pred = inverse[:, P - 1 : P - 1 + T]  # [B, T]: the predicting column
    if values_readable("response_mask", response_mask):
        target = inverse[:, P : P + T]
        bad = response_mask & ((pred < 0) | (target < 0))
        if bool(bad.any()):
            b, t = (int(i) for i in bad.nonzero()[0].tolist())
            raise ValueError(
                f"response_mask: response token ({b}, {t}) is set but column {P - 1 + t} or {P + t} "
                "of its row is padding in the attention mask"
            )
    return torch.where(response_mask, pred, torch.full_like(pred, -1))


# --------------------------------------------------------------------------- varlen_attention_mask


def varlen_attention_mask(
    cu_seqlens: Tensor,  # [S + 1] integer: 0, cumulative lengths, N
    num_tokens: int | None = None,
) -> Tensor:  # [N, N] bool
    """The block-diagonal causal attention mask of a packed row: ``[N, N]`` bool.

        allowed[i, j] = (seq(i) == seq(j)) and (j <= i)

    with ``seq(i)`` the sample of packed token ``i`` (``cu_seqlens[s] <= i < cu_seqlens[s +
    1]``): every token attends to itself and the earlier tokens of its own sample only. It is
    the exact dense equivalent of varlen attention (``flash_attn_varlen_func(...,
    cu_seqlens, causal=True)``) for any attention that takes a mask, e.g.
    ``torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed)`` or a
    Hugging Face model's 4D ``attention_mask`` (``[1, 1, N, N]``; as a float mask: 0 where
    allowed, ``-inf`` elsewhere). A CPU / test fallback: it takes ``O(N^2)`` memory (``N =
    16k`` tokens: 256 MiB as bool, four times that as float32), where a varlen kernel
    takes ``O(N)``.

    Args:
        cu_seqlens: ``[S + 1]`` integer, starting at 0 and non-decreasing (empty samples
            allowed), e.g. ``PackedLayout.cu_seqlens``.
        num_tokens: ``N``; ``None`` reads it from ``cu_seqlens[-1]``, otherwise it must
            equal it.

    Returns:
        ``[N, N]`` bool on the device of ``cu_seqlens``.

    >>> varlen_attention_mask(torch.tensor([0, 2, 3]), 3).int()
    tensor([[1, 0, 0],
            [1, 1, 0],
            [0, 0, 1]], dtype=torch.int32)
    """
    check_ndim("cu_seqlens", cu_seqlens, 1)
    check_int_tensor("cu_seqlens", cu_seqlens)
    if cu_seqlens.shape[0] < 1:
        raise ValueError("cu_seqlens: expected at least one entry (0), got shape [0]")
    if cu_seqlens.is_meta:
        raise ValueError("cu_seqlens: is on the meta device; the mask depends on its values")
    cu = cu_seqlens.to(torch.int64)
    last = int(cu[-1])
    n = last if num_tokens is None else check_positive_int("num_tokens", num_tokens, allow_zero=True)
    if values_readable("cu_seqlens", cu_seqlens):
        if int(cu[0]) != 0:
            raise ValueError(f"cu_seqlens: must start at 0, got {int(cu[0])}")
        if bool((cu[1:] < cu[:-1]).any()):
            raise ValueError("cu_seqlens: must be non-decreasing")
    if last != n:
        raise ValueError(f"num_tokens: {n} does not match cu_seqlens[-1] = {last}")
    seq = torch.repeat_interleave(torch.arange(cu.shape[0] - 1, device=cu.device), cu.diff(), output_size=n)
    causal = torch.ones(n, n, dtype=torch.bool, device=cu.device).tril_()
    return causal & (seq.unsqueeze(0) == seq.unsqueeze(1))
