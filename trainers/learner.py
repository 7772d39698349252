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
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from rollkit.correction import correction_weights, mismatch_stats, reduce_mismatch_stats
from rollkit.keys import (
    ADVANTAGES,
    BEHAVIOR_LOGPROBS,
    IS_WEIGHTS,
    LOGPROBS,
    OLD_LOGPROBS,
    REF_LOGPROBS,
    RESPONSE_MASK,
)
from rollkit.losses import aggregate, global_normalizers
from rollkit.packing import pack_bins
from rollkit.registry import POLICY_LOSSES, REGULARIZERS, Entry
from trainers.config import Config
from trainers.data import Prompt, encode_prompt
from trainers.engines.base import PackedBatch, TrainEngine, pack
from trainers.engines.step import ENTROPY_KEEP, TOKEN_KEEP, StepBatch

__all__ = [
    "Learner",
    "LocalLearner",
    "UpdateSpec",
    "UpdateStats",
    "apply_correction",
    "loss_inputs",
    "micro_batches",
    "needs_recompute",
    "pack_by_tokens",
    "nll_loss",
    "rollout_kl",
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
    max_tokens_per_micro_batch: int = 0  # > 0: pack micro-batches by this token budget instead
    packing: bool = False  # padding-free micro-batches: the token budget counts real tokens (FFD)
    logprob_gap: bool = False  # report train/logprob_gap: mean |log pi_theta - behaviour| (on-policy ~ 0)
    top_k: int = -1  # the rollout's truncation, replayed on the trainer's logits
    top_p: float = 1.0
    mismatch: bool = False  # report mismatch/*: behaviour vs the trainer's log-probs before the update

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
            max_tokens_per_micro_batch=t.max_tokens_per_micro_batch,
            packing=t.packing,
            top_k=cfg.rollout.top_k,
            top_p=cfg.rollout.top_p,
            mismatch=a.correction.metrics,
        )


@dataclass
class UpdateStats:
    """Metric sums and counts of an update; ranks' stats add up (:meth:`merge`) before the
    means (:meth:`metrics`): token-weighted for loss metrics and entropy, per optimizer step
    for ``optim/*`` (reported by rank 0 only: every rank sees the same all-reduced norm)."""

    sums: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    counts: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    # rollkit.correction.mismatch_stats of the micro-batches before the first optimizer step
    mismatch: list[dict[str, torch.Tensor]] = field(default_factory=list)

    def add(self, key: str, value: float, weight: float = 1.0) -> None:
        self.sums[key] += value
        self.counts[key] += weight

    def merge(self, other: UpdateStats) -> UpdateStats:
        for k, v in other.sums.items():
            self.add(k, v, other.counts[k])
        self.mismatch.extend(other.mismatch)
        return self

    def metrics(self) -> dict[str, float]:
        out = {k: self.sums[k] / max(self.counts[k], 1) for k in self.sums}
        if self.mismatch:
            out.update({f"mismatch/{k}": float(v) for k, v in reduce_mismatch_stats(self.mismatch).items()})
        return out


def rollout_kl(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor, estimator: str
) -> tuple[torch.Tensor, float]:
    """``([B, T] per-token KL estimate, token mean)`` between the rollout's log-probs and the
    reference's (the registry's ``"kl"`` regulariser with ``coef=1``): the ``kl/rollout`` metric
    and the per-token penalty of ``kl.mode=reward`` in the RLVR and agentic loops."""
    kl = REGULARIZERS.entry("kl").call(
        {"logprobs": logprobs, "ref_logprobs": ref_logprobs, "response_mask": mask}, estimator=estimator, coef=1.0
    ).loss
    return kl, float(kl.sum() / mask.sum().clamp(min=1))


def needs_recompute(correction: Any) -> bool:
    """Whether ``algorithm.correction`` needs the old log-probs recomputed on the trainer."""
    return bool(correction.recompute_old) or correction.level != "off"


