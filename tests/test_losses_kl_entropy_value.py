import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rollkit.losses import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    entropy_bonus,
    entropy_from_logits,
    entropy_from_logits_chunked,
    kl_estimate,
    kl_k1,
    kl_k1_plus,
    kl_k2,
    kl_k3,
    kl_k3_plus,
    kl_loss,
    kl_penalty,
    value_loss,
)
from rollkit.registry import KL_ESTIMATORS
from rollkit.testing import batches, float_tensors, shapes

E = math.e

# =========================================================================== KL


def test_kl_estimators_hand_computed():
    lp = torch.tensor([-1.0, -2.0, -1.5])
    ref = torch.tensor([-2.0, -1.0, -1.5])
    # log r = ref - lp = [-1, 1, 0]
    assert torch.allclose(kl_k1(lp, ref), torch.tensor([1.0, -1.0, 0.0]))
    assert torch.allclose(kl_k2(lp, ref), torch.tensor([0.5, 0.5, 0.0]))
    assert torch.allclose(kl_k3(lp, ref), torch.tensor([1 / E - 1 + 1, E - 1 - 1, 0.0]))
    assert torch.allclose(kl_k1_plus(lp, ref), kl_k1(lp, ref))
    assert torch.allclose(kl_k3_plus(lp, ref), kl_k3(lp, ref))


def test_k1_and_k3_have_exactly_the_kl_as_expectation():
    """Sign convention check: E_{y ~ pi}[k(y)] = KL(pi || pi_ref) exactly for k1 and k3."""
    logits = torch.tensor([0.3, -1.0, 2.0, 0.0], dtype=torch.float64)
    ref_logits = torch.tensor([1.0, 0.5, -0.5, 0.2], dtype=torch.float64)
    lp, ref = logits.log_softmax(-1), ref_logits.log_softmax(-1)
    p = lp.exp()
    kl = (p * (lp - ref)).sum()
    assert torch.allclose((p * kl_k1(lp, ref)).sum(), kl)
    assert torch.allclose((p * kl_k3(lp, ref, clamp=None)).sum(), kl)
    assert not torch.allclose((p * kl_k2(lp, ref)).sum(), kl)  # k2 is biased


def test_k3_clamps():
    lp = torch.tensor([0.0, 0.0, 0.0])
    ref = torch.tensor([5.0, 30.0, -40.0])  # log r = 5, 30 (clamped to 20), -40 (clamped to -20)
    assert torch.allclose(kl_k3(lp, ref), torch.tensor([10.0, 10.0, 10.0]))
    k = kl_k3(lp, ref, clamp=None)
    expected = torch.tensor([math.exp(5) - 6, math.exp(20) - 21, math.exp(-20) - 1 + 20])
    assert torch.allclose(k, expected)
    assert torch.allclose(kl_k3(lp, ref, clamp=50.0)[2], torch.tensor(19.0 + math.exp(-20)))


def test_k3_gradient_is_finite_for_huge_log_ratios():
    lp = torch.tensor([0.0, -200.0, -1.0], requires_grad=True)
    ref = torch.tensor([-200.0, 0.0, -1.0])
    for clamp in (10.0, None):
        (g,) = torch.autograd.grad(kl_k3(lp, ref, clamp=clamp).sum(), lp)
        assert torch.isfinite(g).all()
    # the clamped token passes no gradient; k3+ passes the k2 gradient everywhere
    (g,) = torch.autograd.grad(kl_k3(lp, ref).sum(), lp)
    assert g[1] == 0
    (g,) = torch.autograd.grad(kl_k3_plus(lp, ref).sum(), lp)
    assert torch.allclose(g, (lp - ref).detach())


def test_kl_estimate_dispatch_and_aliases():
    lp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-2.0, -1.0])
    for name, fn in [("k1", kl_k1), ("kl", kl_k1), ("k2", kl_k2), ("mse", kl_k2), ("k2+", kl_k2)]:
        assert torch.equal(kl_estimate(lp, ref, estimator=name), fn(lp, ref))
    for name in ("k3", "low_var_kl"):
        assert torch.equal(kl_estimate(lp, ref, estimator=name), kl_k3(lp, ref))
    for name in ("k3+", "low_var_kl+"):
        assert torch.equal(kl_estimate(lp, ref, estimator=name), kl_k3_plus(lp, ref))
    assert torch.equal(kl_estimate(lp, ref, estimator="kl+"), kl_k1_plus(lp, ref))
    with pytest.raises(ValueError, match="estimator: must be one of"):
        kl_estimate(lp, ref, estimator="k4")


def test_kl_registry():
    assert set(KL_ESTIMATORS.names()) >= {"k1", "k2", "k3", "k1+", "k3+"}
    assert KL_ESTIMATORS.get("low_var_kl") is kl_k3 and KL_ESTIMATORS.get("low_var_kl+") is kl_k3_plus
    assert KL_ESTIMATORS.get("kl") is kl_k1 and KL_ESTIMATORS.get("mse") is kl_k2
    for name in KL_ESTIMATORS.names():
        e = KL_ESTIMATORS.entry(name)
        assert e.in_keys == {"logprobs": "logprobs", "ref_logprobs": "ref_logprobs"}
        assert tuple(e.out_keys) == ("kl",)


