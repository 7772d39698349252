"""The embedded-default rollout engine: batched sampling with transformers, on any device.

:class:`HFRolloutEngine` runs its own KV-cache sampling loop over a Hugging Face causal LM
(rather than ``model.generate``), so that the reported log-probs are exactly the
distribution each token was drawn from:

    logits  -> / temperature -> top-k mask -> top-p mask -> log_softmax = processed log-probs
    token   ~  exp(processed log-probs)            (torch.multinomial with a seeded generator)
    logprob =  processed log-probs[token]

This is vLLM's ``logprobs_mode="processed_logprobs"``. Without top-k / top-p it is
``log_softmax(logits / T)[token]``, which the training engine recomputes exactly
(``TorchTrainEngine.logprobs(..., temperature=T)``). With top-k / top-p the processed
distribution is renormalised over the kept tokens, so the rollout log-prob is ``>=`` the
trainer's full-vocabulary one; use it as the behaviour policy's log-prob (importance
weights), not as a stand-in for the trainer's. ``temperature=0`` is greedy decoding and
reports ``log_softmax(logits)[token]`` (temperature 1, after top-k / top-p masks).

Prompts are left-padded with position ids ``cumsum(mask) - 1``, the layout of
:func:`trainers.engines.base.pack`, so a sample does not depend on the other prompts of
the batch (beyond floating-point reduction order).

:meth:`HFRolloutEngine.generate_iter` streams the same samples, each at the decoding step it
finishes (see :func:`trainers.engines.base.iter_generations` and ``docs/rewards-workers.md``).
"""

from __future__ import annotations

import gc
import os
import random
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from trainers.deps import require
from trainers.engines.base import Generation, SamplingParams, position_ids_from_mask
from trainers.engines.options import rollout_dtype
from trainers.engines.weight_sync import MODES, SyncStats
from trainers.engines.weight_transfer import EngineTarget
from trainers.vision import collate, image_inputs, to_device, vision_token_ids
from trainers.vision import position_ids as vision_position_ids

__all__ = ["HFRolloutEngine", "decode_step", "process_logits", "sample_tokens"]


def process_logits(logits: Tensor, temperature: float, top_k: int = -1, top_p: float = 1.0) -> Tensor:
    """``[N, V]`` raw logits -> ``[N, V]`` log-probs of the processed sampling distribution.

    Temperature (``0`` counts as 1: greedy), then top-k, then top-p (the smallest set of
    most likely tokens whose probability reaches ``top_p``; at least one token is kept);
    removed tokens get ``-inf``. Computed in float32.
    """
    x = logits.float()
    if temperature > 0 and temperature != 1.0:
        x = x / temperature
    V = x.shape[-1]
    if 0 < top_k < V:
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        sorted_x, idx = torch.sort(x, dim=-1, descending=True)
        probs = sorted_x.softmax(-1)
        before = probs.cumsum(-1) - probs  # mass of the strictly more likely tokens
        remove = before >= top_p
        remove[..., 0] = False
        x = x.masked_fill(remove.scatter(-1, idx, remove), float("-inf"))
    return torch.log_softmax(x, dim=-1)


def sample_tokens(
    logits: Tensor,
    temperature: float,
    top_k: int,
    top_p: float,
    generator: torch.Generator,
    inactive: Tensor,
    pad: int,
) -> tuple[Tensor, Tensor]:
    """One decoding step for ``[N, V]`` logits: the ``[N]`` sampled tokens (greedy when
    ``temperature == 0``; ``pad`` where ``inactive``) and their ``[N]`` processed log-probs
    (:func:`process_logits`)."""
    logp = process_logits(logits, temperature, top_k, top_p)
    if temperature == 0:
        tok = logp.argmax(-1)
    else:
        tok = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(-1)
    tok = torch.where(inactive, pad, tok)
    return tok, logp.gather(-1, tok[:, None]).squeeze(-1)