def apply_correction(
    batch: StepBatch, correction: Any, segment_ids: torch.Tensor | None = None
) -> dict[str, float]:
    """Add ``is_weights`` and ``token_keep`` to ``batch`` from ``algorithm.correction`` (a
    :class:`~trainers.config.CorrectionConfig`) with :func:`rollkit.correction.correction_weights`
    of the trainer's old log-probs against the behaviour ones; returns ``correction/*`` metrics.
    Nothing to do when the level is ``"off"`` or the batch has no separate behaviour log-probs.
    ``segment_ids`` (``[B, T]``, level ``"segment"``): the turn of each token; without them
    the whole response is one segment."""
    c = correction
    if c.level == "off" or batch.get(BEHAVIOR_LOGPROBS) is None:
        return {}
    mask = batch[RESPONSE_MASK]
    if c.level == "segment" and segment_ids is None:
        segment_ids = torch.zeros_like(mask, dtype=torch.long)
    out = correction_weights(
        batch[OLD_LOGPROBS],
        batch[BEHAVIOR_LOGPROBS],
        mask,
        level=c.level,
        segment_ids=segment_ids,
        truncate=c.truncate or None,
        mask_low=c.mask_low or None,
        mask_high=c.mask_high or None,
        seq_k3_max=c.seq_k3_max or None,
        reject=c.reject,
    )
    batch[IS_WEIGHTS] = out.weights
    batch.keep_tokens(out.keep)
    return {f"correction/{k}": float(v) for k, v in out.metrics.items()}


#: keys of the step batch that the learner applies itself (not handed to the policy loss): the
#: correction's weights multiply every loss's per-token terms alike
_LEARNER_KEYS = (IS_WEIGHTS,)


def loss_inputs(mb: StepBatch, logprobs: torch.Tensor) -> dict[str, Any]:
    """What a policy loss's registry call reads (by key): the micro-batch's keys, plus
    ``logprobs`` (the trainer's, with gradient), ``response_mask`` = the loss mask
    (the step batch's ``loss_mask``) and ``behavior_logprobs`` = the old ones where the rollout's are the
    same; ``is_weights`` stay with the learner."""
    avail: dict[str, Any] = {k: v for k, v in mb.items() if k not in _LEARNER_KEYS}
    avail[LOGPROBS] = logprobs
    avail[RESPONSE_MASK] = mb.loss_mask
    avail[BEHAVIOR_LOGPROBS] = mb.get(BEHAVIOR_LOGPROBS, mb[OLD_LOGPROBS])
    return avail


def _micro_batch_loss(
    engine: TrainEngine, mb: StepBatch, view: PackedBatch, spec: UpdateSpec, loss_entry: Entry, norms: dict[str, Any]
) -> tuple[torch.Tensor, dict[str, Any], torch.Tensor, torch.Tensor]:
    """``(loss, loss metrics, log-probs, entropy)`` of one micro-batch (``view``: its packed
    view): the policy loss (+ the entropy and KL terms), each aggregated with the mini-batch's
    global normalisers."""
    lp, ent = engine.logprobs(
        view.input_ids,
        view.attention_mask,
        view.response_mask,
        temperature=spec.temperature,
        top_k=spec.top_k,
        top_p=spec.top_p,
        with_entropy=True,
        **view.model_inputs(),
    )
    mask = mb.loss_mask
    out = loss_entry.call(loss_inputs(mb, lp), **spec.policy_loss_kwargs)
    is_weights = mb.get(IS_WEIGHTS)
    pg = out.loss if is_weights is None else out.loss * is_weights
    loss = aggregate(pg, mask, spec.aggregation, **norms)
    if spec.entropy_coef:
        e = REGULARIZERS.get("entropy")(ent, mask, coef=spec.entropy_coef)
        keep = mb.get(ENTROPY_KEEP)
        e_loss = e.loss if keep is None else e.loss * keep  # AsyPPO's filter
        loss = loss + aggregate(e_loss, mask, spec.aggregation, **norms)
    ref_logprobs = mb.get(REF_LOGPROBS)
    if ref_logprobs is not None and spec.kl_in_loss:
        kl = REGULARIZERS.get("kl")(lp, ref_logprobs, mask, estimator=spec.kl_estimator, coef=spec.kl_coef)
        loss = loss + aggregate(kl.loss, mask, spec.aggregation, **norms)
    return loss, out.metrics, lp, ent


