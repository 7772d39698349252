import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rollkit.losses import AGGREGATION_MODES, aggregate, global_normalizers
from rollkit.registry import AGGREGATIONS
from rollkit.testing import batches, float_tensors, masks, shapes
from rollkit.validation import value_checks

LOSS = torch.tensor([[1.0, 2.0, 3.0, 9.0], [4.0, 0.0, 0.0, 0.0], [5.0, 7.0, 0.0, 0.0]])
MASK = torch.tensor([[True, True, True, False], [True, False, False, False], [False, True, False, False]])
# row sums 6, 4, 7; row counts 3, 1, 1; 5 tokens, 3 sequences


@pytest.mark.parametrize(
    "mode, kwargs, expected",
    [
        ("token-mean", {}, 17 / 5),
        ("token-sum", {}, 17.0),
        ("seq-mean-token-sum", {}, 17 / 3),
        ("seq-mean-token-mean", {}, (2 + 4 + 7) / 3),
        ("seq-mean-token-sum-norm", {}, 17 / (3 * 4)),  # norm_length defaults to T = 4
        ("seq-mean-token-sum-norm", {"norm_length": 10}, 17 / 30),
        ("token-mean", {"num_tokens": 10}, 1.7),
        ("seq-mean-token-sum", {"num_seqs": 17}, 1.0),
        ("seq-mean-token-mean", {"num_seqs": 13}, 1.0),
        ("seq-mean-token-sum-norm", {"num_seqs": 17, "norm_length": 2}, 0.5),
        ("token-mean", {"dp_size": 4}, 4 * 17 / 5),
        ("token-sum", {"num_tokens": 123, "num_seqs": 7}, 17.0),  # unused normalisers are ignored
    ],
)
def test_hand_computed_values(mode, kwargs, expected):
    out = aggregate(LOSS, MASK, mode, **kwargs)
    assert out.shape == ()
    assert math.isclose(float(out), expected, rel_tol=1e-6)


@pytest.mark.parametrize(
    "mode, expected",
    [
        # w = [1, 2, 0]: weighted sums 6 + 8 = 14, weighted tokens 3 + 2 = 5, weighted seqs 3
        ("token-mean", 14 / 5),
        ("token-sum", 14.0),
        ("seq-mean-token-sum", 14 / 3),
        ("seq-mean-token-mean", (2 + 2 * 4) / 3),
        ("seq-mean-token-sum-norm", 14 / (3 * 4)),
    ],
)
def test_weights_hand_computed(mode, expected):
    w = torch.tensor([1.0, 2.0, 0.0])
    assert math.isclose(float(aggregate(LOSS, MASK, mode, weights=w)), expected, rel_tol=1e-6)


def test_weights_are_scale_invariant_except_token_sum():
    w = torch.tensor([1.0, 2.0, 0.5])
    for mode in AGGREGATION_MODES:
        a, b = aggregate(LOSS, MASK, mode, weights=w), aggregate(LOSS, MASK, mode, weights=3 * w)
        if mode == "token-sum":
            assert torch.allclose(b, 3 * a)
        else:
            assert torch.allclose(a, b)


def test_fully_masked_rows_do_not_count_as_sequences():
    loss = torch.tensor([[2.0, 2.0], [5.0, 5.0]])
    mask = torch.tensor([[True, True], [False, False]])
    assert float(aggregate(loss, mask, "seq-mean-token-mean")) == 2.0
    assert float(aggregate(loss, mask, "seq-mean-token-sum")) == 4.0
    assert float(global_normalizers(mask)["num_seqs"]) == 1.0


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_fully_masked_batch_is_zero_with_zero_gradient(mode):
    loss = torch.full((2, 3), float("nan")).requires_grad_()
    mask = torch.zeros(2, 3, dtype=torch.bool)
    out = aggregate(loss, mask, mode)
    assert float(out.detach()) == 0.0
    out.backward()
    assert torch.equal(loss.grad, torch.zeros(2, 3))
    # zero global normalisers too (e.g. a rank whose whole batch is padding)
    out = aggregate(loss, mask, mode, num_tokens=0.0, num_seqs=0.0)
    assert float(out.detach()) == 0.0


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_all_zero_weights_give_zero(mode):
    loss = torch.ones(2, 3, requires_grad=True)
    out = aggregate(loss, torch.ones(2, 3, dtype=torch.bool), mode, weights=torch.zeros(2))
    assert float(out.detach()) == 0.0
    out.backward()
    assert torch.isfinite(loss.grad).all()


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_nan_and_inf_under_the_mask_do_not_leak(mode):
    loss = torch.tensor([[1.0, float("nan")], [2.0, float("inf")]], requires_grad=True)
    mask = torch.tensor([[True, False], [True, False]])
    out = aggregate(loss, mask, mode)
    out.backward()
    assert torch.isfinite(out) and torch.isfinite(loss.grad).all()
    assert loss.grad[0, 1] == 0 and loss.grad[1, 1] == 0


