"""Environments in worker processes, with a deadline per call and failures told apart.

An environment is third-party code: it can hang, raise, or take its process down.
:class:`EnvWorkers` keeps every environment in its own worker process and calls ``reset`` /
``step`` over a pipe; every call returns an :class:`EnvResult` whose ``status`` is ``ok``,
``hang`` (no reply within the deadline: the worker is killed), ``error`` (the environment
raised) or ``died`` (the worker process ended), and a failed environment is replaced by a fresh
one. Workers start with ``forkserver`` (default, preloading :mod:`trainers.envs`) or ``spawn``,
never ``fork``. The statuses, replacement and start-up rules are in ``docs/agentic.md``.
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import signal
import threading
import time
import traceback
from collections.abc import Callable, Hashable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

from trainers.envs.registry import make_env

__all__ = ["STATUSES", "EnvResult", "EnvWorkers"]

#: the possible :attr:`EnvResult.status` values
STATUSES = ("ok", "hang", "error", "died")
_METHODS = ("reset", "step")


@dataclass
class EnvResult:
    """The outcome of one ``reset`` / ``step`` call on the environment ``env_id``.

    ``value``: ``(obs, info)`` for ``reset``, ``(obs, reward, terminated, truncated, info)`` for
    ``step`` (``None`` unless ``status == "ok"``). ``incarnation`` counts the replacements of
    the environment before this call (0 for the first worker).
    """

    env_id: Hashable
    method: str
    status: str
    value: Any = None
    error: str | None = None
    elapsed_s: float = 0.0
    incarnation: int = 0

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def _describe(e: BaseException) -> str:
    tb = "".join(traceback.format_exception(type(e), e, e.__traceback__)).rstrip()
    return f"{type(e).__name__}: {e}\n{tb}"


def _worker(conn: Connection, factory: Any, kwargs: dict[str, Any]) -> None:
    """Worker process: build the environment, then serve ``(method, args)`` requests."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    try:
        if isinstance(factory, str):
            env = make_env(factory, **kwargs)
        else:
            env = factory(**kwargs)
    except BaseException as e:  # reported to the parent
        try:
            conn.send(("error", "building the environment failed: " + _describe(e)))
        except OSError:  # the parent is gone or gave up on this worker
            pass
        return
    try:
        conn.send(("ready", None))
    except OSError:
        return
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            break
        if msg is None:
            break
        method, args = msg
        try:
            out = getattr(env, method)(*args)
            conn.send(("ok", out))
        except Exception as e:  # the environment's failure, or an unpicklable result
            try:
                conn.send(("error", _describe(e)))
            except Exception:
                break
    try:
        env.close()
    except Exception:
        pass


def _exit_reason(proc: Any) -> str:
    proc.join(timeout=5.0)
    code = proc.exitcode
    if code is None:
        return "the worker closed its pipe"
    if code < 0:
        try:
            return f"the worker was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"the worker was killed by signal {-code}"
    return f"the worker exited with code {code}"


@dataclass
class _Slot:
    order: int
    factory: Any
    kwargs: dict[str, Any]
    proc: Any = None
    conn: Connection | None = None
    ready: bool = False
    incarnation: int = -1
    lock: threading.Lock = field(default_factory=threading.Lock)