@given(b=batches(max_batch=6, max_len=10, max_log_ratio=5.0))
def test_k2_k3_nonnegative_and_k3_zero_iff_equal(b):
    lp, ref = b["logprobs"].double(), b["ref_logprobs"].double()
    assert (kl_k2(lp, ref) >= 0).all()
    k3 = kl_k3(lp, ref, clamp=None)
    assert (k3 >= 0).all()
    same = lp == ref
    assert (k3[same] == 0).all()
    assert (k3[(lp - ref).abs() > 1e-6] > 0).all()
    # half the tokens exactly equal: zero there, and only there
    lp2 = torch.where(torch.arange(lp.numel()).reshape(lp.shape) % 2 == 0, ref, lp)
    k3b = kl_k3(lp2, ref, clamp=None)
    assert (k3b[lp2 == ref] == 0).all() and (k3b[(lp2 - ref).abs() > 1e-6] > 0).all()


@given(b=batches(max_batch=6, max_len=10, max_log_ratio=5.0), clamp=st.sampled_from([None, 0.5, 10.0]))
def test_straight_through_variants_have_k2_gradient_and_own_value(b, clamp):
    ref = b["ref_logprobs"]
    grads = {}
    for name, fn in [
        ("k2", kl_k2),
        ("k1+", kl_k1_plus),
        ("k3+", lambda lp, ref: kl_k3_plus(lp, ref, clamp=clamp)),
    ]:
        lp = b["logprobs"].clone().requires_grad_()
        out = fn(lp, ref)
        (grads[name],) = torch.autograd.grad(out.sum(), lp)
        if name == "k1+":
            assert torch.equal(out.detach(), kl_k1(lp.detach(), ref))
        if name == "k3+":
            assert torch.equal(out.detach(), kl_k3(lp.detach(), ref, clamp=clamp))
    assert torch.allclose(grads["k1+"], grads["k2"]) and torch.allclose(grads["k3+"], grads["k2"])
    assert torch.allclose(grads["k2"], b["logprobs"] - ref)


def test_kl_loss_hand_computed():
    lp = torch.tensor([[-1.0, -2.0, 0.0], [-1.0, float("nan"), 0.0]], requires_grad=True)
    ref = torch.tensor([[-2.0, -1.0, 0.0], [-1.0, 0.0, float("inf")]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    out = kl_loss(lp, ref, mask, estimator="k1", coef=0.5)
    assert torch.allclose(out.loss, torch.tensor([[0.5, -0.5, 0.0], [0.0, 0.0, 0.0]]))
    assert float(out.metrics["kl"]) == 0.0  # (1 - 1 + 0) / 3
    assert float(out.metrics["kl_coef"]) == 0.5
    out.loss.sum().backward()
    assert torch.equal(lp.grad, torch.tensor([[0.5, 0.5, 0.0], [0.5, 0.0, 0.0]]))  # no NaN leaks
    out = kl_loss(lp.detach(), ref, mask, estimator="k2", coef=2.0)
    assert torch.allclose(out.loss, torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]]))
    assert math.isclose(float(out.metrics["kl"]), 1 / 3, rel_tol=1e-6)
    for v in out.metrics.values():
        assert v.ndim == 0 and not v.requires_grad


def test_kl_loss_fully_masked():
    lp = torch.randn(2, 3).requires_grad_()
    out = kl_loss(lp, torch.randn(2, 3), torch.zeros(2, 3, dtype=torch.bool))
    assert torch.equal(out.loss, torch.zeros(2, 3)) and float(out.metrics["kl"]) == 0.0


@given(b=batches(max_batch=6, max_len=10), estimator=st.sampled_from(["k1", "k2", "k3", "k1+", "k3+"]))
def test_kl_loss_zero_outside_mask_and_finite(b, estimator):
    mask = b["response_mask"]
    out = kl_loss(b["logprobs"], b["ref_logprobs"], mask, estimator=estimator, coef=0.1)
    assert torch.isfinite(out.loss).all() and (out.loss[~mask] == 0).all()
    assert torch.isfinite(out.metrics["kl"])


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"ref_logprobs": torch.zeros(2, 2)}, "ref_logprobs: shape"),
        ({"logprobs": torch.zeros(2, 3, dtype=torch.long)}, "logprobs: expected a floating-point"),
        ({"logprobs": torch.zeros(6), "ref_logprobs": torch.zeros(6)}, "logprobs: expected 2 dimensions"),
        ({"mask": torch.ones(2, 3)}, "mask: expected a torch.bool"),
        ({"mask": torch.ones(3, 2, dtype=torch.bool)}, "mask: shape"),
        ({"coef": -1.0}, "coef: must be >= 0"),
        ({"estimator": "k9"}, "estimator: must be one of"),
        ({"clamp": 0.0}, "clamp: must be > 0"),
    ],
)
def test_kl_loss_validation(kwargs, match):
    args = {
        "logprobs": torch.zeros(2, 3),
        "ref_logprobs": torch.zeros(2, 3),
        "mask": torch.ones(2, 3, dtype=torch.bool),
        **kwargs,
    }
    with pytest.raises(ValueError, match=match):
        kl_loss(args.pop("logprobs"), args.pop("ref_logprobs"), args.pop("mask"), **args)


def test_kl_penalty_hand_computed():
    lp = torch.tensor([[-1.0, -1.0]])
    ref = torch.tensor([[-2.0, 0.0]])
    mask = torch.tensor([[True, True]])
    assert torch.allclose(kl_penalty(lp, ref, mask, coef=0.1), torch.tensor([[0.1, -0.1]]))
    assert torch.allclose(kl_penalty(lp, ref, mask, coef=0.1, estimator="k2"), torch.tensor([[0.05, 0.05]]))


