import math
from collections import defaultdict

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rollkit.advantages.agentic import (
    anchor_state_index,
    discounted_return_advantages,
    discounted_step_returns,
    gigpo_advantages,
    starpo_advantages,
)
from rollkit.registry import ADVANTAGE_ESTIMATORS
from rollkit.testing import group_ids, rewards, step_batches


def _args(b):
    return b["step_rewards"], b["traj_ids"], b["step_index"], b["group_ids"], b["state_ids"]


# --------------------------------------------------------------------------- plain-loop references


def ref_returns(r, traj, step, gamma):
    by_traj = defaultdict(dict)
    for i in range(len(r)):
        by_traj[int(traj[i])][int(step[i])] = float(r[i])
    out = []
    for i in range(len(r)):
        steps = by_traj[int(traj[i])]
        t = int(step[i])
        out.append(sum(gamma ** (k - t) * v for k, v in steps.items() if k >= t))
    return torch.tensor(out, dtype=torch.float64)


def ref_normalize(values, keys, norm, eps=1e-6):
    groups = defaultdict(list)
    for v, k in zip(values, keys):
        groups[k].append(v)
    out = []
    for v, k in zip(values, keys):
        g = groups[k]
        if max(g) == min(g):
            out.append(0.0)
            continue
        mean = sum(g) / len(g)
        a = v - mean
        if norm == "std":
            std = math.sqrt(sum((x - mean) ** 2 for x in g) / (len(g) - 1))
            a /= std + eps
        out.append(a)
    return out


def ref_gigpo(r, traj, step, group, state, *, gamma, omega, norm, episode_stats="trajectory"):
    r64 = r.double()
    n = len(r)
    total = defaultdict(float)
    tgroup = {}
    for i in range(n):
        total[int(traj[i])] += float(r64[i])
        tgroup[int(traj[i])] = int(group[i])
    if episode_stats == "trajectory":
        tids = sorted(total)
        a_t = dict(zip(tids, ref_normalize([total[t] for t in tids], [tgroup[t] for t in tids], norm)))
        a_e = [a_t[int(traj[i])] for i in range(n)]
    else:
        a_e = ref_normalize([total[int(traj[i])] for i in range(n)], [int(group[i]) for i in range(n)], norm)
    ret = ref_returns(r64, traj, step, gamma).tolist()
    a_s = ref_normalize(ret, [(int(group[i]), int(state[i])) for i in range(n)], norm)
    return torch.tensor([e + omega * s for e, s in zip(a_e, a_s)], dtype=torch.float64)


# --------------------------------------------------------------------------- discounted returns


def test_discounted_returns_hand_computed():
    # trajectory 5: steps 0, 1, 2 with rewards 1, 2, 4 ; trajectory 9: steps 0 and 2 (gap) with 1, 8
    r = torch.tensor([4.0, 1.0, 1.0, 2.0, 8.0])
    traj = torch.tensor([5, 9, 5, 5, 9])
    step = torch.tensor([2, 0, 0, 1, 2])
    out = discounted_step_returns(r, traj, step, gamma=0.5)
    # traj 5: R2 = 4, R1 = 2 + .5*4 = 4, R0 = 1 + .5*4 = 3 ; traj 9: R2 = 8, R0 = 1 + .25*8 = 3
    torch.testing.assert_close(out, torch.tensor([4.0, 3.0, 3.0, 4.0, 8.0]))
    # gamma = 1: reward-to-go ; gamma = 0: the immediate reward
    torch.testing.assert_close(
        discounted_step_returns(r, traj, step, gamma=1.0), torch.tensor([4.0, 9.0, 7.0, 6.0, 8.0])
    )
    torch.testing.assert_close(discounted_step_returns(r, traj, step, gamma=0.0), r)


@given(step_batches(gaps=True), st.sampled_from([0.0, 0.3, 0.95, 1.0]))
def test_discounted_returns_match_loop_reference(b, gamma):
    r = b["step_rewards"].double()
    out = discounted_step_returns(r, b["traj_ids"], b["step_index"], gamma=gamma)
    ref = ref_returns(r, b["traj_ids"], b["step_index"], gamma)
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-9)


@given(step_batches(), st.data())
def test_discounted_returns_gamma_zero_and_permutation(b, data):
    r, traj, step = b["step_rewards"], b["traj_ids"], b["step_index"]
    assert torch.equal(discounted_step_returns(r, traj, step, gamma=0.0), r)
    perm = torch.tensor(data.draw(st.permutations(range(len(r)))))
    out = discounted_step_returns(r, traj, step, gamma=0.9)
    out_p = discounted_step_returns(r[perm], traj[perm], step[perm], gamma=0.9)
    torch.testing.assert_close(out_p, out[perm])