def test_low_precision_accumulates_in_float32():
    loss = torch.full((1, 4096), 1.0 + 2**-7, dtype=torch.bfloat16)
    mask = torch.ones(1, 4096, dtype=torch.bool)
    out = aggregate(loss, mask, "token-sum")
    assert out.dtype == torch.float32
    assert float(out) == 4096 * (1.0 + 2**-7)  # a bf16 running sum would be far off


def test_registry_has_every_mode_bound():
    for mode in AGGREGATION_MODES:
        entry = AGGREGATIONS.entry(mode)
        assert entry.in_keys == {"loss": "loss", "mask": "response_mask", "weights": "sample_weights"}
        assert tuple(entry.out_keys) == ("loss_objective",)  # never overwrites the [B, T] "loss"
        assert entry.tensor_args() == {"loss": True, "mask": True, "weights": False}
        assert torch.allclose(entry.fn(LOSS, MASK, norm_length=5), aggregate(LOSS, MASK, mode, norm_length=5))
        w = torch.arange(1.0, LOSS.shape[0] + 1)
        assert torch.equal(
            entry.fn(LOSS, MASK, w, norm_length=5), aggregate(LOSS, MASK, mode, weights=w, norm_length=5)
        )
        assert entry.doc


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"mode": "mean"}, "mode: must be one of"),
        ({"mask": MASK.float()}, "mask: expected a torch.bool mask"),
        ({"mask": MASK[:, :2]}, "mask: shape"),
        ({"loss": LOSS[0]}, "loss: expected 2 dimensions"),
        ({"loss": LOSS.long()}, "loss: expected a floating-point tensor"),
        ({"weights": torch.ones(2)}, r"weights: expected shape \[3\]"),
        ({"weights": torch.tensor([1.0, -1.0, 1.0])}, "weights: must be >= 0"),
        ({"weights": torch.tensor([1.0, float("nan"), 1.0])}, "weights: contains 1 NaN"),
        ({"weights": torch.ones(3, dtype=torch.long)}, "weights: expected a floating-point"),
        ({"num_tokens": -1.0}, "num_tokens: must be finite and >= 0"),
        ({"num_tokens": torch.tensor(float("inf"))}, "num_tokens: must be finite and >= 0"),
        ({"num_seqs": torch.ones(2), "mode": "seq-mean-token-sum"}, "num_seqs: expected a scalar"),
        ({"norm_length": 0, "mode": "seq-mean-token-sum-norm"}, "norm_length: must be > 0"),
        ({"norm_length": 2.5}, "norm_length: must be an integer"),
        ({"dp_size": 0}, "dp_size: must be an integer >= 1"),
    ],
)
def test_validation_errors(kwargs, match):
    args = {"loss": LOSS, "mask": MASK, "mode": "token-mean", **kwargs}
    with pytest.raises(ValueError, match=match):
        aggregate(args.pop("loss"), args.pop("mask"), args.pop("mode"), **args)


def test_global_normalizers_validation_and_value_checks_off():
    with pytest.raises(ValueError, match="mask: expected 2 dimensions"):
        global_normalizers(MASK[0])
    with pytest.raises(ValueError, match="weights: must be >= 0"):
        global_normalizers(MASK, torch.tensor([1.0, -2.0, 0.0]))
    with value_checks(False):  # the data-reading checks can be switched off
        assert float(aggregate(LOSS, MASK, "token-mean", weights=torch.tensor([1.0, -1.0, 0.0]))) == 2 / 2


# --------------------------------------------------------------------------- classic bug


def test_classic_bug_local_token_mean_depends_on_the_split():
    """Averaging per-micro-batch token-means != the token-mean of the batch."""
    loss = torch.tensor([[1.0, 1.0, 1.0, 1.0], [5.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, True, True], [True, False, False, False]])
    full = aggregate(loss, mask, "token-mean")  # (4 + 5) / 5 = 1.8
    naive = (aggregate(loss[:1], mask[:1]) + aggregate(loss[1:], mask[1:])) / 2  # (1 + 5) / 2 = 3
    assert math.isclose(float(full), 1.8, rel_tol=1e-6) and math.isclose(float(naive), 3.0)
    norms = global_normalizers(mask)
    exact = aggregate(loss[:1], mask[:1], **norms) + aggregate(loss[1:], mask[1:], **norms)
    assert math.isclose(float(exact), 1.8, rel_tol=1e-6)


