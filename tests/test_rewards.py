"""Tests of rollkit.rewards: hand-computed numbers, edge cases, validation and properties."""

from __future__ import annotations

import inspect
import io
import itertools
import math

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

from rollkit import keys
from rollkit.registry import REWARD_TRANSFORMS
from rollkit.rewards import (
    RunningRewardNormalizer,
    clip_advantages,
    clip_rewards,
    mask_truncated,
    normalize_rewards,
    overlong_penalty,
    token_level_rewards,
)
from rollkit.testing import (
    batches,
    float_tensors,
    group_ids,
    int_tensors,
    invalid_masks,
    masks,
    non_tensors,
    rewards,
    shapes,
)
from rollkit.validation import value_checks

# --------------------------------------------------------------------------- normalize_rewards


def test_normalize_batch_unbiased_hand_computed():
    r = torch.tensor([1.0, 2.0, 3.0, 4.0])
    std = math.sqrt(5.0 / 3.0)  # sum of squared deviations 5, n - 1 = 3
    want = torch.tensor([-1.5, -0.5, 0.5, 1.5]) / std
    assert torch.allclose(normalize_rewards(r, eps=0.0), want, atol=1e-6)
    # default eps = 1e-6 is added to the std
    assert torch.allclose(
        normalize_rewards(r), torch.tensor([-1.5, -0.5, 0.5, 1.5]) / (std + 1e-6), atol=1e-7
    )


def test_normalize_eps_is_added_to_the_std():
    # [0, 2]: mean 1, unbiased std sqrt(2); eps = 0.5 -> +-1 / (sqrt(2) + 0.5)
    out = normalize_rewards(torch.tensor([0.0, 2.0]), eps=0.5)
    v = 1.0 / (math.sqrt(2.0) + 0.5)
    assert torch.allclose(out, torch.tensor([-v, v]), rtol=0, atol=1e-6)
    norm = RunningRewardNormalizer(eps=0.5)
    assert torch.allclose(norm.normalize(torch.tensor([0.0, 2.0])), torch.tensor([-v, v]), rtol=0, atol=1e-6)


def test_normalize_batch_biased_hand_computed():
    r = torch.tensor([1.0, 2.0, 3.0, 4.0])
    std = math.sqrt(5.0 / 4.0)
    out = normalize_rewards(r, unbiased_std=False, eps=0.0)
    assert torch.allclose(out, torch.tensor([-1.5, -0.5, 0.5, 1.5]) / std, atol=1e-6)


def test_normalize_group_hand_computed():
    r = torch.tensor([0.0, 1.0, 3.0, 1.0, 2.0, 4.0])
    g = torch.tensor([5, 5, 9, 2, 9, 9])  # groups {5: [0, 1]}, {9: [3, 2, 4]}, {2: [1]}
    out = normalize_rewards(r, g, level="group", eps=0.0)
    s = math.sqrt(0.5)  # std of [0, 1], unbiased
    want = torch.tensor([-0.5 / s, 0.5 / s, 0.0, 0.0, -1.0, 1.0])  # [3, 2, 4]: mean 3, std 1
    assert torch.allclose(out, want, atol=1e-6)


def test_normalize_degenerate_sets_are_exactly_zero():
    # singleton groups and constant groups (even values that do not average exactly) give 0
    r = torch.tensor([0.1, 0.1, 0.1, 7.0, -2.0, -2.0], dtype=torch.float64)
    g = torch.tensor([0, 0, 0, 1, 2, 2])
    out = normalize_rewards(r, g, level="group")
    assert torch.equal(out, torch.zeros(6, dtype=torch.float64))
    # batch level: a single sample, and a constant batch
    assert torch.equal(normalize_rewards(torch.tensor([3.0])), torch.tensor([0.0]))
    assert torch.equal(normalize_rewards(torch.full((4,), 0.3)), torch.zeros(4))