def test_discounted_returns_errors_and_empty():
    r = torch.tensor([1.0, 2.0])
    with pytest.raises(ValueError, match=r"step_index: .*unique"):
        discounted_step_returns(r, torch.tensor([3, 3]), torch.tensor([1, 1]))
    with pytest.raises(ValueError, match="step_index: must be >= 0"):
        discounted_step_returns(r, torch.tensor([3, 3]), torch.tensor([0, -1]))
    with pytest.raises(ValueError, match="traj_ids: expected an integer tensor"):
        discounted_step_returns(r, torch.tensor([3.0, 3.0]), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="step_index: has 3 entries"):
        discounted_step_returns(r, torch.tensor([3, 3]), torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="step_rewards: expected a floating-point"):
        discounted_step_returns(torch.tensor([1, 2]), torch.tensor([3, 3]), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="step_rewards: contains 1 NaN"):
        discounted_step_returns(torch.tensor([1.0, float("nan")]), torch.tensor([3, 3]), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="gamma: must be in"):
        discounted_step_returns(r, torch.tensor([3, 3]), torch.tensor([0, 1]), gamma=1.5)
    empty = discounted_step_returns(
        torch.zeros(0), torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64)
    )
    assert empty.shape == (0,)


# --------------------------------------------------------------------------- GiGPO


def _two_episode_example():
    # One task group (id 4), two episodes that both start from state 100 and both pass through
    # state 200, in shuffled order:
    #   episode A (traj 1): s=100 r=0 -> s=200 r=0 -> s=300 r=1      R(A) = 1
    #   episode B (traj 2): s=100 r=0 -> s=200 r=0                    R(B) = 0
    rows = [  # (traj, step, state, reward)
        (2, 1, 200, 0.0),
        (1, 0, 100, 0.0),
        (1, 2, 300, 1.0),
        (2, 0, 100, 0.0),
        (1, 1, 200, 0.0),
    ]
    traj = torch.tensor([x[0] for x in rows])
    step = torch.tensor([x[1] for x in rows])
    state = torch.tensor([x[2] for x in rows])
    r = torch.tensor([x[3] for x in rows])
    return r, traj, step, torch.full((5,), 4), state


def test_gigpo_hand_computed_mean_norm():
    r, traj, step, group, state = _two_episode_example()
    adv = gigpo_advantages(r, traj, step, group, state, gamma=0.5, step_weight=1.0, norm="none")
    # A_E: returns (1, 0), mean 0.5 -> A: +0.5, B: -0.5
    # discounted returns (gamma .5): A = (0.25, 0.5, 1), B = (0, 0)
    # anchor s=100: {A 0.25, B 0} mean .125 -> +-.125 ; s=200: {A .5, B 0} -> +-.25 ; s=300 alone -> 0
    expected = torch.tensor([-0.5 - 0.25, 0.5 + 0.125, 0.5 + 0.0, -0.5 - 0.125, 0.5 + 0.25])
    torch.testing.assert_close(adv, expected)
    # omega scales the step term only
    adv2 = gigpo_advantages(r, traj, step, group, state, gamma=0.5, step_weight=2.0, norm="none")
    torch.testing.assert_close(adv2, torch.tensor([-1.0, 0.75, 0.5, -0.75, 1.0]))


def test_gigpo_hand_computed_std_norm():
    r, traj, step, group, state = _two_episode_example()
    adv = gigpo_advantages(r, traj, step, group, state, gamma=0.5, norm="std", eps=0.0)
    # two-member groups {x, y}: unbiased std = |x - y| / sqrt(2), centred values +-|x - y| / 2
    # -> every non-constant pair normalises to +-1/sqrt(2), whatever the scale
    h = 1 / math.sqrt(2)
    expected = torch.tensor([-h - h, h + h, h + 0.0, -h - h, h + h])
    torch.testing.assert_close(adv, expected)
    biased = gigpo_advantages(r, traj, step, group, state, gamma=0.5, norm="std", eps=0.0, unbiased_std=False)
    torch.testing.assert_close(biased, torch.tensor([-2.0, 2.0, 1.0, -2.0, 2.0]))


def test_gigpo_episode_stats_step_weighting():
    # A: 2 steps, R = 1 ; B: 1 step, R = 0.  Step-weighted mean = (1 + 1 + 0) / 3 = 2/3.
    r = torch.tensor([0.0, 1.0, 0.0])
    traj, step = torch.tensor([0, 0, 1]), torch.tensor([0, 1, 0])
    group, state = torch.tensor([7, 7, 7]), torch.tensor([1, 2, 3])  # all anchors singletons
    per_step = gigpo_advantages(r, traj, step, group, state, episode_stats="step")
    torch.testing.assert_close(per_step, torch.tensor([1 / 3, 1 / 3, -2 / 3]))
    per_traj = gigpo_advantages(r, traj, step, group, state, episode_stats="trajectory")
    torch.testing.assert_close(per_traj, torch.tensor([0.5, 0.5, -0.5]))


def test_gigpo_episode_returns_override():
    r, traj, step, group, state = _two_episode_example()
    total = torch.tensor([0.0, 1.0, 1.0, 0.0, 1.0])  # per step: its episode's sum of rewards
    base = gigpo_advantages(r, traj, step, group, state, gamma=0.5)
    torch.testing.assert_close(gigpo_advantages(r, traj, step, group, state, total, gamma=0.5), base)
    # an outcome score that disagrees with the step rewards: B succeeds (3), A does not (1)
    score = torch.where(traj == 1, 1.0, 3.0)
    adv = gigpo_advantages(r, traj, step, group, state, score, gamma=0.5, step_weight=0.0)
    torch.testing.assert_close(adv, torch.where(traj == 1, -1.0, 1.0))
    with pytest.raises(ValueError, match="episode_returns: must be constant within each trajectory"):
        gigpo_advantages(r, traj, step, group, state, torch.arange(5.0))
    with pytest.raises(ValueError, match="episode_returns: has 2 entries"):
        gigpo_advantages(r, traj, step, group, state, torch.zeros(2))


