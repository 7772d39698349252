"""Tests of rollkit.logprobs: the sampling replay against vLLM's and the HF rollout's samplers,
the sampled-token rule, the lean (chunked LM head) path against the plain one (values and
gradients), gradcheck, the absence of ``[N, V]`` tensors in the lean path, and validation."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from rollkit.logprobs import lean_token_logprobs, outside_support, support_mask, token_logprobs
from trainers.engines.hf_rollout import process_logits

try:
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch
except Exception:  # pragma: no cover - depends on the installed extras
    apply_top_k_top_p_pytorch = None

TEMPS = st.sampled_from([0.3, 0.7, 1.0, 1.3])
TOP_K = st.sampled_from([-1, 0, 1, 2, 5, 16, 40, 64, 100])
TOP_P = st.sampled_from([0.05, 0.3, 0.5, 0.8, 0.9, 0.95, 0.99, 1.0])


def random_logits(seed: int, n: int, V: int, ties: bool, scale: float = 3.0) -> torch.Tensor:
    """``[n, V]`` float32 logits; with ``ties`` rounded to a coarse grid (many exact ties)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, V, generator=g) * scale
    return (x * 2).round() / 2 if ties else x


def tempered(logits: torch.Tensor, t: float) -> torch.Tensor:
    return logits.float() / t if t != 1.0 else logits.float()


def robust_membership(z: torch.Tensor, top_k: int, top_p: float, eps: float = 1e-5):
    """``(surely_kept, surely_removed)`` [n, V] bool, in float64 exact-arithmetic terms: a
    token's top-p fate is decided whatever the order among ties and the float rounding."""
    z = z.double()
    V = z.shape[-1]
    if 0 < top_k < V:
        kth = torch.topk(z, top_k, dim=-1).values[..., -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    p = torch.softmax(z, -1)
    greater = (p.unsqueeze(-2) * (z.unsqueeze(-2) > z.unsqueeze(-1))).sum(-1)  # mass strictly above
    geq = (p.unsqueeze(-2) * (z.unsqueeze(-2) >= z.unsqueeze(-1))).sum(-1) - p  # ... plus ties
    finite = z > float("-inf")
    if top_p >= 1.0:
        return finite, ~finite
    # kept iff the mass before it (strictly above, plus the ties sorted first) is < top_p
    kept = finite & (geq < top_p - eps)
    removed = ~finite | (greater >= top_p + eps)
    return kept, removed


def vllm_logprobs(z: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    V = z.shape[-1]
    n = z.shape[0]
    k = torch.full((n,), top_k, dtype=torch.long) if 0 < top_k < V else None
    p = torch.full((n,), top_p, dtype=torch.float32) if top_p < 1.0 else None
    return torch.log_softmax(apply_top_k_top_p_pytorch(z.clone(), k, p, allow_cpu_sync=True), -1)


# ----------------------------------------------------------------------------- plain path


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 10**6), st.integers(1, 6), st.integers(1, 50), TEMPS, st.booleans())
def test_no_truncation_is_log_softmax(seed, n, V, t, entropy):
    logits = random_logits(seed, n, V, ties=False)
    tok = torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(seed))
    ref = torch.log_softmax(logits / t, -1)
    out = token_logprobs(logits, tok, temperature=t, with_entropy=entropy, top_k=V, top_p=1.0)
    lp = out[0] if entropy else out
    torch.testing.assert_close(lp, ref.gather(-1, tok[:, None]).squeeze(-1), atol=1e-6, rtol=1e-6)
    if entropy:
        torch.testing.assert_close(out[1], -(ref.exp() * ref).sum(-1), atol=1e-5, rtol=1e-6)