def test_normalize_shift_mean_false_keeps_the_mean():
    r = torch.tensor([0.0, 1.0, 3.0, 3.0])
    g = torch.tensor([0, 0, 1, 1])
    out = normalize_rewards(r, g, level="group", eps=0.0, shift_mean=False)
    s = math.sqrt(0.5)
    assert torch.allclose(out, torch.tensor([0.5 - 0.5 / s, 0.5 + 0.5 / s, 3.0, 3.0]), atol=1e-6)


def test_normalize_dtype_empty_and_no_mutation():
    r = torch.tensor([1.0, 5.0, 2.0], dtype=torch.float64)
    before = r.clone()
    out = normalize_rewards(r)
    assert out.dtype == torch.float64 and torch.equal(r, before)
    half = normalize_rewards(torch.tensor([1.0, 2.0], dtype=torch.bfloat16))
    assert half.dtype == torch.bfloat16
    empty = normalize_rewards(torch.zeros(0), torch.zeros(0, dtype=torch.long), level="group")
    assert empty.shape == (0,)
    assert normalize_rewards(torch.zeros(0)).shape == (0,)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(rewards=torch.tensor([1.0, float("nan")])), "rewards"),
        (dict(rewards=torch.tensor([1.0, float("inf")])), "rewards"),
        (dict(rewards=torch.tensor([1, 2])), "rewards"),
        (dict(rewards=torch.ones(2, 2)), "rewards"),
        (dict(rewards=torch.ones(2), level="group"), "group_ids"),
        (dict(rewards=torch.ones(2), group_ids=torch.tensor([0.0, 1.0]), level="group"), "group_ids"),
        (dict(rewards=torch.ones(2), group_ids=torch.tensor([0, 1, 2]), level="group"), "group_ids"),
        (dict(rewards=torch.ones(2), level="token"), "level"),
        (dict(rewards=torch.ones(2), eps=-1.0), "eps"),
    ],
)
def test_normalize_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        normalize_rewards(**kwargs)


def test_normalize_nan_passes_with_value_checks_off():
    with value_checks(False):
        out = normalize_rewards(torch.tensor([1.0, float("nan")]))
    assert out.shape == (2,)


@given(st.data())
def test_normalize_group_properties(data):
    B = data.draw(st.integers(1, 10))
    r = data.draw(rewards(B)).to(torch.float64)
    g = data.draw(group_ids(B))
    out = normalize_rewards(r, g, level="group", unbiased_std=False, eps=0.0)
    # permutation equivariance
    perm = torch.randperm(B, generator=torch.Generator().manual_seed(B))
    out_p = normalize_rewards(r[perm], g[perm], level="group", unbiased_std=False, eps=0.0)
    assert torch.allclose(out_p, out[perm], atol=1e-9)
    # relabel invariance
    out_r = normalize_rewards(r, 1000 - 3 * g, level="group", unbiased_std=False, eps=0.0)
    assert torch.equal(out_r, out)
    # each non-degenerate group has mean 0 and (population) std 1; degenerate ones are 0
    for gid in g.unique():
        sel = g == gid
        if r[sel].max() == r[sel].min():
            assert torch.equal(out[sel], torch.zeros_like(out[sel]))
        else:
            assert abs(float(out[sel].mean())) < 1e-6
            assert abs(float(out[sel].std(unbiased=False)) - 1.0) < 1e-6
    # all samples in one group == batch level
    same = normalize_rewards(r, torch.zeros(B, dtype=torch.long), level="group")
    assert torch.allclose(same, normalize_rewards(r), atol=1e-12)


@given(st.data())
def test_normalize_shift_and_scale_invariance(data):
    B = data.draw(st.integers(2, 8))
    r = data.draw(rewards(B)).to(torch.float64)
    assume(float(r.max() - r.min()) > 1e-3)
    c = data.draw(st.integers(-50, 50))
    a = data.draw(st.sampled_from([0.5, 2.0, 8.0]))
    base = normalize_rewards(r, eps=0.0)
    assert torch.allclose(normalize_rewards(r + c, eps=0.0), base, atol=1e-6)
    assert torch.allclose(normalize_rewards(a * r, eps=0.0), base, atol=1e-9)
    # |out| is bounded by sqrt(n - 1) for the unbiased std (Samuelson's inequality)
    assert float(base.abs().max()) <= math.sqrt(B - 1) + 1e-9