def ppo_update(
    engine: TrainEngine,
    batch: StepBatch,
    spec: UpdateSpec,
    *,
    seed: int = 0,
    rank: int = 0,
    world_size: int = 1,
) -> UpdateStats:
    """``ppo_epochs`` x mini-batches x micro-batches of policy loss on ``engine``, in this
    process or on each data-parallel rank of a Ray train group. Returns the rank's
    :class:`UpdateStats`.

    ``batch`` is the step batch (:class:`~trainers.engines.step.StepBatch`) with at least
    ``advantages`` ``[B, T]`` (0 outside the response) and ``old_logprobs``; ``ref_logprobs``
    is used when ``spec.kl_in_loss``, ``behavior_logprobs`` / ``is_weights`` / ``token_keep``
    (the correction), ``entropy_keep`` (AsyPPO) and ``step_ids`` (IPA) when present; the
    policy loss reads its inputs from it by key (:func:`loss_inputs`).

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

    ``rank`` / ``world_size`` are the *data-parallel* rank and size: with a tensor- or
    pipeline-parallel engine (:class:`~trainers.engines.megatron_train.MegatronTrainEngine`) the
    ranks of one model-parallel group take the same share, and the normalisers sum over the
    engine's ``dp_group``.

    Collectives must match across ranks: each rank runs ``ceil(ceil(|rows_m| / W) / mbs)``
    micro-batches, padding with a masked-out row (zero loss, zero gradient) when its share is
    shorter, then one ``step``.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
    if not isinstance(batch, StepBatch):
        raise ValueError(f"ppo_update: batch is a {type(batch).__name__}, not a StepBatch (StepBatch.from_packed)")
    missing = [k for k in (ADVANTAGES, OLD_LOGPROBS) if k not in batch]
    if missing:
        raise ValueError(f"ppo_update: the step batch has no {missing} (it has {sorted(batch)})")
    loss_entry = POLICY_LOSSES.entry(spec.policy_loss)
    mask = batch.loss_mask
    B = mask.shape[0]
    mini = spec.mini_batch_size or B
    gen = torch.Generator().manual_seed(seed)
    stats = UpdateStats()
    for epoch in range(spec.ppo_epochs):
        order = torch.randperm(B, generator=gen) if spec.ppo_epochs > 1 or mini < B else torch.arange(B)
        for m0 in range(0, B, mini):
            rows_m = order[m0 : m0 + mini]
            local = rows_m.tensor_split(world_size)[rank]
            norms = global_normalizers(mask[local], group=getattr(engine, "dp_group", None))
            for rows in micro_batches(batch, rows_m, spec, rank=rank, world_size=world_size):
                pad = len(rows) == 0  # this rank's share ran out: a masked row keeps collectives aligned
                rows = rows_m[:1] if pad else rows
                mb = batch.rows(rows)
                if pad:
                    mb = mb.replace(**{RESPONSE_MASK: torch.zeros_like(mb[RESPONSE_MASK]), TOKEN_KEEP: None})
                view = mb.view()
                loss, loss_metrics, lp, ent = _micro_batch_loss(engine, mb, view, spec, loss_entry, norms)
                engine.backward(loss)
                if not pad:
                    _add_micro_batch_stats(stats, view, loss_metrics, lp, ent, spec)
                    _add_padding_stats(stats, view, spec.packing)
                    if spec.mismatch and epoch == 0 and m0 == 0:  # the weights that sampled (sync)
                        behavior = mb.get(BEHAVIOR_LOGPROBS, mb[OLD_LOGPROBS])
                        stats.mismatch.append(mismatch_stats(lp.detach(), behavior, mb[RESPONSE_MASK]))
            for k, v in engine.step().items():
                if rank == 0:
                    stats.add(f"optim/{k}", v)
    return stats


def pack_by_tokens(
    rows: torch.Tensor, response_len: torch.Tensor, prompt_len: int, budget: int
) -> list[torch.Tensor]:
    """``rows`` packed into micro-batches of at most ``budget`` computed tokens, longest
    response first: a micro-batch of ``b`` rows costs ``b * (prompt_len + its longest
    response)`` tokens (the tensor the forward runs on: the batch's prompt width, the
    micro-batch's longest response). A row over the budget on its own is a micro-batch alone.

    >>> pack_by_tokens(torch.arange(4), torch.tensor([6, 1, 2, 6]), 2, 16)
    [tensor([0, 3]), tensor([2, 1])]
    """
    order = rows[torch.argsort(response_len[rows], descending=True, stable=True)]
    out: list[list[int]] = []
    width = 0
    for r in order.tolist():
        if out and (len(out[-1]) + 1) * width <= budget:
            out[-1].append(r)
        else:
            out.append([r])
            width = prompt_len + int(response_len[r])
    return [torch.tensor(mb, dtype=torch.long) for mb in out]


def micro_batches(
    batch: StepBatch | PackedBatch, rows_m: torch.Tensor, spec: UpdateSpec, *, rank: int = 0, world_size: int = 1
) -> list[torch.Tensor]:
    """This rank's micro-batches (row indices) of the mini-batch ``rows_m``: its contiguous
    share ``rows_m.tensor_split(world_size)[rank]`` in micro-batches of ``micro_batch_size`` rows
    (sorted by response length with ``sort_by_length``), or packed by
    ``max_tokens_per_micro_batch`` (:func:`pack_by_tokens`; with ``packing`` the budget counts
    each row's real tokens, bins by :func:`rollkit.packing.pack_bins`, first-fit decreasing).
    Every rank gets as many micro-batches as the rank with the most (empty ones where its share
    ran out), so collectives stay aligned."""
    batch = batch.view() if isinstance(batch, StepBatch) else batch
    resp = batch.response_mask.sum(-1)
    shares = rows_m.tensor_split(world_size)
    if spec.max_tokens_per_micro_batch and getattr(spec, "packing", False):
        real = batch.attention_mask.sum(-1)  # a packed micro-batch computes its real tokens only
        plans = [[s[b] for b in pack_bins(real[s], spec.max_tokens_per_micro_batch)] for s in shares]
        n, mine = max(len(p) for p in plans), plans[rank]
    elif spec.max_tokens_per_micro_batch:
        plans = [pack_by_tokens(s, resp, batch.prompt_len, spec.max_tokens_per_micro_batch) for s in shares]
        n, mine = max(len(p) for p in plans), plans[rank]
    else:
        mbs, local = spec.micro_batch_size, shares[rank]
        if spec.sort_by_length:  # same rows, same gradient sum; each micro-batch pads less
            local = local[torch.argsort(resp[local], stable=True)]
        n = math.ceil(math.ceil(len(rows_m) / world_size) / mbs)
        mine = [local[u * mbs : (u + 1) * mbs] for u in range(n)]
        mine = [m for m in mine if len(m)]
    return mine + [torch.zeros(0, dtype=torch.long)] * (n - len(mine))


def _add_padding_stats(stats: UpdateStats, mb: PackedBatch, packed: bool = False) -> None:
    """``train/padding_frac``: the share of the computed tokens (rows x (prompt width + longest
    response); a packed micro-batch computes its real tokens only) that are padding."""
    resp = mb.response_mask.sum(-1)
    computed = mb.response_mask.shape[0] * (mb.prompt_len + int(resp.max()))
    real = int(mb.attention_mask[:, : mb.prompt_len].sum()) + int(resp.sum())
    if packed:
        computed = real
    stats.add("train/padding_frac", float(computed - real), float(computed))


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

    def update(self, batch: StepBatch, *, seed: int) -> dict[str, float]:
        """The PPO update on the step batch (its ``advantages``, ``old_logprobs`` and the
        optional keys :func:`ppo_update` reads); returns the update's metrics."""

    def export_weights(self) -> Any: ...

    def save_model(self, path: str | Path, tokenizer: Any = None) -> Path: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class LocalLearner:
    """The train role in this process: :func:`ppo_update` on one :class:`TrainEngine`."""

    def __init__(self, engine: TrainEngine, spec: UpdateSpec) -> None:
        self.engine, self.spec = engine, spec

    def update(self, batch: StepBatch, *, seed: int) -> dict[str, float]:
        return ppo_update(self.engine, batch, self.spec, seed=seed).metrics()

    def export_weights(self) -> Any:
        return self.engine.export_weights()

    def save_model(self, path: str | Path, tokenizer: Any = None) -> Path:
        """The trained policy as a Hugging Face model directory (the engine's ``save_model``)."""
        return self.engine.save_model(path, tokenizer)

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
    lp = engine.logprobs(b.input_ids, b.attention_mask, b.response_mask, **b.model_inputs())
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
