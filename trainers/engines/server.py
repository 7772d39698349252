"""The generation server: one thread that owns a rollout engine and serves single-sample requests.

Environment-level asynchronous rollout (:mod:`trainers.envs.episodes`) plays every episode on
its own thread; each thread submits its next turn here and the server batches whatever is
pending into one ``engine.generate`` call. Lock-step rollout calls :meth:`GenerationServer.generate`
directly. See ``docs/agentic.md``.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import deque
from collections.abc import Hashable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from trainers.engines.base import Generation, SamplingParams

__all__ = ["ASYNC_SEED_OFFSET", "GenerationServer"]

#: the seeds of the asynchronous (:meth:`GenerationServer.submit`) path start this far from
#: ``params.seed``, so that they never coincide with the lock-step path's
ASYNC_SEED_OFFSET = 1 << 32


@dataclass
class _Request:
    context: list[int]
    params: SamplingParams
    room: int
    tag: Hashable
    future: Future = field(default_factory=Future)


def _cut(g: Generation, room: int) -> Generation:
    """``g`` with at most ``room`` tokens (a prefix keeps its log-probs: they do not depend on
    later tokens)."""
    if len(g.token_ids) <= room:
        return g
    return dataclasses.replace(
        g, token_ids=g.token_ids[:room], logprobs=g.logprobs[:room], finish_reason="length"
    )


class GenerationServer:
    """One thread that owns a rollout engine and serves single-sample requests from many threads.

    :meth:`submit` queues ``(context, params)`` and returns a ``Future`` of a
    :class:`~trainers.engines.base.Generation`; the server thread takes every pending request
    with the same sampling parameters (at most ``max_batch_size``) into one
    ``engine.generate`` call, so requests that arrive while the engine is busy form the next
    batch. ``room`` caps a request's tokens (the sample is cut to it; the batch runs with the
    params' ``max_tokens``).

    Seeds (with ``params.seed`` set): the two paths count their engine calls separately. The
    ``i``-th call of :meth:`generate` (lock-step) uses ``params.seed + i``, whatever
    asynchronous calls came before or in between, so lock-step samples are reproducible. The
    ``j``-th batch of the :meth:`submit` path uses ``params.seed + ASYNC_SEED_OFFSET + j``;
    which requests share a batch depends on timing, so asynchronous samples are random but
    not reproducible.

    :meth:`update_weights` and :meth:`generate` take the engine lock between batches: a weight
    update waits for the running batch, and later requests see the new ``policy_version``.

    Args:
        engine: a :class:`~trainers.engines.base.RolloutEngine`.
        max_batch_size: the most requests per engine call (``None``: all pending).
        batch_wait_s: after the first request of a batch arrives, wait this long for more.
    """

    def __init__(self, engine: Any, *, max_batch_size: int | None = None, batch_wait_s: float = 0.0) -> None:
        if max_batch_size is not None and (isinstance(max_batch_size, bool) or max_batch_size < 1):
            raise ValueError(f"max_batch_size: expected an int >= 1 or None, got {max_batch_size!r}")
        if not batch_wait_s >= 0:
            raise ValueError(f"batch_wait_s: expected a number >= 0, got {batch_wait_s!r}")
        self.engine = engine
        self.max_batch_size = max_batch_size
        self.batch_wait_s = float(batch_wait_s)
        self._engine_lock = threading.Lock()
        self._cv = threading.Condition()
        self._queue: deque[_Request] = deque()
        self._calls = {"direct": 0, "async": 0}  # seeds of the lock-step (generate) and submit paths
        self._thread: threading.Thread | None = None
        self._closed = False
        #: ``calls`` (engine calls), ``requests``, ``cancelled`` (dropped before generation)
        self.stats: dict[str, int] = {"calls": 0, "requests": 0, "cancelled": 0}

    @property
    def policy_version(self) -> int:
        return int(getattr(self.engine, "policy_version", 0))

    def _next(self, path: str) -> int:
        """The index of this engine call on ``path`` (called under the engine lock)."""
        i = self._calls[path]
        self._calls[path] = i + 1
        return i

    def state_dict(self) -> dict[str, int]:
        """The seed counters of both paths (a resumed run continues the lock-step seeds)."""
        return dict(self._calls)

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._calls = {"direct": int(state["direct"]), "async": int(state["async"])}

    def _seeded(self, params: SamplingParams, offset: int) -> SamplingParams:
        """``params`` for one engine call (taken under the engine lock); ``offset`` is the
        call's index on its path (plus :data:`ASYNC_SEED_OFFSET` on the asynchronous one)."""
        self.stats["calls"] += 1
        seed = None if params.seed is None else (params.seed + offset) % (2**63)
        return dataclasses.replace(params, n=1, seed=seed)

    # ------------------------------------------------------------------ requests

    def submit(
        self, context: Sequence[int], params: SamplingParams, *, room: int | None = None, tag: Hashable = None
    ) -> Future:
        """Queue one sample of ``context``; ``tag`` names the request for :meth:`cancel`."""
        if self._closed:
            raise RuntimeError("the GenerationServer is closed")
        if params.n != 1:
            raise ValueError(f"params.n: one sample per request, got n={params.n}")
        if not context:
            raise ValueError("context: needs at least one token")
        req = _Request(list(context), params, params.max_tokens if room is None else max(1, int(room)), tag)
        with self._cv:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="generation-server", daemon=True)
                self._thread.start()
            self._queue.append(req)
            self.stats["requests"] += 1
            self._cv.notify()
        return req.future

    def cancel(self, tags: Iterable[Hashable]) -> int:
        """Drop the queued (not yet generating) requests whose tag is in ``tags``; their futures
        are cancelled. Returns how many."""
        tags = set(tags)
        with self._cv:
            keep, dropped = deque(), 0
            for r in self._queue:
                if r.tag in tags and r.future.cancel():
                    dropped += 1
                else:
                    keep.append(r)
            self._queue = keep
            self.stats["cancelled"] += dropped
        return dropped

    def _take(self) -> list[_Request] | None:
        with self._cv:
            while not self._queue and not self._closed:
                self._cv.wait()
            if self._closed and not self._queue:
                return None
        if self.batch_wait_s:
            time.sleep(self.batch_wait_s)
        with self._cv:
            if not self._queue:
                return []
            params = self._queue[0].params
            limit = self.max_batch_size or len(self._queue)
            batch, rest = [], deque()
            for r in self._queue:
                if len(batch) < limit and r.params == params:
                    batch.append(r)
                else:
                    rest.append(r)
            self._queue = rest
        return [r for r in batch if r.future.set_running_or_notify_cancel()]

    def _loop(self) -> None:
        while True:
            batch = self._take()
            if batch is None:
                return
            if not batch:
                continue
            try:
                with self._engine_lock:
                    gens = self.engine.generate(
                        [r.context for r in batch],
                        self._seeded(batch[0].params, ASYNC_SEED_OFFSET + self._next("async")),
                    )
                for r, g in zip(batch, gens):
                    r.future.set_result(_cut(g, r.room))
            except BaseException as e:  # reported to the episodes that asked
                for r in batch:
                    if not r.future.done():
                        r.future.set_exception(e)

    # ------------------------------------------------------------------ direct use

    def generate(
        self, contexts: Sequence[Sequence[int]], params: SamplingParams, rooms: Sequence[int] | None = None
    ) -> list[Generation]:
        """One ``engine.generate`` call over all ``contexts`` (the lock-step path), each sample cut
        to its ``rooms`` entry."""
        with self._engine_lock:
            gens = self.engine.generate(
                [list(c) for c in contexts], self._seeded(params, self._next("direct"))
            )
        rooms = rooms if rooms is not None else [params.max_tokens] * len(gens)
        return [_cut(g, r) for g, r in zip(gens, rooms)]

    def update_weights(self, named_tensors: Iterable[Any], version: int) -> None:
        """``engine.update_weights`` between two batches."""
        with self._engine_lock:
            self.engine.update_weights(named_tensors, version)

    def close(self) -> None:
        """Stop the server thread (queued requests are cancelled)."""
        with self._cv:
            self._closed = True
            for r in self._queue:
                r.future.cancel()
            self._queue.clear()
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=60)