# --------------------------------------------------------------------------- RunningRewardNormalizer


def test_running_hand_computed():
    norm = RunningRewardNormalizer(eps=0.0)
    norm.update(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    sd = norm.state_dict()
    assert int(sd["count"]) == 4 and float(sd["mean"]) == 2.5 and float(sd["m2"]) == 5.0
    norm.update(torch.tensor([10.0]))  # all five: mean 4, m2 = 9+4+1+0+36 = 50
    assert float(norm.mean) == 4.0 and float(norm.m2) == 50.0
    assert math.isclose(float(norm.var), 12.5)  # unbiased: 50 / 4
    out = norm.normalize(torch.tensor([4.0, 9.0]), update=False)
    assert torch.allclose(out, torch.tensor([0.0, 5.0 / math.sqrt(12.5)]))
    biased = RunningRewardNormalizer(unbiased_std=False, eps=0.0)
    biased.update(torch.tensor([1.0, 2.0, 3.0, 4.0, 10.0]))
    assert math.isclose(float(biased.var), 10.0)


def test_running_normalize_updates_first_then_normalizes():
    a = RunningRewardNormalizer()
    b = RunningRewardNormalizer()
    a.update(torch.tensor([0.0, 1.0]))
    b.update(torch.tensor([0.0, 1.0]))
    x = torch.tensor([3.0, -1.0, 2.0])
    out_a = a.normalize(x)  # update=True
    b.update(x)
    assert torch.equal(out_a, b.normalize(x, update=False))
    assert int(a.count) == 5


def test_running_edge_cases_and_clip():
    norm = RunningRewardNormalizer()
    with pytest.raises(ValueError, match="rewards"):
        norm.normalize(torch.tensor([1.0]), update=False)
    norm.update(torch.zeros(0))  # no-op
    assert int(norm.count) == 0
    # one reward seen, and equal rewards: zero variance gives exactly 0
    assert torch.equal(norm.normalize(torch.tensor([5.0])), torch.tensor([0.0]))
    norm.update(torch.tensor([5.0, 5.0]))
    assert torch.equal(norm.normalize(torch.tensor([7.0, 5.0]), update=False), torch.zeros(2))
    keep = RunningRewardNormalizer(shift_mean=False)
    keep.update(torch.tensor([2.0, 2.0]))
    assert torch.equal(keep.normalize(torch.tensor([9.0]), update=False), torch.tensor([2.0]))
    clipped = RunningRewardNormalizer(clip=1.5, eps=0.0, unbiased_std=False)
    clipped.update(torch.tensor([-1.0, 1.0]))  # mean 0, std 1
    out = clipped.normalize(torch.tensor([-4.0, 0.5, 3.0]), update=False)
    assert torch.equal(out, torch.tensor([-1.5, 0.5, 1.5]))
    # shape / dtype of the input are kept, 2-D inputs count every entry
    n2 = RunningRewardNormalizer()
    y = n2.normalize(torch.ones(2, 3, dtype=torch.float64) * torch.arange(3.0, dtype=torch.float64))
    assert y.shape == (2, 3) and y.dtype == torch.float64 and int(n2.count) == 6


@pytest.mark.parametrize(
    "kwargs, match",
    [(dict(eps=-1.0), "eps"), (dict(clip=0.0), "clip"), (dict(clip=-2.0), "clip")],
)
def test_running_constructor_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RunningRewardNormalizer(**kwargs)


def test_running_update_validation_and_load_errors():
    norm = RunningRewardNormalizer()
    with pytest.raises(ValueError, match="rewards"):
        norm.update(torch.tensor([1.0, float("nan")]))
    with pytest.raises(ValueError, match="rewards"):
        norm.update(torch.tensor([1, 2]))
    assert int(norm.count) == 0  # a failed update changes nothing
    with pytest.raises(ValueError, match="missing"):
        norm.load_state_dict({"count": torch.tensor(1), "mean": torch.tensor(0.0)})
    with pytest.raises(ValueError, match="count"):
        norm.load_state_dict({"count": torch.tensor(-1), "mean": 0.0, "m2": 0.0})
    with pytest.raises(ValueError, match="count"):
        norm.load_state_dict({"count": torch.tensor(1.5), "mean": 0.0, "m2": 0.0})
    with pytest.raises(ValueError, match="m2"):
        norm.load_state_dict({"count": torch.tensor(3), "mean": 0.0, "m2": -1.0})


@given(st.data())
def test_running_split_invariance(data):
    n = data.draw(st.integers(1, 24))
    x = data.draw(float_tensors((n,), min_value=-100.0, max_value=100.0, extreme=True, dtype=torch.float64))
    cuts = sorted(data.draw(st.lists(st.integers(0, n), max_size=5)))
    bounds = [0, *cuts, n]
    split = RunningRewardNormalizer()
    for lo, hi in itertools.pairwise(bounds):
        split.update(x[lo:hi])
    whole = RunningRewardNormalizer()
    whole.update(x)
    assert int(split.count) == int(whole.count) == n
    scale = float(x.abs().max()) + 1.0
    assert math.isclose(float(split.mean), float(whole.mean), rel_tol=1e-12, abs_tol=1e-12 * scale)
    assert math.isclose(float(split.m2), float(whole.m2), rel_tol=1e-9, abs_tol=1e-9 * scale**2)
    # and both match the two-pass float64 statistics of the whole
    assert math.isclose(float(whole.mean), float(x.mean()), rel_tol=1e-12, abs_tol=1e-12 * scale)
    ref_m2 = float((x - x.mean()).square().sum())
    assert math.isclose(float(whole.m2), ref_m2, rel_tol=1e-9, abs_tol=1e-9 * scale**2)


@given(st.data())
def test_running_state_round_trip(data):
    norm = RunningRewardNormalizer(clip=3.0)
    for _ in range(data.draw(st.integers(1, 3))):
        norm.update(data.draw(rewards(data.draw(st.integers(1, 6)))))
    state = norm.state_dict()
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    restored = RunningRewardNormalizer(clip=3.0)
    restored.load_state_dict(torch.load(buf))
    for k, v in norm.state_dict().items():
        assert torch.equal(restored.state_dict()[k], v) and restored.state_dict()[k].dtype == v.dtype
    probe = data.draw(rewards(4))
    assert torch.equal(restored.normalize(probe, update=False), norm.normalize(probe, update=False))
    # the saved state is a copy: later updates do not change it
    norm.update(torch.tensor([1e3]))
    assert int(state["count"]) == int(restored.count)


# --------------------------------------------------------------------------- clipping


def test_clip_rewards_hand_and_validation():
    r = torch.tensor([-3.0, 0.5, 9.0])
    assert torch.equal(clip_rewards(r, low=-1.0, high=2.0), torch.tensor([-1.0, 0.5, 2.0]))
    assert torch.equal(clip_rewards(r, low=1.0, high=1.0), torch.ones(3))
    assert torch.equal(clip_rewards(r, low=-math.inf, high=0.0), torch.tensor([-3.0, 0.0, 0.0]))
    assert torch.equal(r, torch.tensor([-3.0, 0.5, 9.0]))  # not mutated
    with pytest.raises(ValueError, match="low"):
        clip_rewards(r, low=2.0, high=1.0)
    with pytest.raises(ValueError, match="low"):
        clip_rewards(r, low=float("nan"), high=1.0)
    with pytest.raises(ValueError, match="rewards"):
        clip_rewards(torch.tensor([float("nan")]), low=0.0, high=1.0)


def test_clip_advantages_hand_and_validation():
    a = torch.tensor([[-5.0, 0.3], [2.0, 0.0]])
    assert torch.equal(clip_advantages(a, max_abs=1.0), torch.tensor([[-1.0, 0.3], [1.0, 0.0]]))
    assert torch.equal(clip_advantages(a, max_abs=math.inf), a)
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="max_abs"):
            clip_advantages(a, max_abs=bad)
    with pytest.raises(ValueError, match="advantages"):
        clip_advantages(torch.tensor([1, 2]), max_abs=1.0)


