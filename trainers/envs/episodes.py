"""Episodes: many episodes of one text environment played with one rollout engine.

:class:`EpisodeRunner` schedules them in one of three ways: **lock-step** (every turn of the
batch is one engine call, then every environment steps), **environment-level asynchronous**
(each episode on its own thread, its turns batched by a
:class:`~trainers.engines.server.GenerationServer`; ROLL Flash, Lu et al., 2025,
arXiv:2510.11345) and **redundant** (more episodes and task groups than needed, the first
finishers kept). Environments run in :class:`~trainers.envs.workers.EnvWorkers` processes with
a deadline per call; an episode whose environment fails is replaced, every turn records the
policy version that wrote it (per-turn staleness), and :meth:`EpisodeRunner.collect` returns
an :class:`EpisodeBatch`. The schedules, faults, staleness, attribution and metrics are
described in ``docs/agentic.md``.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from concurrent.futures import CancelledError
from dataclasses import dataclass, field
from typing import Any, TypeVar

from rollkit.trajectory import TrajectoryBatch, Turn, build_batch, build_turn_batch, context_window
from trainers.engines.base import Generation, SamplingParams
from trainers.engines.server import GenerationServer
from trainers.envs.turns import TurnEncoder
from trainers.envs.workers import EnvResult, EnvWorkers
from trainers.envs.wrappers import StateIdEnv

__all__ = [
    "FAILURES",
    "MODES",
    "AsyncSchedule",
    "EpisodeBatch",
    "EpisodeRecord",
    "EpisodeRunner",
    "LockstepSchedule",
    "VersionFloor",
]

#: the scheduling modes of :meth:`EpisodeRunner.collect`
MODES = ("lockstep", "async")
_RUNNER_IDS = itertools.count()
#: statuses of a finished :class:`EpisodeRecord` that drop it and launch a replacement
FAILURES = ("hang", "error", "died", "stale")
#: the counters of one :meth:`EpisodeRunner.collect` call
_COUNTS = ("hang", "error", "died", "stale", "replaced", "cancelled", "launched", "abandoned", "discarded")


@dataclass
class EpisodeRecord:
    """One launched episode: its task, its turns and text transcript, and how it ended.

    ``status``: ``"running"``, ``"done"`` (played to the end: terminated, truncated, out of
    ``max_turns`` or ``context_full``), ``"hang"`` / ``"error"`` / ``"died"`` (its environment
    failed; ``error`` says how), ``"stale"`` (a turn fell below the version floor),
    ``"cancelled"``, or ``"crash"`` (the driver or the engine raised: a bug, re-raised).
    ``versions[k]`` is the policy version that generated turn ``k``.
    """

    uid: int
    group: int
    seed: int
    slot: Hashable = None
    status: str = "running"
    turns: list[Turn] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    observations: list[str] = field(default_factory=list)
    actions: list[str] = field(default_factory=list)
    terminated: bool = False
    truncated: bool = False
    context_full: bool = False
    error: str | None = None
    incarnation: int = 0
    started_at: float = 0.0
    finished_at: float = 0.0
    env_s: float = 0.0

    @property
    def total_reward(self) -> float:
        return sum(t.reward for t in self.turns)

    @property
    def success(self) -> bool:
        """The episode ended with a positive final reward (FrozenLake / Sokoban: solved)."""
        return self.terminated and bool(self.turns) and self.turns[-1].reward > 0


@dataclass
class EpisodeBatch:
    """What :meth:`EpisodeRunner.collect` kept: ``groups x group_size`` finished episodes, grouped
    (``group_ids[i]`` is the task group of ``episodes[i]``; all episodes of a group share the
    task seed ``seeds[group]``), and the call's metrics."""

    episodes: list[EpisodeRecord]
    group_ids: list[int]
    seeds: dict[int, int]
    metrics: dict[str, float]

    def to_batch(
        self, *, max_context: int | None = None, policy: str = "truncate", pad_token_id: int = 0
    ) -> TrajectoryBatch:
        """:func:`rollkit.trajectory.build_batch` of the kept episodes."""
        return build_batch(
            [e.turns for e in self.episodes],
            self.group_ids,
            max_context=max_context,
            policy=policy,
            pad_token_id=pad_token_id,
        )

    def to_turn_batch(self, *, budget: int | None = None, pad_token_id: int = 0) -> TrajectoryBatch:
        """:func:`rollkit.trajectory.build_turn_batch` of the kept episodes: one row per turn, its
        prompt the context window the model read (``budget``: the runner's ``context_window``)."""
        return build_turn_batch(
            [e.turns for e in self.episodes], self.group_ids, budget=budget, pad_token_id=pad_token_id
        )


