r"""Asynchronous RLVR (ROLL Flash): rollout keeps generating while the trainer trains.

ROLL Flash (Lu et al. 2025, "Part II: ROLL Flash -- Accelerating RLVR and Agentic Training
with Asynchrony", arXiv:2510.11345) decouples the two: the rollout side runs requests one sample
at a time on every engine and puts each finished, scored group into a freshness-bounded buffer;
the trainer takes a batch as soon as one is ready and trains while generation goes on.
:class:`AsyncTrainer` is that loop on rollkit's pieces:

* **Queue scheduling** (the producer thread, :class:`QueueScheduler`): every prompt of
  ``rollout.n`` samples becomes ``n`` single-sample requests (*prompt replication*; with
  ``asynchronous.replicate=false`` a prompt's samples stay on one engine), each sent to the
  least-loaded :class:`~trainers.engines.requests.RequestEngine` (fewest running requests)
  and scored by the :class:`~trainers.rewards.RewardPool` the moment it finishes. A group
  whose ``n`` scores are in goes into the :class:`rollkit.buffer.SampleBuffer`, or, with
  dynamic filtering (``filter.zero_variance``), is dropped when its rewards do not vary, and
  its slot starts a new prompt at once: generation stops as soon as enough groups pass.
* **Freshness** (``asynchronous.ratio`` :math:`\alpha`): at trainer version :math:`n` every
  trained sample was started by a policy at most :math:`\lceil\alpha\rceil` versions old
  (fractional :math:`\alpha` as in :class:`~rollkit.buffer.SampleBuffer`); at most
  :math:`\lceil(1+\alpha)B\rceil` + ``asynchronous.extra_prompts`` prompts are in flight
  (*over-provisioning*: extra running prompts hide the long tail). Requests that can no
  longer be trained are aborted as soon as the batch that makes them too old is drawn.
* **Weight update protocol**: suspend (the producer parks between engine steps; no new
  requests start) -> the in-flight requests are stopped -> the new weights go to every
  engine (version :math:`n+1`) -> resume. ``asynchronous.in_flight="keep"``: a stopped
  request keeps its tokens and per-token behaviour log-probs and is resubmitted first,
  continuing under the new weights (it keeps the version that *started* it);
  ``"abort"``: its tokens are discarded and it starts again from its prompt.
* **Off-policy correction**: with ``asynchronous.recompute_logprobs`` (default) a batch with
  tokens sampled by an older policy has its log-probs recomputed under the trainer's current
  weights before the update (the *proximal* policy, ``old_logprobs``) and the rollout's become
  ``behavior_logprobs`` (an on-policy batch keeps the rollout's, as in the synchronous
  trainer); pick a policy loss that uses both by name (``algorithm.policy_loss=decoupled-ppo``
  or ``tis``; docs/losses.md): with ``ppo`` the stale samples get no importance correction
  (a warning says so; measured in docs/async.md). Otherwise the rollout's log-probs are
  ``old_logprobs``.

``asynchronous.ratio=0`` is synchronous training: the buffer holds only the current version's
requests, so the trainer trains on exactly the samples the synchronous trainer's request path
(:meth:`~trainers.sync_trainer.SyncTrainer.step` with per-request generation) would (tested).

Metrics per step (besides the synchronous trainer's): ``staleness/*`` (histogram of
:math:`n - v` over the batch's groups), ``async/stale_token_frac`` (tokens sampled by an
older policy than the trainer's), ``async/resumed_samples``, ``buffer/*`` (the buffer's
counts: produced, consumed, dropped_stale, aborted), ``async/filtered``,
``time/wait`` (the trainer waiting for a batch), ``time/train``, ``time/weight_sync``.

Where the roles run: by default all in this process (the producer is a thread; engines,
trainer and reward pool share the process's cores). With ``ray.enabled=true`` and
``placement.mode=disaggregated`` rollout and training are separate processes on resources of
their own: the engines are the ``placement.rollout_workers`` rollout actors (each driven
through a :class:`~trainers.ray.RayRequestEngine`; the producer thread only dispatches, steps
every actor at once and scores), the trainer is the Ray train group (data-parallel ranks, which
also recompute the proximal log-probs), and the weights go to every actor from one
object-store copy. docs/async.md has the knobs and the measured tables.
"""

