"""The engines' sections: ``model``, ``rollout`` (the engine settings shared by every trainer, and
the RLVR sampling) and ``train``, with their rules and the checks that relate their fields."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from trainers.config.capabilities import ROLLOUT_ENGINES, TRAIN_ENGINES, EngineTable
from trainers.config.fields import setting
from trainers.models import is_hub_id

__all__ = [
    "DTYPE_NAMES",
    "TINY_VLM_NAMES",
    "ModelConfig",
    "RolloutConfig",
    "RolloutEngineConfig",
    "TrainConfig",
    "parse_length_dist",
    "server_addresses",
]

DTYPE_NAMES = ("float32", "bfloat16", "float16")
#: ``model.path`` names of the tiny random vision-language models (trainers.engines.build.TINY_VLMS)
TINY_VLM_NAMES = ("tiny_vl", "tiny_idefics3")

DtypeName = Literal["float32", "bfloat16", "float16"]
RolloutDtype = Literal["", "auto", "float32", "bfloat16", "float16"]


@dataclass
class ModelConfig:
    """The policy. ``path``: an HF causal-LM directory; ``""`` = the embedded default
    (SmolLM2-135M-Instruct, :func:`trainers.models.default_model_path`); ``"tiny"`` = a random
    tiny Qwen2 with the character tokenizer (tests); ``"tiny_vl"`` = a random tiny Qwen2-VL
    (:func:`trainers.vision.tiny_qwen2_vl`), ``"tiny_idefics3"`` a tiny Idefics3 / SmolVLM. A vision-language checkpoint (its config has a
    ``vision_config``: Qwen2-VL, Qwen2.5-VL...) loads with its processor; prompts may then carry
    images (:mod:`trainers.vision`)."""

    path: str = ""
    dtype: DtypeName = "float32"
    tiny_seed: int = 0
    # attention heads of the tiny model (hidden size 64); 0: 4 heads (head size 16), or 2 (head size
    # 32) when rollout.engine is vllm or server, whose CPU attention has no head size 16
    tiny_heads: int = setting(0, ge=0)
    tiny_kv_heads: int = setting(2, ge=1)
    # a vision-language model: freeze its image tower and projector (false: train them too)
    freeze_vision: bool = True


@dataclass
class RolloutEngineConfig:
    """The rollout engine's settings for ``rollout.engine`` vllm and server, shared by the RLVR
    (:class:`RolloutConfig`) and agentic (:class:`~trainers.config.AgenticRolloutConfig`) configs."""

    gpu_memory_utilization: float = setting(0.5, gt=0, le=1)  # vLLM on GPUs
    # vLLM's tensor parallelism: each rollout engine (or local vllm serve) shards the model over
    # this many devices (LLM(tensor_parallel_size=...), --tensor-parallel-size). hf: 1 only
    tensor_parallel_size: int = setting(1, ge=1)
    max_model_len: int | None = setting(None, ge=1)  # vLLM: longest prompt + response (None: the model's)
    # rollout.engine=server (docs/server.md): comma-separated http://host:port of running vllm
    # servers; "" starts num_servers local ones (logs and weight files in server_dir, "" = a temp dir)
    servers: str = ""
    num_servers: int = setting(1, ge=1)
    server_dir: str = ""
    server_timeout_s: float = setting(30.0, gt=0)  # each control call (health, models, abort, weights)
    server_request_timeout_s: float = setting(300.0, gt=0)  # the longest wait for a request's next token
    server_startup_timeout_s: float = setting(600.0, gt=0)  # local servers: until all answer /health
    server_kv_cache_gib: int = setting(1, ge=1)  # local servers on CPU: VLLM_CPU_KVCACHE_SPACE
    prompts_per_request: int = setting(
        1, ge=1
    )  # Ray: prompts per request sent to the least-loaded rollout actor
    # How the weights reach the rollout after each step (docs/weight_sync.md): "reload" (the whole
    # model at once: vLLM's reload_weights, a safetensors file each server re-reads), "buckets"
    # (streamed in weight_bucket_mb buckets over a gloo group behind vLLM's weight-transfer API:
    # no whole-model copy, no shared filesystem), "delta" (buckets of sparse patches of the
    # elements that changed, exact; both ends keep a copy in the rollout dtype)
    weight_sync: Literal["reload", "buckets", "delta"] = "reload"
    weight_bucket_mb: float = setting(64.0, gt=0)
    # buckets / delta: after each sync the engines' version and digests (sha256 of what each
    # worker loaded) must equal the trainer's, else the run stops naming the engine and tensor
    weight_check: bool = True
    # the address vLLM servers reach the trainer's gloo rendezvous at ("": 127.0.0.1 for local
    # servers, else this machine's address on the route to the first server)
    weight_sync_host: str = ""
    # after each sync, the largest |log-prob gap| of a few probe tokens between the rollout and the
    # trainer before the run stops (0: off); it catches weights that arrived but are not served
    weight_probe_tol: float = setting(0.0, ge=0)


@dataclass
class RolloutConfig(RolloutEngineConfig):
    """Sampling. ``prompts_per_step`` x ``n`` samples make the batch of one step."""

    # a name of trainers.config.ROLLOUT_ENGINES: "hf" (transformers), "vllm" (in process) or
    # "server" (vllm serve over HTTP)
    engine: str = setting("hf", registry=ROLLOUT_ENGINES)
    prompts_per_step: int = setting(4, ge=1)
    n: int = setting(8, ge=1)
    temperature: float = setting(0.7, gt=0)
    top_p: float = setting(1.0, gt=0, le=1)
    top_k: int = setting(-1, ge=-1)  # -1 or 0: off
    max_tokens: int = setting(12, ge=1)
    max_batch_size: int | None = setting(None, ge=1)
    # Rollout weights' dtype: "" = model.dtype; "float32" / "bfloat16" / "float16"; "auto" =
    # bfloat16 where its matmuls are fast (CUDA with bf16, CPUs with AMX), else model.dtype.
    dtype: RolloutDtype = ""
    # W1 long-tail workload: per-request max_tokens ~ "lognormal:MEDIAN:SIGMA" capped at max_tokens,
    # generated with ignore_eos ("": every request may use max_tokens and stops at EOS)
    length_dist: str = ""
    # request-level hf engine (async, tail batching, length_dist): tokens a request advances per step
    chunk_tokens: int = setting(16, ge=1)
    # with train.lora_rank > 0: what the rollout engine receives after each update: "merged"
    # (the full weights W + scale * B A, any engine) or "adapter" (only the LoRA tensors, served
    # by vLLM's LoRA support as a new adapter per version; rollout.engine=vllm)
    lora_weights: Literal["merged", "adapter"] = "merged"
    # an injected training-inference mismatch for experiments (benchmarks/bench_correction.py):
    # > 0: the rollout engine samples at this temperature while the trainer's log-probs use
    # rollout.temperature. 0: off (both sides use rollout.temperature)
    engine_temperature: float = setting(0.0, ge=0)


@dataclass
class TrainConfig:
    """Optimisation. ``steps`` RL steps, each ``ppo_epochs`` passes over the batch in
    micro-batches of ``micro_batch_size`` sequences, one optimizer step per
    ``mini_batch_size`` sequences (``0``: the whole batch)."""

    # a name of trainers.config.TRAIN_ENGINES: "torch" (plain PyTorch), "deepspeed", "fsdp2"
    # (torch fully_shard) or "megatron"
    engine: str = setting("torch", registry=TRAIN_ENGINES)
    zero_stage: Literal[0, 1, 2, 3] = 2  # DeepSpeed ZeRO stage (0-3)
    # train.engine=megatron (Megatron-Core; docs/megatron.md): tensor- and pipeline-parallel sizes;
    # the rest of the train ranks (placement.train_workers with ray.enabled) are data parallel
    megatron_tp: int = setting(1, ge=1)
    megatron_pp: int = setting(1, ge=1)
    steps: int = setting(20, ge=0)
    lr: float = setting(1e-5, gt=0)
    weight_decay: float = setting(0.0, ge=0)
    grad_clip: float = setting(1.0, gt=0)
    warmup_steps: int = setting(0, ge=0)
    lr_schedule: Literal["constant", "cosine"] = "constant"  # "constant" or "cosine" (after warm-up)
    ppo_epochs: int = setting(1, ge=1)
    mini_batch_size: int = setting(0, ge=0)
    micro_batch_size: int = setting(8, ge=1)
    # > 0: micro-batches packed longest-first up to this many computed tokens (rows x (prompt
    # width + longest response)) instead of micro_batch_size rows; the gradient is the same
    max_tokens_per_micro_batch: int = setting(0, ge=0)
    # > 0: log-probs and entropy without the [B, T, V] logits (rollkit.logprobs.lean_token_logprobs),
    # this many positions per chunk (torch engine; DeepSpeed ZeRO 0-2)
    logprob_chunk_tokens: int = setting(0, ge=0)
    # padding-free micro-batches (trainers.engines.packed): each micro-batch's real tokens run as
    # one packed row, positions and attention per sample; same log-probs and gradients. With
    # max_tokens_per_micro_batch the budget counts real tokens (first-fit decreasing bins)
    packing: bool = False
    # torch.compile each decoder layer (trainers.engines.compiled; compile_backend "inductor",
    # "aot_eager" or "eager"), and the AdamW with fused=True where the device has the kernel
    compile: bool = False
    compile_backend: Literal["inductor", "aot_eager", "eager"] = "inductor"
    fused_optimizer: bool = False
    # with model.dtype=bfloat16 / float16 on the torch engine: float32 master weights (gradients
    # accumulated and the optimizer stepped in float32; trainers.engines.precision) instead of
    # stepping the low-precision weights themselves. Needs train.autocast=off
    master_weights: bool = False
    # LoRA (peft): > 0 trains rank-r adapters only; the rollout gets the merged weights and the
    # saved model is the merged one (trainers.engines.lora). alpha 0: = rank (scale 1)
    lora_rank: int = setting(0, ge=0)
    lora_alpha: float = setting(0.0, ge=0)
    lora_dropout: float = setting(0.0, ge=0, lt=1)
    lora_targets: str = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
    # group each rank's rows into micro-batches by response length (long-tail batches pad less;
    # the gradient is the same sum up to float rounding)
    sort_by_length: bool = False
    device: str = "cpu"
    # recompute each decoder layer's activations in the backward (non-reentrant), every engine
    gradient_checkpointing: bool = False
    # train.engine=fsdp2: FSDP2's CPUOffloadPolicy (sharded parameters, gradients and optimizer
    # state live on the host; the optimizer steps there; each layer is copied in for its compute)
    fsdp2_cpu_offload: bool = False
    # Mixed precision of the torch engine's forward/backward (fp32 master weights and optimizer):
    # "off", "bfloat16", "float16", or "auto" (bfloat16 where it is fast, as rollout.dtype).
    autocast: Literal["off", "auto", "bfloat16", "float16"] = "off"


# --------------------------------------------------------------------------- checks across fields


def parse_length_dist(spec: str) -> tuple[float, float] | None:
    """``rollout.length_dist``: ``""`` (None) or ``"lognormal:MEDIAN:SIGMA"`` -> ``(median, sigma)``."""
    if not spec:
        return None
    parts = spec.split(":")
    try:
        if parts[0] != "lognormal" or len(parts) != 3:
            raise ValueError
        median, sigma = float(parts[1]), float(parts[2])
    except ValueError:
        raise ValueError(
            f"rollout.length_dist: expected '' or 'lognormal:MEDIAN:SIGMA', got {spec!r}"
        ) from None
    if not (median >= 1 and sigma >= 0 and math.isfinite(median) and math.isfinite(sigma)):
        raise ValueError(f"rollout.length_dist: need MEDIAN >= 1 and SIGMA >= 0, got {spec!r}")
    return median, sigma


def server_addresses(spec: str) -> list[str]:
    """``rollout.servers`` as a list of ``http://host:port`` addresses (``""``: none)."""
    out = []
    for part in (p.strip() for p in str(spec).split(",")):
        if not part:
            continue
        scheme, _, rest = part.partition("://")
        host, _, port = rest.rstrip("/").rpartition(":")
        if scheme not in ("http", "https") or not host or not port.isdigit():
            raise ValueError(
                f"rollout.servers: expected comma-separated http://host:port addresses, got {part!r}"
            )
        out.append(part.rstrip("/"))
    return out


