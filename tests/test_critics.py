"""Tests of rollkit.critics: AsyPPO's critic shards, ensemble value and disagreement masks."""

from __future__ import annotations

import math
from collections import Counter
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import rollkit
from rollkit.advantages.gae import gae_advantages
from rollkit.critics import (
    DEFAULT_ADVANTAGE_MASK_FRAC,
    DEFAULT_ENTROPY_FILTER_FRAC,
    SHARD_LEVELS,
    AsyPPOAdvantages,
    DisagreementMasks,
    asyppo_advantages,
    critic_shards,
    disagreement_masks,
    ensemble_values,
)
from rollkit.losses import aggregate, entropy_bonus, ppo_clip
from rollkit.testing import float_tensors, group_ids, masks, shapes

METRIC_KEYS = {"advantage_masked_frac", "entropy_filtered_frac", "value_std_mean", "value_std_max"}
_FRACS = st.sampled_from([0.0, 0.05, 0.1, 0.2, 0.25, 0.29, 0.4, 0.5, 0.7, 1.0]) | st.floats(0.0, 1.0)


# --------------------------------------------------------------------------- references


def ref_masks(std: torch.Tensor, mask: torch.Tensor, k: float, h: float):
    """Plain-Python ``Low_k`` / ``Top_h`` with the documented rule, by counting (no sort): with
    ``m = floor(k n)``, a valid token is masked iff at most ``m`` valid tokens have a std
    ``<=`` its own (ties at the boundary kept); the entropy filter mirrors it from the top."""
    vals = std[mask].tolist()
    n = len(vals)
    m_low = n * Fraction(k).limit_denominator(10**6) // 1
    m_high = n * Fraction(h).limit_denominator(10**6) // 1
    adv = torch.zeros_like(mask)
    ent = torch.zeros_like(mask)
    for idx in mask.nonzero().tolist():
        s = float(std[tuple(idx)])
        adv[tuple(idx)] = not (sum(v <= s for v in vals) <= m_low)
        ent[tuple(idx)] = not (sum(v >= s for v in vals) <= m_high)
    return adv, ent, int(m_low), int(m_high)


@st.composite
def std_batches(draw, *, ties: bool | None = None):
    b, t = draw(shapes(max_batch=6, max_len=10))
    mask = draw(masks(b, t, min_tokens=0))
    if ties is None:
        ties = draw(st.booleans())
    if ties:  # few distinct values: many ties, also at the thresholds
        values = draw(st.lists(st.sampled_from([0.0, 0.5, 1.0, 2.0]), min_size=b * t, max_size=b * t))
        std = torch.tensor(values, dtype=torch.float32).reshape(b, t)
    else:
        std = draw(float_tensors((b, t), min_value=0.0, max_value=5.0, mask=mask))
    # anything outside the mask: NaN, inf, negative
    junk = draw(st.sampled_from([math.nan, math.inf, -1.0, 0.0]))
    return torch.where(mask, std, torch.full_like(std, junk)), mask


# --------------------------------------------------------------------------- critic_shards


@settings(max_examples=80)
@given(
    data=st.data(),
    b=st.integers(0, 40),
    k=st.integers(1, 6),
    level=st.sampled_from(SHARD_LEVELS),
    seed=st.none() | st.integers(0, 2**31),
)
def test_shards_are_a_balanced_partition(data, b, k, level, seed):
    gid = data.draw(group_ids(b, max_groups=data.draw(st.integers(1, 12))))
    shards = critic_shards(gid, k, level=level, seed=seed)
    assert shards.dtype == torch.int64 and shards.shape == (b,)
    # one critic per sample: the critics' subsets are disjoint and cover the batch
    assert bool(((shards >= 0) & (shards < k)).all())
    per_critic = [int((shards == m).sum()) for m in range(k)]
    assert sum(per_critic) == b
    groups = {}
    for g, c in zip(gid.tolist(), shards.tolist()):
        groups.setdefault(g, []).append(c)
    if level == "response":
        for members in groups.values():  # within each prompt: counts differ by at most 1
            counts = Counter(members)
            sizes = [counts.get(m, 0) for m in range(k)]
            assert max(sizes) - min(sizes) <= 1, (members, sizes)
        assert max(per_critic) - min(per_critic) <= 1  # and over the batch
        if b >= k:
            assert min(per_critic) >= 1
    else:
        for members in groups.values():  # a whole prompt goes to one critic
            assert len(set(members)) == 1
        owners = Counter(members[0] for members in groups.values())
        group_counts = [owners.get(m, 0) for m in range(k)]
        assert max(group_counts) - min(group_counts) <= 1
        if len(groups) >= k:
            assert min(per_critic) >= 1


