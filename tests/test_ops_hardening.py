"""The ops layer against the invalid-input and huge-magnitude strategies of ``rollkit.testing``
(issue 31): every bad input is an error naming the argument, every finite input gives the
float64 result (rounded to float32, ``inf`` only where that result is out of range).

The agreement check is ``rollkit.testing.assert_float64_close``.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rollkit.ops import (
    broadcast_to_tokens,
    explained_variance,
    group_index,
    group_normalize,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    segment_count,
    segment_max,
    segment_mean,
    segment_min,
    segment_std,
    segment_sum,
    segment_var,
)
from rollkit.testing import (
    assert_float64_close,
    batches,
    dims,
    float_tensors,
    group_ids,
    int_tensors,
    integer_dtypes,
    invalid_dims,
    invalid_masks,
    masks,
    non_tensors,
    shapes,
)
from rollkit.validation import InvalidTypeError, value_checks

F32_MAX = float(torch.finfo(torch.float32).max)
EPS = float(torch.finfo(torch.float32).eps)


def raises_naming(name: str):
    """``pytest.raises`` of a ``ValueError`` or ``TypeError`` whose message starts with ``name:``."""
    return pytest.raises((ValueError, TypeError), match=rf"^{name}: ")


HUGE = {"min_value": -F32_MAX, "max_value": F32_MAX, "huge": True}


# --------------------------------------------------------------------------- integer dtypes


@given(st.data())
def test_statistics_of_integers_are_refused_naming_x(data):
    B = data.draw(st.integers(1, 6))
    x = data.draw(int_tensors((B,), dtype=None, extremes=True))
    idx, G = group_index(data.draw(group_ids(B)))
    m = torch.ones(B, dtype=torch.bool)
    calls = [
        lambda: segment_mean(x, idx, G),
        lambda: segment_var(x, idx, G, unbiased=True),
        lambda: segment_std(x, idx, G, unbiased=False),
        lambda: masked_mean(x, m),
        lambda: masked_var(x, m, unbiased=False),
        lambda: masked_whiten(x, m, unbiased=False),
        lambda: group_normalize(x, idx, G),
    ]
    for call in calls:
        with pytest.raises(
            InvalidTypeError, match=r"^x: expected a floating-point tensor, got dtype torch\."
        ):
            call()
    with pytest.raises(TypeError, match=r"^x: "):  # also a TypeError
        segment_mean(x, idx, G)


@given(st.data())
def test_integer_extremes_and_sums_are_exact(data):
    """``segment_min`` / ``segment_max`` used ``+-inf`` as the fill of integer tensors (an
    overflow error); they now fill with the dtype's extremes (what an empty segment gives)."""
    dtype = data.draw(integer_dtypes())
    B = data.draw(st.integers(0, 8))
    x = data.draw(int_tensors((B,), dtype=dtype, extremes=True))
    G = data.draw(st.integers(B > 0, 4))
    idx = torch.tensor(
        data.draw(st.lists(st.integers(0, max(G - 1, 0)), min_size=B, max_size=B)), dtype=torch.long
    )
    info = torch.iinfo(dtype)
    lo, hi = segment_min(x, idx, G), segment_max(x, idx, G)
    assert lo.dtype == hi.dtype == dtype
    for g in range(G):
        vals = x[idx == g].tolist()
        assert lo[g].item() == (min(vals) if vals else info.max)
        assert hi[g].item() == (max(vals) if vals else info.min)
    # sums are exact, in int64 (as torch.sum): an int8 segment of 100 + 100 is 200
    small = data.draw(int_tensors((B,), dtype=dtype, min_value=-120, max_value=120))
    s = segment_sum(small, idx, G)
    assert s.dtype == torch.int64
    for g in range(G):
        assert s[g].item() == sum(small[idx == g].tolist())
    m = data.draw(masks(1, B, min_tokens=0)).reshape(B) if B else torch.zeros(0, dtype=torch.bool)
    assert masked_sum(small, m).item() == sum(v for v, k in zip(small.tolist(), m.tolist()) if k)