@given(step_batches(gaps=True), st.sampled_from(["none", "std"]), st.sampled_from([0.0, 0.5, 1.0]))
def test_gigpo_matches_loop_reference(b, norm, omega):
    b["step_rewards"] = b["step_rewards"].double()
    out = gigpo_advantages(*_args(b), gamma=0.9, step_weight=omega, norm=norm)
    ref = ref_gigpo(*_args(b), gamma=0.9, omega=omega, norm=norm)
    torch.testing.assert_close(out, ref, rtol=1e-7, atol=1e-7)


@given(step_batches(), st.sampled_from(["none", "std"]))
def test_gigpo_step_stats_match_loop_reference(b, norm):
    b["step_rewards"] = b["step_rewards"].double()
    out = gigpo_advantages(*_args(b), gamma=0.7, norm=norm, episode_stats="step")
    ref = ref_gigpo(*_args(b), gamma=0.7, omega=1.0, norm=norm, episode_stats="step")
    torch.testing.assert_close(out, ref, rtol=1e-7, atol=1e-7)


@given(step_batches(), st.data())
def test_gigpo_permutation_invariant(b, data):
    args = _args(b)
    perm = torch.tensor(data.draw(st.permutations(range(len(args[0])))))
    out = gigpo_advantages(*args, norm="std")
    out_p = gigpo_advantages(*(a[perm] for a in args), norm="std")
    torch.testing.assert_close(out_p, out[perm])


@given(step_batches(), st.sampled_from([(7, 3), (-1, 1000), (13, -5)]))
def test_gigpo_id_relabelling_invariant(b, affine):
    a, c = affine  # injective relabelling x -> a*x + c of traj, group and state ids
    r, traj, step, group, state = _args(b)
    out = gigpo_advantages(r, traj, step, group, state, norm="std")
    out2 = gigpo_advantages(r, a * traj + c, step, a * group - c, -state * a + c, norm="std")
    torch.testing.assert_close(out2, out)


@given(step_batches())
def test_gigpo_singleton_anchors_give_episode_term_only(b):
    r, traj, step, group, _ = _args(b)
    unique_states = torch.arange(len(r)) * 31 + 5  # every step its own anchor
    out = gigpo_advantages(r, traj, step, group, unique_states, step_weight=3.0, norm="std")
    episode_only = gigpo_advantages(r, traj, step, group, unique_states, step_weight=0.0, norm="std")
    torch.testing.assert_close(out, episode_only)


@given(step_batches(), st.sampled_from(["none", "std"]))
def test_gigpo_omega_zero_is_starpo_over_episodes(b, norm):
    r, traj, step, group, state = _args(b)
    out = gigpo_advantages(r, traj, step, group, state, step_weight=0.0, norm=norm)
    # one row per trajectory: its return and group, through the trajectory-wise estimator
    tid, inv = torch.unique(traj, return_inverse=True)
    totals = torch.zeros(len(tid)).index_add(0, inv, r)
    tgroup = torch.zeros(len(tid), dtype=torch.int64).scatter(0, inv, group)
    per_traj = starpo_advantages(totals, tgroup, norm=norm)
    torch.testing.assert_close(out, per_traj[inv])
    # and it does not depend on the states or on gamma
    other = gigpo_advantages(r, traj, step, group, state * 0, step_weight=0.0, norm=norm, gamma=0.1)
    torch.testing.assert_close(other, out)


@given(step_batches(), st.floats(-5, 5))
def test_gigpo_constant_rewards_give_exact_zero(b, c):
    r, traj, step, group, state = _args(b)
    const = torch.full_like(r, c)
    # equal-length episodes are needed for equal returns, so use gamma=0 / episode returns given
    adv = gigpo_advantages(const, traj, step, group, state, torch.full_like(r, c), gamma=0.0, norm="std")
    assert torch.equal(adv, torch.zeros_like(r))


@given(step_batches(max_traj=5))
def test_gigpo_episode_term_is_group_centred(b):
    r, traj, step, group, state = _args(b)
    a_e = gigpo_advantages(r, traj, step, group, state, step_weight=0.0, norm="none")
    tid, inv = torch.unique(traj, return_inverse=True)
    per_traj = torch.zeros(len(tid)).scatter(0, inv, a_e)
    tgroup = torch.zeros(len(tid), dtype=torch.int64).scatter(0, inv, group)
    for g in tgroup.unique():  # per-group sums of the episode advantages vanish
        assert abs(per_traj[tgroup == g].sum().item()) <= 1e-3 * (1 + r.abs().max().item() * len(r))


