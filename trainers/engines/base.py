"""Engine interfaces shared by every rollout and training backend, and the token layout.

A *rollout engine* samples responses with the per-token log-probs of the sampled tokens; a
*training engine* recomputes those log-probs with gradients, back-propagates a rollkit loss
and steps the optimizer, then exports its weights to the rollout engine. Backends (the
transformers / plain-PyTorch embedded defaults here, vLLM and DeepSpeed later) implement
:class:`RolloutEngine` and :class:`TrainEngine`; the trainers only talk to these.

Token layout (:func:`pack`): prompts are **left**-padded to the longest prompt ``P``,
responses **right**-padded to the longest response ``T``::

    input_ids       [B, P + T]   <pad> <pad> p0 p1 p2 | r0 r1 r2 <pad>
    attention_mask  [B, P + T]     0     0   1  1  1  |  1  1  1   0
    response_mask   [B, T]                             |  1  1  1   0

so every response starts at column ``P`` and the response region is the last ``T`` columns:
the log-prob of response token ``t`` comes from the logits at column ``P - 1 + t``, for
every row. Position ids are ``cumsum(attention_mask) - 1`` (clamped at 0), so a prompt's
first real token has position 0 whatever its padding: a row's logits do not depend on how
much padding the batch added, and the training engine's log-probs line up token for token
with the rollout engine's.

Log-prob convention: ``logprobs[b, t] = log softmax(logits / temperature)[token]``, the
*processed* distribution the token was sampled from (vLLM's ``logprobs_mode=
"processed_logprobs"``). See :mod:`trainers.engines.hf_rollout` for top-k / top-p.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, TypeVar, runtime_checkable

import torch
from torch import Tensor

from trainers.vision import collate, image_inputs

T = TypeVar("T")

__all__ = [
    "size_groups",
    "Generation",
    "PackedBatch",
    "RolloutEngine",
    "SamplingParams",
    "TrainEngine",
    "batch_logprobs",
    "iter_generations",
    "pack",
    "pack_generations",
    "pad_right",
    "position_ids_from_mask",
    "prompt_seed",
]

_MASK64 = (1 << 64) - 1


def prompt_seed(seed: int, prompt: int) -> int:
    """The sampling seed of prompt ``prompt`` of a seeded batch, for engines that seed each
    request on its own (vLLM, ``vllm serve``): sample ``j`` of that prompt uses
    ``prompt_seed(seed, prompt) + j`` (vLLM's rule for the children of an ``n > 1`` request).

    A splitmix64 hash of ``(seed, prompt)``, shifted to 62 bits: every prompt of a batch gets a
    stream of its own, and consecutive batch seeds (``seed``, ``seed + 1``, ..., as
    :class:`trainers.engines.server.GenerationServer` counts its calls) never share one. With
    ``seed + j`` for every prompt (the old rule) two rows holding the same context, e.g. the
    first turn of two episodes of one task, drew the same sample.

    >>> prompt_seed(7, 0) != prompt_seed(7, 1) != prompt_seed(8, 0)
    True
    """
    z = (int(seed) + (int(prompt) + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 2


@dataclass(frozen=True)
class SamplingParams:
    """How to sample (the subset of vLLM's ``SamplingParams`` every engine supports).

    Attributes:
        n: samples per prompt.
        temperature: ``> 0`` samples from ``softmax(logits / temperature)``; ``0`` is greedy.
        top_p: nucleus sampling, in ``(0, 1]`` (1 disables it).
        top_k: keep the ``top_k`` most likely tokens (``-1`` or ``0`` disables it).
        max_tokens: the most tokens generated per sample (the stop token included).
        stop_token_ids: tokens that end a sample (``finish_reason="stop"``), in addition to
            the model's EOS tokens. The stop token is part of ``token_ids``.
        ignore_eos: do not stop at EOS (``stop_token_ids`` still stop).
        seed: seeds the sampler; the same seed, prompts and params give the same samples.
            ``None``: a fresh random seed.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))


@dataclass
class Generation:
    """One sample: the prompt's index in the ``generate`` call, its tokens and log-probs.

    ``logprobs[i]`` is the log-prob of ``token_ids[i]`` under the processed sampling
    distribution (module docstring). ``policy_version`` is the engine's weight version when
    the sample was generated (for staleness accounting in asynchronous training).
    """

    prompt_index: int
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: Literal["stop", "length"]
    policy_version: int = 0