@given(data=st.data(), k=st.integers(1, 5), level=st.sampled_from(SHARD_LEVELS), seed=st.integers(0, 10**6))
def test_shards_are_deterministic(data, k, level, seed):
    gid = data.draw(group_ids(data.draw(st.integers(1, 30))))
    assert torch.equal(critic_shards(gid, k, level=level), critic_shards(gid, k, level=level))
    a = critic_shards(gid, k, level=level, seed=seed)
    assert torch.equal(a, critic_shards(gid, k, level=level, seed=seed))
    assert torch.equal(a, critic_shards(gid.clone(), k, level=level, seed=seed))


def test_shards_seed_changes_the_division():
    gid = torch.arange(8).repeat_interleave(8)  # 8 prompts x 8 responses
    base = critic_shards(gid, 2)
    seeded = [critic_shards(gid, 2, seed=s) for s in range(5)]
    assert any(not torch.equal(base, s) for s in seeded)
    assert len({tuple(s.tolist()) for s in seeded}) > 1
    for s in seeded:  # still 4 + 4 in every prompt
        assert torch.equal(torch.stack([(s[gid == g] == 0).sum() for g in range(8)]), torch.full((8,), 4))


def test_shards_deal_in_order_without_seed():
    gid = torch.tensor([5, 2, 5, 2, 2, 5, 9])
    # groups by increasing id (2, 5, 9), samples in batch order, dealt 0, 1, 2, 0, ...
    assert critic_shards(gid, 3).tolist() == [0, 0, 1, 1, 2, 2, 0]
    assert critic_shards(gid, 3, level="prompt").tolist() == [1, 0, 1, 0, 0, 1, 2]
    assert critic_shards(gid, 1).tolist() == [0] * 7
    assert critic_shards(torch.zeros(0, dtype=torch.int64), 2).shape == (0,)
    assert critic_shards(gid.int(), 2).dtype == torch.int64


def test_shards_bad_arguments():
    gid = torch.tensor([0, 0, 1, 1])
    for bad in (0, -1):
        with pytest.raises(ValueError, match=r"^num_critics: must be >= 1"):
            critic_shards(gid, bad)
    for bad in (2.0, True, "2", torch.tensor(2)):
        with pytest.raises(ValueError, match=r"^num_critics:"):
            critic_shards(gid, bad)
    with pytest.raises(ValueError, match=r"^level: must be one of"):
        critic_shards(gid, 2, level="token")
    for bad in (1.5, "1", True):
        with pytest.raises(ValueError, match=r"^seed:"):
            critic_shards(gid, 2, seed=bad)
    for seed in (-1, 2**70):  # any int seeds (reduced mod 2**64)
        assert torch.equal(critic_shards(gid, 2, seed=seed), critic_shards(gid, 2, seed=seed))
    with pytest.raises(ValueError, match=r"^group_ids:"):
        critic_shards(gid.float(), 2)
    with pytest.raises(ValueError, match=r"^group_ids:"):
        critic_shards(gid.view(2, 2), 2)
    with pytest.raises(ValueError, match=r"^group_ids:"):
        critic_shards([0, 1], 2)


# --------------------------------------------------------------------------- ensemble_values


@given(data=st.data(), k=st.integers(1, 4), unbiased=st.booleans())
def test_ensemble_matches_torch(data, k, unbiased):
    if unbiased and k == 1:
        k = 2
    b, t = data.draw(shapes(max_batch=5, max_len=8))
    mask = data.draw(masks(b, t, min_tokens=0))
    values = torch.stack(
        [
            data.draw(float_tensors((b, t), min_value=-50, max_value=50, mask=mask, garbage_padding=True))
            for _ in range(k)
        ]
    )
    mean, std = ensemble_values(values, mask, unbiased=unbiased)
    assert mean.shape == std.shape == (b, t) and mean.dtype == std.dtype == torch.float32
    clean = torch.where(mask, values, torch.zeros(()))
    ref_std, ref_mean = torch.std_mean(clean.double(), dim=0, correction=int(unbiased))
    assert torch.allclose(mean[mask].double(), ref_mean[mask], atol=1e-5, rtol=1e-5)
    assert torch.allclose(std[mask].double(), ref_std[mask], atol=1e-4, rtol=1e-4)
    assert bool((mean[~mask] == 0).all()) and bool((std[~mask] == 0).all())
    assert bool((std >= 0).all())
    if k == 1:
        assert bool((std == 0).all())