@dataclass
class _Group:
    index: int
    seed: int
    kept: list[EpisodeRecord] = field(default_factory=list)
    running: dict[int, EpisodeRecord] = field(default_factory=dict)
    launched: int = 0
    closed: bool = False


class VersionFloor:
    """The per-turn staleness rule of one collect call, in one place.

    ``version_floor`` (a callable, or None for no rule) gives the oldest admissible policy
    version; it is read before every turn and when the turn's action comes back. An episode
    holding a turn older than the floor is ``stale`` (dropped and replaced by the schedule), and
    so is a turn that comes back written by older weights. :class:`EpisodeRunner` and
    ``benchmarks/sim/agentic.py`` both ask this object.

    >>> f = VersionFloor(lambda: 3)
    >>> f.admits(2), f.admits(3), f.admits(2, floor=1)
    (False, True, True)
    >>> rec = EpisodeRecord(uid=0, group=0, seed=0); rec.versions = [2, 4]
    >>> f.stale(rec), VersionFloor(None).stale(rec)
    (True, False)
    """

    def __init__(self, version_floor: Callable[[], int] | None) -> None:
        self.version_floor = version_floor

    def floor(self) -> int | None:
        """The oldest admissible version now (None: no rule)."""
        return None if self.version_floor is None else int(self.version_floor())

    def admits(self, version: int, floor: int | None = None) -> bool:
        """Whether a turn written by ``version`` may be kept: not older than ``floor`` (a floor
        read earlier, as lock-step reads it once per turn; default: the floor now)."""
        f = self.floor() if floor is None else floor
        return f is None or version >= f

    def stale(self, rec: EpisodeRecord) -> bool:
        """Whether ``rec`` holds a turn older than the floor now."""
        return bool(rec.versions) and not self.admits(min(rec.versions))


class _Control(VersionFloor):
    """Shared state of one collect call: the version floor, cancellations and the finished
    records (the threads' events)."""

    def __init__(self, version_floor: Callable[[], int] | None) -> None:
        super().__init__(version_floor)
        self.cancelled: set[int] = set()
        self.events: queue.Queue[EpisodeRecord] = queue.Queue()


@dataclass(frozen=True)
class _Call:
    """The checked arguments of one :meth:`EpisodeRunner.collect` call."""

    seeds: list[int]
    params: SamplingParams
    groups: int
    group_size: int
    mode: str
    redundancy: int
    launch_groups: int
    version_floor: Callable[[], int] | None
    max_attempts: int


def _check_collect(
    seeds: Sequence[int],
    params: SamplingParams,
    groups: int | None,
    group_size: int,
    mode: str,
    redundancy: int,
    launch_groups: int | None,
    version_floor: Callable[[], int] | None,
    max_attempts: int | None,
) -> _Call:
    """The arguments of :meth:`EpisodeRunner.collect`, checked and defaulted (``ValueError``
    naming the first bad one)."""
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
    seeds = [int(s) for s in seeds]
    groups = len(seeds) if groups is None else groups
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1:
        raise ValueError(f"groups: expected an int >= 1, got {groups!r}")
    if len(seeds) < groups:
        raise ValueError(f"seeds: {len(seeds)} task seeds for {groups} groups")
    if len(set(seeds)) != len(seeds):
        raise ValueError("seeds: must be distinct (one task per group)")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size: expected an int >= 1, got {group_size!r}")
    if isinstance(redundancy, bool) or not isinstance(redundancy, int) or redundancy < 0:
        raise ValueError(f"redundancy: expected an int >= 0, got {redundancy!r}")
    launch_groups = len(seeds) if launch_groups is None else launch_groups
    if not groups <= launch_groups <= len(seeds):
        raise ValueError(
            f"launch_groups: expected {groups} <= launch_groups <= {len(seeds)}, got {launch_groups}"
        )
    if mode == "lockstep" and redundancy:
        raise ValueError("redundancy: lock-step rollout has no redundant environments (use mode='async')")
    if params.n != 1:
        raise ValueError(f"params.n: one sample per turn, got n={params.n}")
    max_attempts = 3 * (group_size + redundancy) if max_attempts is None else max_attempts
    if max_attempts < group_size + redundancy:
        raise ValueError(f"max_attempts: must be >= group_size + redundancy, got {max_attempts}")
    return _Call(
        seeds, params, groups, group_size, mode, redundancy, launch_groups, version_floor, max_attempts
    )


