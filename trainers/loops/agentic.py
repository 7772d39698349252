"""The agentic multi-turn RL trainer: environment episodes -> trajectories -> StarPO / GiGPO -> PPO.

:meth:`AgenticTrainer.step` is one RL step::

    collect (lock-step | env-level async | async + redundant environments; faulty envs dropped and
    replaced) -> one sequence per episode (or one row per turn), response_mask False on env
    tokens -> the shared update stage (UpdateStage: [recompute,
    correction per turn] -> [reference / KL, the penalty per turn] -> advantages (registry name:
    "starpo" per trajectory, "gigpo" per step with state groups, any outcome estimator; or GAE
    over a critic) -> [whitening, clip] -> [critic update] -> the PPO update) -> push weights -> log

The trainer runs on the shared roles (:func:`trainers.roles.build_roles`: in process or Ray
actors) and the shared fit loop (:func:`trainers.loops.common.run_fit`); its own part is the
episode collection and :class:`TrajectoryCredit`. With ``rollout.max_staleness = 0`` (default)
the step is synchronous; with ``>= 1`` the next batch is collected in the background while the
current one trains, with a per-turn staleness bound. Configuration:
:class:`~trainers.config.AgenticConfig`. docs/agentic.md.
"""

from __future__ import annotations

import copy
import math
import random
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from rollkit.advantages import anchor_state_index
from rollkit.keys import GROUP_IDS, OLD_LOGPROBS, RESPONSE_MASK, REWARDS, STEP_IDS
from rollkit.trajectory import TrajectoryBatch
from trainers.config import AgenticConfig, critic_needed, validate_agentic
from trainers.deps import require
from trainers.engines.base import SamplingParams
from trainers.engines.build import build_engines, build_model, parse_dtype
from trainers.engines.step import ATTENTION_MASK, INPUT_IDS, StepBatch
from trainers.engines.torch_train import TorchTrainEngine
from trainers.envs.base import extract_boxed
from trainers.envs.episodes import EpisodeBatch, EpisodeRunner
from trainers.envs.turns import TurnEncoder
from trainers.envs.wrappers import build_inner
from trainers.learner import UpdateSpec, nll_loss
from trainers.loops.common import Timer, read_checkpoint, run_fit, write_checkpoint
from trainers.loops.stage import UpdateStage, row_advantages
from trainers.roles import build_roles

__all__ = ["AgenticTrainer", "TrajectoryCredit", "build_agentic_engines", "plot_history", "trajectory_advantages", "turn_kl_penalty"]


def build_agentic_engines(cfg: AgenticConfig) -> tuple[Any, Any, Any]:
    """``(rollout, train, tokenizer)``: the embedded transformers / PyTorch engines for
    ``cfg.model`` (:func:`trainers.engines.build.build_engines`; the tiny model gets positions
    for ``env.max_context`` tokens)."""
    validate_agentic(cfg)
    return build_engines(cfg, max_positions=max(512, cfg.env.max_context))


def _check_env(cfg: AgenticConfig) -> None:
    """Build the environment once here, so that a bad ``env.name`` / ``env.kwargs`` fails with a
    named error before any model or worker process starts."""
    try:
        build_inner(cfg.env.name, cfg.env.kwargs).close()
    except ValueError as e:
        raise ValueError(f"env.{e}" if str(e).startswith("name:") else f"env.kwargs: {e}") from None
    except TypeError as e:
        raise ValueError(f"env.kwargs: {cfg.env.name} does not take {cfg.env.kwargs}: {e}") from None


def _episode_view(batch: TrajectoryBatch) -> dict[str, torch.Tensor]:
    """The per-episode inputs of a trajectory-level estimator from a one-row-per-turn batch
    (:func:`rollkit.trajectory.build_turn_batch`: ``traj_ids`` is each row's episode)."""
    ep, mask = batch.traj_ids, batch.response_mask
    E = int(ep.max()) + 1 if ep.numel() else 0
    rewards = torch.zeros(E, dtype=batch.rewards.dtype).scatter(0, ep, batch.rewards)
    groups = torch.zeros(E, dtype=batch.group_ids.dtype).scatter(0, ep, batch.group_ids)
    length = torch.zeros(E, dtype=torch.long).index_add(0, ep, mask.sum(-1))
    width = int(length.max()) if E else 0
    return {"rewards": rewards, "group_ids": groups, "response_length": length,
            "response_mask": torch.arange(width)[None] < length[:, None]}  # fmt: skip


