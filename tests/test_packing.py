"""Tests of rollkit.packing: FFD bins, the packed layout, gather / scatter, response positions,
the varlen attention mask, and a tiny Qwen2 run padded vs packed."""

from __future__ import annotations

import itertools
import math
from typing import NamedTuple

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import rollkit
from rollkit.packing import (
    PackedLayout,
    pack_bins,
    pack_tokens,
    packed_layout,
    response_positions,
    unpack_tokens,
    varlen_attention_mask,
)
from rollkit.testing import float_tensors, invalid_masks, masks, non_tensors, shapes
from rollkit.validation import value_checks


class _Padded(NamedTuple):
    input_ids: torch.Tensor  # [B, P + T]
    attention_mask: torch.Tensor  # [B, P + T] long
    response_mask: torch.Tensor  # [B, T] bool
    prompt_len: int


def pack(prompts, responses, pad_token_id, *, response_width=None):
    """The trainers' padded layout (trainers.engines.base.pack, rebuilt here: the core tests
    import only rollkit): prompts left-padded to P, responses right-padded to T."""
    P = max(len(p) for p in prompts)
    T = max([len(r) for r in responses] + [response_width or 0])
    B = len(prompts)
    ids = torch.full((B, P + T), pad_token_id, dtype=torch.long)
    am = torch.zeros((B, P + T), dtype=torch.long)
    rm = torch.zeros((B, T), dtype=torch.bool)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        ids[i, P - len(p) : P] = torch.tensor(p, dtype=torch.long)
        am[i, P - len(p) : P] = 1
        if r:
            ids[i, P : P + len(r)] = torch.tensor(r, dtype=torch.long)
            am[i, P : P + len(r)] = 1
            rm[i, : len(r)] = True
    return _Padded(ids, am, rm, P)


def position_ids_from_mask(mask):
    """The trainers' position ids: ``cumsum(mask) - 1`` clamped at 0."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


# --------------------------------------------------------------------------- references


def ref_ffd(lengths: list[int], budget: int, max_rows: int | None = None) -> list[list[int]]:
    """First-fit decreasing, written out plainly: bins as (used tokens, members, closed)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])  # sorted() is stable
    bins: list[dict] = []
    for i in order:
        n = lengths[i]
        placed = False
        if n <= budget:
            for b in bins:
                full = max_rows is not None and len(b["members"]) >= max_rows
                if not b["closed"] and not full and b["used"] + n <= budget:
                    b["used"] += n
                    b["members"].append(i)
                    placed = True
                    break
        if not placed:
            bins.append({"used": n, "members": [i], "closed": n > budget})
    return [sorted(b["members"]) for b in bins]


def opt_bins(lengths: list[int], budget: int) -> int:
    """The fewest bins (exhaustive search; small instances only, every length <= budget)."""
    items = sorted(lengths, reverse=True)
    best = len(items)

    def place(k: int, loads: list[int]) -> None:
        nonlocal best
        if len(loads) >= best:
            return
        if k == len(items):
            best = len(loads)
            return
        seen = set()
        for j, load in enumerate(loads):
            if load + items[k] <= budget and load not in seen:
                seen.add(load)
                loads[j] += items[k]
                place(k + 1, loads)
                loads[j] -= items[k]
        place(k + 1, [*loads, items[k]])

    place(0, [])
    return best


def ref_varlen(cu: list[int]) -> torch.Tensor:
    n = cu[-1]
    seq = [s for s in range(len(cu) - 1) for _ in range(cu[s + 1] - cu[s])]
    out = torch.zeros(n, n, dtype=torch.bool)
    for i, j in itertools.product(range(n), range(n)):
        out[i, j] = seq[i] == seq[j] and j <= i
    return out


@st.composite
def attention_masks(draw, *, max_batch: int = 6, max_len: int = 10):
    """``[B, L]`` masks of any pattern (left padding, right padding, holes, empty rows), as bool
    or as Hugging Face's int64 0 / 1."""
    b, length = draw(shapes(min_batch=0, max_batch=max_batch, min_len=0, max_len=max_len))
    flat = draw(st.lists(st.booleans(), min_size=b * length, max_size=b * length))
    m = torch.tensor(flat, dtype=torch.bool).reshape(b, length)
    return m if draw(st.booleans()) else m.long()