@given(st.data())
def test_clip_properties(data):
    B = data.draw(st.integers(1, 8))
    r = data.draw(rewards(B, extreme=True))
    lo = data.draw(st.floats(-50, 50))
    hi = lo + data.draw(st.floats(0, 50))
    out = clip_rewards(r, low=lo, high=hi)
    lo32, hi32 = torch.tensor(lo, dtype=out.dtype), torch.tensor(hi, dtype=out.dtype)
    assert bool(((out >= lo32) & (out <= hi32)).all())
    inside = (r >= lo) & (r <= hi)
    assert torch.equal(out[inside], r[inside])
    assert torch.equal(clip_rewards(out, low=lo, high=hi), out)  # idempotent
    c = data.draw(st.floats(1e-3, 10))
    adv = clip_advantages(r, max_abs=c)
    assert float(adv.abs().max()) <= c + 1e-6
    assert torch.equal(torch.sign(adv), torch.sign(r))


# --------------------------------------------------------------------------- overlong penalty


def test_overlong_penalty_hand_computed():
    L = torch.tensor([0, 10, 16, 17, 18, 19, 20, 21, 100])
    out = overlong_penalty(L, max_length=20, cache_length=4)
    want = torch.tensor([0.0, 0.0, 0.0, -0.25, -0.5, -0.75, -1.0, -1.0, -1.0])
    assert torch.allclose(out, want) and out.dtype == torch.get_default_dtype()
    half = overlong_penalty(L, max_length=20, cache_length=4, penalty_factor=0.5, dtype=torch.float64)
    assert torch.allclose(half, want.double() * 0.5) and half.dtype == torch.float64