def test_bool_and_complex_values_are_refused():
    idx = torch.tensor([0, 1])
    for x in (torch.tensor([True, False]), torch.tensor([1 + 1j, 2 + 0j])):
        for call in (segment_sum, segment_min, segment_max):
            with raises_naming("x"):
                call(x, idx, 2)
        with raises_naming("x"):
            masked_sum(x, torch.ones(2, dtype=torch.bool))


# --------------------------------------------------------------------------- non-finite floats


@given(st.data())
def test_segment_min_max_order_infinities_and_propagate_nan(data):
    """Documented: ``+-inf`` are ordered as usual, a NaN makes its segment NaN, an empty segment
    is ``+inf`` (min) / ``-inf`` (max)."""
    B = data.draw(st.integers(1, 8))
    x = data.draw(float_tensors((B,), nonfinite=True, **HUGE))
    G = data.draw(st.integers(1, 4))
    idx = torch.tensor(data.draw(st.lists(st.integers(0, G - 1), min_size=B, max_size=B)), dtype=torch.long)
    lo, hi = segment_min(x, idx, G), segment_max(x, idx, G)
    for g in range(G):
        sel = x[idx == g]
        if sel.numel() == 0:
            assert lo[g].item() == math.inf and hi[g].item() == -math.inf
        else:  # torch.amin / amax propagate NaN
            torch.testing.assert_close(lo[g], sel.amin(), equal_nan=True)
            torch.testing.assert_close(hi[g], sel.amax(), equal_nan=True)


@given(st.data())
def test_non_finite_selected_values_give_the_documented_results(data):
    B, T = data.draw(shapes(max_batch=4, max_len=5))
    m = data.draw(masks(B, T, min_tokens=2))
    x = data.draw(float_tensors((B, T), mask=m, nonfinite=True))
    sel = x[m]
    has_nan, pos, neg = torch.isnan(sel).any(), (sel == math.inf).any(), (sel == -math.inf).any()
    mean, var = masked_mean(x, m), masked_var(x, m)
    assert torch.isnan(var)
    if has_nan or (pos and neg):
        assert torch.isnan(mean) and torch.isnan(masked_sum(x, m))
    else:
        assert mean.item() == (math.inf if pos else -math.inf)
    assert torch.isnan(masked_whiten(x, m)[m]).all()


# --------------------------------------------------------------------------- huge magnitudes


@settings(max_examples=80)
@given(st.data())
def test_masked_reductions_of_huge_values_match_float64(data):
    """Squares and partial sums of ``1e19 .. 3.4e38`` overflowed float32: ``masked_var`` gave NaN
    or ``inf`` for representable variances, ``masked_mean`` NaN for ``3e38 + 3e38 - 3e38 - ...``."""
    B, T = data.draw(shapes(max_batch=4, max_len=6))
    m = data.draw(masks(B, T, min_tokens=1, allow_empty_rows=False))
    x = data.draw(float_tensors((B, T), mask=m, garbage_padding=data.draw(st.booleans()), **HUGE))
    x64 = torch.where(m, x.double(), torch.zeros((), dtype=torch.float64))
    n = m.sum(-1).double()
    absx = x64.abs()
    # sums: float32 accuracy relative to the sum of magnitudes
    assert_float64_close(masked_sum(x, m, dim=-1), x64.sum(-1), atol=4 * T * EPS * absx.sum(-1))
    assert_float64_close(masked_sum(x, m), x64.sum(), atol=4 * B * T * EPS * absx.sum())
    assert_float64_close(masked_mean(x, m, dim=-1), x64.sum(-1) / n, atol=4 * T * EPS * absx.sum(-1) / n)
    assert_float64_close(masked_mean(x, m), x64.sum() / n.sum(), atol=4 * B * T * EPS * absx.sum() / n.sum())
    for unbiased in (0, 1):
        keep = n >= (2 if unbiased else 1)
        if not keep.all():
            continue
        mean = (x64.sum(-1) / n).unsqueeze(-1)
        ref = torch.where(m, x64 - mean, torch.zeros((), dtype=torch.float64)).square().sum(-1) / (
            n - unbiased
        )
        # relative accuracy: deviations are taken from the row minimum, so the error is
        # O(n^2 eps) of the variance itself, whatever the magnitude
        assert_float64_close(masked_var(x, m, dim=-1, unbiased=unbiased), ref, rtol=T * T * 8 * EPS)