def prefill(
    model: Any, seqs: Sequence[Sequence[int]], pad_id: int, device: Any
) -> tuple[Tensor, Tensor, Any, Tensor]:
    """Left-pad ``seqs`` to one width and run them through ``model`` with a KV cache; returns
    ``(attention_mask, position_ids, cache, last_logits)`` for :func:`decode_step`. Prompts with
    images (:class:`trainers.vision.ImagePrompt`) bring their image inputs to the forward, with
    the model's own positions (Qwen2-VL's M-RoPE); the returned positions are then the text
    axis, whose last column continues as a plain text position in the decode steps."""
    width = max(len(x) for x in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for b, x in enumerate(seqs):
        ids[b, width - len(x) :] = torch.tensor(list(x))
        mask[b, width - len(x) :] = 1
    ids, mask = ids.to(device), mask.to(device)
    inputs = to_device(collate([image_inputs(x) for x in seqs]), device)
    if inputs:
        pos3 = vision_position_ids(model, ids, mask, inputs)
        o = model(input_ids=ids, attention_mask=mask, position_ids=pos3, use_cache=True, logits_to_keep=1, **inputs)
        return mask, pos3[0] if pos3.dim() == 3 else pos3, o.past_key_values, o.logits[:, -1]
    pos = position_ids_from_mask(mask)
    o = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1)
    return mask, pos, o.past_key_values, o.logits[:, -1]


def decode_step(
    model: Any, tok: Tensor, mask: Tensor, pos: Tensor, cache: Any
) -> tuple[Tensor, Tensor, Any, Tensor]:
    """Feed the ``[N]`` tokens just sampled: extend the ``[N, L]`` attention mask by one column,
    advance the ``[N, 1]`` positions, run one cached forward. Returns ``(mask, pos, cache,
    logits)`` with the ``[N, V]`` logits of the next token."""
    mask = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], dim=1)
    pos = pos + 1
    o = model(
        input_ids=tok[:, None], attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True
    )
    return mask, pos, o.past_key_values, o.logits[:, -1]


def _ids(p: Sequence[int]) -> list[int]:
    """A prompt's ids as a list of ints; a prompt with images is kept as is (its inputs travel)."""
    return p if image_inputs(p) is not None else list(map(int, p))


