"""rollkit's own invalid-input and huge-magnitude strategies run over the distillation,
preference (Bradley-Terry included) and SFT losses (issue 31).

* Bad input (a wrong-shape or non-bool mask, an integer tensor where log-probs are expected, a
  list or ``None`` for a tensor) raises a ``ValueError`` / ``TypeError`` whose message starts
  with the argument's name.
* Finite input of any magnitude (log-probs down to ``-3.4e38``) gives the float64 result: the
  loss and every metric, computed from float32 inputs, agree with the same call on the same
  values in float64 (``rollkit.testing.check_float64_agreement``: never NaN where float64
  gives a number, ``+-inf`` only where the float64 value is beyond float32's range).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rollkit.losses import (
    bradley_terry,
    distill_token_rewards,
    dpo,
    gather_topk_logprobs,
    ipo,
    on_policy_distill,
    orpo,
    sequence_logprobs,
    sft_nll,
    simpo,
    topk_forward_kl,
    topk_jsd,
    topk_reverse_kl,
)
from rollkit.testing import (
    check_float64_agreement,
    float_tensors,
    int_tensors,
    invalid_masks,
    masks,
    non_tensors,
    rewards,
    shapes,
)

F32_MAX = float(torch.finfo(torch.float32).max)
EPS = float(torch.finfo(torch.float32).eps)


def raises_naming(name: str):
    """``pytest.raises`` of a ``ValueError`` or ``TypeError`` whose message starts with ``name:``."""
    return pytest.raises((ValueError, TypeError), match=rf"^{name}: ")


HUGE_LP = {"min_value": -F32_MAX, "max_value": 0.0, "huge": True}

TOKEN_LOSSES = {
    "sft_nll": lambda lp, other, m: sft_nll(lp, m),
    "sequence_logprobs(sum)": lambda lp, other, m: sequence_logprobs(lp, m),
    "sequence_logprobs(mean)": lambda lp, other, m: sequence_logprobs(lp, m, reduction="mean"),
    "on_policy_distill": lambda lp, other, m: on_policy_distill(lp, other, m, coef=0.5),
    "distill_token_rewards": lambda lp, other, m: distill_token_rewards(lp, other, m, coef=0.5),
}
# the name each token loss gives its second tensor argument (None: it takes none)
SECOND = {
    "sft_nll": None,
    "sequence_logprobs(sum)": None,
    "sequence_logprobs(mean)": None,
    "on_policy_distill": "teacher_logprobs",
    "distill_token_rewards": "teacher_logprobs",
}
TOPK = {
    "topk_forward_kl": lambda s, t, m, tail: topk_forward_kl(s, t, m, tail=tail),
    "topk_reverse_kl": lambda s, t, m, tail: topk_reverse_kl(s, t, m, tail=tail),
    "topk_jsd": lambda s, t, m, tail: topk_jsd(s, t, m, beta=0.3, tail=tail),
}
PAIRS = {
    "dpo": lambda c, r, rc, rr, nc, nr: dpo(c, r, rc, rr, beta=0.1),
    "dpo(cdpo)": lambda c, r, rc, rr, nc, nr: dpo(c, r, rc, rr, beta=0.1, label_smoothing=0.1),
    "dpo(robust)": lambda c, r, rc, rr, nc, nr: dpo(c, r, rc, rr, beta=0.1, label_smoothing=0.1, robust=True),
    "ipo": lambda c, r, rc, rr, nc, nr: ipo(c, r, rc, rr, beta=0.1),
    "ipo(lengths)": lambda c, r, rc, rr, nc, nr: ipo(c, r, rc, rr, nc, nr, beta=0.1),
    "simpo": lambda c, r, rc, rr, nc, nr: simpo(c, r, nc, nr, beta=2.0, gamma=0.5),
    "orpo": lambda c, r, rc, rr, nc, nr: orpo(c, r, nc, nr, beta=0.1),
}
PAIR_NAMES = {
    "dpo": ("chosen_logprobs", "rejected_logprobs", "ref_chosen_logprobs", "ref_rejected_logprobs"),
    "ipo": ("chosen_logprobs", "rejected_logprobs", "ref_chosen_logprobs", "ref_rejected_logprobs"),
    "simpo": ("chosen_logprobs", "rejected_logprobs", "chosen_lengths", "rejected_lengths"),
    "orpo": ("chosen_logprobs", "rejected_logprobs", "chosen_lengths", "rejected_lengths"),
}


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("name", list(TOKEN_LOSSES))
@given(data=st.data())
def test_token_losses_refuse_bad_input_by_name(name, data):
    fn = TOKEN_LOSSES[name]
    B, T = data.draw(shapes(max_batch=4, max_len=5))
    lp = data.draw(float_tensors((B, T), min_value=-20.0, max_value=0.0))
    other = data.draw(float_tensors((B, T), min_value=-20.0, max_value=0.0))
    m = data.draw(masks(B, T))
    with raises_naming("mask"):
        fn(lp, other, data.draw(invalid_masks((B, T))))
    with raises_naming("logprobs"):
        fn(data.draw(int_tensors((B, T), dtype=None, extremes=True)), other, m)
    with raises_naming("logprobs"):
        fn(data.draw(non_tensors((B, T))), other, m)
    second = SECOND[name]
    if second is not None:
        with raises_naming(second):
            fn(lp, data.draw(int_tensors((B, T), dtype=None)), m)
        with raises_naming(second):
            fn(lp, data.draw(non_tensors((B, T))), m)
        with raises_naming(second):
            fn(lp, data.draw(float_tensors((B, T + 1))), m)


@pytest.mark.parametrize("name", list(TOPK))
@given(data=st.data())
def test_topk_losses_refuse_bad_input_by_name(name, data):
    fn = TOPK[name]
    B, T = data.draw(shapes(max_batch=3, max_len=4))
    K = data.draw(st.integers(1, 4))
    s = data.draw(float_tensors((B, T, K), min_value=-20.0, max_value=-2.0))
    t = data.draw(float_tensors((B, T, K), min_value=-20.0, max_value=-2.0))
    m = data.draw(masks(B, T))
    with raises_naming("mask"):
        fn(s, t, data.draw(invalid_masks((B, T))), "bucket")
    with raises_naming("student_topk_logprobs"):
        fn(data.draw(int_tensors((B, T, K), dtype=None)), t, m, "bucket")
    with raises_naming("student_topk_logprobs"):
        fn(data.draw(non_tensors((B, T, K))), t, m, "bucket")
    with raises_naming("teacher_topk_logprobs"):
        fn(s, data.draw(int_tensors((B, T, K), dtype=None)), m, "bucket")
    with raises_naming("teacher_topk_logprobs"):
        fn(s, data.draw(non_tensors((B, T, K))), m, "bucket")


@given(data=st.data())
def test_gather_topk_logprobs_refuses_bad_input_by_name(data):
    B, T = data.draw(shapes(max_batch=3, max_len=3))
    V, K = data.draw(st.integers(2, 6)), data.draw(st.integers(1, 2))
    logits = data.draw(float_tensors((B, T, V)))
    ids = data.draw(int_tensors((B, T, K), min_value=0, max_value=V - 1))
    with raises_naming("logits"):
        gather_topk_logprobs(data.draw(int_tensors((B, T, V), dtype=None)), ids)
    with raises_naming("logits"):
        gather_topk_logprobs(data.draw(non_tensors((B, T, V))), ids)
    with raises_naming("topk_ids"):
        gather_topk_logprobs(logits, data.draw(float_tensors((B, T, K))))
    with raises_naming("topk_ids"):
        gather_topk_logprobs(logits, data.draw(non_tensors((B, T, K))))


@given(data=st.data())
def test_gather_topk_logprobs_refuses_out_of_range_ids_by_name(data):
    B, T = data.draw(shapes(max_batch=3, max_len=3))
    V = data.draw(st.integers(2, 6))
    logits = data.draw(float_tensors((B, T, V)))
    ids = data.draw(int_tensors((B, T, 1), min_value=V, max_value=V + 3))
    with raises_naming("topk_ids"):
        gather_topk_logprobs(logits, ids)


@pytest.mark.parametrize("name", ["dpo", "ipo", "simpo", "orpo"])
@given(data=st.data())
def test_preference_losses_refuse_bad_input_by_name(name, data):
    P = data.draw(st.integers(1, 5))
    c, r, rc, rr = (data.draw(float_tensors((P,), min_value=-50.0, max_value=0.0)) for _ in range(4))
    n = torch.ones(P, dtype=torch.long)
    args = [c, r, rc, rr] if name in ("dpo", "ipo") else [c, r, n, n]
    fn = {"dpo": dpo, "ipo": ipo, "simpo": simpo, "orpo": orpo}[name]
    for i, arg_name in enumerate(PAIR_NAMES[name]):
        bad = list(args)
        bad[i] = data.draw(non_tensors((P,)))
        with raises_naming(arg_name):
            fn(*bad)
        bad[i] = args[i].reshape(P, 1)  # [P, 1] where [P] is expected
        with raises_naming(arg_name):
            fn(*bad)
        if arg_name.endswith("_logprobs"):
            bad[i] = data.draw(int_tensors((P,), dtype=None))
        else:  # token counts: integers and floats are fine, bool is not
            bad[i] = torch.ones(P, dtype=torch.bool)
        with raises_naming(arg_name):
            fn(*bad)


# --------------------------------------------------------------------------- huge finite input

# Known numerics failures of the loss files this change does not own (issue 31, reported to
# their owner): a float32 sum or difference of finite log-probs overflows where the float64
# result is representable. The test xfails with the reason and the first mismatch, without
# shrinking; it passes (and should be removed from here) once the loss is fixed.
_SUM = "a float32 sum of the log-probs overflows (the mean is representable)"
_PREF = (
    "rollkit/losses/preference.py: the 'logps/*' and 'rewards/*' metrics are Tensor.mean() of "
    "float32 values, whose sum overflows"
)
_H = "; the loss's margin h = chosen_ratio - rejected_ratio overflows (each ratio up to 3.4e38)"
KNOWN = {
    "sft_nll": f"rollkit/losses/sft.py: metrics['nll'] is sum / n: {_SUM}",
    "sequence_logprobs(mean)": f"rollkit/losses/sft.py: reduction='mean' is sum / n: {_SUM}",
    "dpo": _PREF + _H,
    "dpo(cdpo)": _PREF + _H,
    "dpo(robust)": _PREF + _H,
    "ipo": _PREF + _H,
    "ipo(lengths)": _PREF + _H,
    "simpo": _PREF + " (beta * mean log-prob, beta = 2, overflows too)",
    "orpo": _PREF + " (and 'log_odds_chosen', the mean of the log-odds differences)",
}


def _run_agreement(name: str, case, *, max_examples: int) -> None:
    """Run ``_check_float64_agreement`` on ``max_examples`` drawn cases (``case(data) -> (fn,
    args, rtol, atol)``). A loss listed in ``KNOWN`` xfails on its first mismatch, with the
    reason and the mismatch, without shrinking (hypothesis shrinks every failure it catches,
    pytest's xfail included, so the mismatch is recorded and the example passes)."""
    mismatches: list[str] = []

    @settings(max_examples=max_examples)
    @given(data=st.data())
    def run(data):
        fn, args, rtol, atol = case(data)
        if mismatches:  # known and recorded: draw (hypothesis replays draws), check no more
            return
        try:
            check_float64_agreement(fn, args, rtol=rtol, atol=atol)
        except AssertionError as e:
            if name not in KNOWN:
                raise
            mismatches.append(str(e).splitlines()[0][:300])

    run()
    if mismatches:
        pytest.xfail(f"{KNOWN[name]} -- first mismatch: {mismatches[0]}")


@pytest.mark.parametrize("name", list(TOKEN_LOSSES))
def test_token_losses_of_huge_log_probs_match_float64(name):
    def case(data):
        B, T = data.draw(shapes(max_batch=4, max_len=6))
        m = data.draw(masks(B, T))
        lp = data.draw(float_tensors((B, T), mask=m, garbage_padding=True, **HUGE_LP))
        other = data.draw(float_tensors((B, T), mask=m, garbage_padding=True, **HUGE_LP))
        scale = float(torch.where(m, lp.double().abs() + other.double().abs(), 0.0).max()) if m.any() else 1.0
        # on-policy distillation multiplies two log-probs: rounding relative to scale^2
        atol = 16 * T * EPS * max(scale, scale * scale)
        return TOKEN_LOSSES[name], [lp, other, m], 16 * T * EPS, atol

    _run_agreement(name, case, max_examples=80)


def _topk_logprobs(data, shape):
    """Top-k log-probs (``logsumexp <= 0``) with magnitudes up to float32's largest."""
    x = data.draw(float_tensors(shape, **HUGE_LP))
    lse = x.double().logsumexp(-1, keepdim=True).clamp(min=0.0)
    return (x.double() - lse).float()  # a valid top-k: the mass sums to at most 1


@pytest.mark.parametrize("tail", ["bucket", "renormalize"])
@pytest.mark.parametrize("name", list(TOPK))
def test_topk_losses_of_huge_log_probs_match_float64(name, tail):
    def case(data):
        B, T = data.draw(shapes(max_batch=3, max_len=4))
        K = data.draw(st.integers(1, 4))
        m = data.draw(masks(B, T))
        s, t = _topk_logprobs(data, (B, T, K)), _topk_logprobs(data, (B, T, K))
        scale = float(torch.cat([s, t]).double().abs().max())
        return (lambda *a: TOPK[name](*a, tail)), [s, t, m], 1e-3, 64 * EPS * max(1.0, scale)

    _run_agreement(name, case, max_examples=60)


@pytest.mark.parametrize("name", list(PAIRS))
def test_preference_losses_of_huge_log_probs_match_float64(name):
    def case(data):
        P = data.draw(st.integers(1, 6))
        c, r, rc, rr = (data.draw(float_tensors((P,), **HUGE_LP)) for _ in range(4))
        nc, nr = (data.draw(int_tensors((P,), min_value=0, max_value=4096)) for _ in range(2))
        scale = float(torch.stack([c, r, rc, rr]).double().abs().max())
        atol = 64 * EPS * max(1.0, scale, scale * scale if name.startswith("ipo") else 0.0)
        return PAIRS[name], [c, r, rc, rr, nc, nr], 1e-3, atol

    _run_agreement(name, case, max_examples=80)


# --------------------------------------------------------------------------- Bradley-Terry


def _softplus(x: float) -> float:
    """``log(1 + e^x)`` in float64 without overflow: the Bradley-Terry loss is ``softplus(-h)``."""
    return max(x, 0.0) + math.log1p(math.exp(-abs(x)))


@given(data=st.data())
def test_bradley_terry_refuses_bad_input_by_name(data):
    P = data.draw(st.integers(1, 5))
    c, r = data.draw(rewards(P)), data.draw(rewards(P))
    for i, name in enumerate(("chosen_rewards", "rejected_rewards")):
        for bad in (
            data.draw(non_tensors((P,))),
            data.draw(int_tensors((P,), dtype=None)),
            # chosen_rewards is the reference: a [P + 1] one is a mismatch of rejected_rewards
            data.draw(float_tensors(data.draw(st.sampled_from([(P, 1), ()] + [(P + 1,)] * i)))),
        ):
            args = [c, r]
            args[i] = bad
            with raises_naming(name):
                bradley_terry(*args)
    bad_margin = data.draw(
        st.one_of(
            st.sampled_from([math.nan, math.inf, -math.inf, "1", None, True]),
            float_tensors((P + 1,)),
            int_tensors((P,), dtype=None),
            float_tensors((P,), nonfinite=True),
        )
    )
    with raises_naming("margin"):
        bradley_terry(c, r, margin=bad_margin)


@given(data=st.data(), extreme=st.booleans())
def test_bradley_terry_on_strategy_rewards_matches_a_loop(data, extreme):
    """Scores from ``rollkit.testing.rewards`` (up to 1e6): the loss is ``softplus(-(c - r -
    m))`` per pair, non-negative, shift invariant, and the metrics are the loop's means."""
    P = data.draw(st.integers(1, 6))
    c, r = data.draw(rewards(P, extreme=extreme)), data.draw(rewards(P, extreme=extreme))
    margin = data.draw(st.one_of(st.floats(-3, 3), float_tensors((P,), min_value=-3, max_value=3)))
    out = bradley_terry(c, r, margin=margin)
    m = margin.tolist() if isinstance(margin, torch.Tensor) else [margin] * P
    h = [float(a) - float(b) - float(k) for a, b, k in zip(c.double(), r.double(), m)]
    want = torch.tensor([_softplus(-x) for x in h], dtype=torch.float64)
    assert out.loss.shape == (P,) and (out.loss >= 0).all()
    torch.testing.assert_close(out.loss.double(), want, rtol=1e-5, atol=1e-6 * (1 + float(c.abs().max())))
    shift = data.draw(st.sampled_from([-7.0, 0.5, 100.0]))
    torch.testing.assert_close(
        bradley_terry(c.double() + shift, r.double() + shift, margin=margin).loss, want, rtol=1e-9, atol=1e-9
    )
    acc = sum(float(a) > float(b) for a, b in zip(c, r)) / P
    assert float(out.metrics["rewards/accuracies"]) == pytest.approx(acc)


def test_bradley_terry_of_huge_scores_matches_float64():
    """The loss of scores up to float32's largest: the float64 loss rounded, ``inf`` only where
    that loss is beyond float32 (a gap of ``-6e38``). The metrics are not compared: their
    float32 means overflow (``_PREF`` above, the same known issue as the other preference
    losses)."""

    @settings(max_examples=80)
    @given(data=st.data())
    def run(data):
        P = data.draw(st.integers(1, 6))
        c, r = (
            data.draw(float_tensors((P,), **HUGE_LP)),
            data.draw(float_tensors((P,), min_value=0.0, max_value=F32_MAX, huge=True)),
        )
        check_float64_agreement(lambda a, b: bradley_terry(a, b), [c, r], rtol=1e-5, atol=1e-6, metrics=False)

    run()