def trajectory_advantages(
    entry: Any, batch: TrajectoryBatch, kwargs: dict[str, Any], *, per_turn: bool = False
) -> tuple[torch.Tensor, dict[str, float]]:
    """``[B, T]`` advantages on the action tokens (0 on environment tokens and padding) by the
    estimator ``entry``: step-level (GiGPO, one value per turn) when it reads ``step_rewards``,
    else trajectory-level (StarPO, GRPO, RLOO, ...: one value per trajectory). ``per_turn``: the
    rows are turns (:func:`rollkit.trajectory.build_turn_batch`); a step value goes to its row,
    a trajectory value to every row of its episode (the same values as in the trajectory
    layout; an estimator with per-token values of the whole trajectory is refused)."""
    mask = batch.response_mask
    anchor, n_anchor = anchor_state_index(batch.step_group_ids, batch.state_ids)
    sizes = torch.bincount(anchor, minlength=n_anchor) if anchor.numel() else anchor
    metrics = {"adv/state_groups": float(n_anchor), "adv/state_groups_multi": float((sizes > 1).sum())}
    if "step_rewards" in entry.in_keys.values():
        steps = {
            "step_rewards": batch.step_rewards,
            "traj_ids": batch.traj_ids,
            "step_index": batch.step_index,
            "group_ids": batch.step_group_ids,
            "state_ids": batch.state_ids,
            "episode_returns": batch.episode_returns,
        }
        adv = batch.steps_to_tokens(entry.call(steps, **kwargs))
    elif per_turn:
        out = entry.call(_episode_view(batch), **kwargs)
        out = out[0] if isinstance(out, tuple) else out
        if out.dim() == 2 and out.shape[1] > 1 and not bool((out == out[:, :1]).all()):
            raise ValueError(
                f"rollout.sample_per=turn: algorithm.advantage={entry.name!r} gives per-token advantages of the "
                "whole trajectory; use a per-trajectory or per-step estimator (starpo, grpo, gigpo, discounted_return)"
            )
        adv = out.reshape(out.shape[0], -1)[:, 0][batch.traj_ids][:, None] * mask
    else:
        adv = row_advantages(entry, {REWARDS: batch.rewards, GROUP_IDS: batch.group_ids, RESPONSE_MASK: mask}, kwargs)
    adv = torch.where(mask, adv, torch.zeros((), dtype=adv.dtype))
    metrics["advantage/abs_mean"] = float(adv.abs().sum() / mask.sum().clamp(min=1))
    return adv, metrics


def episode_metrics(result: EpisodeBatch, version: int) -> dict[str, float]:
    """Rewards, success, turns and staleness of a collected batch (plus the collector's metrics)."""
    eps = result.episodes
    versions = [v for e in eps for v in e.versions]
    stale = [version - v for v in versions]
    return {
        **result.metrics,
        "reward/mean": sum(e.total_reward for e in eps) / len(eps),
        "success/rate": sum(e.success for e in eps) / len(eps),
        "episode/turns_mean": sum(len(e.turns) for e in eps) / len(eps),
        "episode/action_tokens_mean": sum(len(t.action_ids) for e in eps for t in e.turns)
        / max(1, len(versions)),
        "episode/context_full": float(sum(e.context_full for e in eps)),
        "staleness/max": float(max(stale, default=0)),
        "staleness/mean": sum(stale) / max(1, len(stale)),
    }


def turn_kl_penalty(batch: TrajectoryBatch, penalty: torch.Tensor, *, per_turn: bool = False) -> float:
    """``algorithm.kl.mode=reward`` for agents: each turn's summed per-token ``penalty`` ``[B, T]``
    (``coef x KL``, 0 off the action tokens) is taken off that turn's reward (``step_rewards``)
    and off its trajectory's (``rewards``, ``episode_returns``), before any estimator sees them;
    ``per_turn``: the rows are turns (:func:`rollkit.trajectory.build_turn_batch`). Returns the
    mean summed penalty per row (``kl/reward_penalty_mean``)."""
    mask = batch.response_mask
    pen = penalty * mask
    n = int(batch.step_rewards.shape[0])
    step = (batch.step_offsets.unsqueeze(1) + batch.step_ids.clamp(min=0)).clamp(max=max(n - 1, 0))
    per_step = torch.zeros(n, dtype=pen.dtype).index_add_(0, step[mask], pen[mask])
    # per turn: traj_ids are episodes; one sequence per episode: rows (a row may have no kept turn)
    episodes = (int(batch.traj_ids.max()) + 1 if n else 0) if per_turn else int(batch.rewards.shape[0])
    per_episode = torch.zeros(episodes, dtype=pen.dtype).index_add_(0, batch.traj_ids, per_step)
    row_episode = batch.traj_ids if per_turn else torch.arange(batch.rewards.shape[0])
    batch.step_rewards = batch.step_rewards - per_step
    batch.rewards = batch.rewards - per_episode[row_episode]
    batch.episode_returns = batch.episode_returns - per_episode[batch.traj_ids]
    return float(pen.sum(-1).mean())


