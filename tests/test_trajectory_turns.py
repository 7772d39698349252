"""One sample per turn (rollkit.trajectory.context_window / build_turn_batch) and the
discounted-return step estimator: the per-turn layout carries the same steps, tokens and
log-probs as the trajectory layout."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rollkit.advantages import discounted_return_advantages, discounted_step_returns
from rollkit.registry import ADVANTAGE_ESTIMATORS
from rollkit.trajectory import Turn, build_batch, build_turn_batch, context_window


def _episode(rng: random.Random, turns: int) -> list[Turn]:
    out = []
    for k in range(turns):
        obs = [rng.randrange(1, 50) for _ in range(rng.randrange(1 if k == 0 else 0, 5))] or (
            [7] if k == 0 else []
        )
        act = [rng.randrange(50, 99) for _ in range(rng.randrange(1, 4))]
        out.append(Turn(obs, act, [-rng.random() for _ in act], float(rng.randrange(2)), rng.randrange(3)))
    return out


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10**6), n=st.integers(1, 4))
def test_turn_rows_are_the_trajectory_prefixes_with_the_same_steps(seed, n):
    rng = random.Random(seed)
    eps = [_episode(rng, rng.randrange(1, 5)) for _ in range(n)]
    groups = [i // 2 for i in range(n)]
    traj, turns = build_batch(eps, groups), build_turn_batch(eps, groups)
    for key in ("step_rewards", "step_index", "step_group_ids", "state_ids", "episode_returns"):
        assert torch.equal(getattr(traj, key), getattr(turns, key)), key
    assert torch.equal(traj.traj_ids, turns.traj_ids)  # the trajectory row = the episode here
    # each turn row = the trajectory's tokens up to the end of that action; its response = the action
    for r in range(turns.input_ids.shape[0]):
        e, k = int(turns.traj_ids[r]), int(turns.step_index[r])
        full = traj.input_ids[e][traj.attention_mask[e].bool()].tolist()
        row = turns.input_ids[r][turns.attention_mask[r].bool()].tolist()
        act = list(eps[e][k].action_ids)
        assert full[: len(row)] == row and row[-len(act) :] == act
        assert turns.response_mask[r].sum() == len(act)
        lp = turns.behavior_logprobs[r][turns.response_mask[r]]
        torch.testing.assert_close(lp, torch.tensor(eps[e][k].logprobs, dtype=torch.float32))
    # a per-step value lands on the same tokens in both layouts
    v = torch.randn(traj.step_rewards.shape[0])
    a, b = traj.steps_to_tokens(v)[traj.response_mask], turns.steps_to_tokens(v)[turns.response_mask]
    assert torch.equal(a.sort().values, b.sort().values)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10**6), budget=st.integers(1, 30))
def test_the_window_keeps_the_prompt_and_the_latest_whole_exchanges(seed, budget):
    rng = random.Random(seed)
    turns = _episode(rng, rng.randrange(1, 6))
    nxt = [rng.randrange(1, 50) for _ in range(rng.randrange(0, 4))]
    full = context_window(turns, nxt)
    win = context_window(turns, nxt, budget)
    prompt = list(turns[0].obs_ids)
    last = list(turns[-1].action_ids) + nxt
    if len(prompt) + len(last) > budget:
        assert win is None
        return
    assert (
        len(win) <= budget
        and win[: len(prompt)] == prompt
        and full[-len(win[len(prompt) :]) :] == win[len(prompt) :]
    )
    # maximal: one more exchange would not fit
    pairs = [list(t.action_ids) + list(o) for t, o in zip(turns, [t.obs_ids for t in turns[1:]] + [nxt])]
    kept = len(win) - len(prompt)
    total, i = 0, len(pairs)
    while i and total + len(pairs[i - 1]) <= kept:
        total, i = total + len(pairs[i - 1]), i - 1
    assert total == kept and (i == 0 or len(win) + len(pairs[i - 1]) > budget)


def test_turn_batch_uses_the_window_and_refuses_what_cannot_fit():
    eps = [[Turn([1, 2], [3, 3]), Turn([4, 4], [5]), Turn([6], [7, 7])]]
    b = build_turn_batch(eps, [0], budget=6)
    rows = [b.input_ids[r][b.attention_mask[r].bool()].tolist() for r in range(3)]
    assert rows == [[1, 2, 3, 3], [1, 2, 3, 3, 4, 4, 5], [1, 2, 5, 6, 7, 7]]  # turn 2: window [1, 2, 5, 6]
    with pytest.raises(ValueError, match="turn 1: its context does not fit budget=4"):
        build_turn_batch(eps, [0], budget=4)


def test_discounted_return_estimator_is_group_normalised_returns():
    r = torch.tensor([0.0, 1.0, 0.0, 0.0, 0.0, 2.0])
    traj, step = torch.tensor([0, 0, 1, 1, 2, 2]), torch.tensor([0, 1, 0, 1, 0, 1])
    groups = torch.tensor([0, 0, 0, 0, 1, 1])
    ret = discounted_step_returns(r, traj, step, gamma=0.9)
    want = torch.cat(
        [
            (ret[:4] - ret[:4].mean()) / (ret[:4].std() + 1e-6),
            (ret[4:] - ret[4:].mean()) / (ret[4:].std() + 1e-6),
        ]
    )
    got = discounted_return_advantages(r, traj, step, groups, gamma=0.9)
    torch.testing.assert_close(got, want)
    entry = ADVANTAGE_ESTIMATORS.entry("discounted_return")
    steps = {"step_rewards": r, "traj_ids": traj, "step_index": step, "group_ids": groups}
    torch.testing.assert_close(entry.call(steps, gamma=0.9), want)