def check_model_path(path: str, name: str = "model.path") -> None:
    """A local directory, a hub name, or one of the built-in names (``""``, ``tiny``, a tiny VLM)."""
    if path not in ("", "tiny", *TINY_VLM_NAMES) and not Path(path).exists() and not is_hub_id(path):
        raise ValueError(
            f"{name}: {path} does not exist (give a local HF checkpoint directory, a hub name "
            "such as Qwen/Qwen2.5-0.5B-Instruct, or '' / tiny)"
        )


def refuse_unless(table: EngineTable, name: str, capability: str, field_: str, *, train: Any = None) -> None:
    """Raise ``ValueError`` naming ``field_`` where engine ``name`` lacks ``capability``."""
    if not table.supports(name, capability, train=train):
        note = table[name].notes.get(capability)
        raise ValueError(f"{field_}: not supported by {table.field}={name}" + (f" ({note})" if note else ""))


def check_rollout_engine(r: RolloutEngineConfig, engine: str) -> None:
    """The server fields and tensor parallelism against ``engine``'s capabilities."""
    server_addresses(r.servers)
    spec = ROLLOUT_ENGINES[engine]
    if r.servers and not spec.remote:
        raise ValueError(
            f"rollout.servers is set but rollout.engine={engine!r}: set rollout.engine="
            f"{ROLLOUT_ENGINES.having(lambda s: s.remote)}"
        )
    if r.tensor_parallel_size > 1 and not spec.tensor_parallel:
        raise ValueError(
            f"rollout.tensor_parallel_size={r.tensor_parallel_size}: "
            f"{spec.notes.get('tensor_parallel', f'rollout.engine={engine} runs on one device')}; use rollout.engine={ROLLOUT_ENGINES.having(lambda s: s.tensor_parallel)}, or tensor_parallel_size=1"
        )


