"""The standard batch keys of rollkit, their shapes and dtypes, in one place.

A rollkit batch is a :class:`tensordict.TensorDict` (or a plain ``dict`` of tensors) with
``batch_size=[B]``. ``B`` counts samples (prompt + response pairs, or agent steps) and ``T``
counts response tokens, right-padded. Every primitive takes plain tensors; the adapters in
:mod:`rollkit.td` read and write these keys so that a TensorDict user never unpacks a batch.

=====================  ==========  ========  ==============================================
key                    shape       dtype     meaning
=====================  ==========  ========  ==============================================
``response_mask``      ``[B, T]``  bool      tokens the policy generated (False for padding
                                             and for environment / tool tokens)
``logprobs``           ``[B, T]``  float     log pi_theta of the taken tokens (has grad)
``old_logprobs``       ``[B, T]``  float     policy the PPO ratio is taken against
``behavior_logprobs``  ``[B, T]``  float     log-probs reported by the rollout engine
``ref_logprobs``       ``[B, T]``  float     reference policy, for KL
``values``             ``[B, T]``  float     critic values
``ensemble_values``    ``[B,T,C]`` float     every critic's value (AsyPPO's ``C`` mini-critics)
``returns``            ``[B, T]``  float     return targets
``advantages``         ``[B, T]``  float     advantages
``rewards``            ``[B]``     float     sequence-level score
``token_rewards``      ``[B, T]``  float     per-token rewards
``group_ids``          ``[B]``     int       prompt / trajectory group / state group id
``policy_version``     ``[B]``     int       weights version that started the sample
=====================  ==========  ========  ==============================================

Distillation (:mod:`rollkit.losses.distill`) reads the teacher's log-probs of the sampled
tokens, ``teacher_logprobs`` ``[B, T]``, or its top-k, ``teacher_topk_logprobs`` (float) and
``teacher_topk_ids`` (int), both ``[B, T, K]``.
"""

from __future__ import annotations

from dataclasses import dataclass

RESPONSE_MASK = "response_mask"
LOGPROBS = "logprobs"
OLD_LOGPROBS = "old_logprobs"
BEHAVIOR_LOGPROBS = "behavior_logprobs"
REF_LOGPROBS = "ref_logprobs"
VALUES = "values"
ENSEMBLE_VALUES = "ensemble_values"
OLD_VALUES = "old_values"
RETURNS = "returns"
ADVANTAGES = "advantages"
REWARDS = "rewards"
TOKEN_REWARDS = "token_rewards"
GROUP_IDS = "group_ids"
POLICY_VERSION = "policy_version"
# Common auxiliary keys.
LOGITS = "logits"
RESPONSE_LENGTH = "response_length"
STEP_IDS = "step_ids"
LOSS = "loss"
LOSS_OBJECTIVE = "loss_objective"
# Keys used by particular primitives.
KL = "kl"
GREEDY_REWARDS = "greedy_rewards"
SAMPLE_WEIGHTS = "sample_weights"
TRUNCATED = "truncated"
ACCURACY = "accuracy"
KEEP = "keep"
# AsyPPO's per-token indicators (rollkit.critics.disagreement_masks)
ADVANTAGE_KEEP = "advantage_keep"
ENTROPY_KEEP = "entropy_keep"
OVERLONG_PENALTY = "overlong_penalty"
# Step-level (agentic) keys: one sample per agent step.
STEP_REWARDS = "step_rewards"
TRAJ_IDS = "traj_ids"
STEP_INDEX = "step_index"
STATE_IDS = "state_ids"
EPISODE_RETURNS = "episode_returns"
# Loss terms and corrections written by the adapters.
IS_WEIGHTS = "is_weights"
IS_METRICS = "is_metrics"  # a metrics dict (non-tensor), not in SPECS
ENTROPY = "entropy"
KL_LOSS = "kl_loss"
ENTROPY_LOSS = "entropy_loss"
VALUE_LOSS = "value_loss"
# Distillation: the teacher's scores of the sampled tokens, or its top-k ([B, T, K]).
TEACHER_LOGPROBS = "teacher_logprobs"
TEACHER_TOPK_LOGPROBS = "teacher_topk_logprobs"
TEACHER_TOPK_IDS = "teacher_topk_ids"


@dataclass(frozen=True)
class KeySpec:
    """Shape and dtype of a standard key. ``shape`` uses ``"B"`` and ``"T"`` as symbols."""

    name: str
    shape: tuple[str, ...]
    dtype: str  # "bool", "float" or "int"
    doc: str


