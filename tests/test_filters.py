"""Tests of rollkit.filters: hand-computed keep-masks, edge cases, validation and properties."""

from __future__ import annotations

import inspect
import math

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

from rollkit import keys
from rollkit.filters import (
    accuracy_band_filter,
    combine_keep,
    filter_metrics,
    length_filter,
    staleness_filter,
    zero_variance_filter,
)
from rollkit.registry import FILTERS
from rollkit.testing import batches, group_ids, rewards

T, F = True, False


def _group_constant(keep: torch.Tensor, g: torch.Tensor) -> bool:
    """Every group is kept or dropped as a whole."""
    return all(keep[g == gid].all() or not keep[g == gid].any() for gid in g.unique())


# --------------------------------------------------------------------------- zero variance


def test_zero_variance_hand_computed():
    r = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.5, 0.2, 0.2000001])
    g = torch.tensor([4, 4, 4, 8, 8, 2, 2, 6, 1, 1])
    # {4}: all 1 -> drop; {8}: 0/1 -> keep; {2}: all 0 -> drop; {6}: singleton -> drop;
    # {1}: spread 1e-7 <= atol=1e-6 -> drop
    want = torch.tensor([F, F, F, T, T, F, F, F, F, F])
    assert torch.equal(zero_variance_filter(r, g), want)
    # atol=0 keeps any group with two distinct rewards
    want0 = torch.tensor([F, F, F, T, T, F, F, F, T, T])
    assert torch.equal(zero_variance_filter(r, g, atol=0.0), want0)
    # a bigger tolerance drops the 0/1 group too
    assert not bool(zero_variance_filter(r, g, atol=1.0).any())


def test_zero_variance_empty_batch():
    out = zero_variance_filter(torch.zeros(0), torch.zeros(0, dtype=torch.long))
    assert out.shape == (0,) and out.dtype == torch.bool


@pytest.mark.parametrize(
    "r, g, kwargs, match",
    [
        (torch.tensor([1.0, float("nan")]), torch.tensor([0, 0]), {}, "rewards"),
        (torch.tensor([1.0, float("inf")]), torch.tensor([0, 0]), {}, "rewards"),
        (torch.tensor([1, 0]), torch.tensor([0, 0]), {}, "rewards"),
        (torch.tensor([1.0, 0.0]), torch.tensor([0.0, 0.0]), {}, "group_ids"),
        (torch.tensor([1.0, 0.0]), torch.tensor([0, 0, 1]), {}, "group_ids"),
        (torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), dict(atol=-1e-3), "atol"),
        (torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), dict(atol=float("nan")), "atol"),
    ],
)
def test_zero_variance_validation(r, g, kwargs, match):
    with pytest.raises(ValueError, match=match):
        zero_variance_filter(r, g, **kwargs)


@given(st.data())
def test_zero_variance_properties(data):
    B = data.draw(st.integers(1, 12))
    r = data.draw(rewards(B)).to(torch.float64)
    g = data.draw(group_ids(B, max_groups=4))
    keep = zero_variance_filter(r, g)
    assert keep.dtype == torch.bool and keep.shape == (B,)
    assert _group_constant(keep, g)
    # reference: range > atol per group, singletons dropped
    for gid in g.unique():
        sel = g == gid
        assert bool(keep[sel][0]) == (float(r[sel].max() - r[sel].min()) > 1e-6)
        if int(sel.sum()) == 1:
            assert not bool(keep[sel].any())
    perm = torch.randperm(B, generator=torch.Generator().manual_seed(B))
    assert torch.equal(zero_variance_filter(r[perm], g[perm]), keep[perm])
    assert torch.equal(zero_variance_filter(r, 7 * g + 11), keep)
    # shifting by a constant does not change the decision (away from the atol boundary)
    ranges = [float(r[g == gid].max() - r[g == gid].min()) for gid in g.unique()]
    assume(all(abs(x - 1e-6) > 1e-9 for x in ranges))
    c = data.draw(st.integers(-100, 100))
    assert torch.equal(zero_variance_filter(r + c, g), keep)
    # float32 input gives the same answer as float64 for well-separated ranges
    assume(all(x == 0 or x > 1e-3 for x in ranges) and bool((r.float().double() == r).all()))
    assert torch.equal(zero_variance_filter(r.float(), g), keep)