class HFRolloutEngine:
    """A :class:`~trainers.engines.base.RolloutEngine` over a transformers causal LM.

    Args:
        model_path_or_module: a checkpoint directory (``from_pretrained``) or a model
            instance. An instance is used as is, not copied: pass ``copy.deepcopy(model)``
            to keep the rollout weights separate from a trainer's.
        tokenizer: gives ``eos_token_id`` / ``pad_token_id``; loaded from the path if None.
        device: where the model runs. dtype: its dtype (log-probs are float32 regardless).
        max_batch_size: the most sequences per forward (``None``: all prompts x ``n``).
            Determinism holds for the same value.

    ``policy_version`` starts at 0 and is set by :meth:`update_weights`.
    """

    def __init__(
        self,
        model_path_or_module: str | os.PathLike | Any,
        tokenizer: Any = None,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        max_batch_size: int | None = None,
        weight_sync: str = "reload",
    ) -> None:
        if weight_sync not in MODES:
            raise ValueError(f"rollout.weight_sync must be one of {MODES}, got {weight_sync!r}")
        transformers = require("transformers")
        if isinstance(model_path_or_module, (str, os.PathLike)):
            model = transformers.AutoModelForCausalLM.from_pretrained(model_path_or_module, dtype=dtype)
            if tokenizer is None:
                tokenizer = transformers.AutoTokenizer.from_pretrained(model_path_or_module)
        else:
            model = model_path_or_module
        if tokenizer is None:
            raise ValueError("tokenizer is required when passing a model instance")
        self.device = torch.device(device)
        self.dtype = dtype
        self.model = model.to(device=self.device, dtype=dtype).eval()
        self.tokenizer = tokenizer
        eos: set[int] = set()
        for e in (tokenizer.eos_token_id, getattr(model.generation_config, "eos_token_id", None)):
            if e is not None:
                eos.update([e] if isinstance(e, int) else e)
        eos.update(vision_token_ids(model))  # a VLM's sample ends at a vision token (trainers.vision)
        self.eos_token_ids: tuple[int, ...] = tuple(sorted(eos))
        pad = tokenizer.pad_token_id
        self.pad_token_id: int = pad if pad is not None else (self.eos_token_ids or (0,))[0]
        self.max_batch_size = max_batch_size
        self.policy_version = 0
        self._sleep_level = 0
        self._buffers: dict[str, Tensor] = {}
        self._needs_weights = False
        self.weight_sync = weight_sync
        self.last_sync: SyncStats | None = None
        self._target: EngineTarget | None = None

    # ------------------------------------------------------------------ generation

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Generation]:
        """``params.n`` samples per prompt; ``out[i * n + j]`` is sample ``j`` of prompt ``i``."""
        out: list[Generation] = []
        for chunk in self._chunks(prompts, params):
            done = sorted(chunk, key=lambda bg: bg[0])  # the chunk's rows in order
            out.extend(g for _, g in done)
        return out

    def generate_iter(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> Iterator[Generation]:
        """Stream :meth:`generate`: yield each sample at the decoding step it finishes.

        The samples are those of :meth:`generate` for the same seed, prompts, params and
        ``max_batch_size`` (the same sampling loop runs: a finished row stays in the batch,
        padded, so the random stream is unchanged), in the order they finish: rows of a
        chunk of ``max_batch_size`` rows come out as they hit a stop token (several in one
        step in row order), those that reach ``max_tokens`` at the chunk's last step; a
        chunk starts once the previous one is done. ``prompt_index`` says which prompt a
        sample belongs to. The work of the next step happens when the consumer asks for the
        next item, so scoring a sample between items overlaps nothing in this thread:
        hand it to a :class:`trainers.rewards.RewardPool` (non-blocking ``submit``). Do not
        call other methods of the engine while the iterator is open.
        """
        for chunk in self._chunks(prompts, params):
            for _, g in chunk:
                yield g

    def _chunks(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams
    ) -> Iterator[Iterator[tuple[int, Generation]]]:
        """Checks the call, then one iterator per chunk of rows, each yielding ``(row, sample)``
        as the rows finish (the common path of generate and generate_iter)."""
        if self._sleep_level:
            raise RuntimeError("the engine is asleep: call wake() first")
        if self._needs_weights:
            why = getattr(self, "_stale_why", "discarded by sleep(level=2)")
            raise RuntimeError(f"weights were {why}: call update_weights() first")
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        rows = [(i, _ids(p)) for i, p in enumerate(prompts) for _ in range(params.n)]
        seed = params.seed if params.seed is not None else random.randrange(2**63)
        gen = torch.Generator(device=self.device).manual_seed(seed)
        stop = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop.update(self.eos_token_ids)
        stop_t = torch.tensor(sorted(stop), dtype=torch.long, device=self.device)
        step = self.max_batch_size or max(len(rows), 1)
        for s in range(0, len(rows), step):
            yield self._sample(rows[s : s + step], params, stop_t, gen)

    def generate_text(self, texts: Sequence[str], params: SamplingParams) -> list[str]:
        """Convenience: encode ``texts``, :meth:`generate`, decode (special tokens skipped)."""
        prompts = [self.tokenizer(t).input_ids for t in texts]
        gens = self.generate(prompts, params)
        return [self.tokenizer.decode(g.token_ids, skip_special_tokens=True) for g in gens]

    @torch.inference_mode()
    def _sample(
        self, rows: list[tuple[int, list[int]]], params: SamplingParams, stop: Tensor, gen: torch.Generator
    ) -> Iterator[tuple[int, Generation]]:
        """Sample ``rows`` as one batch; yield ``(row, Generation)`` at the step each row finishes."""
        B, dev = len(rows), self.device
        # Prefill each distinct prompt once (the n samples of a prompt repeat it), then gather
        # its KV cache and last logits to every row that samples from it.
        # (A prompt with images is keyed by its object too: two images can give the same ids.)
        keys = [(tuple(p), id(p) if image_inputs(p) is not None else 0) for _, p in rows]
        first: dict[tuple[Any, int], int] = {}
        inv = torch.tensor([first.setdefault(k, len(first)) for k in keys], device=dev)
        uniq: list[Any] = [None] * len(first)  # each distinct prompt (the row's own list: it may carry images)
        for k, (_, p) in zip(keys, rows):
            uniq[first[k]] = uniq[first[k]] or p
        mask, pos, cache, logits = prefill(self.model, uniq, self.pad_token_id, dev)
        if len(uniq) < B:
            cache.batch_select_indices(inv)
            logits, mask, pos = logits[inv], mask[inv], pos[inv]

        M = params.max_tokens
        tokens = torch.full((B, M), self.pad_token_id, dtype=torch.long, device=dev)
        lps = torch.zeros((B, M), dtype=torch.float32, device=dev)
        length = torch.full((B,), M, dtype=torch.long, device=dev)
        done = torch.zeros(B, dtype=torch.bool, device=dev)
        emitted: set[int] = set()  # rows already yielded (they finished before the last step)
        pos = pos[:, -1:]
        for t in range(M):
            tok, tok_lp = sample_tokens(
                logits, params.temperature, params.top_k, params.top_p, gen, done, self.pad_token_id
            )
            tokens[:, t], lps[:, t] = tok, tok_lp
            hit = torch.isin(tok, stop) & ~done
            length = torch.where(hit, t + 1, length)
            done |= hit
            finished = hit.nonzero().flatten().tolist()  # a host sync, as done.all() below
            if finished and t < M - 1 and not bool(done.all()):
                yield from self._emit(rows, finished, tokens, lps, t + 1, "stop")
                emitted.update(finished)
            if t == M - 1 or bool(done.all()):
                break
            mask, pos, cache, logits = decode_step(self.model, tok, mask, pos, cache)

        tokens, lps, length, done = tokens.cpu(), lps.cpu(), length.tolist(), done.tolist()
        for b, (i, p) in enumerate(rows):
            if b not in emitted:
                yield (
                    b,
                    Generation(
                        prompt_index=i,
                        prompt_ids=p,
                        token_ids=tokens[b, : length[b]].tolist(),
                        logprobs=lps[b, : length[b]].tolist(),
                        finish_reason="stop" if done[b] else "length",
                        policy_version=self.policy_version,
                    ),
                )

    def _emit(
        self,
        rows: list[tuple[int, list[int]]],
        finished: list[int],
        tokens: Tensor,
        lps: Tensor,
        n: int,
        reason: str,
    ) -> Iterator[tuple[int, Generation]]:
        """The rows ``finished`` at step ``n - 1`` (their ``n`` tokens)."""
        idx = torch.tensor(finished, device=tokens.device)
        tok, lp = tokens[idx, :n].cpu(), lps[idx, :n].cpu()
        for k, b in enumerate(finished):
            yield (
                b,
                Generation(
                    prompt_index=rows[b][0],
                    prompt_ids=rows[b][1],
                    token_ids=tok[k].tolist(),
                    logprobs=lp[k].tolist(),
                    finish_reason=reason,  # type: ignore[arg-type]
                    policy_version=self.policy_version,
                ),
            )

    # ------------------------------------------------------------------ weights

    def update_weights(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> None:
        """Copy ``(name, tensor)`` pairs into the model in place; set ``policy_version``.

        Names are the model's ``state_dict`` keys (a tied ``lm_head.weight`` may be given
        or not: it is the embedding). The update is all-or-nothing: every name must exist
        and every shape match, and every parameter must be covered, else nothing is copied
        and ``KeyError`` / ``ValueError`` is raised. Tensors are cast to the engine's
        dtype and device.
        """
        if self._sleep_level == 2:
            raise RuntimeError(
                "the weights were discarded by sleep(level=2): call wake() before update_weights()"
            )
        if self.weight_sync != "reload":
            self._stream(named_tensors, version)
            return
        targets = self.model.state_dict(keep_vars=True)
        params = {id(p): n for n, p in self.model.named_parameters()}
        pending: list[tuple[Tensor, Tensor]] = []
        covered: set[int] = set()
        for name, t in named_tensors:
            dst = _target_of(targets, name, t)
            pending.append((dst, t))
            covered.add(id(dst))
        missing = [n for i, n in params.items() if i not in covered]
        if missing:
            raise KeyError(
                f"update_weights: missing parameters {missing[:5]}{'...' if len(missing) > 5 else ''}"
            )
        with torch.no_grad():
            for dst, t in pending:
                dst.copy_(t.detach().to(device=dst.device, dtype=dst.dtype))
        self._needs_weights = False
        self.policy_version = int(version)

    def _stream(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> None:
        """``weight_sync`` buckets / delta: each tensor is checked and copied as it arrives (no
        list of the whole stream, so a gathering export holds one tensor at a time). A stream that
        fails half-way (an unknown name, a wrong shape, a parameter left out) leaves the engine
        refusing to generate until the next update. Nothing travels between processes here, so
        delta is buckets."""
        t0 = time.perf_counter()
        targets = self.model.state_dict(keep_vars=True)
        params = {id(p): n for n, p in self.model.named_parameters()}
        covered: set[int] = set()
        stats = SyncStats()
        self._needs_weights, self._stale_why = True, "left half-loaded by a failed update"
        for name, t in named_tensors:
            dst = _copy_in(targets, name, t)
            if id(dst) not in covered:
                covered.add(id(dst))
                stats.tensors += 1
                stats.dense_bytes += dst.numel() * dst.element_size()
        missing = [n for i, n in params.items() if i not in covered]
        if missing:
            raise KeyError(
                f"update_weights: missing parameters {missing[:5]}{'...' if len(missing) > 5 else ''}"
            )
        stats.bytes, stats.seconds = stats.dense_bytes, time.perf_counter() - t0
        self.last_sync = stats
        self._needs_weights, self._stale_why = False, "discarded by sleep(level=2)"
        self.policy_version = int(version)

    def sync_target(self) -> EngineTarget:
        """This engine as the target of a sender elsewhere (train rank 0 on Ray, ``weight_sync``
        buckets / delta): a :class:`~trainers.engines.weight_transfer.Receiver` here whose tensors are
        checked by name and shape and copied into the parameters as each bucket arrives."""
        if self._target is None:
            self._target = EngineTarget("hf engine", load=self._load_bucket, finished=self._finished)
        return self._target

    def _load_bucket(self, weights: list[tuple[str, Tensor]]) -> None:
        self._needs_weights, self._stale_why = True, "left half-loaded by a failed update"
        targets = self.model.state_dict(keep_vars=True)
        for name, t in weights:
            _copy_in(targets, name, t)

    def _finished(self, version: int) -> None:
        if version >= 0:
            self._needs_weights, self._stale_why = False, "discarded by sleep(level=2)"
            self.policy_version = int(version)

    def metrics(self) -> dict[str, float]:
        """``sync/*`` of the latest ``weight_sync`` buckets / delta update (``{}`` before one)."""
        return {} if self.last_sync is None else self.last_sync.metrics()

    # ------------------------------------------------------------------ memory

    def sleep(self, level: int = 1) -> None:
        """Free the accelerator memory of the weights while a colocated trainer runs.

        * level 1: move the model to CPU (a no-op when ``device="cpu"``); :meth:`wake` moves
          it back, weights intact.
        * level 2: discard the weights (the model goes to the ``meta`` device; buffers such
          as RoPE frequencies are kept on CPU). :meth:`wake` re-allocates uninitialised
          storage and :meth:`update_weights` must run before the next :meth:`generate`,
          as with vLLM's level-2 sleep. Frees memory on CPU too.
        """
        if level not in (1, 2):
            raise ValueError(f"level must be 1 or 2, got {level}")
        if self._sleep_level:
            return
        if level == 2:
            self._buffers = {n: b.detach().to("cpu", copy=True) for n, b in self.model.named_buffers()}
            self.model.to("meta")
        else:
            self.model.to("cpu")
        self._sleep_level = level
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def wake(self) -> None:
        """Undo :meth:`sleep` (after level 2, weights must then be sent with update_weights)."""
        if not self._sleep_level:
            return
        if self._sleep_level == 2:
            self.model.to_empty(device=self.device)
            if hasattr(self.model, "tie_weights"):
                self.model.tie_weights()  # to_empty may untie lm_head from the embedding
            with torch.no_grad():
                for n, b in self.model.named_buffers():
                    b.copy_(self._buffers[n])
            self._buffers = {}
            self._needs_weights = True
        else:
            self.model.to(self.device)
        self._sleep_level = 0

    @property
    def is_sleeping(self) -> bool:
        return self._sleep_level > 0


def _target_of(targets: dict[str, Tensor], name: str, t: Tensor) -> Tensor:
    """The model's tensor ``name`` for an update's ``t``: an unknown name is a ``KeyError``, another
    shape a ``ValueError``, each naming the tensor."""
    if name not in targets:
        raise KeyError(f"update_weights: unknown parameter {name!r}")
    dst = targets[name]
    if tuple(t.shape) != tuple(dst.shape):
        raise ValueError(f"update_weights: {name!r} has shape {list(t.shape)}, expected {list(dst.shape)}")
    return dst


@torch.no_grad()
def _copy_in(targets: dict[str, Tensor], name: str, t: Tensor) -> Tensor:
    """Copy ``t`` into the model's tensor ``name`` (checked by :func:`_target_of`, cast to its dtype
    and device); returns the model's tensor."""
    dst = _target_of(targets, name, t)
    dst.copy_(t.detach().to(device=dst.device, dtype=dst.dtype))
    return dst


def build_hf_rollout(cfg: Any, model: Any, tokenizer: Any, *, device: str) -> HFRolloutEngine:
    """``rollout.engine=hf``: the transformers sampling loop over ``model`` (used as is), with the
    config's rollout dtype and batch size (:data:`trainers.config.ROLLOUT_ENGINES`)."""
    r = cfg.rollout
    if r.tensor_parallel_size != 1:
        raise ValueError(
            f"rollout.tensor_parallel_size={r.tensor_parallel_size}: the hf engine runs on one device"
        )
    return HFRolloutEngine(
        model, tokenizer, device=device, dtype=rollout_dtype(cfg, device), max_batch_size=r.max_batch_size,
        weight_sync=r.weight_sync,
    )
