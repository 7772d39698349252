"""Multi-turn rollout drivers: lock-step batched, environment-level asynchronous, and redundant.

An agentic rollout plays many episodes of text environments with one rollout engine. Three
ways to schedule them, all on the same engine, environments and :class:`EnvRunner`:

* **lock-step** (``mode="lockstep"``, the classic batched loop): every episode of the batch
  generates its turn ``k`` in one ``engine.generate`` call, then every environment steps
  (in parallel, in its worker process), then turn ``k + 1``. A turn lasts as long as the
  slowest environment of the batch, and an episode lost to a failing environment is played
  again in another lock-step round after the batch.
* **environment-level asynchronous** (``mode="async"``; ROLL Flash, Lu et al., 2025,
  arXiv:2510.11345): each episode runs on its own thread -- encode the prompt, submit a
  one-sample request to the :class:`GenerationServer`, step the environment in its worker
  when the action comes back, next turn -- with no barrier between episodes. The server
  batches whatever requests are pending into one ``generate`` call (up to
  ``max_batch_size``), so concurrency still batches on the engine while environment steps run
  off its critical path.
* **redundant** (``mode="async"`` with ``redundancy > 0`` and/or more task seeds than
  ``groups`` needed; ROLL Flash's redundant environment rollout): launch ``len(seeds)`` task
  groups of ``group_size + redundancy`` episodes each, keep the first ``group_size``
  finishers of each of the first ``groups`` groups to complete, cancel the rest.

**Faults.** Every environment call goes through :class:`~trainers.envs.runner.EnvRunner`
with a deadline. An episode whose environment hangs (``hang``), raises (``error``) or whose
process dies (``died``) is dropped, its worker replaced, and a replacement episode of the same
task is launched (asynchronously at once; in lock-step in the next round). Nothing waits on a
failed environment longer than the deadline. A group that keeps failing (``max_attempts``
episodes launched) is abandoned and a spare task seed takes its place.

**Staleness per turn.** With ``version_floor`` (a callable giving the oldest admissible policy
version; the asynchronous trainer passes ``current version - max_staleness``), each turn
records the ``policy_version`` of the weights that generated it, and an episode is aborted
(``stale``) and replaced as soon as *any* of its turns falls below the floor -- checked before
every turn and when the action comes back, not only when the trajectory is consumed.

**Attribution.** Each episode owns its token context, its environment slot and its
:class:`~rollkit.trajectory.Turn` list; generation requests are matched to episodes by future,
and the driver checks that every returned sample's ``prompt_ids`` is the context the episode
sent. Metrics (counts per call of :meth:`EnvRollout.collect`): ``env/hang``, ``env/error``,
``env/died``, ``env/replaced`` (replacement episodes launched), ``env/cancelled`` (running
episodes cancelled once their group or the batch was complete), ``rollout/stale``,
``rollout/launched``, ``rollout/abandoned_groups``, ``rollout/discarded`` (finished episodes of
groups that were not needed, or abandoned); every launched episode is counted exactly once as
kept, failed (hang / error / died / stale), cancelled or discarded.
"""

from __future__ import annotations

import dataclasses
import itertools
import queue
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Sequence
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass, field
from typing import Any

from rollkit.trajectory import TrajectoryBatch, Turn, build_batch
from trainers.engines.base import Generation, SamplingParams
from trainers.envs.runner import EnvResult, EnvRunner
from trainers.envs.trajectory import TurnEncoder
from trainers.envs.wrappers import StateIdEnv

__all__ = ["MODES", "EnvRollout", "EpisodeRecord", "GenerationServer", "RolloutResult"]

#: the scheduling modes of :meth:`EnvRollout.collect`
MODES = ("lockstep", "async")
_ROLLOUT_IDS = itertools.count()
#: statuses of a finished :class:`EpisodeRecord` that drop it and launch a replacement
FAILURES = ("hang", "error", "died", "stale")


