"""A :class:`~trainers.engines.base.TrainEngine` on Megatron-Core: tensor, pipeline and data parallel.

:class:`MegatronTrainEngine` builds Megatron-Core's ``GPTModel`` (the local layer spec: no
TransformerEngine, so it runs on a CPU over gloo as on GPUs over NCCL) from a Hugging Face
Llama / Qwen2 model, loads its weights through rollkit's own mapping
(:mod:`trainers.engines.megatron_weights`), and trains it with rollkit's losses behind the same
interface as the other engines: ``logprobs`` (plain or memory-lean head, the rollout's top-k /
top-p replayed), ``backward``, ``step``, ``export_weights`` (Hugging Face names, the tensor-
parallel shards gathered), ``save_model`` and ``state_dict`` (parallelism-independent: Hugging
Face names for the weights and the AdamW moments, so a checkpoint resumes at another ``tp`` /
``pp``).

Parallelism. The world of ``tp x pp x dp`` ranks is split by Megatron's ``parallel_state``
(order tp, dp, pp). The ranks of one tensor- and pipeline-parallel group must receive the same
micro-batches; :attr:`dp_rank` / :attr:`world_size` say which data share a rank takes
(:func:`trainers.learner.ppo_update`), and :attr:`dp_group` is the group its normalisers sum
over. Gradients are averaged over the data-parallel group, the global norm is summed over the
model-parallel group (each tensor-parallel duplicate counted once) before clipping.

Forward. rollkit computes the rotary frequencies of each token's own position
(``cumsum(attention_mask) - 1``, the layout of :func:`trainers.engines.base.pack`) and the
causal + padding mask itself and calls the embedding and ``TransformerBlock`` directly, so the
log-probs equal a Hugging Face forward of the same weights. The LM head's vocabulary-parallel
weight is gathered (the backward takes each rank's rows), every tensor-parallel rank computes
the same log-probs, and :func:`trainers.engines.torch_train.response_logprobs` does the rest.

Pipeline parallelism runs one micro-batch through the stages at a time (GPipe with one
micro-batch, no 1F1B interleaving): stage ``s`` receives the hidden states of stage ``s - 1``,
the last stage computes the log-probs and broadcasts them to the other stages (so every rank
computes the same loss), and :meth:`MegatronTrainEngine.backward` sends each stage's input
gradient back. With tied embeddings and ``pp > 1`` the last stage holds a copy of the
embedding as its LM head and the two gradients are summed (Megatron's embedding group).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from trainers.deps import require
from trainers.engines.base import position_ids_from_mask
from trainers.engines.compiled import adamw
from trainers.engines.megatron_cpu import install as install_cpu_shims
from trainers.engines.megatron_cpu import seed_model_parallel_rng
from trainers.engines.megatron_weights import Layout, is_sharded, layout_of, merge, pairs, to_megatron
from trainers.engines.offload import Offloadable, resident, state_tensors
from trainers.engines.options import train_autocast
from trainers.engines.torch_train import response_logprobs, used_response_width
from trainers.models import save_model

__all__ = ["MegatronTrainEngine", "build_gpt", "init_parallel"]


def init_parallel(tp: int, pp: int, device: torch.device) -> None:
    """Megatron's ``parallel_state`` for ``tp`` x ``pp`` (x the data-parallel rest of the world):
    starts a one-process group (gloo on CPU, NCCL on CUDA) if there is none, and (re)initialises
    the model-parallel groups when their sizes differ. One-line errors name the field."""
    dist = torch.distributed
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    world = dist.get_world_size()
    if world % (tp * pp):
        raise ValueError(
            f"train.megatron_tp x train.megatron_pp = {tp * pp} does not divide the world of {world} ranks"
        )
    ps = require("megatron.core.parallel_state")
    if ps.model_parallel_is_initialized():
        if (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()) == (
            tp,
            pp,
        ):
            return
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)


def build_gpt(lay: Layout, *, dtype: torch.dtype, gradient_checkpointing: bool = False) -> Any:
    """This rank's pipeline stage of a Megatron-Core ``GPTModel`` with ``lay``'s shapes (weights
    left uninitialised: :func:`~trainers.engines.megatron_weights.to_megatron` fills them)."""
    core = require("megatron.core")
    ps = core.parallel_state
    gpt = require("megatron.core.models.gpt")
    specs = require("megatron.core.models.gpt.gpt_layer_specs")
    recompute = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    config = require("megatron.core.transformer").TransformerConfig(
        num_layers=lay.layers, hidden_size=lay.hidden, num_attention_heads=lay.heads,
        num_query_groups=lay.kv_heads, kv_channels=lay.head_dim, ffn_hidden_size=lay.intermediate,
        normalization="RMSNorm", layernorm_epsilon=lay.norm_eps, gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, add_qkv_bias=lay.qkv_bias,
        hidden_dropout=0.0, attention_dropout=0.0, params_dtype=dtype, pipeline_dtype=dtype,
        tensor_model_parallel_size=lay.tp, pipeline_model_parallel_size=lay.pp,
        use_cpu_initialization=True, perform_initialization=False, bias_activation_fusion=False,
        masked_softmax_fusion=False, persist_layer_norm=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False,
        **(recompute if gradient_checkpointing else {}),
    )  # fmt: skip
    return gpt.GPTModel(
        config,
        specs.get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=lay.padded_vocab,
        max_sequence_length=lay.max_positions,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=lay.tied and lay.pp == 1,
        position_embedding_type="rope",
        rotary_base=int(lay.rope_theta),
    )


def attention_mask_4d(attention_mask: Tensor) -> Tensor:  # [B, 1, L, L] bool, True = masked out
    """Megatron's attention mask of a left-padded batch: a query attends to the real keys at or
    before it (a padded query attends to nothing; its output is never used)."""
    L = attention_mask.shape[1]
    causal = torch.ones(L, L, dtype=torch.bool, device=attention_mask.device).tril()
    keep = causal[None] & attention_mask.bool()[:, None, :]
    return ~keep[:, None]


def rotary_freqs(position_ids: Tensor, head_dim: int, theta: float) -> Tensor:  # [L, B, 1, head_dim]
    """RoPE angles of each token's own position (Megatron's non-interleaved layout, as Hugging
    Face's ``rotate_half``)."""
    inv = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=position_ids.device) / head_dim)
    )
    ang = position_ids.t().float()[..., None] * inv  # [L, B, d / 2]
    return torch.cat([ang, ang], -1)[:, :, None, :]


