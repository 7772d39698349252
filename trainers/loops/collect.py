r"""Collectors: how a synchronous step gets its scored groups of samples.

A collector's ``collect(step, timer)`` returns ``(groups, metrics, lengths)``: the kept groups
``(prompt, n generations, n rewards)``, the rollout metrics, and the length of every generated
sample (for the throughput). Every sample is handed to the reward pool the moment it finishes,
so scoring overlaps generation.

* :class:`GroupCollector`: ``rollout.n`` samples for each of ``rollout.prompts_per_step`` prompts;
  dynamic sampling (``filter.zero_variance``) drops groups whose rewards all agree, and
  ``filter.accuracy_band`` those whose mean reward is outside the band, and generates again, at
  most ``filter.max_rounds`` rounds. With ``rollout.length_dist`` (the W1 long-tail
  workload) every sample is its own request with its own length budget
  (:class:`RequestMaker`), through the rollout engine's request-level view.
* :class:`TailCollector`: one round of RollPacker's tail batching (``tail_batching.enabled``;
  docs/scheduling.md) over the request-level view.
"""

from __future__ import annotations

import dataclasses
import time
from collections import defaultdict
from typing import Any

import torch

from rollkit.registry import FILTERS
from rollkit.scheduling import EpochSampler, TailBatch, TailBatchingPolicy
from trainers.config import Config
from trainers.data import Prompt, PromptIterator
from trainers.domains import DomainIterator
from trainers.engines.base import Generation, SamplingParams, iter_generations
from trainers.engines.requests import Request, RequestEnginePool, as_request_engine
from trainers.loops.common import Codec, Timer
from trainers.loops.lengths import LengthSampler
from trainers.rewards import RewardPool
from trainers.roles import on_ray, request_view

__all__ = [
    "Group",
    "GroupCollector",
    "RequestMaker",
    "TailCollector",
    "accuracy_band_keep",
    "sampling_params",
]

#: one kept group: the prompt, its samples and their rewards
Group = tuple[Prompt, list[Generation], list[float]]


def sampling_params(cfg: Config, round_: int, step: int) -> SamplingParams:
    """The rollout engine's sampling parameters for generation round ``round_`` of ``step`` (the
    sync, async and tail-batching loops all sample with these).

    The seed is a function of ``(seed, step, round_)`` only, so a resumed run samples what the
    original would have. The temperature is ``rollout.engine_temperature`` when it is set (> 0:
    an injected training-inference mismatch; the engine's log-probs are then those of its own
    temperature, while the trainer's stay at ``rollout.temperature``), else ``rollout.temperature``.
    Greedy evaluation does not come through here.
    """
    r = cfg.rollout
    seed = (cfg.seed * 1_000_003 + step * 1009 + round_) % (2**31)
    temperature = r.engine_temperature if r.engine_temperature > 0 else r.temperature
    return SamplingParams(
        n=r.n, temperature=temperature, top_p=r.top_p, top_k=r.top_k, max_tokens=r.max_tokens, seed=seed
    )


class RequestMaker:
    r"""Single-sample :class:`~trainers.engines.requests.Request`\ s, each with its own length
    budget from ``rollout.length_dist`` (:class:`~trainers.loops.lengths.LengthSampler`; its
    draws are state, checkpointed with the loop) and the seed ``params.seed + seed_offset``."""

    def __init__(self, cfg: Config) -> None:
        self.lengths = LengthSampler(cfg.rollout.length_dist, cap=cfg.rollout.max_tokens, seed=cfg.seed)

    @property
    def per_request(self) -> bool:
        """Whether requests get budgets of their own (``rollout.length_dist`` is set)."""
        return bool(self.lengths.spec)

    def request(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        seed_offset: int,
        *,
        start_version: int,
        tag: Any,
    ) -> Request:
        return Request(
            request_id,
            prompt_ids,
            dataclasses.replace(
                params,
                n=1,
                max_tokens=self.lengths.draw(),
                ignore_eos=self.lengths.ignore_eos or params.ignore_eos,
                seed=None if params.seed is None else (params.seed + seed_offset) % (2**31),
            ),
            start_version=start_version,
            tag=tag,
        )

    def state_dict(self) -> dict[str, Any]:
        return self.lengths.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.lengths.load_state_dict(state)