def test_ensemble_population_vs_unbiased_and_detached():
    v = torch.tensor([[[1.0, 4.0]], [[3.0, 4.0]]], requires_grad=True)  # K=2, B=1, T=2
    m = torch.ones(1, 2, dtype=torch.bool)
    mean, std = ensemble_values(v, m)
    assert mean.tolist() == [[2.0, 4.0]] and std.tolist() == [[1.0, 0.0]]  # np.std: |a - b| / 2
    _, std_u = ensemble_values(v, m, unbiased=True)
    assert torch.allclose(std_u, torch.tensor([[math.sqrt(2.0), 0.0]]))  # torch.std: |a - b| / sqrt 2
    assert not mean.requires_grad and not std.requires_grad
    # half precision is computed and returned in float32; float64 stays float64
    assert ensemble_values(v.detach().half(), m)[1].dtype == torch.float32
    assert ensemble_values(v.detach().double(), m)[0].dtype == torch.float64


def test_ensemble_large_values_do_not_overflow():
    v = torch.tensor([[[3e19]], [[-3e19]]])  # squares overflow float32, the scaled std does not
    mean, std = ensemble_values(v, torch.ones(1, 1, dtype=torch.bool))
    assert mean.item() == 0.0 and math.isclose(std.item(), 3e19, rel_tol=1e-6)


def test_ensemble_bad_arguments():
    m = torch.ones(2, 3, dtype=torch.bool)
    v = torch.zeros(2, 2, 3)
    with pytest.raises(ValueError, match=r"^values: expected 3 dimensions"):
        ensemble_values(torch.zeros(2, 3), m)
    with pytest.raises(ValueError, match=r"^values: expected a floating-point"):
        ensemble_values(v.long(), m)
    with pytest.raises(ValueError, match=r"^mask: shape"):
        ensemble_values(v, torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"^mask: expected a torch.bool"):
        ensemble_values(v, m.float())
    with pytest.raises(ValueError, match=r"^values: needs at least one critic"):
        ensemble_values(torch.zeros(0, 2, 3), m)
    with pytest.raises(ValueError, match=r"^unbiased: .*K >= 2"):
        ensemble_values(torch.zeros(1, 2, 3), m, unbiased=True)
    with pytest.raises(ValueError, match=r"^unbiased: expected a bool"):
        ensemble_values(v, m, unbiased=1)
    bad = v.clone()
    bad[1, 0, 2] = math.nan
    with pytest.raises(ValueError, match=r"^values: contains 1 NaN"):
        ensemble_values(bad, m)
    m2 = m.clone()
    m2[0, 2] = False
    assert ensemble_values(bad, m2)[0][0, 2] == 0  # NaN outside the mask is ignored


# --------------------------------------------------------------------------- disagreement_masks


@settings(max_examples=100)
@given(batch=std_batches(), k=_FRACS, h=_FRACS)
def test_masks_match_the_reference(batch, k, h):
    std, mask = batch
    adv, ent, metrics = disagreement_masks(std, mask, advantage_mask_frac=k, entropy_filter_frac=h)
    ref_adv, ref_ent, m_low, m_high = ref_masks(std, mask, k, h)
    assert adv.dtype == ent.dtype == torch.bool and adv.shape == ent.shape == mask.shape
    assert torch.equal(adv, ref_adv) and torch.equal(ent, ref_ent)
    assert not bool((adv | ent)[~mask].any())  # both False outside the mask
    n = int(mask.sum())
    n_adv, n_ent = int((mask & ~adv).sum()), int((mask & ~ent).sum())
    assert n_adv <= m_low and n_ent <= m_high  # never more than the budget
    assert set(metrics) == METRIC_KEYS
    assert math.isclose(float(metrics["advantage_masked_frac"]), n_adv / max(n, 1), abs_tol=1e-6)
    assert math.isclose(float(metrics["entropy_filtered_frac"]), n_ent / max(n, 1), abs_tol=1e-6)
    mean = float(std[mask].double().mean()) if n else 0.0
    assert math.isclose(float(metrics["value_std_mean"]), mean, rel_tol=1e-5, abs_tol=1e-6)
    assert float(metrics["value_std_max"]) == (float(std[mask].max()) if n else 0.0)