@given(st.data())
def test_zero_variance_matches_accuracy_band_on_binary_rewards(data):
    B = data.draw(st.integers(1, 12))
    r = data.draw(rewards(B, binary=True))
    g = data.draw(group_ids(B, max_groups=4))
    assert torch.equal(zero_variance_filter(r, g), accuracy_band_filter(r, g))


# --------------------------------------------------------------------------- accuracy band


def test_accuracy_band_hand_computed():
    # five groups of 4 with pass rates 0, 1/4, 1/2, 3/4, 1
    acc = torch.tensor([0, 0, 0, 0, 1, 0, 0, 0, 1, 1, 0, 0, 1, 1, 1, 0, 1, 1, 1, 1], dtype=torch.float32)
    g = torch.arange(5).repeat_interleave(4)

    def per_group(keep):
        assert _group_constant(keep, g)
        return keep.reshape(5, 4)[:, 0].tolist()

    assert per_group(accuracy_band_filter(acc, g)) == [F, T, T, T, F]
    assert per_group(accuracy_band_filter(acc, g, inclusive="both")) == [T, T, T, T, T]
    assert per_group(accuracy_band_filter(acc, g, low=0.25, high=0.75, inclusive="both")) == [F, T, T, T, F]
    assert per_group(accuracy_band_filter(acc, g, low=0.25, high=0.75, inclusive="neither")) == [
        F,
        F,
        T,
        F,
        F,
    ]
    assert per_group(accuracy_band_filter(acc, g, low=0.25, high=0.75, inclusive="left")) == [F, T, T, F, F]
    assert per_group(accuracy_band_filter(acc, g, low=0.25, high=0.75, inclusive="right")) == [F, F, T, T, F]
    assert per_group(accuracy_band_filter(acc, g, low=0.5, high=0.5, inclusive="both")) == [F, F, T, F, F]


def test_accuracy_band_dtypes_fractional_and_singletons():
    g = torch.tensor([0, 0, 1])
    as_bool = accuracy_band_filter(torch.tensor([True, False, True]), g)
    as_int = accuracy_band_filter(torch.tensor([1, 0, 1]), g)
    assert torch.equal(as_bool, torch.tensor([T, T, F])) and torch.equal(as_int, as_bool)
    # fractional scores: [0.5, 0.5] has mean 0.5 -> kept by the band (zero-variance drops it)
    frac = torch.tensor([0.5, 0.5, 0.3])
    assert torch.equal(accuracy_band_filter(frac, g), torch.tensor([T, T, T]))
    assert torch.equal(zero_variance_filter(frac, g), torch.tensor([F, F, F]))
    # empty batch
    assert accuracy_band_filter(torch.zeros(0), torch.zeros(0, dtype=torch.long)).shape == (0,)


@pytest.mark.parametrize(
    "acc, kwargs, match",
    [
        (torch.tensor([1.5, 0.0]), {}, "accuracy"),
        (torch.tensor([-0.1, 0.0]), {}, "accuracy"),
        (torch.tensor([float("nan"), 0.0]), {}, "accuracy"),
        (torch.tensor([[1.0, 0.0]]), {}, "accuracy"),
        (torch.tensor([1.0, 0.0]), dict(low=0.8, high=0.2), "low"),
        (torch.tensor([1.0, 0.0]), dict(low=-0.1), "low"),
        (torch.tensor([1.0, 0.0]), dict(high=1.1), "high"),
        (torch.tensor([1.0, 0.0]), dict(inclusive="open"), "inclusive"),
    ],
)
def test_accuracy_band_validation(acc, kwargs, match):
    with pytest.raises(ValueError, match=match):
        accuracy_band_filter(acc, torch.tensor([0, 0]), **kwargs)
    with pytest.raises(ValueError, match="group_ids"):
        accuracy_band_filter(torch.tensor([1.0, 0.0]), torch.tensor([0.5, 1.5]))


