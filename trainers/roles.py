"""The roles of an RLVR run, built in this process or as Ray actors: rollout, train, reference,
critic, reward.

:func:`build_roles` turns a config into a :class:`Roles`: the rollout role (an engine, or a
group of Ray rollout actors), the train role as a :class:`~trainers.learner.Learner` (in
process, or the Ray train group), the frozen reference policy when ``algorithm.kl.coef > 0``,
the learned critic when ``algorithm.advantage`` is ``gae`` or ``asyppo`` (:mod:`trainers.critic`),
and the :class:`~trainers.rewards.RewardPool` that scores samples as they finish. The loops
talk only to these; ``Roles.close()`` stops what was started here. docs/distributed.md.
"""

from __future__ import annotations

import copy
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from trainers.config import AgenticConfig, Config, DistillConfig, critic_needed
from trainers.critic import build_critic
from trainers.data import Prompt
from trainers.engines.build import build_engines, build_model, frozen_reference, parse_dtype
from trainers.engines.options import rollout_dtype, train_autocast
from trainers.engines.requests import RequestEnginePool, as_request_engine
from trainers.engines.server_rollout import ServerRolloutEngine
from trainers.engines.weight_sync import PROBE_TEXT, check_probe, probe_gap
from trainers.learner import Learner, learner_for, supervised_warmup
from trainers.models import is_hub_id
from trainers.ray import (
    RayRequestEngine,
    RayRolloutGroup,
    RayTeacher,
    build_ray_roles,
    build_ray_teacher,
    teacher_engine,
)
from trainers.rewards import RewardPool, get_verifier
from trainers.rewards.routing import domain_verifiers

__all__ = [
    "AnswerReward",
    "Roles",
    "build_roles",
    "build_teacher",
    "build_verifier",
    "close_all",
    "is_ray_teacher",
    "on_ray",
    "ray_request_engines",
    "request_view",
    "reward_pool",
    "teacher_config",
]

#: the reward pool's failure counters reported every step
REWARD_FAILURES = ("errors", "timeouts", "crashes", "retries", "crash_failures")


@dataclass(frozen=True)
class AnswerReward:
    """A ``(text, answer) -> float`` reward function as a ``(text, prompt)`` verifier (picklable if
    the function is, so it runs in process and Ray reward pools too)."""

    fn: Any

    def __call__(self, completion: str, prompt: Prompt) -> float:
        return self.fn(completion, prompt.answer)


