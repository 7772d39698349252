"""Distillation losses: sampled-token reverse KL (on-policy distillation) and the top-k
forward KL / reverse KL / generalised JSD with their tail conventions."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rollkit.losses import (
    AGGREGATION_MODES,
    aggregate,
    distill_token_rewards,
    gather_topk_logprobs,
    global_normalizers,
    on_policy_distill,
    topk_forward_kl,
    topk_jsd,
    topk_reverse_kl,
)
from rollkit.testing import batches

TOPK = {
    "forward": lambda s, t, m, **kw: topk_forward_kl(s, t, m, **kw),
    "reverse": lambda s, t, m, **kw: topk_reverse_kl(s, t, m, **kw),
    "jsd": lambda s, t, m, **kw: topk_jsd(s, t, m, beta=0.3, **kw),
}


def _topk_inputs(B, T, V, K, *, seed=0, dtype=torch.float64):
    """Student / teacher logits and the teacher's top-k ids and log-probs."""
    g = torch.Generator().manual_seed(seed)
    s_logits = torch.randn(B, T, V, generator=g, dtype=dtype) * 2
    t_logits = torch.randn(B, T, V, generator=g, dtype=dtype) * 2
    t_lp = t_logits.log_softmax(-1)
    top_lp, ids = t_lp.topk(K, dim=-1)
    return s_logits, t_logits, ids, top_lp


