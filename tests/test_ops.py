import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rollkit.ops import (
    broadcast_to_tokens,
    group_index,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    segment_count,
    segment_mean,
    segment_std,
    segment_sum,
    segment_var,
)
from rollkit.testing import float_tensors, group_ids, masks, shapes
from rollkit.validation import value_checks


def test_masked_reductions_hand_computed():
    x = torch.tensor([[1.0, 3.0, 100.0], [2.0, 6.0, -7.0]])
    m = torch.tensor([[True, True, False], [True, True, True]])
    assert masked_sum(x, m).item() == pytest.approx(5.0)
    assert masked_mean(x, m).item() == pytest.approx(1.0)  # (1+3+2+6-7)/5
    torch.testing.assert_close(masked_mean(x, m, dim=-1), torch.tensor([2.0, 1 / 3]))
    # values 1,3,2,6,-7: mean 1, squared deviations 0,4,1,25,64 -> 94
    assert masked_var(x, m).item() == pytest.approx(94 / 4)
    assert masked_var(x, m, unbiased=False).item() == pytest.approx(94 / 5)
    torch.testing.assert_close(masked_var(x, m, dim=-1), torch.tensor([2.0, 133 / 3]))


def test_nan_under_mask_does_not_leak_into_value_or_grad():
    x = torch.tensor([1.0, float("nan"), float("inf")], requires_grad=True)
    m = torch.tensor([True, False, False])
    y = masked_mean(x, m)
    y.backward()
    assert y.item() == 1.0
    assert torch.equal(x.grad, torch.tensor([1.0, 0.0, 0.0]))


def test_empty_mask_mean_raises_naming_mask():
    with pytest.raises(ValueError, match="mask: selects no elements"):
        masked_mean(torch.ones(3), torch.zeros(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="empty slice"):
        masked_mean(torch.ones(2, 2), torch.tensor([[True, False], [False, False]]), dim=-1)
    out = masked_mean(torch.ones(2, 2), torch.tensor([[True, False], [False, False]]), dim=-1, empty_value=0.0)
    torch.testing.assert_close(out, torch.tensor([1.0, 0.0]))
    with value_checks(False):  # no data-dependent check: empty slices give 0
        assert masked_mean(torch.ones(3), torch.zeros(3, dtype=torch.bool)).item() == 0.0


def test_var_needs_enough_elements():
    m = torch.tensor([True, False])
    with pytest.raises(ValueError, match="at least 2"):
        masked_var(torch.ones(2), m)
    assert masked_var(torch.tensor([5.0, 1.0]), m, unbiased=False).item() == 0.0


def test_non_bool_mask_rejected():
    with pytest.raises(ValueError, match=r"mask: expected a torch\.bool mask"):
        masked_sum(torch.ones(3), torch.ones(3))
    with pytest.raises(ValueError, match="mask: shape"):
        masked_sum(torch.ones(3), torch.ones(2, dtype=torch.bool))


def test_whiten_unit_stats_and_zero_outside_mask():
    x = torch.tensor([[1.0, 2.0, 3.0, 50.0], [4.0, 5.0, 0.0, 0.0]])
    m = torch.tensor([[True, True, True, False], [True, True, False, False]])
    y = masked_whiten(x, m)
    assert abs(masked_mean(y, m).item()) < 1e-6
    assert masked_var(y, m).item() == pytest.approx(1.0, abs=1e-5)
    assert torch.all(y[~m] == 0)
    y2 = masked_whiten(x, m, shift_mean=False)
    assert masked_mean(y2, m).item() == pytest.approx(masked_mean(x, m).item(), abs=1e-5)


@given(st.data())
def test_masked_ops_match_boolean_indexing(data):
    B, T = data.draw(shapes())
    m = data.draw(masks(B, T, min_tokens=2))
    x = data.draw(float_tensors((B, T), extreme=True)).double()
    sel = x[m]
    torch.testing.assert_close(masked_sum(x, m), sel.sum())
    torch.testing.assert_close(masked_mean(x, m), sel.mean())
    torch.testing.assert_close(masked_var(x, m), sel.var(unbiased=True), rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(masked_var(x, m, unbiased=False), sel.var(unbiased=False), rtol=1e-9, atol=1e-9)


def test_group_index_is_dense_and_sorted():
    idx, g = group_index(torch.tensor([7, 3, 7, 9, 3]))
    assert g == 3
    assert idx.tolist() == [1, 0, 1, 2, 0]
    with pytest.raises(ValueError, match="group_ids: expected an integer tensor"):
        group_index(torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match=r"group_ids: expected shape \[B\]"):
        group_index(torch.tensor([[1, 2]]))


@given(st.data())
def test_segment_ops_match_per_group_loop(data):
    B = data.draw(st.integers(1, 12))
    gids = data.draw(group_ids(B))
    x = data.draw(float_tensors((B,), extreme=True)).double()
    idx, G = group_index(gids)
    cnt = segment_count(idx, G, torch.float64)
    for g, u in enumerate(torch.unique(gids).tolist()):
        sel = x[gids == u]
        assert cnt[g].item() == sel.numel()
        torch.testing.assert_close(segment_sum(x, idx, G)[g], sel.sum())
        torch.testing.assert_close(segment_mean(x, idx, G)[g], sel.mean())
        want_b = sel.var(unbiased=False)
        want_u = sel.var(unbiased=True) if sel.numel() > 1 else torch.zeros((), dtype=x.dtype)
        torch.testing.assert_close(segment_var(x, idx, G, unbiased=False)[g], want_b, rtol=1e-9, atol=1e-6)
        torch.testing.assert_close(segment_var(x, idx, G, unbiased=True)[g], want_u, rtol=1e-9, atol=1e-6)
        torch.testing.assert_close(segment_std(x, idx, G, unbiased=False)[g], want_b.sqrt(), rtol=1e-9, atol=1e-6)


def test_segment_ops_on_rows():
    x = torch.arange(6.0).reshape(3, 2)
    idx = torch.tensor([1, 0, 1])
    torch.testing.assert_close(segment_sum(x, idx, 2), torch.tensor([[2.0, 3.0], [4.0, 6.0]]))
    torch.testing.assert_close(segment_mean(x, idx, 2), torch.tensor([[2.0, 3.0], [2.0, 3.0]]))


def test_broadcast_to_tokens():
    m = torch.tensor([[True, False], [True, True]])
    out = broadcast_to_tokens(torch.tensor([2.0, -1.0]), m)
    assert out.tolist() == [[2.0, 0.0], [-1.0, -1.0]]
    assert broadcast_to_tokens(torch.ones(2, 2), m).tolist() == [[1.0, 0.0], [1.0, 1.0]]
    with pytest.raises(ValueError, match="values: has 3 entries"):
        broadcast_to_tokens(torch.ones(3), m)


def test_segment_min_max():
    from rollkit.ops import segment_max, segment_min

    x = torch.tensor([3.0, -1.0, 2.0, 5.0])
    idx = torch.tensor([0, 0, 2, 0])
    assert segment_min(x, idx, 3).tolist() == [-1.0, float("inf"), 2.0]
    assert segment_max(x, idx, 3).tolist() == [5.0, float("-inf"), 2.0]
    rows = torch.tensor([[1.0, 4.0], [2.0, 0.0]])
    assert segment_max(rows, torch.tensor([0, 0]), 1).tolist() == [[2.0, 4.0]]