@settings(max_examples=80)
@given(data=st.data(), unbiased=st.sampled_from([0, 1]), shift_mean=st.booleans())
def test_masked_whiten_of_huge_values_matches_float64(data, unbiased, shift_mean):
    """``masked_whiten`` (and with it REINFORCE++) returned 0 or NaN for values above ~1e19."""
    B, T = data.draw(shapes(max_batch=4, max_len=6))
    m = data.draw(masks(B, T, min_tokens=2))
    x = data.draw(float_tensors((B, T), mask=m, garbage_padding=True, **HUGE))
    eps = data.draw(st.sampled_from([0.0, 1e-8, 1.0]))
    y = masked_whiten(x, m, unbiased=unbiased, shift_mean=shift_mean, eps=eps)
    sel = x.double()[m]
    d = sel - sel.mean()
    var = d.square().sum() / (sel.numel() - unbiased)
    ref_sel = torch.zeros_like(d) if var == 0 else d / (var + eps).sqrt()
    if shift_mean:
        assert_float64_close(y[m], ref_sel, atol=sel.numel() * 16 * EPS)
    else:
        ref_sel = ref_sel + sel.mean()
        # the mean added back is a float32 sum: accurate to eps * sum |x|, as any float32 mean
        atol = sel.numel() * 16 * EPS * (1 + sel.abs().mean())
        assert_float64_close(y[m], ref_sel, rtol=sel.numel() * 8 * EPS, atol=atol)
    assert (y[~m] == 0).all()


@settings(max_examples=80)
@given(st.data())
def test_segment_statistics_of_huge_values_match_float64(data):
    B = data.draw(st.integers(1, 10))
    x = data.draw(float_tensors((B,), **HUGE))
    idx, G = group_index(data.draw(group_ids(B)))
    x64 = x.double()
    n = segment_count(idx, G, torch.float64)
    sums, mags = torch.zeros(G, dtype=torch.float64), torch.zeros(G, dtype=torch.float64)
    sums.index_add_(0, idx, x64)
    mags.index_add_(0, idx, x64.abs())
    assert_float64_close(segment_sum(x, idx, G), sums, atol=4 * B * EPS * mags)
    assert_float64_close(segment_mean(x, idx, G), sums / n, atol=4 * B * EPS * mags / n)
    for unbiased in (0, 1):
        ref = torch.stack(
            [
                x64[idx == g].var(unbiased=bool(unbiased))
                if (n[g] > 1 or not unbiased)
                else x64.new_zeros(())
                for g in range(G)
            ]
        )
        assert_float64_close(segment_var(x, idx, G, unbiased=unbiased), ref, rtol=B * B * 8 * EPS)
        assert_float64_close(segment_std(x, idx, G, unbiased=unbiased), ref.sqrt(), rtol=B * B * 8 * EPS)


@given(st.data())
def test_group_normalize_of_values_spanning_float32_matches_float64(data):
    """Differences of opposite-signed values above ~1.7e38 overflowed (``3e38 - (-3e38)``)."""
    B = data.draw(st.integers(1, 10))
    x = data.draw(float_tensors((B,), **HUGE))
    idx, G = group_index(data.draw(group_ids(B)))
    for unbiased in (True, False):
        for scale in (True, False):
            got = group_normalize(x, idx, G, unbiased=unbiased, scale=scale, eps=0.0)
            want = group_normalize(x.double(), idx, G, unbiased=unbiased, scale=scale, eps=0.0)
            span = x.double().abs().max()
            assert_float64_close(got, want, atol=1e-5 if scale else 8 * B * EPS * span)


