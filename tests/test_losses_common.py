"""The private helpers shared by the loss modules (rollkit.losses._common)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings

from rollkit.losses._common import (
    check_seq_or_token,
    check_token_tensors,
    compute_dtype,
    masked_stat,
    safe_div,
    zero_outside,
)
from rollkit.testing import batches

MASK = torch.tensor([[True, False, True], [False, False, False]])


def test_check_token_tensors_names_the_argument():
    x = torch.zeros(2, 3)
    check_token_tensors(MASK, logprobs=x, old_logprobs=x.clone())  # valid: no error
    with pytest.raises(ValueError, match="logprobs: expected 2 dimensions"):
        check_token_tensors(MASK, logprobs=torch.zeros(6))
    with pytest.raises(ValueError, match="logprobs: expected a floating-point"):
        check_token_tensors(MASK, logprobs=torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(
        ValueError, match=r"old_logprobs: shape \[2, 4\] does not match logprobs shape \[2, 3\]"
    ):
        check_token_tensors(MASK, logprobs=x, old_logprobs=torch.zeros(2, 4))
    with pytest.raises(ValueError, match="returns: expected a floating-point"):
        check_token_tensors(MASK, values=x, returns=torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"mask: expected a torch\.bool mask"):
        check_token_tensors(MASK.float(), loss=x)
    with pytest.raises(ValueError, match="mask: shape"):
        check_token_tensors(MASK[:, :2], loss=x)


def test_check_seq_or_token():
    ref = torch.zeros(2, 3)
    check_seq_or_token("advantages", torch.zeros(2), "logprobs", ref)
    check_seq_or_token("advantages", torch.zeros(2, 3), "logprobs", ref)
    with pytest.raises(ValueError, match="advantages: has 3 entries but logprobs has 2 rows"):
        check_seq_or_token("advantages", torch.zeros(3), "logprobs", ref)
    with pytest.raises(
        ValueError, match=r"advantages: shape \[2, 4\] is neither \[B\] nor logprobs' \[2, 3\]"
    ):
        check_seq_or_token("advantages", torch.zeros(2, 4), "logprobs", ref)


def test_zero_outside_drops_nan_padding_and_its_gradient():
    x = torch.tensor([[1.0, float("nan"), 2.0], [float("inf"), 3.0, -1.0]], requires_grad=True)
    y = zero_outside(x, MASK)
    assert torch.equal(y.detach(), torch.tensor([[1.0, 0.0, 2.0], [0.0, 0.0, 0.0]]))
    y.sum().backward()
    assert torch.equal(x.grad, MASK.float())


def test_masked_stat_is_detached_and_zero_when_empty():
    x = torch.tensor([[1.0, 100.0, 2.0], [5.0, 5.0, 5.0]], requires_grad=True)
    s = masked_stat(x, MASK)
    assert float(s) == 1.5 and not s.requires_grad
    assert float(masked_stat(x, torch.zeros_like(MASK))) == 0.0


def test_safe_div_zero_denominator_gives_zero_and_zero_gradient():
    num = torch.tensor([3.0, 2.0], requires_grad=True)
    out = safe_div(num, torch.tensor([2.0, 0.0]))
    assert torch.equal(out.detach(), torch.tensor([1.5, 0.0]))
    out.sum().backward()
    assert torch.equal(num.grad, torch.tensor([0.5, 0.0]))


def test_compute_dtype_promotes_half_to_float32():
    assert compute_dtype(torch.zeros(1, dtype=torch.bfloat16)) == torch.float32
    assert compute_dtype(torch.zeros(1, dtype=torch.float16)) == torch.float32
    assert compute_dtype(torch.zeros(1, dtype=torch.float64)) == torch.float64


@settings(max_examples=25)
@given(batches())
def test_property_zero_outside_and_masked_stat(b):
    m, x = b["response_mask"], b["values"]
    z = zero_outside(x, m)
    assert torch.equal(z[m], x[m]) and bool((z[~m] == 0).all())
    n = int(m.sum())
    expected = x[m].sum() / n if n else torch.tensor(0.0)
    torch.testing.assert_close(masked_stat(x, m), expected)
