"""The reward pool: score samples with a verifier as they are generated, inline, on worker
processes or on Ray actors, and :func:`rollout_and_score` (streaming generation + scoring).

::

    submit(key, completion, prompt)   non-blocking; keys unique within a round
    gather() -> {key: reward}         blocks until every submitted key is scored; starts a new round

A verifier that raises, returns a non-finite number or runs past ``timeout_s`` scores ``0.0``
and is counted; a worker that dies mid-sample is replaced and the sample is retried on a fresh
worker (``max_retries``); a key is never lost. A verifier with a ``score_batch(completions,
prompts)`` method (the reward model) is handed up to ``batch_size`` samples per call.
Guide: ``docs/rewards-workers.md``.

>>> pool = RewardPool("exact_match", backend="inline")
>>> pool.submit("a", "12+34=46", Prompt("12+34=", "46"))
>>> pool.submit("b", "it is 45", Prompt("12+34=", "46"))
>>> pool.gather()
{'a': 1.0, 'b': 0.0}
"""

from __future__ import annotations

import collections
import math
import multiprocessing
import multiprocessing.connection as mpc
import os
import pickle
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from trainers.data import Prompt
from trainers.deps import require
from trainers.engines.base import iter_generations
from trainers.rewards.verifiers import Verifier, get_verifier, mark_pool_worker

__all__ = ["BACKENDS", "RewardPool", "rollout_and_score"]

BACKENDS = ("inline", "process", "ray")

#: the counters of :meth:`RewardPool.metrics` (class docstring)
COUNTERS = (
    "scored",
    "errors",
    "timeouts",
    "crashes",
    "retries",
    "crash_failures",
    "restarts",
    "scale_ups",
    "scale_downs",
)


def _run_verifier(verifier: Verifier, completion: str, prompt: Prompt) -> tuple[str, float, float, str]:
    """``(status, reward, seconds, error)``; status is ``"ok"`` or ``"error"``."""
    t0 = time.perf_counter()
    try:
        r = float(verifier(completion, prompt))
        if not math.isfinite(r):
            raise ValueError(f"the verifier returned a non-finite reward {r}")
        return "ok", r, time.perf_counter() - t0, ""
    except Exception as e:  # any verifier failure scores 0
        return "error", 0.0, time.perf_counter() - t0, f"{type(e).__name__}: {e}"


def _score_items(
    verifier: Verifier, completions: Sequence[str], prompts: Sequence[Prompt]
) -> list[tuple[str, float, float, str]]:
    """``_run_verifier``'s result per sample. Several samples and a verifier with ``score_batch``:
    one ``score_batch`` call, its time split evenly among them (a non-finite reward is that
    sample's error); if the call raises, each sample is scored alone, so errors stay per sample."""
    n = len(completions)
    score_batch = getattr(verifier, "score_batch", None)
    if n == 1 or not callable(score_batch):
        return [_run_verifier(verifier, c, p) for c, p in zip(completions, prompts)]
    t0 = time.perf_counter()
    try:
        rewards = [float(r) for r in score_batch(list(completions), list(prompts))]
        if len(rewards) != n:
            raise ValueError(f"score_batch returned {len(rewards)} rewards for {n} samples")
    except Exception:  # one at a time: the sample that fails scores 0, the others their reward
        lost = (time.perf_counter() - t0) / n
        alone = [_run_verifier(verifier, c, p) for c, p in zip(completions, prompts)]
        return [(st, r, dt + lost, err) for st, r, dt, err in alone]
    share = (time.perf_counter() - t0) / n
    return [
        ("ok", r, share, "")
        if math.isfinite(r)
        else ("error", 0.0, share, f"the verifier returned a non-finite reward {r}")
        for r in rewards
    ]


# --------------------------------------------------------------------------- worker side


