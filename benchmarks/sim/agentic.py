"""Agentic rollouts on the simulator: multi-turn trajectories with environment latency.

A trajectory is ``turns`` rounds of (generate a turn on a :class:`SimEngine`, then an
environment step whose latency is drawn from ``cost.env``: ROLL Flash / RollArt's Gaussian,
mean 10 s, std 1-10 s). Modes, as in ROLL Flash section 5.2:

* ``lockstep``: every turn is a barrier over the batch (batched environment steps);
* ``env-async``: each trajectory proceeds alone (environment-level asynchronous rollout);
* ``redundant``: env-async with ``ceil((1 + redundancy) B)`` trajectories launched, the first
  ``B`` kept and the rest aborted;

and, for any of them, rollout-train asynchrony through the real
:class:`~rollkit.buffer.SampleBuffer` (a trajectory is one request; ``ratio=0``: synchronous).
The environment-level runner of ``trainers/envs/episodes.py`` owns threads and real worker
processes, so it is not driven here (docs/simulator.md).
"""

from __future__ import annotations

import heapq
import math
import random
import statistics
from dataclasses import dataclass

from benchmarks.sim.clock import VirtualClock
from benchmarks.sim.costs import CostModel
from benchmarks.sim.engine import INF, RunList, SimEngine
from benchmarks.sim.lengths import Lengths
from rollkit.buffer import SampleBuffer
from trainers.engines.base import SamplingParams
from trainers.engines.requests import Request

__all__ = ["AgenticSetting", "run_agentic"]


@dataclass
class AgenticSetting:
    batch: int  # trajectories trained per step
    turns: int
    lengths: Lengths  # tokens generated per turn
    cost: CostModel
    engines: int = 1
    prompt_len: int = 512
    obs_len: int = 128  # environment tokens appended per turn
    steps: int = 6
    seed: int = 0


class _Traj:
    __slots__ = ("ctx", "rid", "turn", "version")

    def __init__(self, rid: int, ctx: int, version: int) -> None:
        self.rid, self.ctx, self.turn, self.version = rid, ctx, 0, version


def run_agentic(s: AgenticSetting, mode: str = "env-async", *, ratio: float = 0.0, redundancy: float = 0.0):
    """Seconds per step (mean over ``s.steps``) of one mode (module docstring)."""
    if mode not in ("lockstep", "env-async", "redundant"):
        raise ValueError(f"mode: expected lockstep, env-async or redundant, got {mode!r}")
    clock, rng = VirtualClock(), random.Random(s.seed)
    engines = [
        SimEngine(clock, s.cost.decode, s.lengths, sync_s=s.cost.train.sync_s) for _ in range(s.engines)
    ]
    launch = math.ceil((1 + (redundancy if mode == "redundant" else 0.0)) * s.batch)
    buf = SampleBuffer(
        s.batch, async_ratio=ratio, max_in_flight=math.ceil((1 + ratio) * s.batch) + launch - s.batch
    )
    live: dict[int, _Traj] = {}
    envq: list[tuple[float, int, int]] = []  # (done time, tie, rid)
    barrier: list[int] = []  # lockstep: trajectories waiting for the batch's turn to end
    tie = [0]

    def generate(t: _Traj) -> None:
        n = s.lengths.natural(t.rid, t.turn)
        req = Request(
            f"t{t.rid}-{t.turn}", RunList(1, t.ctx, key=t.rid), SamplingParams(max_tokens=n, ignore_eos=True)
        )
        req.tag = t.rid
        min(engines, key=lambda e: e.num_running).add([req])

    def env_done(rid: int) -> None:
        t = live[rid]
        t.turn += 1
        if t.turn == s.turns:
            del live[rid]
            if buf.is_running(rid):
                buf.put(rid, t.ctx)
        else:
            generate(t)

    def pump(until: float | None) -> None:
        """Process events until ``until`` (``None``: until the buffer holds a batch)."""
        while (until is None and buf.num_ready() < s.batch) or (until is not None and clock.now < until):
            for rid in buf.reserve(buf.free_slots) if buf.free_slots else []:
                live[rid] = _Traj(rid, s.prompt_len, buf.version)
                generate(live[rid])
            for e in engines:
                for r in e.step():
                    t = live.get(r.tag)
                    if t is not None:
                        t.ctx += len(r.token_ids) + s.obs_len
                        tie[0] += 1
                        heapq.heappush(envq, (clock.now + s.cost.env.sample(rng), tie[0], r.tag))
            while envq and envq[0][0] <= clock.now:
                rid = heapq.heappop(envq)[2]
                if rid in live:
                    (barrier.append(rid) if mode == "lockstep" else env_done(rid))
            if mode == "lockstep" and barrier and not envq and not any(e.num_running for e in engines):
                for rid in barrier:
                    env_done(rid)
                barrier.clear()
                continue
            if until is None and buf.num_ready() >= s.batch:
                return
            t = min(min((e.next_event() for e in engines), default=INF), envq[0][0] if envq else INF)
            if until is not None:
                t = min(t, until)
            if t == INF:
                raise RuntimeError(f"agentic simulation stalled ({buf.stats()})")
            clock.advance_to(t)

    steps = []
    for _ in range(s.steps):
        t0 = clock.now
        pump(None)
        batch = buf.get_batch()
        expired = buf.abort_expiring()
        if mode == "redundant" and ratio == 0:  # the batch is full: abort the spare trajectories
            spare = buf.running_ids()
            buf.abort(spare)
            expired += spare
        for rid in expired:
            live.pop(rid, None)
            for e in engines:
                e.abort([f"t{rid}-{k}" for k in range(s.turns)])
        pump(clock.now + s.cost.train.time(sum(batch.samples)))
        buf.set_version(buf.version + 1)
        for e in engines:
            e.pause_for_sync(buf.version)
        pump(clock.now + s.cost.train.sync_s)
        steps.append(clock.now - t0)
    return statistics.fmean(steps[1:] if len(steps) > 1 else steps)