def check_remote_rollout(cfg: Any, num_engines: int = 1) -> None:
    """An engine that drives inference servers runs in the trainer's process, one over all servers."""
    if not ROLLOUT_ENGINES[cfg.rollout.engine].remote:
        return
    if cfg.ray.enabled:
        raise ValueError(
            f"rollout.engine={cfg.rollout.engine}: the inference servers are the rollout workers "
            "(rollout.num_servers or rollout.servers); set ray.enabled=false"
        )
    if num_engines != 1:
        raise ValueError(
            f"asynchronous.num_engines={num_engines}: with rollout.engine={cfg.rollout.engine} one engine "
            "routes over all servers; set rollout.num_servers (or rollout.servers) instead"
        )


def check_rollout_placement(cfg: Any) -> None:
    """``rollout.tensor_parallel_size`` on Ray and ``placement.offload_train`` (every trainer)."""
    r, p = cfg.rollout, cfg.placement
    gpus = p.gpus_per_worker or 0
    if r.tensor_parallel_size > 1 and cfg.ray.enabled and gpus < r.tensor_parallel_size:
        raise ValueError(
            f"rollout.tensor_parallel_size={r.tensor_parallel_size}: each Ray rollout actor needs that many "
            f"GPUs in its bundle; set placement.gpus_per_worker >= {r.tensor_parallel_size} (got {p.gpus_per_worker})"
        )
    if p.offload_train and cfg.ray.enabled and p.mode != "colocated":
        raise ValueError(
            f"placement.offload_train: applies to placement.mode=colocated (the train actors share the rollout's "
            f"devices), got placement.mode={p.mode!r}"
        )