def test_the_issue_examples():
    one = torch.ones(3, dtype=torch.bool)
    x = torch.tensor([1e19, -1e19, 2e19])
    assert masked_var(x, one).item() == pytest.approx(7e38 / 3, rel=1e-6)  # was inf / NaN
    assert segment_var(x, torch.zeros(3, dtype=torch.long), 1, unbiased=True).item() == pytest.approx(
        7e38 / 3, rel=1e-6
    )
    big = torch.tensor([3e38, 3e38, -3e38, -3e38])
    assert masked_mean(big, torch.ones(4, dtype=torch.bool)).item() == 0.0  # was NaN
    assert masked_sum(big, torch.ones(4, dtype=torch.bool)).item() == 0.0
    assert segment_std(
        torch.tensor([3e38, -3e38]), torch.tensor([0, 0]), 1, unbiased=False
    ).item() == pytest.approx(3e38)
    y = masked_whiten(torch.tensor([3e38, -3e38]), torch.ones(2, dtype=torch.bool), unbiased=False)
    assert y.tolist() == pytest.approx([1.0, -1.0])
    assert segment_min(torch.tensor([5, 2**63 - 1]), torch.tensor([0, 1]), 3).tolist() == [
        5,
        2**63 - 1,
        2**63 - 1,
    ]


# --------------------------------------------------------------------------- dims


@given(st.data())
def test_invalid_dims_are_refused_naming_dim(data):
    B, T = data.draw(shapes(max_batch=3, max_len=3))
    x = data.draw(float_tensors((B, T)))
    m = torch.ones(B, T, dtype=torch.bool)
    dim = data.draw(invalid_dims(2))
    for call in (masked_sum, masked_mean, masked_var):
        with raises_naming("dim"):
            call(x, m, dim)


def test_dim_errors_name_the_range():
    x, m = torch.ones(2, 3), torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(
        ValueError,
        match=r"^dim: 2 is out of range for x with 2 dimension\(s\) \(expected an int in \[-2, 1\]\)$",
    ):
        masked_sum(x, m, 2)
    with pytest.raises(InvalidTypeError, match=r"^dim: expected an int or a tuple of ints, got float$"):
        masked_mean(x, m, 1.0)
    with pytest.raises(ValueError, match=r"^dim: dimension 1 appears more than once in \(1, -1\)$"):
        masked_var(x, m, (1, -1))
    with pytest.raises(ValueError, match=r"^dim: an empty tuple is ambiguous"):
        masked_sum(x, m, ())


@given(data=st.data(), keepdim=st.booleans())
def test_valid_dims_match_torch(data, keepdim):
    ndim = data.draw(st.integers(1, 3))
    shape = tuple(data.draw(st.lists(st.integers(1, 3), min_size=ndim, max_size=ndim)))
    x = data.draw(float_tensors(shape, extreme=True)).double()
    m = torch.rand(shape, generator=torch.Generator().manual_seed(data.draw(st.integers(0, 99)))) < 0.7
    dim = data.draw(dims(ndim))
    z = torch.where(m, x, torch.zeros((), dtype=x.dtype))
    want = z.sum() if dim is None else z.sum(dim=dim, keepdim=keepdim)
    torch.testing.assert_close(masked_sum(x, m, dim, keepdim), want)
    n = m.sum() if dim is None else m.sum(dim=dim, keepdim=keepdim)
    torch.testing.assert_close(
        masked_mean(x, m, dim, keepdim, empty_value=0.0), torch.where(n > 0, want / n.clamp(min=1), 0.0)
    )


# --------------------------------------------------------------------------- masks and non-tensors


@given(st.data())
def test_wrong_masks_are_refused_naming_mask(data):
    B, T = data.draw(shapes(max_batch=4, max_len=4))
    x = data.draw(float_tensors((B, T)))
    bad = data.draw(invalid_masks((B, T)))
    for call in (masked_sum, masked_mean, masked_var, masked_whiten):
        with raises_naming("mask"):
            call(x, bad)