from __future__ import annotations

import copy
import math
import threading
import time
import warnings
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rollkit.buffer import SampleBuffer, staleness_metrics
from rollkit.registry import POLICY_LOSSES
from trainers.config import Config
from trainers.data import Prompt
from trainers.engines.base import PackedBatch, batch_logprobs
from trainers.engines.requests import Request, RequestEngine, as_request_engine
from trainers.sync_trainer import SyncTrainer, _Timer

__all__ = ["AsyncTrainer", "QueueScheduler"]


@dataclass
class _Group:
    """The ``n`` samples of one prompt, from admission until the buffer holds them."""

    rid: int  # the buffer's request id
    prompt: Prompt
    requests: list[Request]  # their start_version is the version that started the group
    scores: dict[int, float] = field(default_factory=dict)
    finished: dict[int, Request] = field(default_factory=dict)


def _is_object_ref(x: Any) -> bool:
    return type(x).__name__ == "ObjectRef"


def _least_loaded(engines: Sequence[RequestEngine], extra: Sequence[int] | None = None) -> int:
    loads = [e.num_running + (extra[i] if extra else 0) for i, e in enumerate(engines)]
    return loads.index(min(loads))


class QueueScheduler:
    """The rollout side of :class:`AsyncTrainer`: a thread that keeps the engines busy.

    Args:
        trainer: the :class:`AsyncTrainer` (prompts, seeds, length budgets, reward pool).
        engines: the request engines; a request goes to the one with the fewest running.
        buffer: the :class:`~rollkit.buffer.SampleBuffer` (its ``free_slots`` bound what starts).

    All engine calls happen on the producer thread, except while it is parked
    (:meth:`pause`), when the trainer thread may stop requests and update weights.
    """

    def __init__(self, trainer: AsyncTrainer, engines: Sequence[RequestEngine], buffer: SampleBuffer) -> None:
        self.tr, self.engines, self.buffer = trainer, list(engines), buffer
        self.cond = threading.Condition()
        self.groups: dict[int, _Group] = {}
        self.resubmit: list[Request] = []  # stopped at a weight update, to continue first
        self._to_abort: list[int] = []
        self._pause = self._parked = self._stop = False
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._admit_at = (-1, 0)  # (version, groups admitted at it): the seed index of the next group
        self.counts = dict.fromkeys(("filtered", "resubmitted", "restarted", "generated_tokens"), 0)

    # ------------------------------------------------------------------ control (trainer thread)

    def start(self) -> None:
        if self._thread is None:
            self._stop = False
            self._thread = threading.Thread(target=self._run, name="rollkit-rollout", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        with self.cond:
            self._stop = True
            self.cond.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def check(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"the rollout thread failed: {self._error!r}") from self._error

    def pause(self) -> None:
        """Suspend: return once the producer is parked between engine steps (or not running)."""
        with self.cond:
            self._pause = True
            self.cond.notify_all()
            while self._thread is not None and not self._parked and self._error is None:
                self.cond.wait(0.5)
        self.check()

    def resume(self) -> None:
        with self.cond:
            self._pause = False
            self.cond.notify_all()

    def abort_groups(self, rids: Sequence[int]) -> None:
        """Ask the producer to stop the requests of these groups (already settled in the buffer)."""
        if rids:
            with self.cond:
                self._to_abort += list(rids)
                self.cond.notify_all()

    def stop_in_flight(self, keep: bool) -> int:
        """(Paused.) Stop every running request. ``keep``: queue it to continue after the update;
        else discard its tokens and queue it to start again. Returns how many were stopped."""
        stopped = [r for e in self.engines for r in e.abort()]
        for r in stopped:
            if not keep:
                r.token_ids, r.logprobs, r.token_versions = [], [], []
                self.counts["restarted"] += 1
        self.resubmit = stopped + self.resubmit
        return len(stopped)

    # ------------------------------------------------------------------ the producer

    def _run(self) -> None:
        try:
            while True:
                with self.cond:
                    if self._stop:
                        return
                    if self._pause:
                        self._parked = True
                        self.cond.notify_all()
                        while self._pause and not self._stop:
                            self.cond.wait()
                        self._parked = False
                        continue
                    aborts, self._to_abort = self._to_abort, []
                if aborts:
                    self._drop(aborts)
                busy = self._admit()
                running = [e for e in self.engines if e.num_running]
                for e in running:  # remote engines (Ray actors) step at the same time
                    if hasattr(e, "start_step"):
                        e.start_step()
                for e in running:
                    busy = True
                    for r in e.step():
                        self._finished(r)
                busy |= self._collect_scores()
                if not busy:
                    with self.cond:
                        if not (self._stop or self._pause or self._to_abort):
                            self.cond.wait(0.002)
        except BaseException as e:  # surfaced to the trainer by check()
            self._error = e
            with self.cond:
                self.cond.notify_all()

    def _drop(self, rids: Sequence[int]) -> None:
        drop = set(rids)
        ids = [r.request_id for rid in drop if rid in self.groups for r in self.groups[rid].requests]
        for e in self.engines:
            e.abort(ids)
        self.resubmit = [r for r in self.resubmit if r.tag[0] not in drop]
        for rid in drop:
            self.groups.pop(rid, None)

    def _dispatch(self, reqs: Sequence[Request], *, together: bool) -> None:
        if together:  # a prompt's samples on one engine
            self.engines[_least_loaded(self.engines)].add(list(reqs))
            return
        pending = [0] * len(self.engines)
        per_engine: dict[int, list[Request]] = defaultdict(list)
        for r in reqs:
            k = _least_loaded(self.engines, pending)
            pending[k] += 1
            per_engine[k].append(r)
        for k, rs in per_engine.items():
            self.engines[k].add(rs)

    def _admit(self) -> bool:
        """Resubmit stopped requests first, then start new prompts in the free slots."""
        started = False
        if self.resubmit:
            reqs, self.resubmit = self.resubmit, []
            self.counts["resubmitted"] += sum(1 for r in reqs if r.token_ids)
            self._dispatch(reqs, together=False)
            started = True
        with self.cond:
            k = self.buffer.free_slots
            rids = self.buffer.reserve(k) if k else []
            version = self.buffer.version
        for rid in rids:
            index = self._admit_at[1] if self._admit_at[0] == version else 0
            self._admit_at = (version, index + 1)
            g = self.tr._new_group(rid, version, index)
            self.groups[rid] = g
            self._dispatch(g.requests, together=not self.tr.cfg.asynchronous.replicate)
            started = True
        return started

    def _finished(self, r: Request) -> None:
        rid, j = r.tag
        g = self.groups.get(rid)
        if g is None:
            return
        g.finished[j] = r
        self.counts["generated_tokens"] += len(r.token_ids)
        self.tr.rewards.submit((rid, j), self.tr.decode(r.token_ids), g.prompt)

    def _collect_scores(self, scored: dict | None = None) -> bool:
        """Apply the scores that arrived (``RewardPool.poll()``, or ``scored`` when given)."""
        scored = self.tr.rewards.poll() if scored is None else scored
        for (rid, j), s in scored.items():
            g = self.groups.get(rid)
            if g is None:
                continue
            g.scores[j] = s
            if len(g.scores) == len(g.requests):
                self._settle(g)
        return bool(scored)

    def _settle(self, g: _Group) -> None:
        del self.groups[g.rid]
        rewards = [g.scores[j] for j in range(len(g.requests))]
        with self.cond:
            if not self.buffer.is_running(g.rid):
                return  # expired meanwhile
            if self.tr.cfg.filter.zero_variance and len(rewards) > 1 and max(rewards) == min(rewards):
                self.buffer.abort(g.rid)
                self.counts["filtered"] += 1
            else:
                self.buffer.put(
                    g.rid, [(g.prompt, g.finished[j], rewards[j]) for j in range(len(g.requests))]
                )
            self.cond.notify_all()


class AsyncTrainer(SyncTrainer):
    """Asynchronous RLVR: :class:`~trainers.sync_trainer.SyncTrainer`'s training step fed by a
    :class:`QueueScheduler` thread through a :class:`~rollkit.buffer.SampleBuffer` (module
    docstring).

    Args:
        cfg: the configuration (``asynchronous.*`` for the knobs).
        engines: rollout engines for the scheduler (batch engines, viewed through
            :func:`~trainers.engines.requests.as_request_engine`); default: the trainer's
            rollout engine, plus ``asynchronous.num_engines - 1`` copies of it (transformers
            engine only). Every engine must start with the trainer's weights.
        **kwargs: as for :class:`~trainers.sync_trainer.SyncTrainer`.

    ``fit()`` starts the producer, trains ``train.steps`` steps and stops it; :meth:`step`
    starts it too if needed (call :meth:`close` when done).
    """

    def __init__(self, cfg: Config, *, engines: Sequence[Any] | None = None, **kwargs: Any) -> None:
        ac = cfg.asynchronous
        if cfg.ray.enabled and cfg.placement.mode != "disaggregated":
            raise ValueError(
                f"placement.mode={cfg.placement.mode!r}: the asynchronous trainer generates while it "
                "trains, so on Ray the rollout and train actors need resources of their own: set "
                "placement.mode=disaggregated"
            )
        if cfg.ray.enabled and ac.num_engines not in (1, cfg.placement.rollout_workers):
            raise ValueError(
                f"asynchronous.num_engines={ac.num_engines}: on Ray the engines are the "
                f"placement.rollout_workers={cfg.placement.rollout_workers} rollout actors; set that instead"
            )
        if ac.in_flight not in ("keep", "abort"):
            raise ValueError(f"asynchronous.in_flight must be 'keep' or 'abort', got {ac.in_flight!r}")
        if ac.extra_prompts < 0:
            raise ValueError(f"asynchronous.extra_prompts must be >= 0, got {ac.extra_prompts}")
        if ac.num_engines < 1:
            raise ValueError(f"asynchronous.num_engines must be >= 1, got {ac.num_engines}")
        if ac.ratio < 0:
            raise ValueError(f"asynchronous.ratio must be >= 0, got {ac.ratio}")
        super().__init__(cfg, **kwargs)
        loss_inputs = set(POLICY_LOSSES.entry(cfg.algorithm.policy_loss).in_keys.values())
        if ac.ratio > 0 and ac.recompute_logprobs and "behavior_logprobs" not in loss_inputs:
            warnings.warn(
                f"algorithm.policy_loss={cfg.algorithm.policy_loss!r} ignores behavior_logprobs: with "
                f"asynchronous.ratio={ac.ratio:g} stale samples are trained without an importance "
                "correction (measured: held-out accuracy fell where decoupled-ppo kept it; docs/async.md). "
                "Losses that use them: "
                + ", ".join(
                    sorted(
                        k
                        for k in POLICY_LOSSES.names()
                        if "behavior_logprobs" in POLICY_LOSSES.entry(k).in_keys.values()
                    )
                ),
                stacklevel=2,
            )
        P, n = cfg.rollout.prompts_per_step, cfg.rollout.n
        if engines is None and hasattr(self.rollout, "actors"):  # Ray: every rollout actor
            from trainers.ray import RayRequestEngine

            engines = [
                RayRequestEngine(a, chunk_tokens=ac.chunk_tokens, seed=cfg.seed + 1 + k)
                for k, a in enumerate(self.rollout.actors)
            ]
        if engines is None:
            engines = [self.rollout]
            if ac.num_engines > 1:
                if not hasattr(self.rollout, "model"):
                    raise ValueError(
                        "asynchronous.num_engines: copies are made of the transformers engine only; "
                        "pass engines=[...] for other engines"
                    )
                for _ in range(ac.num_engines - 1):
                    e = copy.copy(self.rollout)
                    e.model = copy.deepcopy(self.rollout.model)
                    engines.append(e)
        self.batch_engines = list(engines)
        self.engines = [
            self.request_engine()
            if e is self.rollout
            else as_request_engine(e, chunk_tokens=ac.chunk_tokens, seed=cfg.seed + 1 + k)
            for k, e in enumerate(self.batch_engines)
        ]
        self.buffer = SampleBuffer(
            P,
            async_ratio=ac.ratio,
            group_size=n,
            max_in_flight=math.ceil((1 + ac.ratio) * P) + ac.extra_prompts,
            initial_version=self.global_step,
        )
        self.scheduler = QueueScheduler(self, self.engines, self.buffer)
        self._batch_is_stale = True

    # ------------------------------------------------------------------ the producer's callbacks

    def _new_group(self, rid: int, version: int, index: int) -> _Group:
        """The ``n`` requests of the next prompt, admitted as the ``index``-th at ``version``:
        the seeds and length budgets of the synchronous trainer's request path."""
        (prompt,) = self.iterator.next_batch(1)
        params = self._sampling(0, step=version)
        n, ids = params.n, self.encode(prompt)
        reqs = [
            self._request(f"a{rid}-{j}", ids, params, index * n + j, start_version=version, tag=(rid, j))
            for j in range(n)
        ]
        return _Group(rid, prompt, reqs)

    # ------------------------------------------------------------------ the trainer

    def _prepare_batch(self, batch: PackedBatch, timer: _Timer) -> None:
        """Recompute the proximal log-probs (``asynchronous.recompute_logprobs``) when some
        token of the batch was sampled by an older policy than the trainer's; a batch sampled
        entirely by the current policy keeps the rollout's, as the synchronous trainer does."""
        if not self.cfg.asynchronous.recompute_logprobs or not self._batch_is_stale:
            return
        # in process: the train engine; on Ray: the train group's batch_logprobs
        policy = getattr(self.learner, "engine", self.learner)
        if not hasattr(policy, "logprobs") and not hasattr(policy, "batch_logprobs"):
            raise ValueError(
                "asynchronous.recompute_logprobs: the learner has neither an in-process train engine "
                "nor batch_logprobs; set asynchronous.recompute_logprobs=false"
            )
        with timer("recompute"):
            proximal = batch_logprobs(
                policy,
                batch,
                temperature=self.cfg.rollout.temperature,
                micro_batch_size=self.cfg.train.micro_batch_size,
            )
        batch.behavior_logprobs = batch.old_logprobs
        batch.old_logprobs = proximal * batch.response_mask

    def step(self) -> dict[str, float]:
        """Wait for a batch, train on it, then suspend -> update every engine -> resume."""
        cfg, timer, sch = self.cfg, _Timer(), self.scheduler
        t_start = time.perf_counter()
        sch.start()
        tokens0 = sch.counts["generated_tokens"]
        with timer("wait"):
            with sch.cond:
                while (batch := self.buffer.get_batch()) is None:
                    sch.check()
                    sch.cond.wait(0.5)
                expiring = self.buffer.abort_expiring()
                stats = self.buffer.stats()
            sch.abort_groups(expiring)
        k = cfg.rollout.n
        groups = [
            (
                batch.samples[i][0],
                [s[1] for s in batch.samples[i : i + k]],
                [s[2] for s in batch.samples[i : i + k]],
            )
            for i in range(0, len(batch.samples), k)
        ]
        n = self.global_step
        gens_flat = [r for _, rs, _ in groups for r in rs]
        rewards_flat = [x for _, _, rs in groups for x in rs]
        stale_tokens = sum(sum(1 for v in r.token_versions if v < n) for r in gens_flat)
        self._batch_is_stale = stale_tokens > 0
        all_tokens = sum(len(r.token_ids) for r in gens_flat)
        metrics: dict[str, float] = {
            "reward/mean": sum(rewards_flat) / len(rewards_flat),
            "response/length_mean": all_tokens / len(gens_flat),
            "rollout/kept_groups": len(groups),
            "async/stale_token_frac": stale_tokens / max(all_tokens, 1),
            "async/resumed_samples": sum(1 for r in gens_flat if r.resumed),
            **staleness_metrics(batch.staleness),
            **{f"buffer/{k}": float(v) for k, v in stats.items() if isinstance(v, (int, float))},
            **{f"async/{k}": float(v) for k, v in sch.counts.items()},
        }
        by_src: dict[str, list[float]] = defaultdict(list)
        for p, _, rs in groups:
            by_src[p.data_source] += rs
        metrics.update({f"accuracy/{k}": sum(v) / len(v) for k, v in by_src.items()})
        train_groups = [(p, [r.to_generation(i) for r in rs], rw) for i, (p, rs, rw) in enumerate(groups)]
        self._train_on_groups(train_groups, metrics, timer)
        with timer("weight_sync"):
            weights = self.learner.export_weights()  # Ray: one object-store copy for every actor
            if not _is_object_ref(weights):
                weights = list(weights)
            sch.pause()
            try:
                metrics["async/stopped_in_flight"] = sch.stop_in_flight(
                    keep=cfg.asynchronous.in_flight == "keep"
                )
                for e in self.engines:
                    e.update_weights(weights, version=n + 1)
                with sch.cond:
                    expired = self.buffer.set_version(n + 1)
                sch._drop(expired)  # the producer is parked: safe on this thread
            finally:
                sch.resume()
        self.global_step += 1
        metrics.update({f"time/{k}": v for k, v in timer.t.items()})
        metrics["time/step"] = time.perf_counter() - t_start
        metrics["throughput/rollout_tokens_per_s"] = (sch.counts["generated_tokens"] - tokens0) / max(
            metrics["time/step"], 1e-9
        )
        metrics.update(self._reward_pool_metrics())
        return metrics

    def evaluate(self, prompts: list[Prompt] | None = None) -> dict[str, float]:
        """Greedy held-out accuracy on the first engine, with the producer suspended and its
        running requests stopped (kept, and continued after)."""
        sch = self.scheduler
        running = sch._thread is not None
        if running:
            sch.pause()
        try:
            if running:
                sch.stop_in_flight(keep=True)
                # The evaluation's gather() would take the producer's scores too: settle them first.
                sch._collect_scores(self.rewards.gather())
            return super().evaluate(prompts)
        finally:
            if running:
                sch.resume()

    def fit(self, steps: int | None = None) -> dict[str, Any]:
        try:
            return super().fit(steps)
        finally:
            self.scheduler.stop()

    def state_dict(self) -> dict[str, Any]:
        """The synchronous trainer's state (weights, data and length-sampler positions, RNG),
        read with the producer suspended. The buffer's in-flight requests are not saved: a
        resumed run starts generating afresh at its step (the prompts that were in flight are
        not revisited in that epoch)."""
        sch = self.scheduler
        running = sch._thread is not None
        if running:
            sch.pause()
        try:
            return super().state_dict()
        finally:
            if running:
                sch.resume()

    def load_checkpoint(self, path: Any) -> None:
        if self.scheduler._thread is not None:
            raise RuntimeError("load_checkpoint: stop the trainer (close()) before loading a checkpoint")
        super().load_checkpoint(path)
        for e in self.engines:
            if e is not self._requests:
                e.update_weights(self.learner.export_weights(), version=self.global_step)
        self.buffer = SampleBuffer(
            self.buffer.batch_size,
            async_ratio=self.buffer.async_ratio,
            group_size=self.buffer.group_size,
            max_in_flight=self.buffer.max_in_flight,
            initial_version=self.global_step,
        )
        self.scheduler = QueueScheduler(self, self.engines, self.buffer)

    def close(self) -> None:
        """Stop the producer, abort the requests still running in the engines (so an engine
        passed in can be reused), then the synchronous trainer's :meth:`close`."""
        self.scheduler.stop()
        for e in self.engines:
            e.abort()
        super().close()

    def __enter__(self) -> AsyncTrainer:
        return self