class _GatherRows(torch.autograd.Function):
    """All-gather a tensor-parallel shard along dim 0; the backward keeps this rank's rows of
    the gradient (every tensor-parallel rank computes the same loss from the full tensor)."""

    @staticmethod
    def forward(ctx: Any, shard: Tensor, group: Any, rank: int, world: int) -> Tensor:
        ctx.rank, ctx.world = rank, world
        parts = [torch.empty_like(shard) for _ in range(world)]
        torch.distributed.all_gather(parts, shard.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        return grad.chunk(ctx.world)[ctx.rank].contiguous(), None, None, None


@dataclass
class _Record:
    """One pipeline micro-batch awaiting its backward: the stage's input (a leaf) and output."""

    inp: Tensor | None
    out: Tensor | None


class _HFView:
    """The stage seen as :func:`~trainers.engines.torch_train.response_logprobs` wants a causal
    LM: ``get_decoder()`` (final hidden states), ``get_output_embeddings()`` (the gathered LM
    head) and a call with ``logits_to_keep``."""

    def __init__(self, engine: MegatronTrainEngine) -> None:
        self._e = engine

    def get_decoder(self) -> Callable[..., Any]:
        def forward(input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, **_: Any) -> Any:
            h = self._e._stage(input_ids, attention_mask, position_ids)  # [L, B, H]
            return SimpleNamespace(last_hidden_state=h.transpose(0, 1))

        return forward

    def get_output_embeddings(self) -> Any:
        return SimpleNamespace(weight=self._e._head_weight(), bias=None)

    def __call__(self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor,
                 logits_to_keep: int = 0, **_: Any) -> Any:  # fmt: skip
        h = self._e._stage(input_ids, attention_mask, position_ids)[-logits_to_keep:]
        return SimpleNamespace(logits=h.transpose(0, 1) @ self._e._head_weight().t())


class MegatronTrainEngine(Offloadable):
    """A :class:`~trainers.engines.base.TrainEngine` on Megatron-Core (module docstring).

    Args:
        model: a Hugging Face ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` (its config and
            weights; the engine keeps neither).
        tp, pp: tensor- and pipeline-parallel sizes (``train.megatron_tp`` / ``megatron_pp``);
            the rest of the world is data parallel.
        lr, weight_decay, grad_clip, scheduler, dtype, device, fused_optimizer: as
            :class:`~trainers.engines.torch_train.TorchTrainEngine` (AdamW over this rank's shard).
        gradient_checkpointing: Megatron's full activation recomputation, one layer at a time.
        autocast: ``torch.bfloat16`` / ``torch.float16`` matmuls under ``torch.autocast`` with
            ``dtype`` parameters (None: none). CUDA only: Megatron's linear layers declare their
            autocast for CUDA, and on a CPU their backward would mix dtypes (refused by name).
        logprob_chunk_tokens: ``> 0``: the memory-lean head (no ``[B, T, V]`` logits).
        seed: the model-parallel RNG state (dropout, recomputation).

    :meth:`offload` / :meth:`onload` (``placement.offload_train``): this rank's weights,
    gradients and AdamW state to the host and back (:mod:`trainers.engines.offload`); a method
    that needs them onloads first.

    >>> # under torchrun --nproc-per-node 2:
    >>> engine = MegatronTrainEngine(hf_model, tp=2)  # doctest: +SKIP
    """

    lora_export: str = "merged"

    def __init__(
        self,
        model: Any,
        *,
        tp: int = 1,
        pp: int = 1,
        lr: float = 1e-5,
        weight_decay: float = 0.0,
        grad_clip: float | None = 1.0,
        scheduler: Any = None,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        gradient_checkpointing: bool = False,
        autocast: torch.dtype | None = None,
        logprob_chunk_tokens: int = 0,
        fused_optimizer: bool = False,
        optimizer_factory: Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer] | None = None,
        seed: int = 0,
    ) -> None:
        self.device, self.dtype, self.autocast = torch.device(device), dtype, autocast
        if autocast is not None and self.device.type != "cuda":
            raise ValueError(
                "train.autocast: Megatron-Core's linear layers autocast on CUDA only (their backward "
                "mixes dtypes on a CPU); on a CPU use train.autocast=off, or model.dtype=bfloat16"
            )
        self.lay = layout_of(model.config, tp, pp)
        self._hf_config = model.config
        self._hf_shapes = {n: tuple(t.shape) for n, t in model.state_dict().items()}
        install_cpu_shims()
        init_parallel(tp, pp, self.device)
        ps = require("megatron.core.parallel_state")
        self._ps = ps
        self.tp_rank, self.stage = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
        self._first, self._last = self.stage == 0, self.stage == pp - 1
        seed_model_parallel_rng(seed, self.tp_rank)
        self.model = build_gpt(self.lay, dtype=dtype, gradient_checkpointing=gradient_checkpointing)
        self._params = dict(self.model.named_parameters())
        self._load_hf(model.state_dict())
        self.model.to(self.device).train()
        self.logprob_chunk_tokens = int(logprob_chunk_tokens)
        params = list(self._params.values())
        self.optimizer = (optimizer_factory(params) if optimizer_factory is not None
                          else adamw(params, lr=lr, weight_decay=weight_decay, fused=fused_optimizer))  # fmt: skip
        if callable(scheduler) and not hasattr(scheduler, "step"):
            scheduler = scheduler(self.optimizer)
        self.scheduler, self.grad_clip, self.global_step = scheduler, grad_clip, 0
        self._view = _HFView(self)
        self._pending: _Record | None = None

    def _offload_tensors(self) -> list[Tensor]:
        return state_tensors(self.model, [self.optimizer])

    # ------------------------------------------------------------------ groups

    @property
    def world_size(self) -> int:
        """The data-parallel size (the ranks that take different data)."""
        return self._ps.get_data_parallel_world_size()

    @property
    def dp_rank(self) -> int:
        return self._ps.get_data_parallel_rank()

    @property
    def dp_group(self) -> Any:
        return self._ps.get_data_parallel_group()

    def _stage_rank(self, stage: int) -> int:
        """The global rank of pipeline stage ``stage`` in this rank's pipeline group."""
        return torch.distributed.get_process_group_ranks(self._ps.get_pipeline_model_parallel_group())[stage]

    def _gather_tp(self, t: Tensor) -> list[Tensor]:
        if self.lay.tp == 1:
            return [t]
        parts = [torch.empty_like(t) for _ in range(self.lay.tp)]
        torch.distributed.all_gather(parts, t.contiguous(), group=self._ps.get_tensor_model_parallel_group())
        return parts

    # ------------------------------------------------------------------ forward / backward

    def _stage(self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor) -> Tensor:  # [L, B, H]
        """This stage's forward: the embedding (first stage) or the previous stage's hidden
        states (received), the stage's decoder layers (and the final norm on the last stage)."""
        freqs = rotary_freqs(position_ids, self.lay.head_dim, self.lay.rope_theta)
        mask = attention_mask_4d(attention_mask)
        inp = None
        if self._first:
            x = self.model.embedding(input_ids=input_ids, position_ids=None)
        else:
            B, L = input_ids.shape
            inp = torch.empty(L, B, self.lay.hidden, dtype=self.dtype, device=self.device)
            torch.distributed.recv(inp, src=self._stage_rank(self.stage - 1))
            inp.requires_grad_(torch.is_grad_enabled())
            self.model.decoder.set_input_tensor(inp)
            x = None
        h = self.model.decoder(hidden_states=x, attention_mask=mask, rotary_pos_emb=freqs)
        if self.lay.pp > 1 and torch.is_grad_enabled():
            self._pending = _Record(inp, h)  # the micro-batch the next backward is for
        return h

    def _head_weight(self) -> Tensor:  # [V, H]
        m = self.model
        w = (
            m.shared_embedding_or_output_weight()
            if self.lay.tied and self.lay.pp == 1
            else m.output_layer.weight
        )
        if self.lay.tp > 1:
            group = self._ps.get_tensor_model_parallel_group()
            w = _GatherRows.apply(w, group, self.tp_rank, self.lay.tp)
        return w[: self.lay.vocab]

    @resident
    def logprobs(
        self,
        input_ids: Tensor,  # [B, L]
        attention_mask: Tensor,  # [B, L]
        response_mask: Tensor,  # [B, T]
        *,
        temperature: float = 1.0,
        with_entropy: bool = False,
        top_k: int = -1,
        top_p: float = 1.0,
        inputs: dict[str, Tensor] | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """``[B, T]`` float32 log-probs of the response tokens (and entropies), as
        :meth:`TorchTrainEngine.logprobs <trainers.engines.torch_train.TorchTrainEngine.logprobs>`;
        every rank of a tensor / pipeline group returns the same values."""
        if inputs:
            raise ValueError("train.engine=megatron: image inputs are not supported (use train.engine=torch)")
        L = input_ids.shape[1]
        T, used = used_response_width(input_ids, response_mask)
        ids, am = (
            input_ids[:, : L - T + used].to(self.device),
            attention_mask[:, : L - T + used].to(self.device),
        )
        rm = response_mask[:, :used]
        sampling = {"temperature": temperature, "with_entropy": with_entropy, "top_k": top_k, "top_p": top_p}
        out = None
        if self._last:
            out = response_logprobs(self._view, ids, am, rm, share_prompts=False, autocast=self.autocast,
                                    device=self.device, chunk_tokens=self.logprob_chunk_tokens, **sampling)  # fmt: skip
        else:
            with torch.autocast(
                self.device.type, dtype=self.autocast or torch.bfloat16, enabled=self.autocast is not None
            ):
                h = self._stage(ids, am, position_ids_from_mask(am))
            torch.distributed.send(
                h.detach().to(self.dtype).contiguous(), dst=self._stage_rank(self.stage + 1)
            )
        if self.lay.pp > 1:
            out = self._from_last(out, rm.shape, with_entropy)
        pad = (0, T - used)
        if with_entropy:
            return F.pad(out[0], pad), F.pad(out[1], pad)
        return F.pad(out, pad)

    def _from_last(self, out: Any, shape: torch.Size, with_entropy: bool) -> Any:
        """The last stage's log-probs (and entropies) on every stage of the pipeline; on the
        other stages leaves that require grad (their loss's graph ends there)."""
        k = 2 if with_entropy else 1
        if self._last:
            buf = (torch.stack(out) if with_entropy else out[None]).detach().clone()
        else:
            buf = torch.empty(k, *shape, dtype=torch.float32, device=self.device)
        group = self._ps.get_pipeline_model_parallel_group()
        torch.distributed.broadcast(buf, src=self._stage_rank(self.lay.pp - 1), group=group)
        if self._last:
            return out
        buf.requires_grad_(torch.is_grad_enabled())
        return (buf[0], buf[1]) if with_entropy else buf[0]

    @resident
    def backward(self, loss: Tensor) -> None:
        """Accumulate ``d loss / d params`` (one micro-batch): with ``pp > 1`` the last stage
        back-propagates the loss and each stage sends its input's gradient to the previous."""
        if loss.dim() != 0:
            raise ValueError(
                f"loss must be a scalar, got shape {list(loss.shape)} (use rollkit.losses.aggregate)"
            )
        if self.lay.pp == 1:
            loss.backward()
            return
        rec, self._pending = self._pending, None
        if rec is None:
            raise RuntimeError(
                "MegatronTrainEngine.backward: no forward with gradients since the last backward"
            )
        if self._last:
            loss.backward()
        else:
            g = torch.empty_like(rec.out)
            torch.distributed.recv(g, src=self._stage_rank(self.stage + 1))
            torch.autograd.backward(rec.out, g)
        if not self._first:
            grad = rec.inp.grad if rec.inp.grad is not None else torch.zeros_like(rec.inp)
            torch.distributed.send(grad.to(self.dtype).contiguous(), dst=self._stage_rank(self.stage - 1))

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def _tied_copy(self, name: str) -> bool:
        """The last stage's copy of a tied embedding (its gradient is summed with stage 0's)."""
        return self.lay.tied and self.lay.pp > 1 and name == "output_layer.weight"

    def _reduce_grads(self) -> None:
        """Every rank takes part in the same collectives: missing gradients are zeros; the tied
        embedding's two copies sum their gradients; the data-parallel ranks average theirs."""
        dist = torch.distributed
        for p in self._params.values():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if self.lay.tied and self.lay.pp > 1 and (self._first or self._last):
            name = "embedding.word_embeddings.weight" if self._first else "output_layer.weight"
            dist.all_reduce(self._params[name].grad, group=self._ps.get_embedding_group())
        if self.world_size > 1:
            grads = [p.grad for p in self._params.values()]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=self.dp_group)
            flat.div_(self.world_size)
            off = 0
            for g in grads:
                g.copy_(flat[off : off + g.numel()].view_as(g))
                off += g.numel()

    def grad_norm(self) -> float:
        """The global gradient norm: each tensor-parallel duplicate (norms, a tied copy) counted
        once, summed over the tensor- and pipeline-parallel ranks."""
        sq = torch.zeros((), dtype=torch.float64, device=self.device)
        for name, p in self._params.items():
            if (self.tp_rank == 0 or is_sharded(name)) and not self._tied_copy(name):
                sq += p.grad.double().pow(2).sum()
        if self.lay.tp * self.lay.pp > 1:
            torch.distributed.all_reduce(sq, group=self._ps.get_model_parallel_group())
        return float(sq.sqrt())

    @resident
    def step(self) -> dict[str, float]:
        """Reduce the gradients (:meth:`_reduce_grads`), clip to ``grad_clip`` by the global
        norm (``torch.nn.utils.clip_grad_norm_``'s coefficient ``max / (norm + 1e-6)``), AdamW
        step, scheduler step, zero the gradients. A non-finite norm skips the step."""
        self._reduce_grads()
        norm = self.grad_norm()
        lr = float(self.optimizer.param_groups[0]["lr"])
        if not math.isfinite(norm):
            self.zero_grad()
            return {"grad_norm": norm, "lr": lr, "skipped": 1.0}
        if self.grad_clip is not None:
            coef = min(1.0, self.grad_clip / (norm + 1e-6))
            if coef < 1.0:
                for p in self._params.values():
                    p.grad.mul_(coef)
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        self.zero_grad()
        self.global_step += 1
        return {"grad_norm": norm, "lr": lr, "skipped": 0.0}

    # ------------------------------------------------------------------ weights / checkpoints

    def _load_hf(self, hf: dict[str, Tensor]) -> None:
        local = to_megatron(hf, self.lay, stage=self.stage, rank=self.tp_rank)
        with torch.no_grad():
            for name, p in self._params.items():
                p.copy_(local[name].to(p.dtype))

    def _full(self, tensors: dict[str, Tensor], dtype: torch.dtype) -> Iterator[tuple[str, Tensor]]:
        """``{megatron name: this rank's shard}`` as whole Hugging Face tensors in Hugging Face's
        ``named_parameters`` order, on every rank (a collective: the tensor-parallel shards
        gathered, each stage's broadcast), one decoder layer at a time: the peak extra memory is
        one gathered layer, not a stage (``rollout.weight_sync`` buckets stream them)."""
        order = {n: i for i, n in enumerate(self._hf_shapes)}
        for stage in range(self.lay.pp):
            groups: dict[str, list[tuple[tuple[str, ...], str]]] = {}
            for hf, meg in pairs(self.lay, stage):
                if not (stage and self._tied_copy(meg)):
                    groups.setdefault(".".join(hf[0].split(".")[:3]), []).append((hf, meg))  # model.layers.<i>
            for group in groups.values():
                merged: dict[str, Tensor] = {}
                if stage == self.stage:
                    for hf, meg in group:
                        merged.update(zip(hf, merge(meg, self._gather_tp(tensors[meg]), self.lay), strict=True))
                for name in sorted((n for hf, _ in group for n in hf), key=order.__getitem__):
                    t = merged.pop(name) if stage == self.stage else torch.empty(
                        self._hf_shapes[name], dtype=dtype, device=self.device)  # fmt: skip
                    if self.lay.pp > 1:
                        t = t.to(dtype).contiguous()
                        group_pp = self._ps.get_pipeline_model_parallel_group()
                        torch.distributed.broadcast(t, src=self._stage_rank(stage), group=group_pp)
                    yield name, t

    @resident
    def export_weights(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, Tensor]]:
        """``(Hugging Face name, whole tensor)`` of every weight, in ``named_parameters`` order
        (a tied LM head once), on every rank: a collective, every rank must consume it."""
        local = {n: p.detach() for n, p in self._params.items()}
        for name, t in self._full(local, self.dtype):
            yield name, (t if dtype is None else t.to(dtype))

    @resident
    def save_model(self, path: str | Path, tokenizer: Any = None) -> Path:
        """The policy as a Hugging Face model directory (every rank gathers, global rank 0
        writes)."""
        weights = dict(self.export_weights())
        if torch.distributed.get_rank() == 0:
            transformers = require("transformers")
            hf = transformers.AutoModelForCausalLM.from_config(self._hf_config).to(self.dtype)
            missing, unexpected = hf.load_state_dict(weights, strict=False)
            if unexpected or [k for k in missing if k != "lm_head.weight"]:
                raise RuntimeError(
                    f"MegatronTrainEngine.save_model: weights do not fit: {missing} {unexpected}"
                )
            save_model(hf, tokenizer, path)
        return Path(path)

    @resident
    def state_dict(self) -> dict[str, Any]:
        """``{"model", "optimizer", "scheduler", "global_step"}`` with whole tensors under Hugging
        Face names (weights and AdamW moments), so the checkpoint loads at any ``tp`` / ``pp``.
        A collective: every rank must call it."""
        opt = {
            "param_groups": [
                {k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups
            ]
        }
        first = next(iter(self._params.values()))
        if self.optimizer.state.get(first):
            for key in ("exp_avg", "exp_avg_sq"):
                local = {n: self.optimizer.state[p][key] for n, p in self._params.items()}
                opt[key] = {n: t.clone() for n, t in self._full(local, self.dtype)}
            opt["step"] = float(self.optimizer.state[first]["step"])
        return {
            "model": {n: t.clone() for n, t in self.export_weights()},
            "optimizer": opt,
            "scheduler": None if self.scheduler is None else self.scheduler.state_dict(),
            "global_step": self.global_step,
        }

    @resident
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (from any ``tp`` / ``pp``)."""
        self._load_hf(state["model"])
        opt = state["optimizer"]
        for group, saved in zip(self.optimizer.param_groups, opt["param_groups"], strict=True):
            group.update(saved)
        self.optimizer.state.clear()
        if "exp_avg" in opt:
            moments = {k: to_megatron(opt[k], self.lay, stage=self.stage, rank=self.tp_rank)
                       for k in ("exp_avg", "exp_avg_sq")}  # fmt: skip
            for name, p in self._params.items():
                self.optimizer.state[p] = {
                    "step": torch.tensor(opt["step"], dtype=torch.float32),
                    "exp_avg": moments["exp_avg"][name].to(p),
                    "exp_avg_sq": moments["exp_avg_sq"][name].to(p),
                }
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        self.global_step = int(state.get("global_step", 0))


def build_megatron_train(cfg: Any, model: Any, *, device: str, **common: Any) -> MegatronTrainEngine:
    """``train.engine=megatron`` (``train.megatron_tp`` x ``megatron_pp``) over ``model`` with the
    settings every engine takes (``common``; packing and torch.compile are not Megatron's)."""
    t = cfg.train
    return MegatronTrainEngine(
        model,
        tp=t.megatron_tp,
        pp=t.megatron_pp,
        autocast=train_autocast(cfg, device),
        gradient_checkpointing=bool(t.gradient_checkpointing),
        seed=cfg.seed,
        device=device,
        **{k: v for k, v in common.items() if k not in ("packing", "compile_backend")},
    )
