import pytest
import torch
from hypothesis import assume, given, settings
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
from rollkit.testing import batches, float_tensors, group_ids, masks, shapes
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
    out = masked_mean(
        torch.ones(2, 2), torch.tensor([[True, False], [False, False]]), dim=-1, empty_value=0.0
    )
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
    torch.testing.assert_close(
        masked_var(x, m, unbiased=False), sel.var(unbiased=False), rtol=1e-9, atol=1e-9
    )


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
        torch.testing.assert_close(
            segment_std(x, idx, G, unbiased=False)[g], want_b.sqrt(), rtol=1e-9, atol=1e-6
        )


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


# --------------------------------------------------------------------------- group_normalize


def test_group_normalize_hand_computed():
    from rollkit.ops import group_normalize

    x = torch.tensor([1.0, 0.0, 0.0, 1.0, 5.0, 5.0, 7.0, 2.0, 4.0])
    index, G = group_index(torch.tensor([3, 3, 3, 3, 8, 8, 9, 4, 4]))
    # group 3: [1, 0, 0, 1], mean 0.5, unbiased std sqrt(1/3), biased std 0.5
    y = group_normalize(x, index, G, eps=0.0)
    torch.testing.assert_close(y[:4], torch.tensor([1.0, -1.0, -1.0, 1.0]) * 0.5 * 3**0.5)
    # group 4: [2, 4], mean 3, biased std 1, unbiased std sqrt(2); with eps=0.5: +-1 / 1.5
    yb = group_normalize(x, index, G, unbiased=False, eps=0.5)
    torch.testing.assert_close(yb[7:], torch.tensor([-1.0, 1.0]) / 1.5)
    torch.testing.assert_close(yb[:4], torch.tensor([1.0, -1.0, -1.0, 1.0]) * 0.5 / 1.0)
    yc = group_normalize(x, index, G, scale=False)
    assert yc.tolist() == [0.5, -0.5, -0.5, 0.5, 0.0, 0.0, 0.0, -1.0, 1.0]
    # constant group (5, 5) and singleton (7): exactly 0 in every mode
    for out in (y, yb, yc):
        assert out[4:7].tolist() == [0.0, 0.0, 0.0]


def test_group_normalize_constant_groups_are_exactly_zero():
    from rollkit.ops import group_normalize

    # 0.1 and 1000.3 are not representable: a plain (x - mean) leaves rounding noise that
    # /(0 + eps) would blow up; the min-shift makes these groups exactly 0, also with eps=0
    x = torch.tensor([0.1, 0.1, 0.1, 1000.3, 1000.3, 1000.3, 1000.3, 1000.3, 1000.3, 1000.3])
    index = torch.tensor([0, 0, 0, 1, 1, 1, 1, 1, 1, 1])
    for eps in (0.0, 1e-8):
        for unbiased in (True, False):
            y = group_normalize(x, index, 2, eps=eps, unbiased=unbiased)
            assert y.tolist() == [0.0] * 10
    assert group_normalize(torch.zeros(0), torch.zeros(0, dtype=torch.long), 0).shape == (0,)
    # a singleton with an unbiased std: zero spread, exactly 0
    assert group_normalize(torch.tensor([3.7]), torch.tensor([0]), 1, eps=0.0).tolist() == [0.0]


def test_group_normalize_rows_and_validation():
    from rollkit.ops import group_normalize

    rows = torch.tensor([[1.0, 10.0], [3.0, 10.0], [5.0, 0.0]])
    y = group_normalize(rows, torch.tensor([0, 0, 1]), 2, unbiased=False, eps=0.0)
    torch.testing.assert_close(y, torch.tensor([[-1.0, 0.0], [1.0, 0.0], [0.0, 0.0]]))
    with pytest.raises(ValueError, match="index: has 2 entries but x has 3 rows"):
        group_normalize(torch.ones(3), torch.zeros(2, dtype=torch.long), 1)
    with pytest.raises(ValueError, match="x: expected a floating-point tensor"):
        group_normalize(torch.ones(3, dtype=torch.long), torch.zeros(3, dtype=torch.long), 1)
    with pytest.raises(ValueError, match="eps: must be >= 0"):
        group_normalize(torch.ones(3), torch.zeros(3, dtype=torch.long), 1, eps=-1.0)