def test_apply_kl_penalty_sequence_rewards_at_last_valid_token():
    rewards = torch.tensor([1.0, 2.0, 3.0])
    lp = torch.tensor([[-1.0, -1.0, -1.0, -1.0]] * 3, requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0, -1.0, -1.0], [-1.0, -2.0, -1.0, -1.0], [-1.0, -1.0, -1.0, -1.0]])
    # row 0: tokens 0, 2 (hole at 1, padding at 3) -> last valid token is 2; row 2 is empty
    mask = torch.tensor([[True, False, True, False], [True, True, True, True], [False] * 4])
    tr, m = apply_kl_penalty(rewards, lp, ref, mask, coef=2.0)
    expected = torch.tensor([[-1.0, 0.0, 1.0, 0.0], [0.0, -2.0, 0.0, 2.0], [0.0, 0.0, 0.0, 0.0]])
    assert torch.allclose(tr, expected)
    assert not tr.requires_grad
    # kl per row: row0 mean (0.5 + 0) / 2 = 0.25, sum 0.5; row1 mean 1 / 4, sum 1; row 2 excluded
    assert math.isclose(float(m["kl"]), (0.25 + 0.25) / 2, rel_tol=1e-6)
    assert math.isclose(float(m["kl_seq_sum"]), (0.5 + 1.0) / 2, rel_tol=1e-6)
    assert float(m["kl_coef"]) == 2.0


def test_apply_kl_penalty_token_rewards_and_errors():
    tok = torch.tensor([[0.5, 0.5], [1.0, 9.0]])
    lp = torch.tensor([[-1.0, -1.0], [-1.0, -1.0]])
    ref = torch.tensor([[-2.0, -1.0], [-1.0, -1.0]])
    mask = torch.tensor([[True, True], [True, False]])
    tr, _ = apply_kl_penalty(tok, lp, ref, mask, coef=0.5)
    assert torch.allclose(tr, torch.tensor([[0.0, 0.5], [1.0, 0.0]]))
    _, m = apply_kl_penalty(tok, lp, ref, torch.zeros(2, 2, dtype=torch.bool), coef=0.5)
    assert float(m["kl"]) == 0.0 and float(m["kl_seq_sum"]) == 0.0
    with pytest.raises(ValueError, match="rewards: has 3 entries"):
        apply_kl_penalty(torch.zeros(3), lp, ref, mask, coef=0.1)
    with pytest.raises(ValueError, match="rewards: expected shape"):
        apply_kl_penalty(torch.zeros(2, 3), lp, ref, mask, coef=0.1)
    with pytest.raises(ValueError, match="rewards: contains 1 NaN"):
        apply_kl_penalty(torch.tensor([0.0, float("nan")]), lp, ref, mask, coef=0.1)


@settings(max_examples=30)
@given(b=batches(max_batch=6, max_len=10), coef=st.floats(0.0, 1.0))
def test_apply_kl_penalty_properties(b, coef):
    mask = b["response_mask"]
    tr, _ = apply_kl_penalty(b["rewards"], b["old_logprobs"], b["ref_logprobs"], mask, coef=coef)
    assert (tr[~mask] == 0).all() and torch.isfinite(tr).all()
    # summing a row gives R - coef * sum_t KL_t for non-empty rows
    k1 = torch.where(mask, b["old_logprobs"] - b["ref_logprobs"], torch.zeros(()))
    nonempty = mask.any(-1)
    expected = torch.where(nonempty, b["rewards"] - coef * k1.sum(-1), torch.zeros(()))
    assert torch.allclose(tr.sum(-1), expected, rtol=1e-4, atol=1e-3)


def test_adaptive_kl_controller_hand_computed():
    ctl = AdaptiveKLController(0.2, target=6.0, horizon=1000)
    assert math.isclose(ctl.update(6.6, n_steps=100), 0.2 * (1 + 0.1 * 0.1))  # error 0.1
    v = ctl.value
    assert math.isclose(ctl.update(torch.tensor(0.0), n_steps=100), v * (1 - 0.2 * 0.1))  # clipped -0.2
    v = ctl.value
    assert math.isclose(ctl.update(600.0, n_steps=50), v * (1 + 0.2 * 0.05))  # clipped +0.2
    assert math.isclose(ctl.update(6.0, n_steps=50), ctl.value)  # on target: unchanged
    state = ctl.state_dict()
    other = AdaptiveKLController(1.0, target=1.0, horizon=1.0)
    other.load_state_dict(state)
    assert other.state_dict() == state
    assert other.update(9.0, 10) == ctl.update(9.0, 10)
    with pytest.raises(ValueError, match="target: must be > 0"):
        AdaptiveKLController(0.1, target=0.0, horizon=10)
    with pytest.raises(ValueError, match="horizon: must be > 0"):
        AdaptiveKLController(0.1, target=1.0, horizon=-1)
    with pytest.raises(ValueError, match="current_kl: must be finite"):
        ctl.update(float("nan"), 10)
    with pytest.raises(ValueError, match="n_steps: must be >= 0"):
        ctl.update(1.0, -1)


def test_fixed_kl_controller():
    ctl = FixedKLController(0.05)
    assert ctl.update(100.0, 10) == 0.05 and ctl.value == 0.05
    ctl2 = FixedKLController(1.0)
    ctl2.load_state_dict(ctl.state_dict())
    assert ctl2.value == 0.05
    with pytest.raises(ValueError, match="coef: must be >= 0"):
        FixedKLController(-0.1)


# =========================================================================== entropy


def test_entropy_hand_computed():
    logits = torch.tensor(
        [
            [0.0, 0.0, 0.0, 0.0],
            [0.0, math.log(3.0), float("-inf"), float("-inf")],
            [5.0, float("-inf"), float("-inf"), float("-inf")],
            [1e4, -1e4, 0.0, 1e4],
        ]
    )
    h = entropy_from_logits(logits)
    p = torch.tensor([0.25, 0.75])
    expected = torch.tensor([math.log(4), float(-(p * p.log()).sum()), 0.0, math.log(2)])
    assert torch.allclose(h, expected, atol=1e-6)