def check_rlvr_rollout(cfg: Any) -> None:
    """``rollout.lora_weights`` and ``rollout.length_dist`` of the RLVR configs."""
    r, t = cfg.rollout, cfg.train
    if r.lora_weights == "adapter" and not t.lora_rank:
        raise ValueError("rollout.lora_weights=adapter: needs a LoRA policy (train.lora_rank > 0)")
    if r.lora_weights == "adapter" and not ROLLOUT_ENGINES.supports(r.engine, "lora_adapter"):
        raise ValueError(
            f"rollout.lora_weights=adapter: served unmerged by rollout.engine={ROLLOUT_ENGINES.having(lambda s: s.lora_adapter)}, "
            f"not rollout.engine={r.engine!r}; use lora_weights=merged"
        )
    if r.lora_weights == "adapter" and cfg.placement.sleep_level == 2:
        raise ValueError(
            "placement.sleep_level=2 discards the rollout's base weights, which rollout.lora_weights=adapter "
            "does not resend: use sleep_level=1 or lora_weights=merged"
        )
    parse_length_dist(r.length_dist)


def _check_lora(t: TrainConfig, critic_engine: str) -> None:
    """``train.lora_*`` against the engines that train them."""
    if not t.lora_rank:
        return
    refuse_unless(TRAIN_ENGINES, t.engine, "lora", "train.lora_rank", train=t)
    if not [s for s in t.lora_targets.split(",") if s.strip()]:
        raise ValueError("train.lora_targets: name at least one module (comma-separated), e.g. q_proj,v_proj")
    if critic_engine:
        refuse_unless(TRAIN_ENGINES, critic_engine, "critic_lora", "critic.engine", train=t)


