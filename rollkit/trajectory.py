"""Multi-turn episodes as token sequences: the layout that agentic RL trains on.

An agent *episode* alternates environment text and model text. Each **turn** ``k`` is one
observation followed by one action: ``obs_ids`` (what the environment said, formatted with the
chat template; for turn 0 this is the whole initial prompt) and ``action_ids`` (the tokens the
model sampled, with their behaviour log-probs). :func:`build_trajectory` concatenates the
turns into one sequence; :func:`build_batch` packs many of them into right-padded tensors
in the prompt / response layout of ``trainers.engines.base.pack``::

    turn            0 (prompt)     0        1        1        2        2
    tokens          [ o o o o ] [ a a a ] [ o o ] [ a a a a ] [ o o o ] [ a a ]
    response_mask     0 0 0 0     1 1 1     0 0     1 1 1 1     0 0 0     1 1
    turn_ids         -1 ...-1     0 0 0     1 1     1 1 1 1     2 2 2     2 2
                    |-prompt--| |------------------ response ------------------|

* ``response_mask`` is True exactly on the model's own tokens: observations, tool outputs and
  chat-template glue are context, never trained on (RAGEN / StarPO, Wang et al., 2025,
  arXiv:2504.20073; verl-agent / GiGPO, Feng et al., 2025, arXiv:2505.10978).
* ``turn_ids`` says which turn each token belongs to: ``-1`` for the initial prompt (turn 0's
  observation), ``k`` for turn ``k``'s observation and action; so step-level advantages
  (:func:`rollkit.advantages.gigpo_advantages`, one value per turn) can be spread over the
  tokens of their own turn with :meth:`TrajectoryBatch.steps_to_tokens`.
* The **prompt** is turn 0's observation; everything after it (later observations included,
  masked) is the **response**: a trainer packs the prompt left-padded and the response
  right-padded, exactly as for single-turn RL, and the per-token log-probs of the training
  engine line up with ``behavior_logprobs``.

**Max-context policy.** An episode longer than ``max_context`` tokens (prompt included):

* ``"truncate"`` (default): keep the longest prefix of *whole* turns that fits -- a cut only
  ever falls at a turn boundary, never inside an observation or a model turn -- and mark the
  trajectory ``truncated``. The rewards of the dropped turns are dropped with them (the kept
  tokens never saw those turns); ``dropped_turns`` counts them. If not even turn 0 fits, the
  trajectory keeps only its prompt (zero turns, an empty response). A prompt that alone
  exceeds ``max_context`` raises ``ValueError`` (a configuration error, not an episode
  outcome), except under ``"drop"``.
* ``"drop"``: the whole trajectory is discarded (:func:`build_trajectory` returns ``None``).
* ``"error"``: raise ``ValueError``.

The rollout loop normally stops an episode before it outgrows the budget; the policy is the
guarantee that nothing longer than ``max_context`` ever reaches the trainer.

**One sample per turn** (:func:`build_turn_batch`): for long horizons each turn is its own
training sample, its context the window the model saw when it wrote the action
(:func:`context_window`: the initial prompt, then the most recent whole ``(action, observation)``
pairs that fit the budget), so the horizon is no longer bounded by the context. The step
tensors (rewards, trajectory ids, step indices, states, returns) are those of the trajectory
layout, so step- and trajectory-level estimators give the same values in both layouts.

Pure: token-id lists in, tensors out (no tokenizer; see ``trainers.envs.turns`` for the
glue that turns text into turns).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from rollkit import keys
from rollkit.validation import check_choice, check_group_ids, check_ndim

__all__ = [
    "POLICIES",
    "Trajectory",
    "TrajectoryBatch",
    "Turn",
    "build_batch",
    "build_trajectory",
    "build_turn_batch",
    "collate_trajectories",
    "context_window",
]

#: The max-context policies of :func:`build_trajectory`.
POLICIES = ("truncate", "drop", "error")


@dataclass(frozen=True)
class Turn:
    """One turn of an episode: the observation the model read, then the action it wrote.

    Attributes:
        obs_ids: tokens added to the context before the action (turn 0: the whole initial
            prompt, at least one token; later turns: the environment's reply to the previous
            action with its chat-template glue; may be empty).
        action_ids: the model's sampled tokens (at least one; the stop token included).
        logprobs: behaviour log-probs of ``action_ids`` (same length, finite), or ``None``
            (then 0 is written).
        reward: the environment's reward for this action (finite).
        state_id: integer hash of the environment state the action was taken from (GiGPO's
            anchor states; equal ids = same state). Default 0.
    """

    obs_ids: Sequence[int]
    action_ids: Sequence[int]
    logprobs: Sequence[float] | None = None
    reward: float = 0.0
    state_id: int = 0


@dataclass
class Trajectory:
    """One episode as one sequence (module docstring layout). All tensors on CPU.

    Attributes:
        input_ids: ``[L]`` long, the whole sequence (prompt + response).
        response_mask: ``[L]`` bool, True exactly on action tokens.
        turn_ids: ``[L]`` long, ``-1`` on the prompt, ``k`` on turn ``k``'s tokens.
        logprobs: ``[L]`` float32, behaviour log-probs on action tokens, 0 elsewhere.
        prompt_len: ``P``, the length of turn 0's observation.
        bounds: ``[K, 3]`` long, per kept turn ``(obs_start, action_start, action_end)``:
            turn ``k`` occupies ``[obs_start, action_end)``, its action ``[action_start,
            action_end)``; the context the model saw when writing it is
            ``input_ids[:action_start]``. Row 0 has ``obs_start = 0, action_start = P``.
        turn_rewards: ``[K]`` float32, reward of each kept turn.
        state_ids: ``[K]`` long.
        truncated: turns were dropped by the ``"truncate"`` policy.
        dropped_turns: how many.
    """

    input_ids: Tensor
    response_mask: Tensor
    turn_ids: Tensor
    logprobs: Tensor
    prompt_len: int
    bounds: Tensor
    turn_rewards: Tensor
    state_ids: Tensor
    truncated: bool = False
    dropped_turns: int = 0

    @property
    def num_turns(self) -> int:
        return int(self.bounds.shape[0])

    @property
    def reward(self) -> float:
        """Episode return of the kept turns, ``sum_k turn_rewards[k]``."""
        return float(self.turn_rewards.sum())

    @property
    def prompt_ids(self) -> Tensor:  # [P]
        return self.input_ids[: self.prompt_len]

    @property
    def response_ids(self) -> Tensor:  # [L - P]
        return self.input_ids[self.prompt_len :]


def _as_turn(k: int, t: Turn | Mapping[str, Any]) -> Turn:
    if isinstance(t, Turn):
        return t
    if isinstance(t, Mapping):
        unknown = set(t) - {"obs_ids", "action_ids", "logprobs", "reward", "state_id"}
        if unknown:
            raise ValueError(f"turns[{k}]: unknown keys {sorted(unknown)}")
        try:
            return Turn(**t)
        except TypeError as e:
            raise ValueError(f"turns[{k}]: {e}") from e
    raise TypeError(f"turns[{k}]: expected a Turn or a mapping, got {type(t).__name__}")


def _check_ids(name: str, ids: Sequence[int]) -> list[int]:
    if isinstance(ids, Tensor):
        ids = ids.tolist()
    out = list(ids)
    for v in out:
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{name}: token ids must be ints >= 0, got {v!r}")
    return out


def _check_turn(k: int, t: Turn) -> tuple[list[int], list[int], list[float], float, int]:
    obs = _check_ids(f"turns[{k}].obs_ids", t.obs_ids)
    act = _check_ids(f"turns[{k}].action_ids", t.action_ids)
    if k == 0 and not obs:
        raise ValueError("turns[0].obs_ids: the initial prompt needs at least one token")
    if not act:
        raise ValueError(f"turns[{k}].action_ids: a turn needs at least one model token")
    if t.logprobs is None:
        lp = [0.0] * len(act)
    else:
        lp = t.logprobs.tolist() if isinstance(t.logprobs, Tensor) else [float(x) for x in t.logprobs]
        if len(lp) != len(act):
            raise ValueError(f"turns[{k}].logprobs: {len(lp)} values for {len(act)} action tokens")
        if not all(math.isfinite(x) for x in lp):
            raise ValueError(f"turns[{k}].logprobs: must be finite")
    reward = float(t.reward)
    if not math.isfinite(reward):
        raise ValueError(f"turns[{k}].reward: must be finite, got {reward}")
    if isinstance(t.state_id, bool) or not isinstance(t.state_id, int):
        raise ValueError(f"turns[{k}].state_id: expected an int, got {type(t.state_id).__name__}")
    return obs, act, lp, reward, t.state_id


def build_trajectory(
    turns: Sequence[Turn | Mapping[str, Any]],
    *,
    max_context: int | None = None,
    policy: str = "truncate",
) -> Trajectory | None:
    """Concatenate an episode's turns into one sequence with its action mask (module docstring).

        input_ids     = obs_0 + act_0 + obs_1 + act_1 + ... + obs_{K-1} + act_{K-1}
        response_mask = [t in some act_k]         turn_ids = k on obs_k (k >= 1) and act_k, -1 on obs_0

    Args:
        turns: ``K >= 1`` turns (:class:`Turn` or mappings with its field names).
        max_context: the most tokens the sequence may hold (prompt included); ``None``: no limit.
        policy: what to do when the episode is longer: ``"truncate"`` (keep whole turns that
            fit, mark ``truncated``), ``"drop"`` (return ``None``) or ``"error"`` (raise).

    Returns:
        A :class:`Trajectory`, or ``None`` when ``policy="drop"`` discards it.

    >>> traj = build_trajectory(
    ...     [Turn([5, 6], [7, 8], [-0.1, -0.2], reward=0.0), Turn([9], [10], [-0.3], reward=1.0)]
    ... )
    >>> traj.input_ids.tolist(), traj.response_mask.int().tolist(), traj.turn_ids.tolist()
    ([5, 6, 7, 8, 9, 10], [0, 0, 1, 1, 0, 1], [-1, -1, 0, 0, 1, 1])
    >>> traj.bounds.tolist(), traj.reward
    ([[0, 2, 4], [4, 5, 6]], 1.0)
    >>> build_trajectory([Turn([5, 6], [7, 8]), Turn([9], [10])], max_context=5).num_turns
    1
    """
    check_choice("policy", policy, POLICIES)
    if isinstance(turns, (str, bytes)) or not isinstance(turns, Sequence):
        raise TypeError(f"turns: expected a sequence of turns, got {type(turns).__name__}")
    if len(turns) == 0:
        raise ValueError("turns: an episode needs at least one turn")
    if max_context is not None:
        if isinstance(max_context, bool) or not isinstance(max_context, int) or max_context < 1:
            raise ValueError(f"max_context: expected an int >= 1 or None, got {max_context!r}")
    parsed = [_check_turn(k, _as_turn(k, t)) for k, t in enumerate(turns)]
    prompt_len = len(parsed[0][0])
    if max_context is not None and prompt_len > max_context:
        if policy == "drop":
            return None
        raise ValueError(
            f"turns[0].obs_ids: the prompt alone has {prompt_len} tokens > max_context {max_context}"
        )

    # keep the longest prefix of whole turns that fits
    keep, length = 0, 0
    for obs, act, *_ in parsed:
        if max_context is not None and length + len(obs) + len(act) > max_context:
            break
        keep += 1
        length += len(obs) + len(act)
    dropped = len(parsed) - keep
    if dropped:
        if policy == "drop":
            return None
        if policy == "error":
            raise ValueError(
                f"turns: the episode needs {sum(len(o) + len(a) for o, a, *_ in parsed)} tokens "
                f"> max_context {max_context}"
            )

    ids: list[int] = []
    mask: list[bool] = []
    tids: list[int] = []
    lps: list[float] = []
    bounds: list[tuple[int, int, int]] = []
    if keep == 0:  # not even turn 0's action fits: the prompt alone
        ids, mask, tids, lps = list(parsed[0][0]), [False] * prompt_len, [-1] * prompt_len, [0.0] * prompt_len
    for k, (obs, act, lp, _, _) in enumerate(parsed[:keep]):
        start = len(ids)
        ids += obs
        mask += [False] * len(obs)
        tids += [-1 if k == 0 else k] * len(obs)
        lps += [0.0] * len(obs)
        a0 = len(ids)
        ids += act
        mask += [True] * len(act)
        tids += [k] * len(act)
        lps += lp
        bounds.append((start, a0, len(ids)))
    return Trajectory(
        input_ids=torch.tensor(ids, dtype=torch.long),
        response_mask=torch.tensor(mask, dtype=torch.bool),
        turn_ids=torch.tensor(tids, dtype=torch.long),
        logprobs=torch.tensor(lps, dtype=torch.float32),
        prompt_len=prompt_len,
        bounds=torch.tensor(bounds, dtype=torch.long).reshape(-1, 3),
        turn_rewards=torch.tensor([p[3] for p in parsed[:keep]], dtype=torch.float32),
        state_ids=torch.tensor([p[4] for p in parsed[:keep]], dtype=torch.long),
        truncated=dropped > 0,
        dropped_turns=dropped,
    )


@dataclass
class TrajectoryBatch:
    """``B`` trajectories in the prompt / response layout of ``trainers.engines.base.pack``.

    Row tensors (``B`` rows; prompts **left**-padded to ``P``, responses **right**-padded to
    ``T``; the response of every row starts at column ``P``):

    * ``input_ids`` ``[B, P + T]`` long, ``attention_mask`` ``[B, P + T]`` long (1 = real token)
    * ``response_mask`` ``[B, T]`` bool: True on action tokens only (env tokens and padding False)
    * ``behavior_logprobs`` ``[B, T]`` float32, 0 off the mask
    * ``step_ids`` ``[B, T]`` long: the turn of each response token, ``-1`` on padding
    * ``rewards`` ``[B]`` float32 (sum of kept turn rewards), ``group_ids`` ``[B]`` long,
      ``truncated`` ``[B]`` bool, ``num_turns`` ``[B]`` long, ``episode_index`` ``[B]`` long
      (position of the row's episode in the input list; rows dropped by ``policy="drop"``
      leave gaps)

    Step tensors (``N = sum(num_turns)`` steps, row-major: row 0's turns, then row 1's, ...),
    exactly the inputs of :func:`rollkit.advantages.gigpo_advantages`:

    * ``step_rewards`` ``[N]`` float32, ``traj_ids`` ``[N]`` (= row), ``step_index`` ``[N]``,
      ``step_group_ids`` ``[N]`` (the row's group), ``state_ids`` ``[N]``,
      ``episode_returns`` ``[N]`` (the row's reward), ``step_offsets`` ``[B]`` (first step of
      each row).
    """

    input_ids: Tensor
    attention_mask: Tensor
    response_mask: Tensor
    behavior_logprobs: Tensor
    step_ids: Tensor
    prompt_len: int
    rewards: Tensor
    group_ids: Tensor
    truncated: Tensor
    num_turns: Tensor
    episode_index: Tensor
    step_rewards: Tensor
    traj_ids: Tensor
    step_index: Tensor
    step_group_ids: Tensor
    state_ids: Tensor
    episode_returns: Tensor
    step_offsets: Tensor
    extras: dict[str, Any] = field(default_factory=dict)

    @property
    def responses(self) -> Tensor:  # [B, T]
        return self.input_ids[:, self.prompt_len :]

    def steps_to_tokens(self, values: Tensor) -> Tensor:
        """Spread a per-step ``[N]`` value (e.g. GiGPO advantages) over each step's action
        tokens: ``[B, T]``, ``out[b, t] = values[step_offsets[b] + step_ids[b, t]]`` on
        ``response_mask``, 0 elsewhere."""
        check_ndim("values", values, 1)
        n = int(self.step_rewards.shape[0])
        if values.shape[0] != n:
            raise ValueError(f"values: has {values.shape[0]} entries, the batch has {n} steps")
        if n == 0:
            return torch.zeros(self.response_mask.shape, dtype=values.dtype, device=values.device)
        # padding (step_ids -1) reads some valid step and is zeroed by the mask below
        idx = (self.step_offsets.unsqueeze(1) + self.step_ids.clamp(min=0)).clamp(max=n - 1)
        out = values.index_select(0, idx.reshape(-1).to(values.device)).reshape(self.response_mask.shape)
        zero = torch.zeros((), dtype=values.dtype, device=values.device)
        return torch.where(self.response_mask.to(values.device), out, zero)

    def turn_end_rewards(self) -> Tensor:
        """``[B, T]`` per-token rewards for a critic: each step's reward on the last action token
        of its turn, 0 elsewhere (environment tokens, padding, the other action tokens), so
        :func:`rollkit.advantages.gae_advantages` over ``response_mask`` credits each turn's
        reward when the turn ends and skips the environment's tokens. A row's entries sum to its
        ``rewards`` (the sum of its kept turn rewards) when each of its turns has an action token.

        Each turn is identified by ``step_ids``; its last action token is the last position on
        ``response_mask`` with that step id.
        """
        mask, ids = self.response_mask, self.step_ids
        T = mask.shape[1]
        pos = torch.arange(T, device=mask.device).expand_as(ids)
        # the last action position of each (row, step): scatter_reduce amax over the action tokens
        n = int(self.step_rewards.shape[0])
        out = torch.zeros(mask.shape, dtype=self.step_rewards.dtype, device=mask.device)
        if n == 0 or T == 0:
            return out
        step = (self.step_offsets.unsqueeze(1) + ids.clamp(min=0)).clamp(max=n - 1)
        last = torch.full((n,), -1, dtype=torch.long, device=mask.device)
        last = last.scatter_reduce(0, step[mask], pos[mask], reduce="amax")
        ends = mask & (pos == last[step])
        return torch.where(ends, self.steps_to_tokens(self.step_rewards), out)

    def to_tensordict(self) -> Any:
        """The row tensors as a ``TensorDict`` with ``batch_size=[B]`` (standard keys of
        :mod:`rollkit.keys`); imports tensordict on first use."""
        from tensordict import TensorDict

        return TensorDict(
            {
                "input_ids": self.input_ids,
                "attention_mask": self.attention_mask,
                keys.RESPONSE_MASK: self.response_mask,
                keys.BEHAVIOR_LOGPROBS: self.behavior_logprobs,
                keys.STEP_IDS: self.step_ids,
                keys.REWARDS: self.rewards,
                keys.GROUP_IDS: self.group_ids,
                keys.TRUNCATED: self.truncated,
            },
            batch_size=[int(self.rewards.shape[0])],
        )

    def steps_tensordict(self) -> Any:
        """The step tensors as a ``TensorDict`` with ``batch_size=[N]``, keyed for the
        ``"gigpo"`` registry entry (``step_rewards``, ``traj_ids``, ``step_index``,
        ``group_ids``, ``state_ids``, ``episode_returns``)."""
        from tensordict import TensorDict

        return TensorDict(
            {
                keys.STEP_REWARDS: self.step_rewards,
                keys.TRAJ_IDS: self.traj_ids,
                keys.STEP_INDEX: self.step_index,
                keys.GROUP_IDS: self.step_group_ids,
                keys.STATE_IDS: self.state_ids,
                keys.EPISODE_RETURNS: self.episode_returns,
            },
            batch_size=[int(self.step_rewards.shape[0])],
        )


def collate_trajectories(
    trajectories: Sequence[Trajectory],
    group_ids: Tensor | Sequence[int],
    *,
    pad_token_id: int = 0,
    response_width: int | None = None,
    episode_index: Tensor | Sequence[int] | None = None,
) -> TrajectoryBatch:
    """Pack built trajectories into a :class:`TrajectoryBatch` (prompts left-padded, responses
    right-padded; the layout of ``trainers.engines.base.pack``).

    Args:
        trajectories: ``B`` :class:`Trajectory` objects.
        group_ids: ``[B]`` int, the task group of each trajectory (episodes from the same
            initial state share an id).
        pad_token_id: fills the padding of ``input_ids``.
        response_width: fix ``T`` (at least the longest response), e.g. for constant shapes.
        episode_index: ``[B]`` recorded as ``episode_index`` (default ``0..B-1``).
    """
    B = len(trajectories)
    for i, t in enumerate(trajectories):
        if not isinstance(t, Trajectory):
            raise TypeError(f"trajectories[{i}]: expected a Trajectory, got {type(t).__name__}")
    group_ids = torch.as_tensor(group_ids)
    check_group_ids("group_ids", group_ids, B)
    if isinstance(pad_token_id, bool) or not isinstance(pad_token_id, int) or pad_token_id < 0:
        raise ValueError(f"pad_token_id: expected an int >= 0, got {pad_token_id!r}")
    episode_index = torch.arange(B) if episode_index is None else torch.as_tensor(episode_index)
    check_group_ids("episode_index", episode_index, B)
    P = max((t.prompt_len for t in trajectories), default=0)
    T = max((int(t.input_ids.shape[0]) - t.prompt_len for t in trajectories), default=0)
    if response_width is not None:
        if response_width < T:
            raise ValueError(f"response_width: {response_width} < longest response {T}")
        T = response_width
    input_ids = torch.full((B, P + T), pad_token_id, dtype=torch.long)
    attention = torch.zeros((B, P + T), dtype=torch.long)
    rmask = torch.zeros((B, T), dtype=torch.bool)
    blp = torch.zeros((B, T), dtype=torch.float32)
    step_ids = torch.full((B, T), -1, dtype=torch.long)
    for b, t in enumerate(trajectories):
        p, r = t.prompt_len, int(t.input_ids.shape[0]) - t.prompt_len
        input_ids[b, P - p : P] = t.input_ids[:p]
        attention[b, P - p : P + r] = 1
        input_ids[b, P : P + r] = t.input_ids[p:]
        rmask[b, :r] = t.response_mask[p:]
        blp[b, :r] = t.logprobs[p:]
        step_ids[b, :r] = t.turn_ids[p:]
    num_turns = torch.tensor([t.num_turns for t in trajectories], dtype=torch.long)
    rewards = torch.tensor([t.reward for t in trajectories], dtype=torch.float32)
    rows = torch.arange(B).repeat_interleave(num_turns)
    offsets = torch.cumsum(num_turns, 0) - num_turns
    cat = lambda xs, dt: torch.cat(xs).to(dt) if xs else torch.zeros(0, dtype=dt)  # noqa: E731
    return TrajectoryBatch(
        input_ids=input_ids,
        attention_mask=attention,
        response_mask=rmask,
        behavior_logprobs=blp,
        step_ids=step_ids,
        prompt_len=P,
        rewards=rewards,
        group_ids=group_ids.to(torch.long),
        truncated=torch.tensor([t.truncated for t in trajectories], dtype=torch.bool),
        num_turns=num_turns,
        episode_index=episode_index.to(torch.long),
        step_rewards=cat([t.turn_rewards for t in trajectories], torch.float32),
        traj_ids=rows,
        step_index=cat([torch.arange(t.num_turns) for t in trajectories], torch.long),
        step_group_ids=group_ids.to(torch.long).repeat_interleave(num_turns),
        state_ids=cat([t.state_ids for t in trajectories], torch.long),
        episode_returns=rewards.repeat_interleave(num_turns),
        step_offsets=offsets,
    )


def build_batch(
    episodes: Sequence[Sequence[Turn | Mapping[str, Any]]],
    group_ids: Tensor | Sequence[int],
    *,
    max_context: int | None = None,
    policy: str = "truncate",
    pad_token_id: int = 0,
    response_width: int | None = None,
) -> TrajectoryBatch:
    """:func:`build_trajectory` of every episode, then :func:`collate_trajectories`.

    Episodes discarded by ``policy="drop"`` are left out (with their ``group_ids``);
    ``episode_index`` maps each row back to its episode and ``extras["dropped"]`` counts them.

    >>> eps = [[Turn([1, 2], [3], reward=1.0)], [Turn([4], [5, 6]), Turn([7], [8], state_id=3)]]
    >>> b = build_batch(eps, group_ids=[0, 0])
    >>> b.input_ids.tolist(), b.response_mask.int().tolist(), b.prompt_len
    ([[1, 2, 3, 0, 0, 0], [0, 4, 5, 6, 7, 8]], [[1, 0, 0, 0], [1, 1, 0, 1]], 2)
    >>> b.traj_ids.tolist(), b.step_index.tolist(), b.state_ids.tolist(), b.rewards.tolist()
    ([0, 1, 1], [0, 0, 1], [0, 0, 3], [1.0, 0.0])
    """
    if isinstance(episodes, (str, bytes)) or not isinstance(episodes, Sequence):
        raise TypeError(f"episodes: expected a sequence of episodes, got {type(episodes).__name__}")
    group_ids = torch.as_tensor(group_ids)
    check_group_ids("group_ids", group_ids, len(episodes))
    trajs, keep = [], []
    for i, ep in enumerate(episodes):
        try:
            t = build_trajectory(ep, max_context=max_context, policy=policy)
        except (ValueError, TypeError) as e:
            raise type(e)(f"episodes[{i}]: {e}") from e
        if t is not None:
            trajs.append(t)
            keep.append(i)
    index = torch.tensor(keep, dtype=torch.long)
    out = collate_trajectories(
        trajs,
        group_ids[index] if len(keep) else group_ids[:0],
        pad_token_id=pad_token_id,
        response_width=response_width,
        episode_index=index,
    )
    out.extras["dropped"] = len(episodes) - len(keep)
    return out


def context_window(
    turns: Sequence[Turn | Mapping[str, Any]], next_obs: Sequence[int], budget: int | None = None
) -> list[int] | None:
    """The context the model reads before its next action, after the played ``turns`` and the
    environment's reply ``next_obs``: the initial prompt (``turns[0].obs_ids``; ``next_obs`` itself
    when ``turns`` is empty), then the most recent whole ``(action_j, observation_{j+1})`` pairs,
    the last one (``turns[-1].action_ids + next_obs``) always, as many as fit in ``budget`` tokens:

        pairs_j  = action_j + obs_{j+1}              (obs_K = next_obs, K = len(turns))
        context  = obs_0 + pairs_m + ... + pairs_{K-1},  m the smallest index with len(context) <= budget

    A cut falls only between pairs: an observation is never separated from the action it answers.
    ``budget=None``: no cut (the whole history). ``None`` when not even the prompt and the last
    pair fit (the episode must end: its context is full).

    >>> t = [Turn([1, 2], [3]), Turn([4], [5, 6])]
    >>> context_window(t, [7]), context_window(t, [7], budget=6), context_window(t, [7], budget=4)
    ([1, 2, 3, 4, 5, 6, 7], [1, 2, 5, 6, 7], None)
    """
    turns = [_as_turn(k, t) for k, t in enumerate(turns)]
    if not turns:
        return list(next_obs)
    prompt = list(turns[0].obs_ids)
    obs = [list(t.obs_ids) for t in turns[1:]] + [list(next_obs)]
    pairs = [list(t.action_ids) + o for t, o in zip(turns, obs)]
    room = None if budget is None else budget - len(prompt)
    kept: list[list[int]] = []
    for pair in reversed(pairs):
        if room is not None and len(pair) > room:
            break
        kept.append(pair)
        room = None if room is None else room - len(pair)
    if not kept:
        return None
    return prompt + [t for pair in reversed(kept) for t in pair]


def build_turn_batch(
    episodes: Sequence[Sequence[Turn | Mapping[str, Any]]],
    group_ids: Tensor | Sequence[int],
    *,
    budget: int | None = None,
    pad_token_id: int = 0,
) -> TrajectoryBatch:
    """One row per turn: row ``(e, k)`` is turn ``k`` of episode ``e``, its prompt the
    :func:`context_window` the model read (``budget``: the rollout's window; ``None``: the whole
    history) and its response the action alone (every response token is trained on).

    Rows run episode by episode, turn by turn. The step tensors describe the same steps as
    :func:`build_batch` (one step per row): ``step_rewards`` the turn's reward, ``traj_ids`` the
    episode, ``step_index`` ``k``, ``step_group_ids`` / ``state_ids`` / ``episode_returns`` the
    episode's; ``step_offsets = arange(B)`` and ``step_ids = 0`` on the response, so
    :meth:`TrajectoryBatch.steps_to_tokens` spreads a step value over its row. Row tensors:
    ``rewards`` / ``group_ids`` are the episode's (the row's trajectory), ``num_turns`` 1,
    ``episode_index`` the episode. A turn whose window does not fit ``budget`` raises.

    >>> eps = [[Turn([1, 2], [3], reward=0.0), Turn([4], [5], reward=1.0)], [Turn([6], [7])]]
    >>> b = build_turn_batch(eps, group_ids=[0, 0])
    >>> b.input_ids.tolist(), b.traj_ids.tolist(), b.step_index.tolist(), b.rewards.tolist()
    ([[0, 0, 1, 2, 3], [1, 2, 3, 4, 5], [0, 0, 0, 6, 7]], [0, 0, 1], [0, 1, 0], [1.0, 1.0, 0.0])
    """
    group_ids = torch.as_tensor(group_ids)
    check_group_ids("group_ids", group_ids, len(episodes))
    trajs, meta = [], []
    for e, ep in enumerate(episodes):
        turns = [_as_turn(k, t) for k, t in enumerate(ep)]
        if not turns:
            raise ValueError(f"episodes[{e}]: an episode needs at least one turn")
        ret = float(sum(t.reward for t in turns))
        for k, t in enumerate(turns):
            ctx = context_window(turns[:k], t.obs_ids, budget) if k else list(t.obs_ids)
            if ctx is None or (budget is not None and len(ctx) > budget):
                raise ValueError(f"episodes[{e}] turn {k}: its context does not fit budget={budget}")
            trajs.append(build_trajectory([Turn(ctx, t.action_ids, t.logprobs, t.reward, t.state_id)]))
            meta.append((e, k, ret))
    rows = torch.tensor([m[0] for m in meta], dtype=torch.long)
    out = collate_trajectories(trajs, group_ids[rows] if len(rows) else group_ids[:0], pad_token_id=pad_token_id,
                               episode_index=rows)  # fmt: skip
    returns = torch.tensor([m[2] for m in meta], dtype=torch.float32)
    out.step_ids = torch.where(out.step_ids >= 0, torch.zeros_like(out.step_ids), out.step_ids)
    out.traj_ids, out.rewards, out.episode_returns = rows, returns, returns.clone()
    out.step_index = torch.tensor([m[1] for m in meta], dtype=torch.long)
    return out
