"""Rule-based verifiers and reward workers that score samples as generations finish.

A **verifier** maps one completion to a scalar reward::

    Verifier = Callable[[str, Prompt], float]     # (completion text, prompt) -> reward

where the :class:`~trainers.data.Prompt` carries the ground truth (``.answer``) and its
``.data_source``. :data:`VERIFIERS` names the built-in ones (``"exact_match"``: the last
number of the completion equals the answer; ``"math_verify"``: Hugging Face's Math-Verify
parses the answer and the completion into sympy and compares them); :data:`VERIFIER_FACTORIES`
names those built from settings (``"llm_judge"``: a judge model grades the completion,
:mod:`trainers.judge`); :func:`get_verifier` resolves a name or passes a callable through.

A :class:`RewardPool` runs a verifier on worker processes (or Ray actors, or inline) so that
the rollout loop can hand each sample over the moment it is generated
(:func:`trainers.engines.base.iter_generations`) and collect every reward at the end of the
rollout: scoring overlaps generation instead of following it (:func:`rollout_and_score`)::

    submit(key, completion, prompt)   non-blocking; keys unique within a round
    gather() -> {key: reward}         blocks until every submitted key is scored; starts a new round

Failure semantics (every backend): a verifier that raises, returns something that is not a
finite number, or runs past ``timeout_s`` scores ``0.0`` and is counted (``errors`` /
``timeouts`` in :meth:`RewardPool.metrics`); a worker that dies (segfault, ``os._exit``,
OOM kill) is replaced, and the sample it was scoring scores ``0.0`` (``crashes``). A key is
never lost and the trainer never sees the exception. The process and Ray backends *kill* a
worker whose sample runs past ``timeout_s`` (a verifier stuck in C code, e.g. sympy expanding
``9^(9^(9^9))``, cannot be interrupted any other way) and start a replacement; the inline
backend cannot interrupt its own thread, so it scores an over-long sample ``0.0`` after it
returns.

The process and Ray pools can size themselves to their queue (``max_workers``): they start
workers while more samples wait to be dispatched than workers are free, and stop a worker
that has been idle ``idle_s`` seconds, never going below ``num_workers`` or above
``max_workers`` (:class:`RewardPool`; ``scale_ups`` / ``scale_downs`` in its metrics).

Math-Verify guards its own parsing and comparison with ``signal.alarm``, which only works in
the main thread of a process. Pool workers run every sample in their main thread (the process
backend's workers are single-threaded; a Ray actor with the default ``max_concurrency=1`` runs
its methods on the worker's main thread), and there :class:`MathVerifier` turns those alarms
on (``timeout_s`` seconds each). Everywhere else (the inline backend, or any thread that is
not a pool worker's main thread) it calls Math-Verify with its timeouts disabled
(``parse(..., parsing_timeout=None)``, ``verify(..., timeout_seconds=None)``), so it never
installs a ``SIGALRM`` handler in the trainer; the pool's ``timeout_s`` is the only guard
there.

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

from trainers.data import Prompt, exact_match_reward

__all__ = [
    "VERIFIERS",
    "VERIFIER_FACTORIES",
    "MathVerifier",
    "RewardPool",
    "Verifier",
    "exact_match",
    "get_verifier",
    "llm_judge",
    "math_verify_reward",
    "rollout_and_score",
]

Verifier = Callable[[str, Prompt], float]

# True inside a RewardPool worker (process or Ray actor): its main thread may use signal.alarm.
_IN_POOL_WORKER = False


def _signal_timeouts_allowed() -> bool:
    return _IN_POOL_WORKER and threading.current_thread() is threading.main_thread()


# --------------------------------------------------------------------------- verifiers


def exact_match(completion: str, prompt: Prompt) -> float:
    """``1.0`` if the last number of ``completion`` equals ``prompt.answer`` as numbers, else ``0.0``
    (:func:`trainers.data.exact_match_reward`).

    >>> exact_match("12+34=46", Prompt("12+34=", "46")), exact_match("46.5", Prompt("q", "46"))
    (1.0, 0.0)
    """
    return exact_match_reward(completion, prompt.answer)


def _import_math_verify() -> Any:
    try:
        import math_verify
    except ImportError as e:
        raise ImportError(
            "the 'math_verify' verifier needs Math-Verify: pip install 'math-verify[antlr4_13_2]==0.9.0' "
            "(see scripts/install.sh)"
        ) from e
    return math_verify


def _as_latex(answer: str) -> str:
    a = str(answer).strip()
    return a if "$" in a or "\\(" in a or "\\[" in a or "\\boxed" in a else f"${a}$"


@dataclass(frozen=True)
class MathVerifier:
    """Math-Verify (Hugging Face, 2025) equivalence of the completion's answer and the gold answer.

    * gold: ``prompt.answer``, wrapped in ``$...$`` unless it already is LaTeX (``$``,
      ``\\(``, ``\\[`` or ``\\boxed``), parsed with Math-Verify's default extraction; an answer
      it cannot parse raises ``ValueError`` (the pool counts it as an error and scores 0).
    * prediction: Math-Verify's ``parse(completion)`` with the LaTeX extraction (a
      ``\\boxed{...}`` answer first, then the last LaTeX expression) and the plain-expression
      extraction (the last number or expression, e.g. ``x=3`` gives 3); nothing extracted
      scores 0.
    * reward: ``1.0`` if ``verify(gold, prediction)`` (symbolic / numeric equality, sets,
      intervals, equations) else ``0.0``.

    ``timeout_s`` (whole seconds) bounds each Math-Verify parse / comparison with its own
    ``signal.alarm`` timeouts, which are used only in the main thread of a pool worker
    (module docstring); elsewhere they are disabled and the caller must bound the time
    (:class:`RewardPool`'s ``timeout_s``). A Math-Verify timeout scores 0 (it is not an
    error: Math-Verify returns "not equal").

    >>> v = MathVerifier()
    >>> v("so \\\\boxed{\\\\frac{1}{2}}", Prompt("q", "0.5")), v("x=3", Prompt("q", "3")), v("7", Prompt("q", "3"))
    (1.0, 1.0, 0.0)
    """

    timeout_s: int = 5

    def __post_init__(self) -> None:
        if not isinstance(self.timeout_s, int) or self.timeout_s < 1:
            raise ValueError(f"timeout_s must be a whole number of seconds >= 1, got {self.timeout_s!r}")

    def setup(self) -> None:
        """Import Math-Verify (and sympy / antlr) once, when a pool worker starts."""
        _import_math_verify()

    def __call__(self, completion: str, prompt: Prompt) -> float:
        mv = _import_math_verify()
        t = self.timeout_s if _signal_timeouts_allowed() else None
        gold = mv.parse(_as_latex(prompt.answer), parsing_timeout=t)
        if not gold:
            raise ValueError(f"math_verify cannot parse the answer {prompt.answer!r}")
        pred = mv.parse(
            completion,
            extraction_config=[mv.LatexExtractionConfig(), mv.ExprExtractionConfig()],
            parsing_timeout=t,
        )
        if not pred:
            return 0.0
        return 1.0 if mv.verify(gold, pred, timeout_seconds=t) else 0.0


math_verify_reward = MathVerifier()

#: name -> verifier, for configs (``RewardPool("math_verify")``).
VERIFIERS: dict[str, Verifier] = {
    "exact_match": exact_match,
    "math_verify": math_verify_reward,
}


def llm_judge(*, judge_model: str = "", **options: Any) -> Verifier:
    """A :class:`trainers.judge.JudgeReward` whose engine is built from ``judge_model`` on first
    use (``""``: the embedded SmolLM2-135M-Instruct, ``"tiny"``: the tiny random Qwen2, else a
    checkpoint directory); ``options`` are its other keyword arguments (``max_tokens``,
    ``invalid_score``, ``template``, ...)."""
    from trainers.judge import JudgeReward

    return JudgeReward(model=judge_model, **options)


#: name -> factory(**options) -> verifier, for verifiers built from settings (a judge model)
#: rather than shared instances: ``get_verifier("llm_judge", judge_model="tiny")``.
VERIFIER_FACTORIES: dict[str, Callable[..., Verifier]] = {
    "llm_judge": llm_judge,
}


def get_verifier(name_or_fn: str | Verifier, **options: Any) -> Verifier:
    """The verifier called ``name_or_fn`` in :data:`VERIFIERS`, a new one from its factory in
    :data:`VERIFIER_FACTORIES` (called with ``options``), or ``name_or_fn`` itself if callable.
    Only factories take ``options``.

    >>> get_verifier("exact_match") is exact_match
    True
    >>> get_verifier("llm_judge", judge_model="tiny", max_tokens=16).max_tokens
    16
    """
    known = sorted({*VERIFIERS, *VERIFIER_FACTORIES})
    if isinstance(name_or_fn, str):
        if name_or_fn in VERIFIER_FACTORIES:
            return VERIFIER_FACTORIES[name_or_fn](**options)
        if name_or_fn not in VERIFIERS:
            raise ValueError(f"verifier: unknown name {name_or_fn!r}; known: {known}")
        if options:
            raise TypeError(f"verifier {name_or_fn!r} takes no options, got {sorted(options)}")
        return VERIFIERS[name_or_fn]
    if callable(name_or_fn):
        if options:
            raise TypeError(
                f"options are for named verifier factories, got {sorted(options)} with a callable"
            )
        return name_or_fn
    raise TypeError(
        f"verifier must be a name in {known} or a callable (completion, prompt) -> float, "
        f"got {type(name_or_fn).__name__}"
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


# --------------------------------------------------------------------------- worker side


def _mark_pool_worker() -> None:
    import trainers.rewards as this  # the real module, even if this code was pickled by value

    this._IN_POOL_WORKER = True


def _process_worker_main(conn: mpc.Connection, verifier_bytes: bytes) -> None:
    """A process-backend worker: set up, then score one sample per message, in the main thread."""
    _mark_pool_worker()
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
        task_id, completion, prompt = msg
        conn.send(("result", task_id, *_run_verifier(verifier, completion, prompt)))


class _RayRewardWorker:
    """A Ray-backend worker (made a Ray actor class by :class:`RewardPool`)."""

    def __init__(self, verifier: Verifier) -> None:
        _mark_pool_worker()
        self.verifier = verifier
        setup = getattr(verifier, "setup", None)
        if callable(setup):
            setup()

    def ready(self) -> bool:
        """True when this method runs on the process's main thread (where signal.alarm works)."""
        return threading.current_thread() is threading.main_thread()

    def score(self, completion: str, prompt: Prompt) -> tuple[str, float, float, str]:
        return _run_verifier(self.verifier, completion, prompt)

    def pid(self) -> int:
        return os.getpid()


# --------------------------------------------------------------------------- the pool


@dataclass
class _Slot:
    """One worker, as the dispatcher sees it."""

    handle: Any  # multiprocessing Process, or a Ray actor handle
    conn: Any = None  # process backend: the parent's end of the pipe
    ready_ref: Any = None  # ray backend: the ready() call in flight
    ready: bool = False
    setup_error: str = ""
    task: tuple[int, float] | None = None  # (task id, dispatch time)
    ref: Any = None  # ray backend: the score() call in flight
    idle_since: float = 0.0  # perf_counter when it became ready or finished its last sample


class RewardPool:
    """Score ``(completion, prompt)`` samples with a verifier, concurrently with generation.

    Args:
        verifier: a name in :data:`VERIFIERS` or a callable ``(completion, prompt) -> float``.
            For the process backend it must be picklable (a module-level function or an
            instance of a module-level class, not a lambda); a ``setup()`` method, if it has
            one, runs once in each worker before its first sample.
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
            (``timeouts``); the process and Ray backends kill the worker and start another.
        start_method: ``"forkserver"`` or ``"spawn"`` (process backend).
        ray_num_cpus: CPUs each Ray actor reserves (Ray backend).
        ray_options: more ``.options(...)`` for the Ray actors (e.g. a scheduling strategy).

    Keys are any hashables, unique within a round (a round ends with :meth:`gather`); a
    duplicate raises ``ValueError``. :meth:`metrics` counts, over the pool's life: ``scored``
    (samples scored, failures included), ``errors``, ``timeouts``, ``crashes`` (samples whose
    worker died), ``restarts`` (workers replaced), ``busy_s`` (seconds spent inside the
    verifier), ``queue_hwm`` (the most samples submitted and not yet scored at once) and
    ``pending`` (now), and the pool's size: ``workers`` (now, starting ones included; 0
    inline), ``workers_hwm`` (the most at once), ``scale_ups`` / ``scale_downs`` (workers
    started / stopped by the queue-driven sizing; replacements of dead workers are
    ``restarts``). ``recent_errors`` keeps the last 20 error messages.

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
        start_method: str | None = None,
        ray_num_cpus: float = 0.0,
        ray_options: dict[str, Any] | None = None,
    ) -> None:
        if backend not in ("inline", "process", "ray"):
            raise ValueError(f"backend must be 'inline', 'process' or 'ray', got {backend!r}")
        if not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"num_workers must be an int >= 1, got {num_workers!r}")
        if max_workers is not None and (
            not isinstance(max_workers, int) or isinstance(max_workers, bool) or max_workers < num_workers
        ):
            raise ValueError(
                f"max_workers must be None (a fixed pool) or an int >= num_workers ({num_workers}), "
                f"got {max_workers!r}"
            )
        if not (isinstance(idle_s, (int, float)) and not isinstance(idle_s, bool) and idle_s > 0):
            raise ValueError(f"idle_s must be a number > 0, got {idle_s!r}")
        if not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
            raise ValueError(f"timeout_s must be a number > 0, got {timeout_s!r}")
        if ray_num_cpus < 0:
            raise ValueError(f"ray_num_cpus must be >= 0, got {ray_num_cpus}")
        self.verifier = get_verifier(verifier)
        self.backend = backend
        self.num_workers = num_workers
        self.max_workers = num_workers if max_workers is None else max_workers
        self.idle_s = float(idle_s)
        self.timeout_s = float(timeout_s)
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._round: set[Hashable] = set()  # keys submitted this round
        self._results: dict[Hashable, float] = {}
        self._tasks: dict[int, tuple[Hashable, str, Prompt]] = {}  # not yet scored
        self._queue: collections.deque[int] = collections.deque()  # not yet dispatched
        self._next_id = 0
        self._counts = dict.fromkeys(
            ("scored", "errors", "timeouts", "crashes", "restarts", "scale_ups", "scale_downs"), 0
        )
        self._workers_hwm = 0
        self._busy_s = 0.0
        self._hwm = 0
        self.recent_errors: collections.deque[str] = collections.deque(maxlen=20)
        self._fatal: str | None = None
        self._closed = False
        self._slots: list[_Slot] = []
        self._thread: threading.Thread | None = None
        self._startup_failures = 0
        if backend == "process":
            method = start_method or (
                "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
            )
            if method not in ("forkserver", "spawn"):
                raise ValueError(f"start_method must be 'forkserver' or 'spawn' (never fork), got {method!r}")
            try:
                self._verifier_bytes = pickle.dumps(self.verifier)
            except Exception as e:
                raise TypeError(
                    f"verifier: the process backend needs a picklable verifier (a module-level function "
                    f"or class instance, not a lambda or closure): {e}"
                ) from None
            self._ctx = multiprocessing.get_context(method)
            if method == "forkserver":
                self._ctx.set_forkserver_preload(["trainers.rewards"])
            self._wake_r, self._wake_w = os.pipe()
            self._slots = [self._start_process() for _ in range(num_workers)]
            self._workers_hwm = num_workers
            self._thread = threading.Thread(target=self._process_loop, name="RewardPool", daemon=True)
            self._thread.start()
        elif backend == "ray":
            from trainers.deps import require

            ray = require("ray")
            if not ray.is_initialized():
                raise RuntimeError("backend='ray': call ray.init() before building the RewardPool")
            self._ray = ray
            opts = {"num_cpus": ray_num_cpus, "max_concurrency": 1, **(ray_options or {})}
            if opts["max_concurrency"] != 1:
                raise ValueError(
                    "ray_options: max_concurrency must stay 1 (the verifier needs the main thread)"
                )
            self._actor_cls = ray.remote(_RayRewardWorker).options(**opts)
            self._wake = threading.Event()
            self._slots = [self._start_actor() for _ in range(num_workers)]
            self._workers_hwm = num_workers
            self._thread = threading.Thread(target=self._ray_loop, name="RewardPool", daemon=True)
            self._thread.start()

    # ------------------------------------------------------------------ public API

    def submit(self, key: Hashable, completion: str, prompt: Prompt) -> None:
        """Queue one sample for scoring (returns at once, except inline where it scores it)."""
        if not isinstance(completion, str):
            raise TypeError(f"completion must be a str, got {type(completion).__name__}")
        with self._lock:
            if self._closed:
                raise RuntimeError("the RewardPool is closed")
            if key in self._round:
                raise ValueError(
                    f"key {key!r} was already submitted in this round (keys must be unique until gather())"
                )
            self._round.add(key)
            task_id = self._next_id
            self._next_id += 1
            self._tasks[task_id] = (key, completion, prompt)
            self._hwm = max(self._hwm, len(self._tasks))
            if self.backend != "inline":
                self._queue.append(task_id)
        if self.backend == "inline":
            status, r, dt, err = _run_verifier(self.verifier, completion, prompt)
            if status == "ok" and dt > self.timeout_s:
                status, r, err = "timeout", 0.0, f"took {dt:.3g} s > timeout_s {self.timeout_s}"
            with self._lock:
                self._record(task_id, status, r, dt, err)
        elif self.backend == "process":
            os.write(self._wake_w, b"x")
        else:
            self._wake.set()

    def gather(self) -> dict[Hashable, float]:
        """Block until every key submitted since the last gather is scored; return them all and
        start a new round. Raises ``RuntimeError`` if workers cannot start at all."""
        with self._cond:
            while self._tasks and self._fatal is None:
                if self._closed:
                    raise RuntimeError("the RewardPool was closed with samples still unscored")
                self._cond.wait(timeout=1.0)
            if self._fatal is not None:
                raise RuntimeError(self._fatal)
            out, self._results, self._round = self._results, {}, set()
            return out

    def poll(self) -> dict[Hashable, float]:
        """The samples scored since the last ``poll`` / ``gather``, without waiting (possibly
        ``{}``). Their keys leave the round, so they may be submitted again; the samples still
        being scored stay for a later ``poll`` or ``gather``. Raises ``RuntimeError`` if
        workers cannot start at all. For consumers that act on each score as it arrives (the
        asynchronous rollout scheduler)."""
        with self._lock:
            if self._fatal is not None:
                raise RuntimeError(self._fatal)
            out, self._results = self._results, {}
            self._round.difference_update(out)
            return out

    def metrics(self) -> dict[str, float]:
        """Counters over the pool's life (class docstring)."""
        with self._lock:
            return {
                **{k: float(v) for k, v in self._counts.items()},
                "busy_s": self._busy_s,
                "queue_hwm": float(self._hwm),
                "pending": float(len(self._tasks)),
                "workers": float(len(self._slots)),
                "workers_hwm": float(self._workers_hwm),
            }

    def worker_pids(self) -> list[int]:
        """The process ids of the live workers (process backend), for monitoring and tests."""
        if self.backend != "process":
            raise ValueError(f"worker_pids() is for the process backend, this pool is {self.backend!r}")
        with self._lock:
            return [s.handle.pid for s in self._slots]

    def close(self) -> None:
        """Stop the workers (samples not yet scored are dropped). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self.backend == "process":
            os.write(self._wake_w, b"x")
        elif self.backend == "ray":
            self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        for s in self._slots:
            self._stop_slot(s, graceful=True)
        self._slots = []
        if self.backend == "process":
            os.close(self._wake_r)
            os.close(self._wake_w)

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:  # best effort: do not leak worker processes
        try:
            self.close()
        except Exception:
            pass

    # ------------------------------------------------------------------ bookkeeping (lock held)

    def _record(self, task_id: int, status: str, reward: float, busy: float, err: str) -> None:
        entry = self._tasks.pop(task_id, None)
        if entry is None:
            return
        key = entry[0]
        self._results[key] = reward if status == "ok" else 0.0
        self._counts["scored"] += 1
        self._busy_s += busy
        if status != "ok":
            self._counts[{"error": "errors", "timeout": "timeouts", "crash": "crashes"}[status]] += 1
            self.recent_errors.append(f"{status} on key {key!r}: {err}")
        self._cond.notify_all()

    def _startup_failed(self, why: str) -> None:
        self._startup_failures += 1
        self.recent_errors.append(f"worker failed to start: {why}")
        if self._startup_failures >= 3 * self.max_workers:
            self._fatal = f"RewardPool: workers keep failing to start ({self._startup_failures} times): {why}"
            self._cond.notify_all()

    # ------------------------------------------------------------------ sizing (dispatcher thread)

    def _start_worker(self) -> _Slot:
        return self._start_process() if self.backend == "process" else self._start_actor()

    def _scale_up(self) -> None:
        """Start workers while more samples wait to be dispatched than workers are free
        (idle or still starting), up to ``max_workers``."""
        if len(self._slots) >= self.max_workers:
            return
        free = sum(1 for s in self._slots if s.task is None)
        with self._lock:
            waiting = len(self._queue)
        new = min(waiting - free, self.max_workers - len(self._slots))
        for _ in range(max(new, 0)):
            slot = self._start_worker()
            with self._lock:
                self._slots.append(slot)
                self._counts["scale_ups"] += 1
                self._workers_hwm = max(self._workers_hwm, len(self._slots))

    def _surplus_idle(self) -> list[_Slot]:
        """Idle workers beyond ``num_workers``, longest idle first."""
        surplus = len(self._slots) - self.num_workers
        if surplus <= 0:
            return []
        idle = sorted((s for s in self._slots if s.ready and s.task is None), key=lambda s: s.idle_since)
        return idle[:surplus]

    def _next_idle_deadline(self) -> float:
        """When the next surplus worker reaches ``idle_s`` (``inf`` if none is waiting to)."""
        if len(self._slots) <= self.num_workers:
            return math.inf
        return min((s.idle_since + self.idle_s for s in self._surplus_idle()), default=math.inf)

    def _scale_down(self) -> None:
        """Stop surplus workers that have been idle for ``idle_s`` (never below ``num_workers``)."""
        now = time.perf_counter()
        with self._lock:
            if self._queue:
                return
        for s in self._surplus_idle():
            if now - s.idle_since < self.idle_s:
                break  # longest idle first: the rest are younger
            with self._lock:
                self._slots = [x for x in self._slots if x is not s]
                self._counts["scale_downs"] += 1
            self._stop_slot(s, graceful=True)

    # ------------------------------------------------------------------ process backend

    def _start_process(self) -> _Slot:
        parent, child = self._ctx.Pipe(duplex=True)
        proc = self._ctx.Process(
            target=_process_worker_main, args=(child, self._verifier_bytes), name="RewardWorker", daemon=True
        )
        proc.start()
        child.close()
        return _Slot(handle=proc, conn=parent)

    def _stop_slot(self, s: _Slot, *, graceful: bool) -> None:
        if self.backend == "ray":
            try:
                self._ray.kill(s.handle, no_restart=True)
            except Exception:  # already dead
                pass
            return
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

    def _replace(self, i: int, status: str, err: str) -> None:
        """Worker ``i`` died or was killed: score its sample 0 (``status``), start another."""
        s = self._slots[i]
        self._stop_slot(s, graceful=False)
        with self._lock:
            if s.task is not None:
                self._record(s.task[0], status, 0.0, time.perf_counter() - s.task[1], err)
            elif not s.ready:
                self._startup_failed(s.setup_error or err)
            self._counts["restarts"] += 1
            if self._fatal is not None or self._closed:
                return
        self._slots[i] = self._start_worker()

    def _dispatch(self, send: Callable[[_Slot, int, str, Prompt], None]) -> None:
        for s in self._slots:
            if not s.ready or s.task is not None:
                continue
            with self._lock:
                if not self._queue:
                    return
                task_id = self._queue.popleft()
                _, completion, prompt = self._tasks[task_id]
            s.task = (task_id, time.perf_counter())
            send(s, task_id, completion, prompt)

    def _process_loop(self) -> None:
        self._guarded(self._process_loop_body)

    def _guarded(self, loop: Callable[[], None]) -> None:
        """Run the dispatcher loop; an unexpected failure makes gather() raise, never hang."""
        try:
            loop()
        except Exception as e:
            with self._lock:
                if not self._closed:
                    self._fatal = f"RewardPool dispatcher failed: {type(e).__name__}: {e}"
                self._cond.notify_all()

    def _process_loop_body(self) -> None:
        def send(s: _Slot, task_id: int, completion: str, prompt: Prompt) -> None:
            try:
                s.conn.send((task_id, completion, prompt))
            except OSError:
                pass  # the worker is dead: its sentinel reports it below

        while not self._closed and self._fatal is None:
            self._scale_down()
            self._dispatch(send)
            self._scale_up()
            now = time.perf_counter()
            wait_s = min((s.task[1] + self.timeout_s - now for s in self._slots if s.task), default=1.0)
            wait_s = min(wait_s, self._next_idle_deadline() - now)
            objs: list[Any] = [self._wake_r]
            for s in self._slots:
                objs += [s.conn, s.handle.sentinel]
            ready = mpc.wait(objs, timeout=max(wait_s, 0.0))
            if self._wake_r in ready:
                os.read(self._wake_r, 4096)
            for i, s in enumerate(list(self._slots)):
                dead = s.handle.sentinel in ready
                if s.conn in ready or dead:
                    try:
                        while s.conn.poll():
                            self._on_message(s, s.conn.recv())
                    except (EOFError, OSError):
                        dead = True
                if dead or not s.handle.is_alive():
                    s.handle.join(timeout=1)
                    code = s.handle.exitcode
                    self._replace(i, "crash", f"worker process died (exit code {code})")
                elif s.task is not None and time.perf_counter() - s.task[1] > self.timeout_s:
                    self._replace(i, "timeout", f"ran past timeout_s {self.timeout_s}; worker killed")
                if self._fatal is not None or self._closed:
                    return

    def _on_message(self, s: _Slot, msg: tuple) -> None:
        kind = msg[0]
        if kind == "ready":
            s.ready, s.idle_since = True, time.perf_counter()
            return
        if kind == "setup_error":
            s.setup_error = msg[1]  # the worker exits next; _replace counts the failure
            return
        with self._lock:
            _, task_id, status, reward, busy, err = msg
            if s.task is not None and s.task[0] == task_id:
                s.task, s.idle_since = None, time.perf_counter()
            self._record(task_id, status, reward, busy, err)

    # ------------------------------------------------------------------ ray backend

    def _start_actor(self) -> _Slot:
        actor = self._actor_cls.remote(self.verifier)
        return _Slot(handle=actor, ready_ref=actor.ready.remote())

    def _ray_loop(self) -> None:
        self._guarded(self._ray_loop_body)

    def _ray_loop_body(self) -> None:
        ray = self._ray

        def send(s: _Slot, task_id: int, completion: str, prompt: Prompt) -> None:
            s.ref = s.handle.score.remote(completion, prompt)

        while not self._closed and self._fatal is None:
            self._scale_down()
            self._dispatch(send)
            self._scale_up()
            self._wake.clear()
            refs = [s.ready_ref for s in self._slots if s.ready_ref is not None]
            refs += [s.ref for s in self._slots if s.ref is not None]
            now = time.perf_counter()
            wait_s = min((s.task[1] + self.timeout_s - now for s in self._slots if s.task), default=0.2)
            wait_s = min(max(wait_s, 0.0), 0.05)  # ray.wait cannot watch submit(): poll
            done: set[Any] = set()
            if refs:
                done = set(ray.wait(refs, num_returns=1, timeout=wait_s)[0])
            else:
                self._wake.wait(timeout=wait_s)
            for i, s in enumerate(list(self._slots)):
                if s.ready_ref is not None and s.ready_ref in done:
                    try:
                        ray.get(s.ready_ref)
                        s.ready, s.ready_ref, s.idle_since = True, None, time.perf_counter()
                    except Exception as e:  # the actor could not start
                        self._replace(i, "crash", f"{type(e).__name__}: {e}")
                        if self._fatal is not None:
                            return
                        continue
                if s.ref is not None and s.ref in done:
                    try:
                        status, reward, busy, err = ray.get(s.ref)
                    except ray.exceptions.RayActorError as e:
                        self._replace(i, "crash", f"Ray actor died: {type(e).__name__}")
                        continue
                    except Exception as e:  # anything else counts as an error
                        status, reward, busy, err = "error", 0.0, 0.0, f"{type(e).__name__}: {e}"
                    task_id = s.task[0] if s.task else -1
                    s.task, s.ref, s.idle_since = None, None, time.perf_counter()
                    with self._lock:
                        self._record(task_id, status, reward, busy, err)
                elif s.task is not None and time.perf_counter() - s.task[1] > self.timeout_s:
                    self._replace(i, "timeout", f"ran past timeout_s {self.timeout_s}; actor killed")


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
    from trainers.engines.base import iter_generations

    if len(prompts) != len(token_prompts):
        raise ValueError(f"prompts: {len(prompts)} prompts for {len(token_prompts)} token prompts")
    gens: list[Any] = []
    for g in iter_generations(engine, token_prompts, params):
        pool.submit(len(gens), decode(g.token_ids), prompts[g.prompt_index])
        gens.append(g)
    scores = pool.gather()
    order = sorted(range(len(gens)), key=lambda k: gens[k].prompt_index)
    return [gens[k] for k in order], [scores[k] for k in order]