@pytest.mark.skipif(apply_top_k_top_p_pytorch is None, reason="vllm not importable")
@settings(max_examples=150, deadline=None)
@given(st.integers(0, 10**6), st.integers(1, 5), st.integers(2, 120), TEMPS, TOP_K, TOP_P, st.booleans())
def test_matches_vllm_apply_top_k_top_p(seed, n, V, t, k, p, ties):
    logits = random_logits(seed, n, V, ties)
    z = tempered(logits, t)
    ref = vllm_logprobs(z, k, p)
    kept = support_mask(logits, temperature=t, top_k=k, top_p=p)
    assert torch.equal(kept, ref > float("-inf"))  # bit-identical kept set (same ops)
    # tokens inside the set: the same log-probs
    g = torch.Generator().manual_seed(seed + 1)
    tok = torch.multinomial(ref.exp(), 1, generator=g).squeeze(-1)
    lp, outside = token_logprobs(logits, tok, temperature=t, top_k=k, top_p=p, return_outside=True)
    assert not outside.any()
    torch.testing.assert_close(lp, ref.gather(-1, tok[:, None]).squeeze(-1), atol=1e-6, rtol=1e-6)


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 10**6), st.integers(1, 5), st.integers(2, 60), TEMPS, TOP_K, TOP_P, st.booleans())
def test_matches_hf_process_logits(seed, n, V, t, k, p, ties):
    """Equal to the HF rollout's sampler wherever the set is decided in exact arithmetic."""
    logits = random_logits(seed, n, V, ties)
    ref = process_logits(logits, t, k, p)
    kept = support_mask(logits, temperature=t, top_k=k, top_p=p)
    sure_in, sure_out = robust_membership(tempered(logits, t), k, p)
    hf_kept = ref > float("-inf")
    for mine in (kept, hf_kept):
        assert not (sure_in & ~mine).any() and not (sure_out & mine).any()
    same = (kept == hf_kept).all(-1)
    assert same.float().mean() >= 0.5 or n == 1  # disagreements are rare boundary cases
    tok = torch.multinomial(ref.exp(), 1, generator=torch.Generator().manual_seed(seed)).squeeze(-1)
    lp = token_logprobs(logits, tok, temperature=t, top_k=k, top_p=p)
    want = ref.gather(-1, tok[:, None]).squeeze(-1)
    torch.testing.assert_close(lp[same], want[same], atol=1e-6, rtol=1e-6)


def test_hf_and_vllm_agree_without_boundary_ties():
    """Continuous random logits: both samplers and the replay give the same sets."""
    for seed in range(20):
        logits = random_logits(seed, 8, 200, ties=False)
        for k, p in [(-1, 0.9), (50, 0.8), (10, 1.0), (-1, 0.3)]:
            kept = support_mask(logits, temperature=0.7, top_k=k, top_p=p)
            assert torch.equal(kept, process_logits(logits, 0.7, k, p) > float("-inf"))


def test_sampled_token_outside_the_set_is_added():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 0.0, 0.0, 0.0]])
    tok = torch.tensor([2, 3])
    lp, ent, outside = token_logprobs(logits, tok, top_p=0.5, with_entropy=True, return_outside=True)
    assert outside.tolist() == [True, False]
    assert torch.equal(outside, outside_support(logits, tok, top_p=0.5))
    # row 0: the set is {0} plus the sampled token 2
    ref0 = torch.log_softmax(torch.tensor([2.0, 0.0]), -1)
    torch.testing.assert_close(lp[0], ref0[1])
    torch.testing.assert_close(ent[0], -(ref0.exp() * ref0).sum())
    # row 1: uniform, top-p 0.5 keeps two tokens (ascending cumulative 0.25, 0.5 <= 0.5 removed)
    torch.testing.assert_close(lp[1], torch.tensor(0.5).log())
    assert torch.isfinite(lp).all()
    lean = lean_token_logprobs(torch.eye(2), logits.T.contiguous(), tok, top_p=0.5, return_outside=True)
    assert lean[1].tolist() == [True, False]