def test_entropy_minus_inf_logits_have_finite_gradient_and_all_minus_inf_row_is_zero():
    logits = torch.tensor([[0.5, float("-inf"), 1.0], [float("-inf")] * 3], requires_grad=True)
    h = entropy_from_logits(logits)
    assert h[1] == 0 and torch.isfinite(h).all()
    h.sum().backward()
    assert torch.isfinite(logits.grad).all()
    assert logits.grad[0, 1] == 0
    # the naive formula has a NaN here
    naive = -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)
    assert torch.isnan(naive[0])


@settings(max_examples=30)
@given(data=st.data(), shape=shapes(max_batch=4, max_len=6), V=st.integers(1, 12))
def test_entropy_matches_direct_formula_and_bounds(data, shape, V):
    logits = data.draw(float_tensors((*shape, V), min_value=-30.0, max_value=30.0, extreme=False))
    h = entropy_from_logits(logits)
    assert h.shape == shape
    d = logits.double()
    direct = -(d.softmax(-1) * d.log_softmax(-1)).sum(-1)
    assert torch.allclose(h.double(), direct, atol=1e-5)
    assert (h >= -1e-6).all() and (h <= math.log(V) + 1e-5).all()


@settings(max_examples=25)
@given(data=st.data(), shape=shapes(max_batch=4, max_len=6), V=st.integers(1, 9), chunk=st.integers(1, 30))
def test_chunked_entropy_equals_unchunked_values_and_gradients(data, shape, V, chunk):
    x = data.draw(float_tensors((*shape, V), min_value=-20.0, max_value=20.0))
    x[..., 0] = float("-inf") if V > 1 else x[..., 0]
    a = x.clone().requires_grad_()
    b = x.clone().requires_grad_()
    ha, hb = entropy_from_logits(a), entropy_from_logits_chunked(b, chunk_size=chunk)
    assert torch.allclose(ha, hb, atol=1e-6, rtol=0)
    w = torch.arange(ha.numel(), dtype=ha.dtype).reshape(ha.shape)
    (ga,) = torch.autograd.grad((ha * w).sum(), a)
    (gb,) = torch.autograd.grad((hb * w).sum(), b)
    assert torch.allclose(ga, gb, atol=1e-5)
    with torch.no_grad():
        assert torch.allclose(entropy_from_logits_chunked(x, chunk_size=chunk), ha.detach(), atol=1e-6)


def test_entropy_bf16_accumulates_in_float32():
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(4, 8, 5000, generator=g) * 3).to(torch.bfloat16)
    h = entropy_from_logits(logits)
    assert h.dtype == torch.bfloat16
    ref = entropy_from_logits(logits.float())
    assert torch.allclose(h.float(), ref, rtol=2**-8, atol=0)
    assert torch.equal(entropy_from_logits_chunked(logits, chunk_size=7), h)


def test_entropy_validation_and_empty():
    with pytest.raises(ValueError, match="logits: expected a floating-point"):
        entropy_from_logits(torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="chunk_size: must be > 0"):
        entropy_from_logits_chunked(torch.zeros(2, 3), chunk_size=0)
    assert entropy_from_logits_chunked(torch.zeros(0, 4, 5)).shape == (0, 4)


def test_entropy_bonus_hand_computed_and_edge_cases():
    ent = torch.tensor([[1.0, 2.0, float("nan")], [3.0, 0.0, 0.0]], requires_grad=True)
    mask = torch.tensor([[True, True, False], [False, False, False]])
    out = entropy_bonus(ent, mask, coef=0.5)
    assert torch.equal(out.loss, torch.tensor([[-0.5, -1.0, 0.0], [0.0, 0.0, 0.0]]))
    assert float(out.metrics["entropy"]) == 1.5
    out.loss.sum().backward()
    assert torch.equal(ent.grad, torch.tensor([[-0.5, -0.5, 0.0], [0.0, 0.0, 0.0]]))
    out = entropy_bonus(torch.ones(2, 2), torch.zeros(2, 2, dtype=torch.bool))
    assert torch.equal(out.loss, torch.zeros(2, 2)) and float(out.metrics["entropy"]) == 0.0
    with pytest.raises(ValueError, match="mask: shape"):
        entropy_bonus(torch.ones(2, 2), torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="coef: must be >= 0"):
        entropy_bonus(torch.ones(2, 2), torch.ones(2, 2, dtype=torch.bool), coef=-1.0)


# =========================================================================== value


def test_value_loss_hand_computed():
    values = torch.tensor([[1.5, 1.1, 0.0]], requires_grad=True)
    old = torch.tensor([[1.0, 1.0, 0.0]])
    returns = torch.tensor([[2.0, 0.0, float("nan")]])
    mask = torch.tensor([[True, True, False]])
    out = value_loss(values, old, returns, mask, clip_range=0.2)
    # token 0: unclipped (1.5-2)^2 = 0.25, clipped (1.2-2)^2 = 0.64 -> 0.32 (clipped branch)
    # token 1: inside the clip range: 1.1^2 = 1.21 -> 0.605
    assert torch.allclose(out.loss, torch.tensor([[0.32, 0.605, 0.0]]))
    assert float(out.metrics["vf_clipfrac"]) == 0.5
    assert math.isclose(float(out.metrics["vf_mse"]), (0.25 + 1.21) / 2, rel_tol=1e-6)
    out.loss.sum().backward()
    # the clipped branch passes no gradient; token 1: 0.5 * 2 * 1.1
    assert torch.allclose(values.grad, torch.tensor([[0.0, 1.1, 0.0]]))
    out = value_loss(values.detach(), old, returns, mask, clip_range=None, coef=1.0)
    assert torch.allclose(out.loss, torch.tensor([[0.25, 1.21, 0.0]]))
    assert float(out.metrics["vf_clipfrac"]) == 0.0


