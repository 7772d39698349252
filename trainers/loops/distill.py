"""On-policy distillation: the student samples, a frozen teacher scores the sampled tokens, the
student minimises its sampled-token reverse KL to the teacher.

:class:`DistillTrainer` is built from the sync loop's parts (:mod:`trainers.loops.parts`: the
roles, the prompts, the :class:`~trainers.loops.collect.GroupCollector`, the evaluation and
the fit driver). Each step::

    collect (the student's rollout engine, scored by the verifier for the metrics) -> pack ->
    teacher log-probs of the sampled tokens (no gradient) -> update -> push weights

The teacher runs in this process (``distill.teacher_placement="process"``) or in a Ray actor
of its own (``"ray"``: :func:`trainers.ray.build_ray_teacher`, every call with the deadline
``ray.timeout_s``), beside student roles in process or on Ray.

``distill.mode="loss"`` (default): one optimizer step of :func:`rollkit.losses.on_policy_distill`
(``A_t = coef * (log pi_teacher - log pi_student)``, the per-token reverse KL's score-function
gradient, Thinking Machines' "On-Policy Distillation" 2025) with the global normalisers of the
batch; nothing else is in the loss. ``distill.mode="rl"``: the advantages are
:func:`rollkit.losses.distill_token_rewards` of the rollout's log-probs (plus
``distill.task_coef`` times the task advantages of ``algorithm.advantage``), trained with the
configured policy loss through the learner's PPO update (also on Ray). Guides: ``docs/offline.md``,
``docs/distillation.md``.
"""

from __future__ import annotations

import copy
import random
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from rollkit.losses import aggregate, distill_token_rewards, global_normalizers, on_policy_distill
from rollkit.registry import ADVANTAGE_ESTIMATORS
from trainers.config import (
    DISTILL_MODES,
    TEACHER_PLACEMENTS,
    DistillConfig,
    DistillSettings,
    validate_distill,
)
from trainers.data import Prompt
from trainers.engines.base import PackedBatch, batch_logprobs, pack_generations
from trainers.engines.build import build_model
from trainers.learner import supervised_warmup
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
from trainers.models import is_hub_id
from trainers.ray import RayTeacher, build_ray_teacher, teacher_engine

__all__ = [
    "DISTILL_MODES",
    "TEACHER_PLACEMENTS",
    "DistillConfig",
    "DistillSettings",
    "DistillTrainer",
    "build_teacher",
    "teacher_config",
    "validate_distill",
]

def _check_vocab(teacher_vocab: dict[str, int] | None, tokenizer: Any, where: str) -> None:
    get_s = getattr(tokenizer, "get_vocab", None)
    if teacher_vocab is not None and callable(get_s) and teacher_vocab != get_s():
        raise ValueError(
            f"distill.teacher: {where}'s tokenizer differs from the student's (the teacher scores the "
            "student's token ids: use a teacher of the same tokenizer)"
        )


def _vocab(tok: Any) -> dict[str, int] | None:
    get = getattr(tok, "get_vocab", None)
    return get() if callable(get) else None


def teacher_config(cfg: DistillConfig) -> DistillConfig:
    """A copy of ``cfg`` whose ``model`` section is the teacher's (``distill.teacher``,
    ``distill.teacher_tiny_seed``, ``distill.teacher_dtype`` or ``model.dtype``)."""
    d, tcfg = cfg.distill, copy.deepcopy(cfg)
    tcfg.model.path, tcfg.model.tiny_seed = d.teacher, d.teacher_tiny_seed
    tcfg.model.dtype = d.teacher_dtype or cfg.model.dtype
    return tcfg


def _load_teacher(tcfg: DistillConfig, tokenizer: Any) -> Any:
    """The teacher model of ``tcfg.model``, its tokenizer checked against the student's."""
    where = tcfg.model.path or "the embedded default"
    try:
        teacher, teacher_tok = build_model(tcfg)
    except ValueError as e:
        raise ValueError(f"distill.teacher: {e}") from None
    _check_vocab(_vocab(teacher_tok), tokenizer, where)
    return teacher