# --------------------------------------------------------------------------- properties


def _split_points(draw, B):
    cuts = draw(st.lists(st.integers(1, max(1, B - 1)), max_size=3)) if B > 1 else []
    return [0, *sorted(set(cuts)), B]


def _grad(fn, theta):
    theta = theta.detach().clone().requires_grad_()
    out = fn(theta)
    (g,) = torch.autograd.grad(out, theta, allow_unused=True)
    return out.detach(), (torch.zeros_like(theta) if g is None else g)


@given(data=st.data(), b=batches(max_batch=8, max_len=8), mode=st.sampled_from(AGGREGATION_MODES))
def test_microbatch_split_with_global_normalizers_is_exact(data, b, mode):
    mask, x = b["response_mask"], b["values"]
    B, T = mask.shape
    weights = data.draw(st.none() | float_tensors((B,), min_value=0.0, max_value=3.0))
    theta = data.draw(float_tensors((T,), min_value=-2.0, max_value=2.0))
    bounds = _split_points(data.draw, B)

    def per_token(theta, rows):
        return (x[rows] * theta).square() + x[rows] * theta  # a non-linear shared-parameter loss

    def full(theta):
        return aggregate(per_token(theta, slice(None)), mask, mode, weights=weights, norm_length=T)

    norms = global_normalizers(mask, weights)

    def split(theta):
        total = 0.0
        for lo, hi in itertools.pairwise(bounds):
            w = None if weights is None else weights[lo:hi]
            rows = slice(lo, hi)
            total = total + aggregate(
                per_token(theta, rows), mask[rows], mode, weights=w, norm_length=T, **norms
            )
        return total

    v_full, g_full = _grad(full, theta)
    v_split, g_split = _grad(split, theta)
    assert torch.allclose(v_full, v_split, rtol=1e-4, atol=1e-4)
    assert torch.allclose(g_full, g_split, rtol=1e-4, atol=1e-4)


@given(data=st.data(), shape=shapes(min_batch=2, max_batch=8, max_len=8))
def test_ddp_mean_reduction_is_undone_by_dp_size(data, shape):
    """Two 'ranks' whose gradients are averaged (as DDP does) give the full gradient with dp_size=2."""
    B, T = shape
    mask = data.draw(masks(B, T))
    x = data.draw(float_tensors((B, T), min_value=-3.0, max_value=3.0))
    theta = data.draw(float_tensors((T,), min_value=-2.0, max_value=2.0))
    k = B // 2
    norms = global_normalizers(mask)  # the counts an all-reduce would give
    _, g_full = _grad(lambda th: aggregate((x * th).square(), mask, "token-mean"), theta)
    grads = [
        _grad(
            lambda th, r=r: aggregate((x[r] * th).square(), mask[r], "token-mean", **{**norms, "dp_size": 2}),
            theta,
        )[1]
        for r in (slice(0, k), slice(k, B))
    ]
    assert torch.allclose((grads[0] + grads[1]) / 2, g_full, rtol=1e-4, atol=1e-4)


@settings(max_examples=40)
@given(b=batches(max_batch=6, max_len=8), mode=st.sampled_from(AGGREGATION_MODES))
def test_finite_and_matches_direct_formula(b, mode):
    mask, loss = b["response_mask"], b["values"]
    out = aggregate(loss, mask, mode, norm_length=8)
    assert torch.isfinite(out)
    unit = aggregate(loss, mask, mode, norm_length=8, weights=torch.ones(mask.shape[0]))
    assert torch.allclose(out, unit)  # unit weights == no weights
    m = mask.double()
    s = (loss.double() * m).sum(-1)
    n = m.sum(-1)
    seqs = float((n > 0).sum())
    if mode == "token-mean":
        ref = s.sum() / n.sum() if n.sum() > 0 else torch.tensor(0.0)
    elif mode == "token-sum":
        ref = s.sum()
    elif mode == "seq-mean-token-sum":
        ref = s.sum() / seqs if seqs else torch.tensor(0.0)
    elif mode == "seq-mean-token-mean":
        ref = (s / n.clamp(min=1)).sum() / seqs if seqs else torch.tensor(0.0)
    else:
        ref = s.sum() / (seqs * 8) if seqs else torch.tensor(0.0)
    assert math.isclose(float(out), float(ref), rel_tol=1e-5, abs_tol=1e-5)


