"""The reward pool's worker side: the verifier call with its timing and failures, the worker
processes and Ray actors that run it, the ledger of a round's samples and the worker backends
(:class:`ProcessWorkers`, :class:`RayWorkers`) that :class:`~trainers.rewards.pool.RewardPool`
drives. Guide: ``docs/rewards-workers.md``.
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
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from trainers.data import Prompt
from trainers.deps import require
from trainers.rewards.verifiers import Verifier, mark_pool_worker

__all__ = [
    "COUNTERS",
    "Ledger",
    "ProcessWorkers",
    "RayRewardWorker",
    "RayWorkers",
    "Sizing",
    "Slot",
    "Task",
    "Workers",
    "process_worker_main",
    "run_verifier",
    "score_items",
]


#: the counters of :meth:`~trainers.rewards.pool.RewardPool.metrics`
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


def run_verifier(verifier: Verifier, completion: str, prompt: Prompt) -> tuple[str, float, float, str]:
    """``(status, reward, seconds, error)``; status is ``"ok"`` or ``"error"``."""
    t0 = time.perf_counter()
    try:
        r = float(verifier(completion, prompt))
        if not math.isfinite(r):
            raise ValueError(f"the verifier returned a non-finite reward {r}")
        return "ok", r, time.perf_counter() - t0, ""
    except Exception as e:  # any verifier failure scores 0
        return "error", 0.0, time.perf_counter() - t0, f"{type(e).__name__}: {e}"


def score_items(
    verifier: Verifier, completions: Sequence[str], prompts: Sequence[Prompt]
) -> list[tuple[str, float, float, str]]:
    """``run_verifier``'s result per sample. Several samples and a verifier with ``score_batch``:
    one ``score_batch`` call, its time split evenly among them (a non-finite reward is that
    sample's error); if the call raises, each sample is scored alone, so errors stay per sample."""
    n = len(completions)
    score_batch = getattr(verifier, "score_batch", None)
    if n == 1 or not callable(score_batch):
        return [run_verifier(verifier, c, p) for c, p in zip(completions, prompts)]
    t0 = time.perf_counter()
    try:
        rewards = [float(r) for r in score_batch(list(completions), list(prompts))]
        if len(rewards) != n:
            raise ValueError(f"score_batch returned {len(rewards)} rewards for {n} samples")
    except Exception:  # one at a time: the sample that fails scores 0, the others their reward
        lost = (time.perf_counter() - t0) / n
        alone = [run_verifier(verifier, c, p) for c, p in zip(completions, prompts)]
        return [(st, r, dt + lost, err) for st, r, dt, err in alone]
    share = (time.perf_counter() - t0) / n
    return [
        ("ok", r, share, "")
        if math.isfinite(r)
        else ("error", 0.0, share, f"the verifier returned a non-finite reward {r}")
        for r in rewards
    ]


# --------------------------------------------------------------------------- worker side


def process_worker_main(conn: mpc.Connection, verifier_bytes: bytes) -> None:
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
        conn.send(("result", task_ids, score_items(verifier, completions, prompts)))


class RayRewardWorker:
    """A Ray-backend worker (made a Ray actor class by :class:`RayWorkers`)."""

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
        return run_verifier(self.verifier, completion, prompt)

    def score_many(
        self, completions: list[str], prompts: list[Prompt]
    ) -> list[tuple[str, float, float, str]]:
        return score_items(self.verifier, completions, prompts)

    def pid(self) -> int:
        return os.getpid()


# --------------------------------------------------------------------------- shared state


@dataclass
class Task:
    key: Hashable
    completion: str
    prompt: Prompt
    attempts: int = 0  # dispatches that ended with the worker dying


class Ledger:
    """The samples, results and counters that the caller and the dispatcher thread share; every
    field is guarded by ``lock``."""

    def __init__(self, max_retries: int) -> None:
        self.max_retries = max_retries
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)
        self.round: set[Hashable] = set()  # keys submitted this round
        self.results: dict[Hashable, float] = {}
        self.tasks: dict[int, Task] = {}  # not yet scored
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
        self.tasks[task_id] = Task(key, completion, prompt)
        self.hwm = max(self.hwm, len(self.tasks))
        if queue:
            self.queue.append(task_id)
        return task_id

    def take(self, limit: int = 1) -> list[tuple[int, Task]]:
        """The next samples to dispatch together, up to ``limit`` in queue order (lock held by the
        caller; ``[]`` if none). A sample retried after a crash goes alone, so the sample that
        kills its worker cannot take a batch of others down with it again."""
        out: list[tuple[int, Task]] = []
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
class Slot:
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
class Sizing:
    num_workers: int
    max_workers: int
    idle_s: float
    timeout_s: float
    batch_size: int = 1


