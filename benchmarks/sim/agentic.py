"""Agentic rollouts on the simulator: multi-turn episodes with environment latency.

An episode is ``turns`` rounds of (generate a turn on a :class:`SimEngine`, then an environment
step whose latency is drawn from ``cost.env``: ROLL Flash / RollArt's Gaussian, mean 10 s, std
1-10 s; with probability ``failure`` the step fails). The agentic trainer's modes
(``trainers/loops/agentic.py``, ROLL Flash section 5.2):

* ``lockstep``: rounds of the real :class:`~trainers.envs.episodes.LockstepSchedule`,
  unmodified (the missing episodes of every open task group, a group abandoned for a spare seed
  after ``max_attempts``); this module plays a round as ``EpisodeRunner._play_lockstep`` does:
  every turn is one batched generation, then every environment steps (two barriers per turn),
  and an episode whose environment step fails leaves the round and is replayed in the next;
* ``env-async``: each episode proceeds alone. The decisions (launch, replace a failed or stale
  episode, abandon a group, keep the first complete groups, cancel the rest) are the real
  :class:`~trainers.envs.episodes.AsyncSchedule`'s, unmodified; this module plays the episodes
  it launches on the virtual clock in place of the runner's threads;
* ``redundant``: env-async with ``ceil((1 + redundancy) groups)`` task groups launched
  (``rollout.num_env_groups``), the first complete ones kept;

and, as the trainer does with ``rollout.max_staleness`` = k >= 1, the next batch collected
while the current one trains, every turn checked against the version floor ``version - k``
(an episode holding an older turn is dropped as stale and replaced by the schedule; the rule
is the runner's :class:`~trainers.envs.episodes.VersionFloor`).
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
import statistics
from dataclasses import dataclass

from benchmarks.sim.clock import VirtualClock
from benchmarks.sim.costs import CostModel
from benchmarks.sim.engine import INF, RunList, SimEngine
from benchmarks.sim.lengths import Lengths
from trainers.engines.base import SamplingParams
from trainers.engines.requests import Request
from trainers.envs.episodes import AsyncSchedule, EpisodeRecord, LockstepSchedule, VersionFloor

__all__ = ["MODES", "AgenticRun", "AgenticSetting", "run_agentic"]

MODES = ("lockstep", "env-async", "redundant")


@dataclass
class AgenticSetting:
    batch: int  # episodes trained per step (groups_per_step x group_size)
    turns: int
    lengths: Lengths  # tokens generated per turn
    cost: CostModel
    engines: int = 1
    prompt_len: int = 512
    obs_len: int = 128  # environment tokens appended per turn
    steps: int = 6
    seed: int = 0
    group_size: int = 1  # episodes kept per task group (rollout.group_size)
    failure: float = 0.0  # probability that one environment step fails (the episode is replaced)


Schedule = AsyncSchedule | LockstepSchedule


class _Episode:
    __slots__ = ("ctx", "rec", "schedule", "turn")

    def __init__(self, rec: EpisodeRecord, schedule: Schedule, ctx: int) -> None:
        self.rec, self.schedule, self.ctx, self.turn = rec, schedule, ctx, 0


class AgenticRun:
    """One simulated run of a mode (module docstring); :meth:`run` returns seconds per step.

    After a run, ``schedules`` holds the collect calls' schedule objects (:class:`AsyncSchedule`
    or :class:`LockstepSchedule`; their ``counts``: launched, stale, error, replaced, cancelled,
    ...), ``rounds`` the lock-step rounds of each call, ``ended`` how each launched
    episode ended (``done`` / ``stale`` / ``error`` / ``cancelled``, or ``running``) and
    ``trained`` the uids trained, in order; :meth:`check` verifies the invariants."""

    def __init__(
        self, s: AgenticSetting, mode: str = "env-async", *, max_staleness: int = 0, redundancy: float = 0.0
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode: expected one of {', '.join(MODES)}, got {mode!r}")
        if s.batch % s.group_size:
            raise ValueError(f"batch: {s.batch} episodes is not a multiple of group_size={s.group_size}")
        if mode == "lockstep" and max_staleness:
            raise ValueError("mode: lockstep is simulated synchronous (max_staleness 0)")
        if max_staleness < 0 or redundancy < 0:
            raise ValueError(f"max_staleness / redundancy: must be >= 0, got {max_staleness} / {redundancy}")
        self.s, self.mode, self.max_staleness = s, mode, max_staleness
        self.groups = s.batch // s.group_size
        self.launch_groups = math.ceil((1 + (redundancy if mode == "redundant" else 0.0)) * self.groups)
        self.clock, self.rng = VirtualClock(), random.Random(s.seed)
        self.engines = [
            SimEngine(self.clock, s.cost.decode, s.lengths, sync_s=s.cost.train.sync_s)
            for _ in range(s.engines)
        ]
        self.version = 0
        self.floor = VersionFloor(self._floor if max_staleness else None)
        self.live: dict[int, _Episode] = {}
        self.envq: list[tuple[float, int, int]] = []  # (done time, tie, uid)
        self.waiting: list[_Episode] = []  # lock-step: the phase's barrier
        self.schedule: Schedule | None = None  # the collect call in progress
        self.schedules: list[Schedule] = []
        self._round: list[EpisodeRecord] = []  # lock-step: the round being played
        self.rounds: list[int] = []  # lock-step: rounds played per collect call
        self.batch: list[EpisodeRecord] | None = None  # the collected batch, not yet trained
        self.ended: dict[int, str] = {}
        self.owner: dict[int, int] = {}  # uid -> index of its collect call
        self.trained: list[int] = []
        self._tie, self._seeds, self._uids = itertools.count(), itertools.count(), itertools.count()

    # ---------------------------------------------------------------- one episode

    def _floor(self) -> int:
        return self.version - self.max_staleness

    def _generate(self, ep: _Episode) -> None:
        uid = ep.rec.uid
        params = SamplingParams(max_tokens=self.s.lengths.natural(uid, ep.turn), ignore_eos=True)
        req = Request(f"e{uid}-{ep.turn}", RunList(1, ep.ctx, key=uid), params)
        req.tag = uid
        min(self.engines, key=lambda e: e.num_running).add([req])

    def _turn(self, ep: _Episode) -> None:
        """Start the next turn of ``ep``, or drop it as stale (the runner checks before a turn)."""
        if self.floor.stale(ep.rec):
            self._end(ep, "stale")
        else:
            self._generate(ep)

    def _generated(self, r: Request) -> None:
        ep = self.live.get(r.tag)
        if ep is None:
            return
        version = min(r.token_versions.values())  # the oldest weights that wrote the turn
        if not self.floor.admits(version):
            self._end(ep, "stale")
            return
        ep.rec.versions.append(version)
        ep.ctx += len(r.token_ids)
        if self.mode == "lockstep":
            self._barrier(ep)
        else:
            self._env_step(ep)

    def _env_step(self, ep: _Episode) -> None:
        done_at = self.clock.now + self.s.cost.env.sample(self.rng)
        heapq.heappush(self.envq, (done_at, next(self._tie), ep.rec.uid))

    def _env_done(self, uid: int) -> None:
        ep = self.live.get(uid)
        if ep is None:
            return
        if self.s.failure and self.rng.random() < self.s.failure:
            self._end(ep, "error")
            return
        ep.turn += 1
        if ep.turn == self.s.turns:
            self._end(ep, "stale" if self.floor.stale(ep.rec) else "done")
        elif self.mode == "lockstep":
            self._barrier(ep)
        else:
            ep.ctx += self.s.obs_len
            self._turn(ep)

    def _barrier(self, ep: _Episode | None) -> None:
        """Lock-step: one phase (generate, or environment step) of every live episode ends
        before the next phase starts (``ep`` None: an episode left the round)."""
        if ep is not None:
            self.waiting.append(ep)
        if not self.waiting or len(self.waiting) < len(self.live):
            return
        eps, self.waiting = self.waiting, []
        for e in eps:
            if len(e.rec.versions) > e.turn:  # generated: the environments step
                self._env_step(e)
            else:
                e.ctx += self.s.obs_len
                self._generate(e)

    def _end(self, ep: _Episode, status: str) -> None:
        rec = ep.rec
        del self.live[rec.uid]
        rec.status = self.ended[rec.uid] = status
        if isinstance(ep.schedule, LockstepSchedule):
            self._lockstep_ended(ep.schedule)
            return
        if ep.schedule is not self.schedule:
            return  # a finished collect call no longer reads its episodes
        launch, cancel = ep.schedule.finished(rec)
        self._cancel(cancel)
        self._launch(launch, ep.schedule)
        if ep.schedule.done:
            self._cancel(ep.schedule.close())
            self.batch = [r for g in ep.schedule.result() for r in g.kept]
            self.schedule = None

    def _lockstep_ended(self, schedule: LockstepSchedule) -> None:
        """An episode of the round ended: the others may be waiting at the barrier for it; the
        round over, the schedule takes it and plays the next one or gives the batch."""
        if self.live:
            self._barrier(None)
            return
        schedule.played(self._round)
        if schedule.done:
            self.batch = [r for g in sorted(schedule.result(), key=lambda g: g.index) for r in g.kept]
            self.schedule = None
        else:
            self._play_round(schedule)

    def _play_round(self, schedule: LockstepSchedule) -> None:
        self.rounds[-1] += 1
        self._round = schedule.round()
        self._launch(self._round, schedule)

    def _launch(self, recs: list[EpisodeRecord], schedule: Schedule) -> None:
        for rec in recs:
            self.ended[rec.uid] = "running"
            self.owner[rec.uid] = len(self.schedules) - 1
            self.live[rec.uid] = _Episode(rec, schedule, self.s.prompt_len)
        for rec in recs:
            ep = self.live.get(rec.uid)
            if ep is not None:
                self._turn(ep)

    def _cancel(self, recs: list[EpisodeRecord]) -> None:
        for rec in recs:
            ep = self.live.pop(rec.uid, None)
            if ep is not None:
                self.ended[rec.uid] = "cancelled"
                for e in self.engines:
                    e.abort([f"e{rec.uid}-{ep.turn}"])

    # ---------------------------------------------------------------- the loop

    def _collect(self) -> None:
        """Start one collect call (as the trainer's ``collect``: fresh task seeds, two spares)."""
        cls = LockstepSchedule if self.mode == "lockstep" else AsyncSchedule
        self.schedule = cls.plan(
            [next(self._seeds) for _ in range(self.launch_groups + 2)],
            SamplingParams(max_tokens=1),
            groups=self.groups,
            group_size=self.s.group_size,
            launch_groups=self.launch_groups,
            version_floor=self._floor if self.max_staleness else None,
            uids=self._uids,
        )
        self.schedules.append(self.schedule)
        if isinstance(self.schedule, LockstepSchedule):
            self.rounds.append(0)
            self._play_round(self.schedule)
        else:
            self._launch(self.schedule.start(), self.schedule)

    def _pump(self, until: float | None) -> None:
        """Process events until ``until`` (``None``: until a batch is collected)."""
        while (until is None and self.batch is None) or (until is not None and self.clock.now < until):
            for e in self.engines:
                for r in e.step():
                    self._generated(r)
            while self.envq and self.envq[0][0] <= self.clock.now:
                self._env_done(heapq.heappop(self.envq)[2])
            if until is None and self.batch is not None:
                return
            t = min(
                min((e.next_event() for e in self.engines), default=INF),
                self.envq[0][0] if self.envq else INF,
            )
            if t == INF and any(e.num_running for e in self.engines):
                continue  # requests added after the engines stepped: the next step admits them
            if until is not None:
                t = min(t, until)
            if t == INF:
                raise RuntimeError(f"agentic simulation stalled ({len(self.live)} episodes live)")
            self.clock.advance_to(t)

    def _tokens(self, rec: EpisodeRecord) -> int:
        """Tokens trained for one episode: its prompt, every turn's action and observation."""
        turns = len(rec.versions)
        return (
            self.s.prompt_len
            + sum(self.s.lengths.natural(rec.uid, k) for k in range(turns))
            + self.s.obs_len * turns
        )

    def run(self) -> float:
        """Seconds per step, the mean over the steps after the first."""
        s, steps = self.s, []
        self._collect()
        for _ in range(s.steps):
            t0 = self.clock.now
            self._pump(None)
            batch, self.batch = self.batch, None
            self.trained += [r.uid for r in batch]
            if self.max_staleness:  # the next batch is collected while this one trains
                self._collect()
            self._pump(self.clock.now + s.cost.train.time(sum(self._tokens(r) for r in batch)))
            self.version += 1
            for e in self.engines:
                e.pause_for_sync(self.version)
            self._pump(self.clock.now + s.cost.train.sync_s)
            if not self.max_staleness:
                self._collect()
            steps.append(self.clock.now - t0)
        self.check()
        return statistics.fmean(steps[1:] if len(steps) > 1 else steps)

    def check(self) -> None:
        """The invariants, ``AssertionError`` naming the first broken one: ``steps x batch``
        episodes trained, each once and each ``done``; every launched episode of a finished
        collect call ended exactly one way, and that call's counters agree (its failures,
        its cancellations, its done episodes = kept + discarded)."""
        s = self.s
        if len(self.trained) != s.steps * s.batch or len(set(self.trained)) != len(self.trained):
            raise AssertionError(f"trained {len(self.trained)} episodes ({len(set(self.trained))} distinct)")
        if any(self.ended[u] != "done" for u in self.trained):
            raise AssertionError("a trained episode did not end done")
        by_call: dict[int, list[str]] = {}
        for uid, status in self.ended.items():
            by_call.setdefault(self.owner[uid], []).append(status)
        for i, sched in enumerate(self.schedules):
            if not sched.done:
                continue
            ends, c = by_call[i], sched.counts
            want = {
                "running": 0,
                "stale": c["stale"],
                "error": c["error"],
                "cancelled": c["cancelled"],
                "done": self.groups * s.group_size + c["discarded"],
            }
            got = {k: ends.count(k) for k in want}
            if got != want or len(ends) != c["launched"]:
                raise AssertionError(
                    f"collect call {i}: episodes ended {got}, counters say {want}, launched {c['launched']}"
                )


def run_agentic(
    s: AgenticSetting, mode: str = "env-async", *, max_staleness: int = 0, redundancy: float = 0.0
) -> float:
    """Seconds per step (mean over ``s.steps`` after the first) of one mode (module docstring);
    the run's invariants are checked (:meth:`AgenticRun.check`)."""
    return AgenticRun(s, mode, max_staleness=max_staleness, redundancy=redundancy).run()