@settings(max_examples=30)
@given(b=batches(max_batch=6, max_len=10), clip=st.sampled_from([0.1, 0.2, 1.0]), coef=st.floats(0.0, 2.0))
def test_value_loss_properties(b, clip, coef):
    mask = b["response_mask"]
    values, old, returns = b["values"], b["values"] + b["token_rewards"], b["advantages"]
    mse = torch.where(mask, coef * (values - returns).square(), torch.zeros(()))
    # no clipping, or old == values: plain (scaled) MSE
    assert torch.allclose(value_loss(values, old, returns, mask, clip_range=None, coef=coef).loss, mse)
    same = value_loss(values, values, returns, mask, clip_range=clip, coef=coef)
    assert torch.allclose(same.loss, mse) and float(same.metrics["vf_clipfrac"]) == 0.0
    # clipping is pessimistic: never below the MSE; zero outside the mask; finite metrics
    out = value_loss(values, old, returns, mask, clip_range=clip, coef=coef)
    assert (out.loss >= mse - 1e-6).all() and (out.loss[~mask] == 0).all()
    assert all(torch.isfinite(v) and v.ndim == 0 for v in out.metrics.values())
    assert 0.0 <= float(out.metrics["vf_clipfrac"]) <= 1.0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"old_values": torch.zeros(2, 2)}, "old_values: shape"),
        ({"returns": torch.zeros(3, 2)}, "returns: shape"),
        ({"values": torch.zeros(2, 3, dtype=torch.long)}, "values: expected a floating-point"),
        ({"mask": torch.ones(2, 3)}, "mask: expected a torch.bool"),
        ({"clip_range": 0.0}, "clip_range: must be > 0"),
        ({"coef": -0.5}, "coef: must be >= 0"),
    ],
)
def test_value_loss_validation(kwargs, match):
    args = {
        "values": torch.zeros(2, 3),
        "old_values": torch.zeros(2, 3),
        "returns": torch.zeros(2, 3),
        "mask": torch.ones(2, 3, dtype=torch.bool),
        **kwargs,
    }
    with pytest.raises(ValueError, match=match):
        value_loss(args.pop("values"), args.pop("old_values"), args.pop("returns"), args.pop("mask"), **args)


@given(b=batches(max_batch=4, max_len=6))
def test_losses_finite_with_fully_masked_rows(b):
    mask = b["response_mask"].clone()
    mask[0] = False  # at least one fully masked row
    lp = b["logprobs"].clone().requires_grad_()
    total = (
        kl_loss(lp, b["ref_logprobs"], mask, estimator="k3+").loss.sum()
        + entropy_bonus(-lp, mask).loss.sum()
        + value_loss(lp, b["old_logprobs"], b["values"], mask).loss.sum()
    )
    total.backward()
    assert torch.isfinite(total) and torch.isfinite(lp.grad).all()
    assert (lp.grad[0] == 0).all()


# =========================================================================== review fixes


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3", "k1+", "k3+"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_kl_loss_half_precision_gradient_is_finite_and_float32(estimator, dtype):
    """fp16 exp(log r) overflows above ~11.1: the KL must be computed in float32."""
    from rollkit.losses import aggregate

    mask = torch.ones(1, 2, dtype=torch.bool)
    lp = torch.tensor([[-13.0, -1.0]], dtype=dtype, requires_grad=True)
    ref = torch.tensor([[-0.5, -1.2]], dtype=dtype)
    out = kl_loss(lp, ref, mask, coef=0.1, estimator=estimator)
    assert out.loss.dtype == torch.float32
    aggregate(out.loss, mask).backward()
    assert torch.isfinite(lp.grad).all(), lp.grad
    # equals the float32 computation on the same (rounded) values
    lp32 = lp.detach().float().requires_grad_(True)
    ref_out = kl_loss(lp32, ref.float(), mask, coef=0.1, estimator=estimator)
    assert torch.allclose(out.loss, ref_out.loss, rtol=1e-6, atol=1e-7)
    aggregate(ref_out.loss, mask).backward()
    assert torch.allclose(lp.grad.float(), lp32.grad, rtol=2**-7, atol=1e-6)


def test_kl_k3_half_precision_stays_finite():
    lp = torch.tensor([-13.0, -1.0], dtype=torch.float16, requires_grad=True)
    ref = torch.tensor([-0.5, -1.2], dtype=torch.float16)
    k = kl_k3(lp, ref)
    assert k.dtype == torch.float16 and torch.isfinite(k).all()
    k.sum().backward()
    assert torch.isfinite(lp.grad).all(), lp.grad


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_regularizers_and_value_loss_return_float32_for_half_inputs(dtype):
    mask = torch.tensor([[True, True, False]])
    x = torch.tensor([[-1.0, -2.0, -0.5]], dtype=dtype)
    y = torch.tensor([[-1.5, -1.0, -0.25]], dtype=dtype)
    assert kl_loss(x, y, mask).loss.dtype == torch.float32
    assert kl_penalty(x, y, mask, coef=0.1).dtype == torch.float32
    assert entropy_bonus(-x, mask).loss.dtype == torch.float32
    out = value_loss(x, y, x * 0.5, mask)
    assert out.loss.dtype == torch.float32
    assert torch.allclose(out.loss, value_loss(x.float(), y.float(), (x * 0.5).float(), mask).loss)


