"""Simulated training runs: the real schedulers on simulated engines, with invariants checked.

* :func:`run_queue` (sync is ``ratio=0``): rollkit's :class:`~trainers.loops.queue.QueueScheduler`
  (prompt replication, least-loaded dispatch, extra prompts) feeding a
  :class:`~rollkit.buffer.SampleBuffer` with the async ratio; the trainer takes a batch, trains
  while the producer goes on, then ``QueueScheduler.update_weights`` (suspend, stop in-flight
  requests keeping their tokens, update, resume) pauses every engine for the sync time.
* :func:`run_sync`: the synchronous trainer's own
  :class:`~trainers.loops.collect.GroupCollector` on one simulated engine; train and sync follow
  each step.
* :func:`run_tail`: rollkit's :class:`~trainers.loops.collect.TailCollector` (RollPacker's tail
  batching, :class:`~rollkit.scheduling.TailBatchingPolicy` and :class:`~rollkit.scheduling.EpochSampler`)
  on one simulated engine of ``engines`` instances; train and sync follow each round.

A step's time is wait (or rollout) + train + weight sync on the virtual clock. Every run checks
the invariants of :func:`check_invariants` (a failure raises ``AssertionError``).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any

from benchmarks.sim.clock import VirtualClock
from benchmarks.sim.costs import CostModel
from benchmarks.sim.engine import INF, SimCodec, SimEngine, SimRewards, make_prompts
from benchmarks.sim.lengths import Lengths
from rollkit.buffer import SampleBuffer
from trainers.config import Config
from trainers.data import PromptIterator
from trainers.loops.collect import GroupCollector, RequestMaker, TailCollector
from trainers.loops.common import Timer
from trainers.loops.queue import GroupFactory, QueueScheduler

__all__ = ["Result", "Setting", "StepRecord", "check_invariants", "run_queue", "run_sync", "run_tail"]


@dataclass
class Setting:
    """What is simulated: ``prompts`` x ``n`` samples trained per step, ``engines`` rollout
    engines, ``lengths`` of the responses (``w1``: a ``lognormal:MEDIAN:SIGMA`` spec given to
    the trainers' own per-request budgets, ``ignore_eos``, instead), prompt length, costs."""

    prompts: int
    n: int
    lengths: Lengths
    cost: CostModel
    engines: int = 1
    prompt_len: int = 128
    steps: int = 10
    seed: int = 0
    w1: str = ""
    num_prompts: int = 0  # the data set (0: enough for every step, never repeated)
    zero_variance: bool = False
    tick: float = 0.0  # the least simulated seconds between two producer steps (0: exact)

    def config(self) -> Config:
        cfg = Config()
        cfg.seed = self.seed
        r = cfg.rollout
        r.prompts_per_step, r.n, r.max_tokens, r.length_dist = self.prompts, self.n, self.lengths.cap, self.w1
        cfg.filter.zero_variance = self.zero_variance
        return cfg


@dataclass
class StepRecord:
    start: float
    wait: float
    train: float
    sync: float
    trained_tokens: int  # response tokens of the trained samples
    samples: int
    staleness: dict[int, int] = field(default_factory=dict)

    @property
    def time(self) -> float:
        return self.wait + self.train + self.sync


@dataclass
class Result:
    mode: str
    steps: list[StepRecord]
    counts: dict[str, Any]
    generated_tokens: int

    @property
    def measured(self) -> list[StepRecord]:
        """The steps after the first (the pipeline's fill), or all of them when fewer than 3."""
        return self.steps[1:] if len(self.steps) > 2 else self.steps

    @property
    def s_per_step(self) -> float:
        return statistics.fmean(s.time for s in self.measured)

    @property
    def median_step(self) -> float:
        return statistics.median(s.time for s in self.measured)

    @property
    def tokens_per_s(self) -> float:
        """Trained response tokens per second over the measured steps (the fair headline)."""
        m = self.measured
        return sum(s.trained_tokens for s in m) / max(sum(s.time for s in m), 1e-12)

    @property
    def mean_length(self) -> float:
        return sum(s.trained_tokens for s in self.steps) / max(sum(s.samples for s in self.steps), 1)


def _n_prompts(s: Setting, extra: float) -> int:
    return s.num_prompts or math.ceil(s.prompts * (s.steps + 2) * extra + 64)


def check_invariants(
    buffer: SampleBuffer, sch: QueueScheduler, engines: list[SimEngine], ratio: float
) -> None:
    """The buffer's conservation laws, the staleness bound of the last batch, and no request lost:
    every request of a group in flight is finished, running in an engine or queued to resume."""
    st = buffer.stats()
    assert st["produced"] == st["consumed"] + st["dropped_stale"] + st["held"], st
    assert st["reserved"] == st["produced"] + st["aborted"] + st["running"], st
    assert max(st["staleness"], default=0) <= math.ceil(ratio), st["staleness"]
    running = set().union(*(e.where for e in engines))
    queued = {r.request_id for r in sch.resubmit}
    for g in sch.groups.values():
        for j, r in enumerate(g.requests):
            ok = j in g.finished or r.request_id in running or r.request_id in queued
            assert ok, f"request {r.request_id} of group {g.rid} was lost"
    assert sum(e.num_running for e in engines) == len(running)


def _next_event(engines: list[SimEngine], rewards: SimRewards) -> float:
    return min(min((e.next_event() for e in engines if e.num_running), default=INF), rewards.next_event())


def _produce_until(
    sch: QueueScheduler, clock: VirtualClock, engines, rewards, until: float, tick: float
) -> None:
    """Producer steps at every event until ``until`` (the trainer's next action)."""
    while True:
        sch.producer_step()
        if clock.now >= until:
            return
        t = _next_event(engines, rewards)
        clock.advance_to(min(until, max(t, clock.now + tick)))


def _wait_batch(sch, buffer, clock, engines, rewards, tick: float) -> Any:
    while True:
        batch = buffer.get_batch()
        if batch is not None:
            return batch
        progressed = sch.producer_step()
        if buffer.num_ready() >= buffer.batch_size:
            continue
        t = _next_event(engines, rewards)
        if t == INF and not progressed and not sch.resubmit:
            raise RuntimeError(f"simulation: nothing runs and no batch can be formed ({buffer.stats()})")
        if t < INF:
            clock.advance_to(max(t, clock.now + tick))


def run_queue(
    s: Setting,
    *,
    ratio: float = 0.0,
    replicate: bool = True,
    extra: int = 0,
    keep: bool = True,
    check_every: int = 1,
) -> Result:
    """Sync (``ratio=0``) or async training through the real queue scheduler (module docstring)."""
    clock = VirtualClock()
    cfg = s.config()
    prompts = make_prompts(_n_prompts(s, 1.0 + math.ceil(ratio) + extra / s.prompts))
    engines = [
        SimEngine(clock, s.cost.decode, s.lengths, sync_s=s.cost.train.sync_s) for _ in range(s.engines)
    ]
    buffer = SampleBuffer(
        s.prompts, async_ratio=ratio, group_size=s.n, max_in_flight=math.ceil((1 + ratio) * s.prompts) + extra
    )
    codec = SimCodec(s.prompt_len)
    rewards = SimRewards(clock, s.cost.reward, s.cost.reward_workers, seed=s.seed)
    factory = GroupFactory(cfg, PromptIterator(prompts, seed=s.seed), RequestMaker(cfg), codec)
    sch = QueueScheduler(
        engines, buffer, factory, rewards, codec.decode, zero_variance=s.zero_variance, replicate=replicate
    )
    steps: list[StepRecord] = []
    trained: set[int] = set()
    for n in range(s.steps):
        t0 = clock.now
        batch = _wait_batch(sch, buffer, clock, engines, rewards, s.tick)
        assert not trained.intersection(batch.request_ids), "a request was trained twice"
        trained.update(batch.request_ids)
        assert max(batch.staleness, default=0) <= math.ceil(ratio)
        sch.drop(buffer.abort_expiring())
        tokens = sum(len(r.token_ids) for _, r, _ in batch.samples)
        t1 = clock.now
        resp = [len(r.token_ids) for _, r, _ in batch.samples]
        train_s = s.cost.train.batch_time(
            resp, prompt_len=s.prompt_len, groups=[i // s.n for i in range(len(resp))]
        )
        _produce_until(sch, clock, engines, rewards, t1 + train_s, s.tick)
        t2 = clock.now
        sch.update_weights(None, n + 1, keep=keep)
        _produce_until(sch, clock, engines, rewards, t2 + s.cost.train.sync_s, s.tick)
        steps.append(
            StepRecord(t0, t1 - t0, t2 - t1, clock.now - t2, tokens, len(batch.samples), batch.staleness)
        )
        if check_every and n % check_every == 0:
            check_invariants(buffer, sch, engines, ratio)
    check_invariants(buffer, sch, engines, ratio)
    counts = {**buffer.stats(), **sch.counts}
    mode = "sync" if ratio == 0 else f"async {ratio:g}"
    return Result(mode, steps, counts, sum(e.counts["generated_tokens"] for e in engines))


def run_sync(s: Setting) -> Result:
    """Synchronous training through the real :class:`~trainers.loops.collect.GroupCollector` (the
    synchronous trainer's collector): each step draws ``prompts`` prompts, generates ``n`` samples
    of each on one simulated engine of ``engines`` instances (per-request length budgets with
    ``w1``, else the batch engines' streaming generate), scores them, then trains and syncs.
    Checks that every step trains ``prompts x n`` samples of prompts never trained before."""
    clock = VirtualClock()
    cfg = s.config()
    prompts = make_prompts(_n_prompts(s, 1.0))
    engine = SimEngine(
        clock, s.cost.decode, s.lengths, instances=s.engines, sync_s=s.cost.train.sync_s, driven=False
    )
    rewards = SimRewards(clock, s.cost.reward, s.cost.reward_workers, seed=s.seed)
    maker = RequestMaker(cfg)
    col = GroupCollector(
        cfg, engine, rewards, SimCodec(s.prompt_len), PromptIterator(prompts, seed=s.seed), maker
    )
    steps: list[StepRecord] = []
    seen: set[Any] = set()
    for n in range(s.steps):
        t0 = clock.now
        groups, _, _ = col.collect(n, Timer())
        keys = [p.text for p, _, _ in groups]
        assert len(groups) == s.prompts and all(len(g) == s.n for _, g, _ in groups), "a step lost samples"
        assert not seen.intersection(keys) and len(set(keys)) == len(keys), "a prompt was trained twice"
        seen.update(keys)
        resp = [len(g.token_ids) for _, gens, _ in groups for g in gens]
        ids = [k for k, (_, gens, _) in enumerate(groups) for _ in gens]
        t1 = clock.now
        clock.advance_to(t1 + s.cost.train.batch_time(resp, prompt_len=s.prompt_len, groups=ids))
        t2 = clock.now
        engine.update_weights(None, n + 1)
        clock.advance_to(t2 + s.cost.train.sync_s)
        steps.append(StepRecord(t0, t1 - t0, t2 - t1, clock.now - t2, sum(resp), len(resp), {0: len(groups)}))
    counts = {"trained_prompts": len(seen), "per_request": maker.per_request}
    return Result("sync (collector)", steps, counts, engine.counts["generated_tokens"])


def run_tail(s: Setting, *, eta_prompts: float = 1.25, eta_responses: float = 1.25) -> Result:
    """RollPacker's tail batching through the real :class:`TailCollector` (module docstring)."""
    clock = VirtualClock()
    cfg = s.config()
    cfg.tail_batching.enabled = True
    cfg.tail_batching.eta_prompts, cfg.tail_batching.eta_responses = eta_prompts, eta_responses
    prompts = make_prompts(_n_prompts(s, eta_prompts))
    engine = SimEngine(
        clock, s.cost.decode, s.lengths, instances=s.engines, sync_s=s.cost.train.sync_s, driven=False
    )
    rewards = SimRewards(clock, s.cost.reward, s.cost.reward_workers, seed=s.seed)
    col = TailCollector(cfg, engine, rewards, SimCodec(s.prompt_len), prompts, RequestMaker(cfg))
    steps: list[StepRecord] = []
    seen: list[Any] = []
    for n in range(s.steps):
        t0 = clock.now
        groups, _, _ = col.collect(n, Timer())
        seen += list(col.last_batch.prompt_ids)
        tokens = sum(len(g.token_ids) for _, gens, _ in groups for g in gens)
        samples = sum(len(gens) for _, gens, _ in groups)
        t1 = clock.now
        resp = [len(g.token_ids) for _, gens, _ in groups for g in gens]
        ids = [k for k, (_, gens, _) in enumerate(groups) for _ in gens]
        clock.advance_to(t1 + s.cost.train.batch_time(resp, prompt_len=s.prompt_len, groups=ids))
        t2 = clock.now
        engine.update_weights(None, n + 1)
        clock.advance_to(t2 + s.cost.train.sync_s)
        steps.append(StepRecord(t0, t1 - t0, t2 - t1, clock.now - t2, tokens, samples))
    assert len(seen) == len(set(seen)), "a prompt was trained twice"
    c = col.policy.counts
    held = len(col.policy.queue) + len(col.policy.state_dict()["replay"])
    assert c["drawn"] == c["trained"] + c["dropped"] + held, c
    return Result("tail batching", steps, dict(c), engine.counts["generated_tokens"])