def build_teacher(cfg: DistillConfig, tokenizer: Any, prompts: list[Prompt], teacher: Any = None) -> Any:
    """The frozen teacher engine: ``teacher`` as given when it has ``logprobs`` /
    ``batch_logprobs``; else a :class:`~trainers.engines.torch_train.TorchTrainEngine` over
    ``teacher`` (a model) or over ``distill.teacher`` loaded with :func:`build_model`, warmed up
    with ``distill.teacher_warmup_steps`` supervised steps on ``prompts``, then frozen.

    ``distill.teacher_placement="ray"``: the same engine in a Ray actor, behind a
    :class:`~trainers.ray.RayTeacher` (close it when done; :class:`DistillTrainer` does). The
    actor loads ``distill.teacher`` itself, unless a model is given or warmed up here first
    (then it is shipped through the object store).
    """
    if teacher is not None and (hasattr(teacher, "logprobs") or hasattr(teacher, "batch_logprobs")):
        return teacher
    d, tcfg = cfg.distill, teacher_config(cfg)
    if d.teacher_placement == "ray" and teacher is None and not d.teacher_warmup_steps:
        return _ray_teacher(tcfg, tokenizer)
    if teacher is None:
        teacher = _load_teacher(tcfg, tokenizer)
    dev = cfg.train.device
    eng = teacher_engine(tcfg, teacher, dev, chunk_tokens=d.teacher_chunk_tokens, lr=d.teacher_warmup_lr)
    if d.teacher_warmup_steps:
        supervised_warmup(
            eng,
            tokenizer,
            prompts,
            steps=d.teacher_warmup_steps,
            batch_size=32,
            seed=cfg.seed + 1,
            chat_template=cfg.data.chat_template,
        )
    eng.model.eval().requires_grad_(False)  # frozen in place (no second copy of a large teacher)
    if d.teacher_placement == "ray":
        return _ray_teacher(tcfg, tokenizer, model=eng.model.cpu())
    return eng


def _ray_teacher(tcfg: DistillConfig, tokenizer: Any, model: Any = None) -> RayTeacher:
    """The teacher in a Ray actor: ``model`` shipped, or ``tcfg.model`` loaded by the actor
    (its path checked here first, for a one-line error)."""
    d, path = tcfg.distill, tcfg.model.path
    if model is None and path not in ("", "tiny") and not Path(path).exists() and not is_hub_id(path):
        raise ValueError(
            f"distill.teacher: model.path: {path} does not exist (give a local HF checkpoint directory or a hub name)"
        )
    rt = build_ray_teacher(
        tcfg,
        model=model,
        tokenizer=tokenizer if model is not None else None,
        chunk_tokens=d.teacher_chunk_tokens,
        cpus=d.teacher_cpus,
        gpus=d.teacher_gpus,
    )
    try:
        _check_vocab(rt.vocab(), tokenizer, path or "the embedded default")
    except BaseException:
        rt.close()
        raise
    return rt


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
            if isinstance(self.teacher, RayTeacher) and self.teacher is not teacher:
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
            batch = pack_generations([g for _, gs, _ in groups for g in gs], self.codec.pad_id)
            if self.roles.offload:  # a colocated rollout sleeps, an offloaded train state returns
                with timer("offload"):
                    self.roles.sleep_rollout()
            if self.cfg.distill.mode == "loss":
                with timer("train"):
                    metrics.update(self.distill_update(batch, timer))
            else:
                metrics.update(self.rl_update(groups, batch, timer))
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

    def rl_update(self, groups: list[Group], batch: PackedBatch, timer: Timer) -> dict[str, float]:
        """``distill.mode=rl``: advantages ``distill_token_rewards(rollout log-probs, teacher)``
        (+ ``task_coef`` x the task advantages), then the learner's PPO update."""
        cfg, mask = self.cfg, batch.response_mask
        with timer("teacher"):
            t_lp = batch_logprobs(
                self.teacher, batch, micro_batch_size=cfg.train.micro_batch_size, **self._sampling()
            ).to(mask.device)
        adv = distill_token_rewards(batch.old_logprobs, t_lp, mask, coef=cfg.distill.coef)
        n_tok = mask.sum().clamp(min=1)
        metrics = {"distill/reverse_kl": float(((batch.old_logprobs - t_lp) * mask).sum() / n_tok)}
        if cfg.distill.task_coef:
            adv = adv + cfg.distill.task_coef * self._task_advantages(groups, mask)
        metrics["advantage/abs_mean"] = float(adv.abs().sum() / n_tok)
        with timer("train"):
            metrics.update(self.learner.update(batch, adv, None, seed=cfg.seed * 7919 + self.global_step))
        return metrics

    def _task_advantages(self, groups: list[Group], mask: torch.Tensor) -> torch.Tensor:
        """``[B, T]`` advantages of the verifier's rewards (``algorithm.advantage``)."""
        a = self.cfg.algorithm
        rewards = torch.tensor([r for _, _, rs in groups for r in rs], dtype=torch.float32)
        group_ids = torch.arange(len(groups)).repeat_interleave(self.cfg.rollout.n)
        avail = {
            "rewards": rewards,
            "group_ids": group_ids,
            "response_mask": mask,
            "response_length": mask.sum(-1),
        }
        adv = ADVANTAGE_ESTIMATORS.entry(a.advantage).call(avail, **a.advantage_kwargs)
        adv = adv[0] if isinstance(adv, tuple) else adv
        return (adv[:, None] if adv.dim() == 1 else adv) * mask

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