@given(st.data())
def test_accuracy_band_properties(data):
    B = data.draw(st.integers(1, 12))
    acc = data.draw(rewards(B, binary=True))
    g = data.draw(group_ids(B, max_groups=4))
    low = data.draw(st.sampled_from([0.0, 0.1, 0.3]))
    high = data.draw(st.sampled_from([0.6, 0.9, 1.0]))
    inclusive = data.draw(st.sampled_from(["both", "neither", "left", "right"]))
    keep = accuracy_band_filter(acc, g, low=low, high=high, inclusive=inclusive)
    assert _group_constant(keep, g)
    for gid in g.unique():
        p = float(acc[g == gid].double().mean())
        lo_ok = p >= low if inclusive in ("both", "left") else p > low
        hi_ok = p <= high if inclusive in ("both", "right") else p < high
        assert bool(keep[g == gid][0]) == (lo_ok and hi_ok)
    perm = torch.randperm(B, generator=torch.Generator().manual_seed(B + 1))
    assert torch.equal(
        accuracy_band_filter(acc[perm], g[perm], low=low, high=high, inclusive=inclusive), keep[perm]
    )
    assert torch.equal(accuracy_band_filter(acc, 3 * g + 5, low=low, high=high, inclusive=inclusive), keep)
    # the widest band with both edges included keeps everything
    assert bool(accuracy_band_filter(acc, g, inclusive="both").all())


# --------------------------------------------------------------------------- length


def test_length_filter_hand_and_validation():
    L = torch.tensor([0, 5, 10, 11])
    assert torch.equal(length_filter(L, min_length=1, max_length=10), torch.tensor([F, T, T, F]))
    assert torch.equal(length_filter(L, min_length=5), torch.tensor([F, T, T, T]))
    assert torch.equal(length_filter(L, max_length=5), torch.tensor([T, T, F, F]))
    assert torch.equal(length_filter(L), torch.ones(4, dtype=torch.bool))
    assert torch.equal(length_filter(L, min_length=5, max_length=5), torch.tensor([F, T, F, F]))
    with pytest.raises(ValueError, match="min_length"):
        length_filter(L, min_length=6, max_length=5)
    with pytest.raises(ValueError, match="lengths"):
        length_filter(L.float(), max_length=5)
    with pytest.raises(ValueError, match="lengths"):
        length_filter(L.reshape(2, 2), max_length=5)
    with pytest.raises(ValueError, match="max_length"):
        length_filter(L, max_length=5.5)


@given(st.data())
def test_length_filter_properties(data):
    B = data.draw(st.integers(0, 10))
    L = torch.tensor(data.draw(st.lists(st.integers(0, 50), min_size=B, max_size=B)), dtype=torch.long)
    lo = data.draw(st.one_of(st.none(), st.integers(0, 25)))
    hi = data.draw(st.one_of(st.none(), st.integers(25, 50)))
    keep = length_filter(L, min_length=lo, max_length=hi)
    want = [(lo is None or x >= lo) and (hi is None or x <= hi) for x in L.tolist()]
    assert keep.tolist() == want


# --------------------------------------------------------------------------- staleness


def test_staleness_hand_and_edges():
    v = torch.tensor([5, 4, 2, 3, 0])
    assert torch.equal(staleness_filter(v, current_version=5, max_staleness=2), torch.tensor([T, T, F, T, F]))
    assert torch.equal(staleness_filter(v, current_version=5, max_staleness=0), torch.tensor([T, F, F, F, F]))
    assert torch.equal(
        staleness_filter(v, current_version=5, max_staleness=1.5), torch.tensor([T, T, F, F, F])
    )
    assert bool(staleness_filter(v, current_version=5, max_staleness=math.inf).all())
    assert staleness_filter(torch.zeros(0, dtype=torch.long), current_version=0, max_staleness=0).shape == (
        0,
    )


@pytest.mark.parametrize(
    "v, kwargs, match",
    [
        (torch.tensor([6, 1]), dict(current_version=5, max_staleness=1), "policy_version"),
        (torch.tensor([1.0]), dict(current_version=5, max_staleness=1), "policy_version"),
        (torch.tensor([1]), dict(current_version=5, max_staleness=-1), "max_staleness"),
        (torch.tensor([1]), dict(current_version=5, max_staleness=float("nan")), "max_staleness"),
        (torch.tensor([1]), dict(current_version=5.0, max_staleness=1), "current_version"),
    ],
)
def test_staleness_validation(v, kwargs, match):
    with pytest.raises(ValueError, match=match):
        staleness_filter(v, **kwargs)


