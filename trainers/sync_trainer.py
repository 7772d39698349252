"""The synchronous RLVR trainer: one readable loop over rollout, train, reference and reward roles.

:meth:`SyncTrainer.step` is the whole RL step on one screen::

    sample prompts -> generate n per prompt, scoring each sample as it finishes (RewardPool)
    -> filter (dynamic sampling: refill until the batch is full, at most filter.max_rounds
    rounds) -> [reference log-probs] -> advantages (registry name) -> [rollout.sleep()]
    -> learner.update: ppo_epochs x mini-batches x micro-batches of policy loss (registry
    name) + aggregate(global_normalizers) -> [rollout.wake()] -> push weights -> log

Everything algorithmic is a rollkit primitive picked by name in :class:`~trainers.config.Config`.
The loop talks to four roles through small interfaces, so the same code runs in this process
and on Ray (:mod:`trainers.ray`, ``ray.enabled=true``; docs/distributed.md):

* rollout: :class:`~trainers.engines.base.RolloutEngine` (``generate`` / ``generate_iter``,
  ``update_weights``, ``sleep`` / ``wake``): an engine, or a group of Ray rollout actors;
* train (the *learner*): ``update(batch, advantages, ref_logprobs, seed=) -> metrics`` and
  ``export_weights()``: :class:`LocalLearner` runs :func:`ppo_update` on a
  :class:`~trainers.engines.base.TrainEngine` here; a Ray train group runs the same
  :func:`ppo_update` on every data-parallel rank;
* reference: the frozen initial policy behind the TrainEngine ``logprobs`` method (or a Ray
  actor's ``batch_logprobs``), used when ``algorithm.kl.coef > 0``;
* reward: a :class:`~trainers.rewards.RewardPool` (inline, worker processes or Ray actors).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import random
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from rollkit.losses import aggregate, global_normalizers
from rollkit.registry import ADVANTAGE_ESTIMATORS, FILTERS, POLICY_LOSSES, REGULARIZERS
from rollkit.rewards import RunningRewardNormalizer
from rollkit.scheduling import EpochSampler, TailBatch, TailBatchingPolicy
from trainers.config import Config
from trainers.data import (
    Prompt,
    PromptIterator,
    addition_task,
    encode_prompt,
    load_prompts,
)
from trainers.engines.base import (
    PackedBatch,
    RolloutEngine,
    SamplingParams,
    TrainEngine,
    batch_logprobs,
    iter_generations,
    pack_generations,
)
from trainers.lengths import LengthSampler
from trainers.tracking import Tracker

__all__ = [
    "Learner",
    "LocalLearner",
    "SyncTrainer",
    "UpdateSpec",
    "UpdateStats",
    "build_engines",
    "build_model",
    "build_prompts",
    "make_rollout_engine",
    "make_train_engine",
    "ppo_update",
    "supervised_warmup",
]

RewardFn = Callable[[str, str], float]
ROLLOUT_ENGINES = ("hf", "vllm")
TRAIN_ENGINES = ("torch", "deepspeed")


def _dtype(name: str) -> torch.dtype:
    try:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]
    except KeyError:
        raise ValueError(f"model.dtype must be float32, bfloat16 or float16, got {name!r}") from None


def fast_bf16(device: str) -> bool:
    """Whether bfloat16 matmuls are fast on ``device``: CUDA with bf16 support, or a CPU with
    AMX tiles (measured on this project's CPUs: 4-9x float32 for a 2048x576x1536 matmul)."""
    if str(device).startswith("cuda"):
        return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    amx = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(amx is not None and amx())


def rollout_dtype(cfg: Config, device: str) -> torch.dtype:
    """``rollout.dtype`` resolved (``""``: ``model.dtype``; ``"auto"``: bfloat16 if fast)."""
    d = cfg.rollout.dtype
    if d == "":
        return _dtype(cfg.model.dtype)
    if d == "auto":
        return torch.bfloat16 if fast_bf16(device) else _dtype(cfg.model.dtype)
    try:
        return _dtype(d)
    except ValueError:
        raise ValueError(f"rollout.dtype must be '', auto, float32, bfloat16 or float16, got {d!r}") from None


def train_autocast(cfg: Config, device: str) -> torch.dtype | None:
    """``train.autocast`` resolved to a dtype or None (``"auto"``: bfloat16 if fast and the
    model is float32, for the torch engine)."""
    a = cfg.train.autocast
    if a == "off":
        return None
    if a == "auto":
        ok = cfg.train.engine == "torch" and cfg.model.dtype == "float32" and fast_bf16(device)
        return torch.bfloat16 if ok else None
    if a not in ("bfloat16", "float16"):
        raise ValueError(f"train.autocast must be off, auto, bfloat16 or float16, got {a!r}")
    if cfg.train.engine != "torch":
        raise ValueError(
            f"train.autocast={a} applies to the torch engine; with train.engine={cfg.train.engine} "
            "set model.dtype=bfloat16 (DeepSpeed's own bf16 mode)"
        )
    return _dtype(a)


def _lr_lambda(cfg: Config) -> Callable[[int], float]:
    warm, total, kind = cfg.train.warmup_steps, max(cfg.train.steps, 1), cfg.train.lr_schedule
    if kind not in ("constant", "cosine"):
        raise ValueError(f"train.lr_schedule must be constant or cosine, got {kind!r}")

    def f(step: int) -> float:  # step counts optimizer steps
        if warm and step < warm:
            return (step + 1) / warm
        if kind == "cosine":
            return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warm) / max(1, total - warm))))
        return 1.0

    return f


def build_model(cfg: Config) -> tuple[Any, Any]:
    """``(model, tokenizer)`` of ``cfg.model``: the tiny Qwen2 + character tokenizer for
    ``"tiny"``, else a local Hugging Face checkpoint (``""``: the embedded default)."""
    from trainers.models import char_tokenizer, default_model_path, load_model, tiny_qwen2

    dtype = _dtype(cfg.model.dtype)
    if cfg.model.path == "tiny":
        tok = char_tokenizer()
        m = cfg.model
        return tiny_qwen2(
            tok, seed=m.tiny_seed, heads=m.tiny_heads, kv_heads=m.tiny_kv_heads, dtype=dtype
        ), tok
    path = cfg.model.path or default_model_path()
    if not Path(path).exists():
        raise ValueError(f"model.path: {path} does not exist (give a local HF checkpoint directory)")
    return load_model(path, dtype=dtype)


