"""The critic role: a value model, its train engine, and the value update beside the policy's.

A critic is a Hugging Face token-classification model with one label: the policy's decoder
(by default the policy's own checkpoint, ``critic.model_path`` for another) and a scalar head
``score`` on the final hidden states, zero-initialised so that a new critic predicts 0. It
trains behind the same :class:`~trainers.engines.base.TrainEngine` interface as the policy
(``critic.engine``: torch, DeepSpeed or FSDP2; LoRA adapters plus a trainable head where the
policy has ``train.lora_rank``), with its own AdamW learning rate, clipping and schedule.

Values line up with the log-probs (layout of :func:`trainers.engines.base.pack`): the value of
response token ``t`` is the head's output at position ``P - 1 + t``, the state *before* the token
is generated, which is the state whose logits predict it::

    values[b, t] = score(h[b, L - T - 1 + t])           [B, T] float32, 0 outside the response

:func:`value_update` is :func:`trainers.learner.ppo_update`'s twin: ``ppo_epochs`` x mini-batches
x micro-batches (the policy's ``train.*`` micro-batching: row count or token budget) of
:func:`rollkit.losses.value_loss` (clipped by ``critic.value_clip``), token-mean over the whole
mini-batch with rollkit's global normalisers, one optimizer step per mini-batch.

:class:`LocalCritic` holds ``K`` such critics (``K = 1`` for PPO, ``critic.num_critics`` for
AsyPPO's mini-critics, each updated on its own shard of the batch) in this process; on Ray a
:class:`trainers.ray.RayCritic` actor holds one. The loops never build a critic: they get one
from :func:`trainers.roles.build_roles` and ask it for values (docs/ppo.md).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from rollkit.losses import aggregate, global_normalizers, value_loss
from trainers.config import Config, critic_ensemble
from trainers.deps import require
from trainers.engines.base import PackedBatch, TrainEngine, position_ids_from_mask
from trainers.engines.build import build_model, make_train_engine, parse_dtype
from trainers.engines.lora import is_lora
from trainers.engines.packed import PackedCall, packed_call, scatter_response
from trainers.engines.torch_train import used_response_width
from trainers.learner import UpdateStats, micro_batches
from trainers.models import save_model

__all__ = [
    "Critic",
    "CriticSpec",
    "LocalCritic",
    "build_critic",
    "critic_train_config",
    "num_critics",
    "response_values",
    "save_critic",
    "value_model",
    "value_update",
]


def num_critics(cfg: Any) -> int:
    """``critic.num_critics``, where 0 means 1 for ``gae`` and 2 (the paper's) for an ensemble
    estimator (``asyppo``: :func:`~trainers.config.algorithm.critic_ensemble`)."""
    k = cfg.critic.num_critics
    return k if k else (2 if critic_ensemble(cfg) else 1)


@dataclass(frozen=True)
class CriticSpec:
    """What :func:`value_update` needs from the config (picklable: it travels to a Ray critic)."""

    value_clip: float = 0.5  # 0: plain MSE
    value_coef: float = 0.5
    ppo_epochs: int = 1
    mini_batch_size: int = 0  # 0: the whole batch
    micro_batch_size: int = 8
    sort_by_length: bool = False
    max_tokens_per_micro_batch: int = 0
    packing: bool = False

    @classmethod
    def from_config(cls, cfg: Any) -> CriticSpec:
        k, t = cfg.critic, cfg.train
        return cls(
            value_clip=k.value_clip,
            value_coef=k.value_coef,
            ppo_epochs=k.ppo_epochs or t.ppo_epochs,
            mini_batch_size=t.mini_batch_size,
            micro_batch_size=t.micro_batch_size,
            sort_by_length=t.sort_by_length,
            max_tokens_per_micro_batch=t.max_tokens_per_micro_batch,
            packing=t.packing,
        )


def critic_train_config(cfg: Config) -> Config:
    """``cfg`` with the ``train`` section the critic's engine is built from: the critic's engine,
    learning rate, weight decay, clipping and schedule; everything else (dtype, device, ZeRO
    stage, LoRA, micro-batching) the policy's."""
    k = cfg.critic
    train = dataclasses.replace(
        cfg.train,
        engine=k.engine or cfg.train.engine,
        lr=k.lr,
        weight_decay=k.weight_decay,
        grad_clip=k.grad_clip,
        warmup_steps=k.lr_warmup_steps,
        lr_schedule=k.lr_schedule,
        logprob_chunk_tokens=0,
    )
    return dataclasses.replace(cfg, train=train)


def _zero_head(model: Any) -> None:
    with torch.no_grad():
        model.score.weight.zero_()
        if model.score.bias is not None:
            model.score.bias.zero_()


def value_model(policy: Any = None, *, path: str = "", dtype: torch.dtype = torch.float32) -> Any:
    """A critic: ``AutoModelForTokenClassification`` with one label and no dropout.

    ``path``: load a checkpoint (a critic saved by :meth:`LocalCritic.save_model` keeps its head;
    a causal LM gets a zero head). Else ``policy`` (a transformers causal LM): a model of the same
    config whose decoder is a copy of the policy's, with a zero head.

    >>> from trainers.models import char_tokenizer, tiny_qwen2
    >>> critic = value_model(tiny_qwen2(char_tokenizer()))
    >>> type(critic).__name__, critic.score.out_features, float(critic.score.weight.abs().sum())
    ('Qwen2ForTokenClassification', 1, 0.0)
    """
    tf = require("transformers")
    if path:
        model, info = tf.AutoModelForTokenClassification.from_pretrained(
            str(path), num_labels=1, classifier_dropout=0.0, dtype=dtype, output_loading_info=True
        )
        if any(k.startswith("score.") for k in info.get("missing_keys", ())):
            _zero_head(model)
        return model
    if policy is None:
        raise ValueError("value_model: give the policy model or a checkpoint path")
    config = copy.deepcopy(policy.config)
    config.num_labels, config.classifier_dropout = 1, 0.0
    config.architectures = None
    model = tf.AutoModelForTokenClassification.from_config(config, dtype=dtype)
    model.base_model.load_state_dict(policy.base_model.state_dict())
    _zero_head(model)
    return model.to(dtype)


def _decoder_and_head(engine: Any) -> tuple[Any, Any]:
    """A critic engine's decoder and value head (through a peft wrapper; a DeepSpeed engine's
    module: ZeRO-3 gathers per submodule, so calling them directly is safe)."""
    model = engine.model
    if is_lora(model):
        model = model.get_base_model()
    return model.base_model, model.score


def _head_outputs(engine: Any, input_ids: Tensor, attention_mask: Tensor, T: int, *, share: bool) -> Tensor:
    """``[B, T, 1]`` the value head at positions ``P - 1 .. P + T - 2``. With ``share`` and fewer
    distinct prompts than rows, each distinct prompt runs once with the KV cache on and the
    responses run on the gathered cache (the prompt sharing of
    :func:`trainers.engines.torch_train.response_logits`: same values and gradients up to float
    rounding, the prompt at ``U / B`` of the cost); else one forward over ``[B, P + T]`` (always
    on an engine with ``root_forward_only``, FSDP2, whose submodules cannot run on their own)."""
    B, L = input_ids.shape
    P = L - T
    pos = position_ids_from_mask(attention_mask)
    if getattr(engine, "root_forward_only", False):  # FSDP2: the root's forward unshards the parameters
        out = engine.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=pos, use_cache=False
        )
        return out.logits[:, P - 1 : L - 1]
    decoder, head = _decoder_and_head(engine)
    if share and B > 1:
        prompts = torch.cat([input_ids[:, :P], attention_mask[:, :P].to(input_ids.dtype)], 1)
        uniq, inv = torch.unique(prompts, dim=0, return_inverse=True)
        if uniq.shape[0] < B:
            p_ids, p_mask = uniq[:, :P], uniq[:, P:].to(attention_mask.dtype)
            first = decoder(input_ids=p_ids, attention_mask=p_mask, position_ids=position_ids_from_mask(p_mask),
                            use_cache=True)  # fmt: skip
            cache = first.past_key_values
            cache.batch_select_indices(inv)  # [U, ...] -> [B, ...], a differentiable gather
            rest = decoder(input_ids=input_ids[:, P:], attention_mask=attention_mask, position_ids=pos[:, P:],
                           past_key_values=cache, use_cache=True)  # fmt: skip
            h = torch.cat([first.last_hidden_state[inv, -1:], rest.last_hidden_state[:, :-1]], dim=1)
            return head(h)
    out = decoder(input_ids=input_ids, attention_mask=attention_mask, position_ids=pos, use_cache=False)
    return head(out.last_hidden_state[:, P - 1 : L - 1])


