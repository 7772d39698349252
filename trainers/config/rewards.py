"""The ``reward`` section: the verifier, the pool that runs it, and the verifiers' options."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from trainers.config.fields import setting

__all__ = ["RewardConfig"]


@dataclass
class RewardConfig:
    """Scoring: a verifier of :data:`trainers.rewards.VERIFIERS` run by a
    :class:`~trainers.rewards.RewardPool` on each sample as soon as it is generated."""

    # "exact_match", "math_verify", "llm_judge", "code", "ifeval", "multiple_choice", "reward_model"
    verifier: str = "exact_match"
    backend: Literal["inline", "process", "ray"] = "inline"  # "inline", "process" or "ray"
    num_workers: int = setting(
        2, ge=1
    )  # with max_workers: the size the pool starts at and never shrinks below
    max_workers: int = setting(
        0, ge=0
    )  # > 0: the pool grows with its queue up to this many workers (0: fixed size)
    idle_s: float = setting(10.0, gt=0)  # with max_workers: a surplus worker idle this long is stopped
    timeout_s: float = setting(
        10.0, gt=0
    )  # per sample; past it the sample scores 0 (process / Ray: the worker is killed)
    # > 0: DAPO soft overlong punishment added to each reward (rollkit.rewards.overlong_penalty;
    # verl reward_model.overlong_buffer.len / penalty_factor): 0 up to rollout.max_tokens -
    # overlong_buffer tokens, then linear down to -overlong_penalty at rollout.max_tokens. 0: off
    overlong_buffer: int = setting(0, ge=0)
    overlong_penalty: float = setting(1.0, ge=0)
    max_retries: int = setting(
        1, ge=0
    )  # a sample whose worker died is scored again on a fresh worker, this many times
    cpus_per_worker: float = setting(0.0, ge=0)  # Ray backend: CPUs each reward actor reserves
    judge_model: str = ""  # llm_judge: "" = SmolLM2-135M-Instruct, "tiny", or a HF checkpoint directory
    judge_max_tokens: int = 64  # llm_judge: the most tokens of one judgment
    judge_invalid_score: float = 0.0  # llm_judge: the reward of a malformed judgment
    # llm_judge: "http://host:port" of a running `vllm serve` judge, asked through the server
    # client with a deadline ("": the judge model runs in this process / the reward workers)
    judge_url: str = ""
    judge_timeout_s: float = setting(
        8.0, gt=0
    )  # served judge: deadline of each judgment (below reward.timeout_s)
    judge_served_model: str = ""  # served judge: the model name on the server ("": its one base model)
    # reward_model: a sequence-classification checkpoint (num_labels=1, e.g. trained by
    # recipes/reward_model.py) whose scalar score of prompt + response is the reward
    rm_path: str = ""
    rm_max_length: int = 512  # reward_model: prompt + response tokens scored (longer: truncated on the left)
    rm_batch_size: int = 8  # reward_model: responses scored per forward pass
    # code: the program runs the problem's tests in the sandbox (the problem is the prompt's answer, as JSON)
    code_mode: Literal["all", "fraction"] = (
        "all"  # "all": 1 if every test passes; "fraction": the share that pass
    )
    code_timeout_s: float = 10.0  # per sandbox run (reward.timeout_s must cover every test of a sample)
    code_isolation: Literal["auto", "bwrap", "rlimit"] = "auto"  # "auto", "bwrap" or "rlimit"
    code_memory_mb: int = 512
    code_max_procs: int = 16
    code_allow_env_secrets: bool = False  # rlimit fallback, non-root: run despite secret-like variables

    def verifier_options(self) -> dict[str, Any]:
        """Keyword options for :func:`trainers.rewards.get_verifier` (the judge's for ``llm_judge``,
        the sandbox's for ``code``)."""
        if self.verifier == "llm_judge":
            opts = {
                "judge_model": self.judge_model,
                "max_tokens": self.judge_max_tokens,
                "invalid_score": self.judge_invalid_score,
            }
            if not self.judge_url:
                return opts
            served = {"served_model": self.judge_served_model} if self.judge_served_model else {}
            return {**opts, "server_url": self.judge_url, "timeout_s": self.judge_timeout_s, **served}
        if self.verifier == "reward_model":
            return {
                "model_path": self.rm_path,
                "max_length": self.rm_max_length,
                "batch_size": self.rm_batch_size,
            }
        if self.verifier == "code":
            return {
                "mode": self.code_mode,
                "timeout_s": self.code_timeout_s,
                "isolation": self.code_isolation,
                "memory_mb": self.code_memory_mb,
                "max_procs": self.code_max_procs,
                "allow_env_secrets": self.code_allow_env_secrets,
            }
        return {}