@given(batches(), st.integers(0, 12))
def test_staleness_properties(b, eta):
    v = b["policy_version"]  # in [0, 10]
    keep = staleness_filter(v, current_version=10, max_staleness=eta)
    assert keep.tolist() == [10 - x <= eta for x in v.tolist()]
    # monotone in the bound
    assert bool((keep <= staleness_filter(v, current_version=10, max_staleness=eta + 1)).all())


# --------------------------------------------------------------------------- combine / metrics


def test_combine_keep_and_metrics():
    a = torch.tensor([T, T, F, T])
    b = torch.tensor([T, F, T, T])
    out = combine_keep(a, b)
    assert torch.equal(out, torch.tensor([T, F, F, T])) and torch.equal(a, torch.tensor([T, T, F, T]))
    assert combine_keep(a).data_ptr() != a.data_ptr()
    with pytest.raises(ValueError, match="keeps"):
        combine_keep()
    with pytest.raises(ValueError, match=r"keeps\[1\]"):
        combine_keep(a, b[:3])
    with pytest.raises(ValueError, match=r"keeps\[1\]"):
        combine_keep(a, b.long())
    m = filter_metrics(out, torch.tensor([3, 3, 9, 9]))
    assert float(m["kept_fraction"]) == 0.5 and int(m["num_kept"]) == 2
    assert int(m["num_groups"]) == 2 and int(m["num_groups_kept"]) == 2
    assert float(m["kept_group_fraction"]) == 1.0
    m2 = filter_metrics(torch.tensor([F, F, T]), torch.tensor([0, 0, 1]))
    assert float(m2["kept_group_fraction"]) == 0.5 and math.isclose(
        float(m2["kept_fraction"]), 1 / 3, rel_tol=1e-6
    )
    assert set(filter_metrics(out)) == {"kept_fraction", "num_kept"}
    empty = filter_metrics(torch.zeros(0, dtype=torch.bool), torch.zeros(0, dtype=torch.long))
    assert float(empty["kept_fraction"]) == 0.0 and float(empty["kept_group_fraction"]) == 0.0
    with pytest.raises(ValueError, match="keep"):
        filter_metrics(out.float())
    with pytest.raises(ValueError, match="group_ids"):
        filter_metrics(out, torch.tensor([0, 1]))


@given(st.data())
def test_group_filter_metrics_consistent(data):
    B = data.draw(st.integers(1, 12))
    r = data.draw(rewards(B, binary=True))
    g = data.draw(group_ids(B, max_groups=5))
    keep = zero_variance_filter(r, g)
    m = filter_metrics(keep, g)
    assert int(m["num_kept"]) == int(keep.sum())
    kept_groups = g[keep].unique().numel()
    assert int(m["num_groups_kept"]) == kept_groups
    assert math.isclose(float(m["kept_group_fraction"]), kept_groups / g.unique().numel(), rel_tol=1e-6)


# --------------------------------------------------------------------------- registry


def test_filters_registered_with_keys():
    expected = {
        "zero_variance": (zero_variance_filter, {"rewards": keys.REWARDS, "group_ids": keys.GROUP_IDS}),
        "accuracy_band": (accuracy_band_filter, {"accuracy": "accuracy", "group_ids": keys.GROUP_IDS}),
        "length": (length_filter, {"lengths": keys.RESPONSE_LENGTH}),
        "staleness": (staleness_filter, {"policy_version": keys.POLICY_VERSION}),
    }
    for name, (fn, in_keys) in expected.items():
        entry = FILTERS.entry(name)
        assert entry.fn is fn and dict(entry.in_keys) == in_keys and list(entry.out_keys) == ["keep"]
        assert set(in_keys) <= set(inspect.signature(fn).parameters)
    assert FILTERS.get("dapo") is zero_variance_filter