def test_gigpo_singleton_task_group_and_revisited_state():
    # a single episode with distinct states: no baseline -> both terms are 0
    r, traj, step, group = (
        torch.tensor([2.0, 5.0]),
        torch.tensor([0, 0]),
        torch.tensor([0, 1]),
        torch.tensor([1, 1]),
    )
    adv = gigpo_advantages(r, traj, step, group, torch.tensor([3, 4]))
    assert torch.equal(adv, torch.zeros(2))
    # the episode revisits state 3: its two visits form an anchor group (as in verl-agent) and
    # compare their returns-to-go: R_0 = 2 + .5 * 5 = 4.5, R_1 = 5 -> mean 4.75 -> -0.25, +0.25
    adv = gigpo_advantages(r, traj, step, group, torch.tensor([3, 3]), gamma=0.5)
    torch.testing.assert_close(adv, torch.tensor([-0.25, 0.25]))
    empty_i = torch.zeros(0, dtype=torch.int64)
    assert gigpo_advantages(torch.zeros(0), empty_i, empty_i, empty_i, empty_i).shape == (0,)


def test_gigpo_same_state_in_two_task_groups_is_two_anchors():
    # two singleton task groups visiting the same state id: no anchor is shared across groups
    r = torch.tensor([1.0, 0.0])
    adv = gigpo_advantages(
        r, torch.tensor([0, 1]), torch.tensor([0, 0]), torch.tensor([0, 1]), torch.tensor([9, 9])
    )
    assert torch.equal(adv, torch.zeros(2))
    # same task group: a shared anchor, and a shared episode group
    adv = gigpo_advantages(
        r, torch.tensor([0, 1]), torch.tensor([0, 0]), torch.tensor([0, 0]), torch.tensor([9, 9])
    )
    torch.testing.assert_close(adv, torch.tensor([1.0, -1.0]))


def test_gigpo_does_not_mutate_and_keeps_dtype():
    r, traj, step, group, state = _two_episode_example()
    r64 = r.double()
    copies = [x.clone() for x in (r64, traj, step, group, state)]
    out = gigpo_advantages(r64, traj, step, group, state, norm="std")
    assert out.dtype == torch.float64
    for x, y in zip((r64, traj, step, group, state), copies):
        assert torch.equal(x, y)


def test_gigpo_errors():
    r, traj, step, group, state = _two_episode_example()
    with pytest.raises(ValueError, match=r"step_index: .*unique"):
        gigpo_advantages(r, traj, torch.zeros_like(step), group, state)
    with pytest.raises(ValueError, match="state_ids: expected an integer tensor"):
        gigpo_advantages(r, traj, step, group, state.float())
    with pytest.raises(ValueError, match="group_ids: expected an integer tensor"):
        gigpo_advantages(r, traj, step, group.bool(), state)
    with pytest.raises(ValueError, match="group_ids: has 4 entries"):
        gigpo_advantages(r, traj, step, group[:4], state)
    with pytest.raises(ValueError, match="step_rewards: expected 1 dimensions"):
        gigpo_advantages(r[:, None], traj, step, group, state)
    with pytest.raises(ValueError, match="group_ids: must be constant within each trajectory"):
        gigpo_advantages(r, traj, step, torch.tensor([4, 4, 4, 4, 5]), state)
    with pytest.raises(ValueError, match="step_rewards: contains 0 NaN and 1 inf"):
        gigpo_advantages(torch.tensor([0.0, 0.0, float("inf"), 0.0, 0.0]), traj, step, group, state)
    with pytest.raises(ValueError, match="norm: must be one of"):
        gigpo_advantages(r, traj, step, group, state, norm="mean_norm")
    with pytest.raises(ValueError, match="episode_stats: must be one of"):
        gigpo_advantages(r, traj, step, group, state, episode_stats="episode")
    with pytest.raises(ValueError, match="step_weight: must be >= 0"):
        gigpo_advantages(r, traj, step, group, state, step_weight=-1.0)
    with pytest.raises(ValueError, match="gamma: must be in"):
        gigpo_advantages(r, traj, step, group, state, gamma=-0.1)


def test_anchor_state_index():
    idx, n = anchor_state_index(torch.tensor([2, 1, 2, 2]), torch.tensor([-7, -7, 4, -7]))
    # pairs sorted: (1,-7)=0, (2,-7)=1, (2,4)=2
    assert n == 3 and idx.tolist() == [1, 0, 2, 1]
    with pytest.raises(ValueError, match="state_ids: has 1 entries"):
        anchor_state_index(torch.tensor([1, 2]), torch.tensor([1]))


# --------------------------------------------------------------------------- StarPO


