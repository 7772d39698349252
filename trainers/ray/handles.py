"""The proxies the loops hold over the Ray actors of :mod:`trainers.ray.workers` (same
interfaces as the in-process engines), and the assembly that starts them.

Proxies (what the trainer holds; same interfaces as the in-process engines):

* :class:`RayRolloutGroup`: ``generate_iter`` sends requests of ``rollout.prompts_per_request``
  prompts, each to the least-loaded actor (fewest prompts in flight, at most two requests
  per actor at once) and yields a request's samples as soon as ``ray.wait`` returns it;
  ``update_weights`` puts the weights in the object store once (or takes the train group's
  object reference as is) and every actor loads that one copy.
* :class:`RayTrainGroup`: ``update`` puts the batch in the object store once, runs
  ``ppo_update`` on every rank and adds up the ranks' metric sums; ``export_weights`` returns
  the object reference of rank 0's weights (the other ranks take part in the collectives
  that ZeRO-3 needs, and return nothing); ``batch_logprobs`` the current policy's log-probs
  (the asynchronous trainer's proximal recompute).
* :class:`RayReference`: ``batch_logprobs``.
* :class:`RayTeacher`: ``batch_logprobs`` and ``batch_topk_logprobs``; ``close()`` kills the
  actor and frees its placement group.
* :class:`RayRequestEngine`: one rollout actor driven request by request (the
  :class:`~trainers.engines.requests.RequestEngine` protocol), for the asynchronous trainer.

:func:`build_ray_roles` starts Ray if needed (:func:`init_ray`), reserves the
placement group, starts the actors and returns :class:`RayRoles`, whose ``close()`` kills
them and frees the placement group.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from trainers.config import Config, critic_needed
from trainers.deps import require
from trainers.engines.base import Generation, PackedBatch, SamplingParams
from trainers.engines.build import (
    TINY_VLMS,
    build_model,
)
from trainers.engines.step import StepBatch
from trainers.learner import UpdateStats
from trainers.models import char_tokenizer, default_model_path
from trainers.ray.placement import Placement, plan_bundles, plan_teacher
from trainers.ray.workers import (
    DEFAULT_TIMEOUT_S,
    MAX_INFLIGHT,
    ActorCallError,
    CriticWorker,
    ReferenceWorker,
    RolloutWorker,
    TeacherWorker,
    TrainWorker,
    call,
    init_ray,
    ray_module,
    wait_all,
)
from trainers.vision import is_vision_checkpoint, load_vision_tokenizer

__all__ = [
    "RayCritic",
    "RayReference",
    "RayRequestEngine",
    "RayRoles",
    "RayRolloutGroup",
    "RayTeacher",
    "RayTrainGroup",
    "build_ray_roles",
    "build_ray_teacher",
]


# --------------------------------------------------------------------------- proxies


class RayRolloutGroup:
    """K rollout actors behind the RolloutEngine interface (module docstring)."""

    def __init__(
        self, actors: list[Any], *, prompts_per_request: int = 1, timeout_s: float = DEFAULT_TIMEOUT_S
    ) -> None:
        if not actors:
            raise ValueError("actors: at least one rollout actor")
        if prompts_per_request < 1:
            raise ValueError(f"prompts_per_request must be >= 1, got {prompts_per_request}")
        self.actors = actors
        self.prompts_per_request = prompts_per_request
        self.timeout_s = timeout_s
        self.policy_version = 0

    def _names(self, what: str) -> list[str]:
        return [f"rollout actor {i} ({what})" for i in range(len(self.actors))]

    def _run(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, size: int
    ) -> Iterator[Generation]:
        """Requests of ``size`` prompts, each to the least-loaded actor; yield as they finish.

        A request for prompts ``[s, s + size)`` samples with seed ``params.seed + 7919 * s``,
        so the samples do not depend on which actor ran it (nor on K)."""
        ray = ray_module()
        queue = deque((s, [list(p) for p in prompts[s : s + size]]) for s in range(0, len(prompts), size))
        load = [0] * len(self.actors)  # prompts in flight per actor
        pending: dict[Any, tuple[int, int, int]] = {}  # ref -> (actor, first prompt, prompts)

        def dispatch() -> None:
            while queue and min(load) < MAX_INFLIGHT * size:
                a = load.index(min(load))
                s, ps = queue.popleft()
                p = (
                    params
                    if params.seed is None
                    else dataclasses.replace(params, seed=(params.seed + 7919 * s) % 2**31)
                )
                pending[self.actors[a].generate.remote(ps, p)] = (a, s, len(ps))
                load[a] += len(ps)

        dispatch()
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=self.timeout_s)
            if not ready:
                late = sorted({a for a, _, _ in pending.values()})
                raise ActorCallError(
                    f"rollout actor(s) {late} (generate): no answer within {self.timeout_s:g} s "
                    "(ray.timeout_s): hung or overloaded; the run stops"
                )
            a, s, k = pending.pop(ready[0])
            load[a] -= k
            dispatch()
            for g in call(ready[0], f"rollout actor {a} (generate)", self.timeout_s):
                yield dataclasses.replace(g, prompt_index=g.prompt_index + s)

    def generate_iter(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> Iterator[Generation]:
        """Stream the samples, a request's worth at a time, in the order requests finish."""
        yield from self._run(prompts, params, self.prompts_per_request)

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Generation]:
        """All samples grouped by prompt (``out[i * n + j]``); one request per actor."""
        size = max(1, math.ceil(len(prompts) / len(self.actors)))
        gens = list(self._run(prompts, params, size))
        return sorted(gens, key=lambda g: g.prompt_index)  # stable: sample order within a prompt

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]] | Any, version: int) -> None:
        """Every actor loads the weights from one object-store copy (an ObjectRef is used as is)."""
        ray = ray_module()
        ref = named_tensors if isinstance(named_tensors, ray.ObjectRef) else ray.put(list(named_tensors))
        call(
            [a.update_weights.remote(ref, version) for a in self.actors],
            self._names("update_weights"),
            self.timeout_s,
        )
        self.policy_version = int(version)

    def sleep(self, level: int = 1) -> None:
        call([a.sleep.remote(level) for a in self.actors], self._names("sleep"), self.timeout_s)

    def wake(self) -> None:
        call([a.wake.remote() for a in self.actors], self._names("wake"), self.timeout_s)

    def node_ids(self) -> list[str]:
        return call([a.node_id.remote() for a in self.actors], self._names("node_id"), self.timeout_s)


