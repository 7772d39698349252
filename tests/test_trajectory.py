"""rollkit.trajectory: multi-turn episodes -> token sequences with action masks (property tests)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rollkit.advantages import gigpo_advantages, starpo_advantages
from rollkit.losses import aggregate
from rollkit.trajectory import Turn, build_batch, build_trajectory, collate_trajectories

# ----------------------------------------------------------------------------- strategies


@st.composite
def turns(draw, index: int):
    obs = draw(st.lists(st.integers(1, 50), min_size=1 if index == 0 else 0, max_size=6))
    act = draw(st.lists(st.integers(1, 50), min_size=1, max_size=6))
    lp = draw(st.lists(st.floats(-10, 0), min_size=len(act), max_size=len(act)))
    reward = draw(st.sampled_from([0.0, 0.0, 1.0, -0.1, 0.5]))
    return Turn(obs, act, lp, reward=reward, state_id=draw(st.integers(0, 3)))


@st.composite
def episodes(draw, max_turns: int = 5):
    k = draw(st.integers(1, max_turns))
    return [draw(turns(i)) for i in range(k)]


def _episode_len(ep) -> int:
    return sum(len(t.obs_ids) + len(t.action_ids) for t in ep)


# ----------------------------------------------------------------------------- single trajectories


@given(episodes())
def test_mask_is_true_exactly_on_action_tokens_and_concatenation_round_trips(ep):
    traj = build_trajectory(ep)
    ids, mask, tids, lps = [], [], [], []
    for k, t in enumerate(ep):
        ids += list(t.obs_ids) + list(t.action_ids)
        mask += [False] * len(t.obs_ids) + [True] * len(t.action_ids)
        tids += [-1 if k == 0 else k] * len(t.obs_ids) + [k] * len(t.action_ids)
        lps += [0.0] * len(t.obs_ids) + list(t.logprobs)
    assert traj.input_ids.tolist() == ids
    assert traj.response_mask.tolist() == mask
    assert traj.turn_ids.tolist() == tids
    torch.testing.assert_close(traj.logprobs, torch.tensor(lps, dtype=torch.float32))
    assert traj.prompt_ids.tolist() == list(ep[0].obs_ids)
    assert traj.input_ids[traj.response_mask].tolist() == [a for t in ep for a in t.action_ids]
    assert not traj.truncated and traj.dropped_turns == 0
    assert traj.reward == pytest.approx(sum(t.reward for t in ep))
    assert traj.state_ids.tolist() == [t.state_id for t in ep]


@given(episodes())
def test_turn_boundaries_are_contiguous_and_recover_each_turn(ep):
    traj = build_trajectory(ep)
    b = traj.bounds.tolist()
    assert len(b) == traj.num_turns == len(ep)
    assert b[0][0] == 0 and b[0][1] == traj.prompt_len and b[-1][2] == len(traj.input_ids)
    for k, (s, a, e) in enumerate(b):
        assert s <= a < e
        if k:
            assert s == b[k - 1][2]  # turn k starts where turn k-1's action ends
        assert traj.input_ids[s:a].tolist() == list(ep[k].obs_ids)
        assert traj.input_ids[a:e].tolist() == list(ep[k].action_ids)
        assert traj.response_mask[a:e].all() and not traj.response_mask[s:a].any()
        assert (traj.turn_ids[a:e] == k).all()
        assert (traj.turn_ids[s:a] == (-1 if k == 0 else k)).all()


@given(episodes(), st.integers(1, 40), st.sampled_from(["truncate", "drop", "error"]))
def test_max_context_is_never_exceeded_and_cuts_fall_at_turn_boundaries(ep, max_context, policy):
    prompt_len, total = len(ep[0].obs_ids), _episode_len(ep)
    if total <= max_context:
        traj = build_trajectory(ep, max_context=max_context, policy=policy)
        assert traj is not None and not traj.truncated and len(traj.input_ids) == total
        return
    if policy == "error" or (policy == "truncate" and prompt_len > max_context):
        with pytest.raises(ValueError, match="max_context"):
            build_trajectory(ep, max_context=max_context, policy=policy)
        return
    traj = build_trajectory(ep, max_context=max_context, policy=policy)
    if policy == "drop":
        assert traj is None
        return
    assert len(traj.input_ids) <= max_context
    assert traj.truncated and traj.dropped_turns == len(ep) - traj.num_turns > 0
    k = traj.num_turns
    # the kept turns are exactly a prefix, built as if the episode had ended there ...
    prefix = build_trajectory(ep[:k] if k else ep[:1])
    if k:
        assert torch.equal(traj.input_ids, prefix.input_ids)
        assert torch.equal(traj.response_mask, prefix.response_mask)
        assert traj.reward == pytest.approx(sum(t.reward for t in ep[:k]))
    else:  # not even turn 0 fits: the prompt alone, nothing to train on
        assert traj.input_ids.tolist() == list(ep[0].obs_ids) and not traj.response_mask.any()
        assert traj.bounds.shape == (0, 3) and traj.turn_rewards.numel() == 0
    # ... and the longest such prefix (the next whole turn would not fit)
    assert len(traj.input_ids if k else []) + len(ep[k].obs_ids) + len(ep[k].action_ids) > max_context or (
        k == 0 and _episode_len(ep[:1]) > max_context
    )


def test_mappings_and_missing_logprobs_are_accepted():
    traj = build_trajectory([{"obs_ids": [3], "action_ids": [4, 5], "reward": 2.0}])
    assert traj.logprobs.tolist() == [0.0, 0.0, 0.0] and traj.reward == 2.0


@pytest.mark.parametrize(
    ("turns_", "kw", "match"),
    [
        ([], {}, "at least one turn"),
        ([Turn([], [1])], {}, "initial prompt"),
        ([Turn([1], [])], {}, "at least one model token"),
        ([Turn([1], [2, 3], [0.0])], {}, "1 values for 2 action tokens"),
        ([Turn([1], [2], [float("nan")])], {}, "finite"),
        ([Turn([1], [2], reward=float("inf"))], {}, "reward"),
        ([Turn([1], [-2])], {}, "ints >= 0"),
        ([Turn([1], [2.5])], {}, "ints >= 0"),
        ([Turn([1], [2], state_id="s")], {}, "state_id"),
        ([{"obs_ids": [1], "actions": [2]}], {}, "unknown keys"),
        ([Turn([1], [2])], {"policy": "cut"}, "policy"),
        ([Turn([1], [2])], {"max_context": 0}, "max_context"),
    ],
)
def test_bad_input_raises_naming_the_argument(turns_, kw, match):
    with pytest.raises(ValueError, match=match):
        build_trajectory(turns_, **kw)


def test_bad_types_raise_type_error():
    with pytest.raises(TypeError, match="turns"):
        build_trajectory("abc")
    with pytest.raises(TypeError, match=r"turns\[0\]"):
        build_trajectory([[1, 2]])


# ----------------------------------------------------------------------------- batches


@given(st.lists(episodes(), min_size=1, max_size=5), st.data())
def test_batch_agrees_with_per_trajectory_builds(eps, data):
    max_context = data.draw(st.one_of(st.none(), st.integers(1, 30)))
    policy = data.draw(st.sampled_from(["truncate", "drop"]))
    if policy == "truncate" and max_context is not None:
        max_context = max(max_context, max(len(ep[0].obs_ids) for ep in eps))
    groups = data.draw(st.lists(st.integers(0, 2), min_size=len(eps), max_size=len(eps)))
    batch = build_batch(eps, groups, max_context=max_context, policy=policy, pad_token_id=0)
    trajs = [build_trajectory(ep, max_context=max_context, policy=policy) for ep in eps]
    kept = [i for i, t in enumerate(trajs) if t is not None]
    assert batch.episode_index.tolist() == kept and batch.extras["dropped"] == len(eps) - len(kept)
    B, P = len(kept), batch.prompt_len
    assert batch.input_ids.shape[0] == batch.response_mask.shape[0] == B
    assert batch.input_ids.shape[1] == P + batch.response_mask.shape[1]
    assert batch.group_ids.tolist() == [groups[i] for i in kept]
    step = 0
    for row, i in enumerate(kept):
        t = trajs[i]
        att = batch.attention_mask[row].bool()
        assert batch.input_ids[row][att].tolist() == t.input_ids.tolist()  # padding removed
        r = len(t.input_ids) - t.prompt_len
        assert att[:P].sum() == t.prompt_len and att[P:].sum() == r and att[P : P + r].all()
        assert batch.response_mask[row, :r].tolist() == t.response_mask[t.prompt_len :].tolist()
        assert not batch.response_mask[row, r:].any()
        assert batch.step_ids[row, :r].tolist() == t.turn_ids[t.prompt_len :].tolist()
        assert (batch.step_ids[row, r:] == -1).all()
        torch.testing.assert_close(batch.behavior_logprobs[row, :r], t.logprobs[t.prompt_len :])
        assert batch.rewards[row].item() == pytest.approx(t.reward)
        assert bool(batch.truncated[row]) == t.truncated
        # step tensors, row-major
        assert batch.step_offsets[row] == step
        sl = slice(step, step + t.num_turns)
        assert batch.traj_ids[sl].tolist() == [row] * t.num_turns
        assert batch.step_index[sl].tolist() == list(range(t.num_turns))
        assert batch.state_ids[sl].tolist() == t.state_ids.tolist()
        assert batch.step_rewards[sl].tolist() == t.turn_rewards.tolist()
        assert (batch.step_group_ids[sl] == groups[i]).all()
        step += t.num_turns
    assert batch.step_rewards.shape[0] == step


@settings(max_examples=30)
@given(st.lists(episodes(), min_size=1, max_size=5))
def test_steps_to_tokens_puts_each_step_value_on_its_own_action_tokens(eps):
    batch = build_batch(eps, list(range(len(eps))))
    n = batch.step_rewards.shape[0]
    values = torch.arange(1, n + 1, dtype=torch.float32)
    tok = batch.steps_to_tokens(values)
    expected = torch.where(
        batch.response_mask,
        (batch.step_offsets.unsqueeze(1) + batch.step_ids + 1).float(),
        torch.zeros(()),
    )
    assert torch.equal(tok, expected)
    with pytest.raises(ValueError, match="steps"):
        batch.steps_to_tokens(torch.zeros(n + 1))


def test_collate_matches_engine_pack_layout():
    pack = pytest.importorskip("trainers.engines.base").pack
    eps = [[Turn([1, 2], [3])], [Turn([4], [5, 6]), Turn([7], [8])]]
    batch = build_batch(eps, [0, 1], pad_token_id=0)
    trajs = [build_trajectory(e) for e in eps]
    ref = pack([t.prompt_ids.tolist() for t in trajs], [t.response_ids.tolist() for t in trajs], 0)
    assert torch.equal(batch.input_ids, ref.input_ids)
    assert torch.equal(batch.attention_mask, ref.attention_mask)
    assert batch.prompt_len == ref.prompt_len
    # pack's mask is True on the whole response; ours only on the actions, a subset of it
    assert torch.equal(batch.response_mask & ref.response_mask, batch.response_mask)
    assert batch.response_mask.tolist() == [[True, False, False, False], [True, True, False, True]]


def test_collate_validates():
    t = build_trajectory([Turn([1], [2])])
    with pytest.raises(ValueError, match="group_ids"):
        collate_trajectories([t], [0, 1])
    with pytest.raises(ValueError, match="response_width"):
        collate_trajectories([t], [0], response_width=0)
    with pytest.raises(TypeError, match="trajectories"):
        collate_trajectories([[1]], [0])
    with pytest.raises(ValueError, match="pad_token_id"):
        collate_trajectories([t], [0], pad_token_id=-1)
    with pytest.raises(ValueError, match=r"episodes\[1\]"):
        build_batch([[Turn([1], [2])], []], [0, 0])


def test_all_dropped_gives_an_empty_batch():
    b = build_batch([[Turn([1, 2, 3], [4])]], [0], max_context=2, policy="drop")
    assert b.input_ids.shape == (0, 0) and b.extras["dropped"] == 1 and b.step_rewards.numel() == 0
    assert b.steps_to_tokens(torch.zeros(0)).shape == (0, 0)


# ----------------------------------------------------------------------------- into the estimators


@settings(max_examples=25)
@given(st.lists(episodes(max_turns=4), min_size=2, max_size=6), st.data())
def test_outputs_feed_starpo_and_gigpo(eps, data):
    groups = data.draw(st.lists(st.integers(0, 1), min_size=len(eps), max_size=len(eps)))
    batch = build_batch(eps, groups)
    B, T = batch.response_mask.shape
    # StarPO: one advantage per trajectory, broadcast over its action tokens
    a_traj = starpo_advantages(batch.rewards, batch.group_ids)
    assert a_traj.shape == (B,)
    # GiGPO: one advantage per step, spread over that step's action tokens
    a_step = gigpo_advantages(
        batch.step_rewards,
        batch.traj_ids,
        batch.step_index,
        batch.step_group_ids,
        batch.state_ids,
        batch.episode_returns,
    )
    assert a_step.shape == batch.step_rewards.shape
    tok = batch.steps_to_tokens(a_step)
    assert tok.shape == (B, T) and torch.isfinite(tok).all()
    assert (tok[~batch.response_mask] == 0).all()
    # the [B, T] advantages go into a loss like any single-turn batch
    loss = aggregate(-tok * batch.behavior_logprobs, batch.response_mask, "token-mean")
    assert loss.ndim == 0 and torch.isfinite(loss)


def test_gigpo_through_the_registry_on_the_step_tensordict():
    from rollkit.td import td_module

    eps = [
        [Turn([1], [2], reward=0.0, state_id=11), Turn([3], [4], reward=1.0, state_id=12)],
        [Turn([1], [5], reward=0.0, state_id=11), Turn([3], [6], reward=0.0, state_id=13)],
    ]
    batch = build_batch(eps, [4, 4])
    td = batch.steps_tensordict()
    out = td_module("gigpo", registry="advantage", gamma=0.5)(td)
    direct = gigpo_advantages(
        batch.step_rewards, batch.traj_ids, batch.step_index, batch.step_group_ids, batch.state_ids, gamma=0.5
    )
    torch.testing.assert_close(out["advantages"], direct)
    torch.testing.assert_close(direct, torch.tensor([0.75, 0.5, -0.75, -0.5]))
    row_td = batch.to_tensordict()
    assert row_td.batch_size == torch.Size([2]) and row_td["step_ids"].shape == batch.response_mask.shape