@dataclass
class Roles:
    """What a loop trains with (module docstring).

    ``train`` is the train role as given or built (a TrainEngine in process, the Ray train group
    on Ray); ``learner`` is the same role behind the :class:`~trainers.learner.Learner` interface.
    ``offload``: the rollout sleeps while the learner trains (Ray, colocated, ``placement.offload``),
    or the train state leaves the device while the rollout generates (``train_offload``).
    """

    cfg: Config | AgenticConfig
    rollout: Any
    train: Any
    learner: Learner
    tokenizer: Any
    reference: Any
    rewards: RewardPool | None  # None: a run without a reward section (the agentic one: its environments score)
    verifier: Any
    reward_fn: Any = None
    critic: Any = None  # algorithm.advantage=gae / asyppo: the learned critic (trainers.critic.Critic)
    owned: list[Any] = field(default_factory=list)
    # False: the rollout serves while the learner trains (the agentic loop's environments and
    # background collection), so a colocated rollout never sleeps
    may_sleep: bool = True
    _reward_busy: float = 0.0
    _probe_ids: list[int] | None = None
    _probe_gap: float | None = None
    _probe_s: float = 0.0
    _sync_metrics: dict[str, float] = field(default_factory=dict)
    _domain_busy: dict[str, float] = field(default_factory=dict)

    @property
    def rollout_sleeps(self) -> bool:
        """The rollout sleeps while the learner trains (Ray, colocated, ``placement.offload``)."""
        p = self.cfg.placement
        return self.may_sleep and self.cfg.ray.enabled and p.mode == "colocated" and p.offload

    @property
    def train_offload(self) -> bool:
        """The train state moves to the host between updates (``placement.offload_train``; on
        Ray with ``placement.mode=colocated``, in process always: one device)."""
        p = self.cfg.placement
        return p.offload_train and (not self.cfg.ray.enabled or p.mode == "colocated")

    @property
    def offload(self) -> bool:
        """Whether a step switches the device between the rollout and the learner at all."""
        return self.rollout_sleeps or self.train_offload

    def _train_engine(self) -> Any:
        """What holds the train state: the in-process engine, or the Ray train group."""
        engine = getattr(self.learner, "engine", self.learner)
        if not (callable(getattr(engine, "offload", None)) and callable(getattr(engine, "onload", None))):
            raise ValueError(
                f"placement.offload_train: the train role {type(engine).__name__} has no offload() / onload(); "
                "set placement.offload_train=false"
            )
        return engine

    def offload_train(self) -> None:
        """Move the train state to the host (``train_offload``; idempotent)."""
        if self.train_offload:
            self._train_engine().offload()

    def sleep_rollout(self) -> None:
        """Before training: a colocated rollout frees its memory (``placement.sleep_level``), then
        the train state comes back to the device (``placement.offload_train``)."""
        if self.rollout_sleeps:
            self.rollout.sleep(self.cfg.placement.sleep_level)
        if self.train_offload:
            self._train_engine().onload()

    def push_weights(self, version: int) -> None:
        """After training: wake a colocated rollout, load the learner's weights into it, and move
        the train state to the host for the next generation (``placement.offload_train``)."""
        if self.rollout_sleeps:
            self.rollout.wake()
        direct = getattr(self.train, "push_weights", None)
        if self.cfg.rollout.weight_sync != "reload" and callable(direct) and isinstance(self.rollout, RayRolloutGroup):
            self._sync_metrics = direct(self.rollout, version)  # train rank 0 -> the rollout actors
        else:
            self.rollout.update_weights(self.learner.export_weights(), version=version)
        self.check_weights(version)
        self.offload_train()

    def check_weights(self, version: int) -> None:
        """After a sync (``rollout.weight_check``): the probe, a few sampled tokens' log-probs from
        the rollout against the learner's (:func:`~trainers.engines.weight_sync.probe_gap`); a gap
        above ``rollout.weight_probe_tol`` (0: by dtype, :func:`probe_tol`) stops the run with a
        one-line error. The gap is ``sync/probe_gap`` in :meth:`rollout_metrics`. Skipped where the
        rollout cannot generate here or the learner cannot score."""
        r = self.cfg.rollout
        policy = getattr(self.learner, "engine", self.learner)
        scores = hasattr(policy, "logprobs") or hasattr(policy, "batch_logprobs")
        if not r.weight_check or self.tokenizer is None or not callable(getattr(self.rollout, "generate", None)) or not scores:
            return
        if self._probe_ids is None:
            self._probe_ids = list(self.tokenizer(PROBE_TEXT).input_ids)
        t0 = time.perf_counter()
        gap = probe_gap(self.rollout, policy, self._probe_ids, pad_token_id=self.tokenizer.pad_token_id or 0,
                        micro_batch_size=self.cfg.train.micro_batch_size)
        self._probe_gap, self._probe_s = gap, time.perf_counter() - t0
        check_probe(gap, probe_tol(self.cfg), engine=f"rollout.engine={r.engine}", version=version)

    def freeze_reference(self) -> Any:
        """The frozen copy of the policy's *current* weights as the reference, when
        ``algorithm.kl.coef > 0`` and none was given or made (:func:`build_roles` with
        ``reference_later=True``: a loop that warms the policy up first); returns the reference."""
        if self.reference is None:
            self.reference = _reference(self.cfg, self.train, None)
        return self.reference

    def reward_metrics(self) -> dict[str, float]:
        """The reward pool's share since the previous call: ``time/reward_busy`` (seconds inside
        the verifier, summed over workers; above the wall-clock ``time/reward`` when workers score
        in parallel), ``reward/workers`` and ``reward/workers_hwm``, the run's failure counts
        (``reward/errors``, ``timeouts``, ``crashes``, ``retries``, ``crash_failures``); with an
        inline verifier that counts its own work (the LLM judge) its counters as ``judge/<name>``;
        with ``data.domains``, ``domain/<name>/reward_busy_s`` per domain. ``{}`` without a pool."""
        if self.rewards is None:
            return {}
        m = self.rewards.metrics()
        busy, self._reward_busy = m["busy_s"] - self._reward_busy, m["busy_s"]
        out = {
            "time/reward_busy": busy,
            "reward/workers": m["workers"],
            "reward/workers_hwm": m["workers_hwm"],
        }
        # failures over the run so far: verifier errors, timeouts, worker crashes, retries, lost samples
        out.update({f"reward/{k}": m[k] for k in REWARD_FAILURES if k in m})
        for d, s in self.rewards.busy_by_domain().items():  # data.domains: verifier seconds per domain
            if d:
                out[f"domain/{d}/reward_busy_s"] = s - self._domain_busy.get(d, 0.0)
                self._domain_busy[d] = s
        counts = getattr(self.verifier, "metrics", None)
        if self.cfg.reward.backend == "inline" and self.reward_fn is None and callable(counts):
            out.update({f"judge/{k}": float(v) for k, v in counts().items()})
        return out

    def rollout_metrics(self) -> dict[str, float]:
        """The rollout engine's own counters, where it keeps any (the server engine's
        ``server/*``: live, dropped and restarted servers, re-routed requests, errors, weight
        updates, and ``server/drop_cause``, a string; ``sync/*`` of its last weight sync), the
        probe's ``sync/probe_gap`` and ``time/probe`` (:meth:`check_weights`), and on Ray the
        ``sync/*`` of train rank 0's direct sync; ``{}`` where there is none of these."""
        counts = getattr(self.rollout, "metrics", None)
        probe = {} if self._probe_gap is None else {"sync/probe_gap": self._probe_gap, "time/probe": self._probe_s}
        out = {**self._sync_metrics, **probe}
        if not callable(counts):
            return out
        return {**out, **{k: v if isinstance(v, str) else float(v) for k, v in counts().items()}}

    def close(self) -> None:
        """Stop the reward workers, the Ray actors / placement groups and the inference servers
        started here (engines passed in are the caller's), each whatever failed before.
        Idempotent."""
        pool = [] if self.rewards is None else [self.rewards.close]
        close_all([*pool, *[o.close for o in reversed(self.owned)]])
        self.owned.clear()