@given(st.data())
def test_broadcast_to_tokens_refuses_bad_masks_and_values_by_name(data):
    """It crashed with a raw ``RuntimeError`` / ``AttributeError`` / ``IndexError``."""
    B, T = data.draw(shapes(max_batch=4, max_len=4))
    values = data.draw(float_tensors((B,)))
    bad = data.draw(invalid_masks((B, T)))
    ok_shape = (
        isinstance(bad, torch.Tensor) and bad.dtype == torch.bool and bad.ndim == 2 and bad.shape[0] == B
    )
    if ok_shape:  # another T is a valid [B, T'] mask: spread over it
        assert broadcast_to_tokens(values, bad).shape == bad.shape
    else:
        with pytest.raises((ValueError, TypeError), match=r"^mask: |^values: .*mask"):
            broadcast_to_tokens(values, bad)
    with raises_naming("values"):
        broadcast_to_tokens(data.draw(non_tensors((B,))), torch.ones(B, T, dtype=torch.bool))


@given(st.data())
def test_non_tensor_arguments_are_refused_by_name(data):
    bad = data.draw(non_tensors((3,)))
    x, m, idx = torch.ones(3), torch.ones(3, dtype=torch.bool), torch.tensor([0, 0, 1])
    for call in (masked_sum, masked_mean, masked_var, masked_whiten):
        with raises_naming("x"):
            call(bad, m)
        with raises_naming("mask"):
            call(x, bad)
    for call in (segment_sum, segment_mean, segment_min, segment_max):
        with raises_naming("x"):
            call(bad, idx, 2)
        with raises_naming("index"):
            call(x, bad, 2)
    with raises_naming("index"):
        segment_count(bad, 2)


# --------------------------------------------------------------------------- KL controller


@given(st.data())
def test_adaptive_kl_controller_checks_its_inputs(data):
    from rollkit.losses import AdaptiveKLController, FixedKLController

    bad = data.draw(
        st.one_of(
            non_tensors((2,)).filter(lambda v: not isinstance(v, (int, float))),
            st.sampled_from(
                [
                    torch.tensor([1.0, 2.0]),
                    torch.tensor(True),
                    torch.tensor(1 + 2j),
                    torch.tensor(float("nan")),
                    torch.tensor(float("inf")),
                    torch.empty(0),
                    torch.tensor(1.0, device="meta"),
                    float("nan"),
                    float("-inf"),
                ]
            ),
        )
    )
    for ctl in (AdaptiveKLController(0.1, target=6.0, horizon=100.0), FixedKLController(0.1)):
        with raises_naming("current_kl"):
            ctl.update(bad, 10)
        with raises_naming("n_steps"):
            ctl.update(
                1.0, data.draw(st.sampled_from([-1, float("nan"), float("inf"), "8", torch.tensor(8), None]))
            )
        assert ctl.value == 0.1
    ctl = AdaptiveKLController(0.1, target=6.0, horizon=100.0)
    with pytest.raises(ValueError, match=r"^n_steps: must be at most 5 \* horizon = 500.0"):
        ctl.update(0.0, 501)  # 1 - 0.2 * 5.01 < 0: the coefficient would turn negative
    assert ctl.update(torch.tensor([[0.0]]), 500) == 0.0  # a 1-element tensor, the largest step


@settings(max_examples=60)
@given(data=st.data(), unbiased=st.booleans(), gamma=st.sampled_from([1.0, 0.9, 0.0]))
def test_reinforce_pp_of_huge_rewards_matches_float64(data, unbiased, gamma):
    """REINFORCE++ whitened returns of ``1e19 .. 3.4e38`` to 0 or NaN (``masked_whiten``'s
    float32 squares); the scan of a sequence reward never exceeds it, so no overflow remains."""
    from rollkit.advantages import reinforce_pp_advantages

    B, T = data.draw(shapes(max_batch=4, max_len=6))
    m = data.draw(masks(B, T, min_tokens=2))
    r = data.draw(float_tensors((B,), **HUGE))
    got = reinforce_pp_advantages(r, m, gamma=gamma, unbiased_std=unbiased)
    want = reinforce_pp_advantages(r.double(), m, gamma=gamma, unbiased_std=unbiased)
    assert_float64_close(got, want, atol=B * T * 16 * EPS)


# --------------------------------------------------------------------------- explained variance


