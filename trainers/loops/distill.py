"""On-policy distillation: the student samples, a frozen teacher scores the sampled tokens, the
student minimises its sampled-token reverse KL to the teacher.

:class:`DistillTrainer` is built from the sync loop's parts (:mod:`trainers.loops.parts`: the
roles, the prompts, the :class:`~trainers.loops.collect.GroupCollector`, the evaluation and
the fit driver). Each step::

    collect (the student's rollout engine, scored by the verifier for the metrics) -> pack ->
    teacher log-probs of the sampled tokens (no gradient) -> update -> push weights

The teacher runs in this process (``distill.teacher_placement="process"``) or in a Ray actor
of its own (``"ray"``: :func:`trainers.ray.build_ray_teacher`, every call with the deadline
``ray.timeout_s``), beside student roles in process or on Ray; :func:`trainers.roles.build_teacher`
builds either.

``distill.mode="loss"`` (default): one optimizer step of :func:`rollkit.losses.on_policy_distill`
(``A_t = coef * (log pi_teacher - log pi_student)``, the per-token reverse KL's score-function
gradient, Thinking Machines' "On-Policy Distillation" 2025) with the global normalisers of the
batch; nothing else is in the loss. ``distill.mode="rl"``: the advantages are
:func:`rollkit.losses.distill_token_rewards` of the rollout's log-probs (plus
``distill.task_coef`` times the task advantages of ``algorithm.advantage``), trained with the
configured policy loss through the shared update stage (:class:`DistillCredit` in
:class:`~trainers.loops.stage.UpdateStage`: the correction, the KL to the initial policy,
whitening and clip work as in RLVR) and the learner's PPO update (also on Ray). Guides: ``docs/offline.md``,
``docs/distillation.md``.
"""

from __future__ import annotations

import random
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from rollkit.keys import OLD_LOGPROBS, RESPONSE_MASK
from rollkit.losses import aggregate, distill_token_rewards, global_normalizers, on_policy_distill
from trainers.config import (
    DISTILL_MODES,
    TEACHER_PLACEMENTS,
    DistillConfig,
    DistillSettings,
    validate_distill,
)
from trainers.data import Prompt
from trainers.engines.base import PackedBatch, batch_logprobs, pack_generations
from trainers.engines.step import StepBatch
from trainers.loops.collect import Group, GroupCollector
from trainers.loops.common import (
    Timer,
    loop_state,
    read_checkpoint,
    restore_loop_state,
    run_fit,
    write_checkpoint,
)
from trainers.loops.evaluation import greedy_accuracy
from trainers.loops.parts import attach, build_parts
from trainers.loops.update import SequenceCredit
from trainers.roles import build_teacher, is_ray_teacher, teacher_config

__all__ = [
    "DISTILL_MODES",
    "TEACHER_PLACEMENTS",
    "DistillCredit",
    "DistillConfig",
    "DistillSettings",
    "DistillTrainer",
    "build_teacher",
    "teacher_config",
    "validate_distill",
]

class DistillCredit:
    """The credit of ``distill.mode=rl`` in the shared update stage
    (:class:`~trainers.loops.stage.Credit`): per-token advantages
    ``distill_token_rewards(rollout log-probs, teacher log-probs)`` (the teacher scored after the
    stage's offload, timed as ``time/teacher``), minus the KL penalty per token
    (``algorithm.kl.mode=reward``), plus ``distill.task_coef`` x the task advantages of the RLVR
    credit (:class:`~trainers.loops.update.SequenceCredit`: ``algorithm.advantage`` over the
    verifier's rewards, with its reward shaping and max-length mask). No critic
    (``validate_distill`` refuses one)."""

    def __init__(
        self, trainer: DistillTrainer, groups: list[Group], batch: StepBatch, timer: Timer,
        metrics: dict[str, float],
    ) -> None:  # fmt: skip
        self.trainer, self.batch, self.timer = trainer, batch, timer
        self.behavior = batch[OLD_LOGPROBS]  # the rollout's log-probs, whatever the stage recomputes
        self.task = SequenceCredit(trainer.update, batch, *trainer.update.samples(groups), metrics)
        self.group_ids = self.task.group_ids
        self.kl_penalty: torch.Tensor | None = None

    def penalize(self, kl_penalty: torch.Tensor, *, critic: bool, metrics: dict[str, float]) -> None:
        self.kl_penalty = kl_penalty

    def shape_rewards(self, metrics: dict[str, float]) -> None:
        self.task.shape_rewards(metrics)

    def advantages(self, entry: Any, kwargs: dict[str, Any], metrics: dict[str, float]) -> torch.Tensor:
        tr, mask = self.trainer, self.batch[RESPONSE_MASK]
        d = tr.cfg.distill
        with self.timer("teacher"):
            t_lp = batch_logprobs(
                tr.teacher, self.batch.view(), micro_batch_size=tr.cfg.train.micro_batch_size, **tr._sampling()
            ).to(mask.device)
        adv = distill_token_rewards(self.behavior, t_lp, mask, coef=d.coef)
        n_tok = mask.sum().clamp(min=1)
        metrics["distill/reverse_kl"] = float(((self.behavior - t_lp) * mask).sum() / n_tok)
        if self.kl_penalty is not None:
            adv = adv - self.kl_penalty * mask
        if d.task_coef:
            adv = adv + d.task_coef * self.task.advantages(entry, kwargs, metrics)
        return adv

    def token_rewards(self) -> torch.Tensor:
        raise ValueError("distill.mode=rl: no critic (its advantages are the teacher's per-token scores)")

    def shape_advantages(self, batch: StepBatch, adv: torch.Tensor, metrics: dict[str, float]) -> torch.Tensor:
        return self.task.shape_advantages(batch, adv, metrics)

    def report(self, adv: torch.Tensor, metrics: dict[str, float]) -> None:
        self.task.report(adv, metrics)


