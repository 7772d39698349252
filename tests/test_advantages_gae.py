"""Tests of rollkit.advantages.gae: the masked reverse scan, discounted returns, GAE, REINFORCE++."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rollkit.advantages.gae import (
    discounted_returns,
    gae_advantages,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    reverse_discounted_cumsum,
)
from rollkit.ops import group_index
from rollkit.registry import ADVANTAGE_ESTIMATORS
from rollkit.testing import batches, float_tensors, group_ids, masks, rewards, shapes
from rollkit.validation import value_checks

# --------------------------------------------------------------------------- plain-Python references


def ref_scan(x, mask, discount):
    """y_t = x_t + discount * y_(next valid), per row, masked tokens skipped (output 0)."""
    B, T = len(x), len(x[0]) if len(x) else 0
    out = [[0.0] * T for _ in range(B)]
    for b in range(B):
        carry = 0.0
        for t in reversed(range(T)):
            if mask[b][t]:
                carry = x[b][t] + discount * carry
                out[b][t] = carry
    return out


def ref_gae(r, v, mask, gamma, lam, bootstrap=None):
    B, T = len(r), len(r[0]) if len(r) else 0
    adv = [[0.0] * T for _ in range(B)]
    ret = [[0.0] * T for _ in range(B)]
    for b in range(B):
        next_v = 0.0 if bootstrap is None else bootstrap[b]
        last = 0.0
        for t in reversed(range(T)):
            if not mask[b][t]:
                continue
            delta = r[b][t] + gamma * next_v - v[b][t]
            last = delta + gamma * lam * last
            adv[b][t] = last
            ret[b][t] = last + v[b][t]
            next_v = v[b][t]
    return adv, ret


def L(t):
    return t.tolist()


def T_(x, dtype=torch.float64):
    return torch.tensor(x, dtype=dtype)


DISCOUNTS = st.sampled_from([0.0, 0.3, 0.9, 0.99, 1.0])
CHUNKS = st.sampled_from([2, 3, 4, 5, 8, 64])


# --------------------------------------------------------------------------- hand-computed examples


def test_scan_hand_example_with_hole():
    x = T_([[1.0, 5.0, 1.0, 1.0, 0.0]])
    m = torch.tensor([[True, False, True, True, False]])
    y = reverse_discounted_cumsum(x, m, discount=0.5, chunk_size=2)
    assert torch.allclose(y, T_([[1.75, 0.0, 1.5, 1.0, 0.0]]))


def test_gae_hand_example():
    r = T_([[0.0, 0.0, 1.0]])
    v = T_([[0.5, 0.6, 0.7]])
    m = torch.ones(1, 3, dtype=torch.bool)
    adv, ret = gae_advantages(r, v, m, gamma=0.9, lam=0.8)
    # delta = [0.04, 0.03, 0.3]; A2 = 0.3, A1 = 0.03 + 0.72 * 0.3, A0 = 0.04 + 0.72 * A1
    assert torch.allclose(adv, T_([[0.21712, 0.246, 0.3]]))
    assert torch.allclose(ret, T_([[0.71712, 0.846, 1.0]]))
    # truncated episode: bootstrap V = 2 after the last token
    adv_b, ret_b = gae_advantages(r, v, m, gamma=0.9, lam=0.8, bootstrap_value=T_([2.0]))
    assert torch.allclose(adv_b, T_([[1.15024, 1.542, 2.1]]))
    assert torch.allclose(ret_b, adv_b + v)


def test_gae_hand_example_with_tool_tokens_and_padding():
    # tokens 1 and 4 are env/tool tokens (skipped), token 5 is padding; garbage there is ignored
    nan = float("nan")
    r = T_([[0.0, 99.0, 0.0, 1.0, nan, nan]])
    v = T_([[0.5, nan, 0.6, 0.7, -9.0, nan]])
    m = torch.tensor([[True, False, True, True, False, False]])
    adv, ret = gae_advantages(r, v, m, gamma=0.9, lam=0.8, chunk_size=2)
    assert torch.allclose(adv, T_([[0.21712, 0.0, 0.246, 0.3, 0.0, 0.0]]))
    assert torch.allclose(ret, T_([[0.71712, 0.0, 0.846, 1.0, 0.0, 0.0]]))


def test_discounted_returns_hand_example():
    r = T_([[0.0, 0.0, 1.0], [2.0, 0.0, 0.0]])
    m = torch.tensor([[True, True, True], [True, False, True]])
    g = discounted_returns(r, m, gamma=0.9)
    assert torch.allclose(g, T_([[0.81, 0.9, 1.0], [2.0, 0.0, 0.0]]))
    # gamma is applied per valid step, not across the hole: 2 + 0.9 * 0 on row 1
    g1 = discounted_returns(T_([[1.0, 0.0, 1.0]]), torch.tensor([[True, False, True]]), gamma=0.5)
    assert torch.allclose(g1, T_([[1.5, 0.0, 1.0]]))


def test_reinforce_pp_hand_example_with_kl():
    rw = T_([1.0])
    m = torch.ones(1, 3, dtype=torch.bool)
    kl = T_([[0.1, 0.2, 0.3]])
    # token rewards: [-0.05, -0.1, -0.15 + 1]
    a = reinforce_pp_advantages(rw, m, kl=kl, kl_coef=0.5, gamma=1.0, whiten=False)
    assert torch.allclose(a, T_([[0.7, 0.75, 0.85]]))
    a = reinforce_pp_advantages(rw, m, kl=kl, kl_coef=0.5, gamma=0.5, whiten=False)
    assert torch.allclose(a, T_([[0.1125, 0.325, 0.85]]))


def test_reinforce_pp_whitening_uses_biased_std_over_batch_tokens():
    rw = T_([1.0, 0.0])
    m = torch.tensor([[True, True, False], [True, True, True]])
    a = reinforce_pp_advantages(rw, m)
    g = torch.tensor([1.0, 1.0, 0.0, 0.0, 0.0], dtype=torch.float64)
    mean, var = g.mean(), g.var(unbiased=False)  # 0.4, 0.24
    want = (torch.tensor([1.0, 0.0], dtype=torch.float64) - mean) / torch.sqrt(var + 1e-8)
    assert torch.allclose(a[0, :2], want[0].expand(2))
    assert torch.allclose(a[1], want[1].expand(3))
    assert a[0, 2] == 0
    assert math.isclose(float(a[0, 0]), 0.6 / math.sqrt(0.24), rel_tol=1e-6)
    # unbiased=True divides by n - 1 = 4 (verl's convention)
    a_u = reinforce_pp_advantages(rw, m, unbiased_std=True)
    assert math.isclose(float(a_u[0, 0]), 0.6 / math.sqrt(0.3), rel_tol=1e-6)


def test_reinforce_pp_baseline_hand_example():
    rw = T_([1.0, 0.0, 0.5, 3.0])
    gid = torch.tensor([7, 7, 2, 7])  # group 7 mean = 4/3; group 2 is a singleton
    m = torch.tensor([[True, True], [True, False], [True, True], [False, True]])
    a = reinforce_pp_baseline_advantages(rw, gid, m, whiten=False)
    c = 4.0 / 3.0
    want = T_([[1 - c, 1 - c], [-c, 0.0], [0.0, 0.0], [0.0, 3 - c]])
    assert torch.allclose(a, want)
    # KL enters per token after the centring: the singleton keeps only its KL return
    kl = T_([[0.0, 0.0], [0.0, 0.0], [1.0, 2.0], [0.0, 0.0]])
    a = reinforce_pp_baseline_advantages(rw, gid, m, kl=kl, kl_coef=0.1, whiten=False)
    assert torch.allclose(a[2], T_([-0.3, -0.2]))
    assert torch.allclose(a[0], want[0])


# --------------------------------------------------------------------------- exactness vs reference


@given(st.data(), shapes(max_batch=5, max_len=40), DISCOUNTS, CHUNKS)
def test_scan_matches_reference_float64(data, shape, discount, chunk):
    B, T = shape
    m = data.draw(masks(B, T))
    x = data.draw(float_tensors((B, T), dtype=torch.float64))
    y = reverse_discounted_cumsum(x, m, discount=discount, chunk_size=chunk)
    assert y.dtype == torch.float64
    assert torch.allclose(y, T_(ref_scan(L(x), L(m), discount)), rtol=1e-12, atol=1e-10)
    assert (y[~m] == 0).all()


@given(st.data(), shapes(max_batch=4, max_len=40), DISCOUNTS, CHUNKS)
def test_scan_matches_reference_float32(data, shape, discount, chunk):
    B, T = shape
    m = data.draw(masks(B, T))
    x = data.draw(float_tensors((B, T)))
    y = reverse_discounted_cumsum(x, m, discount=discount, chunk_size=chunk)
    assert y.dtype == torch.float32
    assert torch.allclose(y.double(), T_(ref_scan(L(x.double()), L(m), discount)), rtol=1e-4, atol=1e-3)


@given(st.data(), shapes(max_batch=5, max_len=40), DISCOUNTS, DISCOUNTS, CHUNKS)
def test_right_padded_fast_path_matches_reference(data, shape, gamma, lam, chunk):
    # masks without interior holes take the no-compaction path
    B, T = shape
    m = data.draw(masks(B, T, holes=False))
    r = data.draw(float_tensors((B, T), min_value=-1, max_value=1, dtype=torch.float64))
    v = data.draw(float_tensors((B, T), min_value=-5, max_value=5, dtype=torch.float64))
    bv = data.draw(float_tensors((B,), dtype=torch.float64))
    adv, ret = gae_advantages(r, v, m, gamma=gamma, lam=lam, bootstrap_value=bv, chunk_size=chunk)
    ra, rr = ref_gae(L(r), L(v), L(m), gamma, lam, L(bv))
    assert torch.allclose(adv, T_(ra), atol=1e-10) and torch.allclose(ret, T_(rr), atol=1e-10)
    y = reverse_discounted_cumsum(r, m, discount=gamma, chunk_size=chunk)
    assert torch.allclose(y, T_(ref_scan(L(r), L(m), gamma)), atol=1e-10)


def test_left_padded_rows():
    x = T_([[9.0, 9.0, 1.0, 2.0], [1.0, 1.0, 1.0, 1.0]])
    m = torch.tensor([[False, False, True, True], [True, True, True, True]])
    y = reverse_discounted_cumsum(x, m, discount=0.5, chunk_size=2)
    assert torch.allclose(y, T_([[0.0, 0.0, 2.0, 2.0], [1.875, 1.75, 1.5, 1.0]]))


@pytest.mark.parametrize("T,chunk", [(1, 2), (1, 64), (7, 3), (64, 8), (65, 8), (200, 4), (513, 8)])
@pytest.mark.parametrize("discount", [0.0, 0.5, 0.999, 1.0])
def test_scan_long_rows_and_chunkings(T, chunk, discount):
    g = torch.Generator().manual_seed(T * 31 + chunk)
    x = torch.randn(3, T, generator=g, dtype=torch.float64)
    m = torch.rand(3, T, generator=g) < 0.7
    m[2] = False  # an all-masked row
    y = reverse_discounted_cumsum(x, m, discount=discount, chunk_size=chunk)
    assert torch.allclose(y, T_(ref_scan(L(x), L(m), discount)), rtol=1e-11, atol=1e-9)
    assert (y[2] == 0).all()


def test_scan_discount_one_is_masked_suffix_sum():
    x = torch.arange(1.0, 301.0, dtype=torch.float64).reshape(3, 100)
    m = torch.ones(3, 100, dtype=torch.bool)
    y = reverse_discounted_cumsum(x, m, discount=1.0, chunk_size=7)
    assert torch.equal(y, x.flip(1).cumsum(1).flip(1))


def test_scan_small_discount_is_stable_on_long_rows():
    # discount**t underflows to 0 long before T: no inf/NaN from negative powers
    x = torch.ones(2, 4096)
    m = torch.ones(2, 4096, dtype=torch.bool)
    y = reverse_discounted_cumsum(x, m, discount=0.01)
    assert torch.isfinite(y).all()
    assert torch.allclose(y[:, :-8], torch.full((2, 4088), 1 / 0.99), rtol=1e-6)
    assert torch.allclose(y[0, -3:], torch.tensor([1.0101, 1.01, 1.0]))


def test_scan_empty_dims_and_low_precision_dtypes():
    assert reverse_discounted_cumsum(
        torch.zeros(2, 0), torch.zeros(2, 0, dtype=torch.bool), discount=0.5
    ).shape == (2, 0)
    assert reverse_discounted_cumsum(
        torch.zeros(0, 3), torch.zeros(0, 3, dtype=torch.bool), discount=0.5
    ).shape == (0, 3)
    x = torch.tensor([[1.0, 1.0, 1.0]], dtype=torch.bfloat16)
    y = reverse_discounted_cumsum(x, torch.ones(1, 3, dtype=torch.bool), discount=1.0)
    assert y.dtype == torch.bfloat16 and y.float().tolist() == [[3.0, 2.0, 1.0]]


def test_scan_is_differentiable():
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0]], requires_grad=True)
    m = torch.tensor([[True, False, True, True]])
    reverse_discounted_cumsum(x, m, discount=0.5).sum().backward()
    # d sum(y) / d x_s = sum over valid t <= s of 0.5 ** (#valid steps between)
    assert torch.allclose(x.grad, torch.tensor([[1.0, 0.0, 1.5, 1.75]]))


def test_scan_gradcheck_through_chunks_and_holes():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 23, generator=g, dtype=torch.float64, requires_grad=True)
    m = torch.rand(2, 23, generator=g) < 0.7
    assert torch.autograd.gradcheck(
        lambda t: reverse_discounted_cumsum(t, m, discount=0.8, chunk_size=3), (x,)
    )
    r = torch.randn(2, 23, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 23, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda a, b: gae_advantages(a, b, m, gamma=0.9, lam=0.7, chunk_size=4), (r, v)
    )


@given(st.data(), shapes(max_batch=5, max_len=30), DISCOUNTS, DISCOUNTS, CHUNKS, st.booleans())
def test_gae_matches_reference(data, shape, gamma, lam, chunk, boot):
    B, T = shape
    m = data.draw(masks(B, T))
    r = data.draw(float_tensors((B, T), min_value=-1, max_value=1, dtype=torch.float64))
    v = data.draw(float_tensors((B, T), min_value=-5, max_value=5, dtype=torch.float64))
    bv = data.draw(float_tensors((B,), dtype=torch.float64)) if boot else None
    adv, ret = gae_advantages(r, v, m, gamma=gamma, lam=lam, bootstrap_value=bv, chunk_size=chunk)
    ra, rr = ref_gae(L(r), L(v), L(m), gamma, lam, None if bv is None else L(bv))
    assert torch.allclose(adv, T_(ra), rtol=1e-10, atol=1e-10)
    assert torch.allclose(ret, T_(rr), rtol=1e-10, atol=1e-10)
    # float32 inputs: loose agreement
    adv32, _ = gae_advantages(
        r.float(),
        v.float(),
        m,
        gamma=gamma,
        lam=lam,
        bootstrap_value=None if bv is None else bv.float(),
        chunk_size=chunk,
    )
    assert adv32.dtype == torch.float32
    assert torch.allclose(adv32.double(), T_(ra), rtol=1e-4, atol=1e-3)


# --------------------------------------------------------------------------- properties


@given(st.data(), shapes(max_batch=5, max_len=20))
def test_gae_lambda1_gamma1_is_reward_to_go_minus_value(data, shape):
    B, T = shape
    m = data.draw(masks(B, T))
    r = data.draw(float_tensors((B, T), min_value=-1, max_value=1, dtype=torch.float64))
    v = data.draw(float_tensors((B, T), min_value=-5, max_value=5, dtype=torch.float64))
    adv, ret = gae_advantages(r, v, m, gamma=1.0, lam=1.0)
    rtg = torch.where(m, r, 0).flip(1).cumsum(1).flip(1)
    assert torch.allclose(adv, torch.where(m, rtg - v, 0), atol=1e-10)
    assert torch.allclose(ret, torch.where(m, rtg, 0), atol=1e-10)


@given(st.data(), shapes(max_batch=5, max_len=20), DISCOUNTS)
def test_gae_lambda0_is_one_step_td_error(data, shape, gamma):
    B, T = shape
    m = data.draw(masks(B, T))
    r = data.draw(float_tensors((B, T), min_value=-1, max_value=1, dtype=torch.float64))
    v = data.draw(float_tensors((B, T), min_value=-5, max_value=5, dtype=torch.float64))
    adv, _ = gae_advantages(r, v, m, gamma=gamma, lam=0.0)
    # V of the next valid token: a reverse "last valid value" fill, built without the scan
    next_v = torch.zeros(B, T, dtype=torch.float64)
    for b in range(B):
        nv = 0.0
        for t in reversed(range(T)):
            next_v[b, t] = nv
            if m[b, t]:
                nv = float(v[b, t])
    assert torch.allclose(adv, torch.where(m, r + gamma * next_v - v, 0), atol=1e-10)


@given(st.data(), shapes(min_batch=2, max_batch=6, max_len=15), DISCOUNTS, DISCOUNTS)
def test_gae_invariant_to_row_permutation(data, shape, gamma, lam):
    B, T = shape
    m = data.draw(masks(B, T))
    r = data.draw(float_tensors((B, T), min_value=-1, max_value=1))
    v = data.draw(float_tensors((B, T), min_value=-5, max_value=5))
    bv = data.draw(float_tensors((B,)))
    perm = torch.tensor(data.draw(st.permutations(list(range(B)))))
    adv, ret = gae_advantages(r, v, m, gamma=gamma, lam=lam, bootstrap_value=bv, chunk_size=4)
    adv_p, ret_p = gae_advantages(
        r[perm], v[perm], m[perm], gamma=gamma, lam=lam, bootstrap_value=bv[perm], chunk_size=4
    )
    assert torch.allclose(adv[perm], adv_p, atol=1e-5) and torch.allclose(ret[perm], ret_p, atol=1e-5)


@given(st.data(), shapes(max_batch=4, max_len=15), st.integers(1, 70), DISCOUNTS, DISCOUNTS)
def test_gae_invariant_to_padding_length(data, shape, extra, gamma, lam):
    B, T = shape
    m = data.draw(masks(B, T))
    r = data.draw(float_tensors((B, T), min_value=-1, max_value=1, dtype=torch.float64))
    v = data.draw(float_tensors((B, T), min_value=-5, max_value=5, dtype=torch.float64))
    adv, ret = gae_advantages(r, v, m, gamma=gamma, lam=lam, chunk_size=8)
    pad = torch.full((B, extra), 7.0, dtype=torch.float64)
    mp = torch.cat([m, torch.zeros(B, extra, dtype=torch.bool)], 1)
    adv_p, ret_p = gae_advantages(
        torch.cat([r, pad], 1), torch.cat([v, pad], 1), mp, gamma=gamma, lam=lam, chunk_size=8
    )
    assert torch.allclose(adv_p[:, :T], adv, atol=1e-10) and (adv_p[:, T:] == 0).all()
    assert torch.allclose(ret_p[:, :T], ret, atol=1e-10) and (ret_p[:, T:] == 0).all()


@given(st.data(), shapes(max_batch=4, max_len=12), DISCOUNTS, DISCOUNTS)
def test_inserting_masked_tokens_does_not_change_valid_advantages(data, shape, gamma, lam):
    B, T = shape
    m = data.draw(masks(B, T))
    r = data.draw(float_tensors((B, T), min_value=-1, max_value=1, dtype=torch.float64))
    v = data.draw(float_tensors((B, T), min_value=-5, max_value=5, dtype=torch.float64))
    # insert a masked tool token (with garbage reward/value) after every position flagged here
    ins = data.draw(st.lists(st.booleans(), min_size=T, max_size=T))
    cols = []
    for t in range(T):
        cols.append(t)
        if ins[t]:
            cols.append(-1)
    idx = torch.tensor([c if c >= 0 else 0 for c in cols])
    hole = torch.tensor([c < 0 for c in cols])
    r2 = torch.where(hole, 123.0, r[:, idx])
    v2 = torch.where(hole, -55.0, v[:, idx])
    m2 = m[:, idx] & ~hole
    adv, ret = gae_advantages(r, v, m, gamma=gamma, lam=lam, chunk_size=3)
    adv2, ret2 = gae_advantages(r2, v2, m2, gamma=gamma, lam=lam, chunk_size=3)
    keep = ~hole
    assert torch.allclose(adv2[:, keep], adv, atol=1e-10) and (adv2[:, hole] == 0).all()
    assert torch.allclose(ret2[:, keep], ret, atol=1e-10)
    g, g2 = discounted_returns(r, m, gamma=gamma), discounted_returns(r2, m2, gamma=gamma)
    assert torch.allclose(g2[:, keep], g, atol=1e-10)


@given(st.data(), shapes(max_batch=6, max_len=15))
def test_reinforce_pp_unwhitened_is_reward_on_every_valid_token(data, shape):
    B, T = shape
    m = data.draw(masks(B, T))
    rw = data.draw(rewards(B))
    a = reinforce_pp_advantages(rw, m, kl_coef=0.0, gamma=1.0, whiten=False)
    assert torch.allclose(a, torch.where(m, rw[:, None].expand(B, T), 0))


@given(st.data(), shapes(max_batch=6, max_len=15), DISCOUNTS)
def test_reinforce_pp_equals_whitened_discounted_returns_of_shaped_rewards(data, shape, gamma):
    B, T = shape
    m = data.draw(masks(B, T, min_tokens=1))
    rw = data.draw(rewards(B)).double()
    kl = data.draw(float_tensors((B, T), min_value=-1, max_value=1, dtype=torch.float64))
    # shaped rewards built by a plain loop: -0.1 * kl on valid tokens, + reward on the last one
    tr = torch.where(m, -0.1 * kl, 0)
    for b in range(B):
        valid = m[b].nonzero().flatten()
        if len(valid):
            tr[b, valid[-1]] += rw[b]
    g = T_(ref_scan(L(tr), L(m), gamma))
    a = reinforce_pp_advantages(rw, m, kl=kl, kl_coef=0.1, gamma=gamma, whiten=False)
    assert torch.allclose(a, g, atol=1e-9)
    aw = reinforce_pp_advantages(rw, m, kl=kl, kl_coef=0.1, gamma=gamma)
    sel = g[m]
    want = (sel - sel.mean()) / torch.sqrt(sel.var(unbiased=False) + 1e-8)
    assert torch.allclose(aw[m], want, atol=1e-6) and (aw[~m] == 0).all()


@given(st.data(), shapes(max_batch=8, max_len=10))
def test_reinforce_pp_baseline_zero_for_zero_variance_groups(data, shape):
    B, T = shape
    m = data.draw(masks(B, T))
    gid = data.draw(group_ids(B))
    index, n_groups = group_index(gid)
    per_group = data.draw(float_tensors((n_groups,), min_value=-3, max_value=3))
    rw = per_group[index]  # every group has a constant reward
    a = reinforce_pp_baseline_advantages(rw, gid, m, whiten=False)
    assert torch.allclose(a, torch.zeros(B, T), atol=1e-5)
    # whitened: all returns equal (0), variance 0 -> advantages 0, no NaN
    if m.any():
        aw = reinforce_pp_baseline_advantages(rw, gid, m)
        assert torch.isfinite(aw).all() and torch.allclose(aw, torch.zeros(B, T), atol=1e-4)


@given(st.data(), shapes(max_batch=8, max_len=10))
def test_reinforce_pp_baseline_singletons_and_group_means(data, shape):
    B, T = shape
    m = data.draw(masks(B, T))
    gid = data.draw(group_ids(B))
    rw = data.draw(rewards(B)).double()
    a = reinforce_pp_baseline_advantages(rw, gid, m, whiten=False)
    for b in range(B):
        same = gid == gid[b]
        want = rw[b] - rw[same].mean()
        if int(same.sum()) == 1:
            assert float(want) == 0.0
        assert torch.allclose(a[b], torch.where(m[b], want, 0), atol=1e-9)


@given(st.data(), shapes(max_batch=6, max_len=10))
def test_inputs_not_mutated(data, shape):
    B, T = shape
    m = data.draw(masks(B, T))
    r = data.draw(float_tensors((B, T)))
    v = data.draw(float_tensors((B, T)))
    rw = data.draw(rewards(B))
    copies = [t.clone() for t in (r, v, m, rw)]
    gae_advantages(r, v, m, gamma=0.9, lam=0.9, bootstrap_value=rw)
    reinforce_pp_advantages(rw, m, kl=v, kl_coef=0.2, whiten=False)
    reverse_discounted_cumsum(r, m, discount=0.7)
    for a, b in zip((r, v, m, rw), copies):
        assert torch.equal(a, b)


# --------------------------------------------------------------------------- edge cases and errors


def test_all_masked_rows_and_batches():
    m = torch.zeros(2, 4, dtype=torch.bool)
    x = torch.randn(2, 4)
    assert (reverse_discounted_cumsum(x, m, discount=0.9) == 0).all()
    adv, ret = gae_advantages(x, x, m, gamma=0.9, lam=0.9, bootstrap_value=torch.ones(2))
    assert (adv == 0).all() and (ret == 0).all()  # bootstrap of an empty row is ignored
    assert (reinforce_pp_advantages(torch.ones(2), m, whiten=False) == 0).all()
    with pytest.raises(ValueError, match="mask"):
        reinforce_pp_advantages(torch.ones(2), m)  # whitening over nothing is undefined
    with value_checks(False):
        assert (reinforce_pp_advantages(torch.ones(2), m) == 0).all()


def test_single_valid_token_whitens_to_zero():
    m = torch.tensor([[False, True, False]])
    a = reinforce_pp_advantages(torch.tensor([5.0]), m)
    assert torch.equal(a, torch.zeros(1, 3))


def test_nan_under_mask_is_ignored_but_nan_on_valid_token_raises():
    x = torch.tensor([[1.0, float("nan"), 2.0]])
    m = torch.tensor([[True, False, True]])
    assert torch.allclose(reverse_discounted_cumsum(x, m, discount=1.0), torch.tensor([[3.0, 0.0, 2.0]]))
    with pytest.raises(ValueError, match="x: contains 1 NaN"):
        reverse_discounted_cumsum(x, torch.ones(1, 3, dtype=torch.bool), discount=1.0)
    with pytest.raises(ValueError, match="values: contains 1 NaN"):
        gae_advantages(torch.zeros(1, 3), x, torch.ones(1, 3, dtype=torch.bool), gamma=1.0, lam=1.0)
    with pytest.raises(ValueError, match="kl: contains"):
        reinforce_pp_advantages(torch.zeros(1), torch.ones(1, 3, dtype=torch.bool), kl=x, kl_coef=0.1)
    with value_checks(False):  # checks off: no error (garbage in, garbage out)
        reverse_discounted_cumsum(x, torch.ones(1, 3, dtype=torch.bool), discount=1.0)
    with pytest.raises(ValueError, match="rewards: contains"):
        reinforce_pp_advantages(torch.tensor([float("inf")]), torch.ones(1, 2, dtype=torch.bool))


def test_errors_name_the_argument():
    x = torch.zeros(2, 3)
    m = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"mask: expected a torch.bool mask"):
        reverse_discounted_cumsum(x, m.float(), discount=0.5)
    with pytest.raises(ValueError, match=r"x: shape \[2, 3\] does not match mask shape \[2, 2\]"):
        reverse_discounted_cumsum(x, m[:, :2], discount=0.5)
    with pytest.raises(ValueError, match="x: expected 2 dimensions"):
        reverse_discounted_cumsum(x[0], m[0], discount=0.5)
    with pytest.raises(ValueError, match="x: expected a floating-point"):
        reverse_discounted_cumsum(x.long(), m, discount=0.5)
    with pytest.raises(ValueError, match=r"discount: must be in \[0.0, 1.0\]"):
        reverse_discounted_cumsum(x, m, discount=1.5)
    with pytest.raises(ValueError, match="chunk_size: must be >= 2"):
        reverse_discounted_cumsum(x, m, discount=0.5, chunk_size=1)
    with pytest.raises(ValueError, match="chunk_size: expected an int"):
        reverse_discounted_cumsum(x, m, discount=0.5, chunk_size=4.0)
    with pytest.raises(ValueError, match="gamma: must be in"):
        discounted_returns(x, m, gamma=-0.1)
    with pytest.raises(ValueError, match="gamma: must be in"):
        gae_advantages(x, x, m, gamma=1.01, lam=0.9)
    with pytest.raises(ValueError, match="lam: must be in"):
        gae_advantages(x, x, m, gamma=0.9, lam=2.0)
    with pytest.raises(ValueError, match="values: shape"):
        gae_advantages(x, torch.zeros(2, 4), m, gamma=0.9, lam=0.9)
    with pytest.raises(ValueError, match="bootstrap_value: expected shape"):
        gae_advantages(x, x, m, gamma=0.9, lam=0.9, bootstrap_value=torch.zeros(3))
    with pytest.raises(ValueError, match="rewards: expected shape"):
        reinforce_pp_advantages(torch.zeros(3), m)
    with pytest.raises(ValueError, match="kl: a \\[B, T\\]"):
        reinforce_pp_advantages(torch.zeros(2), m, kl_coef=0.1)
    with pytest.raises(ValueError, match="kl: expected shape"):
        reinforce_pp_advantages(torch.zeros(2), m, kl=torch.zeros(2, 4), kl_coef=0.1)
    with pytest.raises(ValueError, match="kl_coef: must be >= 0"):
        reinforce_pp_advantages(torch.zeros(2), m, kl=x, kl_coef=-1.0)
    with pytest.raises(ValueError, match="gamma: must be in"):
        reinforce_pp_advantages(torch.zeros(2), m, gamma=2.0)
    with pytest.raises(ValueError, match="group_ids: has 3 entries"):
        reinforce_pp_baseline_advantages(torch.zeros(2), torch.zeros(3, dtype=torch.long), m)
    with pytest.raises(ValueError, match="group_ids: expected an integer"):
        reinforce_pp_baseline_advantages(torch.zeros(2), torch.zeros(2), m)


def test_registry_entries():
    e = ADVANTAGE_ESTIMATORS.entry("gae")
    assert e.fn is gae_advantages
    assert dict(e.in_keys) == {
        "token_rewards": "token_rewards",
        "values": "values",
        "mask": "response_mask",
        "bootstrap_value": "bootstrap_value",
    }
    assert tuple(e.out_keys) == ("advantages", "returns")
    assert ADVANTAGE_ESTIMATORS.get("reinforce_plus_plus") is reinforce_pp_advantages
    assert ADVANTAGE_ESTIMATORS.entry("reinforce++").in_keys["rewards"] == "rewards"
    e = ADVANTAGE_ESTIMATORS.entry("reinforce++-baseline")
    assert e.fn is reinforce_pp_baseline_advantages and e.in_keys["group_ids"] == "group_ids"
    assert tuple(e.out_keys) == ("advantages",)
    e = ADVANTAGE_ESTIMATORS.entry("discounted-returns")
    assert e.fn is discounted_returns and tuple(e.out_keys) == ("returns",)


def test_gae_td_module_with_and_without_bootstrap_value():
    from tensordict import TensorDict

    from rollkit.td import td_module

    r = torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    v = torch.tensor([[0.5, 0.25, 0.0], [1.0, 0.0, 0.0]])
    m = torch.tensor([[True, True, False], [True, False, False]])
    boot = torch.tensor([2.0, -1.0])
    td = TensorDict(token_rewards=r, values=v, response_mask=m, batch_size=[2])
    module = td_module("gae", registry="advantage", gamma=0.5, lam=1.0)
    out = module(td.clone())  # no bootstrap_value key: terminated episodes (V = 0 after the end)
    adv, ret = gae_advantages(r, v, m, gamma=0.5, lam=1.0)
    torch.testing.assert_close(out["advantages"], adv)
    torch.testing.assert_close(out["returns"], ret)
    # by hand, row 0: delta_1 = 1 - 0.25 = 0.75, delta_0 = 0 + 0.5 * 0.25 - 0.5 = -0.375,
    # A_0 = -0.375 + 0.5 * 0.75 = 0; row 1: A_0 = 1 - 1 = 0
    torch.testing.assert_close(out["advantages"], torch.tensor([[0.0, 0.75, 0.0], [0.0, 0.0, 0.0]]))
    td["bootstrap_value"] = boot
    out_b = module(td.clone())
    adv_b, ret_b = gae_advantages(r, v, m, gamma=0.5, lam=1.0, bootstrap_value=boot)
    torch.testing.assert_close(out_b["advantages"], adv_b)
    torch.testing.assert_close(out_b["returns"], ret_b)
    # the bootstrap enters after the last valid token: + gamma * V_boot on it, discounted back
    expected = torch.tensor([[0.5, 1.75, 0.0], [-0.5, 0.0, 0.0]])  # A_0 = -0.375 + 0.5 * 1.75
    torch.testing.assert_close(out_b["advantages"], expected)


def test_reinforce_pp_constant_returns_whiten_to_exact_zero():
    # every valid token has the same return 0.3 (gamma = 1, no KL): zero variance, so the
    # whitened advantage is exactly 0 (float64 statistics on min-shifted returns), not noise / eps
    mask = torch.tensor([[True, True, False], [True, True, True], [True, False, False]])
    for r in (0.3, 0.1, 1000.3):
        adv = reinforce_pp_advantages(torch.full((3,), r), mask)
        assert adv.tolist() == [[0.0] * 3] * 3
    # group-centred constant groups as well
    adv = reinforce_pp_baseline_advantages(torch.tensor([0.7, 0.7, 0.2]), torch.tensor([0, 0, 1]), mask)
    assert adv.tolist() == [[0.0] * 3] * 3


# --------------------------------------------------------------------------- garbage padding


@settings(max_examples=60, deadline=None)
@given(
    b=batches(garbage_padding=True, allow_empty_rows=True),
    gamma=st.sampled_from([0.0, 0.9, 1.0]),
    unbiased=st.booleans(),
    chunk=st.sampled_from([2, 3, 64]),
)
def test_token_estimators_finite_value_and_grad_with_garbage_padding(b, gamma, unbiased, chunk):
    """NaN / +-inf at the masked positions of every [B, T] input reach neither the outputs nor
    the gradients of the token-level estimators."""
    from hypothesis import assume

    m = b["response_mask"]
    assume(int(m.sum()) >= 2)
    tr = b["token_rewards"].double().requires_grad_()
    vals = b["values"].double().requires_grad_()
    kl = (b["ref_logprobs"] - b["logprobs"]).double().requires_grad_()
    rw = b["rewards"].double().requires_grad_()
    adv, ret = gae_advantages(tr, vals, m, gamma=gamma, lam=0.95, chunk_size=chunk)
    outs = [
        adv,
        ret,
        discounted_returns(tr, m, gamma=gamma, chunk_size=chunk),
        reverse_discounted_cumsum(tr, m, discount=gamma, chunk_size=chunk),
        reinforce_pp_advantages(
            rw, m, kl=kl, kl_coef=0.1, gamma=gamma, unbiased_std=unbiased, chunk_size=chunk
        ),
        reinforce_pp_baseline_advantages(
            rw, b["group_ids"], m, kl=kl, kl_coef=0.1, gamma=gamma, unbiased_std=unbiased, chunk_size=chunk
        ),
    ]
    w = torch.linspace(-1.0, 2.0, m.numel(), dtype=torch.float64).reshape(m.shape)
    for out in outs:
        assert torch.isfinite(out).all()
        assert (out[~m] == 0).all()
    sum((o * w).sum() for o in outs).backward()
    for x in (tr, vals, kl):
        assert torch.isfinite(x.grad).all()
        assert (x.grad[~m] == 0).all()
    assert torch.isfinite(rw.grad).all()


def test_reinforce_pp_single_token_depends_on_unbiased_std():
    m = torch.tensor([[True, False]])
    assert reinforce_pp_advantages(torch.tensor([2.0]), m).tolist() == [[0.0, 0.0]]
    with pytest.raises(ValueError, match="at least 2"):
        reinforce_pp_advantages(torch.tensor([2.0]), m, unbiased_std=True)
    with pytest.raises(TypeError):
        reinforce_pp_advantages(torch.tensor([2.0]), m, unbiased=True)  # renamed to unbiased_std


def test_general_layout_path_equals_the_right_padded_fast_path(monkeypatch):
    """On an accelerator the "no interior hole" check is skipped (it would synchronise): the
    general compaction path must give bitwise the same result on right-padded masks."""
    import rollkit.advantages.gae as gae

    gen = torch.Generator().manual_seed(0)
    B, T = 6, 150
    m = torch.arange(T) < torch.tensor([[150], [1], [0], [77], [64], [65]])
    tr = torch.randn(B, T, generator=gen)
    vals = torch.randn(B, T, generator=gen)
    rw = torch.randn(B, generator=gen)

    def run():
        return (
            *gae_advantages(tr, vals, m, gamma=0.99, lam=0.9),
            discounted_returns(tr, m, gamma=0.97),
            reinforce_pp_advantages(rw, m, kl=tr, kl_coef=0.05),
        )

    assert gae._layout(m).dest is None
    fast = run()
    monkeypatch.setattr(gae, "_mask_is_cheap_to_read", lambda mask: False)
    assert gae._layout(m).dest is not None
    for a, b in zip(fast, run()):
        assert torch.equal(a, b)


# --------------------------------------------------------------------------- reliability (issue 14)


def test_a_meta_mask_is_refused_not_answered_with_uninitialised_memory():
    """``scatter_`` with a ``meta`` index on a CPU tensor returns uninitialised memory; the
    device check stops it (the value checks off, so that only the device check can)."""
    from rollkit.advantages.gae import discounted_returns, gae_advantages, reinforce_pp_advantages
    from rollkit.validation import value_checks

    x = torch.tensor([[1.0, 5.0, 1.0, 1.0]])
    meta_mask = torch.tensor([[True, False, True, True]]).to("meta")
    with value_checks(False):
        with pytest.raises(ValueError, match=r"^token_rewards: is on device cpu but mask is on meta$"):
            discounted_returns(x, meta_mask, gamma=0.5)
        with pytest.raises(ValueError, match=r"^values: is on device meta but mask is on cpu$"):
            gae_advantages(x, x.to("meta"), torch.ones(1, 4, dtype=torch.bool))
        with pytest.raises(ValueError, match=r"^bootstrap_value: is on device meta but mask is on cpu$"):
            gae_advantages(
                x, x, torch.ones(1, 4, dtype=torch.bool), bootstrap_value=torch.ones(1, device="meta")
            )
        with pytest.raises(ValueError, match=r"^rewards: is on device meta but mask is on cpu$"):
            reinforce_pp_advantages(torch.ones(1, device="meta"), torch.ones(1, 4, dtype=torch.bool))


@pytest.mark.parametrize("T", [0, 7, 130])
def test_token_estimators_run_on_meta_for_shape_inference(T):
    from rollkit.advantages.gae import discounted_returns, gae_advantages, reinforce_pp_advantages
    from rollkit.validation import value_checks

    x = torch.zeros(3, T, device="meta")
    m = torch.ones(3, T, dtype=torch.bool, device="meta")
    with value_checks(False):
        assert discounted_returns(x, m, gamma=0.9).shape == (3, T)
        adv, ret = gae_advantages(x, x, m, bootstrap_value=torch.zeros(3, device="meta"))
        assert adv.is_meta and ret.shape == (3, T)
        out = reinforce_pp_advantages(torch.zeros(3, device="meta"), m, kl=x, kl_coef=0.1)
        assert out.is_meta and out.shape == (3, T)
    with pytest.raises(ValueError, match=r"^token_rewards: is on the meta device"):
        discounted_returns(x, m, gamma=0.9)
    with pytest.raises(ValueError, match=r"^rewards: is on the meta device"):
        reinforce_pp_advantages(torch.zeros(3, device="meta"), m)
