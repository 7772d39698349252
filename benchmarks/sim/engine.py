"""Simulated rollout engines, reward workers and prompt codec on a :class:`VirtualClock`.

:class:`SimEngine` implements the real :class:`trainers.engines.requests.RequestEngine` protocol
(``num_running``, ``add``, ``step``, ``abort``, ``update_weights``, ``policy_version``), so
rollkit's queue scheduler and collectors drive it unmodified. It holds ``instances``
data-parallel engine instances (each a continuous batch; a request goes to the least-loaded
one); an iteration of an instance costs :meth:`DecodeCost.iteration` and between two events
(a request added, finished or aborted) the instance advances in closed form, so a step is
O(events), not O(tokens). A request's response grows to ``min(max_tokens, natural length)``
(the natural length from :class:`~benchmarks.sim.lengths.Lengths`; ``ignore_eos`` runs to
``max_tokens``, as W1 does). Token lists are run-length :class:`RunList` objects, so a million
requests do not hold a billion ints.

Two ways of moving time: ``driven=True`` (an outer event loop moves the clock, the engine
reports what finished by then: the queue scheduler's producer) or ``driven=False`` (each
:meth:`SimEngine.step` moves the clock to the engine's next finish: a collector that loops
``while engine.num_running: engine.step()``).
"""

from __future__ import annotations

import heapq
import math
import random
import zlib
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import replace
from typing import Any

from benchmarks.sim.clock import VirtualClock
from benchmarks.sim.costs import DecodeCost, Latency
from benchmarks.sim.lengths import Lengths
from trainers.data import Prompt
from trainers.engines.base import Generation, SamplingParams
from trainers.engines.requests import Request

__all__ = ["RunList", "SimCodec", "SimEngine", "SimRewards", "make_prompts"]

INF = math.inf


class RunList(Sequence):
    """A list stored as runs ``[(value, count), ...]`` (token ids, log-probs, versions).

    >>> r = RunList(0, 3); r.extend_run(5, 2); len(r), list(r), r[3]
    (5, [0, 0, 0, 5, 5], 5)
    """

    __slots__ = ("key", "n", "runs")

    def __init__(self, value: Any = 0, n: int = 0, key: Any = None) -> None:
        self.runs: list[tuple[Any, int]] = [(value, n)] if n else []
        self.n, self.key = n, key

    @classmethod
    def of(cls, seq: Sequence) -> RunList:
        if isinstance(seq, RunList):
            return seq
        out = cls()
        for v in seq:
            out.extend_run(v, 1)
        return out

    def extend_run(self, value: Any, k: int) -> None:
        if k <= 0:
            return
        if self.runs and self.runs[-1][0] == value:
            self.runs[-1] = (value, self.runs[-1][1] + k)
        else:
            self.runs.append((value, k))
        self.n += k

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[Any]:
        for v, k in self.runs:
            for _ in range(k):
                yield v

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return list(self)[i]
        if i < 0:
            i += self.n
        if not 0 <= i < self.n:
            raise IndexError(i)
        for v, k in self.runs:
            if i < k:
                return v
            i -= k
        raise IndexError(i)

    def values(self) -> set[Any]:
        return {v for v, _ in self.runs}


class SimCodec:
    """The collectors' codec: a prompt's token ids are a :class:`RunList` of ``prompt_len(key)``
    tokens keyed by the prompt's key (``Prompt.text``); decoding gives ``""`` (rewards are
    simulated)."""

    def __init__(self, prompt_len: int = 128) -> None:
        self.prompt_len = prompt_len
        self.pad_id = 0

    def encode(self, p: Prompt) -> RunList:
        return RunList(1, self.prompt_len, key=p.text)

    def decode(self, ids: Sequence[int]) -> str:
        return ""


def make_prompts(n: int) -> list[Prompt]:
    """``n`` prompts keyed ``0 .. n - 1`` (the key drives the simulated lengths and rewards)."""
    return [Prompt(text=i, answer="", data_source="sim") for i in range(n)]


class _Seq:
    __slots__ = ("base", "ctx0", "live", "req", "start_iter", "target")

    def __init__(self, req: Request, start_iter: int, target: int) -> None:
        self.req, self.start_iter, self.target = req, start_iter, target
        self.base = len(req.token_ids)
        self.ctx0 = len(req.prompt_ids) + self.base
        self.live = True


