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

import time
from collections.abc import Callable, Hashable, Sequence
from typing import Any

from trainers.data import Prompt
from trainers.engines.base import iter_generations
from trainers.rewards.backends import (
    Ledger,
    ProcessWorkers,
    RayWorkers,
    Sizing,
    Workers,
    run_verifier,
    score_items,
)
from trainers.rewards.verifiers import Verifier, get_verifier

__all__ = ["BACKENDS", "RewardPool", "rollout_and_score"]

BACKENDS = ("inline", "process", "ray")


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
        self._ledger = Ledger(max_retries)
        self.recent_errors = self._ledger.recent_errors
        sizing = Sizing(num_workers, self.max_workers, self.idle_s, self.timeout_s, self.batch_size)
        self._workers: Workers | None = None
        if backend == "process":
            self._workers = ProcessWorkers(self._ledger, sizing, self.verifier, start_method)
        elif backend == "ray":
            opts = {"num_cpus": ray_num_cpus, "max_concurrency": 1, **(ray_options or {})}
            self._workers = RayWorkers(self._ledger, sizing, self.verifier, opts)
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
        status, r, dt, err = run_verifier(self.verifier, completion, prompt)
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
            results = score_items(self.verifier, [t.completion for t in tasks], [t.prompt for t in tasks])
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
        if not isinstance(self._workers, ProcessWorkers):
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