def _process_worker_main(conn: mpc.Connection, verifier_bytes: bytes) -> None:
    """A process-backend worker: set up, then score one batch of samples (often one) per
    message, in the main thread."""
    mark_pool_worker()
    try:
        verifier = pickle.loads(verifier_bytes)
        setup = getattr(verifier, "setup", None)
        if callable(setup):
            setup()
    except BaseException as e:  # reported to the parent, which raises it
        conn.send(("setup_error", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready",))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        task_ids, completions, prompts = msg
        conn.send(("result", task_ids, _score_items(verifier, completions, prompts)))


class _RayRewardWorker:
    """A Ray-backend worker (made a Ray actor class by :class:`_RayWorkers`)."""

    def __init__(self, verifier: Verifier) -> None:
        mark_pool_worker()
        self.verifier = verifier
        setup = getattr(verifier, "setup", None)
        if callable(setup):
            setup()

    def ready(self) -> bool:
        """True when this method runs on the process's main thread (where signal.alarm works)."""
        return threading.current_thread() is threading.main_thread()

    def score(self, completion: str, prompt: Prompt) -> tuple[str, float, float, str]:
        return _run_verifier(self.verifier, completion, prompt)

    def score_many(
        self, completions: list[str], prompts: list[Prompt]
    ) -> list[tuple[str, float, float, str]]:
        return _score_items(self.verifier, completions, prompts)

    def pid(self) -> int:
        return os.getpid()


# --------------------------------------------------------------------------- shared state


@dataclass
class _Task:
    key: Hashable
    completion: str
    prompt: Prompt
    attempts: int = 0  # dispatches that ended with the worker dying


class _Ledger:
    """The samples, results and counters that the caller and the dispatcher thread share; every
    field is guarded by ``lock``."""

    def __init__(self, max_retries: int) -> None:
        self.max_retries = max_retries
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)
        self.round: set[Hashable] = set()  # keys submitted this round
        self.results: dict[Hashable, float] = {}
        self.tasks: dict[int, _Task] = {}  # not yet scored
        self.queue: collections.deque[int] = collections.deque()  # not yet dispatched
        self.next_id = 0
        self.counts = dict.fromkeys(COUNTERS, 0)
        self.busy_s = 0.0
        self.busy_by_domain: collections.Counter[str] = collections.Counter()  # prompt.domain -> s
        self.hwm = 0
        self.workers_hwm = 0
        self.recent_errors: collections.deque[str] = collections.deque(maxlen=20)
        self.fatal: str | None = None
        self.closed = False
        self.startup_failures = 0

    def add(self, key: Hashable, completion: str, prompt: Prompt, *, queue: bool) -> int:
        """Register one sample (lock held by the caller); returns its task id."""
        if self.closed:
            raise RuntimeError("the RewardPool is closed")
        if key in self.round:
            raise ValueError(
                f"key {key!r} was already submitted in this round (keys must be unique until gather())"
            )
        self.round.add(key)
        task_id = self.next_id
        self.next_id += 1
        self.tasks[task_id] = _Task(key, completion, prompt)
        self.hwm = max(self.hwm, len(self.tasks))
        if queue:
            self.queue.append(task_id)
        return task_id

    def take(self, limit: int = 1) -> list[tuple[int, _Task]]:
        """The next samples to dispatch together, up to ``limit`` in queue order (lock held by the
        caller; ``[]`` if none). A sample retried after a crash goes alone, so the sample that
        kills its worker cannot take a batch of others down with it again."""
        out: list[tuple[int, _Task]] = []
        while self.queue and len(out) < limit:
            task = self.tasks[self.queue[0]]
            if task.attempts and out:
                break
            out.append((self.queue.popleft(), task))
            if task.attempts:
                break
        return out

    def record(self, task_id: int, status: str, reward: float, busy: float, err: str) -> None:
        """A sample's final score (lock held by the caller); failures score 0.0 and are counted."""
        task = self.tasks.pop(task_id, None)
        if task is None:
            return
        self.results[task.key] = reward if status == "ok" else 0.0
        self.counts["scored"] += 1
        self.busy_s += busy
        self.busy_by_domain[getattr(task.prompt, "domain", "")] += busy
        if status != "ok":
            self.counts[{"error": "errors", "timeout": "timeouts", "crash": "crash_failures"}[status]] += 1
            self.recent_errors.append(f"{status} on key {task.key!r}: {err}")
        self.cond.notify_all()

    def crashed(self, task_ids: Sequence[int], busy: float, err: str) -> None:
        """The worker scoring the batch ``task_ids`` died (lock held by the caller): count the
        crash once and queue each sample again (first in line, in order) unless it has used its
        ``max_retries``; ``busy`` is split evenly among them."""
        live = [t for t in task_ids if t in self.tasks]
        if not live:
            return
        self.counts["crashes"] += 1
        share = busy / len(live)
        for task_id in reversed(live):  # appendleft in reverse: the batch keeps its order
            task = self.tasks[task_id]
            task.attempts += 1
            if task.attempts > self.max_retries:
                self.record(task_id, "crash", 0.0, share, f"{err} ({task.attempts} attempts)")
                continue
            self.busy_s += share
            self.busy_by_domain[getattr(task.prompt, "domain", "")] += share
            self.counts["retries"] += 1
            self.recent_errors.append(f"crash on key {task.key!r}: {err}; retrying on a fresh worker")
            self.queue.appendleft(task_id)

    def startup_failed(self, why: str, max_workers: int) -> None:
        """A worker could not start (lock held by the caller); gives up after ``3 * max_workers``."""
        self.startup_failures += 1
        self.recent_errors.append(f"worker failed to start: {why}")
        if self.startup_failures >= 3 * max_workers:
            self.fatal = f"RewardPool: workers keep failing to start ({self.startup_failures} times): {why}"
            self.cond.notify_all()


# --------------------------------------------------------------------------- worker backends


@dataclass
class _Slot:
    """One worker, as the dispatcher sees it."""

    handle: Any  # multiprocessing Process, or a Ray actor handle
    conn: Any = None  # process backend: the parent's end of the pipe
    ready_ref: Any = None  # ray backend: the ready() call in flight
    ready: bool = False
    setup_error: str = ""
    task: tuple[tuple[int, ...], float] | None = None  # (task ids of the batch, dispatch time)
    ref: Any = None  # ray backend: the score() call in flight
    idle_since: float = 0.0  # perf_counter when it became ready or finished its last sample


@dataclass(frozen=True)
class _Sizing:
    num_workers: int
    max_workers: int
    idle_s: float
    timeout_s: float
    batch_size: int = 1


class _Workers:
    """What the process and Ray backends share: the slots, dispatching queued samples to idle
    workers, replacing dead or timed-out ones (a crash retries the sample), and sizing the pool
    to its queue, run by one dispatcher thread. Subclasses start, stop and watch workers."""

    def __init__(self, ledger: _Ledger, sizing: _Sizing) -> None:
        self.ledger = ledger
        self.sizing = sizing
        self.slots: list[_Slot] = []
        self.thread: threading.Thread | None = None

    # ------------------------------------------------------------------ to implement

    def _start_worker(self) -> _Slot:
        raise NotImplementedError

    def _stop_slot(self, s: _Slot, *, graceful: bool) -> None:
        raise NotImplementedError

    def _send(self, s: _Slot, batch: list[tuple[int, _Task]]) -> None:
        raise NotImplementedError

    def _step(self) -> None:
        """One round of the dispatcher loop: wait for a worker event, handle it."""
        raise NotImplementedError

    def wake(self) -> None:
        """Wake the dispatcher (a sample was submitted, or the pool is closing)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        self.slots = [self._start_worker() for _ in range(self.sizing.num_workers)]
        self.ledger.workers_hwm = len(self.slots)
        self.thread = threading.Thread(target=self._run, name="RewardPool", daemon=True)
        self.thread.start()

    def _running(self) -> bool:
        return not self.ledger.closed and self.ledger.fatal is None

    def _run(self) -> None:
        """The dispatcher loop; an unexpected failure makes gather() raise, never hang."""
        try:
            while self._running():
                self._scale_down()
                self._dispatch()
                self._scale_up()
                self._step()
        except Exception as e:
            with self.ledger.lock:
                if not self.ledger.closed:
                    self.ledger.fatal = f"RewardPool dispatcher failed: {type(e).__name__}: {e}"
                self.ledger.cond.notify_all()

    def close(self) -> None:
        """Stop the dispatcher, then every worker (the ledger is already marked closed)."""
        self.wake()
        if self.thread is not None:
            self.thread.join(timeout=10)
        for s in self.slots:
            self._stop_slot(s, graceful=True)
        self.slots = []

    # ------------------------------------------------------------------ dispatching

    def _dispatch(self) -> None:
        for s in self.slots:
            if not s.ready or s.task is not None:
                continue
            with self.ledger.lock:
                batch = self.ledger.take(self.sizing.batch_size)
            if not batch:
                return
            s.task = (tuple(task_id for task_id, _ in batch), time.perf_counter())
            self._send(s, batch)

    def _deadline(self, s: _Slot) -> float:
        """When the batch on ``s`` times out: ``timeout_s`` per sample after its dispatch."""
        assert s.task is not None
        return s.task[1] + self.sizing.timeout_s * len(s.task[0])

    def _deadline_wait(self, default: float) -> float:
        """Seconds until the next batch's timeout or surplus worker's idle limit."""
        now = time.perf_counter()
        wait_s = min((self._deadline(s) - now for s in self.slots if s.task), default=default)
        return max(min(wait_s, self._next_idle_deadline() - now), 0.0)

    def _timed_out(self, s: _Slot) -> bool:
        return s.task is not None and time.perf_counter() > self._deadline(s)

    def _finish(
        self, s: _Slot, task_ids: Sequence[int], results: Sequence[tuple[str, float, float, str]]
    ) -> None:
        """Worker ``s`` returned the scores of the batch ``task_ids``."""
        if s.task is not None and s.task[0] == tuple(task_ids):
            s.task = None
        s.ref, s.idle_since = None, time.perf_counter()
        with self.ledger.lock:
            for task_id, result in zip(task_ids, results):
                self.ledger.record(task_id, *result)

    def _replace(self, i: int, status: str, err: str) -> None:
        """Worker ``i`` died (``status="crash"``: its samples are retried, up to ``max_retries``)
        or ran past the timeout (``"timeout"``: its samples score 0); start another in its place.
        The batch's busy time is split evenly among its samples."""
        s = self.slots[i]
        self._stop_slot(s, graceful=False)
        with self.ledger.lock:
            if s.task is not None:
                task_ids, busy = s.task[0], time.perf_counter() - s.task[1]
                if status == "crash":
                    self.ledger.crashed(task_ids, busy, err)
                else:
                    for task_id in task_ids:
                        self.ledger.record(task_id, status, 0.0, busy / len(task_ids), err)
            elif not s.ready:
                self.ledger.startup_failed(s.setup_error or err, self.sizing.max_workers)
            self.ledger.counts["restarts"] += 1
            if not self._running():
                return
        self.slots[i] = self._start_worker()

    # ------------------------------------------------------------------ sizing

    def _scale_up(self) -> None:
        """Start workers while more batches (of ``batch_size`` samples) wait to be dispatched
        than workers are free (idle or still starting), up to ``max_workers``."""
        if len(self.slots) >= self.sizing.max_workers:
            return
        free = sum(1 for s in self.slots if s.task is None)
        with self.ledger.lock:
            waiting = math.ceil(len(self.ledger.queue) / self.sizing.batch_size)
        new = min(waiting - free, self.sizing.max_workers - len(self.slots))
        for _ in range(max(new, 0)):
            slot = self._start_worker()
            with self.ledger.lock:
                self.slots.append(slot)
                self.ledger.counts["scale_ups"] += 1
                self.ledger.workers_hwm = max(self.ledger.workers_hwm, len(self.slots))

    def _surplus_idle(self) -> list[_Slot]:
        """Idle workers beyond ``num_workers``, longest idle first."""
        surplus = len(self.slots) - self.sizing.num_workers
        if surplus <= 0:
            return []
        idle = sorted((s for s in self.slots if s.ready and s.task is None), key=lambda s: s.idle_since)
        return idle[:surplus]

    def _next_idle_deadline(self) -> float:
        """When the next surplus worker reaches ``idle_s`` (``inf`` if none is waiting to)."""
        if len(self.slots) <= self.sizing.num_workers:
            return math.inf
        return min((s.idle_since + self.sizing.idle_s for s in self._surplus_idle()), default=math.inf)

    def _scale_down(self) -> None:
        """Stop surplus workers that have been idle for ``idle_s`` (never below ``num_workers``)."""
        now = time.perf_counter()
        with self.ledger.lock:
            if self.ledger.queue:
                return
        for s in self._surplus_idle():
            if now - s.idle_since < self.sizing.idle_s:
                break  # longest idle first: the rest are younger
            with self.ledger.lock:
                self.slots = [x for x in self.slots if x is not s]
                self.ledger.counts["scale_downs"] += 1
            self._stop_slot(s, graceful=True)


class _ProcessWorkers(_Workers):
    """Worker processes started with ``forkserver`` or ``spawn``, one pipe each."""

    def __init__(
        self, ledger: _Ledger, sizing: _Sizing, verifier: Verifier, start_method: str | None
    ) -> None:
        super().__init__(ledger, sizing)
        method = start_method or (
            "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
        )
        if method not in ("forkserver", "spawn"):
            raise ValueError(f"start_method must be 'forkserver' or 'spawn' (never fork), got {method!r}")
        try:
            self.verifier_bytes = pickle.dumps(verifier)
        except Exception as e:
            raise TypeError(
                f"verifier: the process backend needs a picklable verifier (a module-level function "
                f"or class instance, not a lambda or closure): {e}"
            ) from None
        self.ctx = multiprocessing.get_context(method)
        if method == "forkserver":
            self.ctx.set_forkserver_preload(["trainers.rewards"])
        self.wake_r, self.wake_w = os.pipe()

    def _start_worker(self) -> _Slot:
        parent, child = self.ctx.Pipe(duplex=True)
        proc = self.ctx.Process(
            target=_process_worker_main, args=(child, self.verifier_bytes), name="RewardWorker", daemon=True
        )
        proc.start()
        child.close()
        return _Slot(handle=proc, conn=parent)

    def _stop_slot(self, s: _Slot, *, graceful: bool) -> None:
        if graceful and s.ready and s.handle.is_alive():
            try:
                s.conn.send(None)
            except OSError:
                pass
            s.handle.join(timeout=2)
        if s.handle.is_alive():
            s.handle.kill()
        s.handle.join(timeout=5)
        s.conn.close()

    def _send(self, s: _Slot, batch: list[tuple[int, _Task]]) -> None:
        ids = tuple(task_id for task_id, _ in batch)
        try:
            s.conn.send((ids, [t.completion for _, t in batch], [t.prompt for _, t in batch]))
        except OSError:
            pass  # the worker is dead: its sentinel reports it

    def wake(self) -> None:
        os.write(self.wake_w, b"x")

    def close(self) -> None:
        super().close()
        os.close(self.wake_r)
        os.close(self.wake_w)

    def _step(self) -> None:
        objs: list[Any] = [self.wake_r]
        for s in self.slots:
            objs += [s.conn, s.handle.sentinel]
        ready = mpc.wait(objs, timeout=self._deadline_wait(1.0))
        if self.wake_r in ready:
            os.read(self.wake_r, 4096)
        for i, s in enumerate(list(self.slots)):
            dead = s.handle.sentinel in ready
            if s.conn in ready or dead:
                try:
                    while s.conn.poll():
                        self._on_message(s, s.conn.recv())
                except (EOFError, OSError):
                    dead = True
            if dead or not s.handle.is_alive():
                s.handle.join(timeout=1)
                self._replace(i, "crash", f"worker process died (exit code {s.handle.exitcode})")
            elif self._timed_out(s):
                self._replace(i, "timeout", f"ran past timeout_s {self.sizing.timeout_s}; worker killed")
            if not self._running():
                return

    def _on_message(self, s: _Slot, msg: tuple) -> None:
        kind = msg[0]
        if kind == "ready":
            s.ready, s.idle_since = True, time.perf_counter()
        elif kind == "setup_error":
            s.setup_error = msg[1]  # the worker exits next; _replace counts the failure
        else:
            self._finish(s, msg[1], msg[2])

    def pids(self) -> list[int]:
        with self.ledger.lock:
            return [s.handle.pid for s in self.slots]


class _RayWorkers(_Workers):
    """Ray actors with ``max_concurrency=1`` (their methods run on the actor's main thread)."""

    def __init__(self, ledger: _Ledger, sizing: _Sizing, verifier: Verifier, options: dict[str, Any]) -> None:
        super().__init__(ledger, sizing)
        ray = require("ray")
        if not ray.is_initialized():
            raise RuntimeError("backend='ray': call ray.init() before building the RewardPool")
        if options["max_concurrency"] != 1:
            raise ValueError("ray_options: max_concurrency must stay 1 (the verifier needs the main thread)")
        self.ray = ray
        self.verifier = verifier
        self.actor_cls = ray.remote(_RayRewardWorker).options(**options)
        self.event = threading.Event()
        ex = ray.exceptions
        self.crash_errors = tuple(
            getattr(ex, n)
            for n in ("RayActorError", "OutOfMemoryError", "WorkerCrashedError", "NodeDiedError")
            if hasattr(ex, n)
        )

    def _start_worker(self) -> _Slot:
        actor = self.actor_cls.remote(self.verifier)
        return _Slot(handle=actor, ready_ref=actor.ready.remote())

    def _stop_slot(self, s: _Slot, *, graceful: bool) -> None:
        try:
            self.ray.kill(s.handle, no_restart=True)
        except Exception:  # already dead
            pass

    def _send(self, s: _Slot, batch: list[tuple[int, _Task]]) -> None:
        s.ref = s.handle.score_many.remote([t.completion for _, t in batch], [t.prompt for _, t in batch])

    def wake(self) -> None:
        self.event.set()

    def _step(self) -> None:
        self.event.clear()
        refs = [s.ready_ref for s in self.slots if s.ready_ref is not None]
        refs += [s.ref for s in self.slots if s.ref is not None]
        wait_s = min(self._deadline_wait(0.2), 0.05)  # ray.wait cannot watch submit(): poll
        done: set[Any] = set()
        if refs:
            done = set(self.ray.wait(refs, num_returns=1, timeout=wait_s)[0])
        else:
            self.event.wait(timeout=wait_s)
        for i, s in enumerate(list(self.slots)):
            if s.ready_ref is not None and s.ready_ref in done and not self._on_ready(i, s):
                continue
            if s.ref is not None and s.ref in done:
                self._on_result(i, s)
            elif self._timed_out(s):
                self._replace(i, "timeout", f"ran past timeout_s {self.sizing.timeout_s}; actor killed")
            if not self._running():
                return

    def _on_ready(self, i: int, s: _Slot) -> bool:
        """The actor's ready() returned; False if it could not start (it was replaced)."""
        try:
            self.ray.get(s.ready_ref)
        except Exception as e:  # the actor could not start
            self._replace(i, "crash", f"{type(e).__name__}: {e}")
            return False
        s.ready, s.ready_ref, s.idle_since = True, None, time.perf_counter()
        return True

    def _on_result(self, i: int, s: _Slot) -> None:
        task_ids = s.task[0] if s.task else ()
        try:
            results = self.ray.get(s.ref)
        except self.crash_errors as e:  # the actor (or its node) died: retried elsewhere
            self._replace(i, "crash", f"Ray actor died: {type(e).__name__}")
            return
        except Exception as e:  # anything else counts as an error
            results = [("error", 0.0, 0.0, f"{type(e).__name__}: {e}")] * len(task_ids)
        self._finish(s, task_ids, results)


# --------------------------------------------------------------------------- the pool


def _check_pool_args(
    backend: str,
    num_workers: int,
    max_workers: int | None,
    idle_s: float,
    timeout_s: float,
    max_retries: int,
    ray_num_cpus: float,
) -> None:
    def number(v: Any) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool)

    if backend not in BACKENDS:
        raise ValueError(f"backend must be 'inline', 'process' or 'ray', got {backend!r}")
    if not isinstance(num_workers, int) or isinstance(num_workers, bool) or num_workers < 1:
        raise ValueError(f"num_workers must be an int >= 1, got {num_workers!r}")
    if max_workers is not None and (
        not isinstance(max_workers, int) or isinstance(max_workers, bool) or max_workers < num_workers
    ):
        raise ValueError(
            f"max_workers must be None (a fixed pool) or an int >= num_workers ({num_workers}), got {max_workers!r}"
        )
    if not (number(idle_s) and idle_s > 0):
        raise ValueError(f"idle_s must be a number > 0, got {idle_s!r}")
    if not (number(timeout_s) and timeout_s > 0):
        raise ValueError(f"timeout_s must be a number > 0, got {timeout_s!r}")
    if not isinstance(max_retries, int) or isinstance(max_retries, bool) or max_retries < 0:
        raise ValueError(f"max_retries must be an int >= 0, got {max_retries!r}")
    if not (number(ray_num_cpus) and ray_num_cpus >= 0):
        raise ValueError(f"ray_num_cpus must be a number >= 0, got {ray_num_cpus!r}")