class TrajectoryCredit:
    """The agentic credit of the shared update stage (:class:`~trainers.loops.stage.Credit`):
    episode, turn and state-group rewards of a :class:`~rollkit.trajectory.TrajectoryBatch`; the
    KL penalty per turn (:func:`turn_kl_penalty`, with or without a critic); a trajectory- or
    step-level estimator (:func:`trajectory_advantages`); a critic's token rewards are each
    turn's reward on its last action token."""

    def __init__(self, batch: TrajectoryBatch, *, per_turn: bool = False) -> None:
        self.batch, self.per_turn, self.group_ids = batch, per_turn, batch.group_ids

    def penalize(self, kl_penalty: torch.Tensor, *, critic: bool, metrics: dict[str, float]) -> None:
        metrics["kl/reward_penalty_mean"] = turn_kl_penalty(self.batch, kl_penalty, per_turn=self.per_turn)

    def shape_rewards(self, metrics: dict[str, float]) -> None:
        """None: the reward normalisations and clip are refused for agents (validate_agentic)."""

    def advantages(self, entry: Any, kwargs: dict[str, Any], metrics: dict[str, float]) -> torch.Tensor:
        adv, m = trajectory_advantages(entry, self.batch, kwargs, per_turn=self.per_turn)
        metrics.update(m)
        return adv

    def token_rewards(self) -> torch.Tensor:
        return self.batch.turn_end_rewards()

    def shape_advantages(self, batch: StepBatch, adv: torch.Tensor, metrics: dict[str, float]) -> torch.Tensor:
        return adv

    def report(self, adv: torch.Tensor, metrics: dict[str, float]) -> None:
        """None: the episode metrics are the collector's (:func:`episode_metrics`)."""