# --------------------------------------------------------------------------- generation server


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
    params' ``max_tokens``). With ``params.seed`` set, the ``i``-th engine call uses seed
    ``params.seed + i`` (which requests share a call depends on timing, so asynchronous
    samples are random but not reproducible; lock-step's :meth:`generate` is).

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
        self._calls = itertools.count()
        self._thread: threading.Thread | None = None
        self._closed = False
        #: ``calls`` (engine calls), ``requests``, ``cancelled`` (dropped before generation)
        self.stats: dict[str, int] = {"calls": 0, "requests": 0, "cancelled": 0}

    @property
    def policy_version(self) -> int:
        return int(getattr(self.engine, "policy_version", 0))

    def _seeded(self, params: SamplingParams) -> SamplingParams:
        call = next(self._calls)
        self.stats["calls"] += 1
        seed = None if params.seed is None else (params.seed + call) % (2**63)
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
                    gens = self.engine.generate([r.context for r in batch], self._seeded(batch[0].params))
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
            gens = self.engine.generate([list(c) for c in contexts], self._seeded(params))
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


# --------------------------------------------------------------------------- episodes


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
class RolloutResult:
    """What :meth:`EnvRollout.collect` kept: ``groups x group_size`` finished episodes, grouped
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


@dataclass
class _Group:
    index: int
    seed: int
    kept: list[EpisodeRecord] = field(default_factory=list)
    running: dict[int, EpisodeRecord] = field(default_factory=dict)
    launched: int = 0
    closed: bool = False


class _Control:
    """Shared state of one collect call: cancellations and the version floor."""

    def __init__(self, version_floor: Callable[[], int] | None) -> None:
        self.version_floor = version_floor
        self.cancelled: set[int] = set()
        self.events: queue.Queue[EpisodeRecord] = queue.Queue()

    def floor(self) -> int | None:
        return None if self.version_floor is None else int(self.version_floor())

    def stale(self, rec: EpisodeRecord) -> bool:
        f = self.floor()
        return f is not None and bool(rec.versions) and min(rec.versions) < f


class EnvRollout:
    """Plays episodes of one environment with one rollout engine (module docstring).

    Args:
        engine: the rollout engine (wrapped in a :class:`GenerationServer`), or a server.
        encoder: a :class:`~trainers.envs.trajectory.TurnEncoder` (text -> token turns).
        env: a registered environment name, ``"module:attr"`` or a picklable class.
        env_kwargs: its keyword arguments.
        max_turns: the most turns per episode (``None``: until the environment ends it).
        max_context: the most tokens of an episode, prompt included (``None``: no limit).
        runner: the :class:`EnvRunner` (default: a new one with ``deadline_s``).
        deadline_s: per environment call (when the runner is built here).
        max_batch_size: the most requests per engine call in ``async`` mode.

    Environments run in the runner's worker processes, one per concurrent episode, reused
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
        runner: EnvRunner | None = None,
        deadline_s: float = 30.0,
        start_method: str = "forkserver",
        max_batch_size: int | None = None,
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
        self._own_runner = runner is None
        self.runner = runner or EnvRunner(deadline_s=deadline_s, start_method=start_method, max_threads=64)
        self._tok_lock = threading.Lock()  # HF fast tokenizers are not safe to share across threads
        self._slot_lock = threading.Lock()
        self._free: list[Hashable] = []
        self._slot_ids = itertools.count()
        self._prefix = f"r{next(_ROLLOUT_IDS)}-"  # slot ids stay unique when a runner is shared
        self._uids = itertools.count()

    # ------------------------------------------------------------------ slots

    def _acquire(self) -> Hashable:
        with self._slot_lock:
            if self._free:
                return self._free.pop()
            slot = f"{self._prefix}env-{next(self._slot_ids)}"
            self.runner.add(slot, StateIdEnv, env=self.env, env_kwargs=self.env_kwargs)
            return slot

    def _release(self, slot: Hashable) -> None:
        with self._slot_lock:
            self._free.append(slot)

    def prestart(self, n: int) -> None:
        """Start environment workers until at least ``n`` exist and wait until they are ready
        (each is reset once), so that a timed rollout does not pay for process start-up."""
        with self._slot_lock:
            new = []
            while len(self.runner) < n:
                slot = f"{self._prefix}env-{next(self._slot_ids)}"
                self.runner.add(slot, StateIdEnv, env=self.env, env_kwargs=self.env_kwargs)
                self._free.append(slot)
                new.append(slot)
        if new:
            self.runner.run([(s, "reset", 0) for s in new])

    @property
    def num_env_workers(self) -> int:
        return len(self.runner)

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
            begun = self._begin(rec, self.runner.reset(slot, rec.seed))
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
                floor = ctl.floor()
                if floor is not None and g.policy_version < floor:
                    rec.status = "stale"
                    return
                with self._tok_lock:
                    text = self.tokenizer.decode(g.token_ids, skip_special_tokens=True)
                nxt = self._apply(rec, context, obs_ids, state_id, g, text, self.runner.step(slot, text))
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
    ) -> RolloutResult:
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
            version_floor: per-turn staleness bound (module docstring).
            max_attempts: the most episodes launched for one group before it is abandoned
                (default ``3 * (group_size + redundancy)``).

        Returns:
            A :class:`RolloutResult`; raises ``RuntimeError`` when the spare seeds run out or an
            episode crashed (engine error, context too small), ``ValueError`` on bad arguments.
        """
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
        counts = dict.fromkeys(
            ("hang", "error", "died", "stale", "replaced", "cancelled", "launched", "abandoned", "discarded"),
            0,
        )
        t0 = time.perf_counter()
        server0 = dict(self.server.stats)
        if mode == "async":
            done = self._collect_async(
                seeds,
                params,
                groups,
                group_size,
                redundancy,
                launch_groups,
                version_floor,
                max_attempts,
                counts,
            )
        else:
            done = self._collect_lockstep(
                seeds, params, groups, group_size, version_floor, max_attempts, counts
            )
        done.sort(key=lambda g: g.index)
        episodes = [e for g in done for e in g.kept]
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
                "rollout/episodes": float(len(episodes)),
                "rollout/engine_calls": float(calls),
                "rollout/batch_size_mean": (
                    sum(len(e.turns) for g in done for e in g.kept) / max(calls, 1)
                    if mode == "lockstep"
                    else requests / max(calls, 1)
                ),
                "rollout/env_workers": float(self.num_env_workers),
                "time/collect": time.perf_counter() - t0,
            }
        )
        return RolloutResult(
            episodes, [g.index for g in done for _ in g.kept], {g.index: g.seed for g in done}, metrics
        )

    def _launch(self, g: _Group, params: SamplingParams, ctl: _Control, counts: dict[str, int]) -> None:
        rec = EpisodeRecord(uid=next(self._uids), group=g.index, seed=g.seed)
        g.running[rec.uid] = rec
        g.launched += 1
        counts["launched"] += 1
        threading.Thread(
            target=self._play, args=(rec, params, ctl), name=f"episode-{rec.uid}", daemon=True
        ).start()

    def _cancel(self, recs: Iterable[EpisodeRecord], ctl: _Control, counts: dict[str, int]) -> None:
        uids = [r.uid for r in recs]
        ctl.cancelled.update(uids)
        counts["cancelled"] += len(uids)
        self.server.cancel(uids)

    def _collect_async(
        self,
        seeds: list[int],
        params: SamplingParams,
        needed: int,
        group_size: int,
        redundancy: int,
        launch_groups: int,
        version_floor: Callable[[], int] | None,
        max_attempts: int,
        counts: dict[str, int],
    ) -> list[_Group]:
        ctl = _Control(version_floor)
        groups: dict[int, _Group] = {}
        spare = deque(enumerate(seeds))
        complete: list[_Group] = []

        def open_group() -> None:
            index, seed = spare.popleft()
            g = groups[index] = _Group(index, seed)
            for _ in range(group_size + redundancy):
                self._launch(g, params, ctl, counts)

        for _ in range(launch_groups):
            open_group()
        try:
            while len(complete) < needed:
                rec = ctl.events.get()
                g = groups[rec.group]
                g.running.pop(rec.uid, None)
                if rec.status == "crash":
                    raise RuntimeError(f"an episode crashed:\n{rec.error}")
                if g.closed or rec.uid in ctl.cancelled:
                    continue  # counted as cancelled when its group closed
                if rec.status == "done":
                    g.kept.append(rec)
                    if len(g.kept) == group_size:
                        g.closed = True
                        complete.append(g)
                        self._cancel(g.running.values(), ctl, counts)
                        g.running.clear()
                    continue
                counts[rec.status] += 1  # hang / error / died / stale: dropped
                if g.launched < max_attempts:
                    self._launch(g, params, ctl, counts)
                    counts["replaced"] += 1
                elif len(g.kept) + len(g.running) < group_size:  # cannot complete any more
                    g.closed = True
                    counts["abandoned"] += 1
                    counts["discarded"] += len(g.kept)
                    self._cancel(g.running.values(), ctl, counts)
                    g.running.clear()
                    open_now = sum(1 for x in groups.values() if not x.closed)
                    if len(complete) + open_now < needed:
                        if not spare:
                            raise RuntimeError(
                                f"rollout: {counts['abandoned']} task groups abandoned after {max_attempts} "
                                f"attempts each and no spare seeds left (last failure: {rec.status}: {rec.error})"
                            )
                        open_group()
        finally:  # everything still running is no longer needed
            rest = [r for g in groups.values() if not g.closed for r in g.running.values()]
            self._cancel(rest, ctl, counts)
            counts["discarded"] += sum(len(g.kept) for g in groups.values() if not g.closed)
            for g in groups.values():
                g.running.clear()
        return complete[:needed]

    # ------------------------------------------------------------------ lock-step

    def _play_lockstep(self, recs: list[EpisodeRecord], params: SamplingParams, ctl: _Control) -> None:
        """Play ``recs`` together: every turn, one engine call for all, then all environments step."""
        slots = [self._acquire() for _ in recs]
        try:
            now = time.perf_counter()
            for rec, slot in zip(recs, slots):
                rec.slot, rec.started_at = slot, now
            state: dict[int, tuple[list[int], list[int], int]] = {}  # uid -> (context, obs_ids, state_id)
            for rec, res in zip(recs, self.runner.run([(s, "reset", r.seed) for r, s in zip(recs, slots)])):
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
                results = self.runner.run([(r.slot, "step", t) for r, t in zip(active, texts)])
                nxt_active = []
                for r, g, text, res in zip(active, gens, texts, results):
                    context, obs_ids, state_id = state[r.uid]
                    self._check_sample(g, context)
                    if floor is not None and g.policy_version < floor:
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

    def _collect_lockstep(
        self,
        seeds: list[int],
        params: SamplingParams,
        needed: int,
        group_size: int,
        version_floor: Callable[[], int] | None,
        max_attempts: int,
        counts: dict[str, int],
    ) -> list[_Group]:
        ctl = _Control(version_floor)
        groups = [_Group(i, s) for i, s in enumerate(seeds[:needed])]
        spare = deque(list(enumerate(seeds))[needed:])
        while True:
            todo = [g for g in groups if not g.closed and len(g.kept) < group_size]
            if not todo:
                break
            recs = []
            for g in todo:
                for _ in range(group_size - len(g.kept)):
                    recs.append(EpisodeRecord(uid=next(self._uids), group=g.index, seed=g.seed))
                    g.launched += 1
                    counts["launched"] += 1
                    counts["replaced"] += g.launched > group_size  # beyond the originals
            self._play_lockstep(recs, params, ctl)
            by_index = {g.index: g for g in groups}
            for rec in recs:
                g = by_index[rec.group]
                if rec.status == "done":
                    g.kept.append(rec)
                else:
                    counts[rec.status] += 1
            for g in list(todo):
                if len(g.kept) < group_size and g.launched + (group_size - len(g.kept)) > max_attempts:
                    g.closed = True
                    counts["abandoned"] += 1
                    counts["discarded"] += len(g.kept)
                    groups.remove(g)
                    if not spare:
                        raise RuntimeError(
                            f"rollout: {counts['abandoned']} task groups abandoned after {max_attempts} "
                            "attempts each and no spare seeds left"
                        )
                    index, seed = spare.popleft()
                    groups.append(_Group(index, seed))
        return groups

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Stop the generation server and (if built here) the environment workers."""
        self.server.close()
        if self._own_runner:
            self.runner.close()

    def __enter__(self) -> EnvRollout:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