SPECS: dict[str, KeySpec] = {
    s.name: s
    for s in (
        KeySpec(RESPONSE_MASK, ("B", "T"), "bool", "tokens the policy generated"),
        KeySpec(LOGPROBS, ("B", "T"), "float", "log pi_theta of the taken tokens"),
        KeySpec(OLD_LOGPROBS, ("B", "T"), "float", "policy the ratio is taken against"),
        KeySpec(BEHAVIOR_LOGPROBS, ("B", "T"), "float", "rollout-engine log-probs"),
        KeySpec(REF_LOGPROBS, ("B", "T"), "float", "reference-policy log-probs"),
        KeySpec(VALUES, ("B", "T"), "float", "critic values"),
        KeySpec(ENSEMBLE_VALUES, ("B", "T", "C"), "float", "every critic's value (C mini-critics)"),
        KeySpec(ADVANTAGE_KEEP, ("B", "T"), "bool", "tokens that keep their advantage (AsyPPO)"),
        KeySpec(ENTROPY_KEEP, ("B", "T"), "bool", "tokens that get the entropy bonus (AsyPPO)"),
        KeySpec(OLD_VALUES, ("B", "T"), "float", "critic values at rollout time"),
        KeySpec(RETURNS, ("B", "T"), "float", "return targets"),
        KeySpec(ADVANTAGES, ("B", "T"), "float", "advantages"),
        KeySpec(REWARDS, ("B",), "float", "sequence-level reward"),
        KeySpec(TOKEN_REWARDS, ("B", "T"), "float", "per-token reward"),
        KeySpec(GROUP_IDS, ("B",), "int", "group id of each sample"),
        KeySpec(POLICY_VERSION, ("B",), "int", "weights version that started the sample"),
        KeySpec(RESPONSE_LENGTH, ("B",), "int", "number of generated tokens"),
        KeySpec(STEP_IDS, ("B", "T"), "int", "turn index of each token (multi-turn)"),
        KeySpec(KL, ("B", "T"), "float", "per-token KL estimate to the reference"),
        KeySpec(GREEDY_REWARDS, ("B",), "float", "reward of the greedy response (ReMax)"),
        KeySpec(SAMPLE_WEIGHTS, ("B",), "float", "per-sample loss weight"),
        KeySpec(TRUNCATED, ("B",), "bool", "the response hit the length cap"),
        KeySpec(ACCURACY, ("B",), "float", "0/1 (or [0, 1]) correctness"),
        KeySpec(KEEP, ("B",), "bool", "keep-mask written by a filter"),
        KeySpec(OVERLONG_PENALTY, ("B",), "float", "DAPO soft overlong punishment"),
        KeySpec(STEP_REWARDS, ("B",), "float", "reward of an agent step"),
        KeySpec(TRAJ_IDS, ("B",), "int", "trajectory (episode) of an agent step"),
        KeySpec(STEP_INDEX, ("B",), "int", "turn index of an agent step in its trajectory"),
        KeySpec(STATE_IDS, ("B",), "int", "hash of the environment state at an agent step"),
        KeySpec(EPISODE_RETURNS, ("B",), "float", "return of the step's trajectory"),
        KeySpec(IS_WEIGHTS, ("B", "T"), "float", "constant importance weights"),
        KeySpec(ENTROPY, ("B", "T"), "float", "per-token policy entropy"),
        KeySpec(KL_LOSS, ("B", "T"), "float", "per-token KL loss term"),
        KeySpec(ENTROPY_LOSS, ("B", "T"), "float", "per-token entropy bonus term"),
        KeySpec(VALUE_LOSS, ("B", "T"), "float", "per-token critic loss"),
        KeySpec(TEACHER_LOGPROBS, ("B", "T"), "float", "teacher log-probs of the sampled tokens"),
        KeySpec(TEACHER_TOPK_LOGPROBS, ("B", "T", "K"), "float", "teacher's top-k log-probs"),
        KeySpec(TEACHER_TOPK_IDS, ("B", "T", "K"), "int", "token ids of the teacher's top-k"),
    )
}

__all__ = [
    "ACCURACY",
    "ADVANTAGES",
    "ADVANTAGE_KEEP",
    "BEHAVIOR_LOGPROBS",
    "ENSEMBLE_VALUES",
    "ENTROPY",
    "ENTROPY_KEEP",
    "ENTROPY_LOSS",
    "EPISODE_RETURNS",
    "GREEDY_REWARDS",
    "GROUP_IDS",
    "IS_METRICS",
    "IS_WEIGHTS",
    "KEEP",
    "KL",
    "KL_LOSS",
    "KeySpec",
    "LOGITS",
    "LOGPROBS",
    "LOSS",
    "LOSS_OBJECTIVE",
    "OVERLONG_PENALTY",
    "SAMPLE_WEIGHTS",
    "STATE_IDS",
    "STEP_INDEX",
    "STEP_REWARDS",
    "TRAJ_IDS",
    "TRUNCATED",
    "OLD_LOGPROBS",
    "OLD_VALUES",
    "POLICY_VERSION",
    "REF_LOGPROBS",
    "RESPONSE_LENGTH",
    "RESPONSE_MASK",
    "RETURNS",
    "REWARDS",
    "SPECS",
    "STEP_IDS",
    "TEACHER_LOGPROBS",
    "TEACHER_TOPK_IDS",
    "TEACHER_TOPK_LOGPROBS",
    "TOKEN_REWARDS",
    "VALUES",
    "VALUE_LOSS",
]