def _rollout_metrics(
    rewards: list[float], lens: list[int], rounds: int, kept: int, by_source: dict[str, list[float]]
) -> dict[str, float]:
    metrics: dict[str, float] = {
        "reward/mean": sum(rewards) / len(rewards),
        "response/length_mean": sum(lens) / len(lens),
        "rollout/rounds": rounds,
        "rollout/kept_groups": kept,
    }
    metrics.update({f"accuracy/{src}": sum(rs) / len(rs) for src, rs in by_source.items()})
    return metrics


def accuracy_band_keep(cfg: Config, rewards: list[float], group_ids: torch.Tensor) -> torch.Tensor:
    """``filter.accuracy_band``: the keep-mask of :func:`rollkit.filters.accuracy_band_filter`
    (``accuracy_low < group mean reward < accuracy_high``, ROLL's ``difficulty_mask``); the
    rewards are the pass rates, so they must lie in ``[0, 1]``."""
    f = cfg.filter
    try:
        return FILTERS.entry("accuracy_band").call(
            {"accuracy": torch.tensor(rewards, dtype=torch.float32), "group_ids": group_ids},
            low=f.accuracy_low,
            high=f.accuracy_high,
            inclusive="neither",
        )
    except ValueError as e:
        raise ValueError(f"filter.accuracy_band: the rewards are its accuracies: {e}") from None


