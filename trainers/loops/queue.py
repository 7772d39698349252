"""Queue scheduling (ROLL Flash): the rollout side of the asynchronous loop, a producer thread.

Every prompt of ``rollout.n`` samples becomes ``n`` single-sample requests (*prompt
replication*), each sent to the least-loaded :class:`~trainers.engines.requests.RequestEngine`
and scored by the reward pool the moment it finishes; a group whose ``n`` scores are in goes
into the :class:`rollkit.buffer.SampleBuffer` (or, with dynamic filtering, is dropped when its
rewards do not vary, and its slot starts a new prompt). :meth:`QueueScheduler.update_weights`
is the suspend -> stop in-flight -> update -> resume protocol. docs/async.md.
"""

from __future__ import annotations

import heapq
import threading
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from rollkit.buffer import SampleBuffer
from rollkit.registry import FILTERS
from trainers.config import Config
from trainers.data import Prompt, PromptIterator
from trainers.engines.requests import Request, RequestEngine
from trainers.loops.collect import RequestMaker, sampling_params
from trainers.loops.common import Codec
from trainers.rewards import RewardPool

__all__ = ["GroupFactory", "QueueScheduler", "ScheduledGroup"]


@dataclass
class ScheduledGroup:
    """The ``n`` samples of one prompt, from admission until the buffer holds them."""

    rid: int  # the buffer's request id
    prompt: Prompt
    requests: list[Request]  # their start_version is the version that started the group
    scores: dict[int, float] = field(default_factory=dict)
    finished: dict[int, Request] = field(default_factory=dict)


class GroupFactory:
    """The ``n`` requests of the next prompt, with the seeds and length budgets of the synchronous
    loop's per-request path (so ``asynchronous.ratio=0`` trains exactly the synchronous samples)."""

    def __init__(self, cfg: Config, iterator: PromptIterator, maker: RequestMaker, codec: Codec) -> None:
        self.cfg, self.iterator, self.maker, self.codec = cfg, iterator, maker, codec

    def __call__(self, rid: int, version: int, index: int) -> ScheduledGroup:
        """The group admitted as the ``index``-th at ``version`` under buffer id ``rid``."""
        (prompt,) = self.iterator.next_batch(1)
        params = sampling_params(self.cfg, 0, version)
        n, ids = params.n, self.codec.encode(prompt)
        reqs = [
            self.maker.request(f"a{rid}-{j}", ids, params, index * n + j, start_version=version, tag=(rid, j))
            for j in range(n)
        ]
        return ScheduledGroup(rid, prompt, reqs)


def _least_loaded(engines: Sequence[RequestEngine]) -> int:
    loads = [e.num_running for e in engines]
    return loads.index(min(loads))