def _pool_batch_size(verifier: Verifier, batch_size: int | None) -> int:
    """Samples per verifier call: 1 unless the verifier has ``score_batch``; then ``batch_size``,
    or (None) the verifier's own ``batch_size`` attribute, else 1."""
    if batch_size is not None and (
        not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1
    ):
        raise ValueError(f"batch_size must be None (the verifier's own) or an int >= 1, got {batch_size!r}")
    if not callable(getattr(verifier, "score_batch", None)):
        if batch_size not in (None, 1):
            raise ValueError(
                f"batch_size={batch_size}: the verifier has no score_batch(completions, prompts) "
                "method, so it scores one sample per call"
            )
        return 1
    if batch_size is None:
        own = getattr(verifier, "batch_size", 1)
        batch_size = own if isinstance(own, int) and not isinstance(own, bool) and own >= 1 else 1
    return batch_size


class RewardPool:
    """Score ``(completion, prompt)`` samples with a verifier, concurrently with generation.

    Args:
        verifier: a name in :data:`~trainers.rewards.VERIFIERS` or a callable ``(completion,
            prompt) -> float``. For the process backend it must be picklable (a module-level
            function or an instance of a module-level class, not a lambda); a ``setup()``
            method, if it has one, runs once in each worker before its first sample.
        backend: ``"inline"``: the verifier runs inside :meth:`submit`, in the caller's thread
            (for tests and rules that cost microseconds). ``"process"``: ``num_workers``
            worker processes started with ``start_method`` (``"forkserver"`` by default where
            it exists, else ``"spawn"``; never ``"fork"``, which is unsafe once torch has
            started its threads). ``"ray"``: ``num_workers`` Ray actors; ``ray.init()`` must
            already have been called. Each actor reserves ``ray_num_cpus`` CPUs (default 0:
            verifiers are short and should not hold back the CPUs that trainer and rollout
            actors reserve; give a fraction such as 0.25 to make Ray account for them) and
            ``max_concurrency=1``, so its methods run on the actor's main thread.
        num_workers: processes / actors (ignored inline); with ``max_workers`` the size the pool
            starts at and never shrinks below.
        max_workers: ``None`` (default): the pool keeps ``num_workers`` workers. Otherwise the
            pool **scales with its queue** between ``num_workers`` and ``max_workers``: when
            more samples wait to be dispatched than there are idle workers (those still
            starting count as idle: they take a sample as soon as they are up), it starts the
            difference, up to ``max_workers`` in all; a worker that has had nothing to do for
            ``idle_s`` seconds while the pool is above ``num_workers`` is stopped. Ignored
            inline.
        idle_s: seconds a surplus worker may stay idle before it is stopped (with ``max_workers``).
        timeout_s: the most seconds one sample may take. Past it the sample scores 0.0
            (``timeouts``, never retried: it would time out again); the process and Ray
            backends kill the worker and start another.
        max_retries: how many times a sample whose worker died while scoring it (segfault,
            ``os._exit``, OOM kill) is scored again on a fresh worker before it scores 0.0
            (process and Ray backends; default 1).
        start_method: ``"forkserver"`` or ``"spawn"`` (process backend).
        ray_num_cpus: CPUs each Ray actor reserves (Ray backend).
        ray_options: more ``.options(...)`` for the Ray actors (e.g. a scheduling strategy).
        batch_size: samples per verifier call, for a verifier with a ``score_batch(completions,
            prompts) -> rewards`` method (:class:`~trainers.rewards.RewardModelVerifier`);
            ``None`` (default): the verifier's own ``batch_size`` attribute if it has one, else
            1. A verifier without ``score_batch`` scores one sample per call (``batch_size``
            must then be None or 1). With ``batch_size > 1`` the inline backend queues the
            samples and scores them in batches at :meth:`gather` / :meth:`poll`; a process / Ray
            worker is sent up to ``batch_size`` queued samples in one message. A batch's
            deadline is ``timeout_s`` per sample (``timeout_s x`` its length); past it every
            sample of the batch scores 0.0 (``timeouts`` counts each). A worker that dies on a
            batch is one crash; its samples are queued again and each retried alone. If
            ``score_batch`` raises, the samples are scored one at a time, so an error stays with
            its sample. A batch's verifier seconds are split evenly among its samples
            (``busy_s``, :meth:`busy_by_domain`).

    Keys are any hashables, unique within a round (a round ends with :meth:`gather`); a
    duplicate raises ``ValueError``. :meth:`metrics` counts, over the pool's life: ``scored``
    (samples scored, failures included, each once), ``errors``, ``timeouts``, ``crashes``
    (workers that died while scoring a sample, each death), ``retries`` (samples scored again
    after such a death), ``crash_failures`` (samples that scored 0.0 because their worker died
    on all ``1 + max_retries`` attempts), ``restarts`` (workers replaced), ``busy_s`` (seconds
    spent inside the verifier, crashed attempts included), ``queue_hwm`` (the most samples
    submitted and not yet scored at once) and ``pending`` (now), and the pool's size:
    ``workers`` (now, starting ones included; 0 inline), ``workers_hwm`` (the most at once),
    ``scale_ups`` / ``scale_downs`` (workers started / stopped by the queue-driven sizing;
    replacements of dead workers are ``restarts``). ``recent_errors`` keeps the last 20 error
    messages.

    Sizing example: ``RewardPool(v, backend="process", num_workers=1, max_workers=4,
    idle_s=5.0)`` holds one worker while samples trickle in; a burst of 10 samples starts
    three more (``scale_ups == 3``, ``workers_hwm == 4``), and five seconds after the burst
    is scored the pool is back to one worker (``scale_downs == 3``).
    """

    def __init__(
        self,
        verifier: str | Verifier,
        *,
        backend: str = "inline",
        num_workers: int = 2,
        max_workers: int | None = None,
        idle_s: float = 10.0,
        timeout_s: float = 10.0,
        max_retries: int = 1,
        start_method: str | None = None,
        ray_num_cpus: float = 0.0,
        ray_options: dict[str, Any] | None = None,
        batch_size: int | None = None,
    ) -> None:
        _check_pool_args(backend, num_workers, max_workers, idle_s, timeout_s, max_retries, ray_num_cpus)
        self.verifier = get_verifier(verifier)
        self.batch_size = _pool_batch_size(self.verifier, batch_size)
        self.backend = backend
        self.num_workers = num_workers
        self.max_workers = num_workers if max_workers is None else max_workers
        self.idle_s = float(idle_s)
        self.timeout_s = float(timeout_s)
        self.max_retries = max_retries
        self._ledger = _Ledger(max_retries)
        self.recent_errors = self._ledger.recent_errors
        sizing = _Sizing(num_workers, self.max_workers, self.idle_s, self.timeout_s, self.batch_size)
        self._workers: _Workers | None = None
        if backend == "process":
            self._workers = _ProcessWorkers(self._ledger, sizing, self.verifier, start_method)
        elif backend == "ray":
            opts = {"num_cpus": ray_num_cpus, "max_concurrency": 1, **(ray_options or {})}
            self._workers = _RayWorkers(self._ledger, sizing, self.verifier, opts)
        if self._workers is not None:
            self._workers.start()

    # ------------------------------------------------------------------ public API

    def submit(self, key: Hashable, completion: str, prompt: Prompt) -> None:
        """Queue one sample for scoring (returns at once, except inline with ``batch_size`` 1,
        where it scores it)."""
        if not isinstance(completion, str):
            raise TypeError(f"completion must be a str, got {type(completion).__name__}")
        led = self._ledger
        queue = self._workers is not None or self.batch_size > 1
        with led.lock:
            task_id = led.add(key, completion, prompt, queue=queue)
        if self._workers is not None:
            self._workers.wake()
            return
        if queue:
            return  # inline, batched: scored at gather() / poll()
        status, r, dt, err = _run_verifier(self.verifier, completion, prompt)
        if status == "ok" and dt > self.timeout_s:
            status, r, err = "timeout", 0.0, f"took {dt:.3g} s > timeout_s {self.timeout_s}"
        with led.lock:
            led.record(task_id, status, r, dt, err)

    def _score_queued_inline(self) -> None:
        """Inline with ``batch_size > 1``: score the queued samples, ``batch_size`` per call."""
        led = self._ledger
        while self._workers is None:
            with led.lock:
                batch = led.take(self.batch_size)
            if not batch:
                return
            tasks = [t for _, t in batch]
            t0 = time.perf_counter()
            results = _score_items(self.verifier, [t.completion for t in tasks], [t.prompt for t in tasks])
            dt, limit = time.perf_counter() - t0, self.timeout_s * len(batch)
            if dt > limit:
                why = f"the batch of {len(batch)} took {dt:.3g} s > {limit:.3g} s (timeout_s per sample)"
                results = [
                    ("timeout", 0.0, b, why) if st == "ok" else (st, r, b, e) for st, r, b, e in results
                ]
            with led.lock:
                for (task_id, _), result in zip(batch, results):
                    led.record(task_id, *result)

    def gather(self) -> dict[Hashable, float]:
        """Block until every key submitted since the last gather is scored; return them all and
        start a new round. Raises ``RuntimeError`` if workers cannot start at all."""
        self._score_queued_inline()
        led = self._ledger
        with led.cond:
            while led.tasks and led.fatal is None:
                if led.closed:
                    raise RuntimeError("the RewardPool was closed with samples still unscored")
                led.cond.wait(timeout=1.0)
            if led.fatal is not None:
                raise RuntimeError(led.fatal)
            out, led.results, led.round = led.results, {}, set()
            return out

    def poll(self) -> dict[Hashable, float]:
        """The samples scored since the last ``poll`` / ``gather``, without waiting (possibly
        ``{}``). Their keys leave the round, so they may be submitted again; the samples still
        being scored stay for a later ``poll`` or ``gather``. Raises ``RuntimeError`` if
        workers cannot start at all. For consumers that act on each score as it arrives (the
        asynchronous rollout scheduler). Inline with ``batch_size > 1`` it first scores what
        is queued."""
        self._score_queued_inline()
        led = self._ledger
        with led.lock:
            if led.fatal is not None:
                raise RuntimeError(led.fatal)
            out, led.results = led.results, {}
            led.round.difference_update(out)
            return out

    def metrics(self) -> dict[str, float]:
        """Counters over the pool's life (class docstring)."""
        led = self._ledger
        with led.lock:
            return {
                **{k: float(v) for k, v in led.counts.items()},
                "busy_s": led.busy_s,
                "queue_hwm": float(led.hwm),
                "pending": float(len(led.tasks)),
                "workers": float(len(self._workers.slots) if self._workers is not None else 0),
                "workers_hwm": float(led.workers_hwm),
            }

    def busy_by_domain(self) -> dict[str, float]:
        """Seconds inside the verifier over the pool's life, per ``prompt.domain`` (``""``: the
        prompts of a run with one domain); they sum to ``metrics()["busy_s"]``."""
        with self._ledger.lock:
            return dict(self._ledger.busy_by_domain)

    def worker_pids(self) -> list[int]:
        """The process ids of the live workers (process backend), for monitoring and tests."""
        if not isinstance(self._workers, _ProcessWorkers):
            raise ValueError(f"worker_pids() is for the process backend, this pool is {self.backend!r}")
        return self._workers.pids()

    def close(self) -> None:
        """Stop the workers (samples not yet scored are dropped). Idempotent."""
        with self._ledger.lock:
            if self._ledger.closed:
                return
            self._ledger.closed = True
            self._ledger.cond.notify_all()
        if self._workers is not None:
            self._workers.close()

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:  # best effort: do not leak worker processes
        try:
            self.close()
        except Exception:
            pass