class Workers:
    """What the process and Ray backends share: the slots, dispatching queued samples to idle
    workers, replacing dead or timed-out ones (a crash retries the sample), and sizing the pool
    to its queue, run by one dispatcher thread. Subclasses start, stop and watch workers."""

    def __init__(self, ledger: Ledger, sizing: Sizing) -> None:
        self.ledger = ledger
        self.sizing = sizing
        self.slots: list[Slot] = []
        self.thread: threading.Thread | None = None

    # ------------------------------------------------------------------ to implement

    def _start_worker(self) -> Slot:
        raise NotImplementedError

    def _stop_slot(self, s: Slot, *, graceful: bool) -> None:
        raise NotImplementedError

    def _send(self, s: Slot, batch: list[tuple[int, Task]]) -> None:
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

    def _deadline(self, s: Slot) -> float:
        """When the batch on ``s`` times out: ``timeout_s`` per sample after its dispatch."""
        assert s.task is not None
        return s.task[1] + self.sizing.timeout_s * len(s.task[0])

    def _deadline_wait(self, default: float) -> float:
        """Seconds until the next batch's timeout or surplus worker's idle limit."""
        now = time.perf_counter()
        wait_s = min((self._deadline(s) - now for s in self.slots if s.task), default=default)
        return max(min(wait_s, self._next_idle_deadline() - now), 0.0)

    def _timed_out(self, s: Slot) -> bool:
        return s.task is not None and time.perf_counter() > self._deadline(s)

    def _finish(
        self, s: Slot, task_ids: Sequence[int], results: Sequence[tuple[str, float, float, str]]
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

    def _surplus_idle(self) -> list[Slot]:
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


class ProcessWorkers(Workers):
    """Worker processes started with ``forkserver`` or ``spawn``, one pipe each."""

    def __init__(
        self, ledger: Ledger, sizing: Sizing, verifier: Verifier, start_method: str | None
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

    def _start_worker(self) -> Slot:
        parent, child = self.ctx.Pipe(duplex=True)
        proc = self.ctx.Process(
            target=process_worker_main, args=(child, self.verifier_bytes), name="RewardWorker", daemon=True
        )
        proc.start()
        child.close()
        return Slot(handle=proc, conn=parent)

    def _stop_slot(self, s: Slot, *, graceful: bool) -> None:
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

    def _send(self, s: Slot, batch: list[tuple[int, Task]]) -> None:
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

    def _on_message(self, s: Slot, msg: tuple) -> None:
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


class RayWorkers(Workers):
    """Ray actors with ``max_concurrency=1`` (their methods run on the actor's main thread)."""

    def __init__(self, ledger: Ledger, sizing: Sizing, verifier: Verifier, options: dict[str, Any]) -> None:
        super().__init__(ledger, sizing)
        ray = require("ray")
        if not ray.is_initialized():
            raise RuntimeError("backend='ray': call ray.init() before building the RewardPool")
        if options["max_concurrency"] != 1:
            raise ValueError("ray_options: max_concurrency must stay 1 (the verifier needs the main thread)")
        self.ray = ray
        self.verifier = verifier
        self.actor_cls = ray.remote(RayRewardWorker).options(**options)
        self.event = threading.Event()
        ex = ray.exceptions
        self.crash_errors = tuple(
            getattr(ex, n)
            for n in ("RayActorError", "OutOfMemoryError", "WorkerCrashedError", "NodeDiedError")
            if hasattr(ex, n)
        )

    def _start_worker(self) -> Slot:
        actor = self.actor_cls.remote(self.verifier)
        return Slot(handle=actor, ready_ref=actor.ready.remote())

    def _stop_slot(self, s: Slot, *, graceful: bool) -> None:
        try:
            self.ray.kill(s.handle, no_restart=True)
        except Exception:  # already dead
            pass

    def _send(self, s: Slot, batch: list[tuple[int, Task]]) -> None:
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

    def _on_ready(self, i: int, s: Slot) -> bool:
        """The actor's ready() returned; False if it could not start (it was replaced)."""
        try:
            self.ray.get(s.ready_ref)
        except Exception as e:  # the actor could not start
            self._replace(i, "crash", f"{type(e).__name__}: {e}")
            return False
        s.ready, s.ready_ref, s.idle_since = True, None, time.perf_counter()
        return True

    def _on_result(self, i: int, s: Slot) -> None:
        task_ids = s.task[0] if s.task else ()
        try:
            results = self.ray.get(s.ref)
        except self.crash_errors as e:  # the actor (or its node) died: retried elsewhere
            self._replace(i, "crash", f"Ray actor died: {type(e).__name__}")
            return
        except Exception as e:  # anything else counts as an error
            results = [("error", 0.0, 0.0, f"{type(e).__name__}: {e}")] * len(task_ids)
        self._finish(s, task_ids, results)