def test_set_is_constant_of_the_forward():
    """Gradient = that of the log-softmax renormalised over the kept set (zero outside)."""
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]], requires_grad=True)
    lp = token_logprobs(logits, torch.tensor([1]), temperature=2.0, top_k=3)
    lp.sum().backward()
    q = torch.softmax(torch.tensor([3.0, 2.0, 1.0]) / 2, -1)
    want = (torch.tensor([0.0, 1.0, 0.0]) - q) / 2
    torch.testing.assert_close(logits.grad[0], torch.cat([want, torch.zeros(2)]))


def test_bf16_logits_are_upcast():
    logits = random_logits(0, 4, 30, ties=False).bfloat16()
    tok = torch.arange(4)
    lp = token_logprobs(logits, tok, top_p=0.9, top_k=10)
    assert lp.dtype == torch.float32
    torch.testing.assert_close(lp, token_logprobs(logits.float(), tok, top_p=0.9, top_k=10), atol=0, rtol=0)


# ----------------------------------------------------------------------------- lean path


def _grads(fn, hidden, weight, bias, tokens, **kw):
    h = hidden.detach().clone().requires_grad_(True)
    w = weight.detach().clone().requires_grad_(True)
    b = None if bias is None else bias.detach().clone().requires_grad_(True)
    out = fn(h, w, b, tokens, **kw)
    outs = out if isinstance(out, tuple) else (out,)
    g = torch.Generator().manual_seed(7)
    loss = sum(
        (o * torch.randn(o.shape, generator=g).to(o.dtype)).sum() for o in outs if o.is_floating_point()
    )
    loss.backward()
    return outs, (h.grad, w.grad, None if b is None else b.grad)


def plain(h, w, b, tokens, **kw):
    logits = h @ w.T if b is None else h @ w.T + b
    kw.pop("chunk_tokens", None)
    return token_logprobs(logits, tokens, **kw)


def lean(h, w, b, tokens, **kw):
    return lean_token_logprobs(h, w, tokens, bias=b, **kw)


def lm_case(seed: int, lead: tuple[int, ...], H: int, V: int, dtype=torch.float32, bias: bool = True):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*lead, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64) / H**0.5 * 2
    b = torch.randn(V, generator=g, dtype=torch.float64) if bias else None
    tokens = torch.randint(0, V, lead, generator=g)
    b = None if b is None else b.to(dtype)
    return hidden.to(dtype), weight.to(dtype), b, tokens


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10**6), st.integers(1, 3), st.integers(1, 9), st.integers(1, 12), TEMPS, TOP_K, TOP_P,
       st.booleans(), st.booleans())  # fmt: skip
