"""rollkit.correction: weights, rejection, modes, mismatch metrics and their exact reductions."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rollkit.correction import (
    LEVELS,
    SAFE_LOG_WEIGHT,
    correct,
    correction_weights,
    mismatch_metrics,
    mismatch_stats,
    reduce_correction_stats,
    reduce_mismatch_stats,
    stat_reduce_op,
)
from rollkit.losses import aggregate
from rollkit.losses.policy import importance_weights, ppo_clip
from rollkit.testing import batches

_PROPS = settings(max_examples=max(10, settings.default.max_examples // 2))
_JUNK = st.floats(-5.0, 5.0) | st.sampled_from([math.nan, math.inf, -math.inf])

MISMATCH_KEYS = {
    "k1",
    "k3",
    "ess_frac",
    "ratio_out_0.5_2",
    "ratio_out_0.9_1.1",
    "ratio_min",
    "ratio_max",
    "ratio_mean",
    "mult_prob_error",
    "logp_abs_diff_mean",
    "logp_abs_diff_max",
    "nonfinite_frac",
}
CORRECTION_KEYS = {
    "weight_mean",
    "weight_max",
    "weight_ess_frac",
    "truncated_frac",
    "masked_token_frac",
    "masked_seq_frac",
    "nonfinite_frac",
}


@st.composite
def segment_ids(draw, shape):
    b, t = shape
    ids = draw(st.lists(st.integers(0, 3), min_size=b * t, max_size=b * t))
    return torch.tensor(ids, dtype=torch.int64).view(b, t)


@st.composite
def corrected_batches(draw, **kw):
    """A batch, segment ids, and a random valid set of correction options."""
    b = draw(batches(**kw))
    seg = draw(segment_ids(tuple(b["response_mask"].shape)))
    level = draw(st.sampled_from(LEVELS))
    low = draw(st.none() | st.floats(0.05, 1.0))
    high = draw(st.none() | st.floats(1.0, 20.0))
    opts = {
        "level": level,
        "truncate": draw(st.none() | st.floats(0.5, 10.0)),
        "mask_low": low,
        "mask_high": high,
        "seq_k3_max": draw(st.none() | st.floats(0.01, 2.0)),
        "reject": draw(st.sampled_from(["token", "sequence"])),
        "mask_level": draw(st.none() | st.sampled_from(LEVELS)),
    }
    if "segment" in (level, opts["mask_level"]):
        opts["segment_ids"] = seg
    return b, seg, opts


def _cw(b, **opts):
    return correction_weights(b["old_logprobs"], b["behavior_logprobs"], b["response_mask"], **opts)


# --------------------------------------------------------------------------- hand numbers


def test_levels_hand_numbers():
    old = torch.tensor([[-1.0, -1.0, -2.0, 0.0], [-1.0, -1.0, -1.0, -1.0]])
    beh = torch.tensor([[-1.5, -1.0, -1.0, 9.0], [-1.0, -2.0, -1.0, -3.0]])
    m = torch.tensor([[True, True, True, False], [True, True, True, True]])
    d = (old - beh) * m
    tok = correction_weights(old, beh, m, truncate=None).weights
    assert torch.allclose(tok, torch.where(m, d.exp(), 0.0))
    seq = correction_weights(old, beh, m, level="sequence", truncate=None).weights
    assert torch.allclose(seq, torch.where(m, d.sum(-1, keepdim=True).exp(), 0.0))
    geo = correction_weights(old, beh, m, level="geometric", truncate=None).weights
    mean = d.sum(-1, keepdim=True) / m.sum(-1, keepdim=True)
    assert torch.allclose(geo, torch.where(m, mean.exp(), 0.0))
    # segments: row 0 = [0, 0, 1, x], row 1 = [5, 7, 5, 7] (non-contiguous turn ids)
    sid = torch.tensor([[0, 0, 1, 1], [5, 7, 5, 7]])
    segw = correction_weights(old, beh, m, level="segment", segment_ids=sid, truncate=None).weights
    want = torch.tensor(
        [[math.exp(0.5), math.exp(0.5), math.exp(-1.0), 0.0], [1.0, math.exp(3.0), 1.0, math.exp(3.0)]]
    )
    assert torch.allclose(segw, want)
    capped = correction_weights(old, beh, m, level="segment", segment_ids=sid, truncate=2.0)
    assert torch.allclose(capped.weights, want.clamp(max=2.0))
    assert float(capped.metrics["truncated_frac"]) == pytest.approx(2 / 7)


def test_rejection_modes_hand_numbers():
    old = torch.zeros(3, 3)
    beh = torch.tensor([[0.0, -1.0, 0.0], [0.0, 0.0, 0.0], [0.2, 0.2, 0.2]])  # w = e, 1, e^-0.2
    m = torch.ones(3, 3, dtype=torch.bool)
    c = correction_weights(old, beh, m, truncate=None, mask_high=2.0)  # IcePop-style token drop
    assert c.keep.tolist() == [[True, False, True], [True] * 3, [True] * 3]
    assert c.weights[0, 1] == 0
    assert float(c.metrics["masked_token_frac"]) == pytest.approx(1 / 9)
    assert float(c.metrics["masked_seq_frac"]) == 0.0
    c = correction_weights(old, beh, m, mask_high=2.0, reject="sequence")  # the whole row goes
    assert c.keep.tolist() == [[False] * 3, [True] * 3, [True] * 3]
    assert float(c.metrics["masked_seq_frac"]) == pytest.approx(1 / 3)
    # geometric rejection with token weights (OpenRLHF seq-mask-tis): row 0 mean 1/3 -> e^{1/3} in band
    c = correction_weights(old, beh, m, truncate=None, mask_level="geometric", mask_low=0.5, mask_high=1.2)
    assert c.keep.tolist() == [[False] * 3, [True] * 3, [True] * 3]  # e^{1/3} = 1.40 > 1.2
    assert torch.allclose(c.weights[2], torch.full((3,), math.exp(-0.2)))
    # mean k3 of row 0 = (e - 2) / 3 = 0.239; row 2: e^-0.2 - 1 + 0.2 = 0.0187
    c = correction_weights(old, beh, m, seq_k3_max=0.1)
    assert c.keep.tolist() == [[False] * 3, [True] * 3, [True] * 3]
    c = correction_weights(old, beh, m, seq_k3_max=0.01)
    assert c.keep.tolist() == [[False] * 3, [True] * 3, [False] * 3]


def test_mismatch_metrics_hand_numbers():
    lp = torch.tensor([[math.log(0.5), 0.0, math.log(3.0), 5.0]])
    beh = torch.zeros(1, 4)
    m = torch.tensor([[True, True, True, False]])
    out = mismatch_metrics(lp, beh, m)
    assert set(out) == MISMATCH_KEYS
    r = torch.tensor([0.5, 1.0, 3.0], dtype=torch.float64)
    d = r.log()
    assert float(out["k1"]) == pytest.approx(float(-d.mean()))
    assert float(out["k3"]) == pytest.approx(float((r - 1 - d).mean()))
    assert float(out["ess_frac"]) == pytest.approx(float(r.sum() ** 2 / (3 * (r * r).sum())))
    assert float(out["ratio_out_0.5_2"]) == pytest.approx(1 / 3)  # 0.5 is inside, 3 is out
    assert float(out["ratio_out_0.9_1.1"]) == pytest.approx(2 / 3)
    assert float(out["ratio_min"]) == pytest.approx(0.5)
    assert float(out["ratio_max"]) == pytest.approx(3.0)
    assert float(out["ratio_mean"]) == pytest.approx(1.5)
    assert float(out["mult_prob_error"]) == pytest.approx((2.0 + 1.0 + 3.0) / 3)  # mean exp|d|
    assert float(out["logp_abs_diff_max"]) == pytest.approx(math.log(3.0))


def test_empty_batches_and_rows():
    z = torch.zeros(2, 3)
    m = torch.zeros(2, 3, dtype=torch.bool)
    for level in LEVELS:
        seg = torch.zeros(2, 3, dtype=torch.int64) if level == "segment" else None
        c = correction_weights(z, z - 3.0, m, level=level, segment_ids=seg, seq_k3_max=0.1, mask_low=0.5)
        assert torch.equal(c.weights, z) and not c.keep.any()
        assert set(c.metrics) == CORRECTION_KEYS
        assert all(torch.isfinite(v) for v in c.metrics.values())
    out = mismatch_metrics(z, z - 3.0, m)
    assert float(out["ratio_mean"]) == 1.0 and float(out["ess_frac"]) == 1.0 and float(out["k3"]) == 0.0
    for shape in [(0, 3), (2, 0)]:
        e = torch.zeros(shape)
        em = torch.zeros(shape, dtype=torch.bool)
        assert correction_weights(e, e, em, level="segment", segment_ids=em.long()).weights.shape == shape
        assert all(torch.isfinite(v) for v in mismatch_metrics(e, e, em).values())


# --------------------------------------------------------------------------- properties


@_PROPS
@given(batches(), st.data())
def test_identity_when_old_equals_behaviour(b, data):
    mask = b["response_mask"]
    seg = data.draw(segment_ids(tuple(mask.shape)))
    for level in LEVELS:
        kw = {"segment_ids": seg} if level == "segment" else {}
        c = correction_weights(b["old_logprobs"], b["old_logprobs"], mask, level=level, **kw)
        assert torch.equal(c.keep, mask), level
        assert torch.equal(c.weights, mask.float()), level
    out = mismatch_metrics(b["old_logprobs"], b["old_logprobs"], mask)
    assert float(out["k1"]) == 0 and float(out["k3"]) == 0 and float(out["mult_prob_error"]) == 1


@_PROPS
@given(corrected_batches(), _JUNK)
def test_values_outside_the_mask_are_ignored(case, junk):
    b, seg, opts = case
    mask = b["response_mask"]
    moved = {
        k: torch.where(mask, b[k], torch.full_like(b[k], junk)) for k in ("old_logprobs", "behavior_logprobs")
    }
    moved["response_mask"] = mask
    opts_moved = dict(opts)
    if "segment_ids" in opts:
        opts_moved["segment_ids"] = torch.where(mask, seg, seg + 17)
    a, c = _cw(b, **opts), _cw(moved, **opts_moved)
    assert torch.equal(a.weights, c.weights) and torch.equal(a.keep, c.keep)
    for k in a.metrics:
        assert torch.equal(a.metrics[k], c.metrics[k]), k
    ma = mismatch_metrics(b["old_logprobs"], b["behavior_logprobs"], mask)
    mc = mismatch_metrics(moved["old_logprobs"], moved["behavior_logprobs"], mask)
    for k in ma:
        assert torch.equal(ma[k], mc[k]), k


@_PROPS
@given(corrected_batches(), st.integers(0, 3), st.integers(0, 3), _JUNK)
def test_padding_columns_change_nothing(case, left, right, junk):
    b, seg, opts = case
    mask = b["response_mask"]
    B = mask.shape[0]

    def pad(x, fill):
        return torch.cat(
            [torch.full((B, left), fill, dtype=x.dtype), x, torch.full((B, right), fill, dtype=x.dtype)], 1
        )

    padded = {
        "old_logprobs": pad(b["old_logprobs"], junk),
        "behavior_logprobs": pad(b["behavior_logprobs"], junk),
        "response_mask": pad(mask, False),
    }
    opts_p = dict(opts)
    if "segment_ids" in opts:
        opts_p["segment_ids"] = pad(seg, 9)
    a, c = _cw(b, **opts), _cw(padded, **opts_p)
    cols = slice(left, left + mask.shape[1])
    assert torch.equal(a.keep, c.keep[:, cols])
    assert torch.allclose(a.weights, c.weights[:, cols], rtol=1e-6, atol=0)
    assert not c.keep[:, :left].any() and not c.keep[:, left + mask.shape[1] :].any()
    for k in a.metrics:
        assert torch.allclose(a.metrics[k], c.metrics[k], rtol=1e-6, atol=1e-7), k


def _splits(draw, B):
    cuts = sorted(set(draw(st.lists(st.integers(0, B), max_size=4))))
    edges = [0, *cuts, B]
    return [(lo, hi) for lo, hi in itertools.pairwise(edges)]


@_PROPS
@given(corrected_batches(), st.data())
def test_row_splits_are_exact(case, data):
    """Weights per micro-batch of rows equal the whole batch's; merged stats give its metrics."""
    b, seg, opts = case
    mask = b["response_mask"]
    whole = _cw(b, **opts)
    parts, stats, mstats = [], [], []
    for lo, hi in _splits(data.draw, mask.shape[0]):
        piece = {k: b[k][lo:hi] for k in ("old_logprobs", "behavior_logprobs", "response_mask")}
        o = dict(opts)
        if "segment_ids" in o:
            o["segment_ids"] = seg[lo:hi]
        c = _cw(piece, **o)
        parts.append(c)
        stats.append(c.stats)
        mstats.append(mismatch_stats(b["old_logprobs"][lo:hi], b["behavior_logprobs"][lo:hi], mask[lo:hi]))
    assert torch.equal(torch.cat([p.keep for p in parts]), whole.keep)
    assert torch.allclose(torch.cat([p.weights for p in parts]), whole.weights, rtol=1e-6, atol=0)
    merged = reduce_correction_stats(stats)
    for k in whole.metrics:
        assert torch.allclose(merged[k], whole.metrics[k], rtol=1e-6, atol=1e-6), k
    mw = mismatch_metrics(b["old_logprobs"], b["behavior_logprobs"], mask)
    mm = reduce_mismatch_stats(mstats)
    for k in mw:
        assert torch.allclose(mm[k], mw[k], rtol=1e-6, atol=1e-6), k