class RayRequestEngine:
    """One :class:`RolloutWorker` behind the :class:`~trainers.engines.requests.RequestEngine`
    protocol: the asynchronous trainer's queue scheduler drives rollout actors with it.

    ``add`` / ``abort`` / ``update_weights`` wait for the actor; :meth:`start_step` sends a
    step without waiting, so a scheduler that starts every engine's step before collecting any
    (:class:`~trainers.async_trainer.QueueScheduler` does) runs the actors at the same time;
    :meth:`step` collects it (or runs one). The running count is kept here (no call needed).

    Args:
        actor: a :class:`RolloutWorker` actor handle.
        chunk_tokens, seed: for the actor's request engine
            (:func:`~trainers.engines.requests.as_request_engine`).
        renew: build the actor's request engine again (with ``seed``) even if it has one, as
            tail batching does every round; by default an existing one is kept.
        timeout_s: the deadline of every call to the actor; name: how errors name it.
    """

    def __init__(
        self,
        actor: Any,
        *,
        chunk_tokens: int = 16,
        seed: int = 0,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        name: str = "rollout actor",
        renew: bool = False,
    ) -> None:
        self.actor, self.timeout_s, self.name = actor, timeout_s, name
        self.policy_version = int(
            call(actor.init_requests.remote(chunk_tokens, seed, renew), self._n("init"), timeout_s)
        )
        self._running: set[str] = set()
        self._step_ref: Any = None
        self.requests_added = 0  # requests sent to this actor (new and continued)

    def _n(self, what: str) -> str:
        return f"{self.name} ({what})"

    @property
    def num_running(self) -> int:
        return len(self._running)

    def add(self, requests: Sequence[Any]) -> None:
        requests = list(requests)
        call(
            self.actor.add_requests.remote(requests), self._n("add_requests"), self.timeout_s
        )  # it checks them
        self._running.update(r.request_id for r in requests)
        self.requests_added += len(requests)

    def start_step(self) -> None:
        """Send one step to the actor (collected by the next :meth:`step`)."""
        if self._step_ref is None and self._running:
            self._step_ref = self.actor.step_requests.remote()

    def step(self) -> list[Any]:
        self.start_step()
        if self._step_ref is None:
            return []
        ref, self._step_ref = self._step_ref, None
        done = call(ref, self._n("step_requests"), self.timeout_s)
        self._running.difference_update(r.request_id for r in done)
        return done

    def abort(self, request_ids: Iterable[str] | None = None) -> list[Any]:
        ids = None if request_ids is None else [i for i in request_ids if i in self._running]
        if ids == []:
            return []
        if self._step_ref is not None:
            raise RuntimeError("abort: a step is in flight; collect it with step() first")
        stopped = call(self.actor.abort_requests.remote(ids), self._n("abort_requests"), self.timeout_s)
        self._running.difference_update(r.request_id for r in stopped)
        return stopped

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]] | Any, version: int) -> None:
        """Load new weights (an ObjectRef is used as is); refused by the actor while requests run."""
        ray = ray_module()
        ref = named_tensors if isinstance(named_tensors, ray.ObjectRef) else ray.put(list(named_tensors))
        call(self.actor.update_weights.remote(ref, version), self._n("update_weights"), self.timeout_s)
        self.policy_version = int(version)


