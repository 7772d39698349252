"""The small pure helpers of the critic path: per-token rewards, explained variance, and the
per-turn rewards of a trajectory batch (property tests against direct computations)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rollkit.ops import explained_variance
from rollkit.rewards import token_level_rewards
from rollkit.trajectory import Turn, build_batch


@st.composite
def _masked_rows(draw):
    B, T = draw(st.integers(1, 5)), draw(st.integers(1, 6))
    mask = torch.tensor(
        draw(st.lists(st.lists(st.booleans(), min_size=T, max_size=T), min_size=B, max_size=B))
    )
    scores = torch.tensor(draw(st.lists(st.floats(-5, 5), min_size=B, max_size=B)), dtype=torch.float32)
    kl = torch.tensor(
        draw(st.lists(st.lists(st.floats(-1, 1), min_size=T, max_size=T), min_size=B, max_size=B))
    )
    return scores, mask, kl.float()


@given(_masked_rows(), st.floats(0, 2))
def test_token_level_rewards_matches_a_loop(data, coef):
    scores, mask, kl = data
    out = token_level_rewards(scores, mask, kl=kl, kl_coef=coef)
    for b in range(mask.shape[0]):
        valid = mask[b].nonzero().flatten().tolist()
        for t in range(mask.shape[1]):
            expect = 0.0
            if t in valid:
                expect = -coef * float(kl[b, t]) + (float(scores[b]) if t == valid[-1] else 0.0)
            assert float(out[b, t]) == pytest.approx(expect, abs=1e-5)
        # the row's sum is its score minus the KL penalty (the score is dropped with no valid token)
        total = (float(scores[b]) if valid else 0.0) - coef * float(kl[b][mask[b]].sum())
        assert float(out[b].sum()) == pytest.approx(total, abs=1e-4)


def test_token_level_rewards_rejects_bad_input():
    m = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="scores"):
        token_level_rewards(torch.ones(3), m)
    with pytest.raises(ValueError, match="kl: required"):
        token_level_rewards(torch.ones(2), m, kl_coef=0.1)
    with pytest.raises(ValueError, match="kl_coef"):
        token_level_rewards(torch.ones(2), m, kl=torch.zeros(2, 3), kl_coef=-1.0)
    with pytest.raises(ValueError, match="scores"):
        token_level_rewards(torch.tensor([1.0, float("nan")]), m)


@settings(deadline=None)
@given(st.integers(2, 40), st.integers(0, 10_000))
def test_explained_variance_matches_numpy(n, seed):
    g = torch.Generator().manual_seed(seed)
    target, pred = torch.randn(n, generator=g), torch.randn(n, generator=g)
    mask = torch.rand(n, generator=g) > 0.3
    got = explained_variance(pred, target, mask)
    t, p = target[mask].double().numpy(), pred[mask].double().numpy()
    if len(t) == 0 or np.var(t) == 0:
        assert torch.isnan(got)
    else:
        assert float(got) == pytest.approx(1 - np.var(t - p) / np.var(t), rel=1e-9, abs=1e-12)


def test_explained_variance_edges():
    m = torch.ones(3, dtype=torch.bool)
    t = torch.tensor([1.0, 2.0, 4.0])
    assert float(explained_variance(t, t, m)) == 1.0  # a perfect critic
    assert float(explained_variance(torch.full((3,), float(t.mean())), t, m)) == pytest.approx(0.0)
    assert torch.isnan(explained_variance(t, torch.ones(3), m))  # constant targets
    with pytest.raises(ValueError, match="pred"):
        explained_variance(torch.ones(2), t, m)


def test_turn_end_rewards_put_each_turn_reward_on_its_last_action_token():
    eps = [
        [Turn([1, 2], [3, 4], [-0.1, -0.2], reward=0.5), Turn([5], [6, 7, 8], [-0.1] * 3, reward=1.0)],
        [Turn([1], [9], [-0.3], reward=-0.1)],
    ]
    batch = build_batch(eps, [0, 1])
    r = batch.turn_end_rewards()
    mask, ids = batch.response_mask, batch.step_ids
    # row 0: action tokens of turn 0 then turn 1 (the obs token of turn 1 masked in between)
    ends0 = [
        t
        for t in range(mask.shape[1])
        if mask[0, t] and (t + 1 == mask.shape[1] or ids[0, t + 1] != ids[0, t] or not mask[0, t + 1])
    ]
    assert [float(r[0, t]) for t in ends0] == [0.5, 1.0]
    assert float(r[0].sum()) == pytest.approx(1.5) and float(r[1].sum()) == pytest.approx(-0.1)
    assert bool((r[~mask] == 0).all())
    assert torch.allclose(r.sum(-1), batch.rewards)