@_PROPS
@given(corrected_batches(max_log_ratio=30.0))
def test_bounds_and_metric_ranges(case):
    b, _, opts = case
    c = _cw(b, **opts)
    mask = b["response_mask"]
    w, keep = c.weights, c.keep
    assert torch.isfinite(w).all() and (w >= 0).all()
    assert torch.all(w[~keep] == 0) and torch.all(keep <= mask)
    if opts["truncate"] is not None:
        assert (w <= opts["truncate"] * (1 + 1e-6)).all()
    level = opts["level"]
    if opts["mask_level"] in (None, level) and opts["truncate"] is None:
        kept = w[keep]
        if opts["mask_high"] is not None:
            assert (kept <= opts["mask_high"] * (1 + 1e-5)).all()
        if opts["mask_low"] is not None:
            assert (kept >= opts["mask_low"] * (1 - 1e-5)).all()
    if level != "token":  # constant within a row (or a segment)
        for i in range(mask.shape[0]):
            if level != "segment":
                vals = w[i][keep[i]]
                assert vals.numel() == 0 or torch.allclose(vals, vals[0].expand_as(vals))
    for k, v in c.metrics.items():
        assert v.ndim == 0 and torch.isfinite(v), k
    for k in ("truncated_frac", "masked_token_frac", "masked_seq_frac", "weight_ess_frac"):
        assert 0 <= float(c.metrics[k]) <= 1 + 1e-6, k
    mm = mismatch_metrics(b["old_logprobs"], b["behavior_logprobs"], mask)
    assert float(mm["k3"]) >= 0 and 0 < float(mm["ess_frac"]) <= 1 + 1e-6
    assert float(mm["mult_prob_error"]) >= 1 - 1e-6
    assert (
        float(mm["ratio_min"]) <= float(mm["ratio_mean"]) * (1 + 1e-5) <= float(mm["ratio_max"]) * (1 + 1e-5)
    )