class QueueScheduler:
    """Keeps the engines busy from a producer thread (module docstring).

    Args:
        engines: the request engines; a request goes to the one with the fewest running.
        buffer: the :class:`~rollkit.buffer.SampleBuffer` (its ``free_slots`` bound what starts).
        new_group: makes the next admitted group (a :class:`GroupFactory`).
        rewards: the reward pool; decode: token ids -> text for the verifier.
        zero_variance: drop groups whose rewards all agree (``filter.zero_variance``).
        accuracy_band: ``(low, high)``: also drop groups whose mean reward is not strictly
            inside (``filter.accuracy_band``, ROLL's ``difficulty_mask``); None: off.
        replicate: one request per sample, each to the least-loaded engine (else a prompt's
            samples stay on one engine).

    All engine calls happen on the producer thread, except while it is parked (:meth:`pause`),
    when the trainer thread may stop requests and update weights.
    """

    def __init__(
        self,
        engines: Sequence[RequestEngine],
        buffer: SampleBuffer,
        new_group: GroupFactory,
        rewards: RewardPool,
        decode: Any,
        *,
        zero_variance: bool = False,
        accuracy_band: tuple[float, float] | None = None,
        replicate: bool = True,
    ) -> None:
        self.engines, self.buffer, self.new_group = list(engines), buffer, new_group
        self.rewards, self.decode = rewards, decode
        self.zero_variance, self.replicate = zero_variance, replicate
        self.accuracy_band = accuracy_band
        self.cond = threading.Condition()
        self.groups: dict[int, ScheduledGroup] = {}
        self.resubmit: list[Request] = []  # stopped at a weight update, to continue first
        self._to_abort: list[int] = []
        self._pause = self._parked = self._stop = False
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._overlap: threading.Thread | None = None
        self._admit_at = (-1, 0)  # (version, groups admitted at it): the seed index of the next group
        self.counts = dict.fromkeys(("filtered", "resubmitted", "restarted", "generated_tokens"), 0)

    # ------------------------------------------------------------------ control (trainer thread)

    @property
    def running(self) -> bool:
        """Whether the producer thread runs."""
        return self._thread is not None

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
        if self._overlap is not None:
            self._overlap.join()
            self._overlap = None

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

    def wait_batch(self) -> tuple[Any, list[int], dict[str, Any]]:
        """Block until the buffer has a batch; returns it, the groups it makes too old (their
        requests are being aborted) and the buffer's counters."""
        self.start()
        with self.cond:
            while (batch := self.buffer.get_batch()) is None:
                self.check()
                self.cond.wait(0.5)
            expiring = self.buffer.abort_expiring()
            stats = self.buffer.stats()
        if expiring:
            with self.cond:
                self._to_abort += list(expiring)
                self.cond.notify_all()
        return batch, expiring, stats

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

    def update_weights(self, weights: Any, version: int, *, keep: bool) -> int:
        """Suspend -> stop the in-flight requests (``keep``: continue them after) -> load the new
        weights into every engine -> set the buffer's version (dropping what that expires) ->
        resume. Returns how many requests were stopped."""
        self.pause()
        try:
            stopped = self.stop_in_flight(keep=keep)
            for e in self.engines:
                e.update_weights(weights, version=version)
            with self.cond:
                expired = self.buffer.set_version(version)
            self.drop(expired)  # the producer is parked: safe on this thread
        finally:
            self.resume()
        return stopped

    def settle_pending(self) -> None:
        """(Paused.) Wait for every submitted score and apply it (before someone else gathers
        the reward pool, e.g. an evaluation)."""
        self._collect_scores(self.rewards.gather())

    def abort_all(self) -> list[BaseException]:
        """Abort every request still running in the engines (so that engines can be reused);
        an engine that fails (a dead actor) does not stop the others. Returns the failures."""
        failed = []
        for e in self.engines:
            try:
                e.abort()
            except Exception as err:
                failed.append(err)
        return failed

    # ------------------------------------------------------------------ the producer

    def _run(self) -> None:
        try:
            while self._wait_if_paused():
                if not self._iteration():
                    with self.cond:
                        if not (self._stop or self._pause or self._to_abort):
                            self.cond.wait(0.002)
        except BaseException as e:  # surfaced to the trainer by check()
            self._error = e
            with self.cond:
                self.cond.notify_all()

    def producer_step(self) -> bool:
        """One producer step on the caller's thread, what the producer thread repeats: for an
        outer event loop that owns time (the simulator of benchmarks/sim). Returns whether
        anything happened."""
        return self._iteration()

    def _iteration(self, *, gather: bool = False) -> bool:
        """One producer step: drop expired groups, admit, step every engine, apply the scores
        (``gather``: wait for every submitted one, as the deterministic schedule does; else the
        ones that arrived). Returns whether anything happened."""
        with self.cond:
            aborts, self._to_abort = self._to_abort, []
        if aborts:
            self.drop(aborts)
        busy = self._admit()
        busy |= self._step_engines()
        busy |= self._collect_scores(self.rewards.gather() if gather else None)
        return busy

    # ------------------------------------------------------------------ the deterministic schedule

    def run_until_batch(self) -> tuple[Any, list[int], dict[str, Any]]:
        """(Deterministic schedule; no producer thread.) Producer steps in this thread until the
        buffer hands out a batch; returns what :meth:`wait_batch` returns."""
        self.finish_overlap()
        while True:
            with self.cond:
                batch = self.buffer.get_batch()
            if batch is not None:
                break
            if not self._iteration(gather=True):
                raise RuntimeError(
                    f"async scheduler: nothing runs and no batch can be formed (buffer {self.buffer.stats()})"
                )
        with self.cond:
            expiring = self.buffer.abort_expiring()
            stats = self.buffer.stats()
            self._to_abort += list(expiring)
        return batch, expiring, stats

    def start_overlap(self, steps: int) -> None:
        """(Deterministic schedule.) Run ``steps`` producer steps on a thread (while the trainer
        trains); :meth:`finish_overlap` waits for them. The work done is the same whatever the timing."""

        def run() -> None:
            try:
                for _ in range(steps):
                    if not self._iteration(gather=True):
                        break
            except BaseException as e:
                self._error = e

        self._overlap = threading.Thread(target=run, name="rollkit-rollout-overlap", daemon=True)
        self._overlap.start()

    def finish_overlap(self) -> None:
        if self._overlap is not None:
            self._overlap.join()
            self._overlap = None
        self.check()

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """(Paused, nothing running in the engines.) The groups in flight with their finished
        samples and scores, the stopped requests to continue, the admission index and counters,
        and the engines' sampler states."""
        running = sum(e.num_running for e in self.engines)
        if running:
            raise RuntimeError(f"state_dict: {running} requests are running; stop them first")
        return {
            "groups": dict(self.groups),
            "resubmit": list(self.resubmit),
            "to_abort": list(self._to_abort),
            "admit_at": self._admit_at,
            "counts": dict(self.counts),
            "engines": [e.state_dict() if hasattr(e, "state_dict") else None for e in self.engines],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if len(state["engines"]) != len(self.engines):
            raise ValueError(
                f"checkpoint: {len(state['engines'])} rollout engines were saved, this trainer has {len(self.engines)}"
            )
        self.groups = dict(state["groups"])
        self.resubmit = list(state["resubmit"])
        self._to_abort = list(state["to_abort"])
        self._admit_at = tuple(state["admit_at"])
        self.counts = dict(state["counts"])
        for e, es in zip(self.engines, state["engines"]):
            if es is not None and hasattr(e, "load_state_dict"):
                e.load_state_dict(es)

    def _wait_if_paused(self) -> bool:
        """Park while paused; False once stopped."""
        with self.cond:
            while True:
                if self._stop:
                    return False
                if not self._pause:
                    return True
                self._parked = True
                self.cond.notify_all()
                while self._pause and not self._stop:
                    self.cond.wait()
                self._parked = False

    def _step_engines(self) -> bool:
        running = [e for e in self.engines if e.num_running]
        for e in running:  # remote engines (Ray actors) step at the same time
            if hasattr(e, "start_step"):
                e.start_step()
        for e in running:
            for r in e.step():
                self._finished(r)
        return bool(running)

    def drop(self, rids: Iterable[int]) -> None:
        """Forget these groups and abort their requests."""
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
        # least loaded first, ties to the lowest index, counting what this call already gave:
        # a heap of (load, index), O(requests x log engines) (1,000 engines: benchmarks/sim)
        heap = [(e.num_running, k) for k, e in enumerate(self.engines)]
        heapq.heapify(heap)
        per_engine: dict[int, list[Request]] = defaultdict(list)
        for r in reqs:
            load, k = heapq.heappop(heap)
            per_engine[k].append(r)
            heapq.heappush(heap, (load + 1, k))
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
            g = self.new_group(rid, version, index)
            self.groups[rid] = g
            self._dispatch(g.requests, together=not self.replicate)
            started = True
        return started

    def _finished(self, r: Request) -> None:
        rid, j = r.tag
        g = self.groups.get(rid)
        if g is None:
            return
        g.finished[j] = r
        self.counts["generated_tokens"] += len(r.token_ids)
        self.rewards.submit((rid, j), self.decode(r.token_ids), g.prompt)

    def _collect_scores(self, scored: dict | None = None) -> bool:
        """Apply the scores that arrived (``RewardPool.poll()``, or ``scored`` when given)."""
        scored = self.rewards.poll() if scored is None else scored
        for (rid, j), s in scored.items():
            g = self.groups.get(rid)
            if g is None:
                continue
            g.scores[j] = s
            if len(g.scores) == len(g.requests):
                self._settle(g)
        return bool(scored)

    def _in_band(self, rewards: list[float]) -> bool:
        """Whether the group's mean reward is inside ``accuracy_band`` (the rollkit filter's rule)."""
        assert self.accuracy_band is not None
        low, high = self.accuracy_band
        keep = FILTERS.entry("accuracy_band").call(
            {
                "accuracy": torch.tensor(rewards, dtype=torch.float32),
                "group_ids": torch.zeros(len(rewards), dtype=torch.int64),
            },
            low=low,
            high=high,
            inclusive="neither",
        )
        return bool(keep[0])

    def _settle(self, g: ScheduledGroup) -> None:
        del self.groups[g.rid]
        rewards = [g.scores[j] for j in range(len(g.requests))]
        with self.cond:
            if not self.buffer.is_running(g.rid):
                return  # expired meanwhile
            if (self.zero_variance and len(rewards) > 1 and max(rewards) == min(rewards)) or (
                self.accuracy_band is not None and not self._in_band(rewards)
            ):
                self.buffer.abort(g.rid)
                self.counts["filtered"] += 1
            else:
                self.buffer.put(
                    g.rid, [(g.prompt, g.finished[j], rewards[j]) for j in range(len(g.requests))]
                )
            self.cond.notify_all()