def _ev_loop(pred: torch.Tensor, target: torch.Tensor, mask: torch.Tensor) -> float:
    """``1 - Var(target - pred) / Var(target)`` over the selected entries, by a plain loop in
    float64 (biased variances); NaN for no entry or constant targets."""
    t = [float(x) for x in target.double()[mask].tolist()]
    e = [a - float(p) for a, p in zip(t, pred.double()[mask].tolist())]
    if not t or max(t) == min(t):
        return math.nan

    def var(xs):
        mean = math.fsum(xs) / len(xs)
        return math.fsum((x - mean) ** 2 for x in xs) / len(xs)

    return 1.0 - var(e) / var(t)


@given(batches(garbage_padding=True, extreme=True), st.data())
def test_explained_variance_on_strategy_batches_matches_a_loop_and_is_at_most_one(b, data):
    """``rollkit.testing.batches`` (ragged masks, empty rows, NaN / inf padding, advantages up to
    1e6) against the loop: at most 1, 1 for a perfect critic, padding never leaks."""
    mask, pred, target = b["response_mask"], b["values"], b["advantages"]
    got = explained_variance(pred, target, mask)
    assert got.shape == () and got.dtype == torch.float64
    want = _ev_loop(pred, target, mask)
    if math.isnan(want):
        assert torch.isnan(got)
        return
    assert float(got) == pytest.approx(want, rel=1e-9, abs=1e-9)
    assert float(got) <= 1.0
    assert float(explained_variance(target, target, mask)) == 1.0
    # masked-out entries never matter: the same values with other padding
    junk = data.draw(float_tensors(tuple(mask.shape), mask=mask, garbage_padding=True))
    assert torch.equal(
        explained_variance(torch.where(mask, pred, junk), torch.where(mask, target, junk), mask), got
    )


@given(st.data())
def test_explained_variance_of_huge_values_matches_the_float64_loop(data):
    B, T = data.draw(shapes(max_batch=4, max_len=6))
    m = data.draw(masks(B, T))
    pred = data.draw(float_tensors((B, T), mask=m, garbage_padding=True, **HUGE))
    target = data.draw(float_tensors((B, T), mask=m, garbage_padding=True, **HUGE))
    got, want = explained_variance(pred, target, m), _ev_loop(pred, target, m)
    if math.isnan(want):
        assert torch.isnan(got)
    else:  # float64 squares of float32 values never overflow
        assert float(got) == pytest.approx(want, rel=1e-9, abs=1e-9) and float(got) <= 1.0


@given(st.data())
def test_explained_variance_refuses_bad_input_by_name(data):
    B, T = data.draw(shapes(max_batch=4, max_len=5))
    x, y = data.draw(float_tensors((B, T))), data.draw(float_tensors((B, T)))
    m = data.draw(masks(B, T))
    with raises_naming("mask"):
        explained_variance(x, y, data.draw(invalid_masks((B, T))))
    for name, call in (
        ("pred", lambda v: explained_variance(v, y, m)),
        ("target", lambda v: explained_variance(x, v, m)),
    ):
        with raises_naming(name):
            call(data.draw(non_tensors((B, T))))
        with raises_naming(name):
            call(data.draw(int_tensors((B, T), dtype=None)))
    with raises_naming("pred"):
        explained_variance(data.draw(float_tensors((B, T + 1))), y, m)
    with pytest.raises(ValueError, match=r"^pred: is on device meta but target is on cpu$"):
        explained_variance(x.to("meta"), y, m)
    with pytest.raises(ValueError, match=r"^mask: is on device meta but target is on cpu$"):
        explained_variance(x, y, m.to("meta"))


@pytest.mark.parametrize("checks", [True, False])
def test_explained_variance_runs_on_meta_tensors(checks):
    """A diagnostic that reads no value: a 0-dim float64 meta result for shape inference, with
    the value checks on or off (before: torch's NotImplementedError from boolean indexing)."""
    x = torch.zeros(3, 4, device="meta")
    with value_checks(checks):
        out = explained_variance(x, x, torch.ones(3, 4, dtype=torch.bool, device="meta"))
    assert out.is_meta and out.shape == () and out.dtype == torch.float64
