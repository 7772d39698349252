"""Tests of rollkit.losses.policy: hand-computed numbers, then hypothesis properties.

Aggregation is done here with plain sums (``token_sum``) or a hand-written per-sequence mean
(``seq_mean_token_mean``), so these tests do not depend on ``rollkit.losses.aggregation``.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rollkit.losses.policy import (
    cispo,
    decoupled_ppo,
    gmpo,
    gpg,
    gspo,
    gspo_token,
    importance_weights,
    ppo_clip,
    raft_pp,
    sapo,
    tis,
    topr,
    vanilla_pg,
)
from rollkit.registry import POLICY_LOSSES
from rollkit.testing import batches

E = math.e


def token_sum(loss: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (loss * mask).sum()


def seq_mean_token_mean(loss: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    n = mask.sum(-1)
    rows = n > 0
    per_row = (loss * mask).sum(-1) / n.clamp(min=1)
    return per_row[rows].sum() / rows.sum().clamp(min=1)


def grad_of(fn, lp, *args, agg=token_sum, **kw):
    lp = lp.detach().clone().requires_grad_(True)
    out = fn(lp, *args, **kw)
    agg(out.loss, args[2]).backward()
    return out, lp.grad


def row(*xs):
    return torch.tensor([list(xs)])


ALL_MASK = torch.ones(1, 4, dtype=torch.bool)


# --------------------------------------------------------------------------- hand-computed


def test_ppo_clip_hand_numbers():
    lp = row(-1.0, -1.0, -1.0, -1.0)
    old = row(-1.0, -1.5, -0.5, -1.1)  # r = [1, e^.5, e^-.5, e^.1]
    adv = row(1.0, 1.0, -1.0, -1.0)
    out, g = grad_of(ppo_clip, lp, old, adv, ALL_MASK)
    r3 = math.exp(0.1)
    assert torch.allclose(out.loss, row(-1.0, -1.2, 0.8, r3))
    assert torch.allclose(g, row(-1.0, 0.0, 0.0, r3))
    m = out.metrics
    assert torch.allclose(m["clip_frac"], torch.tensor(0.5))
    assert torch.allclose(m["clip_frac_low"], torch.tensor(0.25))
    assert torch.allclose(m["clip_frac_high"], torch.tensor(0.25))
    r = torch.tensor([1.0, math.exp(0.5), math.exp(-0.5), r3])
    assert torch.allclose(m["ratio_mean"], r.mean())
    assert torch.allclose(m["ratio_max"], r.max())
    assert torch.allclose(m["ratio_min"], r.min())
    assert torch.allclose(m["approx_kl"], (r - 1 - r.log()).mean())
    assert all(v.ndim == 0 and not v.requires_grad for v in m.values())


def test_ppo_clip_higher_dual_clip_and_clamp():
    # clip-higher: r = 1.25 is inside [0.8, 1.28] -> gradient -A r
    lp, old = row(math.log(1.25)), row(0.0)
    m1 = torch.ones(1, 1, dtype=torch.bool)
    _, g = grad_of(ppo_clip, lp, old, torch.tensor([1.0]), m1, clip_high=0.28)
    assert torch.allclose(g, torch.tensor([[-1.25]]))
    _, g = grad_of(ppo_clip, lp, old, torch.tensor([1.0]), m1)  # symmetric 0.2: clipped
    assert torch.allclose(g, torch.zeros(1, 1))
    # dual clip: A = -3, r = 5, c = 3 -> loss min(max(15, 3.6), 9) = 9, no gradient
    lp = row(math.log(5.0))
    out, g = grad_of(ppo_clip, lp, old, torch.tensor([-3.0]), m1, dual_clip=3.0)
    assert torch.allclose(out.loss, torch.tensor([[9.0]]))
    assert torch.allclose(g, torch.zeros(1, 1))
    assert torch.allclose(out.metrics["dual_clip_frac"], torch.tensor(1.0))
    out, g = grad_of(ppo_clip, lp, old, torch.tensor([-3.0]), m1)
    assert torch.allclose(out.loss, torch.tensor([[15.0]]))
    assert torch.allclose(g, torch.tensor([[15.0]]), rtol=1e-5)
    # log-ratio clamp: log r = 30 is clamped to 20 before exp; A < 0 -> loss = e^20
    out = ppo_clip(row(0.0), row(-30.0), torch.tensor([-1.0]), m1)
    assert torch.allclose(out.loss, torch.tensor([[math.exp(20.0)]]))
    out = ppo_clip(row(0.0), row(-30.0), torch.tensor([-1.0]), m1, log_ratio_clamp=None)
    assert torch.allclose(out.loss, torch.tensor([[math.exp(30.0)]]), rtol=1e-4)


def test_ppo_clip_is_weights_scale_loss_and_gradient():
    lp = row(-1.0, -2.0)
    m = torch.ones(1, 2, dtype=torch.bool)
    w = row(0.5, 2.0)
    out, g = grad_of(ppo_clip, lp, lp, torch.tensor([1.0]), m, is_weights=w)
    assert torch.allclose(out.loss, row(-0.5, -2.0))
    assert torch.allclose(g, row(-0.5, -2.0))


def test_gspo_hand_numbers():
    lp = torch.tensor([[-1.0, -1.0], [-1.0, -1.0]])
    old = torch.tensor([[-1.2, -1.4], [-1.0, 0.0]])  # row 0: log s = 0.3; row 1: 1 token, s = 1
    m = torch.tensor([[True, True], [True, False]])
    adv = torch.tensor([1.0, -2.0])
    s = math.exp(0.3)
    out, g = grad_of(gspo, lp, old, adv, m, agg=seq_mean_token_mean, clip_low=0.5, clip_high=0.5)
    assert torch.allclose(out.loss, torch.tensor([[-s, -s], [2.0, 0.0]]))
    # d/dlp of (1/2) * (L_0 + L_1): row 0 -> -s / 2 / 2 per token, row 1 -> -A / 2 = 1
    assert torch.allclose(g, torch.tensor([[-s / 4, -s / 4], [1.0, 0.0]]))
    # paper's default ranges clip row 0: the whole sequence passes no gradient
    out, g = grad_of(gspo, lp, old, adv, m, agg=seq_mean_token_mean)
    assert torch.allclose(out.loss[0], torch.full((2,), -(1 + 4e-4)))
    assert torch.allclose(g[0], torch.zeros(2))
    assert torch.allclose(out.metrics["clip_frac"], torch.tensor(2 / 3))
    assert torch.allclose(out.metrics["seq_ratio_max"], torch.tensor(s))


def test_gspo_token_hand_numbers():
    lp = row(-1.0, -1.0)
    old = row(-1.2, -1.4)
    m = torch.ones(1, 2, dtype=torch.bool)
    s = math.exp(0.3)
    out, g = grad_of(gspo_token, lp, old, row(1.0, 3.0), m, clip_low=0.5, clip_high=0.5)
    assert torch.allclose(out.loss, row(-s, -3 * s))
    assert torch.allclose(g, row(-s, -3 * s))


def test_gmpo_hand_numbers():
    m = torch.ones(1, 2, dtype=torch.bool)
    lp, old = row(-1.0, -1.0), row(-1.0, -2.0)  # log r = [0, 1]
    out, g = grad_of(gmpo, lp, old, torch.tensor([1.0]), m, agg=seq_mean_token_mean)
    rho = math.exp(0.2)  # token 1 clipped to 0.4 in log space
    assert torch.allclose(out.loss, row(-rho, -rho))
    assert torch.allclose(g, row(-rho / 2, 0.0))
    assert torch.allclose(out.metrics["clip_frac_high"], torch.tensor(0.5))
    # A < 0: log r = 1 is on the pessimistic side (kept, not clipped)
    out, g = grad_of(gmpo, lp, old, torch.tensor([-1.0]), m, agg=seq_mean_token_mean)
    rho = math.exp(0.5)
    assert torch.allclose(out.loss, row(rho, rho))
    assert torch.allclose(g, row(rho / 2, rho / 2))
    # A < 0 with log r = -1: clipped up to -0.4
    out, g = grad_of(gmpo, lp, row(-1.0, 0.0), torch.tensor([-1.0]), m, agg=seq_mean_token_mean)
    rho = math.exp(-0.2)
    assert torch.allclose(out.loss, row(rho, rho))
    assert torch.allclose(g, row(rho / 2, 0.0))


def test_cispo_hand_numbers():
    lp = row(-1.0, -1.0, -1.0, -1.0)
    old = row(-1.0, -2.0, 0.0, -1.5)  # r = [1, e, 1/e, e^.5]
    adv = row(1.0, 1.0, -1.0, 2.0)
    out, g = grad_of(cispo, lp, old, adv, ALL_MASK, clip_low=0.2, clip_high=0.28)
    w = torch.tensor([1.0, 1.28, 0.8, 1.28])
    assert torch.allclose(g, -(w * adv))
    assert torch.allclose(out.loss, -(w * adv) * lp)
    assert torch.allclose(out.metrics["clip_frac"], torch.tensor(0.75))
    assert torch.allclose(out.metrics["clip_frac_low"], torch.tensor(0.25))
    # no lower bound by default: weight 1/e
    _, g = grad_of(cispo, lp, old, adv, ALL_MASK)
    assert torch.allclose(g[0, 2], torch.tensor(1 / E))


def test_topr_hand_numbers():
    lp = torch.tensor([[-1.0, -1.0], [-1.0, -1.0], [-1.0, -1.0]])
    old = torch.tensor([[-3.0, -3.0], [-0.5, -1.0], [-1.5, -1.5]])
    m = torch.ones(3, 2, dtype=torch.bool)
    adv = torch.tensor([2.0, -1.0, -1.0])  # row 1: log rho = -0.5; row 2: log rho = +1 -> 1
    out, g = grad_of(topr, lp, old, adv, m)
    w1 = math.exp(-0.5)
    assert torch.allclose(g, torch.tensor([[-2.0, -2.0], [w1, w1], [1.0, 1.0]]))
    assert torch.allclose(out.loss, torch.tensor([[2.0, 2.0], [-w1, -w1], [-1.0, -1.0]]))  # -w A log pi
    assert torch.allclose(out.metrics["positive_frac"], torch.tensor(1 / 3))
    assert torch.allclose(out.metrics["truncated_frac"], torch.tensor(1 / 3))
    assert torch.allclose(out.metrics["is_weight_mean"], torch.tensor((w1 + 1) / 2))
    # separate weights
    _, g = grad_of(topr, lp, old, adv, m, positive_weight=0.5, negative_weight=2.0)
    assert torch.allclose(g, torch.tensor([[-1.0, -1.0], [2 * w1, 2 * w1], [2.0, 2.0]]))
    # token level: row 1 weights are [e^-.5, 1]
    _, g = grad_of(topr, lp, old, adv, m, level="token")
    assert torch.allclose(g[1], torch.tensor([w1, 1.0]))


def test_importance_weights_hand_numbers():
    old = torch.tensor([[-1.0, -1.0, -2.0], [-1.0, -1.0, 0.0]])
    beh = torch.tensor([[-2.0, -1.0, -1.0], [-3.0, -1.0, 0.0]])  # log w = [1,0,-1], [2,0,-]
    m = torch.tensor([[True, True, True], [True, True, False]])
    w, met = importance_weights(old, beh, m)
    assert torch.allclose(w, torch.tensor([[2.0, 1.0, 1 / E], [2.0, 1.0, 0.0]]))  # cap 2
    assert torch.allclose(met["truncated_frac"], torch.tensor(2 / 5))
    assert torch.allclose(met["is_weight_mean"], torch.tensor((2 + 1 + 1 / E + 2 + 1) / 5))
    w, met = importance_weights(old, beh, m, mode="mask", lower=0.5)
    assert torch.allclose(w, torch.tensor([[0.0, 1.0, 0.0], [0.0, 1.0, 0.0]]))
    assert torch.allclose(met["masked_frac"], torch.tensor(3 / 5))
    w, _ = importance_weights(old, beh, m, level="sequence", cap=None)
    assert torch.allclose(w, torch.tensor([[1.0, 1.0, 1.0], [E**2, E**2, 0.0]]))
    w, _ = importance_weights(old, beh, m, level="geometric", cap=None)
    assert torch.allclose(w, torch.tensor([[1.0, 1.0, 1.0], [E, E, 0.0]]))
    w, _ = importance_weights(old, beh, m, lower=0.5, cap=None)
    assert torch.allclose(w[0], torch.tensor([E, 1.0, 0.5]))
    # huge sequence log-weights never overflow
    w, _ = importance_weights(
        torch.zeros(1, 3), torch.full((1, 3), -60.0), torch.ones(1, 3, dtype=torch.bool), level="sequence"
    )
    assert torch.equal(w, torch.full((1, 3), 2.0))


def test_tis_hand_numbers():
    lp = row(-1.0, -1.0)
    beh = row(-3.0, -1.0)
    m = torch.ones(1, 2, dtype=torch.bool)
    out, g = grad_of(tis, lp, lp, torch.tensor([1.0]), m, beh)
    assert torch.allclose(g, row(-2.0, -1.0))
    assert torch.allclose(out.loss, row(-2.0, -1.0))
    assert torch.allclose(out.metrics["truncated_frac"], torch.tensor(0.5))
    # mask mode: w = [e (> cap: dropped), 1/e]; the ratio r = e against old is not clipped
    out, g = grad_of(tis, lp, row(-2.0, -2.0), torch.tensor([1.0]), m, beh, mode="mask")
    assert torch.allclose(g, row(0.0, -1.0))
    assert torch.allclose(out.metrics["masked_frac"], torch.tensor(0.5))


def test_decoupled_ppo_hand_numbers():
    lp = row(-1.0, -1.0)
    beh = row(-1.0, -2.0)
    m = torch.ones(1, 2, dtype=torch.bool)
    old = row(-1.0, -1.5)  # r = [1, e^.5] (2nd clipped), w = [1, e^.5]
    out, g = grad_of(decoupled_ppo, lp, old, torch.tensor([1.0]), m, beh)
    assert torch.allclose(out.loss, row(-1.0, -1.2 * math.exp(0.5)))
    assert torch.allclose(g, row(-1.0, 0.0))
    out = decoupled_ppo(lp, old, torch.tensor([1.0]), m, beh, behavior_cap=1.5)
    assert torch.allclose(out.loss, row(-1.0, -1.2 * 1.5))
    out = decoupled_ppo(lp, old, torch.tensor([1.0]), m, beh, behavior_cap=1.5, behavior_mode="mask")
    assert torch.allclose(out.loss, row(-1.0, 0.0))
    assert torch.allclose(out.metrics["masked_frac"], torch.tensor(0.5))


def test_raft_pp_hand_numbers():
    lp = torch.tensor([[-1.0, -1.0], [-1.0, -1.0]])
    old = torch.tensor([[-1.0, -2.0], [-1.0, -1.0]])  # row 0: r = [1, e] (2nd clipped)
    m = torch.ones(2, 2, dtype=torch.bool)
    out, g = grad_of(raft_pp, lp, old, torch.tensor([0.5, -0.5]), m)
    assert torch.allclose(out.loss, torch.tensor([[-1.0, -1.2], [0.0, 0.0]]))
    assert torch.allclose(g, torch.tensor([[-1.0, 0.0], [0.0, 0.0]]))
    assert torch.allclose(out.metrics["accepted_frac"], torch.tensor(0.5))
    assert torch.allclose(out.metrics["clip_frac"], torch.tensor(0.25))


def test_vanilla_pg_and_gpg_hand_numbers():
    lp = row(-1.0, -2.0, -3.0)
    m = torch.tensor([[True, True, False]])
    out, g = grad_of(vanilla_pg, lp, lp - 1.0, torch.tensor([2.0]), m)
    assert torch.allclose(out.loss, row(2.0, 4.0, 0.0))
    assert torch.allclose(g, row(-2.0, -2.0, 0.0))
    assert out.metrics == {}
    out, g = grad_of(gpg, lp, lp, torch.tensor([2.0]), m, alpha=1.5)
    assert torch.allclose(out.loss, row(3.0, 6.0, 0.0))
    assert torch.allclose(g, row(-3.0, -3.0, 0.0))


def test_sapo_hand_numbers():
    lp, old = row(-1.0, -1.0), row(-1.5, -1.5)  # r = e^.5
    m = torch.ones(1, 2, dtype=torch.bool)
    r = math.exp(0.5)
    out, g = grad_of(sapo, lp, old, row(1.0, -1.0), m)
    sp = 1 / (1 + math.exp(-(r - 1)))  # tau = 1
    sn = 1 / (1 + math.exp(-1.05 * (r - 1)))  # tau = 1.05
    assert torch.allclose(out.loss, row(-4 * sp, 4 / 1.05 * sn))
    assert torch.allclose(g, row(-4 * sp * (1 - sp) * r, 4 * sn * (1 - sn) * r))
    assert torch.allclose(out.metrics["gate_mean"], torch.tensor((4 * sp * (1 - sp) + 4 * sn * (1 - sn)) / 2))


@pytest.mark.parametrize("shape", [(2, 3), (0, 3), (2, 0)])
def test_empty_mask_metrics_are_documented_values(shape):
    z = torch.zeros(shape)
    m = torch.zeros(shape, dtype=torch.bool)
    for name, fn, extra in _LOSSES:
        out = fn(z, z, torch.ones(shape[0]), m, *([z] if extra else []))
        assert torch.equal(out.loss, torch.zeros(shape)), name
        for k, v in out.metrics.items():
            want = 1.0 if k.startswith(("ratio_", "seq_ratio_")) else 0.0
            assert float(v) == want, (name, k, float(v))


# --------------------------------------------------------------------------- properties
# Half the profile's examples (30 by default: drawing batches dominates the run time);
# HYPOTHESIS_PROFILE=thorough scales this up to 500.
_PROPS = settings(max_examples=max(10, settings.default.max_examples // 2))

# (name, fn, needs behavior_logprobs)
_LOSSES = [
    ("ppo", ppo_clip, False),
    ("ppo-dual", lambda *a, **k: ppo_clip(*a, dual_clip=3.0, **k), False),
    ("gspo", gspo, False),
    ("gspo-token", gspo_token, False),
    ("gmpo", gmpo, False),
    ("cispo", cispo, False),
    ("topr", topr, False),
    ("topr-token", lambda *a, **k: topr(*a, level="token", **k), False),
    ("tis", tis, True),
    ("tis-seq-mask", lambda *a, **k: tis(*a, level="sequence", mode="mask", **k), True),
    ("decoupled-ppo", decoupled_ppo, True),
    ("raft++", raft_pp, False),
    ("vanilla-pg", vanilla_pg, False),
    ("gpg", gpg, False),
    ("sapo", sapo, False),
]
_SEQUENCE_LOSSES = {"gspo", "gspo-token", "gmpo"}


def _call(fn, extra, lp, b, **kw):
    args = [b["old_logprobs"], b["advantages"], b["response_mask"]]
    if extra:
        args.append(b["behavior_logprobs"])
    return fn(lp, *args, **kw)


@_PROPS
@given(batches())
def test_gradient_at_ratio_one_is_vanilla_policy_gradient(b):
    mask, adv = b["response_mask"], b["advantages"]
    lp0 = b["logprobs"]
    b = {**b, "old_logprobs": lp0.clone(), "behavior_logprobs": lp0.clone()}
    expect_tok = -adv * mask
    n = mask.sum(-1, keepdim=True)
    n_rows = (n > 0).sum().clamp(min=1)
    expect_seq = expect_tok / n.clamp(min=1) / n_rows
    for name, fn, extra in _LOSSES:
        if name == "raft++":
            continue  # weight 1 on accepted samples, not A: tested below
        lp = lp0.clone().requires_grad_(True)
        out = _call(fn, extra, lp, b)
        if name in _SEQUENCE_LOSSES:
            seq_mean_token_mean(out.loss, mask).backward()
            assert torch.allclose(lp.grad, expect_seq, atol=1e-6, rtol=1e-5), name
        else:
            token_sum(out.loss, mask).backward()
            assert torch.allclose(lp.grad, expect_tok, atol=1e-6, rtol=1e-5), name
    lp = lp0.clone().requires_grad_(True)
    token_sum(raft_pp(lp, lp0, adv, mask).loss, mask).backward()
    assert torch.allclose(lp.grad, -((adv > 0) & mask).float())


@_PROPS
@given(batches(), st.floats(0.05, 3.0))
def test_cispo_keeps_gradient_where_ppo_clips(b, excess):
    mask, adv = b["response_mask"], b["advantages"]
    lp0 = b["logprobs"]
    old = lp0 - math.log(1.2) - excess  # r > 1 + clip_high everywhere
    _, g_ppo = grad_of(ppo_clip, lp0, old, adv, mask)
    _, g_cispo = grad_of(cispo, lp0, old, adv, mask, clip_high=0.2)
    pos = mask & (adv > 0)
    assert torch.all(g_ppo[pos] == 0)
    assert torch.allclose(g_cispo[pos], -1.2 * adv[pos])
    assert torch.all(g_cispo[pos] != 0)


@_PROPS
@given(batches(max_len=1))
def test_gspo_on_single_token_responses_equals_ppo(b):
    mask, adv = b["response_mask"], b["advantages"]
    lp0, old = b["logprobs"], b["old_logprobs"]
    for clip in (0.2, 3e-4):
        out_g, g_g = grad_of(gspo, lp0, old, adv, mask, clip_low=clip, clip_high=clip)
        out_p, g_p = grad_of(ppo_clip, lp0, old, adv, mask, clip_low=clip, clip_high=clip)
        assert torch.allclose(out_g.loss, out_p.loss, rtol=1e-5, atol=1e-6)
        assert torch.allclose(g_g, g_p, rtol=1e-5, atol=1e-6)
        out_t = gspo_token(lp0, old, adv, mask, clip_low=clip, clip_high=clip)
        assert torch.allclose(out_t.loss, out_p.loss, rtol=1e-5, atol=1e-6)


@_PROPS
@given(batches())
def test_gspo_token_gradient_equals_gspo_with_sequence_advantages(b):
    mask, adv = b["response_mask"], b["advantages"]
    lp0, old = b["logprobs"], b["old_logprobs"]
    kw = {"clip_low": 0.3, "clip_high": 0.3}
    _, g1 = grad_of(gspo, lp0, old, adv, mask, agg=seq_mean_token_mean, **kw)
    _, g2 = grad_of(gspo_token, lp0, old, adv, mask, agg=seq_mean_token_mean, **kw)
    assert torch.allclose(g1, g2, rtol=1e-5, atol=1e-6)


@_PROPS
@given(batches())
def test_dual_clip_never_changes_positive_advantages(b):
    mask = b["response_mask"]
    adv = b["advantages"].abs()
    for a in (adv, b["advantages"]):
        plain = ppo_clip(b["logprobs"], b["old_logprobs"], a, mask).loss
        dual = ppo_clip(b["logprobs"], b["old_logprobs"], a, mask, dual_clip=1.5).loss
        keep = a >= 0
        assert torch.equal(plain[keep], dual[keep])
        assert torch.all(dual <= plain)


@_PROPS
@given(batches(max_log_ratio=60.0, extreme=True))
def test_finite_and_zero_outside_mask_for_any_finite_input(b):
    mask = b["response_mask"]
    # padding may hold anything, -inf included: it must never reach the loss or the gradient
    neg_inf = torch.full_like(b["logprobs"], float("-inf"))
    b = {
        **b,
        "old_logprobs": torch.where(mask, b["old_logprobs"], neg_inf),
        "behavior_logprobs": torch.where(mask, b["behavior_logprobs"], neg_inf),
    }
    lp0 = torch.where(mask, b["logprobs"], neg_inf)
    for name, fn, extra in _LOSSES:
        lp = lp0.clone().requires_grad_(True)
        out = _call(fn, extra, lp, b)
        assert torch.isfinite(out.loss).all(), name
        assert torch.all(out.loss[~mask] == 0), name
        out.loss.sum().backward()
        assert torch.isfinite(lp.grad).all(), name
        assert torch.all(lp.grad[~mask] == 0), name
        for k, v in out.metrics.items():
            assert v.ndim == 0 and torch.isfinite(v), (name, k)


_JUNK = st.floats(-5.0, 5.0) | st.sampled_from([math.nan, math.inf, -math.inf])


def _check_values_outside_the_mask_are_ignored(b, junk):
    mask = b["response_mask"]
    base = {k: v for k, v in b.items()}
    moved = dict(b)
    for k in ("old_logprobs", "behavior_logprobs", "advantages"):
        moved[k] = torch.where(mask, b[k], torch.full_like(b[k], junk))
    lp_moved = torch.where(mask, b["logprobs"], torch.full_like(b["logprobs"], junk))
    for name, fn, extra in _LOSSES:
        lp_a = b["logprobs"].clone().requires_grad_(True)
        lp_c = lp_moved.clone().requires_grad_(True)
        a = _call(fn, extra, lp_a, base)
        c = _call(fn, extra, lp_c, moved)
        assert torch.equal(a.loss, c.loss), name
        for k in a.metrics:
            assert torch.allclose(a.metrics[k], c.metrics[k], rtol=1e-6, atol=1e-7), (name, k)
        a.loss.sum().backward()
        c.loss.sum().backward()
        assert torch.isfinite(lp_c.grad).all(), (name, junk, lp_c.grad)
        assert torch.all(lp_c.grad[~mask] == 0), name
        assert torch.allclose(lp_a.grad, lp_c.grad, rtol=1e-6, atol=1e-7), name


@_PROPS
@given(batches(), _JUNK)
def test_values_outside_the_mask_are_ignored(b, junk):
    """Any value (NaN / inf included) under the mask, in every input, reaches neither the
    loss, nor the metrics, nor the gradient of ``logprobs``."""
    _check_values_outside_the_mask_are_ignored(b, junk)


@pytest.mark.parametrize("junk", [math.nan, math.inf, -math.inf])
def test_nan_and_inf_outside_the_mask_never_reach_the_gradient(junk):
    g = torch.Generator().manual_seed(0)
    B, T = 4, 6
    mask = torch.rand(B, T, generator=g) < 0.6
    mask[0] = False  # an empty row
    mask[1, 0] = True
    lp = -torch.rand(B, T, generator=g) * 3
    near = lambda: (lp + 0.5 * torch.randn(B, T, generator=g)).clamp(max=0.0)  # noqa: E731
    b = {
        "response_mask": mask,
        "logprobs": lp,
        "old_logprobs": near(),
        "behavior_logprobs": near(),
        "advantages": torch.where(mask, torch.randn(B, 1, generator=g).expand(B, T), torch.zeros(())),
    }
    _check_values_outside_the_mask_are_ignored(b, junk)


@_PROPS
@given(batches())
def test_bf16_inputs_match_fp32_within_stated_tolerance(b):
    """Inputs are upcast: bf16 in == fp32 on the same rounded values (1e-6 relative)."""
    bf = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v) for k, v in b.items()}
    f32 = {k: (v.float() if v.is_floating_point() else v) for k, v in bf.items()}
    for name, fn, extra in _LOSSES:
        lp_b = bf["logprobs"].clone().requires_grad_(True)
        lp_f = f32["logprobs"].clone().requires_grad_(True)
        ob, of = _call(fn, extra, lp_b, bf), _call(fn, extra, lp_f, f32)
        assert ob.loss.dtype == torch.float32, name
        assert torch.allclose(ob.loss, of.loss, rtol=1e-6, atol=1e-6), name
        ob.loss.sum().backward()
        of.loss.sum().backward()
        assert lp_b.grad.dtype == torch.bfloat16
        # the gradient w.r.t. a bf16 leaf is rounded to bf16 (relative 2^-8)
        assert torch.allclose(lp_b.grad.float(), lp_f.grad, rtol=2**-7, atol=1e-6), name


@_PROPS
@given(batches(), st.sampled_from(["token", "sequence", "geometric"]), st.sampled_from(["truncate", "mask"]))
def test_importance_weights_bounds(b, level, mode):
    mask = b["response_mask"]
    w, met = importance_weights(
        b["old_logprobs"], b["behavior_logprobs"], mask, level=level, mode=mode, cap=2.0, lower=0.5
    )
    assert not w.requires_grad
    assert torch.all(w[~mask] == 0)
    valid = w[mask]
    if mode == "truncate":
        assert torch.all((valid >= 0.5 * (1 - 1e-6)) & (valid <= 2.0 * (1 + 1e-6)))
    else:
        assert torch.all((valid == 0) | ((valid >= 0.5 * (1 - 1e-6)) & (valid <= 2.0 * (1 + 1e-6))))
    if level != "token":
        first = w.gather(1, torch.zeros(w.shape[0], 1, dtype=torch.long))
        assert torch.all(torch.where(mask, w == first, True))
    assert all(torch.isfinite(v) for v in met.values())


@_PROPS
@given(batches())
def test_decoupled_ppo_with_behavior_equal_old_is_ppo(b):
    same = {**b, "behavior_logprobs": b["old_logprobs"]}
    a = _call(decoupled_ppo, True, b["logprobs"], same)
    c = ppo_clip(b["logprobs"], b["old_logprobs"], b["advantages"], b["response_mask"])
    assert torch.allclose(a.loss, c.loss)


@_PROPS
@given(batches())
def test_ppo_gradient_vanishes_exactly_on_clipped_tokens(b):
    mask, adv = b["response_mask"], b["advantages"]
    out, g = grad_of(ppo_clip, b["logprobs"], b["old_logprobs"], adv, mask)
    r = (b["logprobs"] - b["old_logprobs"]).exp()
    clipped = mask & (((adv > 0) & (r > 1.2)) | ((adv < 0) & (r < 0.8)))
    assert torch.all(g[clipped] == 0)
    live = mask & ~clipped & (adv != 0)
    assert torch.allclose(g[live], -adv[live] * r[live], rtol=1e-5)
    n = mask.sum().clamp(min=1)
    assert torch.allclose(out.metrics["clip_frac"], clipped.sum() / n)


# --------------------------------------------------------------------------- validation / registry


def _good():
    lp = torch.zeros(2, 3)
    return lp, lp.clone(), torch.ones(2), torch.ones(2, 3, dtype=torch.bool)


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"clip_low": -0.1}, "clip_low"),
        ({"clip_low": 1.5}, "clip_low"),
        ({"clip_high": -0.1}, "clip_high"),
        ({"dual_clip": 1.0}, "dual_clip"),
        ({"log_ratio_clamp": 0.0}, "log_ratio_clamp"),
        ({"is_weights": torch.ones(2, 2)}, "is_weights"),
    ],
)
def test_ppo_rejects_bad_hyper_parameters(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        ppo_clip(*_good(), **kwargs)


@pytest.mark.parametrize("name", [n for n, _, _ in _LOSSES])
def test_bad_tensors_raise_value_error_naming_the_argument(name):
    fn, extra = {n: (f, e) for n, f, e in _LOSSES}[name]
    lp, old, adv, mask = _good()
    tail = [old.clone()] if extra else []
    with pytest.raises(ValueError, match="mask"):
        fn(lp, old, adv, mask.float(), *tail)
    with pytest.raises(ValueError, match="old_logprobs"):
        fn(lp, old[:, :2], adv, mask, *tail)
    with pytest.raises(ValueError, match="advantages"):
        fn(lp, old, torch.ones(3), mask, *tail)
    with pytest.raises(ValueError, match="logprobs"):
        fn(lp.long(), old, adv, mask, *tail)
    if extra:
        with pytest.raises(ValueError, match="behavior_logprobs"):
            fn(lp, old, adv, mask, old[:1])


def test_other_hyper_parameter_checks():
    lp, old, adv, mask = _good()
    with pytest.raises(ValueError, match="level"):
        importance_weights(lp, old, mask, level="seq")
    with pytest.raises(ValueError, match="mode"):
        importance_weights(lp, old, mask, mode="clip")
    with pytest.raises(ValueError, match="cap"):
        importance_weights(lp, old, mask, cap=0.0)
    with pytest.raises(ValueError, match="lower"):
        importance_weights(lp, old, mask, cap=2.0, lower=3.0)
    with pytest.raises(ValueError, match="tau_neg"):
        sapo(lp, old, adv, mask, tau_neg=0.0)
    with pytest.raises(ValueError, match="negative_weight"):
        topr(lp, old, adv, mask, negative_weight=-1.0)
    with pytest.raises(ValueError, match="level"):
        topr(lp, old, adv, mask, level="geometric")
    with pytest.raises(ValueError, match="behavior_mode"):
        decoupled_ppo(lp, old, adv, mask, old, behavior_mode="veto")
    with pytest.raises(ValueError, match="alpha"):
        gpg(lp, old, adv, mask, alpha=0.0)
    with pytest.raises(ValueError, match="clip_low"):
        gmpo(lp, old, adv, mask, clip_low=-1.0)


def test_inputs_are_not_mutated_and_old_logprobs_get_no_gradient():
    lp = torch.randn(3, 4, generator=torch.Generator().manual_seed(0)).clamp(max=0)
    old = (lp - 0.3).requires_grad_(True)
    adv = torch.tensor([1.0, -1.0, 0.5])
    mask = torch.ones(3, 4, dtype=torch.bool)
    snap = (lp.clone(), old.detach().clone(), adv.clone(), mask.clone())
    for name, fn, extra in _LOSSES:
        x = lp.clone().requires_grad_(True)
        out = fn(x, old, adv, mask, *([old] if extra else []))
        out.loss.sum().backward()
        assert old.grad is None, name
    assert torch.equal(lp, snap[0]) and torch.equal(old.detach(), snap[1])
    assert torch.equal(adv, snap[2]) and torch.equal(mask, snap[3])


def test_registry_entries():
    expected = {
        "ppo": ppo_clip,
        "gspo": gspo,
        "gspo-token": gspo_token,
        "topr": topr,
        "cispo": cispo,
        "tis": tis,
        "decoupled-ppo": decoupled_ppo,
        "raft++": raft_pp,
        "gpg": gpg,
        "vanilla-pg": vanilla_pg,
        "reinforce": vanilla_pg,
        "sapo": sapo,
        "gmpo": gmpo,
    }
    for name, fn in expected.items():
        assert POLICY_LOSSES.get(name) is fn, name
        entry = POLICY_LOSSES.entry(name)
        assert entry.in_keys["logprobs"] == "logprobs"
        assert entry.in_keys["mask"] == "response_mask"
        assert entry.out_keys == ("loss",)
    assert POLICY_LOSSES.entry("tis").in_keys["behavior_logprobs"] == "behavior_logprobs"
    assert "behavior_logprobs" not in POLICY_LOSSES.entry("ppo").in_keys


def test_float64_stays_float64_and_advantages_get_no_gradient():
    lp = torch.tensor([[-1.0, -2.0]], dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([1.0], dtype=torch.float64, requires_grad=True)
    m = torch.ones(1, 2, dtype=torch.bool)
    for name, fn, extra in _LOSSES:
        out = fn(lp, lp.detach() - 0.1, adv, m, *([lp.detach()] if extra else []))
        assert out.loss.dtype == torch.float64, name
        out.loss.sum().backward()
        assert adv.grad is None, name


def test_registered_losses_run_on_a_tensordict():
    pytest.importorskip("tensordict")
    from tensordict import TensorDict

    from rollkit.td import td_module

    lp = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.2, -4.0]])
    batch = TensorDict(
        {
            "logprobs": lp,
            "old_logprobs": lp - 0.1,
            "behavior_logprobs": lp - 0.2,
            "advantages": torch.tensor([[1.0, 1.0, 0.0], [-1.0, -1.0, -1.0]]),
            "response_mask": torch.tensor([[True, True, False], [True, True, True]]),
        },
        batch_size=[2],
    )
    for name in POLICY_LOSSES.names():
        out = td_module(name, registry="policy_loss")(batch.clone())
        fn = POLICY_LOSSES.get(name)
        keys = POLICY_LOSSES.entry(name).in_keys
        # optional keyword tensors (ppo's is_weights) whose key is absent get their default
        direct = fn(**{arg: batch[key] for arg, key in keys.items() if key in batch})
        assert torch.equal(out["loss"], direct.loss), name


# --------------------------------------------------------------------------- review fixes


def _registered_policy_losses():
    """Every registered policy loss (default hyper-parameters), plus topr at token level."""
    out = []
    for name in POLICY_LOSSES.names():
        entry = POLICY_LOSSES.entry(name)
        out.append((name, entry.fn, "behavior_logprobs" in entry.in_keys))
    out.append(("topr-token", lambda *a, **k: topr(*a, level="token", **k), False))
    return out


@_PROPS
@given(batches(allow_empty_rows=True))
def test_sequence_and_broadcast_token_advantages_give_identical_results(b):
    """``[B]`` advantages and the same values broadcast to ``[B, T]`` are the same input."""
    mask = b["response_mask"]
    B, T = mask.shape
    adv_seq = b["advantages"].sum(-1) / mask.sum(-1).clamp(min=1)  # constant per row
    b_seq = {**b, "advantages": adv_seq}
    b_tok = {**b, "advantages": adv_seq[:, None].expand(B, T).contiguous()}
    for name, fn, extra in _registered_policy_losses():
        s, t = _call(fn, extra, b["logprobs"], b_seq), _call(fn, extra, b["logprobs"], b_tok)
        assert torch.allclose(s.loss, t.loss, rtol=1e-5, atol=1e-6), name
        assert s.metrics.keys() == t.metrics.keys(), name
        for k in s.metrics:
            assert torch.allclose(s.metrics[k], t.metrics[k], rtol=1e-5, atol=1e-6), (name, k)


def test_topr_token_level_metrics_with_sequence_advantages():
    lp = torch.full((1, 4), -1.0)
    old = torch.full((1, 4), -0.5)
    m = torch.tensor([[True, True, True, False]])
    for adv in (torch.tensor([-1.0]), torch.full((1, 4), -1.0)):
        met = topr(lp, old, adv, m, level="token").metrics
        assert torch.allclose(met["truncated_frac"], torch.tensor(1.0)), (adv.shape, met)
        assert torch.allclose(met["is_weight_mean"], torch.tensor(math.exp(-0.5))), (adv.shape, met)
        assert torch.allclose(met["positive_frac"], torch.tensor(0.0)), (adv.shape, met)


def test_approx_kl_and_ratio_mean_are_accurate_near_on_policy():
    """No catastrophic cancellation: float32 metrics match a float64 reference."""
    g = torch.Generator().manual_seed(0)
    B, T = 128, 4096
    mask = torch.rand(B, T, generator=g) < 0.5
    old = -torch.rand(B, T, generator=g) * 4
    lr = torch.randn(B, T, generator=g) * 1e-3
    lp = old + lr
    lr64 = torch.where(mask, lp.double() - old.double(), torch.zeros((), dtype=torch.float64))
    n = mask.sum()
    kl_ref = (torch.expm1(lr64) - lr64).sum() / n
    ratio_ref = 1 + torch.expm1(lr64).sum() / n
    for name, fn, extra in _LOSSES:
        if name in ("vanilla-pg", "gpg"):
            continue
        met = fn(lp, old, torch.ones(B), mask, *([old] if extra else [])).metrics
        assert abs(met["approx_kl"].double() - kl_ref) / kl_ref < 1e-3, (name, met["approx_kl"], kl_ref)
        assert abs(met["ratio_mean"].double() - ratio_ref) < 1e-6, (name, met["ratio_mean"], ratio_ref)


# --------------------------------------------------------------------------- reliability (issue 14)


def _call_loss(name, b, **kw):
    entry = POLICY_LOSSES.entry(name)
    return entry.call(b, **kw)


_RATIO_FREE = {"vanilla-pg", "gpg"}  # old_logprobs unused
_SIGN_SPLIT = {"topr"}  # positives use no ratio (no old_logprobs) by design


@given(
    b=batches(nonfinite=("logprobs", "old_logprobs", "advantages"), allow_empty_rows=False),
    key=st.sampled_from(["logprobs", "old_logprobs", "advantages"]),
)
def test_non_finite_inputs_at_valid_tokens_propagate(b, key):
    """NaN / +-inf at a valid token never becomes a finite loss there: not through
    ``log_ratio_clamp`` (+inf -> 20), a clip, RAFT++'s threshold (a NaN advantage was dropped as
    a rejection) or a masked IS weight. Other rows stay finite; padding stays ignored."""
    m = b["response_mask"]
    clean = {
        k: torch.where(torch.isfinite(v), v, -1.0) if k in ("logprobs", "old_logprobs", "advantages") else v
        for k, v in b.items()
    }
    bad = ~torch.isfinite(b[key]) & m
    bad_rows = bad.any(-1)
    case = {**clean, key: b[key]}
    for name in POLICY_LOSSES.names():
        if key == "old_logprobs" and name in _RATIO_FREE | _SIGN_SPLIT:
            continue
        loss = _call_loss(name, case).loss
        assert not torch.isfinite(loss[bad]).any(), (name, key)
        assert torch.isfinite(loss[~bad_rows]).all(), (name, key)
        assert (loss[~m] == 0).all(), name


def test_raft_pp_nan_advantage_is_not_a_silent_rejection():
    lp, m = torch.tensor([[-1.0, -1.0]], requires_grad=True), torch.ones(1, 2, dtype=torch.bool)
    out = raft_pp(lp, lp.detach(), torch.tensor([float("nan")]), m)
    assert torch.isnan(out.loss).all()
    out.loss.sum().backward()
    assert torch.isnan(lp.grad).all()
    assert torch.isinf(raft_pp(lp, lp.detach(), torch.tensor([float("inf")]), m).loss).all()
    assert raft_pp(lp, lp.detach(), torch.tensor([-1.0]), m).loss.tolist() == [[0.0, 0.0]]
    with pytest.raises(ValueError, match=r"^threshold: must not be NaN$"):
        raft_pp(lp, lp.detach(), torch.tensor([1.0]), m, threshold=float("nan"))


@pytest.mark.parametrize("mode", ["mask", "truncate"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_importance_weights_of_non_finite_log_probs_are_nan(mode, bad):
    lp = torch.tensor([[-1.0, -1.0]])
    m = torch.ones(1, 2, dtype=torch.bool)
    w, _ = importance_weights(torch.tensor([[bad, -1.0]]), lp, m, mode=mode, lower=0.5)
    assert torch.isnan(w[0, 0]) and w[0, 1].item() == 1.0
    w, _ = importance_weights(torch.tensor([[bad, -1.0]]), lp, m, mode=mode, level="sequence")
    assert torch.isnan(w).all()
    # under a False mask the same value is ignored
    w, _ = importance_weights(torch.tensor([[bad, -1.0]]), lp, torch.tensor([[False, True]]), mode=mode)
    assert w.tolist() == [[0.0, 1.0]]


def test_policy_losses_run_on_meta_and_check_devices():
    b = {k: v for k, v in _meta_batch().items()}
    for name in POLICY_LOSSES.names():
        out = _call_loss(name, b)  # no value is read: shape inference works with the checks on
        assert out.loss.is_meta and out.loss.shape == b["logprobs"].shape
    lp = torch.zeros(2, 3)
    m = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"^advantages: is on device meta but logprobs is on cpu$"):
        ppo_clip(lp, lp, torch.zeros(2, device="meta"), m)
    with pytest.raises(ValueError, match=r"^old_logprobs: is on device meta but logprobs is on cpu$"):
        ppo_clip(lp, lp.to("meta"), torch.zeros(2), m)
    with pytest.raises(ValueError, match=r"^dual_clip: expected a number, got str$"):
        ppo_clip(lp, lp, torch.zeros(2), m, dual_clip="3")


def _meta_batch():
    B, T = 3, 4
    z = torch.zeros(B, T, device="meta")
    return {
        "logprobs": z,
        "old_logprobs": z,
        "behavior_logprobs": z,
        "advantages": torch.zeros(B, device="meta"),
        "response_mask": torch.ones(B, T, dtype=torch.bool, device="meta"),
    }