def test_overlong_penalty_cache_edges():
    L = torch.tensor([0, 5, 10, 11])
    # cache_length = 0: hard step at max_length
    assert torch.equal(
        overlong_penalty(L, max_length=10, cache_length=0), torch.tensor([0.0, 0.0, 0.0, -1.0])
    )
    # cache_length = max_length: linear from 0 at L=0 to -1 at L=max_length
    out = overlong_penalty(L, max_length=10, cache_length=10)
    assert torch.allclose(out, torch.tensor([0.0, -0.5, -1.0, -1.0]))
    assert overlong_penalty(torch.zeros(0, dtype=torch.long), max_length=4, cache_length=1).shape == (0,)


@pytest.mark.parametrize(
    "lengths, kwargs, match",
    [
        (torch.tensor([1.0]), dict(max_length=4, cache_length=1), "lengths"),
        (torch.tensor([-1]), dict(max_length=4, cache_length=1), "lengths"),
        (torch.tensor([[1]]), dict(max_length=4, cache_length=1), "lengths"),
        (torch.tensor([1]), dict(max_length=4, cache_length=5), "cache_length"),
        (torch.tensor([1]), dict(max_length=4, cache_length=-1), "cache_length"),
        (torch.tensor([1]), dict(max_length=0, cache_length=0), "max_length"),
        (torch.tensor([1]), dict(max_length=4.0, cache_length=1), "max_length"),
        (torch.tensor([1]), dict(max_length=4, cache_length=1, penalty_factor=-1.0), "penalty_factor"),
    ],
)
def test_overlong_penalty_validation(lengths, kwargs, match):
    with pytest.raises(ValueError, match=match):
        overlong_penalty(lengths, **kwargs)