# --------------------------------------------------------------------------- rollout + reward


def rollout_and_score(
    engine: Any,
    token_prompts: Sequence[Sequence[int]],
    params: Any,
    prompts: Sequence[Prompt],
    pool: RewardPool,
    decode: Callable[[list[int]], str],
) -> tuple[list[Any], list[float]]:
    """Generate with streaming and score each sample the moment it finishes.

    Every finished :class:`~trainers.engines.base.Generation` from
    :func:`~trainers.engines.base.iter_generations` is decoded with ``decode`` and submitted
    to ``pool`` with ``prompts[g.prompt_index]``; once generation ends, :meth:`RewardPool.gather`
    waits for the stragglers. Returns ``(generations, rewards)`` grouped by prompt:
    ``generations[i * n + j]`` is a sample of prompt ``i`` (the order of the ``n`` samples
    within a prompt is the order they finished), ``rewards[k]`` its reward.
    """
    if len(prompts) != len(token_prompts):
        raise ValueError(f"prompts: {len(prompts)} prompts for {len(token_prompts)} token prompts")
    gens: list[Any] = []
    for g in iter_generations(engine, token_prompts, params):
        pool.submit(len(gens), decode(g.token_ids), prompts[g.prompt_index])
        gens.append(g)
    scores = pool.gather()
    order = sorted(range(len(gens)), key=lambda k: gens[k].prompt_index)
    return [gens[k] for k in order], [scores[k] for k in order]