class RayTrainGroup:
    """N train ranks behind the Learner interface; ``spec``: a loop's UpdateSpec for them all (None: own)."""

    def __init__(self, workers: list[Any], *, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.workers, self.timeout_s, self.spec = workers, timeout_s, None

    def _names(self, what: str) -> list[str]:
        return [f"train rank {r} ({what})" for r in range(len(self.workers))]

    def _all(self, refs: list[Any], what: str) -> list[Any]:
        return call(refs, self._names(what), self.timeout_s)

    @property
    def world_size(self) -> int:
        return len(self.workers)

    def update(self, batch: StepBatch, *, seed: int) -> dict[str, float]:
        """Every rank runs :func:`~trainers.learner.ppo_update` on its share of the step batch
        (one object-store copy for them all); the ranks' stats are merged."""
        ray = ray_module()
        payload = ray.put(dict(batch=batch, spec=self.spec))
        total = UpdateStats()
        for sums, counts, mismatch in self._all(
            [w.update.remote(payload, seed) for w in self.workers], "update"
        ):
            part = UpdateStats(mismatch=list(mismatch))
            part.sums.update(sums)
            part.counts.update(counts)
            total.merge(part)
        return total.metrics()

    def export_weights(self) -> Any:
        """An ObjectRef to rank 0's ``[(name, tensor)]`` (pass it to ``RayRolloutGroup.update_weights``)."""
        refs = [w.export_weights.remote() for w in self.workers]
        wait_all(refs, self._names("export_weights"), self.timeout_s)  # rank 0's stays in the store
        return refs[0]

    def push_weights(self, rollout: RayRolloutGroup, version: int) -> dict[str, float]:
        """``rollout.weight_sync`` buckets / delta: train rank 0 streams the weights straight to
        every rollout actor (gloo, not Ray's object store); returns the sync's ``sync/*`` metrics."""
        out = self._all([w.push_weights.remote(rollout.actors, int(version), self.timeout_s) for w in self.workers],
                        "push_weights")
        rollout.policy_version = int(version)
        return dict(out[0] or {})

    def batch_logprobs(
        self,
        batch: PackedBatch,
        *,
        temperature: float,
        micro_batch_size: int,
        top_k: int = -1,
        top_p: float = 1.0,
    ) -> torch.Tensor:
        """The train policy's current log-probs of ``batch`` (the proximal recompute), computed
        by every rank, returned by rank 0."""
        ray = ray_module()
        ref = ray.put(batch)
        refs = [
            w.batch_logprobs.remote(ref, temperature, micro_batch_size, top_k, top_p) for w in self.workers
        ]
        return self._all(refs, "batch_logprobs")[0]

    def save_model(self, path: str | Path, tokenizer: Any = None) -> Path:
        """The policy as a Hugging Face model directory, written by rank 0 on its node (the
        driver's filesystem when they share one, as on one machine)."""
        self._all([w.save_model.remote(str(path), tokenizer) for w in self.workers], "save_model")
        return Path(path)

    def weights(self) -> list[tuple[str, torch.Tensor]]:
        """Rank 0's weights, fetched here."""
        return call(self.export_weights(), "train rank 0 (weights)", self.timeout_s)

    def state_dict(self) -> dict[str, Any]:
        return self._all([w.state_dict.remote() for w in self.workers], "state_dict")[0]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        ray = ray_module()
        ref = ray.put(state)
        self._all([w.load_state_dict.remote(ref) for w in self.workers], "load_state_dict")

    def offload(self) -> None:
        """Every rank's training state to the host (``placement.offload_train``), with the
        deadline of ``sleep`` / ``wake`` (``ray.timeout_s``)."""
        self._all([w.offload.remote() for w in self.workers], "offload")

    def onload(self) -> None:
        """Every rank's training state back to its device."""
        self._all([w.onload.remote() for w in self.workers], "onload")

    def node_ids(self) -> list[str]:
        return self._all([w.node_id.remote() for w in self.workers], "node_id")


class RayReference:
    """The reference actor behind ``batch_logprobs`` (every call with the deadline ``timeout_s``)."""

    what = "reference actor"  # names the actor in a failed call's error

    def __init__(self, actor: Any, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.actor, self.timeout_s = actor, timeout_s

    def batch_logprobs(
        self,
        batch: PackedBatch,
        *,
        temperature: float,
        micro_batch_size: int,
        top_k: int = -1,
        top_p: float = 1.0,
    ) -> torch.Tensor:
        ref = self.actor.batch_logprobs.remote(batch, temperature, micro_batch_size, top_k, top_p)
        return call(ref, f"{self.what} (batch_logprobs)", self.timeout_s)

    def node_id(self) -> str:
        return call(self.actor.node_id.remote(), f"{self.what} (node_id)", self.timeout_s)


class RayCritic:
    """The critic actor behind the :class:`trainers.critic.Critic` interface; every call has the
    ``ray.timeout_s`` deadline (a hung or dead actor is an :class:`ActorCallError` naming it)."""

    what = "critic actor"

    def __init__(self, actor: Any, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.actor, self.timeout_s = actor, timeout_s
        self.num_critics = int(self._call(actor.num_critics.remote(), "num_critics"))

    def _call(self, ref: Any, what: str) -> Any:
        return call(ref, f"{self.what} ({what})", self.timeout_s)

    def values(self, batch: PackedBatch) -> torch.Tensor:
        return self._call(self.actor.values.remote(batch), "values")

    def update(
        self, batch: PackedBatch, old_values: torch.Tensor, returns: torch.Tensor, shards: Any, *, seed: int
    ) -> dict[str, float]:
        return self._call(self.actor.update.remote(batch, old_values, returns, shards, seed), "update")

    def save_model(self, path: str | Path, tokenizer: Any = None) -> Path:
        """The critic written by the actor, on its node (a shared filesystem puts it here)."""
        return Path(self._call(self.actor.save_model.remote(str(path), tokenizer), "save_model"))

    def state_dict(self) -> dict[str, Any]:
        return self._call(self.actor.state_dict.remote(), "state_dict")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._call(self.actor.load_state_dict.remote(state), "load_state_dict")

    def node_id(self) -> str:
        return self._call(self.actor.node_id.remote(), "node_id")


class RayTeacher(RayReference):
    """The teacher actor behind ``batch_logprobs`` / ``batch_topk_logprobs`` (every call with the
    deadline ``timeout_s``); :meth:`close` kills it and frees its placement group."""

    what = "teacher actor"

    def __init__(
        self, actor: Any, placement: Placement | None = None, *, timeout_s: float = DEFAULT_TIMEOUT_S
    ) -> None:
        super().__init__(actor, timeout_s=timeout_s)
        self.placement = placement

    def batch_topk_logprobs(
        self, batch: PackedBatch, *, k: int, temperature: float, micro_batch_size: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ref = self.actor.batch_topk_logprobs.remote(batch, k, temperature, micro_batch_size)
        return call(ref, f"{self.what} (batch_topk_logprobs)", self.timeout_s)

    def vocab(self) -> dict[str, int] | None:
        return call(self.actor.vocab.remote(), f"{self.what} (vocab)", self.timeout_s)

    def close(self) -> None:
        """Kill the actor (whatever its state) and free the placement group; idempotent."""
        ray = ray_module()
        try:
            if self.actor is not None:
                ray.kill(self.actor, no_restart=True)
                self.actor = None
        finally:
            if self.placement is not None:
                self.placement.remove()
                self.placement = None


# --------------------------------------------------------------------------- assembly


@dataclass
class RayRoles:
    """What :func:`build_ray_roles` started; :meth:`close` stops it."""

    rollout: RayRolloutGroup
    train: RayTrainGroup
    reference: RayReference | None
    tokenizer: Any
    placement: Placement
    actors: list[Any] = field(default_factory=list)
    critic: RayCritic | None = None

    def close(self) -> None:
        """Kill every actor and free the placement group, whatever state the actors are in
        (dead, hung); idempotent."""
        ray = ray_module()
        try:
            for a in self.actors:
                try:
                    ray.kill(a, no_restart=True)
                except Exception as e:  # an actor already gone: nothing to free
                    warnings.warn(f"closing a Ray actor failed: {type(e).__name__}: {e}", stacklevel=2)
            self.actors = []
        finally:
            if self.placement is not None:
                self.placement.remove()
                self.placement = None  # type: ignore[assignment]


def _gpus(cfg: Config) -> float:
    g = cfg.placement.gpus_per_worker
    if g is not None:
        return float(g)
    return 1.0 if ray_module().cluster_resources().get("GPU", 0) > 0 else 0.0


def _tokenizer(cfg: Config) -> Any:
    if cfg.model.path == "tiny":
        return char_tokenizer()
    if cfg.model.path in TINY_VLMS:  # its processor comes with the (tiny) model
        return build_model(cfg)[1]
    if is_vision_checkpoint(cfg.model.path):
        return load_vision_tokenizer(cfg.model.path)
    return require("transformers").AutoTokenizer.from_pretrained(str(cfg.model.path or default_model_path()))


def build_ray_roles(
    cfg: Config, *, model: Any = None, tokenizer: Any = None, reference: bool = False, critic_model: Any = None
) -> RayRoles:
    """Start the roles of ``cfg`` as Ray actors placed by ``cfg.placement``.

    ``model`` (with ``tokenizer``): the initial policy, put once in the object store and
    loaded by every actor; ``None``: every actor builds ``cfg.model`` itself (a checkpoint
    path must then exist on every node). ``reference``: start a reference actor.
    ``critic_model``: the policy the critic actor starts from when it is not ``model``.
    """
    ray = ray_module()
    init_ray(cfg)
    p = cfg.placement
    plan = plan_bundles(
        p.mode,
        rollout_workers=p.rollout_workers,
        train_workers=p.train_workers,
        cpus=p.cpus_per_worker,
        gpus=_gpus(cfg),
        reference=p.reference if reference else None,
        critic=p.critic if critic_needed(cfg) else None,
        strategy=p.strategy,
        rollout_resources=p.rollout_resources,
        train_resources=p.train_resources,
    )
    if model is not None and tokenizer is None:
        raise ValueError("tokenizer: required with model")
    tokenizer = tokenizer if tokenizer is not None else _tokenizer(cfg)
    placement = Placement(plan)
    actors: list[Any] = []
    try:
        model_ref = ray.put(model) if model is not None else None

        def start(cls: type, slot: Any, *args: Any) -> Any:
            threads = cfg.ray.torch_threads or max(1, int(slot.num_cpus))
            device = "cuda" if slot.num_gpus > 0 else "cpu"
            actor = ray.remote(cls).options(**placement.options(slot)).remote(cfg, *args, device, threads)
            actors.append(actor)
            return actor

        train_slots = plan.slots("train")
        workers = [start(TrainWorker, s, s.index, len(train_slots)) for s in train_slots]
        rollouts = [start(RolloutWorker, s, model_ref, tokenizer) for s in plan.slots("rollout")]
        ref_actor = [start(ReferenceWorker, s, model_ref, tokenizer) for s in plan.slots("reference")]
        critic_ref = model_ref if critic_model is None or critic_model is model else ray.put(critic_model)
        critic_actor = [start(CriticWorker, s, critic_ref, tokenizer) for s in plan.slots("critic")]
        # starting: the actors' processes, constructors and model loads, the process group
        t, setting = cfg.ray.startup_timeout_s, "ray.startup_timeout_s"
        addr, port = call(workers[0].address.remote(), "train rank 0 (address)", t, setting)
        setup = [w.setup.remote(model_ref, tokenizer, addr, port) for w in workers]
        call(setup, [f"train rank {r} (setup)" for r in range(len(workers))], t, setting)
        names = [f"rollout actor {i} (start)" for i in range(len(rollouts))]
        names += ["reference actor (start)"] * len(ref_actor) + ["critic actor (start)"] * len(critic_actor)
        starting = rollouts + ref_actor + critic_actor
        call([a.node_id.remote() for a in starting], names, t, setting)  # constructors done
    except BaseException:
        for a in actors:
            ray.kill(a, no_restart=True)
        placement.remove()
        raise
    return RayRoles(
        rollout=RayRolloutGroup(
            rollouts, prompts_per_request=cfg.rollout.prompts_per_request, timeout_s=cfg.ray.timeout_s
        ),
        train=RayTrainGroup(workers, timeout_s=cfg.ray.timeout_s),
        reference=RayReference(ref_actor[0], timeout_s=cfg.ray.timeout_s) if ref_actor else None,
        tokenizer=tokenizer,
        placement=placement,
        actors=actors,
        critic=RayCritic(critic_actor[0], timeout_s=cfg.ray.timeout_s) if critic_actor else None,
    )


def _started(ref: Any, name: str, timeout_s: float) -> None:
    """Wait (at most ``timeout_s``, ``ray.startup_timeout_s``) for an actor's constructor; one
    that raised gives an :class:`ActorCallError` with its exception's last line (e.g. the
    model that did not load)."""
    ray = ray_module()
    wait_all([ref], [name], timeout_s, "ray.startup_timeout_s")
    try:
        ray.get(ref, timeout=timeout_s)
    except ray.exceptions.RayActorError as e:
        lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
        raise ActorCallError(f"{name}: the actor died: {lines[-1] if lines else type(e).__name__}") from None


def build_ray_teacher(
    cfg: Config,
    *,
    model: Any = None,
    tokenizer: Any = None,
    chunk_tokens: int = 0,
    cpus: float = 1.0,
    gpus: float | None = None,
    resources: dict[str, float] | None = None,
) -> RayTeacher:
    """Start a :class:`TeacherWorker` in a placement group of its own (:func:`~trainers.ray.
    placement.plan_teacher`) and return its :class:`RayTeacher`.

    ``cfg.model`` is the teacher (path, dtype; ``cfg.train.autocast``), built on the actor's
    node; ``model`` (with ``tokenizer``): a teacher model shipped through the object store
    instead. ``cpus`` / ``gpus`` / ``resources``: the bundle (``gpus=None``: 1 if the cluster
    has GPUs, else 0). Starts Ray if needed (:func:`init_ray`); waits at most
    ``cfg.ray.startup_timeout_s`` for the actor to load.
    """
    ray = ray_module()
    if model is not None and tokenizer is None:
        raise ValueError("tokenizer: required with model")
    init_ray(cfg)
    if gpus is None:
        gpus = 1.0 if ray.cluster_resources().get("GPU", 0) > 0 else 0.0
    plan = plan_teacher(cpus=cpus, gpus=gpus, resources=resources)
    slot = plan.slots("teacher")[0]
    placement = Placement(plan)
    actor = None
    try:
        model_ref = ray.put(model) if model is not None else None
        threads = cfg.ray.torch_threads or max(1, int(slot.num_cpus))
        device = "cuda" if slot.num_gpus > 0 else "cpu"
        actor = (
            ray.remote(TeacherWorker)
            .options(**placement.options(slot))
            .remote(cfg, model_ref, tokenizer, device, threads, chunk_tokens)
        )
        teacher = RayTeacher(actor, placement, timeout_s=cfg.ray.timeout_s)
        _started(actor.node_id.remote(), "teacher actor (start)", cfg.ray.startup_timeout_s)
    except BaseException:
        if actor is not None:
            ray.kill(actor, no_restart=True)
        placement.remove()
        raise
    return teacher