@st.composite
def token_batches(draw, *, max_batch: int = 6):
    """A trainers-layout batch (``pack``: left-padded prompts, right-padded responses) and a
    ``response_mask`` that may have holes (multi-turn tool tokens: real, but not trained on)."""
    b = draw(st.integers(1, max_batch))
    prompts = [draw(st.lists(st.integers(1, 30), min_size=1, max_size=5)) for _ in range(b)]
    responses = [draw(st.lists(st.integers(1, 30), min_size=0, max_size=5)) for _ in range(b)]
    t_max = max(len(r) for r in responses)
    width = draw(st.none() | st.integers(t_max, t_max + 2))
    batch = pack(prompts, responses, 0, response_width=width)
    rmask = batch.response_mask
    if draw(st.booleans()):
        rmask = (
            rmask & draw(masks(*rmask.shape, holes=True, allow_empty_rows=True, min_tokens=0)).logical_not()
        )
    return batch, rmask


def toy_logits(ids: torch.Tensor, pos: torch.Tensor, prefix: torch.Tensor, vocab: int = 7) -> torch.Tensor:
    """A causal "model" per token: depends on the token, its position id and the sum of the
    tokens up to it in its own sample. ``[..., vocab]``."""
    v = torch.arange(vocab, dtype=torch.float64)
    x = ids.double().unsqueeze(-1)
    return torch.sin(1.3 * x + 0.7 * pos.double().unsqueeze(-1) + v) + 0.01 * prefix.double().unsqueeze(
        -1
    ) * torch.cos(v)


# --------------------------------------------------------------------------- pack_bins


@settings(max_examples=120)
@given(
    lengths=st.lists(st.integers(0, 24), max_size=30),
    budget=st.integers(1, 24),
    max_rows=st.none() | st.integers(1, 5),
)
def test_pack_bins_is_ffd_and_a_partition(lengths, budget, max_rows):
    bins = pack_bins(torch.tensor(lengths, dtype=torch.int64), budget, max_rows=max_rows)
    assert all(b.dtype == torch.int64 and b.ndim == 1 for b in bins)
    members = [b.tolist() for b in bins]
    assert sorted(i for m in members for i in m) == list(range(len(lengths)))  # each index once
    for m in members:
        assert m == sorted(m)
        total = sum(lengths[i] for i in m)
        assert total <= budget or (len(m) == 1 and lengths[m[0]] > budget)
        if max_rows is not None:
            assert len(m) <= max_rows
    assert members == ref_ffd(lengths, budget, max_rows)
    if max_rows is None and lengths:
        assert len(bins) <= 2 * math.ceil(sum(lengths) / budget) + 1
    # deterministic, and any integer dtype reads the same
    assert [
        b.tolist() for b in pack_bins(torch.tensor(lengths, dtype=torch.int32), budget, max_rows=max_rows)
    ] == members


@settings(max_examples=60)
@given(data=st.data(), budget=st.integers(1, 12))
def test_pack_bins_within_the_ffd_bound_of_the_optimum(data, budget):
    lengths = data.draw(st.lists(st.integers(1, budget), min_size=1, max_size=8))
    opt = opt_bins(lengths, budget)
    ffd = len(pack_bins(torch.tensor(lengths), budget))
    assert opt <= ffd <= 11 / 9 * opt + 6 / 9


def test_pack_bins_edge_cases():
    assert pack_bins(torch.zeros(0, dtype=torch.int64), 4) == []
    assert [b.tolist() for b in pack_bins(torch.tensor([0, 0, 0]), 1)] == [[0, 1, 2]]
    assert [b.tolist() for b in pack_bins(torch.tensor([9, 9, 1]), 4)] == [[0], [1], [2]]
    assert [b.tolist() for b in pack_bins(torch.tensor([2, 2, 2, 2]), 8, max_rows=3)] == [[0, 1, 2], [3]]
    assert [b.tolist() for b in pack_bins(torch.tensor([3, 3]), 6.0)] == [[0, 1]]  # integral float


# --------------------------------------------------------------------------- packed_layout