@_PROPS
@given(batches(), st.sampled_from(["token", "sequence", "geometric"]), st.none() | st.floats(0.5, 5.0))
def test_truncation_matches_importance_weights(b, level, cap):
    """The token / sequence / geometric truncated weights are rollkit.losses.importance_weights'."""
    mask = b["response_mask"]
    c = correction_weights(b["old_logprobs"], b["behavior_logprobs"], mask, level=level, truncate=cap)
    w, _ = importance_weights(b["old_logprobs"], b["behavior_logprobs"], mask, level=level, cap=cap)
    assert torch.allclose(c.weights, w, rtol=1e-5, atol=1e-7)
    m = correction_weights(
        b["old_logprobs"], b["behavior_logprobs"], mask, level=level, truncate=None, mask_high=cap
    )
    wm, _ = importance_weights(
        b["old_logprobs"], b["behavior_logprobs"], mask, level=level, mode="mask", cap=cap
    )
    assert torch.allclose(m.weights, wm, rtol=1e-5, atol=1e-7)


# --------------------------------------------------------------------------- numerics


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("level", LEVELS)
def test_extreme_log_ratios_give_finite_weights_and_gradients(dtype, level):
    old = torch.tensor([[0.0, -1e4, 0.0, -3.0], [-1e4, 0.0, -2.0, -1.0]]).to(dtype)
    beh = torch.tensor([[-1e4, 0.0, 0.0, -3.0], [0.0, -1e4, -2.0, -1.0]]).to(dtype)
    mask = torch.tensor([[True, True, True, False], [True, True, True, True]])
    seg = torch.tensor([[0, 1, 1, 1], [0, 0, 1, 1]])
    for opts in [
        {},
        {"truncate": None},
        {"truncate": None, "mask_low": 0.5, "mask_high": 5.0},
        {"seq_k3_max": 1.0},
    ]:
        kw = {"segment_ids": seg} if level == "segment" else {}
        c = correction_weights(old, beh, mask, level=level, **opts, **kw)
        assert c.weights.dtype == torch.float32
        assert torch.isfinite(c.weights).all() and (c.weights <= math.exp(SAFE_LOG_WEIGHT) * 1.0001).all()
        assert all(torch.isfinite(v) for v in c.metrics.values())
        lp = old.detach().float().clone().requires_grad_(True)
        adv = torch.tensor([1.0, -1.0])
        out = ppo_clip(lp, old.float(), adv, mask & c.keep, is_weights=c.weights)
        aggregate(out.loss, mask & c.keep, "token-mean").backward()
        assert torch.isfinite(lp.grad).all()
    mm = mismatch_metrics(old, beh, mask)
    assert all(torch.isfinite(v) for v in mm.values())
    assert float(mm["ratio_min"]) == 0.0 and float(mm["ratio_max"]) == pytest.approx(
        math.exp(SAFE_LOG_WEIGHT), rel=1e-3
    )


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_nonfinite_at_valid_tokens_is_rejected_and_counted(bad):
    old = torch.tensor([[0.0, bad, 0.0], [0.0, 0.0, 0.0]])
    beh = torch.tensor([[-0.5, 0.0, 0.0], [0.0, 0.0, 0.0]])
    m = torch.ones(2, 3, dtype=torch.bool)
    tok = correction_weights(old, beh, m)
    assert tok.keep.tolist() == [[True, False, True], [True] * 3]
    assert torch.isfinite(tok.weights).all()
    assert float(tok.metrics["nonfinite_frac"]) == pytest.approx(1 / 6)
    seq = correction_weights(old, beh, m, level="sequence")
    assert seq.keep.tolist() == [[False] * 3, [True] * 3]
    mm = mismatch_metrics(old, beh, m)
    assert all(torch.isfinite(v) for v in mm.values())
    assert float(mm["nonfinite_frac"]) == pytest.approx(1 / 6)
    assert float(mm["ratio_max"]) == pytest.approx(math.exp(0.5))