# --------------------------------------------------------------------------- host synchronisations


class _SyncCounter:
    """Counts the host reads of tensor data (``bool`` / ``float`` / ``int`` / ``item``)."""

    def __init__(self, monkeypatch):
        self.n = 0
        for meth in ("__bool__", "__float__", "__int__", "item", "tolist"):
            real = getattr(torch.Tensor, meth)

            def counted(self_, *a, _real=real, **k):
                self.n += 1
                return _real(self_, *a, **k)

            monkeypatch.setattr(torch.Tensor, meth, counted)


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_aggregate_syncs_at_most_once_and_never_without_value_checks(mode, monkeypatch):
    w = torch.tensor([1.0, 2.0, 0.5])
    norms = global_normalizers(MASK, w)
    counter = _SyncCounter(monkeypatch)
    aggregate(LOSS, MASK, mode, weights=w, **norms)
    assert counter.n <= 1, counter.n
    counter.n = 0
    with value_checks(False):
        aggregate(LOSS, MASK, mode, weights=w, **norms)
        global_normalizers(MASK, w)
    assert counter.n == 0, counter.n


def test_aggregate_runs_on_meta_tensors_without_value_checks():
    """No data is read at all: meta tensors (which have none) go through."""
    mask = torch.ones(3, 5, dtype=torch.bool, device="meta")
    loss = torch.zeros(3, 5, device="meta")
    w = torch.ones(3, device="meta")
    with value_checks(False):
        for mode in AGGREGATION_MODES:
            aggregate(loss, mask, mode, weights=w, **global_normalizers(mask, w))


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        ({"num_tokens": torch.tensor(-2.0)}, "num_tokens: must be finite and >= 0, got -2.0"),
        ({"num_seqs": torch.tensor(float("nan")), "mode": "seq-mean-token-sum"}, "num_seqs: must be finite"),
        ({"weights": torch.tensor([1.0, float("inf"), 1.0])}, "weights: contains 0 NaN and 1 inf"),
    ],
)
def test_deferred_value_checks_keep_their_messages(kwargs, pattern):
    kwargs = dict(kwargs)
    mode = kwargs.pop("mode", "token-mean")
    with pytest.raises(ValueError, match=pattern):
        aggregate(LOSS, MASK, mode, **kwargs)
    with value_checks(False):
        aggregate(LOSS, MASK, mode, **kwargs)  # not checked


# --------------------------------------------------------------------------- reliability (issue 14)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"norm_length": float("nan")}, r"^norm_length: must be an integer, got nan$"),
        ({"norm_length": float("inf")}, r"^norm_length: must be an integer, got inf$"),
        ({"norm_length": "x"}, r"^norm_length: expected an int, got str$"),
        ({"dp_size": "x"}, r"^dp_size: expected an int, got str$"),
        ({"dp_size": float("nan")}, r"^dp_size: must be an integer, got nan$"),
        ({"num_tokens": "x", "mode": "seq-mean-token-sum"}, r"^num_tokens: expected a number, got str$"),
        ({"num_seqs": float("nan")}, r"^num_seqs: must be finite and >= 0, got nan$"),
    ],
)
def test_bad_scalars_name_the_argument(kwargs, match):
    """``int(nan)`` raised "cannot convert float NaN to integer"; normalisers a mode does not
    use were not looked at, so ``num_tokens="x"`` passed silently."""
    args = {"loss": LOSS, "mask": MASK, "mode": "seq-mean-token-sum-norm", **kwargs}
    with pytest.raises(ValueError, match=match):
        aggregate(**args)


def test_aggregate_devices_and_meta():
    from rollkit.validation import value_checks

    w = torch.ones(LOSS.shape[0])
    with pytest.raises(ValueError, match=r"^weights: is on device meta but mask is on cpu$"):
        aggregate(LOSS, MASK, weights=w.to("meta"))
    with pytest.raises(ValueError, match=r"^mask: is on device meta but loss is on cpu$"):
        aggregate(LOSS, MASK.to("meta"))
    meta = dict(loss=LOSS.to("meta"), mask=MASK.to("meta"), weights=w.to("meta"))
    with pytest.raises(ValueError, match=r"^weights: is on the meta device"):
        aggregate(**meta)
    with value_checks(False):
        assert aggregate(**meta).is_meta
    assert aggregate(LOSS.to("meta"), MASK.to("meta")).is_meta  # no weights: nothing is read