@runtime_checkable
class RolloutEngine(Protocol):
    """Samples responses; receives new weights from the training engine."""

    policy_version: int

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Generation]:
        """``params.n`` samples per prompt, grouped by prompt: ``out[i * n + j]`` is sample
        ``j`` of prompt ``i`` (``out[k].prompt_index == k // n``)."""
        ...

    def update_weights(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> None:
        """Load ``(name, tensor)`` pairs named as in the model's ``state_dict``; set
        ``policy_version = version``."""
        ...

    def sleep(self, level: int = 1) -> None:
        """Free accelerator memory for a colocated trainer (level 1: offload weights,
        level 2: discard them; ``update_weights`` must follow ``wake``)."""
        ...

    def wake(self) -> None:
        """Undo :meth:`sleep`."""
        ...


def iter_generations(
    engine: RolloutEngine, prompts: Sequence[Sequence[int]], params: SamplingParams
) -> Iterator[Generation]:
    """Yield each :class:`Generation` as soon as it is finished, in any order (``prompt_index``
    says which prompt it belongs to).

    Uses ``engine.generate_iter(prompts, params)`` when the engine has it (HFRolloutEngine
    yields a sample at the decoding step it finishes, VLLMRolloutEngine per request as vLLM
    finishes it); otherwise yields the samples of ``engine.generate(prompts, params)`` once
    the whole batch is done. Either way the samples are those ``generate`` returns for the
    same seed, as a multiset. Feed them to a :class:`trainers.rewards.RewardPool` to score
    while the rest of the batch is still generating.
    """
    stream = getattr(engine, "generate_iter", None)
    if callable(stream):
        yield from stream(prompts, params)
    else:
        yield from engine.generate(prompts, params)


@runtime_checkable
class TrainEngine(Protocol):
    """Forward log-probs with gradients, backward a loss, step, export weights, checkpoint.

    Optional methods (``placement.offload_train``; not part of the runtime check):

    - ``offload() -> None``: move the weights, gradients, optimizer state and buffers to the
      host and release their device memory; idempotent. Methods that need them onload first.
    - ``onload() -> None``: bring them back to the device, bit-identical; idempotent.

    The torch, DeepSpeed and FSDP2 engines implement both (:mod:`trainers.engines.offload`);
    with an engine that lacks them, ``placement.offload_train=true`` is refused by name.
    """

    def logprobs(
        self,
        input_ids: Tensor,  # [B, L] (layout of :func:`pack`)
        attention_mask: Tensor,  # [B, L]
        response_mask: Tensor,  # [B, T]: the response is the last T columns of input_ids
        *,
        temperature: float = 1.0,
        with_entropy: bool = False,
        top_k: int = -1,
        top_p: float = 1.0,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """``[B, T]`` log-probs of the response tokens (0 where ``response_mask`` is False),
        and the ``[B, T]`` entropies if ``with_entropy``, of the rollout's processed
        distribution: tempered, and with ``top_k > 0`` / ``top_p < 1`` the same truncation the
        rollout engine applied (replayed on the trainer's logits, :mod:`rollkit.logprobs`)."""
        ...

    def backward(self, loss: Tensor) -> None:
        """Accumulate the gradient of a scalar loss (one micro-batch)."""
        ...

    def step(self) -> dict[str, float]:
        """Clip, apply the accumulated gradient, advance the scheduler, zero the gradient;
        return metrics (``grad_norm`` before clipping, ``lr``)."""
        ...

    def zero_grad(self) -> None: ...

    def export_weights(self) -> Iterator[tuple[str, Tensor]]:
        """The trainable weights as ``(state_dict name, tensor)``, for ``update_weights``."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """Model, optimizer and scheduler state, for checkpointing."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


# --------------------------------------------------------------------------- layout


@dataclass
class PackedBatch:
    """Prompts and responses in the layout of the module docstring (all tensors on CPU).

    ``old_logprobs`` and ``prompt_index`` are filled by :func:`pack_generations`.
    ``behavior_logprobs`` is set when the policy that sampled the tokens differs from the
    one the PPO ratio is taken against (asynchronous training with recomputed proximal
    log-probs, :mod:`trainers.loops.asynchronous`): then ``old_logprobs`` are the proximal policy's
    and ``behavior_logprobs`` the rollout's; ``None`` means they are the same.
    ``is_weights`` / ``keep`` are the mismatch correction's per-token weights and the tokens it
    did not reject (:func:`rollkit.correction.correction_weights`): the learner multiplies the
    policy loss by the weights and trains only the kept tokens.
    """

    input_ids: Tensor  # [B, P + T] long
    attention_mask: Tensor  # [B, P + T] long (1 = real token)
    response_mask: Tensor  # [B, T] bool
    prompt_len: int  # P
    old_logprobs: Tensor | None = None  # [B, T] float32, 0 outside the response
    prompt_index: Tensor | None = None  # [B] long
    behavior_logprobs: Tensor | None = None  # [B, T] float32; None: the same as old_logprobs
    is_weights: Tensor | None = None  # [B, T] mismatch-correction weights (rollkit.correction); None: 1
    keep: Tensor | None = None  # [B, T] bool: tokens the correction kept in the loss; None: all
    # [B, T] bool: tokens that get the entropy bonus (AsyPPO's filter, rollkit.critics); None: all
    entropy_keep: Tensor | None = None
    # [B, T] long: the turn (interaction chunk) of each response token, -1 off it (the agentic
    # loop's TrajectoryBatch.step_ids); the learner passes it to losses that read "step_ids"
    # (IPA's chunk-level ratio). None: a single-turn batch.
    step_ids: Tensor | None = None
    extras: dict[str, Any] = field(default_factory=dict)
    # per row: the prompt's image inputs (trainers.vision; None: no image); None: a text batch
    images: list[dict[str, Tensor] | None] | None = None

    @property
    def responses(self) -> Tensor:  # [B, T]
        return self.input_ids[:, self.prompt_len :]

    def __getitem__(self, rows: slice | Tensor) -> PackedBatch:
        """A micro-batch: the same layout restricted to ``rows`` (columns are kept)."""
        return PackedBatch(
            input_ids=self.input_ids[rows],
            attention_mask=self.attention_mask[rows],
            response_mask=self.response_mask[rows],
            prompt_len=self.prompt_len,
            old_logprobs=None if self.old_logprobs is None else self.old_logprobs[rows],
            prompt_index=None if self.prompt_index is None else self.prompt_index[rows],
            behavior_logprobs=None if self.behavior_logprobs is None else self.behavior_logprobs[rows],
            is_weights=None if self.is_weights is None else self.is_weights[rows],
            keep=None if self.keep is None else self.keep[rows],
            entropy_keep=None if self.entropy_keep is None else self.entropy_keep[rows],
            step_ids=None if self.step_ids is None else self.step_ids[rows],
            images=None if self.images is None else _select(self.images, rows),
        )

    def model_inputs(self) -> dict[str, Any]:
        """The extra keyword arguments of a train engine's ``logprobs`` for these rows:
        ``{"inputs": <the rows' image inputs, collated>}`` when a row has images, else ``{}``."""
        inputs = None if self.images is None else collate(self.images)
        return {} if inputs is None else {"inputs": inputs}


def _select(items: list[Any], rows: slice | Tensor) -> list[Any]:
    """``items[rows]`` for a slice, an index tensor or a boolean mask."""
    if isinstance(rows, slice):
        return items[rows]
    rows = torch.as_tensor(rows)
    if rows.dtype == torch.bool:
        rows = rows.nonzero().flatten()
    return [items[int(i)] for i in rows.flatten().tolist()]


def size_groups(items: Iterable[T], size: Callable[[T], int], limit: int) -> Iterator[list[T]]:
    """Consecutive groups of ``items`` whose ``size`` sums to at most ``limit`` (an item larger
    than ``limit`` is a group of its own), pulled from ``items`` one group at a time: ZeRO-3's
    export gathers (elements), the weight sync's buckets (bytes).

    >>> list(size_groups([3, 3, 5, 1], int, 6))
    [[3, 3], [5, 1]]
    """
    group: list[T] = []
    total = 0
    for item in items:
        n = size(item)
        if group and total + n > limit:
            yield group
            group, total = [], 0
        group.append(item)
        total += n
    if group:
        yield group


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """``cumsum(mask) - 1`` clamped at 0: real tokens count from 0 after any left padding."""
    return (attention_mask.long().cumsum(-1) - 1).clamp_(min=0)


def pad_right(rows: Sequence[Sequence[float]], width: int, value: float, dtype: torch.dtype) -> Tensor:
    """``[len(rows), width]`` tensor with each row right-padded with ``value``."""
    out = torch.full((len(rows), width), value, dtype=dtype)
    for i, r in enumerate(rows):
        if len(r) > width:
            raise ValueError(f"row {i} has {len(r)} entries, more than width {width}")
        if len(r):
            out[i, : len(r)] = torch.as_tensor(r, dtype=dtype)
    return out


def pack(
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    pad_token_id: int,
    *,
    response_width: int | None = None,
) -> PackedBatch:
    """Left-pad ``prompts``, right-pad ``responses``, concatenate (module docstring layout).

    ``response_width`` fixes ``T`` (at least the longest response), e.g. to keep shapes
    constant across steps. An empty response gives an all-False ``response_mask`` row.

    >>> b = pack([[5, 6], [7]], [[8], [9, 10]], pad_token_id=0)
    >>> b.input_ids.tolist(), b.response_mask.tolist(), b.prompt_len
    ([[5, 6, 8, 0], [0, 7, 9, 10]], [[True, False], [True, True]], 2)
    """
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    P = max((len(p) for p in prompts), default=0)
    T = max((len(r) for r in responses), default=0)
    if response_width is not None:
        if response_width < T:
            raise ValueError(f"response_width {response_width} < longest response {T}")
        T = response_width
    B = len(prompts)
    input_ids = torch.full((B, P + T), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((B, P + T), dtype=torch.long)
    response_mask = torch.zeros((B, T), dtype=torch.bool)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        input_ids[i, P - len(p) : P] = torch.as_tensor(list(p), dtype=torch.long)
        attention_mask[i, P - len(p) : P] = 1
        if len(r):
            input_ids[i, P : P + len(r)] = torch.as_tensor(list(r), dtype=torch.long)
            attention_mask[i, P : P + len(r)] = 1
            response_mask[i, : len(r)] = True
    images = [image_inputs(p) for p in prompts]  # prompts with images (trainers.vision.ImagePrompt)
    return PackedBatch(
        input_ids, attention_mask, response_mask, P,
        images=images if any(x is not None for x in images) else None,
    )  # fmt: skip


def pack_generations(
    generations: Sequence[Generation], pad_token_id: int, *, response_width: int | None = None
) -> PackedBatch:
    """:func:`pack` of generations, with their log-probs as ``old_logprobs`` ``[B, T]``."""
    b = pack(
        [g.prompt_ids for g in generations],
        [g.token_ids for g in generations],
        pad_token_id,
        response_width=response_width,
    )
    b.old_logprobs = pad_right(
        [g.logprobs for g in generations], b.response_mask.shape[1], 0.0, torch.float32
    )
    b.prompt_index = torch.tensor([g.prompt_index for g in generations], dtype=torch.long)
    return b


@torch.no_grad()
def batch_logprobs(
    policy: Any,
    batch: PackedBatch,
    *,
    temperature: float,
    micro_batch_size: int,
    top_k: int = -1,
    top_p: float = 1.0,
) -> Tensor:
    """The ``[B, T]`` log-probs of a packed batch under ``policy``, without gradients: its own
    ``batch_logprobs`` when it has one (a Ray reference actor or train group), else its
    TrainEngine ``logprobs`` over micro-batches of ``micro_batch_size`` rows (``top_k`` /
    ``top_p``: the rollout's truncation, replayed)."""
    kw = {"temperature": temperature, "top_k": top_k, "top_p": top_p}
    if hasattr(policy, "batch_logprobs"):
        return policy.batch_logprobs(batch, micro_batch_size=micro_batch_size, **kw)
    out = []
    for i in range(0, batch.input_ids.shape[0], micro_batch_size):
        mb = batch[i : i + micro_batch_size]
        out.append(policy.logprobs(mb.input_ids, mb.attention_mask, mb.response_mask, **kw, **mb.model_inputs()))
    return torch.cat(out)