@given(st.data())
def test_overlong_penalty_properties(data):
    max_length = data.draw(st.integers(1, 64))
    cache = data.draw(st.integers(0, max_length))
    k = data.draw(st.floats(0, 4))
    L = torch.arange(0, max_length + 8)
    out = overlong_penalty(
        L, max_length=max_length, cache_length=cache, penalty_factor=k, dtype=torch.float64
    )
    assert bool((out <= 0).all()) and bool((out >= -k - 1e-12).all())
    assert bool((out[1:] <= out[:-1] + 1e-12).all())  # non-increasing in length
    assert bool((out[: max_length - cache + 1] == 0).all())
    assert math.isclose(float(out[max_length]), -k if cache > 0 else 0.0, abs_tol=1e-12)
    assert bool((out[max_length + 1 :] == -k).all())
    perm = torch.randperm(L.numel(), generator=torch.Generator().manual_seed(max_length))
    again = overlong_penalty(
        L[perm], max_length=max_length, cache_length=cache, penalty_factor=k, dtype=torch.float64
    )
    assert torch.equal(again, out[perm])


# --------------------------------------------------------------------------- truncation mask


def test_mask_truncated_hand_and_validation():
    m = torch.tensor([[True, True, False], [True, False, False], [False, False, False]])
    t = torch.tensor([True, False, True])
    out = mask_truncated(m, t)
    assert torch.equal(out, torch.tensor([[False] * 3, [True, False, False], [False] * 3]))
    assert bool(m[0, 0])  # input untouched
    with pytest.raises(ValueError, match="mask"):
        mask_truncated(m.float(), t)
    with pytest.raises(ValueError, match="truncated"):
        mask_truncated(m, t.long())
    with pytest.raises(ValueError, match="truncated"):
        mask_truncated(m, torch.tensor([True, False]))


@given(st.data())
def test_mask_truncated_properties(data):
    B, T = data.draw(shapes())
    m = data.draw(masks(B, T))
    t = torch.tensor(data.draw(st.lists(st.booleans(), min_size=B, max_size=B)))
    before = m.clone()
    out = mask_truncated(m, t)
    assert torch.equal(m, before) and out.data_ptr() != m.data_ptr()
    assert not bool(out[t].any())
    assert torch.equal(out[~t], m[~t])


# --------------------------------------------------------------------------- registry


def test_reward_transforms_registered_with_keys():
    expected = {
        "normalize": (
            normalize_rewards,
            {"rewards": keys.REWARDS, "group_ids": keys.GROUP_IDS},
            [keys.REWARDS],
        ),
        "clip": (clip_rewards, {"rewards": keys.REWARDS}, [keys.REWARDS]),
        "clip_advantages": (clip_advantages, {"advantages": keys.ADVANTAGES}, [keys.ADVANTAGES]),
        "overlong_penalty": (overlong_penalty, {"lengths": keys.RESPONSE_LENGTH}, ["overlong_penalty"]),
        "mask_truncated": (
            mask_truncated,
            {"mask": keys.RESPONSE_MASK, "truncated": "truncated"},
            [keys.RESPONSE_MASK],
        ),
    }
    for name, (fn, in_keys, out_keys) in expected.items():
        entry = REWARD_TRANSFORMS.entry(name)
        assert entry.fn is fn
        assert dict(entry.in_keys) == in_keys and list(entry.out_keys) == out_keys
        params = inspect.signature(fn).parameters
        assert set(in_keys) <= set(params)
        # every keyword-only parameter is a scalar hyper-parameter, never a tensor input
        assert not (set(in_keys) & {p for p, v in params.items() if v.kind is v.KEYWORD_ONLY})
    assert REWARD_TRANSFORMS.get("dapo_overlong") is overlong_penalty


def _loop_group_normalize(r, g, *, unbiased, eps):
    """Independent plain-Python reference: (r - mean_g) / (std_g + eps), 0 for a zero spread."""
    vals = [float(v) for v in r.double()]
    keys = [int(k) for k in g]
    out = []
    for v, k in zip(vals, keys):
        grp = [x for x, kk in zip(vals, keys) if kk == k]
        mean = math.fsum(grp) / len(grp)
        denom = len(grp) - 1 if unbiased else len(grp)
        std = math.sqrt(math.fsum((x - mean) ** 2 for x in grp) / max(denom, 1))
        out.append(0.0 if max(grp) == min(grp) else (v - mean) / (std + eps))
    return torch.tensor(out, dtype=torch.float64)