def test_starpo_hand_computed():
    R = torch.tensor([1.0, 0.0, 5.0, 1.0, 5.0, 2.0])
    g = torch.tensor([0, 0, 9, 0, 9, 4])  # group 0: (1, 0, 1); group 9: (5, 5); group 4: singleton
    # group 0: mean 2/3, unbiased std = sqrt((1/9 + 4/9 + 1/9) / 2) = sqrt(1/3)
    s = math.sqrt(1 / 3)
    adv = starpo_advantages(R, g, eps=0.0)
    torch.testing.assert_close(adv, torch.tensor([(1 / 3) / s, (-2 / 3) / s, 0.0, (1 / 3) / s, 0.0, 0.0]))
    # biased std: sqrt(2/9)
    b = math.sqrt(2 / 9)
    adv_b = starpo_advantages(R, g, eps=0.0, unbiased_std=False)
    torch.testing.assert_close(adv_b, torch.tensor([(1 / 3) / b, (-2 / 3) / b, 0.0, (1 / 3) / b, 0.0, 0.0]))
    # eps enters as std + eps
    adv_e = starpo_advantages(R, g, eps=0.5)
    torch.testing.assert_close(adv_e[1], torch.tensor((-2 / 3) / (s + 0.5)))
    # mean-only
    adv_n = starpo_advantages(R, g, norm="none")
    torch.testing.assert_close(adv_n, torch.tensor([1 / 3, -2 / 3, 0.0, 1 / 3, 0.0, 0.0]))
    # RAGEN asym_clip: clamp to (-1, 3)
    adv_c = starpo_advantages(R, g, clip=(-1.0, 3.0))
    assert adv_c.min().item() == -1.0 and adv_c[0].item() == pytest.approx((1 / 3) / (s + 1e-6))


def test_starpo_min_std_zeroes_low_variance_groups():
    R = torch.tensor([1.0, 1.001, 0.0, 4.0])
    g = torch.tensor([0, 0, 1, 1])
    adv = starpo_advantages(R, g, min_std=0.01)  # group 0 std ~ 7e-4 <= 0.01 -> 0
    assert adv[:2].tolist() == [0.0, 0.0]
    assert adv[2].item() == pytest.approx(-1 / math.sqrt(2), rel=1e-5)
    adv_keep = starpo_advantages(R, g)
    assert adv_keep[0].item() == pytest.approx(-1 / math.sqrt(2), rel=1e-2)


@given(st.integers(1, 10).flatmap(lambda n: st.tuples(rewards(n), group_ids(n))))
def test_starpo_properties(data):
    R, g = data
    adv = starpo_advantages(R, g, norm="none")
    idx = torch.unique(g, return_inverse=True)[1]
    sums = torch.zeros(int(idx.max()) + 1).index_add(0, idx, adv)
    assert sums.abs().max().item() <= 1e-3 * (1 + R.abs().max().item())  # centred per group
    adv_s = starpo_advantages(R, g, eps=0.0)
    assert torch.isfinite(adv_s).all()
    # shift invariance per group and (std norm) scale invariance
    shift = (idx.double() * 3.0 - 1.0).float()
    torch.testing.assert_close(starpo_advantages(R + shift, g, norm="none"), adv, atol=1e-3, rtol=1e-4)
    torch.testing.assert_close(starpo_advantages(2.0 * R, g, eps=0.0), adv_s, atol=1e-4, rtol=1e-4)
    # non-constant groups have unit (unbiased) std
    for k in range(int(idx.max()) + 1):
        member = adv_s[idx == k]
        if member.numel() > 1 and member.abs().max() > 0:
            assert member.std().item() == pytest.approx(1.0, rel=1e-3)
        if member.numel() == 1:
            assert member.item() == 0.0


def test_starpo_errors_and_empty():
    with pytest.raises(ValueError, match="traj_returns: expected a floating-point"):
        starpo_advantages(torch.tensor([1, 0]), torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="group_ids: has 1 entries"):
        starpo_advantages(torch.tensor([1.0, 0.0]), torch.tensor([0]))
    with pytest.raises(ValueError, match="group_ids: expected an integer tensor"):
        starpo_advantages(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 0.0]))
    with pytest.raises(ValueError, match="traj_returns: contains 1 NaN"):
        starpo_advantages(torch.tensor([1.0, float("nan")]), torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="clip: expected"):
        starpo_advantages(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), clip=(3.0, -1.0))
    with pytest.raises(ValueError, match="norm: must be one of"):
        starpo_advantages(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), norm="mean_std")
    assert starpo_advantages(torch.zeros(0), torch.zeros(0, dtype=torch.int64)).shape == (0,)


# --------------------------------------------------------------------------- registry


def test_registered_with_keys():
    e = ADVANTAGE_ESTIMATORS.entry("gigpo")
    assert e.fn is gigpo_advantages and tuple(e.out_keys) == ("advantages",)
    assert e.in_keys == {
        "step_rewards": "step_rewards",
        "traj_ids": "traj_ids",
        "step_index": "step_index",
        "group_ids": "group_ids",
        "state_ids": "state_ids",
        "episode_returns": "episode_returns",
    }
    s = ADVANTAGE_ESTIMATORS.entry("starpo")
    assert s.fn is starpo_advantages and s.in_keys == {"traj_returns": "rewards", "group_ids": "group_ids"}
    assert tuple(s.out_keys) == ("advantages",)


@given(st.integers(1, 10).flatmap(lambda n: st.tuples(rewards(n, binary=True), group_ids(n))))
def test_starpo_defaults_agree_with_grpo(data):
    # StarPO's trajectory-level advantage is GRPO over whole episodes (same eps placement,
    # same singleton / constant-group conventions); binary rewards keep the comparison exact
    from rollkit.advantages.outcome import grpo_advantages

    R, g = data
    torch.testing.assert_close(starpo_advantages(R, g), grpo_advantages(R, g))
    torch.testing.assert_close(starpo_advantages(R, g, norm="none"), grpo_advantages(R, g, std_level=None))


