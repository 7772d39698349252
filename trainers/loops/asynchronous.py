r"""Asynchronous RLVR (ROLL Flash): rollout keeps generating while the trainer trains.

ROLL Flash (Lu et al. 2025, arXiv:2510.11345) decouples the two: a producer thread
(:class:`~trainers.loops.queue.QueueScheduler`) runs single-sample requests on every engine
and puts each finished, scored group into a freshness-bounded
:class:`~rollkit.buffer.SampleBuffer`; the trainer takes a batch as soon as one is ready and
trains while generation goes on. At trainer version :math:`n` every trained sample was started
by a policy at most :math:`\lceil\alpha\rceil` versions old (``asynchronous.ratio``
:math:`\alpha`). ``asynchronous.ratio=0`` trains exactly the synchronous loop's samples. The
knobs, the weight-update protocol, the metrics and measurements are in docs/async.md.
"""

from __future__ import annotations

import copy
import math
import random
import time
import warnings
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from rollkit.buffer import SampleBuffer, staleness_metrics
from rollkit.registry import POLICY_LOSSES
from trainers.config import Config, validate, validate_async
from trainers.data import Prompt
from trainers.engines.requests import RequestEngine, as_request_engine
from trainers.loops.collect import Group
from trainers.loops.common import (
    Timer,
    loop_state,
    memory_metrics,
    read_checkpoint,
    restore_loop_state,
    run_fit,
    write_checkpoint,
)
from trainers.loops.evaluation import held_out_metrics
from trainers.loops.parts import attach, build_parts
from trainers.loops.queue import GroupFactory, QueueScheduler
from trainers.roles import Roles, close_all, on_ray, ray_request_engines

__all__ = ["AsyncTrainer"]


def _is_object_ref(x: Any) -> bool:
    return type(x).__name__ == "ObjectRef"


def _warn_without_correction(cfg: Config) -> None:
    ac = cfg.asynchronous
    uses = sorted(
        k for k in POLICY_LOSSES.names() if "behavior_logprobs" in POLICY_LOSSES.entry(k).in_keys.values()
    )
    corrected = cfg.algorithm.correction.level != "off"
    if ac.ratio > 0 and ac.recompute_logprobs and cfg.algorithm.policy_loss not in uses and not corrected:
        warnings.warn(
            f"algorithm.policy_loss={cfg.algorithm.policy_loss!r} ignores behavior_logprobs: with "
            f"asynchronous.ratio={ac.ratio:g} stale samples are trained without an importance "
            "correction (measured: held-out accuracy fell where decoupled-ppo kept it; docs/async.md). "
            "Set algorithm.correction.level (docs/correction.md) or use a loss that uses them: "
            + ", ".join(uses),
            stacklevel=3,
        )


def request_engines(
    cfg: Config, roles: Roles, engines: Sequence[Any] | None, first: RequestEngine
) -> list[Any]:
    """The request engines the scheduler drives: the Ray rollout actors, the given engines, or
    the rollout engine (``first``, its request-level view) plus ``asynchronous.num_engines - 1``
    copies of it (transformers engine only)."""
    ac, rollout = cfg.asynchronous, roles.rollout
    if engines is None and on_ray(rollout):  # Ray: every rollout actor
        return ray_request_engines(rollout, cfg, cfg.seed + 1)
    if engines is None:
        engines = [rollout]
        if ac.num_engines > 1:
            if not hasattr(rollout, "model"):
                raise ValueError(
                    "asynchronous.num_engines: copies are made of the transformers engine only; "
                    "pass engines=[...] for other engines"
                )
            for _ in range(ac.num_engines - 1):
                e = copy.copy(rollout)
                e.model = copy.deepcopy(rollout.model)
                engines.append(e)
    return [
        first
        if e is rollout
        else as_request_engine(e, chunk_tokens=cfg.rollout.chunk_tokens, seed=cfg.seed + 1 + k)
        for k, e in enumerate(engines)
    ]