def test_group_level_matches_a_plain_loop_in_float64():
    r = torch.tensor([0.3, 0.1, 0.1, 5.0, 2.5, 2.5, 2.5, -1.0])
    g = torch.tensor([4, 4, 4, 0, 9, 9, 9, 4])
    for unbiased, eps in ((True, 1e-6), (False, 0.0)):
        want = _loop_group_normalize(r, g, unbiased=unbiased, eps=eps)
        got = normalize_rewards(r, g, level="group", unbiased_std=unbiased, eps=eps)
        assert got.dtype == torch.float32
        # computed in float64 and rounded once: within one float32 rounding of the reference
        torch.testing.assert_close(got.double(), want, rtol=2**-24, atol=1e-12)
        assert torch.equal(
            got, normalize_rewards(r.double(), g, level="group", unbiased_std=unbiased, eps=eps).float()
        )
    # singleton (5.0) and constant group (2.5 x 3): exactly 0, or exactly the mean
    assert normalize_rewards(r, g, level="group")[3:7].tolist() == [0.0] * 4
    kept = normalize_rewards(r, g, level="group", shift_mean=False)
    assert kept[3:7].tolist() == [5.0, 2.5, 2.5, 2.5]


def test_normalize_rewards_zero_spread_gradients_are_finite():
    for level, g in (("group", torch.tensor([0, 0, 1, 1])), ("batch", None)):
        for r0 in ([1.0, 1.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0]):
            for eps in (1e-6, 0.0):
                r = torch.tensor(r0, requires_grad=True)
                normalize_rewards(r, g, level=level, eps=eps).sum().backward()
                assert torch.isfinite(r.grad).all(), (level, r0, eps, r.grad)
    # gradcheck next to a (fixed) constant group and a singleton
    fixed = torch.tensor([3.0, 3.0], dtype=torch.float64)
    gid = torch.tensor([0, 0, 0, 5, 7, 7])
    z = torch.tensor([0.3, -1.2, 2.0, 0.9], dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda t: normalize_rewards(torch.cat([t, fixed]), gid, level="group"), (z,)
    )


# --------------------------------------------------------------------------- token_level_rewards


def _k3(lp: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """The k3 KL estimate of each token (garbage padding stays garbage)."""
    d = ref - lp
    return d.exp() - 1 - d


@given(batches(garbage_padding=True, extreme=True), st.sampled_from([0.0, 0.05, 1.0]))
def test_token_level_rewards_on_strategy_batches_match_a_loop(b, coef):
    """``rollkit.testing.batches`` (ragged masks with holes and empty rows, NaN / inf padding,
    rewards up to 1e6) against a plain loop: the score on each row's last valid token, minus
    ``coef * kl`` on every valid token, 0 elsewhere; padding never leaks."""
    mask, scores = b["response_mask"], b["rewards"]
    kl = _k3(b["logprobs"], b["ref_logprobs"])  # NaN / inf under the mask (garbage padding)
    out = token_level_rewards(scores, mask, kl=kl, kl_coef=coef)
    assert out.shape == mask.shape and out.dtype == scores.dtype and torch.isfinite(out).all()
    assert torch.equal(out[~mask], torch.zeros(int((~mask).sum())))
    want = torch.zeros(mask.shape, dtype=torch.float64)
    for i in range(mask.shape[0]):
        valid = mask[i].nonzero().flatten().tolist()
        for t in valid:
            want[i, t] = -coef * float(kl[i, t])
        if valid:
            want[i, valid[-1]] += float(scores[i])
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5 * (1 + float(scores.abs().max())))
    # kl_coef = 0 ignores the values of kl (after checking it), as kl=None
    assert torch.equal(token_level_rewards(scores, mask, kl=kl), token_level_rewards(scores, mask))