class _Instance:
    """One engine instance: a continuous batch advanced in closed form between events."""

    def __init__(self, cost: DecodeCost) -> None:
        self.cost = cost
        self.running: dict[str, _Seq] = {}
        self.heap: list[tuple[int, int, _Seq]] = []  # (finish iteration, tie, seq)
        self.waiting: deque[tuple[Request, int]] = deque()
        self.iters = 0
        self.t = 0.0  # time of the last iteration boundary (or of the end of a prefill)
        self.kv_sum = 0  # sum of (ctx0 - start_iter): the KV tokens are kv_sum + B * iters
        self.tie = 0

    @property
    def load(self) -> int:
        return len(self.running) + len(self.waiting)

    def kv(self) -> int:
        return self.kv_sum + len(self.running) * self.iters

    def _pop_dead(self) -> None:
        while self.heap and not self.heap[0][2].live:
            heapq.heappop(self.heap)

    def next_finish(self) -> float:
        self._pop_dead()
        if not self.heap:
            return INF
        k = self.heap[0][0] - self.iters
        return self.t + self.cost.iterations(k, len(self.running), self.kv())

    def admit(self, now: float, busy_until: float) -> None:
        """Start waiting requests while the batch and KV capacity allow (prefill cost)."""
        cap, tokens, seen = self.cost.kv_capacity, 0, set()
        while self.waiting and len(self.running) < self.cost.max_seqs:
            req, target = self.waiting[0]
            ctx = len(req.prompt_ids) + len(req.token_ids)
            if cap is not None and self.running and self.kv() + ctx > cap:
                break
            self.waiting.popleft()
            s = _Seq(req, self.iters, target)
            self.running[req.request_id] = s
            self.kv_sum += s.ctx0 - self.iters
            self.tie += 1
            heapq.heappush(self.heap, (self.iters + target - s.base, self.tie, s))
            key = getattr(req.prompt_ids, "key", None)
            if self.cost.share_prefix and key is not None and key in seen:
                tokens += s.ctx0 - len(req.prompt_ids)  # the prompt is prefilled once
            else:
                tokens += s.ctx0
            seen.add(key)
        if tokens:
            self.t = max(self.t, now, busy_until) + self.cost.prefill(tokens)

    def _retire(self, s: _Seq, version: int) -> None:
        s.live = False
        del self.running[s.req.request_id]
        self.kv_sum -= s.ctx0 - s.start_iter
        k = self.iters - s.start_iter
        r = s.req
        for name in ("token_ids", "logprobs", "token_versions"):
            if not isinstance(getattr(r, name), RunList):
                setattr(r, name, RunList.of(getattr(r, name)))
        r.token_ids.extend_run(0, k)
        r.logprobs.extend_run(0.0, k)
        r.token_versions.extend_run(version, k)

    def advance(
        self, now: float, version: int, busy_until: float, done: list[Request], admit: bool = True
    ) -> None:
        """Run whole iterations up to ``now``, retiring the requests that finish and admitting
        waiting ones at each finish; what still waits is admitted at ``now`` (one prefill for
        everything added at the same instant)."""
        while self.running and self.t <= now:
            self._pop_dead()
            B, kv = len(self.running), self.kv()
            k_next = self.heap[0][0] - self.iters
            dt = self.cost.iterations(k_next, B, kv)
            if self.t + dt > now:
                k = self.cost.max_iterations(now - self.t, B, kv)
                self.t += self.cost.iterations(k, B, kv)
                self.iters += k
                break
            self.iters += k_next
            self.t += dt
            while self.heap and (not self.heap[0][2].live or self.heap[0][0] <= self.iters):
                _, _, s = heapq.heappop(self.heap)
                if s.live:
                    self._retire(s, version)
                    r = s.req
                    r.finish_reason = "length" if len(r.token_ids) >= r.params.max_tokens else "stop"
                    done.append(r)
            self.admit(self.t, busy_until)
        if admit and self.waiting and self.t <= now:
            self.admit(now, busy_until)
        if not self.running:
            self.t = max(self.t, now)

    def abort(self, rid: str, version: int) -> Request | None:
        s = self.running.get(rid)
        if s is not None:
            self._retire(s, version)
            return s.req
        for i, (req, _) in enumerate(self.waiting):
            if req.request_id == rid:
                del self.waiting[i]
                return req
        return None


