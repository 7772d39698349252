"""IPA's chunk-level credit: discounted returns over interaction chunks (arXiv:2512.24873).

IPA (Wang et al. 2025, "Let It Flow: Agentic Crafting on Rock and Roll, Building the ROME Model
within an Open Agentic Learning Ecosystem", arXiv:2512.24873) assigns credit per *interaction
chunk* (a model turn and what it caused) rather than per token: every token of a chunk gets
the chunk's discounted return, discounted over chunks, not over tokens. The loss side (the
chunk-level importance ratio) is :mod:`rollkit.losses.ipa`.

**Provenance.** The paper's own equations could not be consulted when this module was written
(only third-party summaries of arXiv:2512.24873 were reachable). The return follows ROLL's
implementation (github.com/alibaba/ROLL): ``compute_agentic_reinforce_return`` in
``roll/pipeline/agentic/utils.py`` (``adv_estimator="agentic_reinforce"``), which walks the
chunks of a row backwards, ``G = r_last_token_of_chunk + gamma * G``, and writes ``G`` on every
token of the chunk; ROLL then optionally whitens the advantages over the batch
(``whiten_advantages``). Here a chunk is a step of the step layout of
:mod:`rollkit.advantages.agentic` (one reward per turn: ``TrajectoryBatch.step_rewards``), and
the return is :func:`rollkit.advantages.discounted_step_returns`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rollkit.advantages.agentic import _task_groups, discounted_step_returns
from rollkit.keys import ADVANTAGES, GROUP_IDS, STEP_INDEX, STEP_REWARDS, TRAJ_IDS
from rollkit.ops import _group_index, _group_normalize
from rollkit.registry import ADVANTAGE_ESTIMATORS
from rollkit.validation import check_choice, check_group_ids, check_positive, check_same_device

__all__ = ["ipa_advantages"]

_NORMS = ("batch", "group", "none")


def ipa_advantages(
    step_rewards: Tensor,  # [N] float: the reward of each interaction chunk (turn)
    traj_ids: Tensor,  # [N] int: the episode of each chunk
    step_index: Tensor,  # [N] int >= 0: the chunk's position in its episode
    group_ids: Tensor | None = None,  # [N] int: the task group (norm="group" only)
    *,
    gamma: float = 1.0,
    norm: str = "batch",
    eps: float = 1e-6,
    unbiased_std: bool = True,
) -> Tensor:  # [N] advantage of each chunk (spread it over the chunk's tokens)
    """Chunk-level advantages of IPA: the discounted return over interaction chunks, normalised.

        G_k = sum_{j >= k} gamma^(j - k) r_j            (k, j: chunks of one episode, in order)
        A_k = (G_k - mean G) / (std G + eps)            norm="batch"  (over all chunks of the batch)
        A_k = (G_k - mean_g G) / (std_g G + eps)        norm="group"  (over the chunks of k's task group)
        A_k = G_k                                       norm="none"

    ``G_k`` is ROLL's ``agentic_reinforce`` return (``compute_agentic_reinforce_return``: the
    reward at the last token of each chunk, accumulated backwards over chunks with ``gamma``;
    see the module docstring for provenance: the paper's equation was not available).
    ``norm="batch"`` is ROLL's ``whiten_advantages`` with one difference: ROLL whitens over
    *tokens* (a long chunk weighs more), this whitens over *chunks* (each turn weighs one).
    ``norm="group"`` compares chunks only with those of episodes of the same task (a GRPO-style
    baseline, not ROLL's). The discount is over chunks, never over tokens: a 500-token turn and
    a 5-token turn are each one step of ``gamma``.

    Conventions of :mod:`rollkit.advantages.agentic`: chunks in any order, ids arbitrary, a gap
    in ``step_index`` counts as a chunk with reward 0; a batch (or group) whose returns are all
    equal gets exactly 0; non-finite rewards raise; an empty batch gives an empty tensor.
    Differentiable in the rewards.

    Registered in ``ADVANTAGE_ESTIMATORS`` as ``"ipa"`` (alias ``"chunk-returns"``), reading
    the step keys ``step_rewards``, ``traj_ids``, ``step_index`` and ``group_ids`` (those of
    ``TrajectoryBatch``, which spreads the result over each turn's tokens with
    ``steps_to_tokens``).

    Args:
        step_rewards: ``[N]`` float, finite. traj_ids: ``[N]`` int.
        step_index: ``[N]`` int ``>= 0``, unique per episode.
        group_ids: ``[N]`` int, required for ``norm="group"`` (then constant over the chunks
            of an episode, as in :func:`rollkit.advantages.gigpo_advantages`: an episode that
            claims two task groups raises naming ``group_ids``), ignored otherwise.
        gamma: discount per chunk, in ``[0, 1]``.
        norm: ``"batch"``, ``"group"`` or ``"none"``.
        eps: ``>= 0``, added to the std. unbiased_std: Bessel-corrected std.

    Returns:
        ``[N]`` advantages, input order, dtype of ``step_rewards``.

    >>> r = torch.tensor([0.0, 1.0, 0.0])           # episode 0: turns 0, 1; episode 1: one turn
    >>> traj, step = torch.tensor([0, 0, 1]), torch.tensor([0, 1, 0])
    >>> ipa_advantages(r, traj, step, gamma=0.9, norm="none")     # G_0 = 0 + 0.9 * 1
    tensor([0.9000, 1.0000, 0.0000])
    >>> ipa_advantages(r, traj, step, gamma=0.9)                  # whitened over the 3 chunks
    tensor([ 0.4842,  0.6657, -1.1499])
    """
    check_choice("norm", norm, _NORMS)
    check_positive("eps", eps, allow_zero=True)
    returns = discounted_step_returns(step_rewards, traj_ids, step_index, gamma=gamma)
    if group_ids is not None:  # validated even where the norm ignores it
        check_same_device("group_ids", group_ids, "step_rewards", step_rewards)
    if norm == "none" or returns.shape[0] == 0:
        return returns
    if norm == "group":
        if group_ids is None:
            raise ValueError("group_ids: required when norm='group'")
        check_group_ids("group_ids", group_ids, returns.shape[0])
        t_idx, num_traj = _group_index(traj_ids, "traj_ids")
        index, num = _task_groups(group_ids, t_idx, num_traj)  # one task group per episode
    else:
        index = torch.zeros(returns.shape[0], dtype=torch.int64, device=returns.device)
        num = 1
    return _group_normalize(returns, index, num, scale=True, unbiased=unbiased_std, eps=eps)


ADVANTAGE_ESTIMATORS.register(
    "ipa",
    ipa_advantages,
    aliases=("chunk-returns",),
    in_keys={
        "step_rewards": STEP_REWARDS,
        "traj_ids": TRAJ_IDS,
        "step_index": STEP_INDEX,
        "group_ids": GROUP_IDS,
    },
    out_keys=(ADVANTAGES,),
)