def test_runs_on_a_tensordict_through_the_registry_keys():
    from tensordict import TensorDict

    from rollkit.td import td_module

    r, traj, step, group, state = _two_episode_example()
    keys = {"step_rewards": r, "traj_ids": traj, "step_index": step, "group_ids": group, "state_ids": state}
    td = TensorDict(keys, batch_size=[5])
    out = td_module("gigpo", gamma=0.5)(td.clone())["advantages"]
    torch.testing.assert_close(out, gigpo_advantages(r, traj, step, group, state, gamma=0.5))
    td["episode_returns"] = torch.where(traj == 1, 1.0, 3.0)  # optional key, read when present
    out = td_module("gigpo", gamma=0.5, step_weight=0.0)(td)["advantages"]
    torch.testing.assert_close(out, torch.where(traj == 1, -1.0, 1.0))


def test_group_normalisation_is_the_shared_ops_routine():
    from rollkit.ops import group_index, group_normalize

    R = torch.tensor([1000.1, 1000.2, 1000.3, 7.0, 7.0, 1000.2, 3.0])
    g = torch.tensor([5, 5, 5, 1, 1, 5, 2])
    idx, G = group_index(g)
    for norm, unbiased in (("std", True), ("std", False), ("none", True)):
        adv = starpo_advantages(R, g, norm=norm, unbiased_std=unbiased)
        assert torch.equal(adv, group_normalize(R, idx, G, scale=norm == "std", unbiased=unbiased, eps=1e-6))
    # min-shifted statistics: float32 values far from 0 keep their precision (a plain
    # x - mean in float32 is off by ~1e-3 here)
    ref = starpo_advantages(R.double(), g)
    torch.testing.assert_close(starpo_advantages(R, g).double(), ref, rtol=0, atol=1e-5)
    assert starpo_advantages(R, g)[3:5].tolist() == [0.0, 0.0]


# --------------------------------------------------------------------------- gradients, precision


def test_zero_spread_groups_have_finite_gradients():
    r = torch.tensor([1.0, 1.0, 0.0, 1.0], requires_grad=True)
    starpo_advantages(r, torch.tensor([0, 0, 1, 1])).sum().backward()
    assert torch.isfinite(r.grad).all(), r.grad
    # gigpo: a task group of two episodes with equal returns, constant and singleton anchors
    r = torch.tensor([0.0, 1.0, 1.0, 0.0, 2.0], requires_grad=True)
    traj, step = torch.tensor([0, 0, 1, 1, 2]), torch.tensor([0, 1, 0, 1, 0])
    group, state = torch.tensor([4, 4, 4, 4, 5]), torch.tensor([11, 12, 11, 13, 11])
    for stats in ("trajectory", "step"):
        r.grad = None
        adv = gigpo_advantages(r, traj, step, group, state, gamma=1.0, norm="std", episode_stats=stats)
        adv.sum().backward()
        assert torch.isfinite(r.grad).all(), (stats, r.grad)


def test_starpo_and_gigpo_pass_gradcheck_next_to_constant_and_singleton_groups():
    # starpo: informative groups 0 and 3, singleton 5, constant group 7 (held fixed)
    gid = torch.tensor([0, 0, 0, 3, 3, 5, 7, 7])
    fixed = torch.tensor([2.0, 2.0], dtype=torch.float64)
    z = torch.tensor([0.3, -1.2, 2.0, 0.9, 4.0, 1.0], dtype=torch.float64, requires_grad=True)
    for unbiased in (True, False):
        assert torch.autograd.gradcheck(
            lambda t, u=unbiased: starpo_advantages(torch.cat([t, fixed]), gid, unbiased_std=u), (z,)
        )
    # gigpo (norm="std"): task group 4 (three episodes, state 11 revisited), task group 6 whose
    # two episodes are constant (held fixed), and singleton anchors
    traj = torch.tensor([0, 0, 1, 1, 2, 3, 3, 4, 4])
    step = torch.tensor([0, 1, 0, 1, 0, 0, 1, 0, 1])
    group = torch.tensor([4, 4, 4, 4, 4, 6, 6, 6, 6])
    state = torch.tensor([11, 12, 11, 13, 11, 20, 21, 20, 21])
    fixed = torch.tensor([1.0, 0.5, 1.0, 0.5], dtype=torch.float64)
    z = torch.tensor([0.2, 1.3, -0.4, 0.7, 2.1], dtype=torch.float64, requires_grad=True)
    for stats in ("trajectory", "step"):
        assert torch.autograd.gradcheck(
            lambda t, s=stats: gigpo_advantages(
                torch.cat([t, fixed]), traj, step, group, state, gamma=0.9, norm="std", episode_stats=s
            ),
            (z,),
        )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_inputs_give_the_float32_result_rounded(dtype):
    gen = torch.Generator().manual_seed(3)
    n_traj, length = 300, 4  # task group 0 holds 257 trajectories: more than bfloat16 counts
    traj = torch.arange(n_traj).repeat_interleave(length)
    step = torch.arange(length).repeat(n_traj)
    tgroup = torch.where(torch.arange(n_traj) < 257, 0, 1 + torch.arange(n_traj) % 5)
    group = tgroup.repeat_interleave(length)
    state = torch.randint(0, 3, (n_traj * length,), generator=gen)
    r = (torch.rand(n_traj * length, generator=gen) * 4 + 1).to(dtype)  # the rounded inputs

    def check(fn):
        got = fn(r)
        assert got.dtype == dtype
        want = fn(r.float()).to(dtype).float()
        tol = torch.finfo(dtype).eps * want.abs() + torch.finfo(dtype).tiny
        assert ((got.float() - want).abs() <= tol).all()

    check(lambda x: discounted_step_returns(x, traj, step, gamma=0.97))
    check(lambda x: gigpo_advantages(x, traj, step, group, state, gamma=0.95, norm="std"))
    check(lambda x: gigpo_advantages(x, traj, step, group, state, norm="none", episode_stats="step"))
    r = (torch.rand(n_traj, generator=gen) * 40 + 10).to(dtype)  # episode returns
    check(lambda x: starpo_advantages(x, tgroup))
    check(lambda x: starpo_advantages(x, tgroup, norm="none", min_std=0.1))