def make_rollout_engine(cfg: Config, model: Any, tokenizer: Any, *, device: str) -> RolloutEngine:
    """The ``rollout.engine`` engine over ``model`` (used as is: pass a copy). vLLM loads from
    a directory: the model and tokenizer are saved to a private temporary directory first,
    which lives as long as the engine (``engine.model_dir``)."""
    r = cfg.rollout
    if r.engine == "hf":
        from trainers.engines import HFRolloutEngine

        return HFRolloutEngine(
            model, tokenizer, device=device, dtype=rollout_dtype(cfg, device), max_batch_size=r.max_batch_size
        )
    if r.engine == "vllm":
        from trainers.engines.vllm_rollout import VLLMRolloutEngine
        from trainers.models import save_model

        tmp = tempfile.TemporaryDirectory(prefix="rollkit-vllm-")
        save_model(model, tokenizer, tmp.name)
        rd = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
        eng = VLLMRolloutEngine(
            tmp.name,
            dtype=rd[rollout_dtype(cfg, device)],
            gpu_memory_utilization=r.gpu_memory_utilization,
            max_model_len=r.max_model_len,
            seed=cfg.seed,
        )
        eng.model_dir = tmp  # removed with the engine
        return eng
    raise ValueError(f"rollout.engine must be one of {ROLLOUT_ENGINES}, got {r.engine!r}")


def make_train_engine(cfg: Config, model: Any, *, device: str) -> TrainEngine:
    """The ``train.engine`` engine over ``model`` (``torch`` or ``deepspeed`` with
    ``train.zero_stage``), with the config's optimizer settings and LR schedule."""
    t, dtype, lam = cfg.train, _dtype(cfg.model.dtype), _lr_lambda(cfg)
    kw = dict(
        lr=t.lr,
        weight_decay=t.weight_decay,
        grad_clip=t.grad_clip,
        scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lam),
        dtype=dtype,
        device=device,
    )
    if t.engine == "torch":
        from trainers.engines import TorchTrainEngine

        return TorchTrainEngine(model, autocast=train_autocast(cfg, device), **kw)
    if t.engine == "deepspeed":
        train_autocast(cfg, device)  # rejects an explicit autocast
        from trainers.engines.deepspeed_train import DeepSpeedTrainEngine

        return DeepSpeedTrainEngine(model, zero_stage=t.zero_stage, **kw)
    raise ValueError(f"train.engine must be one of {TRAIN_ENGINES}, got {t.engine!r}")


def build_engines(
    cfg: Config, *, model: Any = None, tokenizer: Any = None
) -> tuple[RolloutEngine, TrainEngine, Any]:
    """``(rollout, train, tokenizer)`` in this process: ``rollout.engine`` / ``train.engine``
    over ``model`` (default :func:`build_model`); the rollout gets a copy of the weights."""
    if model is None:
        model, tokenizer = build_model(cfg)
    elif tokenizer is None:
        raise ValueError("tokenizer: required with model")
    rollout = make_rollout_engine(cfg, copy.deepcopy(model), tokenizer, device=cfg.train.device)
    return rollout, make_train_engine(cfg, model, device=cfg.train.device), tokenizer


def build_prompts(cfg: Config) -> tuple[list[Prompt], list[Prompt]]:
    """``(train, held_out)`` prompts: from ``data.train_file`` / ``data.eval_file`` or the task."""
    d = cfg.data
    if d.train_file:
        train = load_prompts(d.train_file)
        if d.eval_file:
            return train, load_prompts(d.eval_file)
        return train[d.eval_size :], train[: d.eval_size]
    if d.task != "addition":
        raise ValueError(f"data.task: unknown task {d.task!r} (known: addition); or set data.train_file")
    return addition_task(digits=d.digits, eval_size=d.eval_size, seed=cfg.seed)


class _Timer:
    def __init__(self) -> None:
        self.t: dict[str, float] = defaultdict(float)

    @contextmanager
    def __call__(self, name: str):
        t0 = time.perf_counter()
        yield
        self.t[name] += time.perf_counter() - t0


def _call(entry: Any, available: dict[str, Any], kwargs: dict[str, Any]) -> Any:
    """Call a registered primitive with the batch tensors its ``in_keys`` name."""
    args = {a: available[k] for a, k in entry.in_keys.items() if available.get(k) is not None}
    missing = [a for a, req in entry.tensor_args().items() if req and a not in args]
    if missing:
        raise ValueError(f"{entry.name}: the trainer has no input for {missing} (in_keys {entry.in_keys})")
    return entry.fn(**args, **kwargs)


# --------------------------------------------------------------------------- the PPO update


@dataclass(frozen=True)
class UpdateSpec:
    """What :func:`ppo_update` needs from the config (picklable: it travels to Ray train actors)."""

    policy_loss: str = "ppo"
    policy_loss_kwargs: dict = field(default_factory=dict)
    aggregation: str = "token-mean"
    entropy_coef: float = 0.0
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    kl_in_loss: bool = False  # algorithm.kl.mode == "loss" (and coef > 0)
    temperature: float = 1.0  # the rollout's: log-probs must be of the same distribution
    ppo_epochs: int = 1
    mini_batch_size: int = 0  # 0: the whole batch
    micro_batch_size: int = 8
    sort_by_length: bool = False  # micro-batches of similar response lengths (less padding)

    @classmethod
    def from_config(cls, cfg: Config) -> UpdateSpec:
        a, t = cfg.algorithm, cfg.train
        return cls(
            policy_loss=a.policy_loss,
            policy_loss_kwargs=dict(a.policy_loss_kwargs),
            aggregation=a.aggregation,
            entropy_coef=a.entropy_coef,
            kl_coef=a.kl.coef,
            kl_estimator=a.kl.estimator,
            kl_in_loss=a.kl.coef > 0 and a.kl.mode == "loss",
            temperature=cfg.rollout.temperature,
            ppo_epochs=t.ppo_epochs,
            mini_batch_size=t.mini_batch_size,
            micro_batch_size=t.micro_batch_size,
            sort_by_length=t.sort_by_length,
        )


@dataclass
class UpdateStats:
    """Metric sums and counts of an update; ranks' stats add up (:meth:`merge`) before the
    means (:meth:`metrics`): token-weighted for loss metrics and entropy, per optimizer step
    for ``optim/*`` (reported by rank 0 only: every rank sees the same all-reduced norm)."""

    sums: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    counts: dict[str, float] = field(default_factory=lambda: defaultdict(float))

    def add(self, key: str, value: float, weight: float = 1.0) -> None:
        self.sums[key] += value
        self.counts[key] += weight

    def merge(self, other: UpdateStats) -> UpdateStats:
        for k, v in other.sums.items():
            self.add(k, v, other.counts[k])
        return self

    def metrics(self) -> dict[str, float]:
        return {k: self.sums[k] / max(self.counts[k], 1) for k in self.sums}