@given(batch=std_batches(ties=False), k=_FRACS, h=_FRACS)
def test_masks_without_ties_take_exactly_the_extremes(batch, k, h):
    std, mask = batch
    vals = std[mask].numpy()
    if len(np.unique(vals)) < len(vals):
        return  # float draws collided: covered by the reference test
    adv, ent, _ = disagreement_masks(std, mask, advantage_mask_frac=k, entropy_filter_frac=h)
    n = len(vals)
    m_low = math.floor(Fraction(k).limit_denominator(10**6) * n)
    m_high = math.floor(Fraction(h).limit_denominator(10**6) * n)
    order = np.argsort(vals, kind="stable")
    lowest, highest = set(order[:m_low].tolist()), set(order[n - m_high :].tolist()) if m_high else set()
    masked = set(np.flatnonzero(~adv[mask].numpy()).tolist())
    filtered = set(np.flatnonzero(~ent[mask].numpy()).tolist())
    assert masked == lowest and filtered == highest
    if m_low < n:  # the same set as "strictly below numpy's m-th order statistic"
        thr = np.partition(vals, m_low)[m_low]
        assert masked == set(np.flatnonzero(vals < thr).tolist())
        q = np.quantile(vals, (m_low + 0.5) / n, method="inverted_cdf")  # also numpy's s_(m)
        assert masked == set(np.flatnonzero(vals < q).tolist())


@given(batch=std_batches(), k=_FRACS, h=_FRACS, seed=st.integers(0, 1000))
def test_masks_are_permutation_equivariant(batch, k, h, seed):
    std, mask = batch
    perm = torch.randperm(std.numel(), generator=torch.Generator().manual_seed(seed))
    a, e, _ = disagreement_masks(std, mask, advantage_mask_frac=k, entropy_filter_frac=h)
    ps, pm = std.reshape(-1)[perm].reshape(std.shape), mask.reshape(-1)[perm].reshape(mask.shape)
    pa, pe, _ = disagreement_masks(ps, pm, advantage_mask_frac=k, entropy_filter_frac=h)
    assert torch.equal(pa, a.reshape(-1)[perm].reshape(a.shape))
    assert torch.equal(pe, e.reshape(-1)[perm].reshape(e.shape))


def test_masks_defaults_and_exact_counts():
    assert DEFAULT_ADVANTAGE_MASK_FRAC == 0.2 and DEFAULT_ENTROPY_FILTER_FRAC == 0.2
    std = torch.arange(100, dtype=torch.float32).reshape(4, 25).flip(1)
    mask = torch.ones(4, 25, dtype=torch.bool)
    adv, ent, _ = disagreement_masks(std, mask)
    assert int((~adv).sum()) == 20 and int((~ent).sum()) == 20
    assert bool((std[~adv] < 20).all()) and bool((std[~ent] >= 80).all())
    # fractions that float arithmetic gets wrong (0.29 * 100 = 28.999...) are counted exactly
    for frac, want in ((0.29, 29), (0.7, 70), (0.01, 1), (0.0, 0), (1.0, 100)):
        a, e, _ = disagreement_masks(std, mask, advantage_mask_frac=frac, entropy_filter_frac=frac)
        assert int((~a).sum()) == want and int((~e).sum()) == want