@given(mask=attention_masks())
def test_layout_matches_the_padded_positions(mask):
    lay = packed_layout(mask)
    real = mask.bool()
    B, L = real.shape
    lens = real.sum(-1)
    n = int(lens.sum())
    assert isinstance(lay, PackedLayout) and lay.shape == (B, L)
    assert lay.indices.tolist() == real.reshape(-1).nonzero().squeeze(1).tolist()
    assert lay.cu_seqlens.dtype == torch.int32 and lay.cu_seqlens.shape == (B + 1,)
    assert lay.cu_seqlens[0] == 0 and lay.cu_seqlens.diff().tolist() == lens.tolist()
    assert lay.position_ids.shape == (1, n) and lay.position_ids.dtype == torch.int64
    assert lay.position_ids[0].tolist() == position_ids_from_mask(mask.long())[real].tolist()
    assert lay.position_ids[0].tolist() == (real.long().cumsum(-1) - 1)[real].tolist()
    assert lay.seq_ids.tolist() == torch.arange(B).unsqueeze(1).expand(B, L)[real].tolist()
    assert lay.max_seqlen == (int(lens.max()) if B else 0) and isinstance(lay.max_seqlen, int)


@given(mask=attention_masks(), d=st.integers(0, 3), fill=st.sampled_from([0.0, -1.5, -math.inf]))
def test_pack_then_unpack_round_trips(mask, d, fill):
    B, L = mask.shape
    shape = (B, L) if d == 0 else (B, L, d)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(B * 31 + L))
    lay = packed_layout(mask)
    y = pack_tokens(x, lay)
    assert y.shape == (1, lay.indices.shape[0], *shape[2:])
    real = mask.bool()
    assert torch.equal(y[0], x[real])
    for back in (unpack_tokens(y, lay, fill=fill), unpack_tokens(y, lay, shape, fill=fill)):
        assert back.shape == x.shape
        assert torch.equal(back[real], x[real])
        assert (back[~real] == fill).all()
    ids = torch.randint(1, 9, (B, L))
    assert torch.equal(unpack_tokens(pack_tokens(ids, lay), lay, (B, L))[real], ids[real])


def test_gradient_flows_through_pack_and_unpack():
    mask = torch.tensor([[0, 1, 1, 0], [1, 1, 1, 1], [0, 0, 1, 0]])
    lay = packed_layout(mask)
    x = torch.randn(3, 4, 2, dtype=torch.float64, requires_grad=True)
    y = torch.randn(1, 7, 2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: pack_tokens(t, lay), (x,))
    assert torch.autograd.gradcheck(lambda t: unpack_tokens(t, lay, fill=-3.0), (y,))
    assert torch.autograd.gradcheck(lambda t: pack_tokens(unpack_tokens(t, lay), lay), (y,))
    pack_tokens(x, lay).sum().backward()
    assert torch.equal(x.grad[..., 0], mask.double())  # padding gets zero gradient


# --------------------------------------------------------------------------- response_positions


@settings(max_examples=80)
@given(data=token_batches())
def test_response_positions_give_the_padded_logits(data):
    batch, rmask = data
    ids, am, P = batch.input_ids, batch.attention_mask, batch.prompt_len
    T = rmask.shape[1]
    # padded path: position ids cumsum(mask) - 1, prefix sums over the real tokens of the row
    pad_logits = toy_logits(ids, position_ids_from_mask(am), (ids * am).cumsum(-1))
    want = pad_logits[:, P - 1 : P - 1 + T]  # [B, T, V]
    # packed path: one row, positions from the layout, prefix sums within each sample
    lay = packed_layout(am)
    pids = pack_tokens(ids, lay)[0]
    csum = pids.cumsum(0)
    start = lay.cu_seqlens.long()[lay.seq_ids]
    prefix = csum - torch.where(start > 0, csum[(start - 1).clamp(min=0)], torch.zeros_like(csum))
    packed_logits = toy_logits(pids, lay.position_ids[0], prefix).unsqueeze(0)  # [1, N, V]
    pos = response_positions(lay, P, rmask)
    assert pos.shape == rmask.shape and pos.dtype == torch.int64
    assert ((pos >= 0) == rmask).all() and (pos[~rmask] == -1).all()
    got = packed_logits[0, pos.clamp(min=0)]  # [B, T, V]
    assert torch.equal(got[rmask], want[rmask])
    # pos + 1 is the response token itself, in the same sample
    assert torch.equal(pids[pos[rmask] + 1], ids[:, P : P + T][rmask])
    assert torch.equal(lay.seq_ids[pos[rmask] + 1], lay.seq_ids[pos[rmask]])
    # unpacking the packed logits gives the padded ones at every real token
    back = unpack_tokens(packed_logits, lay, fill=math.nan)
    assert torch.equal(back[am.bool()], pad_logits[am.bool()])