def test_targets_and_reference_get_no_gradient():
    mask = torch.tensor([[True, True, False]])
    lp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0, -0.25]], requires_grad=True)
    for est in ("k1", "k2", "k3", "k1+", "k3+"):
        kl_loss(lp, ref, mask, estimator=est).loss.sum().backward()
        kl_penalty(lp, ref, mask, coef=0.1, estimator=est).sum().backward()
    assert ref.grad is None and lp.grad is not None
    v = torch.tensor([[1.0, 0.0, 2.0]], requires_grad=True)
    old = torch.tensor([[0.5, 0.5, 0.5]], requires_grad=True)
    ret = torch.tensor([[0.0, 1.0, 3.0]], requires_grad=True)
    for clip in (0.2, None):
        value_loss(v, old, ret, mask, clip_range=clip).loss.sum().backward()
    assert old.grad is None and ret.grad is None and v.grad is not None


def test_entropy_nan_and_pos_inf_logits_propagate_all_neg_inf_is_zero():
    inf = float("inf")
    logits = torch.tensor(
        [
            [0.0, 1.0, float("nan")],
            [0.0, inf, 1.0],
            [-inf, -inf, -inf],
            [0.0, -inf, 0.0],
        ],
        requires_grad=True,
    )
    for fn in (entropy_from_logits, lambda z: entropy_from_logits_chunked(z, chunk_size=2)):
        h = fn(logits)
        assert torch.isnan(h[0]) and torch.isnan(h[1]), h
        assert h[2] == 0.0
        assert torch.allclose(h[3], torch.tensor(math.log(2.0)))
        logits.grad = None
        h[2:].sum().backward()
        assert torch.isfinite(logits.grad).all()


# --------------------------------------------------------------------------- reliability (issue 14)


@given(b=batches(min_len=0, max_len=4), coef=st.sampled_from([0.0, 0.1]), seq=st.booleans())
def test_apply_kl_penalty_handles_empty_responses(b, coef, seq):
    """``T = 0`` is valid (every row empty): the penalised rewards are ``[B, 0]``, the metrics 0
    (``_last_token_index`` reduced over an empty dimension: IndexError)."""
    from rollkit.losses import apply_kl_penalty

    m = b["response_mask"]
    rew = b["rewards"] if seq else b["token_rewards"]
    tr, met = apply_kl_penalty(rew, b["logprobs"], b["ref_logprobs"], m, coef=coef)
    assert tr.shape == m.shape
    assert torch.isfinite(tr).all() and (tr[~m] == 0).all()
    if m.shape[1] == 0:
        assert float(met["kl"]) == 0.0 and float(met["kl_seq_sum"]) == 0.0


def test_apply_kl_penalty_t0_and_negative_coef():
    from rollkit.losses import apply_kl_penalty

    z, m = torch.zeros(1, 0), torch.zeros(1, 0, dtype=torch.bool)
    tr, met = apply_kl_penalty(torch.tensor([1.0]), z, z, m, coef=0.1)
    assert tr.shape == (1, 0) and float(met["kl"]) == 0.0
    one = torch.ones(1, 1, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"^coef: must be >= 0, got -1.0$"):
        apply_kl_penalty(torch.tensor([0.0]), torch.tensor([[-1.0]]), torch.tensor([[-2.0]]), one, coef=-1.0)
    with pytest.raises(ValueError, match=r"^coef: expected a number, got str$"):
        apply_kl_penalty(torch.tensor([0.0]), torch.tensor([[-1.0]]), torch.tensor([[-2.0]]), one, coef="x")
    with pytest.raises(ValueError, match=r"^rewards: is on device meta but mask is on cpu$"):
        apply_kl_penalty(
            torch.tensor([0.0], device="meta"), torch.tensor([[-1.0]]), torch.tensor([[-2.0]]), one, coef=0.1
        )


@given(st.data())
def test_straight_through_estimators_have_the_value_of_k_and_the_gradient_of_k2(data):
    """``k2 - sg(k2)`` overflowed to ``inf - inf = NaN`` for log-ratios above ~1.8e19 (float32):
    the value of k1+ must be k1 exactly, its gradient ``logprobs - ref_logprobs``, for any
    finite inputs (huge ones included)."""
    from rollkit.losses import kl_k1_plus, kl_k3_plus

    n = data.draw(st.integers(1, 6))
    lp = data.draw(float_tensors((n,), min_value=-3e38, max_value=0.0, huge=True)).requires_grad_()
    ref = data.draw(float_tensors((n,), min_value=-3e38, max_value=0.0, huge=True))
    d = lp.detach() - ref
    k = kl_k1_plus(lp, ref)
    assert torch.equal(k.detach(), d)
    k.sum().backward()
    assert torch.equal(lp.grad, d)
    lp.grad = None
    k3p = kl_k3_plus(lp, ref)
    assert torch.equal(k3p.detach(), kl_k3(lp.detach(), ref)) and torch.isfinite(k3p).all()
    k3p.sum().backward()
    assert torch.equal(lp.grad, d)


def test_k1_plus_of_minus_1e30():
    from rollkit.losses import kl_k1_plus

    lp, ref = torch.tensor([-1e30]), torch.tensor([-1.0])
    assert torch.equal(kl_k1_plus(lp, ref), lp - ref)  # was NaN


