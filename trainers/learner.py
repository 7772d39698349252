"""The one PPO update every loop calls, and the train role's interface.

:func:`ppo_update` runs ``ppo_epochs`` x mini-batches x micro-batches of a rollkit policy loss
(picked by registry name) on a :class:`~trainers.engines.base.TrainEngine`, with rollkit's
global normalisers so that the gradient of every optimizer step is exactly the gradient of the
whole mini-batch, however it is split into micro-batches and data-parallel ranks. The sync,
async and agentic loops call it in process (:class:`LocalLearner`) and every rank of a Ray
train group calls it remotely (:mod:`trainers.ray`). :func:`nll_loss` / :func:`supervised_warmup`
are the supervised step the recipes use to warm a model up before RL.
"""

from __future__ import annotations

import math
import random
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from rollkit.losses import aggregate, global_normalizers
from rollkit.registry import POLICY_LOSSES, REGULARIZERS, Entry
from trainers.config import Config
from trainers.data import Prompt, encode_prompt
from trainers.engines.base import PackedBatch, TrainEngine, pack

__all__ = [
    "Learner",
    "LocalLearner",
    "UpdateSpec",
    "UpdateStats",
    "nll_loss",
    "ppo_update",
    "supervised_warmup",
]


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
    logprob_gap: bool = False  # report train/logprob_gap: mean |log pi_theta - behaviour| (on-policy ~ 0)

    @classmethod
    def from_config(cls, cfg: Any) -> UpdateSpec:
        """The update of ``cfg`` (a :class:`~trainers.config.Config` or an agentic config)."""
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


def _micro_batch_loss(
    engine: TrainEngine,
    mb: PackedBatch,
    advantages: torch.Tensor,
    ref_logprobs: torch.Tensor | None,
    spec: UpdateSpec,
    loss_entry: Entry,
    norms: dict[str, Any],
) -> tuple[torch.Tensor, dict[str, Any], torch.Tensor, torch.Tensor]:
    """``(loss, loss metrics, log-probs, entropy)`` of one micro-batch: the policy loss (+ the
    entropy and KL terms), each aggregated with the mini-batch's global normalisers."""
    mask = mb.response_mask
    lp, ent = engine.logprobs(
        mb.input_ids, mb.attention_mask, mask, temperature=spec.temperature, with_entropy=True
    )
    avail = {
        "logprobs": lp,
        "old_logprobs": mb.old_logprobs,
        "behavior_logprobs": mb.old_logprobs if mb.behavior_logprobs is None else mb.behavior_logprobs,
        "advantages": advantages,
        "response_mask": mask,
    }
    out = loss_entry.call(avail, **spec.policy_loss_kwargs)
    loss = aggregate(out.loss, mask, spec.aggregation, **norms)
    if spec.entropy_coef:
        e = REGULARIZERS.get("entropy")(ent, mask, coef=spec.entropy_coef)
        loss = loss + aggregate(e.loss, mask, spec.aggregation, **norms)
    if ref_logprobs is not None and spec.kl_in_loss:
        kl = REGULARIZERS.get("kl")(lp, ref_logprobs, mask, estimator=spec.kl_estimator, coef=spec.kl_coef)
        loss = loss + aggregate(kl.loss, mask, spec.aggregation, **norms)
    return loss, out.metrics, lp, ent


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
    """``ppo_epochs`` x mini-batches x micro-batches of policy loss on ``engine``, in this
    process or on each data-parallel rank of a Ray train group. Returns the rank's
    :class:`UpdateStats`.

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
    shorter, then one ``step``.
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
                rows = rows_m[:1] if pad else rows
                mb = batch[rows]
                if pad:
                    mb.response_mask = torch.zeros_like(mb.response_mask)
                ref = None if ref_logprobs is None else ref_logprobs[rows]
                loss, loss_metrics, lp, ent = _micro_batch_loss(
                    engine, mb, advantages[rows], ref, spec, loss_entry, norms
                )
                engine.backward(loss)
                if not pad:
                    _add_micro_batch_stats(stats, mb, loss_metrics, lp, ent, spec)
            for k, v in engine.step().items():
                if rank == 0:
                    stats.add(f"optim/{k}", v)
    return stats


def _add_micro_batch_stats(
    stats: UpdateStats,
    mb: PackedBatch,
    loss_metrics: dict[str, Any],
    lp: torch.Tensor,
    ent: torch.Tensor,
    spec: UpdateSpec,
) -> None:
    m = mb.response_mask
    w = int(m.sum())
    for k, v in loss_metrics.items():
        stats.add(f"loss/{k}", float(v) * w, w)
    if spec.logprob_gap:
        behavior = mb.old_logprobs if mb.behavior_logprobs is None else mb.behavior_logprobs
        stats.add("train/logprob_gap", float((lp.detach() - behavior).abs()[m].sum()), w)
    stats.add("entropy", float(ent.detach()[m].sum()), w)


@runtime_checkable
class Learner(Protocol):
    """The train role as the loops see it (in process: :class:`LocalLearner`; on Ray: a
    :class:`~trainers.ray.RayTrainGroup`)."""

    def update(
        self, batch: PackedBatch, advantages: torch.Tensor, ref_logprobs: torch.Tensor | None, *, seed: int
    ) -> dict[str, float]: ...

    def export_weights(self) -> Any: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


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

    def state_dict(self) -> dict[str, Any]:
        return self.engine.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.engine.load_state_dict(state)


# --------------------------------------------------------------------------- supervised


def nll_loss(
    engine: TrainEngine, prompts: list[list[int]], responses: list[list[int]], pad_token_id: int
) -> torch.Tensor:
    """Teacher-forced token-mean negative log-likelihood of ``responses`` after ``prompts``
    (token ids), through the TrainEngine interface."""
    b = pack(prompts, responses, pad_token_id)
    lp = engine.logprobs(b.input_ids, b.attention_mask, b.response_mask)
    return aggregate(-lp, b.response_mask, "token-mean")


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
    (token-mean NLL, the engine's optimizer); returns the last loss. Used to give a tiny random
    model a starting accuracy before RL."""
    rng = random.Random(seed)
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    loss_v = float("nan")
    for _ in range(steps):
        ps = [prompts[rng.randrange(len(prompts))] for _ in range(batch_size)]
        ids = [encode_prompt(tokenizer, p, chat_template) for p in ps]
        ans = [[*tokenizer(p.answer, add_special_tokens=False).input_ids, eos] for p in ps]
        loss = nll_loss(train, ids, ans, pad)
        train.backward(loss)
        train.step()
        loss_v = float(loss.detach())
    return loss_v


def learner_for(train: Any, cfg: Config) -> Learner:
    """``train`` as a :class:`Learner`: itself if it is one, else a :class:`LocalLearner`
    running ``cfg``'s update on it."""
    return train if isinstance(train, Learner) else LocalLearner(train, UpdateSpec.from_config(cfg))