def _coarse(p_full: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """[..., K + 1] probabilities: the top-k ids, then everything else (float64, by hand)."""
    top = p_full.gather(-1, ids)
    return torch.cat([top, 1 - top.sum(-1, keepdim=True)], -1)


def _kl64(p, q):
    return (p * (p.log() - q.log())).sum(-1)


# =========================================================================== sampled token


def test_token_rewards_hand_values_masked_and_detached():
    lp = torch.tensor([[-1.0, -2.0, float("nan")]], requires_grad=True)
    teacher = torch.tensor([[-0.5, -3.0, float("inf")]])
    m = torch.tensor([[True, True, False]])
    r = distill_token_rewards(lp, teacher, m, coef=2.0)
    assert torch.equal(r, torch.tensor([[1.0, -2.0, 0.0]]))
    assert not r.requires_grad


@settings(max_examples=40)
@given(batches(garbage_padding=True))
def test_advantage_and_loss_are_zero_when_teacher_is_student(b):
    lp = b["logprobs"].clone().requires_grad_()
    m = b["response_mask"]
    assert torch.equal(distill_token_rewards(lp, lp.detach(), m), torch.zeros_like(lp))
    out = on_policy_distill(lp, lp.detach(), m)
    out.loss.sum().backward()
    assert torch.equal(out.loss, torch.zeros_like(out.loss))
    assert torch.equal(lp.grad, torch.zeros_like(lp))
    assert float(out.metrics["reverse_kl"]) == 0.0 and float(out.metrics["reverse_kl_k3"]) == 0.0


@settings(max_examples=40)
@given(batches(garbage_padding=True))
def test_on_policy_distill_masked_positions_never_leak(b):
    lp = b["logprobs"].clone().requires_grad_()
    m = b["response_mask"]
    teacher = b["ref_logprobs"]  # garbage (NaN / inf) under the mask too
    out = on_policy_distill(lp, teacher, m, coef=0.5)
    (g,) = torch.autograd.grad(aggregate(out.loss, m, "token-mean"), lp)
    assert torch.isfinite(out.loss).all() and torch.isfinite(g).all()
    assert torch.all(out.loss[~m] == 0) and torch.all(g[~m] == 0)
    assert all(torch.isfinite(v) for v in out.metrics.values())
    adv = distill_token_rewards(lp, teacher, m, coef=0.5)
    assert torch.all(adv[~m] == 0)
    # the gradient is the sampled-token reverse KL's: coef * (log pi_s - log pi_t) on valid tokens
    n = m.sum().clamp(min=1)
    expected = torch.where(m, 0.5 * (b["logprobs"] - teacher), 0.0) / n
    torch.testing.assert_close(g, expected)


def test_on_policy_distill_expected_gradient_is_the_reverse_kl_gradient():
    """Exact expectation over a categorical: sum_y pi_s(y) grad L(y) = grad KL(pi_s || pi_t)."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(7, generator=g, dtype=torch.float64, requires_grad=True)
    t_lp = torch.randn(7, generator=g, dtype=torch.float64).log_softmax(-1)
    lp = logits.log_softmax(-1)
    # one "token" per vocabulary entry, each weighted by its probability under the student
    out = on_policy_distill(lp[None, :], t_lp[None, :], torch.ones(1, 7, dtype=torch.bool))
    (pg,) = torch.autograd.grad((lp.exp().detach() * out.loss[0]).sum(), logits)
    lp = logits.log_softmax(-1)
    kl = (lp.exp() * (lp - t_lp)).sum()
    (exact,) = torch.autograd.grad(kl, logits)
    torch.testing.assert_close(pg, exact, atol=1e-12, rtol=1e-10)


def test_on_policy_distill_matches_vanilla_pg_with_the_distill_advantage():
    from rollkit.losses import vanilla_pg

    g = torch.Generator().manual_seed(1)
    lp = -torch.rand(3, 5, generator=g)
    teacher = -torch.rand(3, 5, generator=g)
    m = torch.rand(3, 5, generator=g) > 0.3
    adv = distill_token_rewards(lp, teacher, m)
    a = on_policy_distill(lp.clone().requires_grad_(), teacher, m).loss
    b = vanilla_pg(lp.clone().requires_grad_(), lp, adv, m).loss
    torch.testing.assert_close(a, b)


# =========================================================================== top-k


def test_gather_topk_logprobs_is_the_full_log_softmax_and_applies_temperature():
    s, _, ids, _ = _topk_inputs(2, 3, 6, 2)
    torch.testing.assert_close(gather_topk_logprobs(s, ids), s.log_softmax(-1).gather(-1, ids))
    torch.testing.assert_close(
        gather_topk_logprobs(s, ids, temperature=2.0), (s / 2).log_softmax(-1).gather(-1, ids)
    )
    out = gather_topk_logprobs(s.to(torch.bfloat16), ids)
    assert out.dtype == torch.float32


@pytest.mark.parametrize("K", [1, 3, 6])
def test_topk_bucket_equals_the_kl_of_the_coarsened_distributions(K):
    """Independent float64 formula: the K top ids plus one 'other' outcome, by hand."""
    s_logits, t_logits, ids, top_t = _topk_inputs(2, 4, 6, K, seed=K)
    m = torch.ones(2, 4, dtype=torch.bool)
    top_s = gather_topk_logprobs(s_logits, ids)
    P = _coarse(t_logits.softmax(-1), ids)
    Q = _coarse(s_logits.softmax(-1), ids)
    if K == 6:  # the tail is rounding only: drop it (0 log 0 = 0)
        P, Q = P[..., :-1], Q[..., :-1]
    torch.testing.assert_close(topk_forward_kl(top_s, top_t, m).loss, _kl64(P, Q), atol=1e-10, rtol=1e-8)
    torch.testing.assert_close(topk_reverse_kl(top_s, top_t, m).loss, _kl64(Q, P), atol=1e-10, rtol=1e-8)
    beta = 0.3
    M = beta * P + (1 - beta) * Q
    jsd = beta * _kl64(P, M) + (1 - beta) * _kl64(Q, M)
    torch.testing.assert_close(topk_jsd(top_s, top_t, m, beta=beta).loss, jsd, atol=1e-10, rtol=1e-8)


def test_topk_renormalize_is_the_kl_of_the_conditionals():
    s_logits, _, ids, top_t = _topk_inputs(2, 3, 8, 3, seed=5)
    m = torch.ones(2, 3, dtype=torch.bool)
    top_s = gather_topk_logprobs(s_logits, ids)
    P = top_t.exp() / top_t.exp().sum(-1, keepdim=True)
    Q = top_s.exp() / top_s.exp().sum(-1, keepdim=True)
    out = topk_forward_kl(top_s, top_t, m, tail="renormalize")
    torch.testing.assert_close(out.loss, _kl64(P, Q))
    torch.testing.assert_close(topk_reverse_kl(top_s, top_t, m, tail="renormalize").loss, _kl64(Q, P))


@pytest.mark.parametrize("name", list(TOPK))
def test_topk_bucket_is_a_lower_bound_of_the_full_kl_and_tight_at_k_equals_v(name):
    """Data processing: coarsening to K + 1 outcomes never increases a divergence."""
    V = 9
    s_logits, _, ids, top_t = _topk_inputs(3, 4, V, V, seed=11)
    m = torch.ones(3, 4, dtype=torch.bool)
    full = TOPK[name](gather_topk_logprobs(s_logits, ids), top_t, m).loss
    for K in (1, 4, 8):
        top_lp, ids_k = top_t[..., :K], ids[..., :K]
        part = TOPK[name](gather_topk_logprobs(s_logits, ids_k), top_lp, m).loss
        assert torch.all(part >= -1e-12) and torch.all(part <= full + 1e-12), (name, K)
    # K = V: the tail is empty and both conventions agree with the full-vocabulary divergence
    ren = TOPK[name](gather_topk_logprobs(s_logits, ids), top_t, m, tail="renormalize").loss
    torch.testing.assert_close(full, ren, atol=1e-12, rtol=1e-10)


def test_topk_full_vocabulary_in_float32_has_a_finite_rounding_tail():
    s_logits, _, ids, top_t = _topk_inputs(4, 8, 50, 50, seed=2, dtype=torch.float32)
    m = torch.ones(4, 8, dtype=torch.bool)
    s_logits.requires_grad_()
    for name, fn in TOPK.items():
        top_s = gather_topk_logprobs(s_logits, ids)
        bucket = fn(top_s, top_t, m).loss
        ren = fn(top_s, top_t, m, tail="renormalize").loss
        assert torch.isfinite(bucket).all(), name
        torch.testing.assert_close(bucket, ren, atol=2e-5, rtol=1e-4)
        (g,) = torch.autograd.grad(bucket.sum(), s_logits)
        assert torch.isfinite(g).all(), name


def test_topk_matches_trl_generalized_jsd_loss_on_the_full_vocabulary():
    """TRL's GKDTrainer.generalized_jsd_loss (its own code, K = V) to 1e-6, every beta."""
    pytest.importorskip("trl")
    gkd = pytest.importorskip("trl.experimental.gkd")
    B, T, V = 3, 5, 11
    s_logits, t_logits, ids, top_t = _topk_inputs(B, T, V, V, seed=7)
    m = torch.arange(T)[None, :] < torch.tensor([[5], [2], [4]])
    labels = torch.where(m, 1, -100)
    for temperature in (1.0, 2.0):
        t_scaled = (t_logits / temperature).log_softmax(-1)
        top_t = t_scaled.gather(-1, ids)
        for beta in (0.0, 0.1, 0.5, 0.9, 1.0):
            s = s_logits.clone().requires_grad_()
            ref = gkd.GKDTrainer.generalized_jsd_loss(s, t_logits, labels, beta=beta, temperature=temperature)
            (g_ref,) = torch.autograd.grad(ref, s)
            for tail in ("bucket", "renormalize"):
                s = s_logits.clone().requires_grad_()
                top_s = gather_topk_logprobs(s, ids, temperature=temperature)
                out = topk_jsd(top_s, top_t, m, beta=beta, tail=tail)
                ours = aggregate(out.loss, m, "token-mean")  # TRL's "batchmean" over labels != -100
                torch.testing.assert_close(ours, ref, atol=1e-6, rtol=1e-6, msg=f"{beta} {tail}")
                (g,) = torch.autograd.grad(ours, s)
                torch.testing.assert_close(g, g_ref, atol=1e-6, rtol=1e-6)
    # the KL special cases are topk_forward_kl / topk_reverse_kl
    fwd = topk_forward_kl(gather_topk_logprobs(s_logits, ids), t_logits.log_softmax(-1).gather(-1, ids), m)
    ref = gkd.GKDTrainer.generalized_jsd_loss(s_logits, t_logits, labels, beta=0.0)
    torch.testing.assert_close(aggregate(fwd.loss, m, "token-mean"), ref, atol=1e-6, rtol=1e-6)


def test_jsd_beta_limits_are_the_rescaled_kls():
    s_logits, _, ids, top_t = _topk_inputs(2, 3, 7, 4, seed=9)
    m = torch.ones(2, 3, dtype=torch.bool)
    top_s = gather_topk_logprobs(s_logits, ids)
    fwd = topk_forward_kl(top_s, top_t, m).loss
    rev = topk_reverse_kl(top_s, top_t, m).loss
    torch.testing.assert_close(topk_jsd(top_s, top_t, m, beta=0.0).loss, fwd)
    torch.testing.assert_close(topk_jsd(top_s, top_t, m, beta=1.0).loss, rev)
    eps = 1e-6
    torch.testing.assert_close(topk_jsd(top_s, top_t, m, beta=eps).loss / eps, fwd, rtol=1e-4, atol=1e-8)
    torch.testing.assert_close(topk_jsd(top_s, top_t, m, beta=1 - eps).loss / eps, rev, rtol=1e-4, atol=1e-8)
    half = topk_jsd(top_s, top_t, m, beta=0.5).loss
    assert torch.all(half >= 0) and torch.all(half <= math.log(2))


@st.composite
def _topk_batch(draw):
    b = draw(batches(garbage_padding=True, max_batch=5, max_len=6))
    B, T = b["logprobs"].shape
    K = draw(st.integers(1, 4))
    V = K + draw(st.integers(0, 3))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    s_logits = torch.randn(B, T, V, generator=g) * 2
    t_lp = (torch.randn(B, T, V, generator=g) * 2).log_softmax(-1)
    top_t, ids = t_lp.topk(K, dim=-1)
    m = b["response_mask"]
    nan = torch.full((), float("nan"))
    top_t = torch.where(m[..., None], top_t, nan)  # garbage padding in the teacher's top-k too
    return s_logits, ids, top_t, m


@settings(max_examples=40)
@given(_topk_batch(), st.sampled_from(list(TOPK)), st.sampled_from(["bucket", "renormalize"]))
def test_topk_masked_positions_never_leak(batch, name, tail):
    s_logits, ids, top_t, m = batch
    s_logits = s_logits.requires_grad_()
    top_s = gather_topk_logprobs(s_logits, ids)
    top_s = torch.where(m[..., None], top_s, torch.full((), float("nan")))  # and in the student's
    out = TOPK[name](top_s, top_t, m, tail=tail)
    (g,) = torch.autograd.grad(aggregate(out.loss, m, "token-mean"), s_logits)
    assert torch.isfinite(out.loss).all() and torch.all(out.loss[~m] == 0)
    assert torch.all(out.loss >= -1e-6)
    assert torch.isfinite(g).all() and torch.all(g[~m] == 0)
    assert all(torch.isfinite(v) for v in out.metrics.values())


# =========================================================================== bucket precision
#
# The bucket tail 1 - sum_k p_k of float32 log-probs is computed in float64 and floored at the
# inputs' rounding level tau = (1 + ln K) eps: float32 inputs give float64's loss and gradient.


def _tau(K, dtype=torch.float32):
    return (1 + math.log(K)) * max(torch.finfo(dtype).eps, torch.finfo(torch.float32).eps)


def _confident(B, V, K, tail, *, seed, noise, student_tail=None):
    """float64 teacher logits whose K random ids hold 1 - tail (tail log-normal around ``tail``),
    student logits = teacher + noise (or with their own top-k tail around ``student_tail``)."""
    g = torch.Generator().manual_seed(seed)

    def boosted(z, ids, t):
        if ids.shape[-1] == z.shape[-1]:  # K = V: no tail to set
            return z * 3
        top = torch.zeros_like(z, dtype=torch.bool).scatter(-1, ids, True)
        t = (t * torch.exp(torch.randn(*z.shape[:-1], 1, generator=g, dtype=z.dtype))).clamp(max=0.5)
        rest = torch.where(top, -math.inf, z).logsumexp(-1, keepdim=True)
        inside = torch.where(top, z, -math.inf).logsumexp(-1, keepdim=True)
        return torch.where(top, z + rest - inside + torch.log1p(-t) - torch.log(t), z)

    z = torch.randn(B, 1, V, generator=g, dtype=torch.float64)
    ids = torch.rand(B, 1, V, generator=g).argsort(-1)[..., :K]
    t_logits = boosted(z, ids, torch.tensor(tail, dtype=torch.float64))
    s_logits = t_logits + noise * torch.randn(B, 1, V, generator=g, dtype=torch.float64)
    if student_tail is not None:
        s_logits = boosted(s_logits, ids, torch.tensor(student_tail, dtype=torch.float64))
    return s_logits, t_logits, ids


def _loss_and_grad(fn, s, t, m, **kw):
    s = s.detach().clone().requires_grad_()
    out = fn(s, t, m, **kw)
    (g,) = torch.autograd.grad(out.loss.sum(), s)
    return out.loss.detach(), g


@pytest.mark.parametrize("tail", [1e-3, 1e-6])
@pytest.mark.parametrize("name", list(TOPK))
def test_float32_matches_float64_on_confident_teachers(name, tail):
    """Issue 31: V = 1000, top-20, tails around 1e-3 / 1e-6. Before the fix, float32 gradients
    were off from the float64 ones of the same inputs by up to 374 (0.09 at 1e-3)."""
    s_logits, t_logits, ids = _confident(500, 1000, 20, tail, seed=0, noise=2.0)
    m = torch.ones(500, 1, dtype=torch.bool)
    s32 = gather_topk_logprobs(s_logits.float(), ids)
    t32 = gather_topk_logprobs(t_logits.float(), ids)
    l32, g32 = _loss_and_grad(TOPK[name], s32, t32, m)
    l64, g64 = _loss_and_grad(TOPK[name], s32.double(), t32.double(), m)
    torch.testing.assert_close(l32.double(), l64, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(g32.double(), g64, atol=1e-5, rtol=1e-5)
    # and from the logits, against the float64 pipeline of the exact (float64) logits
    for dtype in (torch.float32, torch.float64):
        x = s_logits.to(dtype).requires_grad_()
        out = TOPK[name](gather_topk_logprobs(x, ids), gather_topk_logprobs(t_logits.to(dtype), ids), m)
        (gx,) = torch.autograd.grad(out.loss.sum(), x)
        if dtype == torch.float32:
            l_32, g_32 = out.loss.detach().double(), gx.double()
    torch.testing.assert_close(l_32, out.loss.detach(), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(g_32, gx, atol=1e-5, rtol=1e-4)


@st.composite
def _hard_topk(draw):
    """float32 top-k log-probs at the bucket's edges: a confident teacher (tail 1e-9 .. 1e-1)
    or a full-vocabulary top-k (K = V), and a student near the teacher, more or less confident
    than it, with no mass on the top-k (-inf, or -200: 0 in float32), or with -inf entries."""
    V = draw(st.sampled_from([2, 7, 60, 400]))
    K = draw(st.sampled_from(sorted({1, max(1, V // 3), V - 1 if V > 1 else 1, V})))
    tail = 10.0 ** draw(st.floats(-9, -1))
    kind = draw(st.sampled_from(["near", "confident", "loose", "zero", "-inf", "some -inf"]))
    seed = draw(st.integers(0, 2**16))
    B = 3
    s_logits, t_logits, ids = _confident(
        B,
        V,
        K,
        tail,
        seed=seed,
        noise=0.3 if kind == "near" else 2.0,
        student_tail={"confident": tail * 1e-3, "loose": min(10 * tail, 0.5)}.get(kind),
    )
    s = gather_topk_logprobs(s_logits.float(), ids)
    t = gather_topk_logprobs(t_logits.float(), ids)
    if kind == "zero":
        s = torch.full_like(s, -200.0)
    elif kind == "-inf":
        s = torch.full_like(s, -math.inf)
    elif kind == "some -inf":
        s = s.masked_fill(torch.rand(s.shape, generator=torch.Generator().manual_seed(seed)) < 0.5, -math.inf)
    return s, t, K


@settings(max_examples=150, deadline=None)
@given(_hard_topk(), st.sampled_from([0.0, 0.1, 0.5, 0.9, 1.0]))
def test_bucket_float32_agrees_with_float64_and_has_a_finite_gradient(batch, beta):
    """Property: float32 loss and gradient (w.r.t. the student's top-k log-probs) equal the
    float64 ones of the same inputs; the gradient is finite wherever the loss is; loss >= -tau."""
    s, t, K = batch
    m = torch.ones(s.shape[:2], dtype=torch.bool)
    l32, g32 = _loss_and_grad(topk_jsd, s, t, m, beta=beta)
    l64, g64 = _loss_and_grad(topk_jsd, s.double(), t.double(), m, beta=beta)
    fin = torch.isfinite(l64)
    assert torch.equal(torch.isfinite(l32), fin)
    assert torch.equal(l32[~fin], l64[~fin].float())  # +inf: forward KL to a zero-mass student
    assert torch.isfinite(g32[fin]).all() and torch.isfinite(g64[fin]).all()
    torch.testing.assert_close(l32[fin].double(), l64[fin], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(g32[fin].double(), g64[fin], atol=1e-5, rtol=1e-5)
    assert torch.all(l32[fin] >= -_tau(K) - 1e-6)


def test_full_vocabulary_tail_is_zero_and_float32_equals_float64():
    """K = V: the tails are rounding residue (<= tau), so they are 0 in float32 and float64
    alike, and the bucket equals the top-k sum alone. The issue's case: a student with no mass
    on the top-k gave a reverse KL of 15.94 in float32 and 36.04 in float64."""
    V = 50
    g = torch.Generator().manual_seed(1)
    z = torch.randn(64, 1, V, generator=g) * 3
    top_t, ids = z.log_softmax(-1).topk(V, dim=-1)
    t = gather_topk_logprobs(z, ids)
    s = gather_topk_logprobs(torch.randn(64, 1, V, generator=g) * 3, ids)
    m = torch.ones(64, 1, dtype=torch.bool)
    for x in (s, t, top_t):  # gather's and log_softmax's float32 residues are below tau
        assert torch.all((1 - x.double().exp().sum(-1)).abs() <= _tau(V))
    fwd = topk_forward_kl(s, t, m).loss
    torch.testing.assert_close(fwd, (t.exp() * (t - s)).sum(-1), atol=1e-6, rtol=1e-6)
    zero = torch.full((1, 1, V), -200.0)
    for dtype in (torch.float32, torch.float64):
        rev = topk_reverse_kl(zero.to(dtype), t[:1].to(dtype), m[:1]).loss
        assert math.isclose(float(rev), -math.log(_tau(V)), rel_tol=1e-6)  # 1 * log(1 / tau)


@pytest.mark.parametrize("fill", [-math.inf, -200.0])
def test_zero_mass_student_has_a_finite_gradient(fill):
    """The student gives probability 0 to the whole top-k: tail 1. Reverse KL and JSD are
    finite with the exact gradient 0; the forward KL is +inf (-inf log-probs) with gradient -p_t."""
    g = torch.Generator().manual_seed(2)
    top_t, _ = (torch.randn(2, 3, 100, generator=g) * 3).log_softmax(-1).topk(5, dim=-1)
    m = torch.ones(2, 3, dtype=torch.bool)
    s = torch.full((2, 3, 5), fill)
    tail_t = -torch.expm1(top_t.double().logsumexp(-1)).float()
    for name, fn in TOPK.items():
        loss, grad = _loss_and_grad(fn, s, top_t, m)
        assert torch.isfinite(grad).all(), name
        if name == "forward":
            torch.testing.assert_close(grad, -top_t.exp())
            assert torch.isinf(loss).all() if fill == -math.inf else torch.isfinite(loss).all()
        else:
            assert torch.equal(grad, torch.zeros_like(grad)), name
    rev = topk_reverse_kl(s, top_t, m).loss  # all the student's mass is in the tail: -log p_t,tail
    torch.testing.assert_close(rev, -tail_t.log())
    jsd = topk_jsd(s, top_t, m, beta=0.5).loss  # M = (P_t + P_s) / 2; P_s = (0, .., 0, 1)
    teacher_part = math.log(2) * (1 - tail_t) + tail_t * torch.log(2 * tail_t / (1 + tail_t))
    ref = 0.5 * teacher_part + 0.5 * torch.log(2 / (1 + tail_t))
    torch.testing.assert_close(jsd, ref)


def test_the_bucket_floor_is_float32s_whatever_the_inputs_dtype():
    """A tail <= tau = (1 + ln K) eps is 0, eps float32's: bfloat16 inputs are upcast first, so
    a 0.005 tail (below bfloat16's own eps-based floor, ~0.013 at K = 2) is mass, as in float32.
    Before, the floor was the inputs' own eps and a bfloat16 teacher's tail was dropped."""
    K = 2
    assert _tau(K, torch.bfloat16) > 0.005 > _tau(K)
    t16 = torch.log(torch.tensor([[[0.6, 0.395]]])).to(torch.bfloat16)  # tail ~0.005 (bf16-rounded)
    s = torch.log(torch.tensor([[[0.5, 0.3]]]))  # tail 0.2
    m = torch.ones(1, 1, dtype=torch.bool)
    t = t16.float()
    tail_t = float(-torch.expm1(t.double().logsumexp(-1)))
    assert 0 < tail_t < _tau(K, torch.bfloat16)
    top = float((t.exp() * (t - s)).sum())
    with_tail = top + tail_t * math.log(tail_t / 0.2)
    assert math.isclose(float(topk_forward_kl(s, t, m).loss), with_tail, rel_tol=1e-5)
    assert torch.equal(topk_forward_kl(s, t16, m).loss, topk_forward_kl(s, t, m).loss)  # tail kept
    # float64 inputs take float32's floor: the reference of a float32 run computes the same loss
    tiny = torch.tensor([[[-0.5 * _tau(1)]]], dtype=torch.float64)  # tail ~tau / 2
    one = torch.zeros(1, 1, 1, dtype=torch.float64)
    # the tail term, (tau / 2) log(1 / 2) with a float64 floor, is dropped
    top_only = float(tiny.exp() * tiny)
    assert math.isclose(float(topk_forward_kl(one, tiny, m).loss), top_only, rel_tol=1e-12)
    assert math.isclose(float(topk_forward_kl(one.float(), tiny.float(), m).loss), top_only, rel_tol=1e-6)


def test_gather_topk_logprobs_has_an_accurate_normaliser():
    """torch's CPU log_softmax misstates a large vocabulary's normaliser by up to ~1e-4 (in
    float32), and so the tail of every top-k; gather_topk_logprobs keeps it to a few ulps."""
    g = torch.Generator().manual_seed(0)
    V, K = 150_000, 20
    z = torch.randn(16, 1, V, generator=g, dtype=torch.float64) * 2
    z[..., :K] += 15 + torch.randn(16, 1, K, generator=g, dtype=torch.float64)
    ids = torch.arange(K).expand(16, 1, K)
    exact = -torch.expm1(z.float().double().log_softmax(-1)[..., :K].logsumexp(-1))
    ours = -torch.expm1(gather_topk_logprobs(z.float(), ids).double().logsumexp(-1))
    assert float((ours - exact).abs().max()) < 2 * _tau(K)
    # same gradient as log_softmax(x).gather (float64 gradcheck, and float32 against autograd's)
    x = torch.randn(2, 3, 9, generator=g, dtype=torch.float64, requires_grad=True)
    i = torch.randint(0, 9, (2, 3, 4), generator=g)
    assert torch.autograd.gradcheck(lambda x: gather_topk_logprobs(x, i, temperature=0.7), (x,))
    x32 = (torch.randn(2, 3, 9, generator=g) * 5).requires_grad_()
    w = torch.randn(2, 3, 4, generator=g)
    (a,) = torch.autograd.grad((gather_topk_logprobs(x32, i) * w).sum(), x32)
    (b,) = torch.autograd.grad((x32.log_softmax(-1).gather(-1, i) * w).sum(), x32)
    torch.testing.assert_close(a, b)


# =========================================================================== micro-batching


def _loss_fns():
    g = torch.Generator().manual_seed(4)
    B, T, V, K = 7, 6, 9, 3
    s_logits, _, ids, top_t = _topk_inputs(B, T, V, K, seed=4, dtype=torch.float32)
    teacher = -torch.rand(B, T, generator=g) * 3
    m = torch.arange(T)[None, :] < torch.tensor([[6], [0], [1], [3], [6], [2], [5]])
    m[0, 2] = False
    fns = {
        "on_policy_distill": lambda lg, rows: on_policy_distill(
            lg.log_softmax(-1)[..., 0][rows], teacher[rows], m[rows]
        ),
        "topk_forward_kl": lambda lg, rows: topk_forward_kl(
            gather_topk_logprobs(lg, ids)[rows], top_t[rows], m[rows]
        ),
        "topk_reverse_kl": lambda lg, rows: topk_reverse_kl(
            gather_topk_logprobs(lg, ids)[rows], top_t[rows], m[rows]
        ),
        "topk_jsd": lambda lg, rows: topk_jsd(gather_topk_logprobs(lg, ids)[rows], top_t[rows], m[rows]),
    }
    return s_logits, m, fns


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
@pytest.mark.parametrize("name", ["on_policy_distill", "topk_forward_kl", "topk_reverse_kl", "topk_jsd"])
def test_micro_batches_with_global_normalizers_give_the_full_batch(name, mode):
    """The verl #7200 property: the objective does not depend on the micro-batch split."""
    s_logits, m, fns = _loss_fns()
    fn = fns[name]
    B = m.shape[0]
    lg = s_logits.clone().requires_grad_()
    whole = aggregate(fn(lg, slice(None)).loss, m, mode, norm_length=6)
    (g_whole,) = torch.autograd.grad(whole, lg)
    norms = global_normalizers(m)
    for splits in ([1] * B, [3, 4], [2, 2, 3]):
        lg = s_logits.clone().requires_grad_()
        total, start = 0.0, 0
        for size in splits:
            rows = slice(start, start + size)
            total = total + aggregate(fn(lg, rows).loss, m[rows], mode, norm_length=6, **norms)
            start += size
        (g,) = torch.autograd.grad(total, lg)
        torch.testing.assert_close(total, whole, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(g, g_whole, atol=1e-6, rtol=1e-6)


# =========================================================================== dtypes, errors


def test_half_precision_is_computed_in_float32():
    s_logits, _, ids, top_t = _topk_inputs(2, 3, 6, 2, dtype=torch.float32)
    m = torch.ones(2, 3, dtype=torch.bool)
    top_s = gather_topk_logprobs(s_logits, ids).to(torch.bfloat16)
    top_t = top_t.to(torch.bfloat16)
    for tail in ("bucket", "renormalize"):
        assert topk_jsd(top_s, top_t, m, tail=tail).loss.dtype == torch.float32
    # the same values in float32 give the same loss, either tail (tests/test_half_precision.py)
    for tail in ("bucket", "renormalize"):
        out = topk_jsd(top_s, top_t, m, tail=tail)
        ref = topk_jsd(top_s.float(), top_t.float(), m, tail=tail)
        assert torch.equal(out.loss, ref.loss)
    lp = -torch.rand(2, 3).to(torch.bfloat16)
    assert on_policy_distill(lp, lp, m).loss.dtype == torch.float32


def _raises(match, fn, *args, **kwargs):
    with pytest.raises(ValueError, match=match) as err:
        fn(*args, **kwargs)
    assert "\n" not in str(err.value)


def test_bad_inputs_raise_one_line_errors_naming_the_argument():
    lp = -torch.rand(2, 3)
    m = torch.ones(2, 3, dtype=torch.bool)
    _raises("^teacher_logprobs: shape", on_policy_distill, lp, lp[:, :2], m)
    _raises("^mask: expected a torch.bool mask", on_policy_distill, lp, lp, m.float())
    _raises("^coef: must be finite", on_policy_distill, lp, lp, m, coef=float("nan"))
    _raises("^logprobs: ", distill_token_rewards, lp[0], lp, m)
    s = -torch.rand(2, 3, 4)
    _raises("^teacher_topk_logprobs: shape", topk_forward_kl, s, s[..., :3], m)
    _raises("^student_topk_logprobs: ", topk_forward_kl, lp, lp, m)
    _raises("^mask: ", topk_reverse_kl, s, s, m[:, :2])
    _raises("^tail: must be one of", topk_jsd, s, s, m, tail="drop")
    _raises(r"^beta: must be in \[0.0, 1.0\]", topk_jsd, s, s, m, beta=1.5)
    _raises("^student_topk_logprobs: needs at least one", topk_jsd, s[..., :0], s[..., :0], m)
    ids = torch.zeros(2, 3, 4, dtype=torch.long)
    _raises(
        r"^topk_ids: must be in \[0, 4\) \(the vocabulary of logits\), got values in \[0, 4\]$",
        gather_topk_logprobs,
        s,
        ids.index_fill(-1, torch.tensor([1]), 4),
    )
    _raises(r"^topk_ids: must be in \[0, 4\)", gather_topk_logprobs, s, ids - 1)
    _raises(
        r"^logits: expected shape \[B, T, V\] with V >= 1", gather_topk_logprobs, s[..., :0], ids[..., :0]
    )
    _raises("^topk_ids: expected an integer tensor", gather_topk_logprobs, s, ids.float())
    _raises("^topk_ids: shape", gather_topk_logprobs, s, ids[:1])
    _raises("^temperature: must be > 0", gather_topk_logprobs, s, ids, temperature=0.0)