def test_response_positions_refuse_a_mask_over_padding():
    batch = pack([[5, 6], [7]], [[8], [9, 10]], pad_token_id=0)
    lay = packed_layout(batch.attention_mask)
    bad = torch.tensor([[True, True], [True, True]])  # row 0 has one response token
    with pytest.raises(ValueError, match=r"^response_mask: .*\(0, 1\)"):
        response_positions(lay, batch.prompt_len, bad)
    with value_checks(False):
        response_positions(lay, batch.prompt_len, bad)  # not checked: no device sync
    with pytest.raises(ValueError, match=r"^prompt_len: "):
        response_positions(lay, 3, batch.response_mask)


# --------------------------------------------------------------------------- varlen_attention_mask


@given(lengths=st.lists(st.integers(0, 5), max_size=5), int32=st.booleans())
def test_varlen_mask_equals_the_pairwise_definition(lengths, int32):
    cu = [0, *itertools.accumulate(lengths)]
    t = torch.tensor(cu, dtype=torch.int32 if int32 else torch.int64)
    got = varlen_attention_mask(t, cu[-1])
    assert got.dtype == torch.bool and torch.equal(got, ref_varlen(cu))
    assert torch.equal(varlen_attention_mask(t), got)


@given(mask=attention_masks(max_batch=4, max_len=6))
def test_varlen_mask_attends_like_the_padded_rows(mask):
    """The packed row attends exactly where the padded rows do: (b, l) -> (b, l') with l' <= l,
    both real."""
    lay = packed_layout(mask)
    real = mask.bool()
    L = real.shape[1]
    padded = real.unsqueeze(1) & real.unsqueeze(2) & torch.ones(L, L, dtype=torch.bool).tril()  # [B, L, L]
    rows, cols = lay.indices // max(L, 1), lay.indices % max(L, 1)
    want = (rows.unsqueeze(1) == rows.unsqueeze(0)) & padded[
        rows.unsqueeze(1), cols.unsqueeze(1), cols.unsqueeze(0)
    ]
    assert torch.equal(varlen_attention_mask(lay.cu_seqlens, lay.indices.shape[0]), want)


# --------------------------------------------------------------------------- argument checks

_LAY = packed_layout(torch.tensor([[0, 1, 1], [1, 1, 1]]))