def ppo_update(
    engine: TrainEngine,
    batch: PackedBatch,
    advantages: torch.Tensor,  # [B, T], 0 outside the response
    spec: UpdateSpec,
    *,
    ref_logprobs: torch.Tensor | None = None,  # [B, T]; used when spec.kl_in_loss
    seed: int = 0,
    rank: int = 0,
    world_size: int = 1,
) -> UpdateStats:
    """``ppo_epochs`` x mini-batches x micro-batches of policy loss on ``engine``: the train step
    of :class:`SyncTrainer`, in this process or on each data-parallel rank of a Ray train group.

    Every rank gets the same ``batch`` and ``seed`` (so the same mini-batch order) and takes
    its contiguous share ``rows_m.tensor_split(world_size)[rank]`` of each mini-batch
    ``rows_m``. The loss of a micro-batch is

        L_mb = aggregate(policy_loss, mask_mb, aggregation, num_tokens=N, num_seqs=S, dp_size=W)
               (+ the entropy and KL terms, aggregated the same way)

    where ``N``, ``S`` are the valid tokens / sequences of the *whole* mini-batch over all
    ranks (:func:`rollkit.losses.global_normalizers`, all-reduced when torch.distributed is
    initialised) and ``W`` the world size. The engine averages the ranks' gradients (DDP /
    DeepSpeed), and ``W`` cancels that average, so the ``engine.step()`` that ends each
    mini-batch applies exactly the gradient of the whole mini-batch's loss, whatever the
    number of ranks and micro-batches (up to float rounding; tested 1 vs 2 ranks).

    Collectives must match across ranks: each rank runs ``ceil(ceil(|rows_m| / W) / mbs)``
    micro-batches, padding with a masked-out row (zero loss, zero gradient) when its share is
    shorter, then one ``step``. Returns the rank's :class:`UpdateStats`.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
    loss_entry = POLICY_LOSSES.entry(spec.policy_loss)
    mask = batch.response_mask
    B, mbs = mask.shape[0], spec.micro_batch_size
    mini = spec.mini_batch_size or B
    gen = torch.Generator().manual_seed(seed)
    stats = UpdateStats()
    for _ in range(spec.ppo_epochs):
        order = torch.randperm(B, generator=gen) if spec.ppo_epochs > 1 or mini < B else torch.arange(B)
        for m0 in range(0, B, mini):
            rows_m = order[m0 : m0 + mini]
            local = rows_m.tensor_split(world_size)[rank]
            if spec.sort_by_length:  # same rows, same gradient sum; each micro-batch pads less
                local = local[torch.argsort(mask[local].sum(-1), stable=True)]
            norms = global_normalizers(mask[local])
            n_micro = math.ceil(math.ceil(len(rows_m) / world_size) / mbs)
            for u in range(n_micro):
                rows = local[u * mbs : (u + 1) * mbs]
                pad = len(rows) == 0  # this rank's share ran out: a masked row keeps collectives aligned
                mb = batch[rows_m[:1] if pad else rows]
                if pad:
                    mb.response_mask = torch.zeros_like(mb.response_mask)
                lp, ent = engine.logprobs(
                    mb.input_ids,
                    mb.attention_mask,
                    mb.response_mask,
                    temperature=spec.temperature,
                    with_entropy=True,
                )
                avail = {
                    "logprobs": lp,
                    "old_logprobs": mb.old_logprobs,
                    "behavior_logprobs": mb.old_logprobs
                    if mb.behavior_logprobs is None
                    else mb.behavior_logprobs,
                    "advantages": advantages[rows_m[:1] if pad else rows],
                    "response_mask": mb.response_mask,
                }
                out = _call(loss_entry, avail, spec.policy_loss_kwargs)
                loss = aggregate(out.loss, mb.response_mask, spec.aggregation, **norms)
                if spec.entropy_coef:
                    e = REGULARIZERS.get("entropy")(ent, mb.response_mask, coef=spec.entropy_coef)
                    loss = loss + aggregate(e.loss, mb.response_mask, spec.aggregation, **norms)
                if ref_logprobs is not None and spec.kl_in_loss:
                    kl = REGULARIZERS.get("kl")(
                        lp,
                        ref_logprobs[rows_m[:1] if pad else rows],
                        mb.response_mask,
                        estimator=spec.kl_estimator,
                        coef=spec.kl_coef,
                    )
                    loss = loss + aggregate(kl.loss, mb.response_mask, spec.aggregation, **norms)
                engine.backward(loss)
                if pad:
                    continue
                w = int(mb.response_mask.sum())
                for k, v in out.metrics.items():
                    stats.add(f"loss/{k}", float(v) * w, w)
                stats.add("entropy", float(ent.detach()[mb.response_mask].sum()), w)
            for k, v in engine.step().items():
                if rank == 0:
                    stats.add(f"optim/{k}", v)
    return stats


@runtime_checkable
class Learner(Protocol):
    """The train role as :class:`SyncTrainer` sees it."""

    def update(
        self, batch: PackedBatch, advantages: torch.Tensor, ref_logprobs: torch.Tensor | None, *, seed: int
    ) -> dict[str, float]: ...

    def export_weights(self) -> Any: ...


class LocalLearner:
    """The train role in this process: :func:`ppo_update` on one :class:`TrainEngine`."""

    def __init__(self, engine: TrainEngine, spec: UpdateSpec) -> None:
        self.engine, self.spec = engine, spec

    def update(
        self, batch: PackedBatch, advantages: torch.Tensor, ref_logprobs: torch.Tensor | None, *, seed: int
    ) -> dict[str, float]:
        return ppo_update(
            self.engine, batch, advantages, self.spec, ref_logprobs=ref_logprobs, seed=seed
        ).metrics()

    def export_weights(self) -> Any:
        return self.engine.export_weights()


@dataclass(frozen=True)
class _AnswerReward:
    """A ``(text, answer)`` reward function as a ``(text, prompt)`` verifier (picklable if it is)."""

    fn: RewardFn

    def __call__(self, completion: str, prompt: Prompt) -> float:
        return self.fn(completion, prompt.answer)


# --------------------------------------------------------------------------- the trainer


class SyncTrainer:
    """Synchronous RLVR: ``fit()`` = evaluate, ``steps`` x :meth:`step`, evaluate, plot.

    Args:
        cfg: the configuration.
        rollout, train, tokenizer: the rollout role (a RolloutEngine) and the train role (a
            TrainEngine, or a :class:`Learner` such as a Ray train group) and the tokenizer.
            ``rollout`` must start with the same weights as ``train``. Default: built from
            ``cfg`` (``ray.enabled``: Ray actors placed by ``cfg.placement``, see
            :func:`trainers.ray.build_ray_roles`; else :func:`build_engines`).
        model: the initial policy (a transformers causal LM, with ``tokenizer``) for the
            default roles instead of ``cfg.model``, e.g. a warmed-up model.
        train_prompts, eval_prompts: default :func:`build_prompts`.
        reward_fn: ``(completion_text, answer) -> float``; default: the verifier
            ``cfg.reward.verifier``. Either runs in a :class:`~trainers.rewards.RewardPool`
            (``cfg.reward.backend``; inline, the attribute ``reward_fn`` is read per sample).
        reference: anything with the TrainEngine ``logprobs`` method (or ``batch_logprobs``),
            holding the frozen initial policy (used when ``algorithm.kl.coef > 0``); default:
            a frozen deep copy of ``train.model`` (in process) or a Ray reference actor.

    :meth:`close` (or ``with SyncTrainer(...) as tr``) stops the reward workers and the Ray
    actors the trainer started.
    """

    def __init__(
        self,
        cfg: Config,
        *,
        rollout: RolloutEngine | None = None,
        train: TrainEngine | Learner | None = None,
        tokenizer: Any = None,
        model: Any = None,
        train_prompts: list[Prompt] | None = None,
        eval_prompts: list[Prompt] | None = None,
        reward_fn: RewardFn | None = None,
        reference: Any = None,
    ) -> None:
        from trainers.rewards import RewardPool, get_verifier

        self.cfg = cfg
        self._validate()
        a = cfg.algorithm
        self._owned: list[Any] = []  # roles this trainer started: close() stops them
        if rollout is None or train is None:
            if cfg.ray.enabled:
                from trainers.ray import build_ray_roles

                roles = build_ray_roles(cfg, model=model, tokenizer=tokenizer, reference=a.kl.coef > 0)
                self._owned.append(roles)
                rollout, train, tokenizer = roles.rollout, roles.train, roles.tokenizer
                reference = roles.reference if reference is None else reference
            else:
                rollout, train, tokenizer = build_engines(cfg, model=model, tokenizer=tokenizer)
        if tokenizer is None:
            raise ValueError("tokenizer: required when the engines are passed in")
        self.rollout, self.train, self.tok = rollout, train, tokenizer
        self.learner = (
            train if isinstance(train, Learner) else LocalLearner(train, UpdateSpec.from_config(cfg))
        )
        self.offload = cfg.ray.enabled and cfg.placement.mode == "colocated" and cfg.placement.offload
        if train_prompts is None or eval_prompts is None:
            tp, ep = build_prompts(cfg)
            train_prompts = tp if train_prompts is None else train_prompts
            eval_prompts = ep if eval_prompts is None else eval_prompts
        self.train_prompts, self.eval_prompts = train_prompts, eval_prompts
        self.reward_fn = reward_fn
        self.verifier = get_verifier(cfg.reward.verifier, **cfg.reward.verifier_options())
        r = cfg.reward
        scorer = (
            self._score
            if r.backend == "inline"
            else self.verifier
            if reward_fn is None
            else _AnswerReward(reward_fn)
        )
        self.rewards = RewardPool(
            scorer,
            backend=r.backend,
            num_workers=r.num_workers,
            max_workers=r.max_workers or None,
            idle_s=r.idle_s,
            timeout_s=r.timeout_s,
            ray_num_cpus=r.cpus_per_worker,
        )
        self.iterator = PromptIterator(train_prompts, seed=cfg.seed)
        self.lengths = LengthSampler(cfg.rollout.length_dist, cap=cfg.rollout.max_tokens, seed=cfg.seed)
        self._requests: Any = None  # the request-level view of the rollout engine, when needed
        # tail_batching.enabled: RollPacker's tail batching drives the rollout (_collect_tail_groups)
        self.tail: TailBatchingPolicy | None = None
        self.tail_sampler: EpochSampler | None = None
        self.last_tail_batch: TailBatch | None = None  # the latest round's batch (prompt ids, round)
        if cfg.tail_batching.enabled:
            self._check_request_engine(rollout)
            self.tail = TailBatchingPolicy(
                cfg.rollout.prompts_per_step,
                cfg.rollout.n,
                eta_prompts=cfg.tail_batching.eta_prompts,
                eta_responses=cfg.tail_batching.eta_responses,
                dynamic_sampling=cfg.filter.zero_variance,
                max_tokens=cfg.rollout.max_tokens,
            )
            self.tail_sampler = EpochSampler(len(train_prompts), seed=cfg.seed)
        self._ids: dict[int, list[int]] = {}
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.adv_entry = ADVANTAGE_ESTIMATORS.entry(a.advantage)
        self.normalizer = RunningRewardNormalizer() if a.reward_normalizer else None
        # Reference policy: a frozen copy of the initial policy, behind the same logprobs().
        self.reference = reference if a.kl.coef > 0 else None
        if a.kl.coef > 0 and reference is None:
            self.reference = copy.copy(train)
            self.reference.model = copy.deepcopy(train.model).eval().requires_grad_(False)
        self.global_step = 0
        torch.manual_seed(cfg.seed)
        random.seed(cfg.seed)

    def _validate(self) -> None:
        c = self.cfg
        for name, v in (
            ("rollout.prompts_per_step", c.rollout.prompts_per_step),
            ("rollout.n", c.rollout.n),
            ("rollout.prompts_per_request", c.rollout.prompts_per_request),
            ("train.micro_batch_size", c.train.micro_batch_size),
            ("train.ppo_epochs", c.train.ppo_epochs),
            ("filter.max_rounds", c.filter.max_rounds),
        ):
            if v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        for name, value, known in (
            ("algorithm.kl.mode", c.algorithm.kl.mode, ("loss", "reward")),
            ("rollout.engine", c.rollout.engine, ROLLOUT_ENGINES),
            ("train.engine", c.train.engine, TRAIN_ENGINES),
            ("reward.backend", c.reward.backend, ("inline", "process", "ray")),
            ("placement.mode", c.placement.mode, ("colocated", "disaggregated")),
            ("placement.reference", c.placement.reference, ("train", "separate")),
        ):
            if value not in known:
                raise ValueError(f"{name} must be one of {', '.join(known)}, got {value!r}")
        for name, reg, value in (
            ("algorithm.advantage", ADVANTAGE_ESTIMATORS, c.algorithm.advantage),
            ("algorithm.policy_loss", POLICY_LOSSES, c.algorithm.policy_loss),
        ):
            if value not in reg:
                raise ValueError(
                    f"{name}: unknown {reg.kind} {value!r}; known: {', '.join(sorted(reg.names()))}"
                )
        rollout_dtype(c, c.train.device)  # rollout.dtype / train.autocast: fail before any engine starts
        train_autocast(c, c.train.device)
        tb = c.tail_batching
        if tb.enabled:
            if c.ray.enabled:
                raise ValueError(
                    "tail_batching.enabled: tail batching drives a request-level rollout engine "
                    "(rollout.engine=hf or vllm in this process); ray.enabled=true uses a Ray rollout "
                    "group, which has none: set ray.enabled=false or tail_batching.enabled=false"
                )
            for name, eta in (
                ("tail_batching.eta_prompts", tb.eta_prompts),
                ("tail_batching.eta_responses", tb.eta_responses),
            ):
                if not (math.isfinite(eta) and eta >= 1):
                    raise ValueError(
                        f"{name} must be a finite number >= 1 (1: no over-provisioning), got {eta}"
                    )

    def _check_request_engine(self, rollout: Any) -> None:
        """``tail_batching.enabled`` needs a rollout engine with a request-level view."""
        from trainers.engines.requests import as_request_engine

        try:
            as_request_engine(rollout)
        except TypeError:
            raise ValueError(
                f"tail_batching.enabled: tail batching needs a request-level rollout engine (an HF or "
                f"vLLM rollout engine, or a RequestEngine), got {type(rollout).__name__}"
            ) from None

    # ------------------------------------------------------------------ helpers

    def encode(self, p: Prompt) -> list[int]:
        key = id(p)
        if key not in self._ids:
            self._ids[key] = encode_prompt(self.tok, p, self.cfg.data.chat_template)
        return self._ids[key]

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def _score(self, completion: str, prompt: Prompt) -> float:
        """The inline verifier: ``reward_fn(text, answer)`` if set, else ``cfg.reward.verifier``."""
        if self.reward_fn is not None:
            return self.reward_fn(completion, prompt.answer)
        return self.verifier(completion, prompt)

    def _sampling(self, round_: int, step: int | None = None) -> SamplingParams:
        """The sampling parameters of generation round ``round_`` of ``step`` (default: this
        step); the seed is a function of ``(cfg.seed, step, round_)``."""
        r = self.cfg.rollout
        step = self.global_step if step is None else step
        seed = (self.cfg.seed * 1_000_003 + step * 1009 + round_) % (2**31)
        return SamplingParams(
            n=r.n, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, max_tokens=r.max_tokens, seed=seed
        )

    def _generate_and_score(
        self, prompts: list[Prompt], params: SamplingParams, timer: _Timer | None = None
    ) -> tuple[list[Any], list[float]]:
        """Stream the generations and submit each to the reward pool as it finishes; gather.
        Returns ``(generations, rewards)`` grouped by prompt (``gens[i * n + j]``: prompt ``i``)."""
        timer = timer or _Timer()
        if self.lengths.spec:  # per-request length budgets: generate request by request
            return self._generate_requests_and_score(prompts, params, timer)
        gens: list[Any] = []
        t0, t_submit = time.perf_counter(), 0.0
        for g in iter_generations(self.rollout, [self.encode(p) for p in prompts], params):
            t1 = time.perf_counter()
            self.rewards.submit(len(gens), self.decode(g.token_ids), prompts[g.prompt_index])
            t_submit += time.perf_counter() - t1
            gens.append(g)
        timer.t["rollout"] += time.perf_counter() - t0 - t_submit
        timer.t["reward"] += t_submit
        with timer("reward"):
            scores = self.rewards.gather()
        order = sorted(range(len(gens)), key=lambda k: gens[k].prompt_index)  # stable
        return [gens[k] for k in order], [scores[k] for k in order]

    def request_engine(self) -> Any:
        """The request-level view of the rollout engine (:func:`trainers.engines.requests.
        as_request_engine`), built on first use."""
        if self._requests is None:
            from trainers.engines.requests import as_request_engine

            self._requests = as_request_engine(
                self.rollout, chunk_tokens=self.cfg.asynchronous.chunk_tokens, seed=self.cfg.seed
            )
        return self._requests

    def _request(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        seed_offset: int,
        *,
        start_version: int,
        tag: Any,
    ) -> Any:
        """One single-sample :class:`~trainers.engines.requests.Request` with its own length
        budget (``rollout.length_dist``) and the seed ``params.seed + seed_offset`` (mod 2^31)."""
        from trainers.engines.requests import Request

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

    def _generate_requests_and_score(
        self, prompts: list[Prompt], params: SamplingParams, timer: _Timer
    ) -> tuple[list[Any], list[float]]:
        """:meth:`_generate_and_score` with one request per sample, each with its own
        ``max_tokens`` from ``rollout.length_dist`` (the W1 workload), through the request
        engine; every sample is scored the moment it finishes."""

        eng, n = self.request_engine(), params.n
        reqs = [
            self._request(
                f"sync-{self.global_step}-{id(prompts)}-{i}-{j}",
                self.encode(p),
                params,
                i * n + j,
                start_version=self.global_step,
                tag=i * n + j,
            )
            for i, p in enumerate(prompts)
            for j in range(n)
        ]
        eng.add(reqs)
        done: dict[int, Any] = {}
        t0, t_submit = time.perf_counter(), 0.0
        while eng.num_running:
            for r in eng.step():
                t1 = time.perf_counter()
                self.rewards.submit(r.tag, self.decode(r.token_ids), prompts[r.tag // n])
                t_submit += time.perf_counter() - t1
                done[r.tag] = r.to_generation(r.tag // n)
        timer.t["rollout"] += time.perf_counter() - t0 - t_submit
        timer.t["reward"] += t_submit
        with timer("reward"):
            scores = self.rewards.gather()
        return [done[k] for k in range(len(reqs))], [scores[k] for k in range(len(reqs))]

    def _ref_logprobs(self, batch: PackedBatch) -> torch.Tensor:
        c = self.cfg
        return batch_logprobs(
            self.reference,
            batch,
            temperature=c.rollout.temperature,
            micro_batch_size=c.train.micro_batch_size,
        )

    # ------------------------------------------------------------------ the loop

    def _collect_groups(
        self, timer: _Timer
    ) -> tuple[list[tuple[Prompt, list[Any], list[float]]], dict[str, float], list[int]]:
        """Steps 1-3 of :meth:`step`: ``rollout.n`` samples for each of ``prompts_per_step``
        prompts, each scored as it finishes; dynamic sampling drops zero-variance groups and
        refills (at most ``filter.max_rounds`` rounds). Returns ``(groups, metrics, lengths)``:
        ``(prompt, n generations, n rewards)`` per kept group, the rollout metrics and the
        length of every generated sample."""
        cfg = self.cfg
        P, n = cfg.rollout.prompts_per_step, cfg.rollout.n
        groups: list[tuple[Prompt, list[Any], list[float]]] = []
        all_rewards, all_lens, rounds = [], [], 0
        acc_by_source: dict[str, list[float]] = defaultdict(list)
        max_rounds = cfg.filter.max_rounds if cfg.filter.zero_variance else 1
        while len(groups) < P and rounds < max_rounds:
            prompts = self.iterator.next_batch(P - len(groups))
            gens, rewards = self._generate_and_score(prompts, self._sampling(rounds), timer)
            rounds += 1
            for g, r in zip(gens, rewards):
                acc_by_source[prompts[g.prompt_index].data_source].append(r)
            all_rewards += rewards
            all_lens += [len(g.token_ids) for g in gens]
            keep = torch.ones(len(gens), dtype=torch.bool)
            if cfg.filter.zero_variance:
                gid = torch.arange(len(prompts)).repeat_interleave(n)
                r_t = torch.tensor(rewards, dtype=torch.float32)
                keep = _call(FILTERS.entry("zero_variance"), {"rewards": r_t, "group_ids": gid}, {})
            for i, p in enumerate(prompts):
                if bool(keep[i * n]):
                    groups.append((p, gens[i * n : (i + 1) * n], rewards[i * n : (i + 1) * n]))
        groups = groups[:P]
        metrics: dict[str, float] = {
            "reward/mean": sum(all_rewards) / len(all_rewards),
            "response/length_mean": sum(all_lens) / len(all_lens),
            "rollout/rounds": rounds,
            "rollout/kept_groups": len(groups),
        }
        for src, rs in acc_by_source.items():
            metrics[f"accuracy/{src}"] = sum(rs) / len(rs)
        return groups, metrics, all_lens

    def _tail_engine(self) -> Any:
        """The request engine of a tail-batching round: a fresh request-level view of the
        rollout engine (:func:`trainers.engines.requests.as_request_engine`) whose sampler is
        seeded from ``(seed, global_step)``, so that a step depends only on the checkpointed
        state and a resumed run continues exactly as the original (the views hold no state
        between rounds: every request of a round ends in it)."""
        from trainers.engines.requests import as_request_engine

        seed = (self.cfg.seed * 1_000_003 + self.global_step * 1009) % (2**31)
        return as_request_engine(self.rollout, chunk_tokens=self.cfg.asynchronous.chunk_tokens, seed=seed)

    def _collect_tail_groups(
        self, timer: _Timer
    ) -> tuple[list[tuple[Prompt, list[Any], list[float]]], dict[str, float], list[int]]:
        """Steps 1-3 of :meth:`step` with ``tail_batching.enabled``: one round of RollPacker's
        tail batching (Gao et al. 2025, arXiv:2509.21009) driven by :attr:`tail`, a
        :class:`rollkit.scheduling.TailBatchingPolicy` with :math:`P_0` = ``prompts_per_step``
        and :math:`R_0` = ``rollout.n``.

        The round's plan is launched on the request engine, one :class:`~trainers.engines.
        requests.Request` per response (a short round: :math:`\\lceil\\eta_P P_0\\rceil` fresh
        prompts x :math:`\\lceil\\eta_R R_0\\rceil` responses; a long round: :math:`P_0` queued
        prompts x :math:`R_0`), each with its ``max_tokens`` from ``rollout.length_dist`` (the
        cap ``rollout.max_tokens`` in both rounds). Every finished response goes to the
        policy; a kept one is scored at once (the reward pool), the requests the policy names
        are aborted, and the round ends when :math:`P_0` prompts have :math:`R_0` kept
        responses. Returns the same ``(groups, metrics, lengths)`` as :meth:`_collect_groups`:
        the :math:`P_0` completed groups of this one round, in completion order, with their
        responses in finish order; ``lengths`` counts every generated response, aborted ones
        included (the engine's tokens, for the throughput). Fresh prompts come from
        :attr:`tail_sampler` (an :class:`rollkit.scheduling.EpochSampler` over the train
        prompts, id ``epoch * len(train_prompts) + index``); with ``filter.zero_variance`` a
        deferred prompt whose finished responses' rewards all agree is dropped, not queued."""

        policy, eng = self.tail, self._tail_engine()
        plan = policy.plan_step(self.tail_sampler)
        base, N = self._sampling(0), len(self.train_prompts)
        prompt_of = {r.request_id: self.train_prompts[r.prompt_id % N] for r in plan.requests}
        names = {
            r.request_id: [f"tail-{r.request_id}-{j}" for j in range(r.num_responses)] for r in plan.requests
        }
        reqs = [
            self._request(
                names[r.request_id][j],
                self.encode(prompt_of[r.request_id]),
                base,
                r.request_id * 1009 + j,
                start_version=self.global_step,
                tag=(r.request_id, j),
            )
            for r in plan.requests
            for j in range(r.num_responses)
        ]
        kept: dict[tuple[int, int], Any] = {}
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
                        self.rewards.submit(r.tag, self.decode(r.token_ids), prompt_of[rid])
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
            if not complete:  # roll the round back: its prompts are launched again next step
                policy.load_state_dict(policy.state_dict())
        timer.t["rollout"] += time.perf_counter() - t0 - t_submit
        timer.t["reward"] += t_submit
        with timer("reward"):
            scores.update(self.rewards.gather())
        by_request: dict[int, list[float]] = defaultdict(list)
        for key, s in sorted(scores.items(), key=str):
            if isinstance(key, tuple) and key[0] in prompt_of:  # (request id, response id)
                by_request[key[0]].append(s)
        batch = policy.finish_step(by_request if policy.dynamic_sampling else None)
        self.last_tail_batch = batch

        groups = []
        for r, resp in zip(batch.requests, batch.responses):
            gens = [kept[(r.request_id, j)].to_generation(len(groups)) for j in resp]
            groups.append((prompt_of[r.request_id], gens, [scores[(r.request_id, j)] for j in resp]))
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
        metrics["tail/round"] = float(batch.round == "long")
        metrics.update(batch.metrics)
        metrics.update({f"tail/total_{k}": float(v) for k, v in policy.counts.items()})
        return groups, metrics, lens

    def step(self) -> dict[str, float]:
        """One RL step; returns its metrics."""
        timer = _Timer()
        t_start = time.perf_counter()

        # 1-3. Generate n samples per prompt, each scored as it finishes; dynamic sampling refills
        # (with tail_batching.enabled: one round of RollPacker's tail batching).
        collect = self._collect_groups if self.tail is None else self._collect_tail_groups
        groups, metrics, all_lens = collect(timer)

        if groups:
            self._train_on_groups(groups, metrics, timer)  # 4-7
            self._push_weights(timer)  # 8

        self.global_step += 1
        metrics.update({f"time/{k}": v for k, v in timer.t.items()})
        metrics["time/step"] = time.perf_counter() - t_start
        metrics["throughput/rollout_tokens_per_s"] = sum(all_lens) / max(timer.t["rollout"], 1e-9)
        metrics.update(self._reward_pool_metrics())
        return metrics

    def _train_on_groups(
        self, groups: list[tuple[Prompt, list[Any], list[float]]], metrics: dict[str, float], timer: _Timer
    ) -> None:
        """Steps 4-7 of :meth:`step` on ``groups`` (``(prompt, n generations, n rewards)``):
        pack, [reference / KL], advantages, the PPO update. Adds to ``metrics``; shared with
        :class:`trainers.async_trainer.AsyncTrainer`."""
        cfg, a, n = self.cfg, self.cfg.algorithm, self.cfg.rollout.n
        # 4. Pack; the rollout's log-probs are the old (behaviour) log-probs.
        batch = pack_generations([g for _, gs, _ in groups for g in gs], self.pad_id)
        self._prepare_batch(batch, timer)
        mask = batch.response_mask
        group_ids = torch.arange(len(groups)).repeat_interleave(n)
        rewards = torch.tensor([r for _, _, rs in groups for r in rs], dtype=torch.float32)

        # 5. Optional KL to the frozen initial policy (as a reward penalty or a loss term).
        ref_lp = None
        if self.reference is not None:
            with timer("reference"):
                ref_lp = self._ref_logprobs(batch)
            kl_tok = _call(
                REGULARIZERS.entry("kl"),
                {"logprobs": batch.old_logprobs, "ref_logprobs": ref_lp, "response_mask": mask},
                {"estimator": a.kl.estimator, "coef": 1.0},
            ).loss
            metrics["kl/rollout"] = float(kl_tok.sum() / mask.sum().clamp(min=1))
            if a.kl.mode == "reward":
                rewards = rewards - a.kl.coef * kl_tok.sum(-1)
        if self.normalizer is not None:
            rewards = self.normalizer.normalize(rewards)

        # 6. Advantages by registry name ([B] outcome advantages broadcast over tokens).
        adv = _call(
            self.adv_entry,
            {"rewards": rewards, "group_ids": group_ids, "response_mask": mask},
            a.advantage_kwargs,
        )
        adv = adv[0] if isinstance(adv, tuple) else adv
        adv = (adv[:, None] if adv.dim() == 1 else adv) * mask
        metrics["advantage/abs_mean"] = float(adv.abs().sum() / mask.sum().clamp(min=1))

        # 7. The PPO update (ppo_update, on every train rank); a colocated rollout sleeps meanwhile.
        if self.offload:
            with timer("offload"):
                self.rollout.sleep(cfg.placement.sleep_level)
        with timer("train"):
            metrics.update(self.learner.update(batch, adv, ref_lp, seed=cfg.seed * 7919 + self.global_step))

    def _push_weights(self, timer: _Timer) -> None:
        """Step 8 of :meth:`step`: wake a colocated rollout and push the new weights to it."""
        with timer("weight_sync"):
            if self.offload:
                self.rollout.wake()
            self.rollout.update_weights(self.learner.export_weights(), version=self.global_step + 1)

    def _prepare_batch(self, batch: PackedBatch, timer: _Timer) -> None:
        """A hook before the reference and the update (the async trainer recomputes proximal
        log-probs here); nothing in the synchronous trainer."""

    # ------------------------------------------------------------------ evaluation

    def evaluate(self, prompts: list[Prompt] | None = None) -> dict[str, float]:
        """Greedy accuracy on the held-out prompts, overall and per ``data_source``."""
        prompts = self.eval_prompts if prompts is None else prompts
        if not prompts:
            return {}
        params = SamplingParams(n=1, temperature=0.0, max_tokens=self.cfg.eval.max_tokens, seed=0)
        gens = self.rollout.generate([self.encode(p) for p in prompts], params)
        for k, g in enumerate(gens):
            self.rewards.submit(k, self.decode(g.token_ids), prompts[g.prompt_index])
        rewards = self.rewards.gather()
        by: dict[str, list[float]] = defaultdict(list)
        for k, g in enumerate(gens):
            by[prompts[g.prompt_index].data_source].append(rewards[k])
        scores = [s for v in by.values() for s in v]
        out = {"eval/accuracy": sum(scores) / len(scores)}
        if len(by) > 1:
            out.update({f"eval/accuracy/{k}": sum(v) / len(v) for k, v in by.items()})
        return out

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        return {
            "global_step": self.global_step,
            "train": self.train.state_dict(),
            "reference": None
            if getattr(self.reference, "model", None) is None
            else self.reference.model.state_dict(),
            "data": self.iterator.state_dict(),
            "normalizer": None if self.normalizer is None else self.normalizer.state_dict(),
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
            "lengths": self.lengths.state_dict(),
            # tail batching: the long-prompt queue, counts and the fresh-prompt sampler (a round in
            # progress is rolled back: its prompts are launched again after a restore)
            "tail": None
            if self.tail is None
            else {"policy": self.tail.state_dict(), "sampler": self.tail_sampler.state_dict()},
        }

    def save_checkpoint(self, directory: str | Path | None = None) -> Path:
        """Write ``<checkpoint.dir>/step_<k>/trainer.pt``; returns the step directory."""
        root = Path(directory or self.cfg.checkpoint.dir)
        if not str(root):
            raise ValueError("checkpoint.dir: empty")
        path = root / f"step_{self.global_step:06d}"
        path.mkdir(parents=True, exist_ok=True)
        tmp = path / "trainer.pt.tmp"
        torch.save(self.state_dict(), tmp)
        tmp.replace(path / "trainer.pt")
        return path

    def load_checkpoint(self, path: str | Path) -> None:
        """Restore a checkpoint (a ``step_<k>`` directory, or ``"auto"``: the latest under
        ``checkpoint.dir``) and push its weights to the rollout engine."""
        path = Path(path)
        if str(path) == "auto":
            found = sorted(Path(self.cfg.checkpoint.dir).glob("step_*/trainer.pt"))
            if not found:
                raise ValueError(f"checkpoint.resume=auto: no checkpoint under {self.cfg.checkpoint.dir!r}")
            path = found[-1].parent
        f = path / "trainer.pt" if path.is_dir() else path
        if not f.is_file():
            raise ValueError(f"checkpoint.resume: no trainer.pt at {path}")
        state = torch.load(f, weights_only=False)
        self.train.load_state_dict(state["train"])
        if getattr(self.reference, "model", None) is not None and state.get("reference") is not None:
            self.reference.model.load_state_dict(state["reference"])
        self.iterator.load_state_dict(state["data"])
        if self.normalizer is not None and state.get("normalizer") is not None:
            self.normalizer.load_state_dict(state["normalizer"])
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
        if state.get("lengths") is not None:
            self.lengths.load_state_dict(state["lengths"])
        if self.tail is not None and state.get("tail") is not None:  # else the queue starts empty
            self.tail.load_state_dict(state["tail"]["policy"])
            self.tail_sampler.load_state_dict(state["tail"]["sampler"])
        self.global_step = int(state["global_step"])
        self.rollout.update_weights(self.learner.export_weights(), version=self.global_step)

    # ------------------------------------------------------------------ shutdown

    def close(self) -> None:
        """Stop the reward workers and the Ray actors / placement groups this trainer started
        (engines passed in are the caller's). Idempotent."""
        self.rewards.close()
        while self._owned:
            self._owned.pop().close()

    def __enter__(self) -> SyncTrainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ fit

    def fit(self, steps: int | None = None) -> dict[str, Any]:
        """Evaluate, train ``steps`` (default ``train.steps``; counted from the current step
        up to that total), evaluate; returns a summary."""
        cfg = self.cfg
        resume_step = None
        if cfg.checkpoint.resume:
            self.load_checkpoint(cfg.checkpoint.resume)
            resume_step = self.global_step
        total = cfg.train.steps if steps is None else steps
        tracker = Tracker(
            cfg.logging.dir,
            tensorboard=cfg.logging.tensorboard,
            plot=cfg.logging.plot,
            resume_step=resume_step,
        )
        for note in tracker.notes:
            print(f"[rollkit] {note}")
        before = None
        if cfg.eval.before and self.global_step == 0:
            before = self.evaluate()
            tracker.log(0, before)
            print(f"[eval] step 0 held-out accuracy {before.get('eval/accuracy', float('nan')):.3f}")
        t0 = time.perf_counter()
        start = self.global_step
        while self.global_step < total:
            m = self.step()
            k = self.global_step
            if cfg.eval.every and k % cfg.eval.every == 0 and k < total:
                m.update(self.evaluate())
            tracker.log(k, m)
            if cfg.logging.progress:
                ev = f" eval {m['eval/accuracy']:.3f}" if "eval/accuracy" in m else ""
                print(
                    f"[step {k:>4}/{total}] reward {m['reward/mean']:.3f} len {m['response/length_mean']:.1f} "
                    f"kept {m['rollout/kept_groups']} {m['time/step']:.1f}s "
                    f"({m.get('time/rollout', 0):.1f} gen, {m.get('time/train', 0):.1f} train){ev}",
                    flush=True,
                )
            if cfg.checkpoint.dir and cfg.checkpoint.every and k % cfg.checkpoint.every == 0:
                self.save_checkpoint()
        train_time = time.perf_counter() - t0
        after = self.evaluate()
        tracker.log(self.global_step, after)
        plot = tracker.plot()
        tracker.close()
        if cfg.checkpoint.dir:
            self.save_checkpoint()
        steps_run = self.global_step - start
        return {
            "accuracy_before": None if before is None else before.get("eval/accuracy"),
            "accuracy_after": after.get("eval/accuracy"),
            "steps": steps_run,
            "train_seconds": train_time,
            "seconds_per_step": train_time / max(steps_run, 1),
            "metrics_file": str(tracker.jsonl),
            "tensorboard_dir": None
            if tracker.tb is None and not (tracker.dir / "tb").exists()
            else str(tracker.dir / "tb"),
            "plot": None if plot is None else str(plot),
            "notes": tracker.notes,
            "history": tracker.history,
        }

    # ------------------------------------------------------------------ reward pool metrics

    def _reward_pool_metrics(self) -> dict[str, float]:
        """The reward pool's share of a step, for :meth:`step`'s metrics: ``time/reward_busy``
        (seconds spent inside the verifier, summed over the workers, since the previous call;
        it exceeds the wall-clock ``time/reward`` when workers score in parallel),
        ``reward/workers`` (workers now; 0 inline) and ``reward/workers_hwm``. With an inline
        verifier that counts its own work (the LLM judge, :mod:`trainers.judge`) its counters
        are added as ``judge/<name>`` (worker-side counters stay in the workers)."""
        m = self.rewards.metrics()
        last_busy = getattr(self, "_reward_busy_last", 0.0)
        self._reward_busy_last = m["busy_s"]
        out = {
            "time/reward_busy": m["busy_s"] - last_busy,
            "reward/workers": m["workers"],
            "reward/workers_hwm": m["workers_hwm"],
        }
        counts = getattr(self.verifier, "metrics", None)
        if self.cfg.reward.backend == "inline" and self.reward_fn is None and callable(counts):
            out.update({f"judge/{k}": float(v) for k, v in counts().items()})
        return out


def supervised_warmup(
    train: TrainEngine,
    tokenizer: Any,
    prompts: list[Prompt],
    *,
    steps: int,
    batch_size: int = 32,
    seed: int = 0,
    chat_template: str = "off",
) -> float:
    """Teacher-forced SFT of ``prompt -> answer<eos>`` through the TrainEngine interface
    (token-mean NLL); returns the last loss. Used to give a tiny random model a starting
    accuracy before RL."""
    from trainers.engines.base import pack

    rng = random.Random(seed)
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    loss_v = float("nan")
    for _ in range(steps):
        ps = [prompts[rng.randrange(len(prompts))] for _ in range(batch_size)]
        ids = [encode_prompt(tokenizer, p, chat_template) for p in ps]
        ans = [[*tokenizer(p.answer, add_special_tokens=False).input_ids, eos] for p in ps]
        b = pack(ids, ans, pad)
        lp = train.logprobs(b.input_ids, b.attention_mask, b.response_mask)
        loss = aggregate(-lp, b.response_mask, "token-mean")
        train.backward(loss)
        train.step()
        loss_v = float(loss.detach())
    return loss_v