# --------------------------------------------------------------------------- modes, stats


def test_correct_modes():
    beh = torch.tensor([[-1.0, -2.0, -3.0]])
    old = torch.tensor([[-1.5, -2.0, -0.5]])
    m = torch.tensor([[True, True, False]])
    anchor, c = correct("decoupled", beh, m, old_logprobs=old, truncate=None)
    assert anchor is old
    assert torch.allclose(c.weights, torch.tensor([[math.exp(-0.5), 1.0, 0.0]]))
    anchor, c = correct("bypass", beh, m)
    assert anchor is beh and torch.equal(c.keep, m) and torch.equal(c.weights, m.float())
    assert float(c.metrics["weight_mean"]) == 1.0 and float(c.metrics["masked_token_frac"]) == 0.0
    with pytest.raises(ValueError, match=r"^old_logprobs: required"):
        correct("decoupled", beh, m)
    with pytest.raises(ValueError, match=r"^old_logprobs: must be None"):
        correct("bypass", beh, m, old_logprobs=old)
    with pytest.raises(ValueError, match=r"^mask_high: rejection needs old_logprobs"):
        correct("bypass", beh, m, mask_high=2.0)
    with pytest.raises(ValueError, match=r"^mode: must be one of"):
        correct("async", beh, m)


def test_stat_reduce_ops_and_merge_errors():
    s = mismatch_stats(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool))
    assert {stat_reduce_op(k) for k in s} == {"sum", "min", "max"}
    assert stat_reduce_op("min_log_ratio") == "min" and stat_reduce_op("n") == "sum"
    with pytest.raises(ValueError, match=r"^stats: need at least one"):
        reduce_mismatch_stats([])
    with pytest.raises(ValueError, match=r"^stats: every dict must have the keys"):
        reduce_mismatch_stats([s, {"n": s["n"]}])