def probe_tol(cfg: Config | AgenticConfig) -> float:
    """``rollout.weight_probe_tol``, or by dtype where it is 0: 1e-3 where the rollout's weights and
    the trainer's forward are float32 (equal weights differ by about 3e-5 there, one Adam step at
    lr 1e-5 by 0.2-0.8 on SmolLM2-135M: measured), else 1.0 (bfloat16's own gap is 0.1-0.2 there,
    so only weights that are plainly not the trainer's are caught)."""
    r = cfg.rollout
    if r.weight_probe_tol > 0:
        return float(r.weight_probe_tol)
    dev = cfg.train.device
    exact = rollout_dtype(cfg, dev) == torch.float32 and parse_dtype(cfg.model.dtype) == torch.float32
    return 1e-3 if exact and train_autocast(cfg, dev) is None else 1.0


def close_all(steps: list[Any]) -> None:
    """Run every cleanup step even when some fail (a dead actor, a broken pool); the failures
    become one warning naming them, never an exception that would leak what comes after."""
    failed = []
    for step in steps:
        try:
            step()
        except Exception as e:
            failed.append(
                f"{getattr(step, '__qualname__', step)}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            )
    if failed:
        warnings.warn("cleanup steps failed (the others ran): " + "; ".join(failed), stacklevel=3)


def _reference(cfg: Config, train: Any, given: Any) -> Any:
    """The frozen initial policy (``algorithm.kl.coef > 0``): ``given``, or a frozen copy of the
    in-process train engine's weights (:func:`~trainers.engines.build.frozen_reference`: also for
    DeepSpeed, FSDP2 and Megatron engines, whose own forward runs on the live weights)."""
    if cfg.algorithm.kl.coef <= 0:
        return None
    if given is not None:
        return given
    return frozen_reference(train, dtype=parse_dtype(cfg.model.dtype), packing=bool(cfg.train.packing))


def _critic(cfg: Config, model: Any, given: Any, ray_critic: Any) -> Any:
    """The critic role when ``algorithm.advantage`` needs one: ``given``, the Ray critic actor,
    or a :class:`~trainers.critic.LocalCritic` from ``critic.model_path`` or the initial policy
    ``model`` (default: ``cfg.model`` loaded afresh)."""
    if not critic_needed(cfg):
        return None
    if given is not None:
        return given
    if ray_critic is not None:
        return ray_critic
    return build_critic(cfg, policy=model)


def build_verifier(cfg: Config) -> Any:
    """The verifier of ``cfg``: one per domain routed by tag with ``data.domains``
    (:func:`trainers.rewards.routing.domain_verifiers`), else ``reward.verifier``."""
    return domain_verifiers(cfg) or get_verifier(cfg.reward.verifier, **cfg.reward.verifier_options())


def reward_pool(cfg: Config, verifier: Any, reward_fn: Any = None) -> RewardPool:
    """The :class:`~trainers.rewards.RewardPool` of ``cfg.reward`` over ``verifier`` (or over
    ``reward_fn(text, answer)`` when given)."""
    r = cfg.reward
    return RewardPool(
        verifier if reward_fn is None else AnswerReward(reward_fn),
        backend=r.backend,
        num_workers=r.num_workers,
        max_workers=r.max_workers or None,
        idle_s=r.idle_s,
        timeout_s=r.timeout_s,
        ray_num_cpus=r.cpus_per_worker,
        max_retries=r.max_retries,
    )


def build_roles(
    cfg: Config | AgenticConfig,
    *,
    rollout: Any = None,
    train: Any = None,
    tokenizer: Any = None,
    model: Any = None,
    reward_fn: Any = None,
    reference: Any = None,
    critic: Any = None,
    critic_model: Any = None,
    max_positions: int = 512,
    reference_later: bool = False,
    rollout_may_sleep: bool = True,
) -> Roles:
    """The roles of ``cfg`` (module docstring).

    Args:
        rollout, train, tokenizer: given roles (a RolloutEngine, and a TrainEngine or a
            :class:`~trainers.learner.Learner`); ``rollout`` must start with ``train``'s weights.
            Default: built from ``cfg`` (``ray.enabled``: Ray actors placed by ``cfg.placement``;
            else :func:`~trainers.engines.build.build_engines`).
        model: the initial policy (with ``tokenizer``) for the built roles instead of ``cfg.model``.
        reward_fn: ``(completion_text, answer) -> float`` instead of the verifier ``reward.verifier``.
        reference: the frozen reference policy (anything with the TrainEngine ``logprobs`` or a
            ``batch_logprobs`` method); default: a frozen copy of the initial policy.
        critic: the critic (a :class:`~trainers.critic.Critic`) when ``algorithm.advantage`` is
            ``gae`` or ``asyppo``; default: built from ``critic.*`` (a Ray actor on Ray).
        critic_model: the policy the built critic starts from (``critic.model_path`` unset)
            when it is not ``model`` (the agentic trainer's on Ray: ``model`` before its
            warm-up, as the in-process critic); default: ``model``.
        max_positions: the tiny model's positions when it is built here (the agentic runs:
            ``env.max_context``).
        reference_later: in process, the frozen copy of the policy is made by
            :meth:`Roles.freeze_reference` (after a warm-up), not here.
        rollout_may_sleep: ``False``: a colocated rollout never sleeps while the learner trains
            (a loop whose rollout keeps serving, as the agentic one's environments).

    A run config without a ``reward`` section (:class:`~trainers.config.AgenticConfig`: its
    environments score the episodes) gets no verifier and no reward pool.
    """
    owned: list[Any] = []
    ray_critic = None
    critic_model = model if critic_model is None else critic_model
    if critic is None and not cfg.ray.enabled:  # before the engines: LoRA wraps the policy in place
        critic = _critic(cfg, critic_model, None, None)
    if rollout is None or train is None:
        if cfg.ray.enabled:
            ray_roles = build_ray_roles(
                cfg, model=model, tokenizer=tokenizer, reference=cfg.algorithm.kl.coef > 0, critic_model=critic_model
            )
            owned.append(ray_roles)
            rollout, train, tokenizer = ray_roles.rollout, ray_roles.train, ray_roles.tokenizer
            reference = ray_roles.reference if reference is None else reference
            ray_critic = ray_roles.critic
        else:
            rollout, train, tokenizer = build_engines(
                cfg, model=model, tokenizer=tokenizer, max_positions=max_positions
            )
            if isinstance(rollout, ServerRolloutEngine):
                owned.append(rollout)  # its servers stop with the roles, not when it is collected
    if tokenizer is None:
        raise ValueError("tokenizer: required when the engines are passed in")
    try:
        critic = _critic(cfg, critic_model, critic, ray_critic)
        scored = hasattr(cfg, "reward")
        verifier = build_verifier(cfg) if scored else None
        rewards = reward_pool(cfg, verifier, reward_fn) if scored else None
    except BaseException:
        for o in owned:
            o.close()
        raise
    roles = Roles(
        cfg=cfg,
        rollout=rollout,
        train=train,
        learner=learner_for(train, cfg),
        tokenizer=tokenizer,
        reference=reference if reference_later and not cfg.ray.enabled else _reference(cfg, train, reference),
        rewards=rewards,
        verifier=verifier,
        reward_fn=reward_fn,
        critic=critic,
        owned=owned,
        may_sleep=rollout_may_sleep,
    )
    try:
        roles.offload_train()  # the first generation runs with the train state on the host
    except BaseException:
        roles.close()
        raise
    return roles


def on_ray(rollout: Any) -> bool:
    """Whether the rollout role is a group of Ray rollout actors (:class:`~trainers.ray.RayRolloutGroup`)."""
    return isinstance(rollout, RayRolloutGroup)


def ray_request_engines(rollout: Any, cfg: Config, seed: int, *, renew: bool = False) -> list[Any]:
    """One :class:`~trainers.ray.RayRequestEngine` per actor of a Ray rollout group (actor ``k``
    seeded ``seed + k``, named ``rollout actor k``, the deadline ``ray.timeout_s``; with
    ``renew`` every actor builds its request engine again, as a tail-batching round asks)."""
    return [
        RayRequestEngine(
            a,
            chunk_tokens=cfg.rollout.chunk_tokens,
            seed=seed + k,
            timeout_s=cfg.ray.timeout_s,
            name=f"rollout actor {k}",
            renew=renew,
        )
        for k, a in enumerate(rollout.actors)
    ]


def request_view(rollout: Any, cfg: Config, seed: int, *, renew: bool = False) -> Any:
    """The request-level view of the rollout role: over a Ray rollout group, a
    :class:`~trainers.engines.requests.RequestEnginePool` of :func:`ray_request_engines`;
    otherwise :func:`~trainers.engines.requests.as_request_engine` (``renew`` changes nothing:
    the view is made here)."""
    if on_ray(rollout):
        return RequestEnginePool(ray_request_engines(rollout, cfg, seed, renew=renew))
    return as_request_engine(rollout, chunk_tokens=cfg.rollout.chunk_tokens, seed=seed)


# --------------------------------------------------------------------------- the teacher role


def is_ray_teacher(teacher: Any) -> bool:
    """Whether ``teacher`` is a Ray actor's handle (:class:`~trainers.ray.RayTeacher`: close it)."""
    return isinstance(teacher, RayTeacher)


def _check_vocab(teacher_vocab: dict[str, int] | None, tokenizer: Any, where: str) -> None:
    get_s = getattr(tokenizer, "get_vocab", None)
    if teacher_vocab is not None and callable(get_s) and teacher_vocab != get_s():
        raise ValueError(
            f"distill.teacher: {where}'s tokenizer differs from the student's (the teacher scores the "
            "student's token ids: use a teacher of the same tokenizer)"
        )


def _vocab(tok: Any) -> dict[str, int] | None:
    get = getattr(tok, "get_vocab", None)
    return get() if callable(get) else None


def teacher_config(cfg: DistillConfig) -> DistillConfig:
    """A copy of ``cfg`` whose ``model`` section is the teacher's (``distill.teacher``,
    ``distill.teacher_tiny_seed``, ``distill.teacher_dtype`` or ``model.dtype``)."""
    d, tcfg = cfg.distill, copy.deepcopy(cfg)
    tcfg.model.path, tcfg.model.tiny_seed = d.teacher, d.teacher_tiny_seed
    tcfg.model.dtype = d.teacher_dtype or cfg.model.dtype
    return tcfg


def _load_teacher(tcfg: DistillConfig, tokenizer: Any) -> Any:
    """The teacher model of ``tcfg.model``, its tokenizer checked against the student's."""
    where = tcfg.model.path or "the embedded default"
    try:
        teacher, teacher_tok = build_model(tcfg)
    except ValueError as e:
        raise ValueError(f"distill.teacher: {e}") from None
    _check_vocab(_vocab(teacher_tok), tokenizer, where)
    return teacher


def build_teacher(cfg: DistillConfig, tokenizer: Any, prompts: list[Prompt], teacher: Any = None) -> Any:
    """The frozen teacher engine: ``teacher`` as given when it has ``logprobs`` /
    ``batch_logprobs``; else a :class:`~trainers.engines.torch_train.TorchTrainEngine` over
    ``teacher`` (a model) or over ``distill.teacher`` loaded with :func:`build_model`, warmed up
    with ``distill.teacher_warmup_steps`` supervised steps on ``prompts``, then frozen.

    ``distill.teacher_placement="ray"``: the same engine in a Ray actor, behind a
    :class:`~trainers.ray.RayTeacher` (close it when done; :class:`DistillTrainer` does). The
    actor loads ``distill.teacher`` itself, unless a model is given or warmed up here first
    (then it is shipped through the object store).
    """
    if teacher is not None and (hasattr(teacher, "logprobs") or hasattr(teacher, "batch_logprobs")):
        return teacher
    d, tcfg = cfg.distill, teacher_config(cfg)
    if d.teacher_placement == "ray" and teacher is None and not d.teacher_warmup_steps:
        return _ray_teacher(tcfg, tokenizer)
    if teacher is None:
        teacher = _load_teacher(tcfg, tokenizer)
    dev = cfg.train.device
    eng = teacher_engine(tcfg, teacher, dev, chunk_tokens=d.teacher_chunk_tokens, lr=d.teacher_warmup_lr)
    if d.teacher_warmup_steps:
        supervised_warmup(
            eng,
            tokenizer,
            prompts,
            steps=d.teacher_warmup_steps,
            batch_size=32,
            seed=cfg.seed + 1,
            chat_template=cfg.data.chat_template,
        )
    eng.model.eval().requires_grad_(False)  # frozen in place (no second copy of a large teacher)
    if d.teacher_placement == "ray":
        return _ray_teacher(tcfg, tokenizer, model=eng.model.cpu())
    return eng


def _ray_teacher(tcfg: DistillConfig, tokenizer: Any, model: Any = None) -> RayTeacher:
    """The teacher in a Ray actor: ``model`` shipped, or ``tcfg.model`` loaded by the actor
    (its path checked here first, for a one-line error)."""
    d, path = tcfg.distill, tcfg.model.path
    if model is None and path not in ("", "tiny") and not Path(path).exists() and not is_hub_id(path):
        raise ValueError(
            f"distill.teacher: model.path: {path} does not exist (give a local HF checkpoint directory or a hub name)"
        )
    rt = build_ray_teacher(
        tcfg,
        model=model,
        tokenizer=tokenizer if model is not None else None,
        chunk_tokens=d.teacher_chunk_tokens,
        cpus=d.teacher_cpus,
        gpus=d.teacher_gpus,
    )
    try:
        _check_vocab(rt.vocab(), tokenizer, path or "the embedded default")
    except BaseException:
        rt.close()
        raise
    return rt