class AsyncTrainer:
    """Asynchronous RLVR (module docstring): the queue scheduler feeds the synchronous loop's
    :class:`~trainers.loops.update.GroupUpdate` through a :class:`~rollkit.buffer.SampleBuffer`.

    Args:
        cfg: the configuration (``asynchronous.*`` for the knobs).
        engines: rollout engines for the scheduler (batch engines, viewed through
            :func:`~trainers.engines.requests.as_request_engine`); default: the rollout role, plus
            ``asynchronous.num_engines - 1`` copies of it (transformers engine only), or every Ray
            rollout actor. Every engine must start with the trainer's weights.
        rollout, train, tokenizer, model, reward_fn, reference, train_prompts, eval_prompts: as
            for :class:`~trainers.loops.sync.SyncTrainer`.

    ``fit()`` starts the producer, trains ``train.steps`` steps and stops it; :meth:`step`
    starts it too if needed (call :meth:`close` when done).
    """

    def __init__(
        self,
        cfg: Config,
        *,
        engines: Sequence[Any] | None = None,
        rollout: Any = None,
        train: Any = None,
        tokenizer: Any = None,
        model: Any = None,
        train_prompts: list[Prompt] | None = None,
        eval_prompts: list[Prompt] | None = None,
        reward_fn: Any = None,
        reference: Any = None,
    ) -> None:
        validate(cfg)
        validate_async(cfg)
        self.cfg = cfg
        attach(
            self,
            build_parts(
                cfg,
                train_prompts=train_prompts,
                eval_prompts=eval_prompts,
                rollout=rollout,
                train=train,
                tokenizer=tokenizer,
                model=model,
                reward_fn=reward_fn,
                reference=reference,
            ),
        )
        _warn_without_correction(cfg)
        self.global_step = 0
        # the rollout role's request-level view (its weights follow the rollout role's)
        self._own_view = (
            None
            if on_ray(self.rollout)
            else as_request_engine(self.rollout, chunk_tokens=cfg.rollout.chunk_tokens, seed=cfg.seed)
        )
        self.engines = request_engines(cfg, self.roles, engines, self._own_view)
        self._new_scheduler()
        torch.manual_seed(cfg.seed)
        random.seed(cfg.seed)

    def _new_scheduler(self) -> None:
        cfg, P = self.cfg, self.cfg.rollout.prompts_per_step
        ac = cfg.asynchronous
        self.buffer = SampleBuffer(
            P,
            async_ratio=ac.ratio,
            group_size=cfg.rollout.n,
            max_in_flight=math.ceil((1 + ac.ratio) * P) + ac.extra_prompts,
            initial_version=self.global_step,
        )
        self.scheduler = QueueScheduler(
            self.engines,
            self.buffer,
            GroupFactory(cfg, self.iterator, self.maker, self.codec),
            self.rewards,
            self.codec.decode,
            zero_variance=cfg.filter.zero_variance,
            accuracy_band=(
                (cfg.filter.accuracy_low, cfg.filter.accuracy_high) if cfg.filter.accuracy_band else None
            ),
            replicate=ac.replicate,
        )

    def step(self) -> dict[str, float]:
        """Wait for a batch, train on it, then suspend -> update every engine -> resume."""
        cfg, timer, sch, n = self.cfg, Timer(), self.scheduler, self.global_step
        ac = cfg.asynchronous
        t_start, tokens0 = time.perf_counter(), sch.counts["generated_tokens"]
        with timer("wait"):  # the producer generates meanwhile (deterministic: in this thread)
            batch, _, stats = sch.run_until_batch() if ac.deterministic else sch.wait_batch()
        if ac.deterministic:
            sch.start_overlap(ac.overlap_steps)  # a fixed amount of generation while training
        k = cfg.rollout.n
        groups = [
            (
                batch.samples[i][0],
                [s[1] for s in batch.samples[i : i + k]],
                [s[2] for s in batch.samples[i : i + k]],
            )
            for i in range(0, len(batch.samples), k)
        ]
        metrics = self._batch_metrics(groups, batch, stats)
        train_groups: list[Group] = [
            (p, [r.to_generation(i) for r in rs], rw) for i, (p, rs, rw) in enumerate(groups)
        ]
        stale = metrics["async/stale_token_frac"] > 0
        metrics.update(
            self.update(train_groups, n, timer, recompute=stale and cfg.asynchronous.recompute_logprobs)
        )
        with timer("weight_sync"):
            weights = self.learner.export_weights()  # Ray: one object-store copy for every actor
            # several engines read the same weights: a list; one engine takes the stream as it is
            # (rollout.weight_sync buckets / delta then hold one bucket, not the model)
            weights = weights if _is_object_ref(weights) or len(sch.engines) == 1 else list(weights)
            sch.finish_overlap()
            keep = ac.in_flight == "keep"
            metrics["async/stopped_in_flight"] = sch.update_weights(weights, n + 1, keep=keep)
        self.global_step += 1
        metrics.update(timer.metrics(t_start))
        generated = sch.counts["generated_tokens"] - tokens0
        metrics["throughput/rollout_tokens_per_s"] = generated / max(metrics["time/step"], 1e-9)
        metrics.update(self.roles.reward_metrics())
        metrics.update(self.roles.rollout_metrics())
        metrics.update(memory_metrics())
        return metrics

    def _batch_metrics(self, groups: list[tuple], batch: Any, stats: dict[str, Any]) -> dict[str, float]:
        n = self.global_step
        gens = [r for _, rs, _ in groups for r in rs]
        rewards = [x for _, _, rs in groups for x in rs]
        stale_tokens = sum(sum(1 for v in r.token_versions if v < n) for r in gens)
        all_tokens = sum(len(r.token_ids) for r in gens)
        metrics: dict[str, float] = {
            "reward/mean": sum(rewards) / len(rewards),
            "response/length_mean": all_tokens / len(gens),
            "rollout/kept_groups": len(groups),
            "async/stale_token_frac": stale_tokens / max(all_tokens, 1),
            "async/resumed_samples": sum(1 for r in gens if r.resumed),
            **staleness_metrics(batch.staleness),
            **{f"buffer/{k}": float(v) for k, v in stats.items() if isinstance(v, (int, float))},
            **{f"async/{k}": float(v) for k, v in self.scheduler.counts.items()},
        }
        by_src: dict[str, list[float]] = defaultdict(list)
        for p, _, rs in groups:
            by_src[p.data_source] += rs
        metrics.update({f"accuracy/{k}": sum(v) / len(v) for k, v in by_src.items()})
        return metrics

    def evaluate(self, prompts: list[Prompt] | None = None) -> dict[str, float]:
        """Greedy held-out accuracy on the rollout role, with the producer suspended and its
        running requests stopped (kept, and continued after)."""
        sch, running = self.scheduler, self.scheduler.running
        if running:
            sch.pause()
        try:
            if running:
                sch.stop_in_flight(keep=True)
                sch.settle_pending()  # the evaluation gathers the reward pool: settle the producer's first
            prompts = self.eval_prompts if prompts is None else prompts
            return held_out_metrics(
                self.roles, self.codec, prompts, self.cfg, progress=self.cfg.logging.progress
            )
        finally:
            if running:
                sch.resume()

    def fit(self, steps: int | None = None) -> dict[str, Any]:
        try:
            return run_fit(self, steps)
        finally:
            self.scheduler.stop()

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """:func:`~trainers.loops.common.loop_state`, the sample buffer, and the scheduler's groups in
        flight (finished samples with their scores, and the requests stopped mid-way, which continue
        after a resume), read with the producer suspended. The scheduler stops the running requests
        to save them (they continue with their tokens, as at a weight update)."""
        sch, running = self.scheduler, self.scheduler.running
        if running:
            sch.pause()
        try:
            sch.finish_overlap()
            sch.stop_in_flight(keep=True)
            sch.settle_pending()
            return {**loop_state(self), "buffer": self.buffer.state_dict(), "scheduler": sch.state_dict()}
        finally:
            if running:
                sch.resume()

    def save_model(self, path: str | Path) -> Path:
        """The trained policy and tokenizer as a Hugging Face model directory at ``path``."""
        return self.learner.save_model(path, self.tok)

    def save_checkpoint(self, directory: str | Path | None = None) -> Path:
        ck = self.cfg.checkpoint
        return write_checkpoint(
            self.state_dict(), directory or ck.dir, self.global_step, keep=ck.keep, resume=ck.resume
        )

    def load_checkpoint(self, path: str | Path) -> None:
        if self.scheduler.running:
            raise RuntimeError("load_checkpoint: stop the trainer (close()) before loading a checkpoint")
        state = read_checkpoint(path, self.cfg.checkpoint.dir)
        restore_loop_state(self, state)
        self.rollout.update_weights(self.learner.export_weights(), version=self.global_step)
        for e in self.engines:
            if e is not self._own_view:
                e.update_weights(self.learner.export_weights(), version=self.global_step)
        self._new_scheduler()
        if state.get("buffer") is not None:  # else: a fresh buffer at this version
            self.buffer.load_state_dict(state["buffer"])
            self.scheduler.load_state_dict(state["scheduler"])

    def close(self) -> None:
        """Stop the producer, abort the requests still running in the engines (so an engine passed
        in can be reused), then stop the roles started here."""

        def abort() -> None:
            failed = self.scheduler.abort_all()
            if failed:
                raise failed[0]

        close_all([self.scheduler.stop, abort, self.roles.close])

    def __enter__(self) -> AsyncTrainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