def _check_model_parallel(cfg: Any, critic_engine: str | None) -> None:
    """``train.megatron_tp`` / ``megatron_pp`` and what a model-parallel engine does not do."""
    t = cfg.train
    n = t.megatron_tp * t.megatron_pp
    if critic_engine:
        refuse_unless(TRAIN_ENGINES, critic_engine, "critic", "critic.engine")
    spec = TRAIN_ENGINES[t.engine]
    if not spec.model_parallel:
        if n > 1:
            raise ValueError(
                f"train.megatron_tp / megatron_pp: apply to train.engine={TRAIN_ENGINES.having(lambda s: s.model_parallel)}, "
                f"got {t.engine!r}"
            )
        return
    ray, workers = getattr(cfg, "ray", None), getattr(getattr(cfg, "placement", None), "train_workers", 1)
    if n > 1 and not (ray is not None and ray.enabled and workers % n == 0):
        raise ValueError(
            f"train.megatron_tp x megatron_pp = {n} ranks: needs ray.enabled=true and placement.train_workers "
            f"a multiple of {n} (got {workers}; in one process the world is one rank)"
        )


def check_autocast(t: TrainConfig) -> None:
    """An explicit ``train.autocast`` against the engine (any device, CUDA only, or its own mode)."""
    if t.autocast not in ("bfloat16", "float16"):
        return
    spec = TRAIN_ENGINES[t.engine]
    note = spec.notes.get("autocast", "")
    if spec.autocast == "none":
        raise ValueError(
            f"train.autocast={t.autocast} applies to train.engine="
            f"{TRAIN_ENGINES.having(lambda s: s.autocast != 'none')}; "
            f"with train.engine={t.engine} {note or 'set train.autocast=off'}"
        )
    if spec.autocast == "cuda" and not t.device.startswith("cuda"):
        raise ValueError(
            f"train.autocast={t.autocast}: {note or 'autocast on CUDA only'}; on train.device={t.device} use "
            "train.autocast=off or auto, or model.dtype=bfloat16"
        )


def check_train(cfg: Any, critic_engine: str | None = None) -> None:
    """The ``train`` section against its engine's capabilities (and the critic's, ``critic_engine``:
    None without a critic): LoRA, master weights, the lean head, autocast, offload, model parallelism."""
    t = cfg.train
    _check_lora(t, critic_engine or "")
    if t.fsdp2_cpu_offload and not any(
        TRAIN_ENGINES.supports(e, "cpu_offload") for e in (t.engine, critic_engine) if e
    ):
        raise ValueError(
            f"train.fsdp2_cpu_offload: FSDP2's CPUOffloadPolicy needs train.engine={TRAIN_ENGINES.having(lambda s: s.cpu_offload)}, "
            f"got {t.engine!r} (DeepSpeed offloads through ds_config's offload_param / offload_optimizer)"
        )
    if t.logprob_chunk_tokens:
        refuse_unless(TRAIN_ENGINES, t.engine, "lean_head", "train.logprob_chunk_tokens", train=t)
    if t.master_weights and (
        not TRAIN_ENGINES.supports(t.engine, "master_weights")
        or cfg.model.dtype not in ("bfloat16", "float16")
    ):
        raise ValueError(
            f"train.master_weights: needs train.engine={TRAIN_ENGINES.having(lambda s: s.master_weights)} and model.dtype="
            "bfloat16 or float16 (DeepSpeed's bf16 mode and FSDP2's mixed_precision keep float32 masters themselves)"
        )
    if t.master_weights and t.autocast != "off":
        raise ValueError(
            "train.master_weights: the parameters are already low precision; set train.autocast=off"
        )
    _check_model_parallel(cfg, critic_engine)
    for field_, value, capability in (
        ("train.packing", t.packing, "packing"),
        ("train.compile", t.compile, "compile"),
    ):
        if value:
            refuse_unless(TRAIN_ENGINES, t.engine, capability, field_)
    if cfg.model.path in TINY_VLM_NAMES:
        refuse_unless(TRAIN_ENGINES, t.engine, "vision", f"model.path={cfg.model.path}")
    check_autocast(t)
    check_model_path(cfg.model.path)