@pytest.mark.parametrize(
    ("call", "name"),
    [
        (lambda: pack_bins([3, 4], 4), "lengths"),
        (lambda: pack_bins(torch.tensor([[3, 4]]), 4), "lengths"),
        (lambda: pack_bins(torch.tensor([3.0, 4.0]), 4), "lengths"),
        (lambda: pack_bins(torch.tensor([3, -1]), 4), "lengths"),
        (lambda: pack_bins(torch.tensor([3, 1], device="meta"), 4), "lengths"),
        (lambda: pack_bins(torch.tensor([3, 4]), 0), "budget"),
        (lambda: pack_bins(torch.tensor([3, 4]), 2.5), "budget"),
        (lambda: pack_bins(torch.tensor([3, 4]), True), "budget"),
        (lambda: pack_bins(torch.tensor([3, 4]), 4, max_rows=0), "max_rows"),
        (lambda: packed_layout(torch.ones(4, dtype=torch.bool)), "attention_mask"),
        (lambda: packed_layout(torch.ones(2, 3)), "attention_mask"),
        (lambda: packed_layout(torch.tensor([[0, 2, 1]])), "attention_mask"),
        (lambda: packed_layout(torch.ones(2, 3, dtype=torch.bool, device="meta")), "attention_mask"),
        (lambda: packed_layout([[1, 1]]), "attention_mask"),
        (lambda: pack_tokens(torch.zeros(2, 4), _LAY), "x"),
        (lambda: pack_tokens(torch.zeros(2), _LAY), "x"),
        (lambda: pack_tokens(torch.zeros(2, 3), tuple(_LAY)), "layout"),
        (lambda: unpack_tokens(torch.zeros(5), _LAY), "y"),
        (lambda: unpack_tokens(torch.zeros(2, 5), _LAY), "y"),
        (lambda: unpack_tokens(torch.zeros(1, 4), _LAY), "y"),
        (lambda: unpack_tokens(torch.zeros(1, 5), _LAY, (2, 4)), "shape"),
        (lambda: unpack_tokens(torch.zeros(1, 5, 2), _LAY, (2, 3, 3)), "shape"),
        (lambda: unpack_tokens(torch.zeros(1, 5), _LAY, torch.Size([2])), "shape"),
        (lambda: unpack_tokens(torch.zeros(1, 5), _LAY, 6), "shape"),
        (lambda: unpack_tokens(torch.zeros(1, 5), _LAY, fill="x"), "fill"),
        (lambda: response_positions(_LAY, 0, torch.ones(2, 1, dtype=torch.bool)), "prompt_len"),
        (lambda: response_positions(_LAY, 2, torch.ones(2, 2, dtype=torch.bool)), "prompt_len"),
        (lambda: response_positions(_LAY, 2, torch.ones(2, 1)), "response_mask"),
        (lambda: response_positions(_LAY, 2, torch.ones(3, 1, dtype=torch.bool)), "response_mask"),
        (lambda: response_positions(None, 2, torch.ones(2, 1, dtype=torch.bool)), "layout"),
        (lambda: varlen_attention_mask(torch.tensor([1, 3]), 3), "cu_seqlens"),
        (lambda: varlen_attention_mask(torch.tensor([0, 3, 2]), 2), "cu_seqlens"),
        (lambda: varlen_attention_mask(torch.tensor([0.0, 3.0]), 3), "cu_seqlens"),
        (lambda: varlen_attention_mask(torch.zeros(0, dtype=torch.int64), 0), "cu_seqlens"),
        (lambda: varlen_attention_mask(torch.tensor([[0, 3]]), 3), "cu_seqlens"),
        (lambda: varlen_attention_mask(torch.tensor([0, 3]), 4), "num_tokens"),
        (lambda: varlen_attention_mask(torch.tensor([0, 3]), -1), "num_tokens"),
    ],
)
def test_bad_arguments_raise_value_error_naming_them(call, name):
    with pytest.raises(ValueError, match=f"^{name}: ") as info:
        call()
    assert "\n" not in str(info.value)


@given(data=st.data())
def test_invalid_response_masks_are_refused(data):
    bad = data.draw(invalid_masks((2, 1)))
    # any [2, T] bool mask is a valid shape (T is free); only the batch size is fixed
    assume(
        not (isinstance(bad, torch.Tensor) and bad.dtype == torch.bool and bad.ndim == 2 and len(bad) == 2)
    )
    with pytest.raises(ValueError, match=r"^response_mask: "):
        response_positions(_LAY, 2, bad)


@given(bad=non_tensors())
def test_non_tensors_are_refused(bad):
    for call, name in [
        (lambda: pack_bins(bad, 4), "lengths"),
        (lambda: packed_layout(bad), "attention_mask"),
        (lambda: pack_tokens(bad, _LAY), "x"),
        (lambda: unpack_tokens(bad, _LAY), "y"),
        (lambda: varlen_attention_mask(bad), "cu_seqlens"),
    ]:
        with pytest.raises(ValueError, match=f"^{name}: "):
            call()


def test_exported_lazily():
    assert rollkit.packing.pack_bins is pack_bins
    assert "packing" in dir(rollkit)


@given(x=float_tensors((2, 3)))
def test_pack_tokens_keeps_dtype_and_values(x):
    lay = packed_layout(torch.tensor([[True, False, True], [False, True, True]]))
    y = pack_tokens(x, lay)
    assert y.dtype == x.dtype and y[0].tolist() == [x[0, 0], x[0, 2], x[1, 1], x[1, 2]]
