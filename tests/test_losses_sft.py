"""SFT negative log-likelihood as a [B, T] loss matrix, and sequence log-probs."""

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from rollkit.losses import AGGREGATION_MODES, aggregate, global_normalizers, sequence_logprobs, sft_nll
from rollkit.testing import batches


def test_sft_nll_hand_values_and_metrics():
    lp = torch.tensor([[-1.0, -2.0, float("nan")], [-3.0, float("inf"), 0.0]])
    m = torch.tensor([[True, True, False], [True, False, False]])
    out = sft_nll(lp, m)
    assert torch.equal(out.loss, torch.tensor([[1.0, 2.0, 0.0], [3.0, 0.0, 0.0]]))
    assert float(out.metrics["nll"]) == 2.0
    assert math.isclose(float(out.metrics["ppl"]), math.exp(2.0), rel_tol=1e-6)
    empty = sft_nll(lp, torch.zeros_like(m))
    assert float(empty.metrics["nll"]) == 0.0 and float(empty.metrics["ppl"]) == 1.0


def test_sft_ppl_does_not_overflow_past_float32s_exp_range():
    """exp(nll) overflows float32 past a mean NLL of 88.72; ppl is a float64 scalar."""
    m = torch.ones(1, 2, dtype=torch.bool)
    for nll in (88.0, 100.0, 700.0):
        out = sft_nll(torch.full((1, 2), -nll), m)
        assert float(out.metrics["nll"]) == nll
        assert math.isfinite(float(out.metrics["ppl"]))
        assert math.isclose(float(out.metrics["ppl"]), math.exp(nll), rel_tol=1e-6)
    assert sft_nll(torch.full((1, 2), -710.0), m).metrics["ppl"] == math.inf  # float64's limit


def test_sft_token_mean_is_cross_entropy_with_ignore_index():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 7, generator=g, requires_grad=True)
    ids = torch.randint(0, 7, (3, 5), generator=g)
    m = torch.arange(5)[None, :] < torch.tensor([[5], [2], [3]])
    lp = logits.log_softmax(-1).gather(-1, ids[..., None]).squeeze(-1)
    ours = aggregate(sft_nll(lp, m).loss, m, "token-mean")
    ref = F.cross_entropy(logits.reshape(-1, 7), torch.where(m, ids, -100).reshape(-1), ignore_index=-100)
    torch.testing.assert_close(ours, ref)


@settings(max_examples=40)
@given(batches(garbage_padding=True))
def test_sft_masked_positions_never_leak(b):
    lp = b["logprobs"].clone().requires_grad_()
    m = b["response_mask"]
    out = sft_nll(lp, m)
    (g,) = torch.autograd.grad(aggregate(out.loss, m, "seq-mean-token-mean"), lp)
    assert torch.isfinite(out.loss).all() and torch.all(out.loss[~m] == 0)
    assert torch.isfinite(g).all() and torch.all(g[~m] == 0)
    assert torch.all(g[m] <= 0)  # the NLL always pushes log-probs up
    seq = sequence_logprobs(lp, m)
    assert torch.isfinite(seq).all()
    (g2,) = torch.autograd.grad(seq.sum(), lp)
    assert torch.equal(g2, m.to(g2.dtype))


@settings(max_examples=30)
@given(batches(garbage_padding=True, min_batch=2), st.sampled_from(AGGREGATION_MODES), st.data())
def test_sft_micro_batches_with_global_normalizers_give_the_full_batch(b, mode, data):
    lp0, m = b["logprobs"], b["response_mask"]
    B, T = m.shape
    lp = lp0.clone().requires_grad_()
    whole = aggregate(sft_nll(lp, m).loss, m, mode, norm_length=T)
    (g_whole,) = torch.autograd.grad(whole, lp)
    cuts = sorted(data.draw(st.sets(st.integers(1, B - 1), max_size=B - 1)))
    norms = global_normalizers(m)
    lp = lp0.clone().requires_grad_()
    total = 0.0
    for lo, hi in zip([0, *cuts], [*cuts, B]):
        total = total + aggregate(sft_nll(lp[lo:hi], m[lo:hi]).loss, m[lo:hi], mode, norm_length=T, **norms)
    (g,) = torch.autograd.grad(total, lp)
    torch.testing.assert_close(total, whole, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(g, g_whole, atol=1e-6, rtol=1e-6)


def test_sequence_logprobs_sum_mean_empty_rows_and_padding():
    lp = torch.tensor([[-1.0, -2.0, float("nan")], [float("-inf"), 0.0, 0.0]])
    m = torch.tensor([[True, True, False], [False, False, False]])
    assert torch.equal(sequence_logprobs(lp, m), torch.tensor([-3.0, 0.0]))
    assert torch.equal(sequence_logprobs(lp, m, reduction="mean"), torch.tensor([-1.5, 0.0]))
    wide = torch.cat([lp, torch.full((2, 4), float("nan"))], 1)
    wide_m = torch.cat([m, torch.zeros(2, 4, dtype=torch.bool)], 1)
    for red in ("sum", "mean"):
        assert torch.equal(
            sequence_logprobs(wide, wide_m, reduction=red), sequence_logprobs(lp, m, reduction=red)
        )
    assert sequence_logprobs(lp.to(torch.bfloat16), m).dtype == torch.float32
    assert sft_nll(lp.to(torch.float16), m).loss.dtype == torch.float32


def _raises(match, fn, *args, **kwargs):
    with pytest.raises(ValueError, match=match) as err:
        fn(*args, **kwargs)
    assert "\n" not in str(err.value)


def test_bad_inputs_raise_one_line_errors_naming_the_argument():
    lp = -torch.rand(2, 3)
    m = torch.ones(2, 3, dtype=torch.bool)
    _raises("^logprobs: ", sft_nll, lp[0], m)
    _raises("^logprobs: expected a floating", sft_nll, m.long(), m)
    _raises("^mask: expected a torch.bool mask", sft_nll, lp, m.float())
    _raises("^mask: shape", sequence_logprobs, lp, m[:, :2])
    _raises("^reduction: must be one of", sequence_logprobs, lp, m, reduction="max")