# --------------------------------------------------------------------------- validation


_Z = torch.zeros(2, 3)
_M = torch.ones(2, 3, dtype=torch.bool)


@pytest.mark.parametrize(
    ("kwargs", "msg"),
    [
        ({"level": "row"}, "^level: must be one of"),
        ({"mask_level": "row"}, "^mask_level: must be one of"),
        ({"reject": "all"}, "^reject: must be one of"),
        ({"level": "segment"}, "^segment_ids: required"),
        ({"mask_level": "segment"}, "^segment_ids: required"),
        ({"segment_ids": torch.zeros(2, 3, dtype=torch.int64)}, "^segment_ids: only used"),
        ({"level": "segment", "segment_ids": torch.zeros(2, 3)}, "^segment_ids: expected an integer"),
        ({"level": "segment", "segment_ids": torch.zeros(2, 2, dtype=torch.int64)}, "^segment_ids: shape"),
        ({"truncate": 0.0}, "^truncate: must be > 0"),
        ({"truncate": -1.0}, "^truncate: must be > 0"),
        ({"truncate": math.nan}, "^truncate: must be > 0"),
        ({"mask_low": 0.0}, "^mask_low: must be > 0"),
        ({"mask_high": -2.0}, "^mask_high: must be > 0"),
        ({"mask_low": 3.0, "mask_high": 2.0}, "^mask_low: must be <= mask_high"),
        ({"seq_k3_max": 0.0}, "^seq_k3_max: must be > 0"),
        ({"truncate": "2"}, "^truncate: expected a number"),
    ],
)
def test_bad_options_are_named(kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        correction_weights(_Z, _Z, _M, **kwargs)


def test_bad_tensors_are_named():
    with pytest.raises(ValueError, match=r"^behavior_logprobs: shape"):
        correction_weights(_Z, torch.zeros(2, 4), _M)
    with pytest.raises(ValueError, match=r"^old_logprobs: expected a floating-point"):
        correction_weights(_Z.long(), _Z, _M)
    with pytest.raises(ValueError, match=r"^mask: expected a torch.bool"):
        correction_weights(_Z, _Z, _M.float())
    with pytest.raises(ValueError, match=r"^trainer_logprobs: expected a floating-point"):
        mismatch_metrics(_Z.long(), _Z, _M)
    with pytest.raises(ValueError, match=r"^behavior_logprobs: shape"):
        mismatch_stats(_Z, torch.zeros(3, 3), _M)