class EnvWorkers:
    """Environments in worker processes, called with a deadline (module docstring).

    Args:
        deadline_s: the longest a ``reset`` / ``step`` may take before it counts as ``hang``.
        start_timeout_s: the longest a worker may take to start and build its environment.
        start_method: ``"forkserver"`` (default) or ``"spawn"``.
        auto_replace: replace an environment after ``hang`` / ``error`` / ``died``.
        max_threads: threads of :meth:`submit` (calls to different environments overlap).

    Thread-safety: calls to *different* environments may come from different threads (each
    environment has its own lock); :meth:`run` calls many environments in parallel from one
    thread. Use it as a context manager, or call :meth:`close`.

    >>> with EnvWorkers(deadline_s=10.0) as workers:
    ...     workers.add("lake-0", "frozenlake", size=3, hole_prob=0.0)
    ...     obs, info = workers.reset("lake-0", seed=0).value
    ...     result = workers.step("lake-0", r"\\boxed{right}")
    >>> result.status, result.value[1:4], workers.metrics["ok"]
    ('ok', (0.0, False, False), 2)
    """

    def __init__(
        self,
        *,
        deadline_s: float = 30.0,
        start_timeout_s: float = 60.0,
        start_method: str = "forkserver",
        auto_replace: bool = True,
        max_threads: int = 8,
    ) -> None:
        for name, v in (("deadline_s", deadline_s), ("start_timeout_s", start_timeout_s)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"{name}: expected a number > 0, got {v!r}")
        if start_method not in ("forkserver", "spawn"):
            raise ValueError(
                f"start_method: expected 'forkserver' or 'spawn' (never 'fork'), got {start_method!r}"
            )
        if isinstance(max_threads, bool) or not isinstance(max_threads, int) or max_threads < 1:
            raise ValueError(f"max_threads: expected an int >= 1, got {max_threads!r}")
        self.deadline_s = float(deadline_s)
        self.start_timeout_s = float(start_timeout_s)
        self.auto_replace = bool(auto_replace)
        self._ctx = mp.get_context(start_method)
        if start_method == "forkserver":
            self._ctx.set_forkserver_preload(["trainers.envs"])
        self._slots: dict[Hashable, _Slot] = {}
        self._order = itertools.count()
        self._table_lock = threading.Lock()
        self._metrics_lock = threading.Lock()
        self._max_threads = max_threads
        self._pool: ThreadPoolExecutor | None = None
        self._closed = False
        #: counts: ``calls``, one per status (``ok``, ``hang``, ``error``, ``died``), ``replaced``
        self.metrics: dict[str, int] = dict.fromkeys(("calls", *STATUSES, "replaced"), 0)

    # ------------------------------------------------------------------ environments

    @property
    def env_ids(self) -> list[Hashable]:
        return list(self._slots)

    def add(self, env_id: Hashable, factory: str | Callable[..., Any], /, **kwargs: Any) -> None:
        """Start a worker that builds ``factory(**kwargs)`` (or ``make_env(factory, **kwargs)``
        for a registered name) as environment ``env_id``; returns without waiting for it."""
        self._check_open()
        if not (isinstance(factory, str) or callable(factory)):
            raise TypeError(
                f"factory: expected a registered name or a callable, got {type(factory).__name__}"
            )
        try:
            hash(env_id)
        except TypeError:
            raise TypeError(f"env_id: must be hashable, got {type(env_id).__name__}") from None
        with self._table_lock:
            if env_id in self._slots:
                raise ValueError(f"env_id: {env_id!r} is already running")
            slot = _Slot(next(self._order), factory, dict(kwargs))
            self._slots[env_id] = slot
        self._start(slot)

    def remove(self, env_id: Hashable) -> None:
        """Stop the worker of ``env_id`` and forget it."""
        slot = self._slot(env_id)
        with slot.lock:
            self._stop(slot, graceful=True)
            with self._table_lock:
                del self._slots[env_id]

    def replace(self, env_id: Hashable) -> None:
        """Kill ``env_id``'s worker and start a fresh one (counted in ``metrics["replaced"]``)."""
        slot = self._slot(env_id)
        with slot.lock:
            self._replace(slot)

    # ------------------------------------------------------------------ calls

    def reset(
        self, env_id: Hashable, seed: int | None = None, *, deadline_s: float | None = None
    ) -> EnvResult:
        """``env.reset(seed)`` in the worker."""
        return self.run([(env_id, "reset", seed)], deadline_s=deadline_s)[0]

    def step(self, env_id: Hashable, action: str, *, deadline_s: float | None = None) -> EnvResult:
        """``env.step(action)`` in the worker."""
        return self.run([(env_id, "step", action)], deadline_s=deadline_s)[0]

    def submit(
        self, env_id: Hashable, method: str, arg: Any = None, *, deadline_s: float | None = None
    ) -> Future:
        """Run one call on a background thread: a ``Future`` of its :class:`EnvResult`
        (``asyncio.wrap_future`` makes it awaitable)."""
        self._check_open()
        self._check_calls([(env_id, method, arg)])
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._max_threads, thread_name_prefix="env-workers")
        return self._pool.submit(lambda: self.run([(env_id, method, arg)], deadline_s=deadline_s)[0])

    def run(
        self, calls: Sequence[tuple[Hashable, str, Any]], *, deadline_s: float | None = None
    ) -> list[EnvResult]:
        """Make several calls at once, each to a different environment, in parallel.

        Args:
            calls: ``(env_id, "reset", seed)`` or ``(env_id, "step", action)`` items.
            deadline_s: per-call deadline, measured from when the call is sent (default: the
                workers').

        Returns:
            One :class:`EnvResult` per call, in the order of ``calls``.
        """
        self._check_open()
        deadline = self.deadline_s if deadline_s is None else deadline_s
        if isinstance(deadline, bool) or not isinstance(deadline, (int, float)) or not deadline > 0:
            raise ValueError(f"deadline_s: expected a number > 0, got {deadline!r}")
        slots = self._check_calls(calls)
        with ExitStack() as stack:
            for s in sorted(slots, key=lambda s: s.order):
                stack.enter_context(s.lock)
            return self._run(calls, slots, float(deadline))

    # ------------------------------------------------------------------ internals

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the EnvWorkers are closed")

    def _slot(self, env_id: Hashable) -> _Slot:
        try:
            return self._slots[env_id]
        except (KeyError, TypeError):
            raise ValueError(f"env_id: no environment {env_id!r}; running: {self.env_ids}") from None

    def _check_calls(self, calls: Sequence[tuple[Hashable, str, Any]]) -> list[_Slot]:
        if isinstance(calls, (str, bytes)) or not isinstance(calls, Sequence):
            raise TypeError(
                f"calls: expected a sequence of (env_id, method, arg), got {type(calls).__name__}"
            )
        seen, slots = set(), []
        for i, call in enumerate(calls):
            if not isinstance(call, tuple) or len(call) != 3:
                raise ValueError(f"calls[{i}]: expected (env_id, method, arg), got {call!r}")
            env_id, method, arg = call
            if method not in _METHODS:
                raise ValueError(f"calls[{i}]: method must be one of {_METHODS}, got {method!r}")
            if method == "step" and not isinstance(arg, str):
                raise TypeError(f"calls[{i}]: a step action must be a str, got {type(arg).__name__}")
            slot = self._slot(env_id)
            if slot.conn is None:
                raise RuntimeError(
                    f"calls[{i}]: environment {env_id!r} was dropped after a failure (auto_replace=False): "
                    "call replace() or remove()"
                )
            if env_id in seen:
                raise ValueError(f"calls[{i}]: environment {env_id!r} is called twice in one batch")
            seen.add(env_id)
            slots.append(slot)
        return slots

    def _count(self, key: str, n: int = 1) -> None:
        with self._metrics_lock:
            self.metrics[key] += n

    def _start(self, slot: _Slot) -> None:
        parent, child = self._ctx.Pipe(duplex=True)
        proc = self._ctx.Process(target=_worker, args=(child, slot.factory, slot.kwargs), daemon=True)
        proc.start()
        child.close()
        slot.proc, slot.conn, slot.ready = proc, parent, False
        slot.incarnation += 1

    def _stop(self, slot: _Slot, *, graceful: bool = False) -> None:
        proc, conn = slot.proc, slot.conn
        slot.proc, slot.conn, slot.ready = None, None, False
        if conn is not None:
            if graceful and proc is not None and proc.is_alive():
                try:
                    conn.send(None)
                except OSError:
                    pass
            conn.close()
        if proc is not None:
            if graceful:
                proc.join(timeout=1.0)
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=5.0)

    def _replace(self, slot: _Slot) -> None:
        self._stop(slot)
        self._start(slot)
        self._count("replaced")

    def _await_ready(self, slots: list[_Slot], failures: dict[int, tuple[str, str, float]]) -> None:
        """Wait (up to ``start_timeout_s``) for the workers that have not reported yet."""
        waiting = {id(s.conn): s for s in slots if not s.ready and s.conn is not None}
        t0 = time.monotonic()
        end = t0 + self.start_timeout_s
        while waiting:
            ready = wait([s.conn for s in waiting.values()], timeout=max(0.0, end - time.monotonic()))
            if not ready:
                for s in waiting.values():
                    failures[id(s)] = (
                        "hang",
                        f"the worker did not start within {self.start_timeout_s}s",
                        0.0,
                    )
                break
            for conn in ready:
                s = waiting.pop(id(conn))
                try:
                    kind, payload = conn.recv()
                except (EOFError, OSError):
                    failures[id(s)] = ("died", "while starting: " + _exit_reason(s.proc), 0.0)
                    continue
                if kind == "ready":
                    s.ready = True
                else:
                    failures[id(s)] = ("error", payload, 0.0)

    def _run(
        self, calls: Sequence[tuple[Hashable, str, Any]], slots: list[_Slot], deadline: float
    ) -> list[EnvResult]:
        failures: dict[int, tuple[str, str, float]] = {}  # id(slot) -> (status, error, elapsed)
        self._await_ready(slots, failures)
        sent: dict[int, float] = {}
        for (_, method, arg), s in zip(calls, slots):
            if id(s) in failures:
                continue
            try:
                s.conn.send((method, (arg,)))
                sent[id(s)] = time.monotonic()
            except (OSError, ValueError):
                failures[id(s)] = ("died", _exit_reason(s.proc), 0.0)
        replies: dict[int, tuple[str, Any, float]] = {}
        pending = {id(s.conn): s for s in slots if id(s) in sent}
        while pending:
            now = time.monotonic()
            end = min(sent[id(s)] for s in pending.values()) + deadline
            ready = wait([s.conn for s in pending.values()], timeout=max(0.0, end - now))
            now = time.monotonic()
            for conn in ready:
                s = pending.pop(id(conn))
                elapsed = now - sent[id(s)]
                try:
                    kind, payload = conn.recv()
                except (EOFError, OSError):
                    failures[id(s)] = ("died", _exit_reason(s.proc), elapsed)
                    continue
                if kind == "ok":
                    replies[id(s)] = ("ok", payload, elapsed)
                else:
                    failures[id(s)] = ("error", payload, elapsed)
            for key, s in list(pending.items()):
                if now - sent[id(s)] >= deadline:
                    del pending[key]
                    failures[id(s)] = (
                        "hang",
                        f"no reply within {deadline}s: the worker was killed",
                        now - sent[id(s)],
                    )

        results = []
        for (env_id, method, _), s in zip(calls, slots):
            incarnation = s.incarnation
            if id(s) in replies:
                status, value, elapsed = replies[id(s)]
                results.append(EnvResult(env_id, method, "ok", value, None, elapsed, incarnation))
            else:
                status, error, elapsed = failures[id(s)]
                results.append(EnvResult(env_id, method, status, None, error, elapsed, incarnation))
                if self.auto_replace:
                    self._replace(s)
                else:
                    self._stop(s)
            self._count("calls")
            self._count(status)
        return results

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Stop every worker (politely, then ``SIGKILL``); idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        for s in list(self._slots.values()):
            with s.lock:
                self._stop(s, graceful=True)
        self._slots.clear()

    def __enter__(self) -> EnvWorkers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __iter__(self) -> Iterator[Hashable]:
        return iter(self.env_ids)

    def __len__(self) -> int:
        return len(self._slots)