@given(step_batches(gaps=True, max_len=9), st.sampled_from([0.3, 0.95, 1.0]))
def test_float32_discounted_returns_match_float64_loop_to_float32_precision(b, gamma):
    r = b["step_rewards"]
    assert r.dtype == torch.float32
    out = discounted_step_returns(r, b["traj_ids"], b["step_index"], gamma=gamma)
    assert out.dtype == torch.float32
    ref = ref_returns(r.double(), b["traj_ids"], b["step_index"], gamma)
    scale = ref_returns(r.double().abs(), b["traj_ids"], b["step_index"], gamma)
    assert ((out.double() - ref).abs() <= 1e-6 * scale + 1e-6).all()


# --------------------------------------------------------------------------- reliability (issue 14)


@given(
    step_batches(gaps=True, max_len=7), st.sampled_from([2, 10**7, 2**40]), st.sampled_from([0.5, 0.999, 1.0])
)
def test_huge_step_indices_use_memory_proportional_to_the_steps(b, stride, gamma):
    """``step_index`` may have gaps of any size (documented): the steps are compacted per
    trajectory (sort), so memory is O(N) and the result is the loop reference's, exponents of
    the gaps included (before, a dense ``[num_traj, max(step_index) + 1]`` table: 10^7 asked
    for ~800 TB)."""
    r, traj, step = b["step_rewards"], b["traj_ids"], b["step_index"] * stride + 3
    got = discounted_step_returns(r, traj, step, gamma=gamma)
    want = ref_returns(r.double(), traj, step, gamma)  # gamma ** 2**40 underflows to 0: fine
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-4)
    adv = gigpo_advantages(r, traj, step, b["group_ids"], b["state_ids"], gamma=gamma)
    ref = ref_gigpo(r, traj, step, b["group_ids"], b["state_ids"], gamma=gamma, omega=1.0, norm="none")
    assert torch.allclose(adv.double(), ref, rtol=1e-4, atol=1e-4)


def test_step_index_near_the_int64_limit():
    r = torch.tensor([1.0, 2.0, 4.0])
    traj, step = torch.tensor([5, 5, 9]), torch.tensor([2**62, 2**62 + 1, 2**62])
    assert discounted_step_returns(r, traj, step, gamma=0.5).tolist() == [2.0, 2.0, 4.0]
    with pytest.raises(
        ValueError, match=r"^step_index: \(traj_id, step_index\) pairs must be unique; 1 pair"
    ):
        discounted_step_returns(r, torch.tensor([5, 5, 5]), torch.tensor([2**62, 7, 2**62]))
    with pytest.raises(ValueError, match=r"2 pair\(s\) occur more than once"):
        discounted_step_returns(torch.ones(5), torch.tensor([1, 1, 1, 2, 2]), torch.tensor([0, 0, 0, 4, 4]))


def test_agentic_estimators_check_devices_and_refuse_meta_by_name():
    r, traj, step = torch.tensor([1.0, 2.0]), torch.tensor([0, 0]), torch.tensor([0, 1])
    g, s = torch.tensor([0, 0]), torch.tensor([1, 2])
    with pytest.raises(ValueError, match=r"^step_index: is on device meta but step_rewards is on cpu$"):
        discounted_step_returns(r, traj, step.to("meta"))
    with pytest.raises(ValueError, match=r"^episode_returns: is on device meta"):
        gigpo_advantages(r, traj, step, g, s, torch.ones(2, device="meta"))
    with pytest.raises(ValueError, match=r"^group_ids: is on device meta but traj_returns is on cpu$"):
        starpo_advantages(r, g.to("meta"))
    with pytest.raises(ValueError, match=r"^clip: expected a number, got str$"):
        starpo_advantages(r, g, clip=("a", 1.0))
    meta = [t.to("meta") for t in (r, traj, step, g, s)]
    with pytest.raises(ValueError, match=r"^step_rewards: is on the meta device"):
        gigpo_advantages(*meta)
    from rollkit.validation import value_checks

    with value_checks(False), pytest.raises(ValueError, match=r"^traj_ids: is on the meta device"):
        discounted_step_returns(*meta[:3])