class DistillTrainer:
    """On-policy distillation of ``cfg.model`` (the student) from ``distill.teacher``.

    Args:
        cfg: a :class:`DistillConfig`.
        rollout, train, tokenizer, model, reward_fn: the student's roles, as
            :class:`~trainers.loops.SyncTrainer` takes them.
        teacher: a frozen engine (anything with the TrainEngine ``logprobs``), or a model
            (wrapped and frozen), instead of ``distill.teacher``. It must share the tokenizer.
        train_prompts, eval_prompts: default :func:`trainers.data.build_prompts`.

    ``fit()`` = evaluate (greedy accuracy), ``train.steps`` x :meth:`step`, evaluate.
    """

    def __init__(
        self,
        cfg: DistillConfig,
        *,
        rollout: Any = None,
        train: Any = None,
        tokenizer: Any = None,
        model: Any = None,
        teacher: Any = None,
        train_prompts: list[Prompt] | None = None,
        eval_prompts: list[Prompt] | None = None,
        reward_fn: Any = None,
    ) -> None:
        validate_distill(cfg)
        self.cfg = cfg
        parts = build_parts(
            cfg,
            train_prompts=train_prompts,
            eval_prompts=eval_prompts,
            rollout=rollout,
            train=train,
            tokenizer=tokenizer,
            model=model,
            reward_fn=reward_fn,
        )
        attach(self, parts)
        try:
            self.engine = getattr(self.learner, "engine", None)
            if cfg.distill.mode == "loss" and self.engine is None:
                raise ValueError(
                    "distill.mode=loss: needs an in-process train engine; on Ray use distill.mode=rl"
                )
            self.collector = GroupCollector(
                cfg, self.rollout, self.rewards, self.codec, self.iterator, self.maker
            )
            self.teacher = build_teacher(cfg, self.tok, self.train_prompts, teacher)
            if is_ray_teacher(self.teacher) and self.teacher is not teacher:
                self.roles.owned.append(self.teacher)  # stopped with the roles
        except BaseException:
            self.roles.close()
            raise
        self.global_step = 0
        torch.manual_seed(cfg.seed)
        random.seed(cfg.seed)

    def _sampling(self) -> dict[str, Any]:
        r = self.cfg.rollout
        return {"temperature": r.temperature, "top_k": r.top_k, "top_p": r.top_p}

    def step(self) -> dict[str, float]:
        """One distillation step; returns its metrics (``distill/reverse_kl``: the k1 estimate of
        the student's per-token reverse KL to the teacher on this step's samples)."""
        timer, t_start = Timer(), time.perf_counter()
        groups, metrics, lengths = self.collector.collect(self.global_step, timer)
        if groups:
            if self.cfg.distill.mode == "loss":
                batch = pack_generations([g for _, gs, _ in groups for g in gs], self.codec.pad_id)
                if self.roles.offload:  # a colocated rollout sleeps, an offloaded train state returns
                    with timer("offload"):
                        self.roles.sleep_rollout()
                with timer("train"):
                    metrics.update(self.distill_update(batch, timer))
            else:  # the shared update stage (it also puts a colocated rollout to sleep)
                metrics.update(self.rl_update(groups, timer))
            with timer("weight_sync"):
                self.roles.push_weights(version=self.global_step + 1)
        self.global_step += 1
        metrics.update(timer.metrics(t_start))
        metrics["throughput/rollout_tokens_per_s"] = sum(lengths) / max(timer.t["rollout"], 1e-9)
        return metrics

    def distill_update(self, batch: PackedBatch, timer: Timer) -> dict[str, float]:
        """One optimizer step of :func:`~rollkit.losses.on_policy_distill` over micro-batches of
        ``train.micro_batch_size`` rows, aggregated (``algorithm.aggregation``) with the global
        normalisers of the batch; the teacher scores the batch first (no gradient; one call to a
        Ray teacher)."""
        mask, kw, d = batch.response_mask, self._sampling(), self.cfg.distill
        norms = global_normalizers(mask)
        sums: dict[str, float] = defaultdict(float)
        mbs, n_tok = self.cfg.train.micro_batch_size, max(int(mask.sum()), 1)
        with timer("teacher"):  # its logprobs, or batch_logprobs (the Ray teacher)
            teacher_lp = batch_logprobs(self.teacher, batch, micro_batch_size=mbs, **kw)
        for i in range(0, mask.shape[0], mbs):
            mb = batch[i : i + mbs]
            lp = self.engine.logprobs(mb.input_ids, mb.attention_mask, mb.response_mask, **kw)
            t_lp = teacher_lp[i : i + mbs].to(lp.device)  # a Ray teacher answers on the CPU
            out = on_policy_distill(lp, t_lp, mb.response_mask, coef=d.coef)
            loss = aggregate(out.loss, mb.response_mask, self.cfg.algorithm.aggregation, **norms)
            self.engine.backward(loss)
            w = int(mb.response_mask.sum()) / n_tok
            sums["loss/distill"] += float(loss.detach())
            for k, v in out.metrics.items():
                sums[f"distill/{k}"] += float(v) * w
        sums.update({f"optim/{k}": float(v) for k, v in self.engine.step().items()})
        return dict(sums)

    def rl_update(self, groups: list[Group], timer: Timer) -> dict[str, float]:
        """``distill.mode=rl``: the shared update stage (:class:`~trainers.loops.stage.UpdateStage`)
        on the groups' step batch with :class:`DistillCredit`: advantages
        ``distill_token_rewards(rollout log-probs, teacher)`` (+ ``task_coef`` x the task
        advantages), then the learner's PPO update."""
        batch = self.update.step_batch(groups)
        metrics: dict[str, float] = {}
        credit = DistillCredit(self, groups, batch, timer, metrics)
        metrics.update(self.update.run(batch, credit, self.global_step, timer))
        return metrics

    def evaluate(self, prompts: list[Prompt] | None = None) -> dict[str, float]:
        """Greedy accuracy of the student on the held-out prompts."""
        prompts = self.eval_prompts if prompts is None else prompts
        return greedy_accuracy(self.roles, self.codec, prompts, self.cfg.eval.max_tokens)

    def fit(self, steps: int | None = None) -> dict[str, Any]:
        """Evaluate, train ``steps`` (default ``train.steps``), evaluate (:func:`run_fit`)."""
        return run_fit(self, steps, line=_progress)

    def save_model(self, path: str | Path) -> Path:
        """The student and tokenizer as a Hugging Face model directory."""
        return self.learner.save_model(path, self.tok)

    def save_checkpoint(self, directory: str | Path | None = None) -> Path:
        """``<checkpoint.dir>/step_<k>/trainer.pt`` (the frozen teacher is rebuilt, not saved)."""
        ck = self.cfg.checkpoint
        return write_checkpoint(
            loop_state(self), directory or ck.dir, self.global_step, keep=ck.keep, resume=ck.resume
        )

    def load_checkpoint(self, path: str | Path) -> None:
        restore_loop_state(self, read_checkpoint(path, self.cfg.checkpoint.dir))
        self.rollout.update_weights(self.learner.export_weights(), version=self.global_step)

    def close(self) -> None:
        """Stop the reward workers and any Ray actors started here. Idempotent."""
        self.roles.close()

    def __enter__(self) -> DistillTrainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _progress(k: int, total: int, m: dict[str, float]) -> str:
    ev = f" eval {m['eval/accuracy']:.3f}" if "eval/accuracy" in m else ""
    kl = m.get("distill/reverse_kl", float("nan"))
    return (
        f"[step {k:>4}/{total}] reverse KL {kl:.4f} reward {m['reward/mean']:.3f} "
        f"len {m['response/length_mean']:.1f} {m['time/step']:.1f}s{ev}"
    )