@given(st.data())
def test_non_finite_log_probs_are_not_clamped_into_finite_kl(data):
    """``+-inf`` log-probs used to become ``+-20`` through k3's clamp (a finite KL of 10 for an
    impossible token): now any non-finite log-ratio gives NaN, documented; padding stays ignored."""
    from rollkit.testing import logprob_tensors

    n = data.draw(st.integers(1, 6))
    lp = data.draw(logprob_tensors((n,), nonfinite=True))
    ref = data.draw(logprob_tensors((n,)))
    bad = ~torch.isfinite(lp - ref)
    assert bad.any()
    for est in ("k3", "k3+", "k1+"):
        k = kl_estimate(lp, ref, estimator=est)
        assert torch.isnan(k[bad]).all() and torch.isfinite(k[~bad]).all(), est
    for est in ("k1", "k2"):
        k = kl_estimate(lp, ref, estimator=est)
        assert not torch.isfinite(k[bad]).any() and torch.isfinite(k[~bad]).all(), est
    mask = ~bad  # the same values under a False mask are ignored
    out = kl_loss(lp.unsqueeze(0), ref.unsqueeze(0), mask.unsqueeze(0))
    assert torch.isfinite(out.loss).all()
    out = kl_loss(lp.unsqueeze(0), ref.unsqueeze(0), torch.ones(1, n, dtype=torch.bool))
    assert torch.isnan(out.loss[0, bad]).all()


def test_kl_controllers_name_bad_scalars():
    from rollkit.losses import AdaptiveKLController

    ctl = AdaptiveKLController(0.1, target=6.0, horizon=100.0)
    with pytest.raises(ValueError, match=r"^current_kl: expected a number, got str$"):
        ctl.update("x", n_steps=1)
    with pytest.raises(ValueError, match=r"^n_steps: expected a number, got str$"):
        ctl.update(1.0, n_steps="x")
    with pytest.raises(ValueError, match=r"^target: expected a number, got str$"):
        AdaptiveKLController(0.1, target="x", horizon=1.0)
    ctl.load_state_dict({"value": torch.tensor(0.5)})  # a 0-dim tensor from a checkpoint is fine
    assert ctl.value == 0.5


# =========================================================================== huge magnitudes (issue 31)

_F32_MAX = float(torch.finfo(torch.float32).max)
EPS = float(torch.finfo(torch.float32).eps)
_HUGE = {"min_value": -_F32_MAX, "max_value": _F32_MAX, "huge": True}
_ESTIMATORS = ("k1", "k2", "k3", "k1+", "k3+")


@settings(max_examples=80)
@given(data=st.data(), estimator=st.sampled_from(_ESTIMATORS), coef=st.sampled_from([0.0, 1e-3, 0.5, 1.0]))
def test_kl_of_huge_finite_log_probs_matches_float64(data, estimator, coef):
    """k2 formed ``0.5 * d^2`` (inf for ``|d| > 1.8e19``, though ``0.5 d^2`` is finite up to
    ``2.6e19``), k3 / k3+ / k1+ gave NaN where ``logprobs - ref_logprobs`` overflowed, the loss
    terms ``coef * inf`` (NaN for ``coef = 0``): now every output is the float64 one rounded."""
    from rollkit.testing import check_float64_agreement, masks

    B, T = data.draw(shapes(max_batch=3, max_len=5))
    m = data.draw(masks(B, T))
    lp = data.draw(float_tensors((B, T), mask=m, garbage_padding=True, **_HUGE))
    ref = data.draw(float_tensors((B, T), mask=m, garbage_padding=True, **_HUGE))
    rewards = data.draw(float_tensors((B,), **_HUGE))
    z = torch.where(m, lp, 0.0), torch.where(m, ref, 0.0)
    # a per-token estimate beyond float32 is inf (checked); the metrics that average it with
    # others are then not comparable with float64's (inf - inf is NaN in any float32 mean)
    k64 = kl_estimate(z[0].double(), z[1].double(), estimator=estimator)
    # the metrics are means of estimates of both signs (k1): accurate to eps * their magnitude
    scale = float(k64.abs().max()) if k64.numel() else 0.0
    # k3 = expm1(x) - x cancels for small log-ratios: accurate to eps * |x| (|x| <= 20), not
    # relative to k3 ~ x^2 / 2
    k3_atol = (
        8 * EPS * (z[0].double() - z[1].double()).abs().clamp(max=20.0) if estimator.startswith("k3") else 0.0
    )
    tol = {
        "rtol": 16 * T * EPS,
        "atol": k3_atol,
        "metric_atol": 4 * B * T * EPS * scale + float(torch.as_tensor(k3_atol).max()),
        "metrics": not bool((k64.abs() > _F32_MAX).any()),
    }
    check_float64_agreement(lambda a, b: kl_estimate(a, b, estimator=estimator), list(z), **tol)
    check_float64_agreement(
        lambda a, b, k: kl_loss(a, b, k, estimator=estimator, coef=coef), [lp, ref, m], **tol
    )
    check_float64_agreement(
        lambda a, b, k: kl_penalty(a, b, k, estimator=estimator, coef=coef), [lp, ref, m], **tol
    )
    penalised = lambda r, a, b, k: apply_kl_penalty(r, a, b, k, estimator=estimator, coef=coef)  # noqa: E731
    if tol["metrics"]:  # else a penalty beyond float32 is inf, though the reward may bring
        check_float64_agreement(  # R - coef * k back into range in float64
            penalised,
            [rewards, lp, ref, m],
            rtol=16 * T * EPS,
            metric_atol=tol["metric_atol"],
            atol=4
            * T
            * EPS
            * float(rewards.double().abs().max() + (z[0].double() - z[1].double()).abs().max() ** 2),
        )
    assert not torch.isnan(penalised(rewards, lp, ref, m)[0]).any()
    # gradients: never NaN; coef * (logprobs - ref_logprobs) for k2 / k1+ / k3+ (where that is
    # beyond float32: inf for k2, float32's largest value for the straight-through estimators)
    x = lp.clone().requires_grad_()
    kl_loss(x, ref, m, estimator=estimator, coef=coef).loss.sum().backward()
    assert not torch.isnan(x.grad).any()
    if estimator in ("k2", "k1+", "k3+"):
        d = coef * torch.where(m, lp.double() - ref.double(), 0.0)
        inside = d.abs() <= _F32_MAX * (1 - 1e-6)
        tiny = torch.finfo(torch.float32).tiny  # results below it are subnormal, rounded coarser
        assert torch.allclose(x.grad[inside], d[inside].float(), rtol=1e-6, atol=2 * tiny), (x.grad, d)
        g = x.grad[~inside].double()
        assert ((g.abs() >= _F32_MAX * (1 - 1e-6)) & (torch.sign(g) == torch.sign(d[~inside]))).all()