class EpisodeRunner:
    """Plays episodes of one environment with one rollout engine (module docstring).

    Args:
        engine: the rollout engine (wrapped in a :class:`GenerationServer`), or a server.
        encoder: a :class:`~trainers.envs.turns.TurnEncoder` (text -> token turns).
        env: a registered environment name, ``"module:attr"`` or a picklable class.
        env_kwargs: its keyword arguments.
        max_turns: the most turns per episode (``None``: until the environment ends it).
        max_context: the most tokens of an episode, prompt included (``None``: no limit).
        workers: the :class:`~trainers.envs.workers.EnvWorkers` to play in (default: new ones
            with ``deadline_s``; pass shared ones to reuse their processes).
        deadline_s: per environment call (when the workers are built here).
        max_batch_size: the most requests per engine call in ``async`` mode.
        context_window: one sample per turn (``rollout.sample_per=turn``): before each action the
            context is the :func:`rollkit.trajectory.context_window` of this many tokens (the
            prompt, then the most recent whole action + observation pairs that fit), so an
            episode goes on past ``max_context`` (which then bounds each turn's context and
            action). ``None``: the context is the whole episode.

    Environments run in the worker processes, one per concurrent episode, reused
    across calls; every worker builds ``StateIdEnv(env, env_kwargs)`` so the GiGPO state id of
    each turn comes back with the observation. Close with :meth:`close` (or ``with``).
    """

    def __init__(
        self,
        engine: Any,
        encoder: TurnEncoder,
        env: str | Callable[..., Any],
        env_kwargs: dict[str, Any] | None = None,
        *,
        max_turns: int | None = None,
        max_context: int | None = None,
        workers: EnvWorkers | None = None,
        deadline_s: float = 30.0,
        start_method: str = "forkserver",
        max_batch_size: int | None = None,
        context_window: int | None = None,
    ) -> None:
        if not isinstance(encoder, TurnEncoder):
            raise TypeError(f"encoder: expected a TurnEncoder, got {type(encoder).__name__}")
        for name, v in (("max_turns", max_turns), ("max_context", max_context)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{name}: expected an int >= 1 or None, got {v!r}")
        self.server = (
            engine
            if isinstance(engine, GenerationServer)
            else GenerationServer(engine, max_batch_size=max_batch_size)
        )
        self.encoder = encoder
        self.tokenizer = encoder.tokenizer
        self.env, self.env_kwargs = env, dict(env_kwargs or {})
        self.max_turns = max_turns
        self.max_context = max_context
        if context_window is not None and (max_context is None or not 0 < context_window < max_context):
            raise ValueError(
                f"context_window: expected an int in (0, max_context={max_context}), got {context_window!r}"
            )
        self.context_window = context_window
        self._own_workers = workers is None
        self.workers = workers or EnvWorkers(deadline_s=deadline_s, start_method=start_method, max_threads=64)
        self._tok_lock = threading.Lock()  # HF fast tokenizers are not safe to share across threads
        self._slot_lock = threading.Lock()
        self._free: list[Hashable] = []
        self._slot_ids = itertools.count()
        self._prefix = f"r{next(_RUNNER_IDS)}-"  # slot ids stay unique when workers are shared
        self._uids = itertools.count()

    # ------------------------------------------------------------------ slots

    def _acquire(self) -> Hashable:
        with self._slot_lock:
            if self._free:
                return self._free.pop()
            slot = f"{self._prefix}env-{next(self._slot_ids)}"
            self.workers.add(slot, StateIdEnv, env=self.env, env_kwargs=self.env_kwargs)
            return slot

    def _release(self, slot: Hashable) -> None:
        with self._slot_lock:
            self._free.append(slot)

    def prestart(self, n: int) -> None:
        """Start environment workers until at least ``n`` exist and wait until they are ready
        (each is reset once), so that a timed rollout does not pay for process start-up."""
        with self._slot_lock:
            new = []
            while len(self.workers) < n:
                slot = f"{self._prefix}env-{next(self._slot_ids)}"
                self.workers.add(slot, StateIdEnv, env=self.env, env_kwargs=self.env_kwargs)
                self._free.append(slot)
                new.append(slot)
        if new:
            self.workers.run([(s, "reset", 0) for s in new])

    @property
    def num_env_workers(self) -> int:
        return len(self.workers)

    # ------------------------------------------------------------------ one episode

    def _limit(self) -> int:
        return self.max_context if self.max_context is not None else 1 << 62

    def _fail(self, rec: EpisodeRecord, res: EnvResult) -> None:
        rec.status, rec.error, rec.incarnation = res.status, res.error, res.incarnation

    def _begin(self, rec: EpisodeRecord, res: EnvResult) -> tuple[list[int], int] | None:
        """Apply a ``reset`` reply: ``(obs_ids, state_id)``, or None after a failure."""
        rec.env_s += res.elapsed_s
        if not res.ok:
            self._fail(rec, res)
            return None
        obs, info = res.value
        rec.observations.append(obs)
        rec.incarnation = res.incarnation
        with self._tok_lock:
            obs_ids = self.encoder.prompt_ids(obs)
        if len(obs_ids) >= self._limit():
            raise ValueError(
                f"max_context: the first prompt has {len(obs_ids)} tokens, no room for an action "
                f"within max_context={self.max_context}"
            )
        return obs_ids, int(info.get("state_id", 0))

    def _apply(
        self,
        rec: EpisodeRecord,
        context: list[int],
        obs_ids: list[int],
        state_id: int,
        g: Generation,
        text: str,
        res: EnvResult,
    ) -> tuple[list[int], int] | None:
        """Apply a ``step`` reply to the episode; ``(next obs_ids, next state_id)`` while it goes on,
        None when it ended (``status`` set)."""
        rec.env_s += res.elapsed_s
        if not res.ok:
            self._fail(rec, res)
            return None
        obs, reward, terminated, truncated, info = res.value
        rec.turns.append(Turn(obs_ids, list(g.token_ids), list(g.logprobs), float(reward), state_id))
        rec.versions.append(int(g.policy_version))
        rec.actions.append(text)
        rec.observations.append(obs)
        rec.terminated, rec.truncated = bool(terminated), bool(truncated)
        if terminated or truncated or (self.max_turns is not None and len(rec.turns) >= self.max_turns):
            rec.status = "done"
            return None
        with self._tok_lock:
            nxt = self.encoder.obs_ids(obs, g.token_ids)
        context += g.token_ids
        if self.context_window is not None:  # one sample per turn: the rolling window
            window = context_window(rec.turns, nxt, self.context_window)
            if window is None:  # not even the prompt and the last exchange fit
                rec.context_full, rec.status = True, "done"
                return None
            context[:] = window
            return nxt, int(info.get("state_id", 0))
        if len(context) + len(nxt) >= self._limit():  # no room for another action
            rec.context_full, rec.status = True, "done"
            return None
        context += nxt
        return nxt, int(info.get("state_id", 0))

    def _check_sample(self, g: Generation, context: list[int]) -> None:
        if list(g.prompt_ids) != context:
            raise RuntimeError("a generation came back for another context: sample attribution is broken")

    def _play(self, rec: EpisodeRecord, params: SamplingParams, ctl: _Control) -> None:
        """Thread body of one asynchronous episode."""
        slot = self._acquire()
        rec.slot, rec.started_at = slot, time.perf_counter()
        try:
            begun = self._begin(rec, self.workers.reset(slot, rec.seed))
            if begun is None:
                return
            obs_ids, state_id = begun
            context = list(obs_ids)
            while True:
                if rec.uid in ctl.cancelled:
                    rec.status = "cancelled"
                    return
                if ctl.stale(rec):
                    rec.status = "stale"
                    return
                fut = self.server.submit(context, params, room=self._limit() - len(context), tag=rec.uid)
                try:
                    g = fut.result()
                except CancelledError:
                    rec.status = "cancelled"
                    return
                self._check_sample(g, context)
                if not ctl.admits(g.policy_version):
                    rec.status = "stale"
                    return
                with self._tok_lock:
                    text = self.tokenizer.decode(g.token_ids, skip_special_tokens=True)
                nxt = self._apply(rec, context, obs_ids, state_id, g, text, self.workers.step(slot, text))
                if nxt is None:
                    if rec.status == "done" and ctl.stale(rec):
                        rec.status = "stale"
                    return
                obs_ids, state_id = nxt
        except BaseException:
            rec.status, rec.error = "crash", traceback.format_exc()
        finally:
            rec.finished_at = time.perf_counter()
            self._release(slot)
            ctl.events.put(rec)

    # ------------------------------------------------------------------ collect

    def collect(
        self,
        seeds: Sequence[int],
        params: SamplingParams,
        *,
        groups: int | None = None,
        group_size: int = 1,
        mode: str = "async",
        redundancy: int = 0,
        launch_groups: int | None = None,
        version_floor: Callable[[], int] | None = None,
        max_attempts: int | None = None,
    ) -> EpisodeBatch:
        """Play until ``groups`` task groups each have ``group_size`` finished episodes.

        Args:
            seeds: task seeds, one per task group (``reset(seed)``); ``async`` launches the
                first ``launch_groups`` at once (``launch_groups > groups`` is redundancy over
                groups), ``lockstep`` the first ``groups``; the others are spares that replace
                abandoned groups.
            params: sampling parameters (``n = 1``; ``max_tokens`` per turn).
            groups: task groups needed (default ``len(seeds)``).
            group_size: episodes kept per group.
            mode: ``"lockstep"`` or ``"async"``.
            redundancy: extra episodes launched per group (``async`` only).
            launch_groups: task groups launched at once in ``async`` mode (default
                ``len(seeds)``; at least ``groups``).
            version_floor: the oldest admissible policy version (a callable, read before every
                turn and when its action comes back); an episode holding an older turn is
                aborted as ``stale`` and replaced.
            max_attempts: the most episodes launched for one group before it is abandoned
                (default ``3 * (group_size + redundancy)``).

        Returns:
            An :class:`EpisodeBatch`; raises ``RuntimeError`` when the spare seeds run out or an
            episode crashed (engine error, context too small), ``ValueError`` on bad arguments.
        """
        call = _check_collect(
            seeds, params, groups, group_size, mode, redundancy, launch_groups, version_floor, max_attempts
        )
        counts = dict.fromkeys(_COUNTS, 0)
        t0 = time.perf_counter()
        server0 = dict(self.server.stats)
        schedule = _collect_async if call.mode == "async" else _collect_lockstep
        done = schedule(self, call, counts)
        done.sort(key=lambda g: g.index)
        episodes = [e for g in done for e in g.kept]
        metrics = self._metrics(call.mode, done, counts, server0)
        metrics["time/collect"] = time.perf_counter() - t0
        return EpisodeBatch(
            episodes, [g.index for g in done for _ in g.kept], {g.index: g.seed for g in done}, metrics
        )

    def _metrics(
        self, mode: str, done: list[_Group], counts: dict[str, int], server0: dict[str, int]
    ) -> dict[str, float]:
        """The metrics of one collect call (``server0``: the server's stats before it)."""
        calls = self.server.stats["calls"] - server0["calls"]
        requests = self.server.stats["requests"] - server0["requests"]
        metrics: dict[str, float] = {
            f"env/{k}": float(counts[k]) for k in ("hang", "error", "died", "replaced", "cancelled")
        }
        metrics.update(
            {
                "rollout/stale": float(counts["stale"]),
                "rollout/launched": float(counts["launched"]),
                "rollout/abandoned_groups": float(counts["abandoned"]),
                "rollout/discarded": float(counts["discarded"]),
                "rollout/episodes": float(sum(len(g.kept) for g in done)),
                "rollout/engine_calls": float(calls),
                "rollout/batch_size_mean": (
                    sum(len(e.turns) for g in done for e in g.kept) / max(calls, 1)
                    if mode == "lockstep"
                    else requests / max(calls, 1)
                ),
                "rollout/env_workers": float(self.num_env_workers),
            }
        )
        return metrics

    def _start(self, rec: EpisodeRecord, params: SamplingParams, ctl: _Control) -> None:
        threading.Thread(
            target=self._play, args=(rec, params, ctl), name=f"episode-{rec.uid}", daemon=True
        ).start()

    def _cancel(self, recs: Iterable[EpisodeRecord], ctl: _Control) -> None:
        uids = [r.uid for r in recs]
        ctl.cancelled.update(uids)
        self.server.cancel(uids)

    # ------------------------------------------------------------------ lock-step

    def _play_lockstep(self, recs: list[EpisodeRecord], params: SamplingParams, ctl: _Control) -> None:
        """Play ``recs`` together: every turn, one engine call for all, then all environments step."""
        slots = [self._acquire() for _ in recs]
        try:
            now = time.perf_counter()
            for rec, slot in zip(recs, slots):
                rec.slot, rec.started_at = slot, now
            state: dict[int, tuple[list[int], list[int], int]] = {}  # uid -> (context, obs_ids, state_id)
            for rec, res in zip(recs, self.workers.run([(s, "reset", r.seed) for r, s in zip(recs, slots)])):
                begun = self._begin(rec, res)
                if begun is not None:
                    state[rec.uid] = (list(begun[0]), begun[0], begun[1])
            active = [r for r in recs if r.uid in state]
            while active:
                floor = ctl.floor()
                for r in active:
                    if ctl.stale(r):
                        r.status = "stale"
                active = [r for r in active if r.status == "running"]
                if not active:
                    break
                contexts = [state[r.uid][0] for r in active]
                gens = self.server.generate(contexts, params, [self._limit() - len(c) for c in contexts])
                with self._tok_lock:
                    texts = [self.tokenizer.decode(g.token_ids, skip_special_tokens=True) for g in gens]
                results = self.workers.run([(r.slot, "step", t) for r, t in zip(active, texts)])
                nxt_active = []
                for r, g, text, res in zip(active, gens, texts, results):
                    context, obs_ids, state_id = state[r.uid]
                    self._check_sample(g, context)
                    if not ctl.admits(g.policy_version, floor):
                        r.status = "stale"
                        continue
                    nxt = self._apply(r, context, obs_ids, state_id, g, text, res)
                    if nxt is not None:
                        state[r.uid] = (context, nxt[0], nxt[1])
                        nxt_active.append(r)
                    elif r.status == "done" and ctl.stale(r):
                        r.status = "stale"
                active = nxt_active
        finally:
            end = time.perf_counter()
            for rec, slot in zip(recs, slots):
                rec.finished_at = end
                self._release(slot)

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Stop the generation server and (if built here) the environment workers."""
        self.server.close()
        if self._own_workers:
            self.workers.close()

    def __enter__(self) -> EpisodeRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --------------------------------------------------------------------------- schedules


_S = TypeVar("_S", bound="_Schedule")


class _Schedule:
    """What both schedules share: the checked call, its counters and the record numbering."""

    mode: str

    def __init__(
        self, call: _Call, counts: dict[str, int] | None = None, uids: Iterator[int] | None = None
    ) -> None:
        self.call = call
        self.counts = dict.fromkeys(_COUNTS, 0) if counts is None else counts
        self._uids = itertools.count() if uids is None else uids

    @classmethod
    def plan(
        cls: type[_S],
        seeds: Sequence[int],
        params: SamplingParams,
        *,
        groups: int | None = None,
        group_size: int = 1,
        redundancy: int = 0,
        launch_groups: int | None = None,
        version_floor: Callable[[], int] | None = None,
        max_attempts: int | None = None,
        uids: Iterator[int] | None = None,
    ) -> _S:
        """A schedule of the arguments of :meth:`EpisodeRunner.collect` with this schedule's
        ``mode``, checked as it checks them; ``uids`` numbers the records (default from 0)."""
        call = _check_collect(
            seeds,
            params,
            groups,
            group_size,
            cls.mode,
            redundancy,
            launch_groups,
            version_floor,
            max_attempts,
        )
        return cls(call, uids=uids)


class AsyncSchedule(_Schedule):
    """The decisions of the ``async`` schedule, free of threads and clocks.

    Which episodes to launch, which to cancel and which task groups are complete: the launched
    groups play at once, a failed episode (a :data:`FAILURES` status) is replaced until its group
    has launched ``max_attempts``, a group that cannot complete any more is abandoned for a spare
    seed, and the first ``groups`` complete groups are kept (their running episodes cancelled).

    A driver launches every record that :meth:`start` and :meth:`finished` return, cancels the
    records they name for cancellation, reports each launched record back to :meth:`finished`
    once it ends (``status`` set), until :attr:`done`; then it cancels what :meth:`close` returns
    and takes :meth:`result`. :meth:`EpisodeRunner.collect` drives it with a thread per
    episode; ``benchmarks/sim/agentic.py`` drives it on a virtual clock.

    >>> from trainers.engines.base import SamplingParams
    >>> s = AsyncSchedule.plan([7, 8, 9], SamplingParams(max_tokens=4), groups=1, redundancy=1, launch_groups=2)
    >>> launch = s.start(); [(r.uid, r.group, r.seed) for r in launch]
    [(0, 0, 7), (1, 0, 7), (2, 1, 8), (3, 1, 8)]
    >>> launch[0].status = "done"
    >>> new, cancel = s.finished(launch[0]); s.done, [r.uid for r in cancel]
    (True, [1])
    >>> [r.uid for r in s.close()], [g.seed for g in s.result()], s.counts["cancelled"]
    ([2, 3], [7], 3)
    """

    mode = "async"

    def __init__(
        self, call: _Call, counts: dict[str, int] | None = None, uids: Iterator[int] | None = None
    ) -> None:
        super().__init__(call, counts, uids)
        self.groups: dict[int, _Group] = {}
        self.complete: list[_Group] = []
        self.cancelled: set[int] = set()
        self._spare = deque(enumerate(call.seeds))
        self._unsent: list[EpisodeRecord] = []  # closed when finished() raised: close() returns them

    @property
    def done(self) -> bool:
        """``groups`` task groups are complete."""
        return len(self.complete) >= self.call.groups

    def start(self) -> list[EpisodeRecord]:
        """The first launches: ``group_size + redundancy`` episodes of each of the first
        ``launch_groups`` task groups."""
        return [rec for _ in range(self.call.launch_groups) for rec in self._open_group()]

    def _open_group(self) -> list[EpisodeRecord]:
        index, seed = self._spare.popleft()
        g = self.groups[index] = _Group(index, seed)
        return [self._new(g) for _ in range(self.call.group_size + self.call.redundancy)]

    def _new(self, g: _Group) -> EpisodeRecord:
        rec = EpisodeRecord(uid=next(self._uids), group=g.index, seed=g.seed)
        g.running[rec.uid] = rec
        g.launched += 1
        self.counts["launched"] += 1
        return rec

    def _close(self, g: _Group) -> list[EpisodeRecord]:
        """Close ``g``; its running episodes, to cancel."""
        g.closed = True
        recs = list(g.running.values())
        g.running.clear()
        self.cancelled.update(r.uid for r in recs)
        self.counts["cancelled"] += len(recs)
        return recs

    def finished(self, rec: EpisodeRecord) -> tuple[list[EpisodeRecord], list[EpisodeRecord]]:
        """Take a launched record that ended: ``(records to launch, records to cancel)``.
        ``RuntimeError`` when it crashed or when a group is abandoned with no spare seed left."""
        g = self.groups[rec.group]
        g.running.pop(rec.uid, None)
        if rec.status == "crash":
            raise RuntimeError(f"an episode crashed:\n{rec.error}")
        if g.closed or rec.uid in self.cancelled:
            return [], []  # counted as cancelled when its group closed
        if rec.status == "done":
            g.kept.append(rec)
            if len(g.kept) < self.call.group_size:
                return [], []
            self.complete.append(g)
            return [], self._close(g)
        self.counts[rec.status] += 1  # hang / error / died / stale: dropped
        if g.launched < self.call.max_attempts:
            self.counts["replaced"] += 1
            return [self._new(g)], []
        if len(g.kept) + len(g.running) >= self.call.group_size:
            return [], []
        # the group cannot complete any more: abandoned, a spare group opened if one is needed
        self.counts["abandoned"] += 1
        self.counts["discarded"] += len(g.kept)
        cancel = self._close(g)
        open_now = sum(1 for x in self.groups.values() if not x.closed)
        if len(self.complete) + open_now >= self.call.groups:
            return [], cancel
        if not self._spare:
            self._unsent = cancel
            raise RuntimeError(
                f"rollout: {self.counts['abandoned']} task groups abandoned after {self.call.max_attempts} "
                f"attempts each and no spare seeds left (last failure: {rec.status}: {rec.error})"
            )
        return self._open_group(), cancel

    def close(self) -> list[EpisodeRecord]:
        """End the call: the episodes still running (to cancel), no longer needed; the kept
        episodes of incomplete groups are counted as discarded."""
        rest = [g for g in self.groups.values() if not g.closed]
        self.counts["discarded"] += sum(len(g.kept) for g in rest)
        cancel, self._unsent = self._unsent + [r for g in rest for r in self._close(g)], []
        return cancel

    def result(self) -> list[_Group]:
        """The complete groups kept, in the order they completed."""
        return self.complete[: self.call.groups]


def _collect_async(runner: EpisodeRunner, call: _Call, counts: dict[str, int]) -> list[_Group]:
    """The ``async`` schedule (:class:`AsyncSchedule`) driven with an episode per thread."""
    schedule = AsyncSchedule(call, counts, runner._uids)
    ctl = _Control(call.version_floor)

    def act(launch: list[EpisodeRecord], cancel: list[EpisodeRecord]) -> None:
        if cancel:
            runner._cancel(cancel, ctl)
        for rec in launch:
            runner._start(rec, call.params, ctl)

    try:
        act(schedule.start(), [])
        while not schedule.done:
            act(*schedule.finished(ctl.events.get()))
    finally:  # everything still running is no longer needed
        act([], schedule.close())
    return schedule.result()


class LockstepSchedule(_Schedule):
    """The decisions of the ``lockstep`` schedule, free of threads and clocks.

    Rounds: each plays the missing episodes of the open task groups together (how is the
    driver's business: :meth:`EpisodeRunner._play_lockstep` makes one engine call per turn for
    all of them, then steps all their environments). After a round, a group that cannot reach
    ``group_size`` kept episodes within ``max_attempts`` launches is abandoned (its kept
    episodes discarded) and a spare seed takes its place; the next round replays what is
    missing. A driver calls :meth:`round`, plays the records, hands them (``status`` set) to
    :meth:`played`, until :attr:`done`, then takes :meth:`result`.
    :meth:`EpisodeRunner.collect` drives it; so does ``benchmarks/sim/agentic.py``.

    >>> from trainers.engines.base import SamplingParams
    >>> s = LockstepSchedule.plan([7, 8, 9], SamplingParams(max_tokens=4), groups=2, group_size=2, max_attempts=3)
    >>> recs = s.round(); [(r.uid, r.seed) for r in recs]
    [(0, 7), (1, 7), (2, 8), (3, 8)]
    >>> for r, status in zip(recs, ["done", "error", "error", "done"]): r.status = status
    >>> s.played(recs); recs = s.round(); [(r.uid, r.seed) for r in recs]
    [(4, 7), (5, 8)]
    >>> recs[0].status, recs[1].status = "done", "error"
    >>> s.played(recs); recs = s.round(); [(r.uid, r.seed) for r in recs]
    [(6, 9), (7, 9)]
    >>> for r in recs: r.status = "done"
    >>> s.played(recs); s.done, [g.seed for g in s.result()]
    (True, [7, 9])
    >>> {k: s.counts[k] for k in ("launched", "error", "replaced", "abandoned", "discarded")}
    {'launched': 8, 'error': 3, 'replaced': 2, 'abandoned': 1, 'discarded': 1}
    """

    mode = "lockstep"

    def __init__(
        self, call: _Call, counts: dict[str, int] | None = None, uids: Iterator[int] | None = None
    ) -> None:
        super().__init__(call, counts, uids)
        self.groups = [_Group(i, s) for i, s in enumerate(call.seeds[: call.groups])]
        self._spare = deque(list(enumerate(call.seeds))[call.groups :])

    def _todo(self) -> list[_Group]:
        return [g for g in self.groups if not g.closed and len(g.kept) < self.call.group_size]

    @property
    def done(self) -> bool:
        """Every task group has ``group_size`` kept episodes."""
        return not self._todo()

    def round(self) -> list[EpisodeRecord]:
        """The next round: the missing episodes of every incomplete group, in group order."""
        recs = []
        for g in self._todo():
            for _ in range(self.call.group_size - len(g.kept)):
                recs.append(EpisodeRecord(uid=next(self._uids), group=g.index, seed=g.seed))
                g.launched += 1
                self.counts["launched"] += 1
                self.counts["replaced"] += g.launched > self.call.group_size  # beyond the originals
        return recs

    def played(self, recs: Sequence[EpisodeRecord]) -> None:
        """Take a played round (every record's ``status`` set): keep the ``done`` episodes, count
        the failures, abandon the groups that cannot complete for spare seeds. ``RuntimeError``
        when a group is abandoned with no spare seed left."""
        by_index = {g.index: g for g in self.groups}
        for rec in recs:
            if rec.status != "done" and rec.status not in FAILURES:
                raise RuntimeError(f"episode {rec.uid}: played with status {rec.status!r}")
        todo = [by_index[i] for i in dict.fromkeys(r.group for r in recs)]
        for rec in recs:
            g = by_index[rec.group]
            if rec.status == "done":
                g.kept.append(rec)
            else:
                self.counts[rec.status] += 1
        size, most = self.call.group_size, self.call.max_attempts
        for g in todo:
            if len(g.kept) < size and g.launched + (size - len(g.kept)) > most:
                g.closed = True
                self.counts["abandoned"] += 1
                self.counts["discarded"] += len(g.kept)
                self.groups.remove(g)
                if not self._spare:
                    raise RuntimeError(
                        f"rollout: {self.counts['abandoned']} task groups abandoned after {most} "
                        "attempts each and no spare seeds left"
                    )
                index, seed = self._spare.popleft()
                self.groups.append(_Group(index, seed))

    def result(self) -> list[_Group]:
        """The task groups kept (abandoned ones left out; spares in the order they opened)."""
        return list(self.groups)


def _collect_lockstep(runner: EpisodeRunner, call: _Call, counts: dict[str, int]) -> list[_Group]:
    """The ``lockstep`` schedule (:class:`LockstepSchedule`) driven by rounds of
    :meth:`EpisodeRunner._play_lockstep`."""
    schedule = LockstepSchedule(call, counts, runner._uids)
    ctl = _Control(call.version_floor)
    while not schedule.done:
        recs = schedule.round()
        runner._play_lockstep(recs, call.params, ctl)
        schedule.played(recs)
    return schedule.result()
