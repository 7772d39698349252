"""Preference losses (DPO / cDPO / rDPO, IPO, SimPO, ORPO), the Bradley-Terry reward-model
loss, and their pair aggregation.

The references are TRL 1.16's own functions where they exist as callable code
(``CPOTrainer.cpo_loss`` for SimPO, ``ORPOTrainer.odds_ratio_loss``); DPO and IPO live inside
``DPOTrainer._compute_loss`` (it needs a model), so their formulas are written out here in
float64, as TRL 1.16 writes them."""

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from rollkit.losses import (
    aggregate_pairs,
    bradley_terry,
    dpo,
    global_normalizers,
    ipo,
    orpo,
    sequence_logprobs,
    simpo,
)
from rollkit.testing import batches


def _pairs(P=6, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    c, r, rc, rr = (-(torch.rand(P, generator=g, dtype=dtype) * 20 + 1) for _ in range(4))
    nc = torch.randint(1, 12, (P,), generator=g)
    nr = torch.randint(1, 12, (P,), generator=g)
    return c, r, rc, rr, nc, nr


# =========================================================================== DPO family


@pytest.mark.parametrize("beta", [0.05, 0.1, 1.0])
@pytest.mark.parametrize("eps", [0.0, 0.1, 0.3])
def test_dpo_matches_trl_formulas(beta, eps):
    c, r, rc, rr, *_ = _pairs(seed=int(beta * 100 + eps * 10))
    delta = (c - rc) - (r - rr)
    # TRL 1.16 DPOTrainer._compute_loss, f_divergence_type="reverse_kl"
    sigmoid = -F.logsigmoid(beta * delta)
    robust = (-(1 - eps) * F.logsigmoid(beta * delta) + eps * F.logsigmoid(-beta * delta)) / (1 - 2 * eps)
    cdpo = -(1 - eps) * F.logsigmoid(beta * delta) - eps * F.logsigmoid(-beta * delta)
    torch.testing.assert_close(dpo(c, r, rc, rr, beta=beta).loss, sigmoid, atol=1e-6, rtol=1e-6)
    out = dpo(c, r, rc, rr, beta=beta, label_smoothing=eps, robust=True)
    torch.testing.assert_close(out.loss, robust, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(
        dpo(c, r, rc, rr, beta=beta, label_smoothing=eps).loss, cdpo, atol=1e-6, rtol=1e-6
    )
    # TRL's logged metrics
    cr, rr_ = beta * (c - rc), beta * (r - rr)
    expected = {
        "rewards/chosen": cr.mean(),
        "rewards/rejected": rr_.mean(),
        "rewards/accuracies": (cr > rr_).double().mean(),
        "rewards/margins": (cr - rr_).mean(),
        "logps/chosen": c.mean(),
        "logps/rejected": r.mean(),
    }
    assert set(out.metrics) == set(expected)
    for k, v in expected.items():
        torch.testing.assert_close(out.metrics[k], v, msg=k)


@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_ipo_matches_trl_length_normalised_formula(beta):
    c, r, rc, rr, nc, nr = _pairs(seed=3)
    # TRL 1.16 loss_type="ipo": scores averaged over the completion tokens
    ipo_delta = (c - rc) / nc.clamp(min=1) - (r - rr) / nr.clamp(min=1)
    ref = (ipo_delta - 1 / (2 * beta)) ** 2
    torch.testing.assert_close(ipo(c, r, rc, rr, nc, nr, beta=beta).loss, ref, atol=1e-6, rtol=1e-6)
    # without lengths: eq. 17 on the log-probs as passed
    raw = ((c - rc) - (r - rr) - 1 / (2 * beta)) ** 2
    torch.testing.assert_close(ipo(c, r, rc, rr, beta=beta).loss, raw)


@pytest.fixture(scope="module")
def trl_experimental():
    pytest.importorskip("trl")
    import os

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    cpo = pytest.importorskip("trl.experimental.cpo")
    orpo_mod = pytest.importorskip("trl.experimental.orpo")
    return cpo.CPOTrainer, orpo_mod.ORPOTrainer


@pytest.mark.parametrize(("beta", "gamma", "eps"), [(2.0, 0.5, 0.0), (2.5, 1.4, 0.0), (1.0, 0.3, 0.2)])
def test_simpo_matches_trl_cpo_loss(trl_experimental, beta, gamma, eps):
    CPOTrainer, _ = trl_experimental
    c, r, _, _, nc, nr = _pairs(seed=5)
    fake = SimpleNamespace(
        alpha=0.0,
        beta=beta,
        simpo_gamma=gamma,
        label_smoothing=eps,
        loss_type="simpo",
        accelerator=SimpleNamespace(device="cpu"),
    )
    # TRL's CPOTrainer computes average log-probs for loss_type="simpo"
    losses, chosen_rewards, rejected_rewards = CPOTrainer.cpo_loss(fake, c / nc, r / nr)
    out = simpo(c, r, nc, nr, beta=beta, gamma=gamma, label_smoothing=eps)
    torch.testing.assert_close(out.loss, losses, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(out.metrics["rewards/chosen"], chosen_rewards.mean())
    torch.testing.assert_close(out.metrics["rewards/rejected"], rejected_rewards.mean())


@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_orpo_matches_trl_odds_ratio_loss(trl_experimental, beta):
    _, ORPOTrainer = trl_experimental
    c, r, _, _, nc, nr = _pairs(P=8, seed=7)
    c, r = c / 4, r / 4  # average log-probs near 0 too (the log1mexp branch at -log 2)
    fake = SimpleNamespace(beta=beta, accelerator=SimpleNamespace(device="cpu"))
    losses, chosen_rewards, _rejected_rewards, ratio, log_odds = ORPOTrainer.odds_ratio_loss(
        fake, c / nc, r / nr
    )
    out = orpo(c, r, nc, nr, beta=beta, nll_weight=0.0)
    # TRL: loss = nll - mean(losses); per pair, rollkit's odds part is -losses
    torch.testing.assert_close(out.loss, -losses.double(), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(out.metrics["log_odds_ratio"], ratio.double(), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(out.metrics["log_odds_chosen"], log_odds.double(), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(out.metrics["rewards/chosen"], chosen_rewards.double().mean())
    full = orpo(c, r, nc, nr, beta=beta)
    torch.testing.assert_close(full.loss, -(c / nc) - losses.double(), atol=1e-6, rtol=1e-6)


def test_orpo_log1mexp_has_finite_gradients_on_both_branches():
    a = torch.tensor([-1e-4, -0.5, -0.7, -3.0, -40.0], dtype=torch.float64, requires_grad=True)
    n = torch.ones(5)
    out = orpo(a, a.detach().flip(0), n, n)
    (g,) = torch.autograd.grad(out.loss.sum(), a)
    assert torch.isfinite(out.loss).all() and torch.isfinite(g).all()


# =========================================================================== properties


def test_only_the_policy_is_differentiated():
    c, r, rc, rr, nc, nr = (x.clone() for x in _pairs())
    for x in (c, r, rc, rr):
        x.requires_grad_()
    for out in (dpo(c, r, rc, rr), ipo(c, r, rc, rr, nc, nr)):
        gc, gr, grc, grr = torch.autograd.grad(out.loss.sum(), (c, r, rc, rr), allow_unused=True)
        assert gc is not None and gr is not None and grc is None and grr is None
    # DPO's gradient: -beta sigma(-beta h) on chosen, +beta sigma(-beta h) on rejected
    h = ((c - rc) - (r - rr)).detach()
    gc, gr = torch.autograd.grad(dpo(c, r, rc, rr, beta=0.2).loss.sum(), (c, r))
    torch.testing.assert_close(gc, -0.2 * torch.sigmoid(-0.2 * h))
    torch.testing.assert_close(gr, 0.2 * torch.sigmoid(-0.2 * h))


@st.composite
def _pair_tokens(draw):
    """Chosen and rejected token log-probs (garbage padding), reference ones, and masks."""
    b = draw(batches(garbage_padding=True, max_batch=6, max_len=8, allow_empty_rows=False))
    B = b["logprobs"].shape[0]
    P = max(B // 2, 1)
    if B < 2:
        b = {k: torch.cat([v, v]) for k, v in b.items()}
    pad = draw(st.integers(1, 4))
    return b, P, pad


@settings(max_examples=40)
@given(_pair_tokens())
def test_preference_losses_are_invariant_to_padding(data):
    """Extra padding columns (NaN / inf under the mask) change neither the loss nor the gradient."""
    b, P, pad = data
    # strictly below 0: ORPO's odds are infinite for a response of probability 1 (documented)
    lp, ref, m = b["logprobs"] - 0.05, b["ref_logprobs"], b["response_mask"]

    def losses(lp_tokens, ref_tokens, mask):
        lp_tokens = lp_tokens.clone().requires_grad_()
        seq = sequence_logprobs(lp_tokens, mask)
        ref_seq = sequence_logprobs(ref_tokens, mask)
        n = mask.sum(-1)
        c, r, rc, rr, nc, nr = seq[:P], seq[P : 2 * P], ref_seq[:P], ref_seq[P : 2 * P], n[:P], n[P : 2 * P]
        outs = [
            dpo(c, r, rc, rr, label_smoothing=0.1),
            ipo(c, r, rc, rr, nc, nr),
            simpo(c, r, nc, nr),
            orpo(c, r, nc, nr),
        ]
        total = sum(aggregate_pairs(o.loss) for o in outs)
        (g,) = torch.autograd.grad(total, lp_tokens)
        return [o.loss.detach() for o in outs], g

    T = lp.shape[1]
    garbage = torch.full((lp.shape[0], pad), float("nan"))
    lp_pad = torch.cat([lp, garbage], 1)
    ref_pad = torch.cat([ref, -garbage], 1)
    m_pad = torch.cat([m, torch.zeros(lp.shape[0], pad, dtype=torch.bool)], 1)
    l1, g1 = losses(lp, ref, m)
    l2, g2 = losses(lp_pad, ref_pad, m_pad)
    for a, b_ in zip(l1, l2):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b_)
    torch.testing.assert_close(g1, g2[:, :T])
    assert torch.all(g2[:, T:] == 0) and torch.all(g1[~m] == 0)


@pytest.mark.parametrize("weighted", [False, True])
def test_aggregate_pairs_micro_batches_give_the_full_batch(weighted):
    c, r, rc, rr, _nc, _nr = _pairs(P=7, seed=9, dtype=torch.float32)
    w = torch.rand(7, generator=torch.Generator().manual_seed(1)) if weighted else None
    c = c.clone().requires_grad_()
    whole = aggregate_pairs(dpo(c, r, rc, rr).loss, weights=w)
    (g_whole,) = torch.autograd.grad(whole, c)
    norms = global_normalizers(torch.ones(7, 1, dtype=torch.bool), w)
    for splits in ([1] * 7, [3, 4], [2, 2, 3]):
        c2 = c.detach().clone().requires_grad_()
        total, start = 0.0, 0
        for size in splits:
            s = slice(start, start + size)
            out = dpo(c2[s], r[s], rc[s], rr[s])
            total = total + aggregate_pairs(
                out.loss, weights=None if w is None else w[s], num_pairs=norms["num_seqs"]
            )
            start += size
        (g,) = torch.autograd.grad(total, c2)
        torch.testing.assert_close(total, whole, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(g, g_whole, atol=1e-6, rtol=1e-6)
    assert float(aggregate_pairs(torch.zeros(0))) == 0.0


def test_empty_batch_and_half_precision():
    e = torch.zeros(0)
    out = dpo(e, e, e, e)
    assert out.loss.shape == (0,) and all(float(v) == 0.0 for v in out.metrics.values())
    c, r, rc, rr, nc, nr = _pairs(dtype=torch.float32)
    half = [x.to(torch.bfloat16) for x in (c, r, rc, rr)]
    out = dpo(*half)
    assert out.loss.dtype == torch.float32
    torch.testing.assert_close(out.loss, dpo(*(x.float() for x in half)).loss)
    assert simpo(half[0], half[1], nc, nr).loss.dtype == torch.float32


def _raises(match, fn, *args, **kwargs):
    with pytest.raises(ValueError, match=match) as err:
        fn(*args, **kwargs)
    assert "\n" not in str(err.value)


def test_bad_inputs_raise_one_line_errors_naming_the_argument():
    c, r, rc, rr, nc, nr = _pairs()
    _raises("^chosen_logprobs: ", dpo, c[None], r, rc, rr)
    _raises("^rejected_logprobs: shape", dpo, c, r[:2], rc, rr)
    _raises("^ref_rejected_logprobs: expected a floating", dpo, c, r, rc, nr)
    _raises("^beta: must be > 0", dpo, c, r, rc, rr, beta=0.0)
    _raises(r"^label_smoothing: must be in \[0, 0.5\)", dpo, c, r, rc, rr, label_smoothing=0.5)
    _raises("^rejected_lengths: pass both", ipo, c, r, rc, rr, nc)
    _raises("^chosen_lengths: expected integer or float", simpo, c, r, nc.bool(), nr)
    _raises("^rejected_lengths: shape", simpo, c, r, nc, nr[:2])
    _raises("^gamma: must be finite", simpo, c, r, nc, nr, gamma=math.inf)
    _raises("^nll_weight: must be >= 0", orpo, c, r, nc, nr, nll_weight=-1.0)
    _raises("^loss: ", aggregate_pairs, c[None])
    _raises(r"^num_pairs: must be finite and >= 0, got -1.0$", aggregate_pairs, c, num_pairs=-1.0)
    _raises(
        r"^num_pairs: must be finite and >= 0, got nan$", aggregate_pairs, c, num_pairs=torch.tensor(math.nan)
    )
    _raises(r"^num_pairs: expected a scalar", aggregate_pairs, c, num_pairs=torch.ones(2))
    _raises(r"^num_pairs: ", aggregate_pairs, c, num_pairs="3")
    _raises(
        r"^weights: is on device meta but loss is on cpu$",
        aggregate_pairs,
        c,
        weights=torch.ones(6, device="meta"),
    )


# =========================================================================== Bradley-Terry


def _bt_reference(c, r, m):
    """InstructGPT eq. 1 / Llama 2 eq. 2 written out in float64: log(1 + exp(-(c - r - m)))."""
    return torch.log1p(torch.exp(-(c.double() - r.double() - m)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("margin", ["none", "float", "tensor"])
def test_bradley_terry_value_and_gradient_match_float64_autograd(dtype, margin):
    g = torch.Generator().manual_seed(11)
    c, r = (
        (torch.randn(9, generator=g, dtype=torch.float64) * 4).to(dtype),
        torch.randn(9, generator=g).to(dtype),
    )
    m = {"none": 0.0, "float": 0.7, "tensor": torch.rand(9, generator=g, dtype=dtype) * 2}[margin]
    c1, r1 = c.clone().requires_grad_(), r.clone().requires_grad_()
    out = bradley_terry(c1, r1, margin=m)
    gc, gr = torch.autograd.grad(out.loss.sum(), (c1, r1))
    c2, r2 = c.double().requires_grad_(), r.double().requires_grad_()
    m64 = m.double() if isinstance(m, torch.Tensor) else m
    ref = _bt_reference(c2, r2, m64)
    rc, rr = torch.autograd.grad(ref.sum(), (c2, r2))
    tol = {"rtol": 1e-6, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1e-12, "atol": 1e-14}
    assert out.loss.dtype == dtype and out.loss.shape == (9,)
    torch.testing.assert_close(out.loss.double(), ref.detach(), **tol)
    torch.testing.assert_close(gc.double(), rc, **tol)
    torch.testing.assert_close(gr.double(), rr, **tol)
    # closed form: dL/dr_w = -sigma(m - (r_w - r_l)) = -dL/dr_l
    torch.testing.assert_close(gc.double(), -torch.sigmoid(m64 - (c.double() - r.double())), **tol)
    torch.testing.assert_close(gr, -gc)


def test_bradley_terry_is_stable_at_any_score_gap():
    gap = torch.tensor([-1e30, -1e4, -50.0, 0.0, 50.0, 1e4, 1e30], dtype=torch.float32)
    c = gap.clone().requires_grad_()
    out = bradley_terry(c, torch.zeros(7))
    (g,) = torch.autograd.grad(out.loss.sum(), c)
    assert torch.isfinite(out.loss).all() and torch.isfinite(g).all()
    torch.testing.assert_close(out.loss[:3], -gap[:3])  # -log sigma(z) -> -z for z -> -inf
    assert out.loss[3].item() == pytest.approx(math.log(2)) and torch.all(out.loss[4:] < 1e-20)
    torch.testing.assert_close(g, -torch.sigmoid(-gap))


@given(
    st.lists(st.floats(-30, 30), min_size=1, max_size=8),
    st.floats(-30, 30),
    st.floats(-1e3, 1e3),
    st.floats(-5, 5),
)
def test_bradley_terry_properties(scores, shift, other, margin):
    """Invariant to a shift of both scores (only differences are identified), symmetric
    (swapping the responses flips the sign of the gap), and a per-pair margin equals the
    same number."""
    c = torch.tensor(scores, dtype=torch.float64)
    r = torch.full_like(c, other / 100)
    base = bradley_terry(c, r, margin=margin).loss
    torch.testing.assert_close(bradley_terry(c + shift, r + shift, margin=margin).loss, base)
    torch.testing.assert_close(bradley_terry(c, r, margin=torch.full_like(c, margin)).loss, base)
    # -log sigma(z) - (-log sigma(-z)) = -z
    flipped = bradley_terry(r, c, margin=-margin).loss
    torch.testing.assert_close(base - flipped, -(c - r - margin))
    assert torch.all(base >= 0)


def test_bradley_terry_metrics_margin_and_edge_cases():
    c, r = torch.tensor([2.0, 0.0, -1.0, 3.0]), torch.tensor([1.0, 0.0, 1.0, 0.0])
    out = bradley_terry(c, r, margin=0.5)
    assert out.metrics == {
        "rewards/chosen": torch.tensor(1.0),
        "rewards/rejected": torch.tensor(0.5),
        "rewards/accuracies": torch.tensor(0.5),  # r_w > r_l, ties lose, margin not subtracted
        "rewards/margins": torch.tensor(0.5),
    }
    # the margin is a constant: no gradient reaches it
    m = torch.full((4,), 0.5, requires_grad=True)
    assert not bradley_terry(c, r, margin=m).loss.requires_grad
    # empty batch, 16-bit scores computed in float32, the mean through aggregate_pairs
    e = bradley_terry(torch.zeros(0), torch.zeros(0))
    assert e.loss.shape == (0,) and all(float(v) == 0.0 for v in e.metrics.values())
    half = bradley_terry(c.bfloat16(), r.bfloat16())
    assert half.loss.dtype == torch.float32
    torch.testing.assert_close(aggregate_pairs(out.loss), out.loss.mean())


def test_bradley_terry_bad_inputs_raise_one_line_errors_naming_the_argument():
    c, r = torch.zeros(3), torch.ones(3)
    _raises("^chosen_rewards: ", bradley_terry, c[None], r)
    _raises("^chosen_rewards: expected a floating", bradley_terry, c.long(), r)
    _raises("^rejected_rewards: shape", bradley_terry, c, r[:2])
    _raises("^rejected_rewards: expected a floating", bradley_terry, c, r.long())
    _raises("^margin: must be finite", bradley_terry, c, r, margin=math.inf)
    _raises("^margin: must be finite", bradley_terry, c, r, margin=math.nan)
    _raises("^margin: expected a number", bradley_terry, c, r, margin="1")
    _raises("^margin: shape", bradley_terry, c, r, margin=torch.zeros(2))
    _raises("^margin: expected a floating", bradley_terry, c, r, margin=torch.zeros(3, dtype=torch.long))
    _raises("^margin: contains 1 NaN", bradley_terry, c, r, margin=torch.tensor([0.0, math.nan, 0.0]))
    with pytest.raises(TypeError):
        bradley_terry(c, r, 0.5)  # the margin is keyword-only