class SimEngine:
    """A simulated :class:`~trainers.engines.requests.RequestEngine` (module docstring).

    Args:
        clock: the shared virtual clock.
        cost: the decode / prefill cost of one instance.
        lengths: natural response lengths.
        instances: data-parallel instances behind this engine (least-loaded per request).
        sync_s: seconds an instance is paused by :meth:`update_weights`.
        driven: whether an outer loop moves the clock (else :meth:`step` does).
    """

    def __init__(
        self,
        clock: VirtualClock,
        cost: DecodeCost,
        lengths: Lengths,
        *,
        instances: int = 1,
        sync_s: float = 0.0,
        driven: bool = True,
    ) -> None:
        if instances < 1:
            raise ValueError(f"instances: must be >= 1, got {instances}")
        self.clock, self.cost, self.lengths = clock, cost, lengths
        self.sync_s, self.driven = sync_s, driven
        self.inst = [_Instance(cost) for _ in range(instances)]
        self.where: dict[str, _Instance] = {}
        self.policy_version = 0
        self.busy_until = 0.0
        self._done: list[Request] = []
        self.counts = dict.fromkeys(("added", "finished", "aborted", "generated_tokens"), 0)

    @property
    def num_running(self) -> int:
        return len(self.where)

    def _target(self, r: Request) -> int:
        if r.params.ignore_eos:
            return r.params.max_tokens
        key = getattr(r.prompt_ids, "key", None)
        natural = self.lengths.natural(key, zlib.crc32(r.request_id.encode()))
        return max(len(r.token_ids) + 1, min(r.params.max_tokens, natural))

    def add(self, requests: Sequence[Request]) -> None:
        now = self.clock.now
        touched = set()
        for r in requests:
            if r.request_id in self.where:
                raise ValueError(f"requests: request_id {r.request_id!r} is already running")
            if r.finish_reason is not None or r.remaining < 1:
                raise ValueError(f"requests: request {r.request_id!r} is finished or has no budget left")
            inst = min(self.inst, key=lambda i: i.load) if len(self.inst) > 1 else self.inst[0]
            if id(inst) not in touched:
                inst.advance(now, self.policy_version, self.busy_until, self._done, admit=False)
                touched.add(id(inst))
            inst.waiting.append((r, self._target(r)))
            self.where[r.request_id] = inst
            self.counts["added"] += 1

    def next_event(self) -> float:
        """The time of the next finish (``inf`` if nothing runs)."""
        return min((i.next_finish() for i in self.inst if i.running), default=INF)

    def _advance(self, now: float) -> None:
        for inst in self.inst:
            if inst.running or inst.waiting:
                inst.advance(now, self.policy_version, self.busy_until, self._done)

    def step(self) -> list[Request]:
        self._advance(self.clock.now)  # admits what was added
        if not self.driven and not self._done and self.where:
            t = self.next_event()
            if t < INF:
                self.clock.advance_to(t)
                self._advance(self.clock.now)
        done, self._done = self._done, []
        for r in done:
            del self.where[r.request_id]
            self.counts["finished"] += 1
            self.counts["generated_tokens"] += len(r.token_ids)
        return done

    def generate_iter(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> Iterator[Generation]:
        """The batch engines' streaming ``generate`` (``trainers.engines.base.iter_generations``,
        the synchronous collector's path without per-request budgets): ``params.n`` samples of
        every prompt, each a request of this engine, yielded as they finish (``driven=False``:
        each :meth:`step` moves the clock to the next finish)."""
        self._batches = getattr(self, "_batches", 0) + 1
        one = replace(params, n=1)
        reqs = [
            Request(f"batch{self._batches}-{i}-{j}", ids, one, start_version=self.policy_version, tag=i)
            for i, ids in enumerate(prompts)
            for j in range(params.n)
        ]
        self.add(reqs)
        left = {r.request_id for r in reqs}
        while left:
            for r in self.step():
                left.discard(r.request_id)
                yield r.to_generation(r.tag)

    def abort(self, request_ids: Iterable[str] | None = None) -> list[Request]:
        ids = list(self.where) if request_ids is None else [i for i in request_ids if i in self.where]
        if not ids:
            return []
        self._advance(self.clock.now)
        out = []
        for rid in ids:
            inst = self.where.pop(rid, None)
            if inst is None:  # finished in this very advance: reported by the next step()
                continue
            r = inst.abort(rid, self.policy_version)
            if r is not None:
                out.append(r)
                self.counts["aborted"] += 1
        return out

    def update_weights(self, named_tensors: Any, version: int) -> None:
        if self.where:
            raise RuntimeError(f"update_weights: {len(self.where)} requests are running; abort them first")
        self.policy_version = version
        self.busy_until = self.clock.now + self.sync_s
        for inst in self.inst:
            inst.t = max(inst.t, self.busy_until)

    def pause_for_sync(self, version: int) -> None:
        """An in-place weight update with requests kept running (their KV kept): every instance
        pauses ``sync_s`` seconds, later tokens carry ``version`` (the agentic loop's update)."""
        self._advance(self.clock.now)
        self.policy_version = version
        self.busy_until = self.clock.now + self.sync_s
        for inst in self.inst:
            inst.t = max(inst.t, self.busy_until)


class SimRewards:
    """The reward pool's interface (``submit`` / ``poll`` / ``gather``) on the virtual clock:
    each sample is scored by the first free of ``workers`` workers in ``latency`` seconds; the
    score is 1 with probability ``accuracy(prompt key)`` (default 0.5), deterministic per key.

    Code rewards: ``timeout`` maps a problem (the prompt key) to its timeout in seconds, e.g.
    the real :meth:`rollkit.scheduling.AdaptiveTimeout.timeout` (whose ``observe`` is then fed
    every run) or ``lambda problem: 30.0``; a fraction ``doomed`` of the programs never halt and
    run to the timeout (W2), and a run past its timeout scores 0."""

    def __init__(
        self,
        clock: VirtualClock,
        latency: Latency,
        workers: int = 1 << 30,
        *,
        seed: int = 0,
        accuracy: Any = None,
        timeout: Any = None,
        doomed: float = 0.0,
    ) -> None:
        self.clock, self.latency, self.workers = clock, latency, workers
        self.timeout, self.doomed = timeout, doomed
        self.busy_s = 0.0  # worker-seconds spent scoring
        self.rng = random.Random(seed)
        self.seed = seed
        self.accuracy = accuracy or (lambda key: 0.5)
        self.free: list[float] = []  # busy workers' free times (heap)
        self.pending: list[tuple[float, int, Any, float]] = []
        self.tie = 0
        self.scored = 0

    def submit(self, key: Any, completion: str, prompt: Prompt) -> None:
        now = self.clock.now
        while self.free and self.free[0] <= now:
            heapq.heappop(self.free)
        start = now if len(self.free) < self.workers else heapq.heappop(self.free)
        p = self.accuracy(prompt.text)
        u = random.Random(zlib.crc32(repr((self.seed, key)).encode())).random()
        score = 1.0 if u < p else 0.0
        run = self.latency.sample(self.rng)
        if self.timeout is not None:  # code rewards: a run stops at its timeout
            if u > 1.0 - self.doomed:  # a program that never halts (W2: about 5%)
                run, score = math.inf, 0.0
            limit = self.timeout(prompt.text)
            if run > limit:
                run, score = limit, 0.0
            observe = getattr(self.timeout, "__self__", None)
            if observe is not None and hasattr(observe, "observe"):
                observe.observe(prompt.text, run, correct=score == 1.0)
        self.busy_s += run
        done = start + run
        heapq.heappush(self.free, done)
        self.tie += 1
        heapq.heappush(self.pending, (done, self.tie, key, score))

    def next_event(self) -> float:
        return self.pending[0][0] if self.pending else INF

    def poll(self) -> dict[Any, float]:
        out = {}
        now = self.clock.now
        while self.pending and self.pending[0][0] <= now:
            _, _, key, s = heapq.heappop(self.pending)
            out[key] = s
        self.scored += len(out)
        return out

    def gather(self) -> dict[Any, float]:
        if self.pending:
            self.clock.advance_to(max(p[0] for p in self.pending))
        return self.poll()