# --------------------------------------------------------------------------- discounted-return advantages


@given(step_batches(gaps=True), st.sampled_from([0.0, 0.5, 0.95, 1.0]), st.sampled_from(["none", "std"]))
def test_discounted_return_advantages_match_loop_reference(b, gamma, norm):
    """``rollkit.testing.step_batches`` (shuffled, ragged, gaps, arbitrary ids) against a plain
    loop: the discounted returns-to-go, centred (and scaled) within each task group."""
    r, traj, step, group = b["step_rewards"].double(), b["traj_ids"], b["step_index"], b["group_ids"]
    out = discounted_return_advantages(r, traj, step, group, gamma=gamma, norm=norm)
    ret = ref_returns(r, traj, step, gamma).tolist()
    ref = torch.tensor(ref_normalize(ret, group.tolist(), norm), dtype=torch.float64)
    torch.testing.assert_close(out, ref, rtol=1e-7, atol=1e-7)
    for g in group.unique():  # centred within each task group
        assert abs(float(out[group == g].sum())) <= 1e-9 * (1 + float(r.abs().sum()))


@given(step_batches(), st.data(), st.sampled_from([(7, 3), (-1, 1000)]))
def test_discounted_return_advantages_permutation_and_relabelling_invariant(b, data, affine):
    r, traj, step, group = b["step_rewards"], b["traj_ids"], b["step_index"], b["group_ids"]
    out = discounted_return_advantages(r, traj, step, group, gamma=0.9)
    perm = torch.tensor(data.draw(st.permutations(range(len(r)))), dtype=torch.int64)
    out_p = discounted_return_advantages(r[perm], traj[perm], step[perm], group[perm], gamma=0.9)
    torch.testing.assert_close(out_p, out[perm])
    a, c = affine
    torch.testing.assert_close(
        discounted_return_advantages(r, a * traj + c, step, a * group - c, gamma=0.9), out
    )


@given(step_batches(min_traj=2), st.data())
def test_discounted_return_advantages_refuse_group_ids_changing_within_an_episode(b, data):
    """The rule of every estimator of the module (GiGPO's check, shared): an episode belongs to
    one task group. Before, the steps of one episode were silently compared with two groups."""
    r, traj, step, group = b["step_rewards"], b["traj_ids"], b["step_index"], b["group_ids"]
    long_traj = [t for t in traj.unique().tolist() if int((traj == t).sum()) > 1]
    if not long_traj:
        return
    t = data.draw(st.sampled_from(long_traj))
    i = int((traj == t).nonzero()[0])
    bad = group.clone()
    bad[i] = int(group.max()) + 1  # one step of episode t claims another group
    with pytest.raises(
        ValueError, match=r"^group_ids: must be constant within each trajectory; 1 trajectory"
    ):
        discounted_return_advantages(r, traj, step, bad)
    from rollkit.validation import value_checks

    with value_checks(False):  # a value check: off inside value_checks(False)
        assert discounted_return_advantages(r, traj, step, bad).shape == r.shape


def test_discounted_return_advantages_bad_input_is_named():
    r, traj, step, g = (
        torch.tensor([0.0, 1.0]),
        torch.tensor([0, 0]),
        torch.tensor([0, 1]),
        torch.tensor([3, 3]),
    )
    with pytest.raises(ValueError, match=r"^group_ids: must be constant within each trajectory"):
        discounted_return_advantages(r, traj, step, torch.tensor([3, 4]))
    with pytest.raises(ValueError, match=r"^group_ids: is on device meta but step_rewards is on cpu$"):
        discounted_return_advantages(r, traj, step, g.to("meta"))
    with pytest.raises(ValueError, match=r"^group_ids: expected an integer tensor"):
        discounted_return_advantages(r, traj, step, g.float())
    with pytest.raises(ValueError, match=r"^group_ids: has 1 entries"):
        discounted_return_advantages(r, traj, step, g[:1])
    with pytest.raises(ValueError, match=r"^norm: must be one of"):
        discounted_return_advantages(r, traj, step, g, norm="batch")
    with pytest.raises(ValueError, match=r"^eps: must be >= 0"):
        discounted_return_advantages(r, traj, step, g, eps=-1.0)
    with pytest.raises(ValueError, match=r"^gamma: must be in"):
        discounted_return_advantages(r, traj, step, g, gamma=2.0)
    empty = torch.zeros(0, dtype=torch.int64)
    assert discounted_return_advantages(torch.zeros(0), empty, empty, empty).shape == (0,)
    # the registry entry (ADVANTAGE_ESTIMATORS["discounted_return"]) is the same function
    batch = {"step_rewards": r, "traj_ids": traj, "step_index": step, "group_ids": torch.tensor([3, 4])}
    with pytest.raises(ValueError, match=r"^group_ids: must be constant"):
        ADVANTAGE_ESTIMATORS.entry("discounted_return").call(batch)
