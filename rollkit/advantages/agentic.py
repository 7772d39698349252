"""Step-level advantage estimators for multi-turn agents: GiGPO and StarPO.

In multi-turn agentic RL an *episode* (trajectory) is a sequence of steps (turns). Two batch
layouts are common, and the estimators here take one each:

* **step-wise** (GiGPO): every step is one training sample (its own prompt = the observation
  history, its own response tokens). A sample is located by ``traj_ids`` (which episode) and
  ``step_index`` (which turn, ``t = 0, 1, ...``); ``group_ids`` says which task instance the
  episode was sampled for (episodes of one group start from the same initial state) and
  ``state_ids`` hashes the environment state the step acted from.
* **trajectory-wise** (StarPO): one sample per whole episode, one advantage per episode.

Conventions shared by every function of this module:

* Inputs may arrive in any order; ids are arbitrary integers (relabelling them changes
  nothing); trajectories may have different lengths; groups may have any size.
* Group normalisation is ``(x - mean) / (std + eps)`` (``norm="std"``) or ``x - mean``
  (``norm="none"``, i.e. ``F_norm = 1``), computed by :func:`rollkit.ops.group_normalize`.
  ``std`` is Bessel-corrected by default (``unbiased_std=True``, as ``torch.std`` in verl /
  verl-agent / RAGEN).
* A group whose values are all (bitwise) equal -- zero variance, and every singleton group --
  gives an advantage of exactly ``0`` to all its members: there is nothing to compare against.
  (Values equal only up to rounding give ``O(rounding / eps)`` with ``norm="std"``.)
* Non-finite rewards raise ``ValueError``; so do duplicate ``(traj_id, step_index)`` pairs,
  non-integer ids, shape mismatches and a trajectory that claims two task groups.
* An empty batch (``N = 0``) returns an empty tensor.
* 16-bit (``float16`` / ``bfloat16``) inputs are computed in float32 and the result cast back;
  the discount powers are built in float64. Memory is ``O(N)`` whatever the step indices.
* Every tensor must be on the device of the rewards (``ValueError`` naming it); the
  estimators read ids (grouping, step layout), so ``meta`` tensors are refused by name. The estimators are differentiable in the rewards
  (nothing detached) with finite gradients, also for constant and singleton groups.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from rollkit.keys import (
    ADVANTAGES,
    EPISODE_RETURNS,
    GROUP_IDS,
    REWARDS,
    STATE_IDS,
    STEP_INDEX,
    STEP_REWARDS,
    TRAJ_IDS,
)
from rollkit.ops import (
    _group_index,
    _group_normalize,
    _segment_max,
    _segment_min,
    _segment_std,
    _segment_sum,
    group_index,
)
from rollkit.registry import ADVANTAGE_ESTIMATORS
from rollkit.validation import (
    check_choice,
    check_discount,
    check_finite,
    check_float,
    check_group_ids,
    check_ndim,
    check_positive,
    check_real,
    check_same_device,
    values_readable,
)

__all__ = [
    "anchor_state_index",
    "discounted_return_advantages",
    "discounted_step_returns",
    "gigpo_advantages",
    "starpo_advantages",
]

_NORMS = ("std", "none")


# --------------------------------------------------------------------------- helpers


def _constant_within(name: str, values: Tensor, index: Tensor, num_segments: int, what: str) -> None:
    """Raise unless ``values`` is constant inside every segment of ``index``."""
    if values.numel() == 0 or not values_readable(name, values):
        return
    v = values.to(torch.float64)
    bad = _segment_min(v, index, num_segments) != _segment_max(v, index, num_segments)
    if bool(bad.any()):
        raise ValueError(
            f"{name}: must be constant within each {what}; {int(bad.sum())} {what}(s) hold several values"
        )


def _task_groups(group_ids: Tensor, t_idx: Tensor, num_traj: int) -> tuple[Tensor, int]:
    """Dense index of the task groups ``(g_idx [N], G)``; raises unless every trajectory (dense
    index ``t_idx``) claims one task group (the rule of every estimator of this module)."""
    g_idx, num_groups = group_index(group_ids)
    _constant_within("group_ids", g_idx, t_idx, num_traj, "trajectory")
    return g_idx, num_groups


def _check_step_inputs(step_rewards: Tensor, traj_ids: Tensor, step_index: Tensor) -> None:
    check_ndim("step_rewards", step_rewards, 1)
    check_float("step_rewards", step_rewards)
    n = step_rewards.shape[0]
    check_group_ids("traj_ids", traj_ids, n)
    check_group_ids("step_index", step_index, n)
    check_same_device("traj_ids", traj_ids, "step_rewards", step_rewards)
    check_same_device("step_index", step_index, "step_rewards", step_rewards)
    check_finite("step_rewards", step_rewards)
    if n > 0 and values_readable("step_index", step_index) and bool((step_index < 0).any()):
        raise ValueError(f"step_index: must be >= 0, got minimum {int(step_index.min())}")


class _Steps(NamedTuple):
    """Steps sorted by (trajectory, step index); memory ``O(N)`` whatever the step indices."""

    t_idx: Tensor  # [N] dense trajectory index of each step, input order
    num_traj: int
    order: Tensor  # [N] permutation: order[k] is the input position of the k-th sorted step
    coef: Tensor  # [N] sorted: gamma-exponent to the next step of the same trajectory, -1 at its last
    max_len: int  # the most steps one trajectory has


def _step_layout(traj_ids: Tensor, step_index: Tensor) -> _Steps:
    """Sort the steps by (trajectory, step index) with two stable sorts (no ``traj * S + step``
    key, which would overflow int64 for huge step indices, and no table of ``max(step_index)``
    cells). Raises if two samples claim the same ``(traj_id, step_index)`` pair (a
    data-reading check, skipped inside ``rollkit.validation.value_checks(False)``)."""
    t_idx, num_traj = _group_index(traj_ids, "traj_ids")
    steps = step_index.to(torch.int64)
    by_step = torch.sort(steps, stable=True).indices
    order = by_step.index_select(0, torch.sort(t_idx.index_select(0, by_step), stable=True).indices)
    st, ss = t_idx.index_select(0, order), steps.index_select(0, order)
    same = st[1:] == st[:-1]  # [N - 1] sorted step k + 1 continues the trajectory of step k
    gap = ss[1:] - ss[:-1]  # >= 0 within a trajectory
    if values_readable("step_index", step_index) and st.numel() > 1:
        dup = same & (gap == 0)
        if bool(dup.any()):
            first = dup & ~torch.cat([dup.new_zeros(1), dup[:-1]])  # one per repeated pair
            raise ValueError(
                "step_index: (traj_id, step_index) pairs must be unique; "
                f"{int(first.sum())} pair(s) occur more than once"
            )
    # exponent of gamma from each sorted step to the next one of its trajectory, -1 at the last
    coef = torch.where(same, gap, torch.full_like(gap, -1))
    coef = torch.cat([coef, coef.new_full((1,), -1)])
    n = steps.shape[0]
    max_len = int(torch.bincount(t_idx, minlength=num_traj).max()) if n else 0
    return _Steps(t_idx, num_traj, order, coef, max_len)


_HALF = (torch.float16, torch.bfloat16)


def _step_returns(step_rewards: Tensor, lay: _Steps, gamma: float) -> Tensor:
    """``R_i = r_i + gamma^(s_next - s_i) R_next`` over each trajectory's sorted steps, by a
    log-depth (Hillis-Steele) scan of the affine maps ``x -> r_i + a_i x``: ``ceil(log2 L)``
    vectorised passes over ``[N]`` tensors (``L`` = most steps of one trajectory), memory
    ``O(N)``. ``a_i = gamma^gap`` is taken in float64 (``0 <= a <= 1``: only non-negative
    powers, no overflow; a huge gap underflows to 0) and ``a = 0`` at a trajectory's last step,
    so no return crosses into the next trajectory. In float64 for float64 input, else float32."""
    work = torch.float64 if step_rewards.dtype == torch.float64 else torch.float32
    r = step_rewards.to(work).index_select(0, lay.order)
    base = torch.tensor(float(gamma), dtype=torch.float64, device=r.device)
    a = torch.where(lay.coef >= 0, base.pow(lay.coef.clamp(min=0).to(torch.float64)), 0.0).to(work)
    d = 1
    while d < lay.max_len:  # after the pass with offset d, each step has summed 2d steps ahead
        r = torch.cat([r[:-d] + a[:-d] * r[d:], r[-d:]])
        a = torch.cat([a[:-d] * a[d:], torch.zeros_like(a[-d:])])
        d *= 2
    inverse = torch.empty_like(lay.order).scatter_(
        0, lay.order, torch.arange(lay.order.shape[0], device=lay.order.device)
    )
    return r.index_select(0, inverse).to(step_rewards.dtype)


# --------------------------------------------------------------------------- public API


def anchor_state_index(group_ids: Tensor, state_ids: Tensor) -> tuple[Tensor, int]:
    """Dense index of GiGPO's anchor-state groups: samples sharing ``group_id`` AND ``state_id``.

        anchor(i) = anchor(j)  <=>  group_ids[i] == group_ids[j] and state_ids[i] == state_ids[j]

    GiGPO (Feng et al., 2025, arXiv:2505.10978) builds its step-level groups retroactively from
    the environment states that several trajectories of the same task instance revisit. States
    are only compared inside a task group: the same observation in two different tasks is two
    different anchors. Unlike verl-agent's ``build_step_group`` (which clusters raw observations
    in Python), the states come here already hashed to integers, so grouping is one
    ``torch.unique``.

    Args:
        group_ids: ``[N]`` int, task-instance group of each step's trajectory.
        state_ids: ``[N]`` int, hash of the environment state (observation) the step acted from.

    Returns:
        ``(index, A)``: ``index`` ``[N]`` int64 in ``[0, A)``, numbered by sorted
        ``(group_id, state_id)``; ``A`` the number of anchor groups. Useful to log group sizes
        (``torch.bincount(index)``).

    >>> anchor_state_index(torch.tensor([0, 0, 1, 0]), torch.tensor([5, 9, 5, 5]))
    (tensor([0, 1, 2, 0]), 3)
    """
    check_group_ids("group_ids", group_ids)
    check_group_ids("state_ids", state_ids, group_ids.shape[0])
    if group_ids.shape[0] == 0:
        return torch.zeros(0, dtype=torch.int64, device=group_ids.device), 0
    # rank both ids (order preserving), then one 1-D unique over the combined key: the same
    # numbering as a lexicographic unique over (group, state) pairs, without torch.unique(dim=0)
    g_idx, _ = _group_index(group_ids, "group_ids")
    s_idx, num_states = _group_index(state_ids, "state_ids")
    return group_index(g_idx * num_states + s_idx)


def discounted_step_returns(
    step_rewards: Tensor,  # [N] float, immediate reward r_t of each step
    traj_ids: Tensor,  # [N] int, episode each step belongs to
    step_index: Tensor,  # [N] int >= 0, time step t of each step inside its episode
    *,
    gamma: float = 1.0,
) -> Tensor:  # [N] discounted return-to-go R_t of each step
    """Discounted return-to-go of every step of every trajectory (GiGPO, Eq. 5).

        R_t = sum_{k >= t} gamma^(k - t) r_k        (k, t: step indices of the same trajectory)

    The per-step return that GiGPO (Feng et al., 2025, arXiv:2505.10978) compares inside an
    anchor-state group; with ``gamma = 1`` it is the undiscounted reward-to-go, with
    ``gamma = 0`` the immediate reward. Unlike token-level discounted returns (over the ``T``
    tokens of one sample), this discounts over *samples*: each step is its own row of the batch.

    Steps may arrive in any order and trajectories may have different lengths. They are
    sorted by ``(trajectory, step_index)`` (two stable sorts) and the recursion
    ``R_i = r_i + gamma^(s_next - s_i) R_next`` is solved by a log-depth scan over the sorted
    steps (``ceil(log2 L)`` vectorised passes, ``L`` the most steps of one trajectory): memory
    ``O(N)``, whatever the values of ``step_index`` (``10**12`` is fine). ``step_index`` is a
    time index: a gap (step 1 missing between 0 and 2) counts as a step with zero reward, so
    ``R_0 = r_0 + gamma^2 r_2``; the powers ``gamma^gap`` are taken in float64 (only
    non-negative exponents: no overflow; a huge gap underflows to 0). All tensors must share
    a device; ``meta`` is refused by name (the layout reads the ids).

    Args:
        step_rewards: ``[N]`` float, finite.
        traj_ids: ``[N]`` int, any values.
        step_index: ``[N]`` int, ``>= 0``; ``(traj_id, step_index)`` pairs must be unique.
        gamma: discount in ``[0, 1]``.

    Returns:
        ``[N]`` returns, in the order of the input, dtype of ``step_rewards``.

    >>> r = torch.tensor([0.0, 1.0, 3.0, 4.0])
    >>> traj = torch.tensor([7, 7, 3, 7])
    >>> step = torch.tensor([1, 0, 0, 2])    # trajectory 7 = steps (0: 1.0, 1: 0.0, 2: 4.0)
    >>> discounted_step_returns(r, traj, step, gamma=0.5)   # R_1 = 0 + .5*4, R_0 = 1 + .5*R_1
    tensor([2., 2., 3., 4.])
    """
    _check_step_inputs(step_rewards, traj_ids, step_index)
    check_discount("gamma", gamma)
    n = step_rewards.shape[0]
    if n == 0:
        return step_rewards.clone()
    return _step_returns(step_rewards, _step_layout(traj_ids, step_index), gamma)


def discounted_return_advantages(
    step_rewards: Tensor,  # [N] float, immediate reward r_t of each step
    traj_ids: Tensor,  # [N] int, episode of each step
    step_index: Tensor,  # [N] int >= 0, turn of each step inside its episode
    group_ids: Tensor,  # [N] int, task group of the step's episode
    *,
    gamma: float = 0.95,
    norm: str = "std",
    eps: float = 1e-6,
) -> Tensor:  # [N] advantage of each step
    """Per-step credit from discounted returns-to-go, normalised within each task group.

        R_t = sum_{k >= t} gamma^(k - t) r_k                      (discounted_step_returns)
        A_t = (R_t - mean_g R) / (std_g R + eps)    norm="std"    (g: the step's task group)
        A_t =  R_t - mean_g R                       norm="none"

    The step-level baseline of RAGEN / StarPO's per-turn variant and of GiGPO's step term
    (Feng et al., 2025, arXiv:2505.10978, Eq. 5) without GiGPO's anchor-state grouping: every
    step of a group's episodes is compared with every other, so a late step that sits close
    to the reward gets more credit than an early one (``gamma < 1``). Used with one sample
    per turn (``rollout.sample_per=turn`` of the agentic trainer), where each turn is a row.

    The inputs follow the conventions of this module (steps in any order, arbitrary ids, gaps
    in ``step_index`` as zero-reward turns, a constant or singleton group gives exactly 0,
    ``N = 0`` an empty result; ``std`` Bessel-corrected). ``group_ids`` must be constant over
    the steps of an episode, as in :func:`gigpo_advantages`: an episode that claims two task
    groups raises ``ValueError`` naming ``group_ids`` (a value check, skipped inside
    ``rollkit.validation.value_checks(False)``); so do non-integer ids, a length or device
    other than ``step_rewards``'.

    Args:
        step_rewards: ``[N]`` float, finite. traj_ids: ``[N]`` int.
        step_index: ``[N]`` int ``>= 0``, ``(traj_id, step_index)`` unique.
        group_ids: ``[N]`` int, constant per episode.
        gamma: discount in ``[0, 1]``. norm: ``"std"`` or ``"none"``. eps: ``>= 0``.

    >>> r = torch.tensor([0.0, 1.0, 0.0, 0.0])
    >>> traj, step, group = torch.tensor([0, 0, 1, 1]), torch.tensor([0, 1, 0, 1]), torch.tensor([0, 0, 0, 0])
    >>> discounted_return_advantages(r, traj, step, group, gamma=0.5, norm="none")
    tensor([ 0.1250,  0.6250, -0.3750, -0.3750])
    """
    _check_step_inputs(step_rewards, traj_ids, step_index)
    n = step_rewards.shape[0]
    check_group_ids("group_ids", group_ids, n)
    check_same_device("group_ids", group_ids, "step_rewards", step_rewards)
    check_discount("gamma", gamma)
    check_choice("norm", norm, _NORMS)
    check_positive("eps", eps, allow_zero=True)
    if n == 0:
        return step_rewards.clone()
    lay = _step_layout(traj_ids, step_index)
    g_idx, num_groups = _task_groups(group_ids, lay.t_idx, lay.num_traj)
    returns = _step_returns(step_rewards, lay, gamma)
    return _group_normalize(returns, g_idx, num_groups, scale=norm == "std", unbiased=True, eps=eps)


def gigpo_advantages(
    step_rewards: Tensor,  # [N] float, immediate reward of each step
    traj_ids: Tensor,  # [N] int, episode of each step
    step_index: Tensor,  # [N] int >= 0, turn index inside the episode
    group_ids: Tensor,  # [N] int, task-instance group of the episode (constant per episode)
    state_ids: Tensor,  # [N] int, hash of the environment state the step acted from
    episode_returns: Tensor | None = None,  # [N] float, optional episode score per step
    *,
    gamma: float = 0.95,
    step_weight: float = 1.0,
    norm: str = "none",
    eps: float = 1e-6,
    unbiased_std: bool = True,
    episode_stats: str = "trajectory",
) -> Tensor:  # [N] advantage of each step (broadcast it over the step's response tokens)
    """GiGPO (Group-in-Group Policy Optimization; Feng, Xue, Liu, An, 2025, arXiv:2505.10978).

        A(step i of episode tau)  =  A_E(tau)  +  step_weight * A_S(i)

        A_E(tau) = (R(tau) - mean_{tau' in G(tau)} R(tau')) / F_norm      R(tau) = sum_t r_t(tau)
        A_S(i)   = (R_t(i) - mean_{j in anchor(i)} R_t(j)) / F_norm        R_t = discounted_step_returns
        F_norm   = std + eps  (norm="std")   or   1  (norm="none")

    ``G(tau)`` is the task group of the episode (``group_ids``: episodes rolled out from the same
    initial state). ``anchor(i)`` is the *anchor-state group* of step ``i``: all steps, across
    the episodes of the same task group, that acted from the same environment state
    (same ``group_id`` and ``state_id``, see :func:`anchor_state_index`). What distinguishes
    GiGPO from GRPO/StarPO (one advantage per episode) is the second, step-level term: it ranks
    the *actions* taken from one repeated state by their discounted return-to-go, which gives
    per-step credit without a critic and without extra rollouts.

    Args:
        step_rewards: ``[N]`` float, finite: ``r_t``.
        traj_ids: ``[N]`` int, any values; one id per episode.
        step_index: ``[N]`` int ``>= 0``; ``(traj_id, step_index)`` unique (gaps: zero reward).
        group_ids: ``[N]`` int; must be constant over the steps of an episode.
        state_ids: ``[N]`` int; equal ids mean "the same state" (hash the observation text).
        episode_returns: optional ``[N]`` float, constant over the steps of an episode: the
            episode score ``R(tau)`` used by ``A_E`` when it is not the plain sum of the step
            rewards (e.g. an outcome verifier, or a format penalty). ``None`` (default):
            ``R(tau) = sum_t r_t`` (undiscounted, as in the paper).
        gamma: discount of the step returns ``R_t``, in ``[0, 1]`` (verl-agent default 0.95).
        step_weight: ``omega >= 0``, weight of ``A_S`` (paper: 1). ``0`` gives GRPO over episodes.
        norm: ``"none"`` (``F_norm = 1``, mean-centred; verl-agent's default ``mean_norm``) or
            ``"std"`` (``mean_std_norm``). The same choice applies to both levels.
        eps: added to the std (``norm="std"`` only).
        unbiased_std: Bessel-corrected std (``n - 1``), as ``torch.std``.
        episode_stats: ``"trajectory"`` (paper, Eq. 3): ``A_E``'s mean / std are over the
            episodes of the group, each counted once. ``"step"``: over the *steps* of the
            group, each episode weighted by its number of steps (verl-agent's default,
            ``compute_mean_std_cross_steps=True``).

    Edge cases (one behaviour each):
        * singleton task group (one episode) or all episodes with the same return: ``A_E = 0``
          (verl-agent uses mean 0 / std 1 for a singleton, i.e. ``A_E = R``).
        * singleton anchor group (a state visited once) or equal returns in it: ``A_S = 0``.
        * ``step_weight = 0``: episode term only; ``gamma = 0``: ``A_S`` compares immediate
          rewards.
        * ``N = 0``: empty output.

    Returns:
        ``[N]`` advantages in input order; broadcast them over the response tokens of each step
        with :func:`rollkit.ops.broadcast_to_tokens`.

    >>> # one task group, two episodes that both start from state 11 (an anchor of size 2):
    >>> # episode 0: rewards (0, 1) -> R = 1;  episode 1: rewards (0, 0) -> R = 0
    >>> r = torch.tensor([0.0, 1.0, 0.0, 0.0])
    >>> traj, step = torch.tensor([0, 0, 1, 1]), torch.tensor([0, 1, 0, 1])
    >>> group, state = torch.tensor([4, 4, 4, 4]), torch.tensor([11, 12, 11, 13])
    >>> adv = gigpo_advantages(r, traj, step, group, state, gamma=0.5)
    >>> # A_E = +-0.5; at state 11: R_0 = 0.5 vs 0.0 -> A_S = +-0.25; states 12, 13: singletons
    >>> torch.allclose(adv, torch.tensor([0.75, 0.5, -0.75, -0.5]))
    True
    """
    _check_step_inputs(step_rewards, traj_ids, step_index)
    n = step_rewards.shape[0]
    check_group_ids("group_ids", group_ids, n)
    check_group_ids("state_ids", state_ids, n)
    check_same_device("group_ids", group_ids, "step_rewards", step_rewards)
    check_same_device("state_ids", state_ids, "step_rewards", step_rewards)
    check_discount("gamma", gamma)
    check_positive("step_weight", step_weight, allow_zero=True)
    check_choice("norm", norm, _NORMS)
    check_positive("eps", eps, allow_zero=True)
    check_choice("episode_stats", episode_stats, ("trajectory", "step"))
    if episode_returns is not None:
        check_ndim("episode_returns", episode_returns, 1)
        check_float("episode_returns", episode_returns)
        if episode_returns.shape[0] != n:
            raise ValueError(
                f"episode_returns: has {episode_returns.shape[0]} entries but the batch has {n} steps"
            )
        check_same_device("episode_returns", episode_returns, "step_rewards", step_rewards)
        check_finite("episode_returns", episode_returns)
    if n == 0:
        return step_rewards.clone()
    if step_rewards.dtype in _HALF or (episode_returns is not None and episode_returns.dtype in _HALF):
        return gigpo_advantages(  # computed in float32, cast back
            step_rewards.float(),
            traj_ids,
            step_index,
            group_ids,
            state_ids,
            None if episode_returns is None else episode_returns.float(),
            gamma=gamma,
            step_weight=step_weight,
            norm=norm,
            eps=eps,
            unbiased_std=unbiased_std,
            episode_stats=episode_stats,
        ).to(step_rewards.dtype)

    lay = _step_layout(traj_ids, step_index)
    t_idx, num_traj = lay.t_idx, lay.num_traj
    g_idx, num_groups = _task_groups(group_ids, t_idx, num_traj)

    # ---- episode level: R(tau) per trajectory, normalised within the task group
    if episode_returns is None:
        traj_return = _segment_sum(step_rewards, t_idx, num_traj)
    else:
        _constant_within("episode_returns", episode_returns, t_idx, num_traj, "trajectory")
        # one representative per trajectory (all equal after the check); the max keeps it exact
        traj_return = _segment_max(episode_returns.to(step_rewards.dtype), t_idx, num_traj)
    if episode_stats == "trajectory":
        traj_group = torch.zeros(num_traj, dtype=torch.int64, device=g_idx.device).scatter(0, t_idx, g_idx)
        a_traj = _group_normalize(
            traj_return, traj_group, num_groups, scale=norm == "std", unbiased=unbiased_std, eps=eps
        )
        a_episode = a_traj.index_select(0, t_idx)
    else:
        a_episode = _group_normalize(
            traj_return.index_select(0, t_idx),
            g_idx,
            num_groups,
            scale=norm == "std",
            unbiased=unbiased_std,
            eps=eps,
        )

    if step_weight == 0:
        return a_episode

    # ---- step level: discounted return-to-go, normalised within the anchor-state group
    returns = _step_returns(step_rewards, lay, gamma)
    a_idx, num_anchors = anchor_state_index(group_ids, state_ids)
    a_step = _group_normalize(
        returns, a_idx, num_anchors, scale=norm == "std", unbiased=unbiased_std, eps=eps
    )
    return a_episode + step_weight * a_step


def starpo_advantages(
    traj_returns: Tensor,  # [B] float, total reward of each trajectory (one sample per trajectory)
    group_ids: Tensor,  # [B] int, task instance (initial state) each trajectory was rolled out from
    *,
    norm: str = "std",
    eps: float = 1e-6,
    unbiased_std: bool = True,
    min_std: float = 0.0,
    clip: tuple[float, float] | None = None,
) -> Tensor:  # [B] one advantage per trajectory
    """StarPO trajectory-level advantage (RAGEN; Wang, Z. et al., 2025, arXiv:2504.20073).

        A(tau) = clip((R(tau) - mean_{tau' in G(tau)} R(tau')) / F_norm, lo, hi)
        F_norm = std + eps  (norm="std")   or   1  (norm="none")

    StarPO (State-Thinking-Actions-Reward Policy Optimization) optimises whole multi-turn
    trajectories: the sample is the full interleaved episode (states, reasoning, actions,
    environment feedback), its reward the episode total ``R(tau) = sum_t r_t``, and its
    advantage is group-relative over the trajectories rolled out from the same task instance
    (RAGEN's ``grouping="state"``; pass one constant id for ``"batch"``). Unlike GiGPO there is no
    step-level term: every response token of the episode gets the same advantage (broadcast it
    with :func:`rollkit.ops.broadcast_to_tokens` over the trajectory's response mask, which is
    False on environment tokens). StarPO-S's variance-based trajectory filtering (keep the task
    groups with the highest reward std) is a sample filter, not part of this estimator: see
    :mod:`rollkit.filters`.

    Args:
        traj_returns: ``[B]`` float, finite.
        group_ids: ``[B]`` int, any values and group sizes.
        norm: ``"std"`` (RAGEN's ``mean_std``, default) or ``"none"`` (RAGEN's ``mean``).
        eps: added to the std (``norm="std"`` only). RAGEN uses ``1e-6``.
        unbiased_std: Bessel-corrected std (``torch.std``, RAGEN's choice).
        min_std: ``norm="std"`` only: groups whose std is ``<= min_std`` get advantage 0 (RAGEN
            zeroes groups with ``std <= 1e-6`` for bf16 stability; default ``0``: only exactly
            constant groups).
        clip: optional ``(lo, hi)`` clamp of the result (RAGEN's ``asym_clip`` is ``(-1, 3)``).

    Edge cases: singleton groups and constant groups give exactly ``0``; ``B = 0`` gives an
    empty tensor; non-finite returns raise ``ValueError``.

    >>> R = torch.tensor([1.0, 0.0, 5.0, 1.0, 5.0])
    >>> g = torch.tensor([0, 0, 9, 0, 9])      # group 0: (1, 0, 1), group 9: (5, 5)
    >>> adv = starpo_advantages(R, g, norm="none")
    >>> torch.allclose(adv, torch.tensor([1 / 3, -2 / 3, 0.0, 1 / 3, 0.0]))
    True
    """
    check_ndim("traj_returns", traj_returns, 1)
    check_float("traj_returns", traj_returns)
    check_group_ids("group_ids", group_ids, traj_returns.shape[0])
    check_same_device("group_ids", group_ids, "traj_returns", traj_returns)
    check_choice("norm", norm, _NORMS)
    check_positive("eps", eps, allow_zero=True)
    check_positive("min_std", min_std, allow_zero=True)
    if clip is not None:
        pair = tuple(clip) if isinstance(clip, (tuple, list)) else ()
        if len(pair) != 2 or not check_real("clip", pair[0]) <= check_real("clip", pair[1]):
            raise ValueError(f"clip: expected (lo, hi) with lo <= hi, got {clip}")
    check_finite("traj_returns", traj_returns)
    if traj_returns.shape[0] == 0:
        return traj_returns.clone()
    if traj_returns.dtype in _HALF:  # computed in float32, cast back
        return starpo_advantages(
            traj_returns.float(),
            group_ids,
            norm=norm,
            eps=eps,
            unbiased_std=unbiased_std,
            min_std=min_std,
            clip=clip,
        ).to(traj_returns.dtype)
    g_idx, num_groups = group_index(group_ids)
    adv = _group_normalize(
        traj_returns, g_idx, num_groups, scale=norm == "std", unbiased=unbiased_std, eps=eps
    )
    if norm == "std" and min_std > 0:
        std = _segment_std(traj_returns, g_idx, num_groups, unbiased=unbiased_std)
        adv = torch.where(
            (std <= min_std).index_select(0, g_idx), torch.zeros((), dtype=adv.dtype, device=adv.device), adv
        )
    if clip is not None:
        adv = adv.clamp(min=clip[0], max=clip[1])
    return adv


# --------------------------------------------------------------------------- registry

ADVANTAGE_ESTIMATORS.register(
    "gigpo",
    gigpo_advantages,
    aliases=["group-in-group"],
    in_keys={
        "step_rewards": STEP_REWARDS,
        "traj_ids": TRAJ_IDS,
        "step_index": STEP_INDEX,
        "group_ids": GROUP_IDS,
        "state_ids": STATE_IDS,
        "episode_returns": EPISODE_RETURNS,  # optional: absent from the batch -> summed rewards
    },
    out_keys=(ADVANTAGES,),
)
ADVANTAGE_ESTIMATORS.register(
    "discounted_return",
    discounted_return_advantages,
    aliases=["step-return"],
    in_keys={
        "step_rewards": STEP_REWARDS,
        "traj_ids": TRAJ_IDS,
        "step_index": STEP_INDEX,
        "group_ids": GROUP_IDS,
    },
    out_keys=(ADVANTAGES,),
)
ADVANTAGE_ESTIMATORS.register(
    "starpo",
    starpo_advantages,
    in_keys={"traj_returns": REWARDS, "group_ids": GROUP_IDS},
    out_keys=(ADVANTAGES,),
)