def test_masks_ties_empty_rows_and_single_critic():
    mask = torch.tensor([[True, True, True, True], [False, False, False, False], [True, True, False, False]])
    # all tied: nothing can be singled out below k = 1 (ties at the boundary are kept) ...
    flat = torch.full((3, 4), 0.3)
    adv, ent, metrics = disagreement_masks(flat, mask, advantage_mask_frac=0.5, entropy_filter_frac=0.5)
    assert torch.equal(adv, mask) and torch.equal(ent, mask)
    assert float(metrics["advantage_masked_frac"]) == 0.0
    # ... and k = h = 1 masks / filters every valid token
    adv, ent, metrics = disagreement_masks(flat, mask, advantage_mask_frac=1.0, entropy_filter_frac=1.0)
    assert not bool(adv.any()) and not bool(ent.any())
    assert float(metrics["advantage_masked_frac"]) == 1.0 == float(metrics["entropy_filtered_frac"])
    # a fully masked row stays all-False and does not count in n (6 valid tokens: floor(0.34 * 6) = 2)
    std = torch.tensor([[0.5, 0.1, 0.9, 0.2], [0.0, 0.0, 0.0, 0.0], [0.3, 0.8, 7.0, 7.0]])
    adv, ent, _ = disagreement_masks(std, mask, advantage_mask_frac=0.34, entropy_filter_frac=0.34)
    assert (~adv & mask).nonzero().tolist() == [[0, 1], [0, 3]]
    assert (~ent & mask).nonzero().tolist() == [[0, 2], [2, 1]]
    assert not bool(adv[1].any()) and not bool(ent[1].any())
    # K = 1: the std is 0 everywhere, so AsyPPO degenerates to plain PPO (nothing masked)
    values = torch.randn(1, 3, 4)
    _, std1 = ensemble_values(values, mask)
    adv, ent, metrics = disagreement_masks(std1, mask)
    assert torch.equal(adv, mask) and torch.equal(ent, mask)
    assert float(metrics["advantage_masked_frac"]) == 0.0 == float(metrics["entropy_filtered_frac"])


def test_masks_empty_mask():
    for shape in ((2, 3), (0, 3), (2, 0)):
        std = torch.rand(shape)
        mask = torch.zeros(shape, dtype=torch.bool)
        out = disagreement_masks(std, mask)
        assert isinstance(out, DisagreementMasks)
        assert not bool(out.advantage_keep.any()) and not bool(out.entropy_keep.any())
        assert all(float(v) == 0.0 for v in out.metrics.values()) and set(out.metrics) == METRIC_KEYS


def test_masks_bad_arguments():
    std = torch.rand(2, 3)
    mask = torch.ones(2, 3, dtype=torch.bool)
    for name in ("advantage_mask_frac", "entropy_filter_frac"):
        for bad in (-0.1, 1.5, math.nan):
            with pytest.raises(ValueError, match=rf"^{name}: must be in"):
                disagreement_masks(std, mask, **{name: bad})
        for bad in ("0.2", None, True):
            with pytest.raises(ValueError, match=rf"^{name}:"):
                disagreement_masks(std, mask, **{name: bad})
    neg = std.clone()
    neg[1, 1] = -0.5
    with pytest.raises(ValueError, match=r"^std: must be >= 0"):
        disagreement_masks(neg, mask)
    nan = std.clone()
    nan[0, 2] = math.nan
    with pytest.raises(ValueError, match=r"^std: contains 1 NaN"):
        disagreement_masks(nan, mask)
    junk = std.clone()
    junk[0, 2], junk[1, 1] = math.nan, -0.5
    mask2 = torch.isfinite(junk) & (junk >= 0)
    disagreement_masks(junk, mask2)  # anything outside the mask is ignored
    with pytest.raises(ValueError, match=r"^mask: expected a torch.bool"):
        disagreement_masks(std, mask.float())
    with pytest.raises(ValueError, match=r"^mask: shape"):
        disagreement_masks(std, torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"^std: expected 2 dimensions"):
        disagreement_masks(std.reshape(-1), mask.reshape(-1))
    with pytest.raises(ValueError, match=r"^std: expected a floating-point"):
        disagreement_masks(std.long(), mask)
    with pytest.raises(TypeError):
        disagreement_masks(std, mask, 0.2)  # the fractions are keyword-only


# --------------------------------------------------------------------------- together


