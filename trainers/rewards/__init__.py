"""Rewards: verifiers chosen by name, the reward pool, the LLM judge, code rewards and their sandbox.

* :mod:`trainers.rewards.verifiers`: the verifier protocol ``(completion, prompt) -> float``,
  exact match, Math-Verify, and :data:`VERIFIERS`, the one registry a config picks a verifier
  from (``reward.verifier=exact_match|math_verify|llm_judge|code|reward_model``; :func:`get_verifier`).
* :mod:`trainers.rewards.pool`: :class:`RewardPool` (inline, worker processes or Ray actors;
  their worker side in :mod:`trainers.rewards.backends`)
  scores samples as they are generated; :func:`rollout_and_score`.
* :mod:`trainers.rewards.judge`: :class:`JudgeReward`, a judge model's grade.
* :mod:`trainers.rewards.reward_model`: :class:`RewardModelVerifier`, a learned reward model's
  score (a sequence-classification checkpoint, e.g. trained by ``recipes/reward_model.py``).
* :mod:`trainers.rewards.code`: :class:`CodeVerifier`, the completion's program run against
  test cases in :mod:`trainers.rewards.sandbox` (bubblewrap, or a labelled rlimit fallback).
* :mod:`trainers.rewards.instructions`: :class:`InstructionVerifier` (``ifeval``), IFEval's
  verifiable instructions; :mod:`trainers.rewards.choice`: :class:`ChoiceVerifier`
  (``multiple_choice``), the chosen option letter.

Guides: ``docs/rewards-workers.md`` (verifiers, pools, streaming, the judge) and
``docs/sandbox.md`` (the sandbox, code rewards).
"""

from trainers.rewards.choice import ChoiceVerifier, extract_choice
from trainers.rewards.code import CodeProblem, CodeReport, CodeVerifier, StdioCase
from trainers.rewards.instructions import INSTRUCTIONS, InstructionVerifier, check_instructions
from trainers.rewards.judge import JudgeReward, Judgment, parse_judgment
from trainers.rewards.pool import BACKENDS, RewardPool, rollout_and_score
from trainers.rewards.reward_model import RewardModelVerifier
from trainers.rewards.sandbox import RunResult, run_python
from trainers.rewards.verifiers import (
    VERIFIERS,
    MathVerifier,
    Verifier,
    exact_match,
    exact_match_reward,
    get_verifier,
    llm_judge,
    math_verify_reward,
    parse_number,
    register_verifier,
)

__all__ = [
    "BACKENDS",
    "INSTRUCTIONS",
    "VERIFIERS",
    "ChoiceVerifier",
    "CodeProblem",
    "CodeReport",
    "CodeVerifier",
    "InstructionVerifier",
    "JudgeReward",
    "Judgment",
    "MathVerifier",
    "RewardModelVerifier",
    "RewardPool",
    "RunResult",
    "StdioCase",
    "Verifier",
    "check_instructions",
    "exact_match",
    "exact_match_reward",
    "extract_choice",
    "get_verifier",
    "llm_judge",
    "math_verify_reward",
    "parse_judgment",
    "parse_number",
    "register_verifier",
    "rollout_and_score",
    "run_python",
]