@given(st.data())
def test_group_normalize_matches_per_group_reference(data):
    from rollkit.ops import group_normalize
    from rollkit.testing import rewards

    B = data.draw(st.integers(1, 16))
    gids = data.draw(group_ids(B))
    x = data.draw(rewards(B))
    unbiased = data.draw(st.booleans())
    eps = data.draw(st.sampled_from([0.0, 1e-6, 0.5]))
    idx, G = group_index(gids)
    y = group_normalize(x.double(), idx, G, unbiased=unbiased, eps=eps)
    yc = group_normalize(x.double(), idx, G, scale=False)
    for u in torch.unique(gids).tolist():
        sel = gids == u
        v = x.double()[sel]
        if bool((v == v[0]).all()):  # constant group or singleton: exactly 0
            assert y[sel].tolist() == [0.0] * int(sel.sum())
            assert yc[sel].tolist() == [0.0] * int(sel.sum())
            continue
        std = v.std(unbiased=unbiased)
        torch.testing.assert_close(yc[sel], v - v.mean(), rtol=1e-9, atol=1e-9 * (1 + v.abs().max()))
        torch.testing.assert_close(y[sel], (v - v.mean()) / (std + eps), rtol=1e-7, atol=1e-7)
    # group-relative: shifting one group's values leaves the result unchanged
    shift = torch.where(idx == 0, 3.0, 0.0).double()
    shifted = group_normalize(x.double() + shift, idx, G, unbiased=unbiased, eps=eps)
    torch.testing.assert_close(shifted, y, rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------------------- masked_whiten numerics


def test_masked_whiten_constant_input_is_exactly_zero():
    m = torch.tensor([[True, True, False], [True, True, True]])
    for value in (0.1, 0.3, 1000.3, -7.7):
        x = torch.full((2, 3), value)
        x[0, 2] = float("nan")  # outside the mask: ignored
        for eps in (0.0, 1e-8):
            assert masked_whiten(x, m, eps=eps).tolist() == [[0.0] * 3] * 2
            kept = masked_whiten(x, m, eps=eps, shift_mean=False)
            assert kept[m].tolist() == [torch.tensor(value).item()] * 5
    with pytest.raises(ValueError, match="mask: selects no elements"):
        masked_whiten(torch.ones(3), torch.zeros(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="eps: must be >= 0"):
        masked_whiten(torch.ones(3), torch.ones(3, dtype=torch.bool), eps=-1.0)


def test_masked_whiten_float32_keeps_precision_with_a_large_offset():
    # spread 1e-2 on top of 1e3: a plain float32 mean is off by ~1e-4, i.e. 1% of the spread;
    # shifted by the minimum the result is exact to float32 rounding
    gen = torch.Generator().manual_seed(0)
    x = (1000.0 + torch.randn(64, 128, generator=gen) * 1e-2).float()
    m = torch.ones_like(x, dtype=torch.bool)
    ref = masked_whiten(x.double(), m)
    y = masked_whiten(x, m)
    assert y.dtype == torch.float32
    assert (y.double() - ref).abs().max().item() < 1e-6
    assert masked_whiten(x.half(), m).dtype == torch.float16


def test_masked_whiten_gradient():
    x = torch.tensor([[0.3, -1.2, 2.0], [0.5, 4.0, 1.0]], dtype=torch.float64, requires_grad=True)
    m = torch.tensor([[True, True, False], [True, True, True]])
    assert torch.autograd.gradcheck(lambda t: masked_whiten(t, m, eps=1e-3), (x,))


# --------------------------------------------------------------------------- garbage under the mask


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_masked_var_and_whiten_ignore_garbage_under_mask_in_value_and_grad(bad):
    m = torch.tensor([[True, True, False], [True, True, True]])
    clean = torch.tensor([[0.3, -1.2, 0.0], [0.5, 4.0, 1.0]], dtype=torch.float64)
    dirty = clean.clone()
    dirty[0, 2] = bad
    w = torch.arange(1.0, 7.0, dtype=torch.float64).reshape(2, 3)
    for fn in (
        lambda t: masked_var(t, m),
        lambda t: masked_var(t, m, dim=-1, unbiased=False),
        lambda t: masked_whiten(t, m) * w,
        lambda t: masked_whiten(t, m, shift_mean=False, unbiased=False) * w,
    ):
        grads = []
        for x in (clean, dirty):
            x = x.clone().requires_grad_()
            out = fn(x)
            out.sum().backward()
            assert torch.isfinite(out).all()
            grads.append(x.grad)
        assert torch.isfinite(grads[1]).all(), grads[1]
        torch.testing.assert_close(grads[1], grads[0])
        assert grads[1][0, 2].item() == 0.0


@settings(max_examples=60, deadline=None)
@given(b=batches(garbage_padding=True, extreme=True), unbiased=st.booleans())
def test_masked_reductions_finite_value_and_grad_with_garbage_padding(b, unbiased):
    m = b["response_mask"]
    n = int(m.sum())
    assume(n >= 2)
    for key in ("values", "logprobs", "advantages"):
        x = b[key].double().requires_grad_()
        outs = [
            masked_sum(x, m),
            masked_mean(x, m),
            masked_var(x, m, unbiased=unbiased),
            (
                masked_whiten(x, m, unbiased=unbiased) * torch.linspace(-1, 1, x.numel()).reshape(x.shape)
            ).sum(),
            masked_whiten(x, m, shift_mean=False).sum(),
        ]
        total = sum(o.sum() for o in outs)
        assert torch.isfinite(total)
        total.backward()
        assert torch.isfinite(x.grad).all()
        assert (x.grad[~m] == 0).all()


# --------------------------------------------------------------------------- group_normalize: grads, 16-bit


def test_group_normalize_zero_spread_gradient_is_finite_and_gradcheck_passes():
    from rollkit.ops import group_normalize

    r = torch.tensor([1.0, 1.0, 0.0, 1.0], requires_grad=True)
    group_normalize(r, torch.tensor([0, 0, 1, 1]), 2).sum().backward()
    assert torch.isfinite(r.grad).all(), r.grad
    for unbiased in (True, False):
        r = torch.tensor([3.0, 3.0, 5.0], dtype=torch.float64, requires_grad=True)
        group_normalize(r, torch.tensor([0, 0, 1]), 2, unbiased=unbiased, eps=0.0).sum().backward()
        assert torch.isfinite(r.grad).all()
    # gradcheck of the informative rows next to a (fixed) constant group and singletons:
    # groups 0 (3 rows), 1 and 3 (singletons), 2 (2 rows), 4 (constant, held fixed)
    idx = torch.tensor([0, 0, 0, 1, 2, 2, 3, 4, 4])
    fixed = torch.tensor([4.0, 4.0], dtype=torch.float64)
    z = torch.tensor([0.3, -1.2, 2.0, 0.9, 4.0, 1.0, 2.5], dtype=torch.float64, requires_grad=True)
    for unbiased, eps in ((True, 1e-6), (False, 0.0)):
        assert torch.autograd.gradcheck(
            lambda t, u=unbiased, e=eps: group_normalize(torch.cat([t, fixed]), idx, 5, unbiased=u, eps=e),
            (z,),
        )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_segment_statistics_of_16bit_input_are_the_float32_result_rounded(dtype):
    from rollkit.ops import group_normalize, segment_std

    gen = torch.Generator().manual_seed(0)
    idx = torch.cat([torch.zeros(257, dtype=torch.long), torch.ones(3, dtype=torch.long)])
    x = (torch.randn(idx.shape[0], generator=gen) + 8.0).to(dtype)
    assert segment_count(idx, 2, torch.bfloat16).dtype == torch.bfloat16
    for fn in (
        lambda t: segment_sum(t, idx, 2),
        lambda t: segment_mean(t, idx, 2),
        lambda t: segment_var(t, idx, 2, unbiased=True),
        lambda t: segment_std(t, idx, 2, unbiased=False),
        lambda t: group_normalize(t, idx, 2),
        lambda t: group_normalize(t, idx, 2, scale=False),
    ):
        got = fn(x)
        assert got.dtype == dtype
        want = fn(x.float()).to(dtype).float()
        tol = torch.finfo(dtype).eps * want.abs() + torch.finfo(dtype).tiny
        assert ((got.float() - want).abs() <= tol).all(), (got, want)


# --------------------------------------------------------------------------- reliability (issue 14)


def test_masked_whiten_rejects_integer_input():
    with pytest.raises(ValueError, match=r"^x: expected a floating-point tensor, got dtype torch.int64$"):
        masked_whiten(torch.tensor([1, 2, 3, 10]), torch.ones(4, dtype=torch.bool))


@pytest.mark.parametrize(
    ("index", "num", "match"),
    [
        (
            torch.tensor([0, 5, 1]),
            2,
            r"^index: must be in \[0, num_segments\) = \[0, 2\), got values in \[0, 5\]$",
        ),
        (
            torch.tensor([0, -1, 1]),
            2,
            r"^index: must be in \[0, num_segments\) = \[0, 2\), got values in \[-1, 1\]$",
        ),
        (torch.tensor([0, 0, 0]), 0, r"^index: must be in \[0, num_segments\) = \[0, 0\)"),
        (torch.tensor([0, 1]), 2, r"^index: has 2 entries but x has 3 rows$"),
        (torch.tensor([0.0, 1.0, 1.0]), 2, r"^index: expected an integer tensor"),
        (torch.tensor([0, 1, 1]), -1, r"^num_segments: must be >= 0, got -1$"),
        (torch.tensor([0, 1, 1]), 2.0, r"^num_segments: expected an int, got float$"),
    ],
)
def test_segment_ops_validate_index_and_num_segments(index, num, match):
    from rollkit.ops import group_normalize, segment_max, segment_min

    x = torch.ones(3)
    for op in (segment_sum, segment_mean, segment_min, segment_max):
        with pytest.raises(ValueError, match=match):
            op(x, index, num)
    with pytest.raises(ValueError, match=match):
        segment_var(x, index, num, unbiased=True)
    with pytest.raises(ValueError, match=match):
        group_normalize(x, index, num)


def test_segment_ops_on_another_device_or_meta():
    x, index = torch.ones(3), torch.tensor([0, 1, 1])
    with pytest.raises(ValueError, match=r"^index: is on device meta but x is on cpu$"):
        segment_sum(x, index.to("meta"), 2)
    with pytest.raises(ValueError, match=r"^index: is on the meta device"):
        segment_sum(x.to("meta"), index.to("meta"), 2)  # the range check cannot read meta
    with value_checks(False):  # shape inference
        out = segment_std(x.to("meta"), index.to("meta"), 2, unbiased=True)
    assert out.is_meta and out.shape == (2,)
    with pytest.raises(ValueError, match=r"^group_ids: is on the meta device"):
        group_index(torch.tensor([3, 1]).to("meta"))


def test_segment_var_and_std_propagate_nan():
    x, index = torch.tensor([float("nan"), 1.0, 2.0, 4.0]), torch.tensor([0, 0, 1, 1])
    for unbiased in (True, False):
        std = segment_std(x, index, 2, unbiased=unbiased)
        assert torch.isnan(std[0]) and std[1].item() > 0
        assert torch.isnan(segment_var(x, index, 2, unbiased=unbiased)[0])
    # a singleton's unbiased std is still 0, a constant segment's 0 with a zero gradient
    y = torch.tensor([5.0, 3.0, 3.0], requires_grad=True)
    std = segment_std(y, torch.tensor([0, 1, 1]), 2, unbiased=True)
    assert std.tolist() == [0.0, 0.0]
    std.sum().backward()
    assert y.grad.tolist() == [0.0, 0.0, 0.0]


@given(st.data())
def test_group_normalize_huge_and_tiny_values_match_float64(data):
    """Float32 squares overflow above ~1.8e19 (a spread of 1e30 gave 0) and underflow below
    ~1e-19: group_normalize scales by the largest deviation first."""
    from rollkit.ops import group_normalize

    B = data.draw(st.integers(1, 10))
    x = data.draw(float_tensors((B,), min_value=-1e31, max_value=1e31, huge=True))
    g, G = group_index(data.draw(group_ids(B)))
    for unbiased in (True, False):
        got = group_normalize(x, g, G, unbiased=unbiased, eps=0.0)
        want = group_normalize(x.double(), g, G, unbiased=unbiased, eps=0.0)
        # float32 arithmetic on values spanning 60 orders of magnitude: the mean's rounding
        # is relative to the spread, so the error is absolute on the O(1) result
        assert torch.isfinite(got).all()
        assert torch.allclose(got.double(), want, atol=1e-5, rtol=0)
        # and the float64 result is the plain formula (squares of 1e30 are fine in float64)
        x64 = x.double()
        for k in range(G):
            sel = g == k
            v = x64[sel]
            if bool((v == v[0]).all()):
                assert (want[sel] == 0).all()
                continue
            c = v - v.mean()
            std = (c.square().sum() / (len(v) - (1 if unbiased else 0))).sqrt()
            assert torch.allclose(want[sel], c / std, atol=1e-9, rtol=1e-9)
