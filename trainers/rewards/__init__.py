"""Rewards: verifiers chosen by name, the reward pool, the LLM judge, code rewards and their sandbox.

* :mod:`trainers.rewards.verifiers`: the verifier protocol ``(completion, prompt) -> float``,
  exact match, Math-Verify, and :data:`VERIFIERS`, the one registry a config picks a verifier
  from (``reward.verifier=exact_match|math_verify|llm_judge|code``; :func:`get_verifier`).
* :mod:`trainers.rewards.pool`: :class:`RewardPool` (inline, worker processes or Ray actors)
  scores samples as they are generated; :func:`rollout_and_score`.
* :mod:`trainers.rewards.judge`: :class:`JudgeReward`, a judge model's grade.
* :mod:`trainers.rewards.code`: :class:`CodeVerifier`, the completion's program run against
  test cases in :mod:`trainers.rewards.sandbox` (bubblewrap, or a labelled rlimit fallback).

Guides: ``docs/rewards-workers.md`` (verifiers, pools, streaming, the judge) and
``docs/sandbox.md`` (the sandbox, code rewards).
"""

from trainers.rewards.code import CodeProblem, CodeReport, CodeVerifier, StdioCase
from trainers.rewards.judge import JudgeReward, Judgment, parse_judgment
from trainers.rewards.pool import BACKENDS, RewardPool, rollout_and_score
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
    "VERIFIERS",
    "CodeProblem",
    "CodeReport",
    "CodeVerifier",
    "JudgeReward",
    "Judgment",
    "MathVerifier",
    "RewardPool",
    "RunResult",
    "StdioCase",
    "Verifier",
    "exact_match",
    "exact_match_reward",
    "get_verifier",
    "llm_judge",
    "math_verify_reward",
    "parse_judgment",
    "parse_number",
    "register_verifier",
    "rollout_and_score",
    "run_python",
]