def test_asyppo_step_end_to_end():
    """The docs' recipe: shards, ensemble, GAE on the mean, masked advantages, filtered entropy."""
    torch.manual_seed(0)
    B, T, K = 8, 6, 2
    gid = torch.arange(B) // 4  # 2 prompts x 4 responses
    shards = critic_shards(gid, K)
    assert all(torch.equal((shards[gid == g] == 0).sum(), torch.tensor(2)) for g in range(2))
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[3, 4:] = False
    values = torch.randn(K, B, T)
    rewards = torch.zeros(B, T)
    rewards[torch.arange(B), mask.sum(1) - 1] = torch.randint(0, 2, (B,)).float()
    v_bar, sigma = ensemble_values(values, mask)
    adv, _ = gae_advantages(rewards, v_bar, mask, gamma=1.0, lam=0.95)
    adv_keep, ent_keep, metrics = disagreement_masks(sigma, mask)
    logprobs = (-torch.rand(B, T)).requires_grad_(True)
    pg = ppo_clip(logprobs, logprobs.detach(), adv * adv_keep, mask).loss
    ent = entropy_bonus(torch.rand(B, T, requires_grad=True), ent_keep, coef=0.01).loss
    loss = aggregate(pg + ent, mask, "token-mean")
    loss.backward()
    assert bool(torch.isfinite(logprobs.grad).all())
    assert bool((logprobs.grad[mask & ~adv_keep] == 0).all())  # masked tokens: no policy gradient
    n = int(mask.sum())
    assert math.isclose(float(metrics["advantage_masked_frac"]), (n // 5) / n, rel_tol=1e-6)


@given(
    data=st.data(), k=st.integers(1, 3), gamma=st.sampled_from([1.0, 0.99]), lam=st.sampled_from([1.0, 0.95])
)
def test_asyppo_advantages_is_the_composition(data, k, gamma, lam):
    b, t = data.draw(shapes(max_batch=5, max_len=8))
    mask = data.draw(masks(b, t, min_tokens=0))
    rewards = data.draw(float_tensors((b, t), min_value=-1, max_value=1, mask=mask, garbage_padding=True))
    values = torch.stack(
        [
            data.draw(float_tensors((b, t), min_value=-2, max_value=2, mask=mask, garbage_padding=True))
            for _ in range(k)
        ]
    )
    frac_a, frac_h = data.draw(_FRACS), data.draw(_FRACS)
    out = asyppo_advantages(
        rewards, values, mask, gamma=gamma, lam=lam, advantage_mask_frac=frac_a, entropy_filter_frac=frac_h
    )
    assert isinstance(out, AsyPPOAdvantages)
    mean, std = ensemble_values(values, mask)
    adv, ret = gae_advantages(rewards, mean, mask, gamma=gamma, lam=lam)
    keep_a, keep_h, metrics = disagreement_masks(
        std, mask, advantage_mask_frac=frac_a, entropy_filter_frac=frac_h
    )
    assert torch.equal(out.values, mean) and torch.equal(out.std, std)
    assert torch.equal(out.advantage_keep, keep_a) and torch.equal(out.entropy_keep, keep_h)
    assert torch.equal(out.advantages, torch.where(keep_a, adv, torch.zeros(())))
    assert torch.equal(out.returns, ret)  # the critics' targets are not masked
    assert out.metrics.keys() == metrics.keys()
    if k == 1 and frac_a < 1:  # one critic: plain GAE, nothing masked (all tokens tie)
        plain, _ = gae_advantages(
            rewards, torch.where(mask, values[0], torch.zeros(())), mask, gamma=gamma, lam=lam
        )
        assert torch.equal(out.advantages, plain)


def test_asyppo_advantages_bad_arguments():
    mask = torch.ones(2, 3, dtype=torch.bool)
    v = torch.zeros(2, 2, 3)
    with pytest.raises(ValueError, match=r"^token_rewards: shape"):
        asyppo_advantages(torch.zeros(2, 4), v, mask)
    with pytest.raises(ValueError, match=r"^token_rewards: expected a floating-point"):
        asyppo_advantages(torch.zeros(2, 3, dtype=torch.long), v, mask)
    with pytest.raises(ValueError, match=r"^values: expected 3 dimensions"):
        asyppo_advantages(torch.zeros(2, 3), torch.zeros(2, 3), mask)
    with pytest.raises(ValueError, match=r"^advantage_mask_frac: must be in"):
        asyppo_advantages(torch.zeros(2, 3), v, mask, advantage_mask_frac=2.0)
    with pytest.raises(ValueError, match=r"^lam: must be in"):
        asyppo_advantages(torch.zeros(2, 3), v, mask, lam=1.5)


def test_exported_from_the_package():
    assert rollkit.critics.critic_shards is critic_shards
    assert "critics" in dir(rollkit)