class AgenticTrainer:
    """Multi-turn agentic RL (module docstring): ``fit()`` = evaluate, ``train.steps`` x
    :meth:`step`, evaluate.

    Args:
        cfg: the configuration.
        rollout_engine, train_engine, tokenizer: engines (default: the shared roles'
            :func:`~trainers.roles.build_roles`, in process or on Ray; :func:`build_agentic_engines`
            builds the same in-process pair to pass in); the rollout engine must start with the
            train engine's weights.
        runner: an :class:`~trainers.envs.workers.EnvWorkers` to play in (default: a new one).
        critic: the critic (:class:`~trainers.critic.Critic`) of ``algorithm.advantage`` gae /
            asyppo; default: built from ``critic.*`` (``critic.model_path`` or ``model`` afresh).
        reference: the frozen reference policy of ``algorithm.kl.coef > 0`` (anything with the
            train engine's ``logprobs``); default: a frozen copy of the train engine's initial
            weights when RL starts (after the supervised warm-up;
            :func:`~trainers.engines.build.frozen_reference`), saved in checkpoints.
    """

    def __init__(
        self,
        cfg: AgenticConfig,
        *,
        rollout_engine: Any = None,
        train_engine: Any = None,
        tokenizer: Any = None,
        runner: Any = None,
        critic: Any = None,
        reference: Any = None,
    ) -> None:
        validate_agentic(cfg)
        self.cfg = cfg
        _check_env(cfg)
        self.spec = replace(UpdateSpec.from_config(cfg), logprob_gap=True)
        self._prewarmed = False
        positions = max(512, cfg.env.max_context)  # the tiny model's positions, when built here
        model = critic_model = None
        if cfg.ray.enabled and (rollout_engine is None or train_engine is None):
            # the Ray actors start from this model, warmed up here (warmup.*, unless resuming)
            model, tokenizer = build_model(cfg, max_positions=positions)
            self._set_tokenizer(tokenizer)
            if cfg.warmup.steps and not cfg.checkpoint.resume:
                if critic is None and critic_needed(cfg):  # the critic starts before the warm-up, as in process
                    critic_model = copy.deepcopy(model)
                self._warmup_loss = self._warm(TorchTrainEngine(model, dtype=parse_dtype(cfg.model.dtype)))
                self._prewarmed = True
        # the shared roles; in process the frozen reference is made as RL starts (after the warm-up)
        self.roles = build_roles(cfg, rollout=rollout_engine, train=train_engine, tokenizer=tokenizer, model=model,
                                 reference=reference, critic=critic, critic_model=critic_model, max_positions=positions,
                                 reference_later=True, rollout_may_sleep=False)  # fmt: skip
        if model is None:
            self._set_tokenizer(self.roles.tokenizer)
        self.learner = self.roles.learner
        self.learner.spec = self.spec  # logprob_gap: the same update (and metrics) in process and on Ray
        self.train = getattr(self.learner, "engine", None)  # in process: the train engine; None on Ray
        self._own_reference = reference is None and self.train is not None  # a frozen copy made here
        e = cfg.env
        self.rollout = EpisodeRunner(
            self.roles.rollout,
            self.encoder,
            e.name,
            e.kwargs,
            max_turns=e.max_turns,
            max_context=e.max_context,
            workers=runner,
            deadline_s=e.deadline_s,
            start_method=e.start_method,
            max_batch_size=cfg.rollout.max_batch_size,
            context_window=e.max_context - cfg.rollout.max_tokens
            if cfg.rollout.sample_per == "turn"
            else None,
        )
        # recompute / correction, reference / KL, advantages or critic, learner: the shared stage
        self.update = UpdateStage(cfg, self.roles)
        self.version = 0  # optimizer steps applied = the policy version the engine serves
        self._seeds = random.Random(cfg.seed)
        self._calls = 0
        self._bg = (
            ThreadPoolExecutor(1, thread_name_prefix="agentic-collect") if cfg.rollout.max_staleness else None
        )
        self._next: Future | None = None
        torch.manual_seed(cfg.seed)

    # ------------------------------------------------------------------ rollout

    @property
    def launch_groups(self) -> int:
        r = self.cfg.rollout
        return r.num_env_groups or r.groups_per_step

    def version_floor(self) -> int:
        """The oldest policy version a turn may come from (``version - max_staleness``)."""
        return self.version - self.cfg.rollout.max_staleness

    def _params(self, temperature: float, max_tokens: int) -> SamplingParams:
        r = self.cfg.rollout
        self._calls += 1
        return SamplingParams(
            temperature=temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            max_tokens=max_tokens,
            seed=(self.cfg.seed * 1_000_003 + self._calls * 7919) % (2**31),
        )

    def collect(self) -> EpisodeBatch:
        """One batch of ``groups_per_step x group_size`` finished episodes (fresh task seeds)."""
        r = self.cfg.rollout
        seeds: list[int] = []
        while len(seeds) < self.launch_groups + 2:  # two spare tasks for abandoned groups
            s = self._seeds.randrange(self.cfg.eval.seed)
            if s not in seeds:
                seeds.append(s)
        return self.rollout.collect(
            seeds,
            self._params(r.engine_temperature if r.engine_temperature > 0 else r.temperature, r.max_tokens),
            groups=r.groups_per_step,
            group_size=r.group_size,
            mode=r.mode,
            redundancy=r.redundancy,
            launch_groups=self.launch_groups if r.mode == "async" else r.groups_per_step,
            version_floor=self.version_floor if r.max_staleness else None,
            max_attempts=r.max_attempts or None,
        )

    def prestart(self) -> None:
        """Start the environment workers a step needs (outside the timed steps)."""
        r = self.cfg.rollout
        self.rollout.prestart(self.launch_groups * (r.group_size + r.redundancy))

    def _next_batch(self) -> EpisodeBatch:
        """Collect now, or take the batch collected while the previous step trained."""
        if self._bg is None:
            return self.collect()
        if self._next is None:
            self._next = self._bg.submit(self.collect)
        result = self._next.result()
        self._next = self._bg.submit(self.collect)
        return result

    # ------------------------------------------------------------------ the loop

    def step(self) -> dict[str, float]:
        """One RL step; returns its metrics."""
        timer, t0 = Timer(), time.perf_counter()
        self._ensure_reference()
        with timer("rollout"):
            result = self._next_batch()
        metrics = episode_metrics(result, self.version)
        # trajectories -> one step batch (env tokens masked out of the response) -> advantages
        batch = self._batch(result)
        L, T = batch.input_ids.shape[1], batch.response_mask.shape[1]
        step_batch = StepBatch(
            {
                INPUT_IDS: batch.input_ids,
                ATTENTION_MASK: batch.attention_mask,
                RESPONSE_MASK: batch.response_mask,
                OLD_LOGPROBS: batch.behavior_logprobs,
                # the turn of each token: the correction's segments, IPA's chunks (policy_loss=ipa)
                STEP_IDS: batch.step_ids,
            },
            prompt_len=L - T,
        )
        # the shared update stage: [recompute, correction per turn] -> [reference / KL per turn] ->
        # advantages (estimator or critic) -> [whitening, clip] -> [critic update] -> the PPO update
        credit = TrajectoryCredit(batch, per_turn=self.per_turn)
        metrics.update(self.update.run(step_batch, credit, self.version, timer))
        # push the weights (between two generation batches if a collection is running)
        self.version += 1
        with timer("weight_sync"):
            self.rollout.server.update_weights(self.learner.export_weights(), self.version)
        metrics.update(timer.metrics(t0))
        metrics["train/trajectories"] = float(batch.response_mask.shape[0])
        return metrics

    def _set_tokenizer(self, tokenizer: Any) -> None:
        """The tokenizer, its pad id and the turn encoder (``env.chat_template``, ``env.system_prompt``)."""
        e = self.cfg.env
        self.tok = tokenizer
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        template = None if e.chat_template == "auto" else e.chat_template == "on"
        self.encoder = TurnEncoder(tokenizer, chat_template=template, system_prompt=e.system_prompt or None)

    @property
    def reference(self) -> Any:
        """The frozen reference policy (``algorithm.kl.coef > 0``; made as RL starts), or None."""
        return self.roles.reference

    @reference.setter
    def reference(self, value: Any) -> None:
        self.roles.reference = value

    @property
    def critic(self) -> Any:
        """The learned critic of ``algorithm.advantage`` gae / asyppo, or None."""
        return self.roles.critic

    @property
    def per_turn(self) -> bool:
        """One sample per turn (``rollout.sample_per=turn``)."""
        return self.cfg.rollout.sample_per == "turn"

    def _batch(self, result: EpisodeBatch) -> TrajectoryBatch:
        """The training batch: one sequence per episode, or one row per turn (its window)."""
        if self.per_turn:
            return result.to_turn_batch(budget=self.rollout.context_window, pad_token_id=self.pad_id)
        return result.to_batch(max_context=self.cfg.env.max_context, pad_token_id=self.pad_id)

    @property
    def _owns_reference(self) -> bool:
        """Whether the reference is this trainer's frozen copy (saved in checkpoints)."""
        return self._own_reference and self.reference is not None

    def _ensure_reference(self) -> None:
        """The frozen copy of the policy as RL starts (``algorithm.kl.coef > 0``, none given)."""
        self.roles.freeze_reference()

    # ------------------------------------------------------------------ evaluation

    def evaluate(self, episodes: int | None = None) -> dict[str, float]:
        """Greedy success rate on the fixed evaluation tasks."""
        ev = self.cfg.eval
        n = ev.episodes if episodes is None else episodes
        seeds = [ev.seed + i for i in range(n + 2)]
        params = SamplingParams(temperature=0.0, max_tokens=ev.max_tokens, seed=0)
        res = self.rollout.collect(seeds, params, groups=n, group_size=1, mode="async", launch_groups=n)
        eps = res.episodes
        return {
            "eval/success_rate": sum(e.success for e in eps) / len(eps),
            "eval/reward_mean": sum(e.total_reward for e in eps) / len(eps),
            "eval/turns_mean": sum(len(e.turns) for e in eps) / len(eps),
        }

    # ------------------------------------------------------------------ warm-up

    def _warmup_examples(self, env: Any, rng: random.Random) -> tuple[list[list[int]], list[list[int]]]:
        """``warmup.batch_size`` contexts of random tasks after ``0 .. 2`` random turns (built in
        token space as the rollout builds them) and a random well-formed action + EOS for each."""
        w, eos = self.cfg.warmup, self.tok.eos_token_id

        def action() -> list[int]:
            text = env.sample_random_action()
            text = (extract_boxed(text) or text) if w.bare else text
            return [*self.tok(text, add_special_tokens=False).input_ids, eos]

        contexts: list[list[int]] = []
        answers: list[list[int]] = []
        while len(contexts) < w.batch_size:
            obs, _ = env.reset(seed=rng.randrange(self.cfg.eval.seed))
            context = self.encoder.prompt_ids(obs)
            for _ in range(rng.randrange(min(3, self.cfg.env.max_turns))):
                act = action()
                obs, _, terminated, truncated, _ = env.step(self.tok.decode(act, skip_special_tokens=True))
                if terminated or truncated:
                    break
                context = context + act + self.encoder.obs_ids(obs, act)
            else:
                if len(context) < self.cfg.env.max_context - 16:
                    contexts.append(context)
                    answers.append(action())
        return contexts, answers

    def warmup(self, steps: int | None = None) -> float:
        """Supervised warm-up (``warmup.*``): token-mean NLL of random well-formed actions after
        random contexts, through the train engine's forward with an AdamW of its own (lr
        ``warmup.lr``); pushes the weights. Returns the last loss."""
        if self._prewarmed:  # on Ray: done before the actors started
            return self._warmup_loss
        if self.train is None:
            raise ValueError("warmup.steps: the supervised warm-up of a Ray run happens as it starts")
        loss_v = self._warm(self.train, steps)
        self.rollout.server.update_weights(self.learner.export_weights(), self.version)
        return loss_v

    def _warm(self, engine: Any, steps: int | None = None) -> float:
        """The warm-up's ``steps`` AdamW steps on ``engine``'s model; returns the last loss."""
        w = self.cfg.warmup
        steps = w.steps if steps is None else steps
        if steps <= 0:
            return float("nan")
        env = build_inner(self.cfg.env.name, self.cfg.env.kwargs)
        rng = random.Random(self.cfg.seed + 17)
        params = [p for p in engine.model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=w.lr)
        loss_v = float("nan")
        for _ in range(steps):
            contexts, answers = self._warmup_examples(env, rng)
            loss = nll_loss(engine, contexts, answers, self.pad_id)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            loss_v = float(loss.detach())
        opt.zero_grad(set_to_none=True)
        return loss_v

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """Policy version, train engine (weights, optimizer, scheduler), the task-seed and
        sampling-seed streams (the generation server's call counters), the global RNGs. A batch being collected in the background
        (``rollout.max_staleness``) is not saved: the resumed run collects it again."""
        return {
            "version": self.version,
            "train": self.learner.state_dict(),
            "critic": None if self.critic is None else self.critic.state_dict(),
            "update": self.update.state_dict(),  # the adaptive KL coefficient (algorithm.kl.target)
            "seeds": self._seeds.getstate(),
            "calls": self._calls,
            "server": self.rollout.server.state_dict(),
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
            "reference": dict(self.reference.export_weights()) if self._owns_reference else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.learner.load_state_dict(state["train"])
        if self.critic is not None:
            if state.get("critic") is None:
                raise ValueError(
                    "checkpoint.resume: the checkpoint has no critic (it was written by a run without one)"
                )
            self.critic.load_state_dict(state["critic"])
        self.update.load_state_dict(state.get("update", {}))
        self.version, self._calls = int(state["version"]), int(state["calls"])
        self._seeds.setstate(state["seeds"])
        self.rollout.server.load_state_dict(state["server"])
        if state.get("reference") is not None:  # the reference of the run that wrote the checkpoint
            self.reference = None
            self._ensure_reference()
            self.reference.model.load_state_dict(state["reference"], strict=False)
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])

    def save_checkpoint(self, directory: str | Path | None = None) -> Path:
        """Write ``<checkpoint.dir>/step_<version>/trainer.pt``; returns the step directory."""
        self._drain()
        ck = self.cfg.checkpoint
        return write_checkpoint(
            self.state_dict(), directory or ck.dir, self.version, keep=ck.keep, resume=ck.resume
        )

    def load_checkpoint(self, path: str | Path) -> None:
        """Restore a checkpoint (a ``step_<k>`` directory, or ``"auto"``: the latest under
        ``checkpoint.dir``) and push its weights to the rollout engine."""
        self._drain()
        self.load_state_dict(read_checkpoint(path, self.cfg.checkpoint.dir))
        self.rollout.server.update_weights(self.learner.export_weights(), self.version)

    def _progress(self, k: int, total: int, m: dict[str, float]) -> str:
        ev = f" eval {m['eval/success_rate']:.3f}" if "eval/success_rate" in m else ""
        return (
            f"[step {k:>4}/{total}] reward {m['reward/mean']:+.3f} success {m['success/rate']:.3f} "
            f"turns {m['episode/turns_mean']:.1f} {m['time/step']:.1f}s "
            f"({m['time/rollout']:.1f} rollout, {m['time/train']:.1f} train) "
            f"env hang/error/died/replaced/cancelled {m['env/hang']:.0f}/{m['env/error']:.0f}/"
            f"{m['env/died']:.0f}/{m['env/replaced']:.0f}/{m['env/cancelled']:.0f}{ev}"
        )

    #: the headline of the summary and the first evaluation's line (trainers.loops.common.run_fit)
    HEADLINE = ("success", "eval/success_rate", "greedy success rate")

    @property
    def global_step(self) -> int:
        """The optimizer steps applied (:attr:`version`), as :func:`~trainers.loops.common.run_fit` counts them."""
        return self.version

    def save_model(self, path: str | Path) -> Path:
        """The trained policy and tokenizer as a Hugging Face model directory at ``path``."""
        return self.learner.save_model(path, self.tok)

    def _prepare(self, resumed: bool) -> None:
        """Before the first evaluation: the supervised warm-up (``warmup.steps``, not on a resumed
        run) and the environment workers."""
        if self.cfg.warmup.steps and not resumed:
            t = time.perf_counter()
            loss = self.warmup()
            print(f"[warmup] {self.cfg.warmup.steps} steps, last loss {loss:.3f} ({time.perf_counter() - t:.0f}s)")
        self.prestart()

    def fit(
        self, steps: int | None = None, *, on_step: Callable[[int, dict], None] | None = None
    ) -> dict[str, Any]:
        """Warm up (if configured), evaluate, train up to ``steps`` (default ``train.steps``,
        counted from the start of the run), evaluate; writes ``metrics.jsonl`` (and TensorBoard)
        under ``logging.dir`` and a plot (``curves.png``; :func:`plot_history`); returns a
        summary (the shared fit loop, :func:`trainers.loops.common.run_fit`: ``success_before``,
        ``success_after``, ...)."""
        return run_fit(self, steps, line=self._progress, headline=self.HEADLINE, prepare=self._prepare,
                       finish=self._drain, plot=plot_history, on_step=on_step)  # fmt: skip

    def _drain(self) -> None:
        """Wait for a background collection (its batch is discarded)."""
        if self._next is not None:
            try:
                self._next.result()
            finally:
                self._next = None

    def close(self) -> None:
        try:
            self._drain()
        finally:
            if self._bg is not None:
                self._bg.shutdown(wait=True)
            try:
                self.rollout.close()
            finally:
                self.roles.close()

    def __enter__(self) -> AgenticTrainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def plot_history(history: list[dict[str, Any]], path: str | Path) -> Path | None:
    """Training success rate and reward per step, and the greedy evaluation success rate, to a
    PNG; ``None`` without matplotlib."""
    try:
        matplotlib = require("matplotlib")
    except ImportError:
        return None
    matplotlib.use("Agg")
    plt = require("matplotlib.pyplot")
    fig, ax = plt.subplots(figsize=(6.5, 4))
    low = -0.15
    for key, label, marker in (
        ("success/rate", "train success rate (sampled)", None),
        ("reward/mean", "train episode reward", None),
        ("eval/success_rate", "greedy success rate (held-out tasks)", "o"),
    ):
        pts = [(r["step"], r[key]) for r in history if r.get(key) is not None and math.isfinite(r[key])]
        if pts:
            ax.plot(*zip(*pts), marker=marker, label=label)
            low = min(low, min(v for _, v in pts) - 0.05)
    ax.set_xlabel("step")
    ax.set_ylim(low, 1.02)
    ax.legend(loc="best", fontsize=8)
    ax.grid(alpha=0.3)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return path