def test_kl_issue_examples():
    lp, ref = torch.tensor([-2e19, -3e38, 3e38]), torch.tensor([0.0, 3e38, -3e38])
    assert kl_k2(lp, ref)[0].item() == pytest.approx(2e38, rel=1e-6)  # was inf
    assert torch.isinf(kl_k2(lp, ref)[1:]).all()  # 0.5 * (6e38)^2 is beyond float32
    assert kl_k3(lp, ref).tolist() == pytest.approx([10.0, 10.0, 10.0])  # was NaN: clamped like 21
    assert torch.equal(kl_k1_plus(lp, ref), lp - ref)  # [-2e19, -inf, inf]: was NaN
    one = torch.ones(1, 1, dtype=torch.bool)
    out = kl_loss(torch.tensor([[-1e20]]), torch.tensor([[0.0]]), one, estimator="k2", coef=0.0)
    assert out.loss.item() == 0.0  # was 0 * inf = NaN
    out = kl_loss(torch.tensor([[-1e20]]), torch.tensor([[0.0]]), one, estimator="k2", coef=1e-3)
    assert out.loss.item() == pytest.approx(5e36, rel=1e-6)  # was inf


@settings(max_examples=80)
@given(
    data=st.data(),
    clip=st.sampled_from([None, 0.2, 2.0**100]),  # float32-exact: float64 clips at the same bound
    coef=st.sampled_from([0.0, 0.01, 0.5, 1.0]),
)
def test_value_loss_of_huge_finite_values_matches_float64(data, clip, coef):
    """``(V - R)^2`` overflowed before ``coef`` (0.5 * 4e38 = 2e38 gave inf, 0 * inf NaN) and
    ``values_mean`` summed ``3e38 + 3e38 - 3e38 - 3e38`` to NaN."""
    from rollkit.testing import check_float64_agreement, masks

    B, T = data.draw(shapes(max_batch=3, max_len=5))
    m = data.draw(masks(B, T))
    v, old, ret = (data.draw(float_tensors((B, T), mask=m, garbage_padding=True, **_HUGE)) for _ in range(3))
    run = lambda a, b, c, k: value_loss(a, b, c, k, clip_range=clip, coef=coef)  # noqa: E731
    # V_clip = old + (V - old) cancels when |old| >> |V|: accurate to eps * (|V| + |old|), in
    # float64 too; the loss coef * (V_clip - R)^2 to about coef * 32 eps S^2 with S = |V| + |old| + |R|
    S = torch.where(m, v.double().abs() + old.double().abs() + ret.double().abs(), 0.0)
    mags = torch.where(m, v.double().abs(), 0.0)
    tol = {
        "rtol": 16 * T * EPS,
        "atol": 0.0 if clip is None else coef * 32 * EPS * S * S,
        "metric_atol": 4 * B * T * EPS * float(mags.max()) if mags.numel() else 0.0,
    }
    check_float64_agreement(run, [v, old, ret, m], skip=("metrics['vf_clipfrac']",), **tol)
    # the clip fraction counts strict comparisons: float32 may round a near-tie to a tie
    got, want = run(v, old, ret, m), run(v.double(), old.double(), ret.double(), m)
    ties = 0
    if clip is not None:
        v64, o64, r64 = v.double(), old.double(), ret.double()
        du, dc = (v64 - r64).abs(), (o64 + (v64 - o64).clamp(-clip, clip) - r64).abs()
        slack = 1e-6 * torch.maximum(du, dc) + 8 * EPS * (v64.abs() + o64.abs())  # V_clip's rounding
        ties = int((m & ((dc - du).abs() <= slack)).sum())
    diff = abs(float(got.metrics["vf_clipfrac"]) - float(want.metrics["vf_clipfrac"]))
    assert diff <= ties / max(int(m.sum()), 1) + 1e-6
    x = v.clone().requires_grad_()
    value_loss(x, old, ret, m, clip_range=clip, coef=coef).loss.sum().backward()
    assert not torch.isnan(x.grad).any()


def test_value_loss_issue_examples():
    v, m = torch.tensor([[1e19, -1e19]]), torch.ones(1, 2, dtype=torch.bool)
    out = value_loss(v, -v, -v, m)  # error 2e19: 0.5 * 4e38
    assert out.loss.flatten().tolist() == pytest.approx([2e38, 2e38], rel=1e-6)
    assert value_loss(v, -v, -v, m, coef=0.0).loss.tolist() == [[0.0, 0.0]]
    big = torch.tensor([[3e38, 3e38, -3e38, -3e38]])
    out = value_loss(big, big, big, torch.ones(1, 4, dtype=torch.bool))
    assert out.metrics["values_mean"].item() == 0.0  # was NaN