def test_lean_equals_plain(seed, B, T, chunk, t, k, p, entropy, bias):
    """Chunks that divide N and that do not; values and gradients of hidden, weight, bias."""
    hidden, weight, b, tokens = lm_case(seed, (B, T), 6, 37, bias=bias)
    kw = dict(temperature=t, top_k=k, top_p=p, with_entropy=entropy, return_outside=True, chunk_tokens=chunk)
    out_l, g_l = _grads(lean, hidden, weight, b, tokens, **kw)
    out_p, g_p = _grads(plain, hidden, weight, b, tokens, **kw)
    assert torch.equal(out_l[-1], out_p[-1])
    for a, c in zip(out_l[:-1], out_p[:-1]):
        assert a.dtype == torch.float32 and a.shape == (B, T)
        torch.testing.assert_close(a, c, atol=1e-6, rtol=1e-6)
    for a, c in zip(g_l, g_p):
        if c is not None:
            torch.testing.assert_close(a, c, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("chunk", [1, 4, 5, 64])
@pytest.mark.parametrize("entropy", [False, True])
def test_lean_equals_float64_reference(chunk, entropy):
    hidden, weight, b, tokens = lm_case(3, (4, 5), 8, 50)
    kw = dict(temperature=0.8, top_k=20, top_p=0.9, with_entropy=entropy, chunk_tokens=chunk)
    out_l, g_l = _grads(lean, hidden, weight, b, tokens, **kw)
    out_r, g_r = _grads(plain, hidden.double(), weight.double(), b.double(), tokens, **kw)
    out_l = out_l if isinstance(out_l, tuple) else (out_l,)
    for a, c in zip(out_l, out_r):
        torch.testing.assert_close(a.double(), c, atol=1e-6, rtol=1e-6)
    for a, c in zip(g_l, g_r):
        torch.testing.assert_close(a.double(), c, atol=1e-6, rtol=1e-5)


def test_lean_bf16():
    hidden, weight, b, tokens = lm_case(5, (3, 7), 16, 64, dtype=torch.bfloat16)
    kw = dict(temperature=0.9, with_entropy=True, chunk_tokens=4)
    (lp, ent), (gh, gw, gb) = _grads(lean, hidden, weight, b, tokens, **kw)
    assert lp.dtype == torch.float32 and gh.dtype == gw.dtype == gb.dtype == torch.bfloat16
    # exactly the float32 computation on the upcast inputs (per-chunk upcast, fp32 math) ...
    (lp32, ent32), g32 = _grads(plain, hidden.float(), weight.float(), b.float(), tokens, **kw)
    torch.testing.assert_close(lp, lp32, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, ent32, atol=1e-5, rtol=1e-5)
    for a, c in zip((gh, gw, gb), g32):  # gradients rounded to bf16 on the way out
        torch.testing.assert_close(a.float(), c, atol=2**-8 * c.abs().max().item(), rtol=2**-7)
    # ... and within bf16 rounding of the logits of the bf16 plain path
    (lpb, entb), _ = _grads(plain, hidden, weight, b, tokens, **kw)
    logits = (hidden @ weight.T + b).float()
    tol = 4 * 2**-8 * logits.abs().max().item() / 0.9
    torch.testing.assert_close(lp, lpb, atol=tol, rtol=0)
    torch.testing.assert_close(ent, entb, atol=tol, rtol=0)


@pytest.mark.parametrize("kw", [dict(), dict(top_k=4, top_p=0.8, temperature=0.7)])
def test_gradcheck_float64(kw):
    hidden, weight, b, tokens = lm_case(11, (2, 3), 3, 9, dtype=torch.float64)
    hidden.requires_grad_(True), weight.requires_grad_(True), b.requires_grad_(True)

    def f(h, w, bb):
        return lean_token_logprobs(h, w, tokens, bias=bb, with_entropy=True, chunk_tokens=4, **kw)

    assert torch.autograd.gradcheck(f, (hidden, weight, b), eps=1e-6, atol=1e-6)

    def g(logits):
        return token_logprobs(logits, tokens, with_entropy=True, **kw)

    logits = (hidden @ weight.T).detach().requires_grad_(True)
    assert torch.autograd.gradcheck(g, (logits,), eps=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_fused_lean_equals_the_eager_lean_path(backend):
    """``fused``: the compiled per-chunk statistics and logit gradients give the eager chunked
    path's values and gradients (a chunk that divides N and one that does not, temperature,
    entropy, bias; a top-k call keeps the eager code). aot_eager checks the traced functions,
    inductor the generated kernels (compiled once for the dynamic chunk length)."""
    hidden, weight, b, tokens = lm_case(7, (3, 7), 8, 40)
    cases = [dict(temperature=0.7, with_entropy=True, chunk_tokens=5), dict(with_entropy=False, chunk_tokens=7),
             dict(top_k=5, with_entropy=True, chunk_tokens=4)]  # fmt: skip
    for kw in cases:
        out_e, g_e = _grads(lean, hidden, weight, b, tokens, **kw)
        out_f, g_f = _grads(lean, hidden, weight, b, tokens, fused=backend, **kw)
        for a, c in zip(
            out_f if isinstance(out_f, tuple) else (out_f,), out_e if isinstance(out_e, tuple) else (out_e,)
        ):
            torch.testing.assert_close(a, c, atol=2e-6, rtol=1e-5)
        for a, c in zip(g_f, g_e):
            torch.testing.assert_close(a, c, atol=2e-6, rtol=1e-5)
    with pytest.raises(TypeError, match="fused"):
        lean_token_logprobs(hidden, weight, tokens, fused=1)


class _MaxNumel(TorchDispatchMode):
    """Records the largest tensor that any aten op produces (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.max_numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for o in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(o, torch.Tensor):
                self.max_numel = max(self.max_numel, o.numel())
        return out


@pytest.mark.parametrize("kw", [dict(with_entropy=True), dict(with_entropy=True, top_k=50, top_p=0.9)])
def test_lean_never_materialises_n_by_v(kw):
    """No op of the lean forward + backward produces a tensor of more than chunk x V elements
    (the plain path, for contrast, produces [N, V] ones)."""
    N, H, V, chunk = 256, 4, 512, 8  # H < chunk: the [V, H] weight gradient is below chunk x V
    hidden, weight, b, tokens = lm_case(0, (N,), H, V, bias=True)
    for fn, bound in ((lean, chunk * V), (plain, None)):
        with _MaxNumel() as m:
            _grads(fn, hidden, weight, b, tokens, chunk_tokens=chunk, **kw)
        if bound is None:
            assert m.max_numel >= N * V
        else:
            assert m.max_numel <= bound < N * V, m.max_numel


# ----------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(temperature=0.0), "temperature"),
        (dict(temperature=-1.0), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=2.5), "top_k"),
        (dict(top_k=True), "top_k"),
    ],
)
def test_bad_hyperparameters(kw, match):
    logits, tok = torch.randn(2, 5), torch.zeros(2, dtype=torch.long)
    with pytest.raises(ValueError, match=match):
        token_logprobs(logits, tok, **kw)
    with pytest.raises(ValueError, match=match):
        lean_token_logprobs(torch.randn(2, 3), torch.randn(5, 3), tok, **kw)
    with pytest.raises(ValueError, match=match):
        support_mask(logits, **kw)


def test_support_mask_refuses_nan_and_pos_inf_logits_by_name():
    """NaN / +inf make the sorted kept set meaningless; -inf (a banned token) is fine."""
    from rollkit.validation import value_checks

    ok = torch.tensor([[2.0, float("-inf"), 1.0, 0.0]])
    assert support_mask(ok, top_k=2).tolist() == [[True, False, True, False]]
    assert outside_support(ok, torch.tensor([1]), top_p=0.9).tolist() == [True]
    for bad, what in ((float("nan"), r"1 NaN and 0 \+inf"), (float("inf"), r"0 NaN and 1 \+inf")):
        logits = torch.tensor([[2.0, 1.0, bad, 0.0], [1.0, 1.0, 1.0, 1.0]])
        for fn, args, kw in (
            (support_mask, (logits,), dict(top_p=0.9)),
            (support_mask, (logits,), {}),
            (outside_support, (logits, torch.tensor([0, 1])), dict(top_k=2)),
        ):
            match = rf"^logits: contains {what} values \(first at index \(0, 2\)\)"
            with pytest.raises(ValueError, match=match) as err:
                fn(*args, **kw)
            assert "\n" not in str(err.value)
        with value_checks(False):  # a data check: off in a hot loop
            assert support_mask(logits, top_k=2).shape == (2, 4)


def test_bad_shapes_and_tokens():
    logits = torch.randn(2, 5)
    with pytest.raises(ValueError, match="tokens: shape"):
        token_logprobs(logits, torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"tokens: must be in \[0, 5\)"):
        token_logprobs(logits, torch.tensor([0, 5]))
    with pytest.raises(ValueError, match=r"tokens: must be in \[0, 5\)"):
        outside_support(logits, torch.tensor([-1, 0]))
    with pytest.raises(ValueError, match="tokens: expected an integer tensor"):
        token_logprobs(logits, torch.zeros(2))
    with pytest.raises(ValueError, match="logits: expected a floating-point"):
        token_logprobs(torch.zeros(2, 5, dtype=torch.long), torch.zeros(2, dtype=torch.long))
    tok = torch.zeros(2, dtype=torch.long)
    with pytest.raises(ValueError, match="weight: expected shape"):
        lean_token_logprobs(torch.randn(2, 3), torch.randn(5, 4), tok)
    with pytest.raises(ValueError, match="bias: expected shape"):
        lean_token_logprobs(torch.randn(2, 3), torch.randn(5, 3), tok, bias=torch.randn(4))
    with pytest.raises(ValueError, match="chunk_tokens"):
        lean_token_logprobs(torch.randn(2, 3), torch.randn(5, 3), tok, chunk_tokens=0)
    with pytest.raises(ValueError, match=r"tokens: must be in \[0, 5\)"):
        lean_token_logprobs(torch.randn(2, 3), torch.randn(5, 3), torch.tensor([0, 7]))


@pytest.mark.parametrize("mdt", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("wdt", [torch.float32, torch.bfloat16])
def test_lean_low_precision_matmul_is_the_autocast_plain_path(mdt, wdt):
    """``matmul_dtype``: the chunk's matmuls in low precision, as the plain path's under
    autocast (its logits rounded to ``mdt``, then float32 softmax); gradients in the inputs'
    dtypes, within the low precision's rounding of the float32 ones."""
    hidden, weight, b, tokens = lm_case(7, (3, 9), 16, 64, dtype=torch.float32)
    hidden, weight = hidden.to(mdt if wdt != torch.float32 else torch.float32), weight.to(wdt)
    kw = dict(temperature=0.9, with_entropy=True, top_k=20, top_p=0.95)
    (lp, ent), (gh, gw, gb) = _grads(lean, hidden, weight, b, tokens, chunk_tokens=5, matmul_dtype=mdt, **kw)
    assert lp.dtype == torch.float32 and gw.dtype == wdt and gh.dtype == hidden.dtype
    # the plain path's logits: the same low-precision product, then float32 (bias added in float32)

    def autocast_plain(h, w, bb, tok, **k):
        return token_logprobs((h.to(mdt) @ w.to(mdt).T).float() + bb, tok, **k)

    (lpa, enta), ga = _grads(autocast_plain, hidden, weight, b, tokens, **kw)
    torch.testing.assert_close(lp, lpa, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, enta, atol=1e-5, rtol=1e-5)
    for x, y in zip((gh, gw, gb), ga):
        torch.testing.assert_close(x.float(), y.float(), atol=2**-7 * y.abs().max().item(), rtol=2**-6)
    # and close to the float32 computation (the low precision's rounding of the logits)
    (lp32, _), _ = _grads(plain, hidden.float(), weight.float(), b, tokens, **kw)
    logits = (hidden.float() @ weight.float().T + b).abs().max().item()
    assert (lp - lp32).abs().max().item() <= 8 * 2**-8 * logits / 0.9


def test_lean_matmul_dtype_float32_is_the_default():
    hidden, weight, b, tokens = lm_case(8, (2, 5), 8, 32, dtype=torch.float32)
    kw = dict(with_entropy=True, chunk_tokens=3)
    a, ga = _grads(lean, hidden, weight, b, tokens, **kw)
    c, gc = _grads(lean, hidden, weight, b, tokens, matmul_dtype=torch.float32, **kw)
    for x, y in zip((*a, *ga), (*c, *gc)):
        assert torch.equal(x, y)
    with pytest.raises(ValueError, match="matmul_dtype"):
        lean_token_logprobs(hidden, weight, tokens, matmul_dtype=torch.int8)