def response_values(
    engine: Any,
    input_ids: Tensor,  # [B, L] (layout of trainers.engines.base.pack)
    attention_mask: Tensor,  # [B, L]
    response_mask: Tensor,  # [B, T]
) -> Tensor:  # [B, T] float32
    """``[B, T]`` float32 values of the response tokens (module docstring), 0 where
    ``response_mask`` is False; with gradients unless called under ``torch.no_grad()``.
    Response columns past the longest response of these rows are not computed; the rows'
    shared prompts run once (the engine's ``share_prompts``, off under gradient checkpointing)."""
    L = input_ids.shape[1]
    T, T_used = used_response_width(input_ids, response_mask)
    cut = L - T + T_used  # trailing columns no row uses: causal, so nothing else changes
    dev = torch.device(getattr(engine, "device", "cpu"))
    autocast = getattr(engine, "autocast", None)
    ids, att = input_ids[:, :cut].to(dev), attention_mask[:, :cut].to(dev)
    share = getattr(engine, "share_prompts", True) and not getattr(engine, "_ckpt", False)
    with torch.autocast(dev.type, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        if getattr(engine, "packing", False):
            call = packed_call(engine.model, ids, att, response_mask[:, :T_used].to(dev), share=share)
            v = scatter_response(_packed_head_outputs(engine, call)[..., 0].float(), call)
        else:
            v = _head_outputs(engine, ids, att, T_used, share=share)[..., 0].float()
    v = torch.nn.functional.pad(v, (0, T - T_used))
    return v.masked_fill(~response_mask.to(v.device, torch.bool), 0.0).cpu()


def _packed_head_outputs(engine: Any, call: PackedCall) -> Tensor:  # [1, M, 1]
    """The value head at the ``M`` packed positions that predict a response token
    (:mod:`trainers.engines.packed`): one forward of the packed row."""
    if getattr(engine, "root_forward_only", False):  # FSDP2: the root's forward unshards the parameters
        return engine.model(**call.kwargs).logits[:, call.keep]
    decoder, head = _decoder_and_head(engine)
    return head(decoder(**call.kwargs).last_hidden_state[:, call.keep])


@torch.no_grad()
def batch_values(engine: Any, batch: PackedBatch, micro_batch_size: int) -> Tensor:
    """``[B, T]`` values of a whole batch without gradients, ``micro_batch_size`` rows at a time."""
    out = []
    for i in range(0, batch.input_ids.shape[0], micro_batch_size):
        mb = batch[i : i + micro_batch_size]
        out.append(response_values(engine, mb.input_ids, mb.attention_mask, mb.response_mask))
    return torch.cat(out)


def value_update(
    engine: TrainEngine,
    batch: PackedBatch,
    old_values: Tensor,  # [B, T] this critic's values at rollout time
    returns: Tensor,  # [B, T] targets
    spec: CriticSpec,
    *,
    rows: Tensor | None = None,  # [R] the rows this critic trains on (AsyPPO's shard); None: all
    seed: int = 0,
) -> UpdateStats:
    """``ppo_epochs`` x mini-batches x micro-batches of the clipped value loss on ``rows``.

    The loss of a micro-batch is ``aggregate(value_loss, mask_mb, "token-mean", num_tokens=N)``
    with ``N`` the response tokens of the whole mini-batch (:func:`rollkit.losses.global_normalizers`),
    so each optimizer step applies the gradient of the mini-batch's token-mean loss however it is
    split. Returns ``critic/*`` stats: ``value_loss``, ``value_clipfrac``, ``vf_mse`` (token-
    weighted) and the optimizer's ``grad_norm`` / ``lr`` per step."""
    rows = torch.arange(batch.input_ids.shape[0]) if rows is None else rows
    mask = batch.response_mask
    mini = spec.mini_batch_size or len(rows)
    gen = torch.Generator().manual_seed(seed)
    clip = spec.value_clip or None
    stats = UpdateStats()
    for _ in range(spec.ppo_epochs):
        order = (
            rows[torch.randperm(len(rows), generator=gen)]
            if spec.ppo_epochs > 1 or mini < len(rows)
            else rows
        )
        for m0 in range(0, len(order), mini):
            rows_m = order[m0 : m0 + mini]
            norms = global_normalizers(mask[rows_m])
            for mb_rows in micro_batches(batch, rows_m, spec):  # type: ignore[arg-type]
                mb = batch[mb_rows]
                v = response_values(engine, mb.input_ids, mb.attention_mask, mb.response_mask)
                out = value_loss(v, old_values[mb_rows], returns[mb_rows], mb.response_mask,
                                 clip_range=clip, coef=spec.value_coef)  # fmt: skip
                engine.backward(aggregate(out.loss, mb.response_mask, "token-mean", **norms))
                w = float(mb.response_mask.sum())
                stats.add("critic/value_loss", float(out.loss.detach().sum()), w)
                stats.add("critic/value_clipfrac", float(out.metrics["vf_clipfrac"]) * w, w)
                stats.add("critic/vf_mse", float(out.metrics["vf_mse"]) * w, w)
            for k, x in engine.step().items():
                stats.add(f"critic/{k}", x)
    return stats


def save_critic(engine: Any, path: str | Path, tokenizer: Any = None) -> Path:
    """One critic engine's model as a Hugging Face directory (a LoRA critic merged, its head
    included), written by rank 0 (every rank takes part: ZeRO-3 gathers collectively)."""
    if not is_lora(engine.model):
        return engine.save_model(path, tokenizer)
    merged = copy.deepcopy(engine.model).merge_and_unload()
    return save_model(merged, tokenizer, path)


@runtime_checkable
class Critic(Protocol):
    """The critic role as the loops see it (:class:`LocalCritic`, or a Ray critic actor's proxy)."""

    num_critics: int

    def values(self, batch: PackedBatch) -> Tensor:
        """``[K, B, T]`` values of every critic, no gradient."""
        ...

    def update(
        self, batch: PackedBatch, old_values: Tensor, returns: Tensor, shards: Tensor | None, *, seed: int
    ) -> dict[str, float]:
        """Train critic ``k`` on the rows with ``shards == k`` (all rows when ``shards`` is None)
        towards ``returns`` ``[B, T]``, clipping around its ``old_values[k]``; returns metrics."""
        ...

    def save_model(self, path: str | Path, tokenizer: Any = None) -> Path: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class LocalCritic:
    """``K`` critics in this process, each a :class:`~trainers.engines.base.TrainEngine` over a
    :func:`value_model` (module docstring)."""

    def __init__(self, engines: list[Any], spec: CriticSpec, *, micro_batch_size: int = 8) -> None:
        if not engines:
            raise ValueError("LocalCritic: give at least one engine")
        self.engines, self.spec, self.micro_batch_size = list(engines), spec, micro_batch_size

    @property
    def num_critics(self) -> int:
        return len(self.engines)

    def values(self, batch: PackedBatch) -> Tensor:
        return torch.stack([batch_values(e, batch, self.micro_batch_size) for e in self.engines])

    def update(
        self, batch: PackedBatch, old_values: Tensor, returns: Tensor, shards: Tensor | None, *, seed: int
    ) -> dict[str, float]:
        K = self.num_critics
        if old_values.dim() != 3 or old_values.shape[0] != K:
            raise ValueError(f"old_values must be [K={K}, B, T], got {list(old_values.shape)}")
        stats = UpdateStats()
        for k, engine in enumerate(self.engines):
            rows = None if shards is None else (shards == k).nonzero().flatten()
            if rows is not None and len(rows) == 0:
                continue
            stats.merge(
                value_update(engine, batch, old_values[k], returns, self.spec, rows=rows, seed=seed + k)
            )
        return stats.metrics()

    def save_model(self, path: str | Path, tokenizer: Any = None) -> Path:
        """The critic as a Hugging Face directory at ``path`` (``K > 1``: ``path/critic_<k>``);
        :func:`value_model` with ``path=`` (or ``critic.model_path``) loads it back."""
        path = Path(path)
        if self.num_critics == 1:
            return save_critic(self.engines[0], path, tokenizer)
        for k, e in enumerate(self.engines):
            save_critic(e, path / f"critic_{k}", tokenizer)
        return path

    def state_dict(self) -> dict[str, Any]:
        return {"critics": [e.state_dict() for e in self.engines]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state["critics"]
        if len(saved) != self.num_critics:
            raise ValueError(
                f"checkpoint has {len(saved)} critics, this run {self.num_critics} (critic.num_critics)"
            )
        for e, s in zip(self.engines, saved):
            e.load_state_dict(s)


def build_critic(cfg: Config, policy: Any = None, *, device: str | None = None) -> LocalCritic:
    """The critic of ``cfg`` in this process: :func:`num_critics` value models from
    ``critic.model_path`` (critic ``i`` from its ``critic_<i>`` subdirectory where an AsyPPO run
    saved one) or from ``policy`` (the initial policy model; default: a fresh
    :func:`~trainers.engines.build.build_model` of ``cfg.model``), each behind its own engine on
    ``device`` (default ``train.device``)."""
    dtype = parse_dtype(cfg.model.dtype)
    k = cfg.critic
    if not k.model_path and policy is None:
        policy, _ = build_model(cfg)
    ccfg = critic_train_config(cfg)
    engines = []
    for i in range(num_critics(cfg)):
        path = k.model_path
        if path and (Path(path) / f"critic_{i}").is_dir():  # an AsyPPO run's saved critics
            path = str(Path(path) / f"critic_{i}")
        model = value_model(policy, path=path, dtype=dtype)
        engines.append(make_train_engine(ccfg, model, device=device or cfg.train.device, task="value"))
    return LocalCritic(engines, CriticSpec.from_config(cfg), micro_batch_size=cfg.train.micro_batch_size)