@given(st.data())
def test_token_level_rewards_refuse_bad_kl_and_masks_by_name(data):
    B, T = data.draw(shapes(max_batch=4, max_len=5))
    mask = data.draw(masks(B, T))
    scores = data.draw(rewards(B))
    coef = data.draw(st.sampled_from([0.0, 0.1]))  # a bad kl is refused even where it is unused
    with pytest.raises((ValueError, TypeError), match=r"^kl: "):
        token_level_rewards(scores, mask, kl=data.draw(non_tensors((B, T)).filter(lambda v: v is not None)))
    with pytest.raises((ValueError, TypeError), match=r"^kl: "):
        token_level_rewards(scores, mask, kl=data.draw(int_tensors((B, T), dtype=None)), kl_coef=coef)
    other = data.draw(st.sampled_from([(B, T + 1), (B + 1, T), (B,), (B, T, 1)]))
    with pytest.raises((ValueError, TypeError), match=r"^kl: "):
        token_level_rewards(scores, mask, kl=data.draw(float_tensors(other)), kl_coef=coef)
    bad_mask = data.draw(invalid_masks((B, T)))
    if not (isinstance(bad_mask, torch.Tensor) and bad_mask.dtype == torch.bool and bad_mask.ndim == 2):
        with pytest.raises((ValueError, TypeError), match=r"^mask: "):  # [B', T'] bool: see scores / kl
            token_level_rewards(scores, bad_mask)
    if mask.any():  # NaN / inf at a valid token: named; under the mask: ignored
        bad = data.draw(float_tensors((B, T), mask=mask, nonfinite=True))
        with pytest.raises(ValueError, match=r"^kl: contains \d+ NaN and \d+ inf values"):
            token_level_rewards(scores, mask, kl=bad, kl_coef=coef)
        with value_checks(False):
            token_level_rewards(scores, mask, kl=bad, kl_coef=coef)


def test_token_level_rewards_named_bad_kl_of_the_issue():
    """Each bad ``kl`` the issue lists: before, a list crashed with AttributeError, an int kl
    was used and a wrongly shaped one ignored (kl_coef = 0) silently."""
    m = torch.tensor([[True, True, False], [True, True, True]])
    s = torch.tensor([1.0, 0.5])
    cases = [
        (dict(kl=[[0.1] * 3] * 2, kl_coef=0.1), TypeError, r"^kl: expected a torch\.Tensor, got list$"),
        (
            dict(kl=torch.ones(2, 3, dtype=torch.int64), kl_coef=0.1),
            TypeError,
            r"^kl: expected a floating-point tensor, got dtype torch\.int64$",
        ),
        (dict(kl=torch.ones(5)), ValueError, r"^kl: shape \[5\] does not match mask shape \[2, 3\]$"),
        (
            dict(kl=torch.ones(2, 3, device="meta"), kl_coef=0.1),
            ValueError,
            r"^kl: is on device meta but mask is on cpu$",
        ),
        (
            dict(kl=torch.tensor([[0.0, math.nan, math.nan], [0.0, 0.0, 0.0]]), kl_coef=0.1),
            ValueError,
            r"^kl: contains 1 NaN and 0 inf values \(first at index \(0, 1\)\)$",
        ),
        (dict(kl=torch.zeros(2, 3)), None, None),  # kl_coef = 0: a valid kl is ignored
    ]
    for kwargs, err, match in cases:
        if err is None:
            token_level_rewards(s, m, **kwargs)
            continue
        with pytest.raises(err, match=match):
            token_level_rewards(s, m, **kwargs)
    with pytest.raises(
        TypeError, match=r"^scores: expected a floating-point tensor, got dtype torch\.int64$"
    ):
        token_level_rewards(torch.tensor([1, 0]), m)
    # shape inference: with the value checks off it runs on meta
    with value_checks(False):
        out = token_level_rewards(s.to("meta"), m.to("meta"), kl=torch.ones(2, 3, device="meta"), kl_coef=0.1)
    assert out.is_meta and out.shape == (2, 3)
