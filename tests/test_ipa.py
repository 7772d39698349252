"""Tests of IPA's chunk-level primitives (rollkit.losses.ipa, rollkit.advantages.ipa):
a hand-computed two-turn episode, then hypothesis properties (on-policy ratios, invariances,
masks, the GSPO / PPO limits) and a gradient check."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rollkit.advantages import discounted_step_returns, ipa_advantages
from rollkit.losses import gspo, ppo_clip
from rollkit.losses.ipa import chunk_clip_mask, chunk_index, chunk_log_ratio, chunk_mask, ipa_loss
from rollkit.registry import ADVANTAGE_ESTIMATORS, POLICY_LOSSES
from rollkit.testing import (
    batches,
    chunk_ids,
    float_tensors,
    int_tensors,
    invalid_masks,
    non_tensors,
    step_batches,
)

_PROPS = settings(max_examples=max(10, settings.default.max_examples // 2), deadline=None)


# --------------------------------------------------------------------------- hand-computed


# One episode of two turns: [a1 a2 | obs obs | b1] (the observation tokens are not actions).
LP = torch.tensor([[-1.0, -1.0, 0.0, 0.0, -2.0]])
OLD = torch.tensor([[-1.1, -1.3, 0.0, 0.0, -1.9]])  # token log-ratios 0.1, 0.3 | 0.1 - 0 ... | -0.1
MASK = torch.tensor([[True, True, False, False, True]])
IDS = torch.tensor([[0, 0, -1, -1, 1]])


def test_two_turn_episode_by_hand():
    # ratios: chunk 0 = exp(mean(0.1, 0.3)) = e^0.2 = 1.221403; chunk 1 = e^-0.1 = 0.904837
    clr = chunk_log_ratio(LP, OLD, MASK, IDS)
    torch.testing.assert_close(clr, torch.tensor([[0.2, 0.2, 0.0, 0.0, -0.1]]))
    torch.testing.assert_close(
        chunk_log_ratio(LP, OLD, MASK, IDS, reduce="sum"), torch.tensor([[0.4, 0.4, 0.0, 0.0, -0.1]])
    )
    # credit: turn rewards r = (0, 1), gamma = 0.9: G_0 = 0 + 0.9 * 1 = 0.9, G_1 = 1.0
    adv_steps = ipa_advantages(
        torch.tensor([0.0, 1.0]), torch.tensor([0, 0]), torch.tensor([0, 1]), gamma=0.9, norm="none"
    )
    torch.testing.assert_close(adv_steps, torch.tensor([0.9, 1.0]))
    adv = torch.tensor([[0.9, 0.9, 0.0, 0.0, 1.0]])  # spread over each turn's tokens
    # masks: chunk 0 has rho = 1.2214 > 1.2 with A > 0 -> clipped (dropped) as a whole
    assert chunk_clip_mask(clr, adv, MASK).tolist() == [[True, True, False, False, False]]
    # rejection at [0.95, 1.1]: chunk 0 (1.2214) and chunk 1 (0.9048) both leave it
    assert chunk_mask(clr, MASK, low=0.95, high=1.1).tolist() == [[False] * 5]
    assert chunk_mask(clr, MASK, low=0.9, high=1.25).tolist() == [[True, True, False, False, True]]
    # loss: chunk 0 = max(-0.9 * 1.221403, -0.9 * 1.2) = -1.08; chunk 1 = -1.0 * 0.904837
    lp = LP.clone().requires_grad_(True)
    out = ipa_loss(lp, OLD, adv, MASK, IDS)
    torch.testing.assert_close(out.loss, torch.tensor([[-1.08, -1.08, 0.0, 0.0, -0.904837]]))
    out.loss.sum().backward()
    # gradient: 0 through the clipped chunk; chunk 1 (one token): -A rho / |c| = -0.904837
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, 0.0, 0.0, 0.0, -0.904837]]))
    m = out.metrics
    assert float(m["clip_frac"]) == pytest.approx(2 / 3) and float(m["clip_frac_high"]) == pytest.approx(
        2 / 3
    )
    assert float(m["num_chunks"]) == 2
    assert float(m["chunk_ratio_max"]) == pytest.approx(math.exp(0.2), rel=1e-6)
    assert float(m["chunk_ratio_min"]) == pytest.approx(math.exp(-0.1), rel=1e-6)


def test_two_turn_gradient_inside_the_trust_region_by_hand():
    # wider clip: chunk 0 unclipped, each of its 2 tokens gets -sum_t A_t rho / |c| = -0.9 * 1.221403
    lp = LP.clone().requires_grad_(True)
    adv = torch.tensor([[0.9, 0.9, 0.0, 0.0, 1.0]])
    ipa_loss(lp, OLD, adv, MASK, IDS, clip_high=0.5).loss.sum().backward()
    g0 = -0.9 * math.exp(0.2)  # = 2 tokens * (-0.9 * rho / 2)
    torch.testing.assert_close(lp.grad, torch.tensor([[g0, g0, 0.0, 0.0, -math.exp(-0.1)]]))


def test_ipa_advantages_by_hand():
    # episode 0: turns (0, 1) with rewards (0, 1); episode 1: one turn, reward 0; gamma 0.9
    r, traj, step = torch.tensor([0.0, 1.0, 0.0]), torch.tensor([0, 0, 1]), torch.tensor([0, 1, 0])
    # G = (0.9, 1.0, 0.0); mean 0.633333; unbiased std sqrt((0.266667^2 + 0.366667^2 + 0.633333^2) / 2)
    #   = sqrt(0.303333) = 0.550757
    want = torch.tensor([0.266667 / 0.550757, 0.366667 / 0.550757, -0.633333 / 0.550757])
    torch.testing.assert_close(ipa_advantages(r, traj, step, gamma=0.9, eps=0.0), want, rtol=1e-5, atol=1e-5)
    # norm="group": episodes in different groups are compared with themselves only
    g = torch.tensor([0, 0, 1])
    a = ipa_advantages(r, traj, step, g, gamma=0.9, norm="group", eps=0.0)
    torch.testing.assert_close(a, torch.tensor([-0.707107, 0.707107, 0.0]), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"^group_ids"):
        ipa_advantages(r, traj, step, gamma=0.9, norm="group")
    with pytest.raises(ValueError, match=r"^norm"):
        ipa_advantages(r, traj, step, norm="tokens")


def test_registered_by_name():
    e = POLICY_LOSSES.entry("ipa")
    assert e.fn is ipa_loss and e.in_keys["chunk_ids"] == "step_ids"
    assert POLICY_LOSSES.get("chunk-ppo") is ipa_loss
    a = ADVANTAGE_ESTIMATORS.entry("ipa")
    assert a.fn is ipa_advantages and "step_rewards" in a.in_keys.values()
    # the agentic loop's step-level call: the step tensors by key
    steps = {
        "step_rewards": torch.tensor([0.0, 1.0]),
        "traj_ids": torch.tensor([0, 0]),
        "step_index": torch.tensor([0, 1]),
        "group_ids": torch.tensor([0, 0]),
    }
    torch.testing.assert_close(a.call(steps, gamma=0.9, norm="none"), torch.tensor([0.9, 1.0]))
    avail = {
        "logprobs": LP,
        "old_logprobs": OLD,
        "advantages": torch.ones(1),
        "response_mask": MASK,
        "step_ids": IDS,
    }
    torch.testing.assert_close(e.call(avail).loss, ipa_loss(LP, OLD, torch.ones(1), MASK, IDS).loss)


def test_bad_input_is_named():
    with pytest.raises((ValueError, TypeError), match=r"^chunk_ids"):
        chunk_log_ratio(LP, OLD, MASK, IDS.float())
    with pytest.raises(ValueError, match=r"^chunk_ids"):
        chunk_log_ratio(LP, OLD, MASK, IDS[:, :3])
    with pytest.raises(ValueError, match=r"^reduce"):
        chunk_log_ratio(LP, OLD, MASK, IDS, reduce="max")
    with pytest.raises(ValueError, match=r"^low"):
        chunk_mask(LP, MASK, low=2.0, high=1.0)


# --------------------------------------------------------------------------- properties


@_PROPS
@given(batches(garbage_padding=True), st.data())
def test_on_policy_ratios_are_one(b, data):
    mask, lp = b["response_mask"], b["logprobs"]
    ids = data.draw(chunk_ids(mask))
    for reduce in ("mean", "sum"):
        clr = chunk_log_ratio(lp, lp, mask, ids, reduce=reduce)
        assert torch.equal(clr, torch.zeros_like(clr))
    out = ipa_loss(lp, lp, b["advantages"], mask, ids)
    adv = torch.where(mask, b["advantages"], torch.zeros(()))
    torch.testing.assert_close(out.loss, -adv)
    assert not chunk_clip_mask(torch.zeros_like(lp), b["advantages"], mask).any()
    assert torch.equal(chunk_mask(torch.zeros_like(lp), mask, low=0.5, high=2.0), mask)


@_PROPS
@given(batches(garbage_padding=True), st.data())
def test_chunk_ratio_is_the_mean_or_sum_of_its_token_log_ratios(b, data):
    mask, lp, old = b["response_mask"], b["logprobs"], b["old_logprobs"]
    ids = data.draw(chunk_ids(mask))
    mean, total = chunk_log_ratio(lp, old, mask, ids), chunk_log_ratio(lp, old, mask, ids, reduce="sum")
    d = torch.where(mask, lp - old, torch.zeros(()))
    for i in range(mask.shape[0]):
        for c in ids[i][mask[i]].unique():
            sel = mask[i] & (ids[i] == c)
            s = d[i][sel].sum()
            torch.testing.assert_close(total[i][sel], s.expand(int(sel.sum())))
            torch.testing.assert_close(mean[i][sel], (s / sel.sum()).expand(int(sel.sum())))
    assert torch.equal(mean[~mask], torch.zeros(int((~mask).sum())))


@_PROPS
@given(batches(), st.data())
def test_invariances_relabel_permute_pad(b, data):
    mask, lp, old, adv = b["response_mask"], b["logprobs"], b["old_logprobs"], b["advantages"]
    ids = data.draw(chunk_ids(mask))
    ref = ipa_loss(lp, old, adv, mask, ids)
    # relabelling the chunk ids (any injective map, order included) changes nothing
    relabel = torch.where(mask, 1000 - 7 * ids, ids)
    torch.testing.assert_close(ipa_loss(lp, old, adv, mask, relabel).loss, ref.loss)
    # the same ids in two rows are two chunks: permuting rows permutes the loss
    perm = torch.tensor(data.draw(st.permutations(range(mask.shape[0]))), dtype=torch.long)
    out = ipa_loss(lp[perm], old[perm], adv[perm], mask[perm], ids[perm])
    torch.testing.assert_close(out.loss, ref.loss[perm])
    # padding columns (garbage under a False mask) change nothing
    pad = 3
    cat = lambda x, v: torch.cat([x, torch.full((x.shape[0], pad), v, dtype=x.dtype)], 1)  # noqa: E731
    out = ipa_loss(cat(lp, math.nan), cat(old, math.inf), cat(adv, math.nan), cat(mask, False), cat(ids, 0))
    torch.testing.assert_close(out.loss[:, : mask.shape[1]], ref.loss)
    for k in ("chunk_ratio_mean", "chunk_ratio_min", "chunk_ratio_max", "num_chunks", "clip_frac"):
        torch.testing.assert_close(out.metrics[k], ref.metrics[k])


@_PROPS
@given(batches(), st.data())
def test_chunk_masks_are_constant_on_each_chunk(b, data):
    mask, lp, old = b["response_mask"], b["logprobs"], b["old_logprobs"]
    ids = data.draw(chunk_ids(mask))
    clr = chunk_log_ratio(lp, old, mask, ids)
    adv = torch.randn(mask.shape[0])  # chunk-constant advantages
    index, _, _ = chunk_index(ids, mask)
    for keep in (chunk_mask(clr, mask, low=0.8, high=1.25), chunk_clip_mask(clr, adv, mask)):
        assert not (keep & ~mask).any()
        for c in index[mask].unique():
            sel = mask & (index == c)
            assert keep[sel].all() or not keep[sel].any()
    # where the clip mask is set, the loss has no gradient
    lp = lp.clone().requires_grad_(True)
    ipa_loss(lp, old, adv, mask, ids).loss.sum().backward()
    clipped = chunk_clip_mask(clr, adv, mask)
    assert torch.equal(lp.grad[clipped], torch.zeros(int(clipped.sum())))


@_PROPS
@given(batches())
def test_limits_one_chunk_is_gspo_one_token_chunks_are_ppo(b):
    mask, lp, old = b["response_mask"], b["logprobs"], b["old_logprobs"]
    adv_seq = b["rewards"]
    torch.testing.assert_close(
        ipa_loss(lp, old, adv_seq, mask, None, clip_low=0.1, clip_high=0.1).loss,
        gspo(lp, old, adv_seq, mask, clip_low=0.1, clip_high=0.1).loss,
    )
    one_each = torch.arange(mask.numel()).view(mask.shape)
    torch.testing.assert_close(
        ipa_loss(lp, old, b["advantages"], mask, one_each).loss, ppo_clip(lp, old, b["advantages"], mask).loss
    )


@_PROPS
@given(batches(max_batch=4, max_len=6), st.floats(0.0, 1.0))
def test_ipa_advantages_norm_none_is_discounted_step_returns(b, gamma):
    # one chunk per row of rewards: steps = the rows, in reverse step order inside one episode
    r = b["rewards"]
    n = r.shape[0]
    traj, step = torch.zeros(n, dtype=torch.long), torch.arange(n).flip(0)
    got = ipa_advantages(r, traj, step, gamma=gamma, norm="none")
    torch.testing.assert_close(got, discounted_step_returns(r, traj, step, gamma=gamma))
    a = ipa_advantages(r, traj, step, gamma=gamma)
    assert torch.isfinite(a).all()
    if n > 1 and not torch.equal(got, got[:1].expand(n)):
        assert abs(float(a.mean())) < 1e-4


def test_gradcheck_float64():
    torch.manual_seed(0)
    lp = (-torch.rand(2, 6, dtype=torch.float64)).requires_grad_(True)
    old = lp.detach() + 0.01 * torch.randn(2, 6, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0, 1, 1, 0], [1, 1, 1, 1, 0, 0]], dtype=torch.bool)
    ids = torch.tensor([[0, 0, -1, 1, 1, -1], [0, 1, 1, 1, -1, -1]])
    adv = torch.randn(2, 6, dtype=torch.float64)
    for reduce in ("mean", "sum"):
        assert torch.autograd.gradcheck(
            lambda x, r=reduce: ipa_loss(x, old, adv, mask, ids, reduce=r, clip_low=0.5, clip_high=0.5).loss,
            (lp,),
        )


# --------------------------------------------------------------------------- rollkit.testing reaches the chunk primitives


@_PROPS
@given(batches(), st.booleans(), st.data())
def test_chunk_index_is_the_partition_of_a_loop(b, interleaved, data):
    """``chunk_index`` on ``rollkit.testing.chunk_ids`` (turns across holes, interleaved chunks,
    the same id in several rows, garbage under the mask) against a plain loop: one unit per
    ``(row, id)`` of the valid tokens and one per row for its invalid tokens, numbered by
    sorted ``(row, valid, id)``."""
    mask = b["response_mask"]
    ids = data.draw(chunk_ids(mask, interleaved=interleaved))
    index, valid, n = chunk_index(ids, mask)
    units: dict[tuple, list] = {}
    for i in range(mask.shape[0]):
        for t in range(mask.shape[1]):
            key = (i, 1, int(ids[i, t])) if mask[i, t] else (i, 0, 0)
            units.setdefault(key, []).append((i, t))
    assert index.shape == mask.shape and index.dtype == torch.int64
    assert n == len(units) and valid.shape == (n,)
    for c, key in enumerate(sorted(units)):
        assert {int(index[i, t]) for i, t in units[key]} == {c}
        assert bool(valid[c]) == bool(key[1])
    # ids=None: one chunk per row, i.e. any constant ids
    torch.testing.assert_close(chunk_index(None, mask)[0], chunk_index(torch.zeros_like(ids), mask)[0])


@_PROPS
@given(batches(garbage_padding=True), st.data())
def test_chunk_clip_mask_is_the_formula_and_exactly_where_ipa_loss_has_no_gradient(b, data):
    mask, lp, old = b["response_mask"], b["logprobs"], b["old_logprobs"]
    ids = data.draw(chunk_ids(mask, interleaved=data.draw(st.booleans())))
    lo, hi = data.draw(st.sampled_from([0.0, 0.1, 0.2, 1.0])), data.draw(st.sampled_from([0.0, 0.2, 0.5]))
    adv = data.draw(float_tensors((mask.shape[0],), min_value=-2.0, max_value=2.0))  # constant per chunk
    reduce = data.draw(st.sampled_from(["mean", "sum"]))
    clr = chunk_log_ratio(lp, old, mask, ids, reduce=reduce)
    clipped = chunk_clip_mask(clr, adv, mask, clip_low=lo, clip_high=hi)
    # the formula, in float64, away from the rounding of the two boundaries
    rho, a = clr.double().exp(), adv.double()[:, None].expand(mask.shape)
    want = mask & (((a > 0) & (rho > 1 + hi)) | ((a < 0) & (rho < 1 - lo)))
    tie = ((rho - (1 + hi)).abs() < 1e-5) | ((rho - (1 - lo)).abs() < 1e-5)
    assert torch.equal(clipped[~tie], want[~tie])
    assert not (clipped & ~mask).any()
    # exactly ipa_loss's clip set: its clip_frac, and its zero gradient
    x = lp.clone().requires_grad_(True)
    out = ipa_loss(x, old, adv, mask, ids, clip_low=lo, clip_high=hi, reduce=reduce)
    n = int(mask.sum())
    torch.testing.assert_close(out.metrics["clip_frac"], torch.tensor(int(clipped.sum()) / max(n, 1)))
    out.loss.sum().backward()
    assert torch.equal(x.grad[clipped], torch.zeros(int(clipped.sum())))
    live = mask & ~clipped & (a.abs() > 1e-20)  # unclipped with a non-zero advantage: a gradient
    assert (x.grad[live] != 0).all()


@_PROPS
@given(batches(nonfinite=("logprobs",)), st.data())
def test_a_non_finite_log_prob_makes_its_chunk_nan_not_clipped_and_its_loss_nan(b, data):
    """The documented value of ``chunk_clip_mask`` at a NaN ratio: not clipped (False), as in
    ``ipa_loss`` (whose loss is then NaN there: the NaN propagates, it does not vanish)."""
    mask, lp, old = b["response_mask"], b["logprobs"], b["old_logprobs"]
    ids = data.draw(chunk_ids(mask))
    index, _, _ = chunk_index(ids, mask)
    bad = mask & torch.isin(index, index[mask & ~torch.isfinite(lp)])  # tokens of the hit chunks
    clr = chunk_log_ratio(lp, old, mask, ids)
    assert torch.isnan(clr[bad]).all() and torch.isfinite(clr[mask & ~bad]).all()
    for sign in (1.0, -1.0):
        adv = torch.full((mask.shape[0],), sign)
        clipped = chunk_clip_mask(clr, adv, mask, clip_low=0.0, clip_high=0.0)
        assert not clipped[bad].any()
        out = ipa_loss(lp, old, adv, mask, ids, clip_low=0.0, clip_high=0.0)
        assert torch.isnan(out.loss[bad]).all() and torch.isfinite(out.loss[~bad]).all()
        n = max(int(mask.sum()), 1)
        torch.testing.assert_close(out.metrics["clip_frac"], torch.tensor(int(clipped.sum()) / n))
    # a NaN advantage is not clipped either
    nan_adv = torch.full((mask.shape[0],), math.nan)
    assert not chunk_clip_mask(torch.full_like(clr, 5.0), nan_adv, mask).any()


@_PROPS
@given(batches(), st.data())
def test_chunk_primitives_refuse_invalid_masks_and_ids_by_name(b, data):
    mask, lp, old, adv = b["response_mask"], b["logprobs"], b["old_logprobs"], b["advantages"]
    B, T = mask.shape
    ids = data.draw(chunk_ids(mask))
    bad_mask = data.draw(invalid_masks((B, T)))
    # chunk_index's reference is the mask: a [B', T'] bool mask is a mismatch of the ids' shape
    with pytest.raises((ValueError, TypeError), match=r"^(mask|chunk_ids): "):
        chunk_index(ids, bad_mask)
    # without ids the mask is the only input: any [B', T'] bool mask is valid, nothing else
    if not (isinstance(bad_mask, torch.Tensor) and bad_mask.dtype == torch.bool and bad_mask.ndim == 2):
        with pytest.raises((ValueError, TypeError), match=r"^mask: "):
            chunk_index(None, bad_mask)
    for call in (
        lambda m: chunk_log_ratio(lp, old, m, ids),
        lambda m: chunk_clip_mask(lp, adv, m),
        lambda m: chunk_mask(lp, m, high=2.0),
        lambda m: ipa_loss(lp, old, adv, m, ids),
    ):
        with pytest.raises((ValueError, TypeError), match=r"^mask: "):
            call(bad_mask)
    with pytest.raises((ValueError, TypeError), match=r"^chunk_ids: "):
        chunk_index(
            data.draw(non_tensors((B, T)).filter(lambda v: v is not None)), mask
        )  # None: one chunk a row
    with pytest.raises((ValueError, TypeError), match=r"^chunk_ids: "):
        chunk_index(ids.float(), mask)
    with pytest.raises((ValueError, TypeError), match=r"^advantages: "):
        chunk_clip_mask(lp, data.draw(int_tensors((B,), dtype=None)), mask)
    with pytest.raises((ValueError, TypeError), match=r"^chunk_log_ratio: "):
        chunk_clip_mask(data.draw(non_tensors((B, T))), adv, mask)


def test_named_bad_inputs_of_the_issue():
    """Each bad input the issue lists: a one-line error naming the argument (before: a raw
    AttributeError / unpacking error, a uint8 mask accepted, torch's device error)."""
    ids, m = IDS, MASK
    cases = [
        (lambda: chunk_index(ids, None), r"^mask: expected a torch\.Tensor, got NoneType$"),
        (lambda: chunk_index(ids, m.tolist()), r"^mask: expected a torch\.Tensor, got list$"),
        (lambda: chunk_index(None, m[0]), r"^mask: expected shape \[B, T\], got \[5\]$"),
        (lambda: chunk_index(ids[0], m[0]), r"^mask: expected shape \[B, T\], got \[5\]$"),
        (
            lambda: chunk_index(ids, m.to(torch.uint8)),
            r"^mask: expected a torch\.bool mask, got dtype torch\.uint8",
        ),
        (lambda: chunk_index(ids.to("meta"), m), r"^chunk_ids: is on device meta but mask is on cpu$"),
        (
            lambda: chunk_clip_mask(chunk_log_ratio(LP, OLD, m, ids), torch.ones(1, device="meta"), m),
            r"^advantages: is on device meta but chunk_log_ratio is on cpu$",
        ),
    ]
    for call, match in cases:
        with pytest.raises((ValueError, TypeError), match=match) as err:
            call()
        assert "\n" not in str(err.value)
    # the same uint8 mask is refused by chunk_log_ratio with the same message
    with pytest.raises(TypeError, match=r"^mask: expected a torch\.bool mask, got dtype torch\.uint8"):
        chunk_log_ratio(LP, OLD, m.to(torch.uint8), ids)


@_PROPS
@given(step_batches(gaps=True), st.sampled_from([0.0, 0.9, 1.0]))
def test_ipa_advantages_on_step_batches(b, gamma):
    """``ipa_advantages`` on ``rollkit.testing.step_batches``: ``norm="none"`` is the discounted
    return, ``"batch"`` / ``"group"`` centre it over the batch / within each task group, and the
    result is invariant under a permutation of the chunks."""
    r, traj, step, g = b["step_rewards"].double(), b["traj_ids"], b["step_index"], b["group_ids"]
    ret = discounted_step_returns(r, traj, step, gamma=gamma)
    torch.testing.assert_close(ipa_advantages(r, traj, step, g, gamma=gamma, norm="none"), ret)
    scale = 1e-9 * (1 + float(ret.abs().sum()))
    assert abs(float(ipa_advantages(r, traj, step, gamma=gamma).sum())) <= scale
    grouped = ipa_advantages(r, traj, step, g, gamma=gamma, norm="group")
    for k in g.unique():
        assert abs(float(grouped[g == k].sum())) <= scale
    perm = torch.arange(len(r)).flip(0)
    out_p = ipa_advantages(r[perm], traj[perm], step[perm], g[perm], gamma=gamma, norm="group")
    torch.testing.assert_close(out_p, grouped[perm])


def test_ipa_advantages_refuse_group_ids_changing_within_an_episode():
    r, traj, step = torch.tensor([0.0, 1.0, 0.0]), torch.tensor([0, 0, 1]), torch.tensor([0, 1, 0])
    with pytest.raises(ValueError, match=r"^group_ids: must be constant within each trajectory; 1 traj"):
        ipa_advantages(r, traj, step, torch.tensor([0, 1, 1]), norm="group")
    # norm="batch" / "none" ignore the groups (documented)
    assert ipa_advantages(r, traj, step, torch.tensor([0, 1, 1])).shape == (3,)