class GroupCollector:
    """n samples per prompt, scored as they finish, with dynamic-sampling refills (module docstring).

    Args:
        cfg: the configuration (``rollout.*``, ``filter.*``).
        rollout: the rollout engine (batch interface; its request-level view for per-request budgets).
        rewards: the reward pool. codec: prompt encoding. iterator: the prompts.
        maker: per-request budgets and seeds.
    """

    def __init__(
        self,
        cfg: Config,
        rollout: Any,
        rewards: RewardPool,
        codec: Codec,
        iterator: PromptIterator | DomainIterator,
        maker: RequestMaker,
    ) -> None:
        self.cfg, self.rollout, self.rewards, self.codec = cfg, rollout, rewards, codec
        self.iterator, self.maker = iterator, maker
        self._requests: Any = None

    def request_engine(self) -> Any:
        """The request-level view of the rollout engine, built on first use and kept (its sampler
        state carries over from step to step)."""
        if self._requests is None:
            self._requests = request_view(self.rollout, self.cfg, self.cfg.seed)
        return self._requests

    def collect(self, step: int, timer: Timer) -> tuple[list[Group], dict[str, float], list[int]]:
        cfg = self.cfg
        P, n = cfg.rollout.prompts_per_step, cfg.rollout.n
        groups: list[Group] = []
        all_rewards: list[float] = []
        all_lens: list[int] = []
        rounds = 0
        by_source: dict[str, list[float]] = defaultdict(list)
        f = cfg.filter
        max_rounds = f.max_rounds if f.zero_variance or f.accuracy_band else 1
        band_dropped = 0
        dropped: list[Prompt] = []
        by_domain: dict[str, list[int]] = defaultdict(lambda: [0, 0])  # domain -> [kept, filtered]
        while len(groups) < P and rounds < max_rounds:
            # refills replace the filtered groups from their own domains
            prompts = self.iterator.next_like(dropped) if rounds else self.iterator.next_batch(P)
            gens, rewards = self.generate_and_score(prompts, sampling_params(cfg, rounds, step), step, timer)
            rounds += 1
            for g, r in zip(gens, rewards):
                by_source[prompts[g.prompt_index].data_source].append(r)
            all_rewards += rewards
            all_lens += [len(g.token_ids) for g in gens]
            keep = torch.ones(len(gens), dtype=torch.bool)
            gid = torch.arange(len(prompts)).repeat_interleave(n)
            if f.zero_variance:
                keep = FILTERS.entry("zero_variance").call(
                    {"rewards": torch.tensor(rewards, dtype=torch.float32), "group_ids": gid}
                )
            if f.accuracy_band:
                band = accuracy_band_keep(cfg, rewards, gid)
                band_dropped += int((keep & ~band).sum()) // n
                keep = keep & band
            dropped = []
            for i, p in enumerate(prompts):
                by_domain[p.domain][0 if bool(keep[i * n]) else 1] += 1
                if bool(keep[i * n]):
                    groups.append((p, gens[i * n : (i + 1) * n], rewards[i * n : (i + 1) * n]))
                else:
                    dropped.append(p)
        groups = groups[:P]
        metrics = _rollout_metrics(all_rewards, all_lens, rounds, len(groups), by_source)
        if f.accuracy_band:
            metrics["filter/accuracy_band_dropped"] = band_dropped
        for d, (kept, filtered) in by_domain.items():
            if d:  # a multi-domain run (data.domains)
                metrics[f"domain/{d}/kept_groups"] = kept
                metrics[f"domain/{d}/filtered_groups"] = filtered
        return groups, metrics, all_lens

    def generate_and_score(
        self, prompts: list[Prompt], params: SamplingParams, step: int, timer: Timer
    ) -> tuple[list[Generation], list[float]]:
        """Generate ``params.n`` samples per prompt, submitting each to the reward pool as it
        finishes; returns ``(generations, rewards)`` grouped by prompt (``gens[i * n + j]``)."""
        if self.maker.per_request:
            return self._requests_and_score(prompts, params, step, timer)
        gens: list[Generation] = []
        t0, t_submit = time.perf_counter(), 0.0
        for g in iter_generations(self.rollout, [self.codec.encode(p) for p in prompts], params):
            t1 = time.perf_counter()
            self.rewards.submit(len(gens), self.codec.decode(g.token_ids), prompts[g.prompt_index])
            t_submit += time.perf_counter() - t1
            gens.append(g)
        timer.t["rollout"] += time.perf_counter() - t0 - t_submit
        timer.t["reward"] += t_submit
        with timer("reward"):
            scores = self.rewards.gather()
        order = sorted(range(len(gens)), key=lambda k: gens[k].prompt_index)  # stable
        return [gens[k] for k in order], [scores[k] for k in order]

    def _requests_and_score(
        self, prompts: list[Prompt], params: SamplingParams, step: int, timer: Timer
    ) -> tuple[list[Generation], list[float]]:
        """One request per sample, each with its own ``max_tokens`` (``rollout.length_dist``)."""
        eng, n = self.request_engine(), params.n
        reqs = [
            self.maker.request(
                f"sync-{step}-{id(prompts)}-{i}-{j}",
                self.codec.encode(p),
                params,
                i * n + j,
                start_version=step,
                tag=i * n + j,
            )
            for i, p in enumerate(prompts)
            for j in range(n)
        ]
        eng.add(reqs)
        done: dict[int, Generation] = {}
        t0, t_submit = time.perf_counter(), 0.0
        while eng.num_running:
            for r in eng.step():
                t1 = time.perf_counter()
                self.rewards.submit(r.tag, self.codec.decode(r.token_ids), prompts[r.tag // n])
                t_submit += time.perf_counter() - t1
                done[r.tag] = r.to_generation(r.tag // n)
        timer.t["rollout"] += time.perf_counter() - t0 - t_submit
        timer.t["reward"] += t_submit
        with timer("reward"):
            scores = self.rewards.gather()
        return [done[k] for k in range(len(reqs))], [scores[k] for k in range(len(reqs))]


class TailCollector:
    r"""One round of RollPacker's tail batching per step (Gao et al. 2025, arXiv:2509.21009).

    :attr:`policy` is a :class:`rollkit.scheduling.TailBatchingPolicy` with :math:`P_0` =
    ``rollout.prompts_per_step`` and :math:`R_0` = ``rollout.n``. A short round launches
    :math:`\lceil\eta_P P_0\rceil` fresh prompts x :math:`\lceil\eta_R R_0\rceil` responses, a long
    round the :math:`P_0` queued prompts x :math:`R_0`, one request per response with its length
    budget from ``rollout.length_dist``. Every finished response goes to the policy; a kept one is
    scored at once, the requests the policy names are aborted, and the round ends when
    :math:`P_0` prompts have :math:`R_0` kept responses. Fresh prompts come from :attr:`sampler`
    (an :class:`~rollkit.scheduling.EpochSampler` over the train prompts); with
    ``filter.zero_variance`` a deferred prompt whose finished responses all agree is dropped,
    not queued. docs/scheduling.md has the whole protocol.
    """

    def __init__(
        self,
        cfg: Config,
        rollout: Any,
        rewards: RewardPool,
        codec: Codec,
        prompts: list[Prompt],
        maker: RequestMaker,
    ) -> None:
        try:
            if not on_ray(rollout):  # a Ray rollout group: its actors' request engines
                as_request_engine(rollout)
        except TypeError:
            raise ValueError(
                f"tail_batching.enabled: tail batching needs a request-level rollout engine (an HF or "
                f"vLLM rollout engine, a RequestEngine or Ray rollout actors), got {type(rollout).__name__}"
            ) from None
        self.cfg, self.rollout, self.rewards, self.codec, self.maker = cfg, rollout, rewards, codec, maker
        self.prompts = prompts
        tb = cfg.tail_batching
        self.policy = TailBatchingPolicy(
            cfg.rollout.prompts_per_step,
            cfg.rollout.n,
            eta_prompts=tb.eta_prompts,
            eta_responses=tb.eta_responses,
            dynamic_sampling=cfg.filter.zero_variance,
            max_tokens=cfg.rollout.max_tokens,
        )
        self.sampler = EpochSampler(len(prompts), seed=cfg.seed)
        self.last_batch: TailBatch | None = None  # the latest round's batch (prompt ids, round)
        self.engine_requests: list[int] = []  # Ray: requests each rollout actor got in the latest round

    def _engine(self, step: int) -> Any:
        """A fresh request-level view seeded from ``(seed, step)``: a step depends only on the
        checkpointed state (the views hold nothing between rounds: every request ends in its round)."""
        seed = (self.cfg.seed * 1_000_003 + step * 1009) % (2**31)
        return request_view(self.rollout, self.cfg, seed, renew=True)

    def collect(self, step: int, timer: Timer) -> tuple[list[Group], dict[str, float], list[int]]:
        plan = self.policy.plan_step(self.sampler)
        N = len(self.prompts)
        prompt_of = {r.request_id: self.prompts[r.prompt_id % N] for r in plan.requests}
        names = {
            r.request_id: [f"tail-{r.request_id}-{j}" for j in range(r.num_responses)] for r in plan.requests
        }
        base = sampling_params(self.cfg, 0, step)
        reqs = [
            self.maker.request(
                names[r.request_id][j],
                self.codec.encode(prompt_of[r.request_id]),
                base,
                r.request_id * 1009 + j,
                start_version=step,
                tag=(r.request_id, j),
            )
            for r in plan.requests
            for j in range(r.num_responses)
        ]
        kept, scores, lens = self._run_round(plan, reqs, names, prompt_of, step, timer)
        by_request: dict[int, list[float]] = defaultdict(list)
        for key, s in sorted(scores.items(), key=str):
            if isinstance(key, tuple) and key[0] in prompt_of:  # (request id, response id)
                by_request[key[0]].append(s)
        batch = self.policy.finish_step(by_request if self.policy.dynamic_sampling else None)
        self.last_batch = batch
        groups: list[Group] = []
        for r, resp in zip(batch.requests, batch.responses):
            gens = [kept[(r.request_id, j)].to_generation(len(groups)) for j in resp]
            groups.append((prompt_of[r.request_id], gens, [scores[(r.request_id, j)] for j in resp]))
        return groups, self._metrics(groups, batch), lens

    def _run_round(
        self,
        plan: Any,
        reqs: list[Request],
        names: dict[int, list[str]],
        prompt_of: dict[int, Prompt],
        step: int,
        timer: Timer,
    ) -> tuple[dict[tuple[int, int], Request], dict[Any, float], list[int]]:
        """Drive the round's requests to completion: ``(kept responses, their scores, lengths of
        every generated response, aborted ones included)``. A failed round is rolled back."""
        policy, eng = self.policy, self._engine(step)
        kept: dict[tuple[int, int], Request] = {}
        scores: dict[Any, float] = {}
        lens: list[int] = []
        t0, t_submit, complete = time.perf_counter(), 0.0, False
        eng.add(reqs)
        try:
            while not complete:
                if not eng.num_running:
                    raise RuntimeError(
                        f"tail batching: every request of step {plan.step} ended but the round is not "
                        f"complete ({plan.round} round of {len(plan.requests)} prompts)"
                    )
                for r in eng.step():
                    lens.append(len(r.token_ids))
                    rid, j = r.tag
                    d = policy.on_response_finished(rid, j)
                    if d.keep:
                        t1 = time.perf_counter()
                        self.rewards.submit(r.tag, self.codec.decode(r.token_ids), prompt_of[rid])
                        t_submit += time.perf_counter() - t1
                        kept[r.tag] = r
                    if d.abort:
                        lens += [len(a.token_ids) for a in eng.abort([x for k in d.abort for x in names[k]])]
                    complete = complete or d.round_complete
                t1 = time.perf_counter()
                scores.update(self.rewards.poll())
                t_submit += time.perf_counter() - t1
        finally:  # the round is over (or failed): nothing of it may keep running
            lens += [len(a.token_ids) for a in eng.abort([x for v in names.values() for x in v])]
            if isinstance(eng, RequestEnginePool):
                self.engine_requests = [e.requests_added for e in eng.engines]
            if not complete:  # roll the round back: its prompts are launched again next step
                policy.load_state_dict(policy.state_dict())
        timer.t["rollout"] += time.perf_counter() - t0 - t_submit
        timer.t["reward"] += t_submit
        with timer("reward"):
            scores.update(self.rewards.gather())
        return kept, scores, lens

    def _metrics(self, groups: list[Group], batch: TailBatch) -> dict[str, float]:
        rewards = [x for _, _, rs in groups for x in rs]
        metrics: dict[str, float] = {
            "reward/mean": sum(rewards) / len(rewards),
            "response/length_mean": sum(len(g.token_ids) for _, gs, _ in groups for g in gs) / len(rewards),
            "rollout/rounds": 1,
            "rollout/kept_groups": len(groups),
        }
        acc: dict[str, list[float]] = defaultdict(list)
        for p, _, rs in groups:
            acc[p.data_source] += rs
        metrics.update({f"accuracy/{src}": sum(rs) / len(rs) for src, rs in acc.items()})
        if self.engine_requests:  # Ray: how the round's requests spread over the rollout actors
            metrics["rollout/actor_requests_min"] = float(min(self.engine_requests))
            metrics["rollout/actor_requests_max"] = float(max(self.engine_requests))
        metrics["tail/round"] = float(batch.round == "long")
        metrics.update(batch.metrics)
        metrics.update({f"tail/total_{k}": float(v) for k, v in self.policy.counts.items()})
        return metrics

    def state_dict(self) -> dict[str, Any]:
        """The long-prompt queue, counts and the fresh-prompt sampler (a round in progress is
        rolled back: its prompts are launched again after a restore)."""
        return {"policy": self.policy.state_dict(), "sampler": self.sampler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.policy.load_state_dict(state["policy"])
        self.sampler.load_state_dict(state["sampler"])
