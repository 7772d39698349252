"""Typed configuration of the reference trainers: dataclasses, YAML files, command-line overrides.

Every field has a type and a default. :func:`load_config` builds a :class:`Config` from an
optional YAML file (``--config file.yaml``) and then applies overrides, in order, written as
verl / ROLL users expect::

    train.lr=1e-5  --algorithm.advantage grpo  --rollout.n=8  algorithm.policy_loss_kwargs='{clip_high: 0.28}'

Values are parsed as YAML scalars (``1e-5``, ``true``, ``null``, ``[1, 2]``, ``{a: 1}``) and
then checked against the field's type; a wrong key or value raises ``ValueError`` naming the
field. Short aliases: ``--model PATH`` is ``model.path``, ``--data FILE`` is
``data.train_file``, ``--rollout NAME`` is ``rollout.engine``, ``--train NAME`` is
``train.engine``; ``--ray`` (no value) is ``ray.enabled=true`` and ``--ray-address ADDR`` is
``ray.enabled=true ray.address=ADDR`` (``""``: a local ``ray.init()``; ``auto`` or
``host:port``: an existing cluster). ``--help`` lists every field with its type and default
(:func:`help_text`).

>>> cfg = load_config(["train.lr=3e-4", "--algorithm.advantage", "rloo", "--model", "tiny"])
>>> cfg.train.lr, cfg.algorithm.advantage, cfg.model.path
(0.0003, 'rloo', 'tiny')
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

from rollkit.registry import ADVANTAGE_ESTIMATORS, AGGREGATIONS, KL_ESTIMATORS, POLICY_LOSSES
from trainers.models import is_hub_id
from trainers.vision import checkpoint_config, is_vision_checkpoint

__all__ = [
    "ALIASES",
    "AgenticConfig",
    "AgenticEvalConfig",
    "AgenticRolloutConfig",
    "RolloutEngineConfig",
    "EnvConfig",
    "WarmupConfig",
    "validate",
    "validate_agentic",
    "validate_async",
    "AlgorithmConfig",
    "AsyncConfig",
    "CheckpointConfig",
    "Config",
    "CriticConfig",
    "CRITIC_ADVANTAGES",
    "critic_needed",
    "DataConfig",
    "EvalConfig",
    "FilterConfig",
    "KLConfig",
    "LoggingConfig",
    "ModelConfig",
    "PlacementConfig",
    "RayConfig",
    "RewardConfig",
    "RolloutConfig",
    "TailBatchingConfig",
    "TrainConfig",
    "apply_overrides",
    "check_registry_kwargs",
    "config_to_dict",
    "help_text",
    "parse_length_dist",
    "server_addresses",
    "load_config",
    "parse_args",
]


@dataclass
class ModelConfig:
    """The policy. ``path``: an HF causal-LM directory; ``""`` = the embedded default
    (SmolLM2-135M-Instruct, :func:`trainers.models.default_model_path`); ``"tiny"`` = a random
    tiny Qwen2 with the character tokenizer (tests); ``"tiny_vl"`` = a random tiny Qwen2-VL
    (:func:`trainers.vision.tiny_qwen2_vl`), ``"tiny_idefics3"`` a tiny Idefics3 / SmolVLM. A vision-language checkpoint (its config has a
    ``vision_config``: Qwen2-VL, Qwen2.5-VL...) loads with its processor; prompts may then carry
    images (:mod:`trainers.vision`)."""

    path: str = ""
    dtype: str = "float32"
    tiny_seed: int = 0
    # attention heads of the tiny model (hidden size 64); 0: 4 heads (head size 16), or 2 (head size
    # 32) when rollout.engine is vllm or server, whose CPU attention has no head size 16
    tiny_heads: int = 0
    tiny_kv_heads: int = 2
    # a vision-language model: freeze its image tower and projector (false: train them too)
    freeze_vision: bool = True


@dataclass
class DataConfig:
    """Prompts: a JSONL / Parquet file (verl-style fields) or a procedural task."""

    # procedural task when train_file is empty: "addition", or "shapes" (images: trainers.domains.shapes_task)
    task: str = "addition"
    digits: int = 2  # operand digits of the addition task (1 or 2)
    train_file: str = ""  # JSONL, Parquet, a datasets directory (save_to_disk) or a hub dataset name
    eval_file: str = ""
    train_split: str = "train"  # the split of a datasets directory / hub dataset
    eval_split: str = "test"
    eval_size: int = 100  # held-out prompts (procedural task)
    chat_template: str = "auto"  # "auto": use the tokenizer's chat template if it has one; "on"; "off"
    # several domains in one run (docs/domains.md; ROLL's domain_interleave_probs): a mapping
    # name -> {weight, task | train_file, verifier, ...} (keys: DOMAIN_KEYS). Each step draws an
    # exact integer quota of prompts per domain from the weights; each domain's verifier scores
    # its prompts. {}: one domain (task / train_file and reward.verifier above)
    domains: dict = field(default_factory=dict)


@dataclass
class RolloutEngineConfig:
    """The rollout engine's settings for ``rollout.engine`` vllm and server, shared by the RLVR
    (:class:`RolloutConfig`) and agentic (:class:`AgenticRolloutConfig`) configs."""

    gpu_memory_utilization: float = 0.5  # vLLM on GPUs
    # vLLM's tensor parallelism: each rollout engine (or local vllm serve) shards the model over
    # this many devices (LLM(tensor_parallel_size=...), --tensor-parallel-size). hf: 1 only
    tensor_parallel_size: int = 1
    max_model_len: int | None = None  # vLLM: longest prompt + response (None: the model's)
    # rollout.engine=server (docs/server.md): comma-separated http://host:port of running vllm
    # servers; "" starts num_servers local ones (logs and weight files in server_dir, "" = a temp dir)
    servers: str = ""
    num_servers: int = 1
    server_dir: str = ""
    server_timeout_s: float = 30.0  # each control call (health, models, abort, weights)
    server_request_timeout_s: float = 300.0  # the longest wait for a request's next token
    server_startup_timeout_s: float = 600.0  # local servers: until all answer /health
    server_kv_cache_gib: int = 1  # local servers on CPU: VLLM_CPU_KVCACHE_SPACE
    prompts_per_request: int = 1  # Ray: prompts per request sent to the least-loaded rollout actor


@dataclass
class RolloutConfig(RolloutEngineConfig):
    """Sampling. ``prompts_per_step`` x ``n`` samples make the batch of one step."""

    engine: str = "hf"  # "hf" (transformers), "vllm" (in process) or "server" (vllm serve over HTTP)
    prompts_per_step: int = 4
    n: int = 8
    temperature: float = 0.7
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 12
    max_batch_size: int | None = None
    # Rollout weights' dtype: "" = model.dtype; "float32" / "bfloat16" / "float16"; "auto" =
    # bfloat16 where its matmuls are fast (CUDA with bf16, CPUs with AMX), else model.dtype.
    dtype: str = ""
    # W1 long-tail workload: per-request max_tokens ~ "lognormal:MEDIAN:SIGMA" capped at max_tokens,
    # generated with ignore_eos ("": every request may use max_tokens and stops at EOS)
    length_dist: str = ""
    # request-level hf engine (async, tail batching, length_dist): tokens a request advances per step
    chunk_tokens: int = 16
    # with train.lora_rank > 0: what the rollout engine receives after each update: "merged"
    # (the full weights W + scale * B A, any engine) or "adapter" (only the LoRA tensors, served
    # by vLLM's LoRA support as a new adapter per version; rollout.engine=vllm)
    lora_weights: str = "merged"
    # an injected training-inference mismatch for experiments (benchmarks/bench_correction.py):
    # > 0: the rollout engine samples at this temperature while the trainer's log-probs use
    # rollout.temperature. 0: off (both sides use rollout.temperature)
    engine_temperature: float = 0.0


@dataclass
class TrainConfig:
    """Optimisation. ``steps`` RL steps, each ``ppo_epochs`` passes over the batch in
    micro-batches of ``micro_batch_size`` sequences, one optimizer step per
    ``mini_batch_size`` sequences (``0``: the whole batch)."""

    engine: str = "torch"  # "torch" (plain PyTorch), "deepspeed", "fsdp2" (torch fully_shard) or "megatron"
    zero_stage: int = 2  # DeepSpeed ZeRO stage (0-3)
    # train.engine=megatron (Megatron-Core; docs/megatron.md): tensor- and pipeline-parallel sizes;
    # the rest of the train ranks (placement.train_workers with ray.enabled) are data parallel
    megatron_tp: int = 1
    megatron_pp: int = 1
    steps: int = 20
    lr: float = 1e-5
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    warmup_steps: int = 0
    lr_schedule: str = "constant"  # "constant" or "cosine" (after warm-up)
    ppo_epochs: int = 1
    mini_batch_size: int = 0
    micro_batch_size: int = 8
    # > 0: micro-batches packed longest-first up to this many computed tokens (rows x (prompt
    # width + longest response)) instead of micro_batch_size rows; the gradient is the same
    max_tokens_per_micro_batch: int = 0
    # > 0: log-probs and entropy without the [B, T, V] logits (rollkit.logprobs.lean_token_logprobs),
    # this many positions per chunk (torch engine; DeepSpeed ZeRO 0-2)
    logprob_chunk_tokens: int = 0
    # padding-free micro-batches (trainers.engines.packed): each micro-batch's real tokens run as
    # one packed row, positions and attention per sample; same log-probs and gradients. With
    # max_tokens_per_micro_batch the budget counts real tokens (first-fit decreasing bins)
    packing: bool = False
    # torch.compile each decoder layer (trainers.engines.compiled; compile_backend "inductor",
    # "aot_eager" or "eager"), and the AdamW with fused=True where the device has the kernel
    compile: bool = False
    compile_backend: str = "inductor"
    fused_optimizer: bool = False
    # with model.dtype=bfloat16 / float16 on the torch engine: float32 master weights (gradients
    # accumulated and the optimizer stepped in float32; trainers.engines.precision) instead of
    # stepping the low-precision weights themselves. Needs train.autocast=off
    master_weights: bool = False
    # LoRA (peft): > 0 trains rank-r adapters only; the rollout gets the merged weights and the
    # saved model is the merged one (trainers.engines.lora). alpha 0: = rank (scale 1)
    lora_rank: int = 0
    lora_alpha: float = 0.0
    lora_dropout: float = 0.0
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
    autocast: str = "off"


@dataclass
class KLConfig:
    """KL to the frozen initial policy: ``coef == 0`` disables it (no reference model)."""

    coef: float = 0.0
    estimator: str = "k3"  # a name of rollkit.registry.KL_ESTIMATORS
    mode: str = "loss"  # "loss": a regularizer term; "reward": a per-sequence reward penalty
    # > 0: the adaptive KL controller of Ziegler et al. 2019 (rollkit.losses.kl.AdaptiveKLController;
    # ROLL target_kl, verl algorithm.kl_ctrl.type=adaptive + kl_ctrl.target_kl): after each step
    # coef <- coef * (1 + clip(kl / target - 1, -0.2, 0.2) * batch_size / horizon), kl the measured
    # token-mean KL (kl/rollout). Needs mode=reward and coef > 0 (as in ROLL and verl). 0: fixed coef
    target: float = 0.0
    horizon: float = 10000.0  # the controller's horizon in samples (ROLL kl_horizon, verl kl_ctrl.horizon)


@dataclass
class CorrectionConfig:
    """``algorithm.correction``: the training-inference mismatch correction of
    :mod:`rollkit.correction` (docs/correction.md), the same for the sync, async and agentic
    loops. Three policies: behaviour (the rollout engine's log-probs), old / proximal (the
    trainer's recomputation before the update) and current."""

    # recompute the old log-probs on the trainer before the update (verl's default), so the PPO
    # ratio never mixes in the engine's numerics; the engine's log-probs become the behaviour
    # ones. Implied by level != "off". (Asynchronous runs: asynchronous.recompute_logprobs.)
    recompute_old: bool = False
    level: str = "off"  # "off", "token", "sequence", "geometric" or "segment" (agentic: per turn)
    truncate: float = 2.0  # cap C of the weight pi_old / mu (TIS); 0: no truncation
    mask_low: float = 0.0  # rejection: drop tokens (rows) whose weight is below this; 0: off
    mask_high: float = 0.0  # ... or above this; 0: off
    seq_k3_max: float = 0.0  # rejection of rows whose mean K3 divergence exceeds this; 0: off
    reject: str = "token"  # level=token: "token" drops the token, "sequence" the whole row
    metrics: bool = True  # mismatch/* every step (behaviour vs the trainer's log-probs)


@dataclass
class AlgorithmConfig:
    """The rollkit primitives, chosen by registry name, and their keyword arguments (``*_kwargs``,
    checked against the registered function's signature at parse time: :func:`check_registry_kwargs`)."""

    advantage: str = "grpo"
    advantage_kwargs: dict = field(default_factory=dict)
    policy_loss: str = "ppo"
    policy_loss_kwargs: dict = field(default_factory=dict)
    aggregation: str = "token-mean"
    entropy_coef: float = 0.0
    reward_normalizer: bool = False  # running reward standardisation before the advantages
    # standardise the rewards over the batch, (r - mean) / (std + eps), before the advantages
    # (REINFORCE++ / ROLL's batch reward norm; rollkit.rewards.normalize_rewards). With
    # data.domains both normalisations (and their statistics) are per domain
    batch_reward_norm: bool = False
    # > 0: clamp each sequence reward to [-reward_clip, reward_clip] after the KL penalty and the
    # normaliser, before the advantages (ROLL reward_clip; rollkit.rewards.clip_rewards). 0: off
    reward_clip: float = 0.0
    # whiten the token advantages over the batch's response tokens, (A - mean) / sqrt(var + eps)
    # (ROLL whiten_advantages; rollkit.ops.masked_whiten), before advantage_clip
    whiten_advantages: bool = False
    # > 0: clamp each advantage to [-advantage_clip, advantage_clip] (ROLL advantage_clip;
    # rollkit.rewards.clip_advantages). 0: off
    advantage_clip: float = 0.0
    kl: KLConfig = field(default_factory=KLConfig)
    correction: CorrectionConfig = field(default_factory=CorrectionConfig)


#: the ``algorithm.advantage`` values that train with a learned critic (the loops then build the
#: critic role and compute values for every batch)
CRITIC_ADVANTAGES = ("gae", "asyppo")


@dataclass
class CriticConfig:
    """The learned critic of ``algorithm.advantage=gae`` (PPO) or ``asyppo`` (AsyPPO's
    mini-critics): a value model, its optimizer and its update (docs/ppo.md)."""

    # the value model: "" = the policy's checkpoint (model.path, or the tiny model) with a scalar
    # head on the final hidden states; else a Hugging Face checkpoint directory (a causal LM, or a
    # critic saved by a previous run: AutoModelForTokenClassification with one label)
    model_path: str = ""
    engine: str = ""  # "" = train.engine; "torch", "deepspeed" (train.zero_stage) or "fsdp2"
    lr: float = 1e-5  # its own AdamW learning rate (ROLL and verl train the critic faster than the actor)
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    lr_warmup_steps: int = 0  # linear LR warm-up over this many critic optimizer steps
    lr_schedule: str = "constant"  # "constant" or "cosine" (over train.steps, after the warm-up)
    value_clip: float = 0.5  # clip the value update to old +- value_clip (verl cliprange_value); 0: plain MSE
    value_coef: float = 0.5  # the loss coef * max((V - R)^2, (V_clip - R)^2) (rollkit.losses.value_loss)
    # the first warmup_steps RL steps train the critic alone (the policy is not updated; ROLL critic_warmup)
    warmup_steps: int = 0
    # AsyPPO: the number of mini-critics (0: 1 for gae, 2 for asyppo, as in the paper); each trains
    # on its own shard of every batch and the values are their mean
    num_critics: int = 0
    shard_level: str = "response"  # AsyPPO shards: "response" (within each prompt, the paper's) or "prompt"
    # AsyPPO (rollkit.critics.disagreement_masks): the fraction of the batch's response tokens whose
    # advantage is masked, lowest inter-critic std first (the paper's k), and the fraction left out of
    # the entropy bonus, highest std first (its h; acts when algorithm.entropy_coef > 0)
    advantage_mask_frac: float = 0.2
    entropy_filter_frac: float = 0.2
    ppo_epochs: int = 0  # 0: train.ppo_epochs (the critic's micro-batching is the policy's: train.*)
    # whiten the GAE advantages over the batch's response tokens (verl's GAE always does; ROLL's PPO
    # configs set whiten_advantages), before AsyPPO's mask; algorithm.whiten_advantages is the same for every estimator
    whiten_advantages: bool = True


@dataclass
class FilterConfig:
    """Dynamic sampling: drop prompt groups whose rewards are all equal, and generate again
    (at most ``max_rounds`` generation rounds per step) until the batch is full."""

    zero_variance: bool = False
    max_rounds: int = 3
    # drop groups whose mean reward (pass rate) p is outside accuracy_low < p < accuracy_high and
    # generate again, like zero_variance (ROLL difficulty_mask with difficulty_low_threshold /
    # difficulty_high_threshold; rollkit.filters.accuracy_band_filter, inclusive="neither")
    accuracy_band: bool = False
    accuracy_low: float = 0.0
    accuracy_high: float = 1.0
    # no loss on samples that stopped at the length limit (finish_reason "length"): DAPO overlong
    # filtering (ROLL max_len_mask; rollkit.rewards.mask_truncated). They stay in the batch
    max_len_mask: bool = False


@dataclass
class TailBatchingConfig:
    """RollPacker tail batching in the synchronous trainer (:class:`rollkit.scheduling.
    TailBatchingPolicy`): short rounds over-provision prompts and responses, prompts that
    were still running when the quota filled wait for a long round. P0 is
    ``rollout.prompts_per_step``, R0 is ``rollout.n``; ``filter.zero_variance`` drops, rather
    than queues, deferred prompts whose rewards all agree. Needs a request-level rollout
    engine in the trainer's process (hf or vllm, not ``ray.enabled``); docs/scheduling.md."""

    enabled: bool = False
    eta_prompts: float = 1.25  # a short round launches ceil(eta_prompts * prompts_per_step) prompts
    eta_responses: float = 1.25  # each asking for ceil(eta_responses * n) responses


@dataclass
class AsyncConfig:
    """Asynchronous training (ROLL Flash): rollout keeps generating into a
    :class:`rollkit.buffer.SampleBuffer` while the trainer trains (:mod:`trainers.loops.asynchronous`)."""

    enabled: bool = False
    ratio: float = 1.0  # async ratio alpha: samples started by policies at most ceil(alpha) versions old
    extra_prompts: int = 0  # over-provisioning: prompts running beyond ceil((1 + alpha) * prompts_per_step)
    in_flight: str = "keep"  # at a weight update: "keep" partial samples and resubmit them, or "abort"
    replicate: bool = True  # prompt replication: one request per sample (else one request per prompt)
    num_engines: int = 1  # rollout engines the queue scheduler dispatches to (least loaded first)
    # recompute the batch's log-probs under the trainer's weights before the update (the
    # proximal policy); the rollout's become behavior_logprobs (decoupled PPO / TIS / CISPO / TOPR)
    recompute_logprobs: bool = True
    # a reproducible schedule: the producer runs in the trainer's thread until a batch is ready,
    # then exactly overlap_steps scheduler steps while the trainer trains (scores gathered every
    # step), so a run, and a resumed run, are bit-identical for the same seeds (one process)
    deterministic: bool = False
    overlap_steps: int = 4


@dataclass
class RewardConfig:
    """Scoring: a verifier of :data:`trainers.rewards.VERIFIERS` run by a
    :class:`~trainers.rewards.RewardPool` on each sample as soon as it is generated."""

    # "exact_match", "math_verify", "llm_judge", "code", "ifeval", "multiple_choice", "reward_model"
    verifier: str = "exact_match"
    backend: str = "inline"  # "inline", "process" or "ray"
    num_workers: int = 2  # with max_workers: the size the pool starts at and never shrinks below
    max_workers: int = 0  # > 0: the pool grows with its queue up to this many workers (0: fixed size)
    idle_s: float = 10.0  # with max_workers: a surplus worker idle this long is stopped
    timeout_s: float = 10.0  # per sample; past it the sample scores 0 (process / Ray: the worker is killed)
    # > 0: DAPO soft overlong punishment added to each reward (rollkit.rewards.overlong_penalty;
    # verl reward_model.overlong_buffer.len / penalty_factor): 0 up to rollout.max_tokens -
    # overlong_buffer tokens, then linear down to -overlong_penalty at rollout.max_tokens. 0: off
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0
    max_retries: int = 1  # a sample whose worker died is scored again on a fresh worker, this many times
    cpus_per_worker: float = 0.0  # Ray backend: CPUs each reward actor reserves
    judge_model: str = ""  # llm_judge: "" = SmolLM2-135M-Instruct, "tiny", or a HF checkpoint directory
    judge_max_tokens: int = 64  # llm_judge: the most tokens of one judgment
    judge_invalid_score: float = 0.0  # llm_judge: the reward of a malformed judgment
    # llm_judge: "http://host:port" of a running `vllm serve` judge, asked through the server
    # client with a deadline ("": the judge model runs in this process / the reward workers)
    judge_url: str = ""
    judge_timeout_s: float = 8.0  # served judge: deadline of each judgment (below reward.timeout_s)
    judge_served_model: str = ""  # served judge: the model name on the server ("": its one base model)
    # reward_model: a sequence-classification checkpoint (num_labels=1, e.g. trained by
    # recipes/reward_model.py) whose scalar score of prompt + response is the reward
    rm_path: str = ""
    rm_max_length: int = 512  # reward_model: prompt + response tokens scored (longer: truncated on the left)
    rm_batch_size: int = 8  # reward_model: responses scored per forward pass
    # code: the program runs the problem's tests in the sandbox (the problem is the prompt's answer, as JSON)
    code_mode: str = "all"  # "all": 1 if every test passes; "fraction": the share that pass
    code_timeout_s: float = 10.0  # per sandbox run (reward.timeout_s must cover every test of a sample)
    code_isolation: str = "auto"  # "auto", "bwrap" or "rlimit"
    code_memory_mb: int = 512
    code_max_procs: int = 16
    code_allow_env_secrets: bool = False  # rlimit fallback, non-root: run despite secret-like variables

    def verifier_options(self) -> dict[str, Any]:
        """Keyword options for :func:`trainers.rewards.get_verifier` (the judge's for ``llm_judge``,
        the sandbox's for ``code``)."""
        if self.verifier == "llm_judge":
            opts = {
                "judge_model": self.judge_model,
                "max_tokens": self.judge_max_tokens,
                "invalid_score": self.judge_invalid_score,
            }
            if not self.judge_url:
                return opts
            served = {"served_model": self.judge_served_model} if self.judge_served_model else {}
            return {**opts, "server_url": self.judge_url, "timeout_s": self.judge_timeout_s, **served}
        if self.verifier == "reward_model":
            return {
                "model_path": self.rm_path,
                "max_length": self.rm_max_length,
                "batch_size": self.rm_batch_size,
            }
        if self.verifier == "code":
            return {
                "mode": self.code_mode,
                "timeout_s": self.code_timeout_s,
                "isolation": self.code_isolation,
                "memory_mb": self.code_memory_mb,
                "max_procs": self.code_max_procs,
                "allow_env_secrets": self.code_allow_env_secrets,
            }
        return {}


@dataclass
class RayConfig:
    """Run the roles as Ray actors (docs/distributed.md). ``address``: ``""`` joins
    ``RAY_ADDRESS`` where it is set (``ray job submit`` sets it), else starts a new local Ray
    (``ray.init(address="local")``: the address file of an earlier ``ray start`` is ignored);
    ``"auto"`` or ``"host:port"`` joins a running cluster."""

    enabled: bool = False
    address: str = ""
    num_cpus: int | None = None  # local ray.init only (None: every core)
    object_store_mb: int = 0  # local ray.init only (0: Ray's default)
    torch_threads: int = 0  # torch threads per actor (0: the actor's CPUs, at least 1)
    # deadline of every call to an actor (a generation request, an update, a weight load): past it
    # the run stops with an error naming the actor (hung, e.g. SIGSTOP, or overloaded)
    timeout_s: float = 1800.0
    # deadline of starting the actors (processes, constructors, model loads, the process group):
    # separate, so that a short timeout_s that catches a hung step does not fail a slow start
    startup_timeout_s: float = 600.0


@dataclass
class PlacementConfig:
    """The device mapping of the Ray roles. ``colocated``: rollout, train and reference actors
    share the bundles of one placement group (the rollout sleeps while training when
    ``offload``); ``disaggregated``: every role has bundles of its own. ``strategy``: the
    placement group strategy (``""``: PACK when colocated, SPREAD when disaggregated)."""

    mode: str = "colocated"  # "colocated" or "disaggregated"
    strategy: str = ""  # "", PACK, SPREAD, STRICT_PACK, STRICT_SPREAD
    rollout_workers: int = 1
    train_workers: int = 1  # data-parallel ranks (gloo on CPU, NCCL on GPUs)
    cpus_per_worker: float = 1.0  # CPUs per bundle (colocated: shared by the bundle's actors)
    gpus_per_worker: float | None = None  # GPUs per bundle (None: 1 if the cluster has GPUs, else 0)
    reference: str = "train"  # "train": in train rank 0's bundle; "separate": a bundle of its own
    critic: str = (
        "train"  # the critic actor (algorithm.advantage gae / asyppo): "train" or "separate", as reference
    )
    offload: bool = True  # colocated: rollout.sleep() while training, wake() + update after
    sleep_level: int = 1  # 1: offload weights; 2: discard them (the update reloads them)
    # colocated (in process: always): the train engine's weights, gradients and optimizer state
    # move to the host while the rollout generates and back for the update (trainers.engines.offload)
    offload_train: bool = False
    rollout_resources: dict = field(default_factory=dict)  # custom node resources per rollout bundle
    train_resources: dict = field(default_factory=dict)  # custom node resources per train bundle


@dataclass
class EvalConfig:
    """Greedy held-out accuracy before training, every ``every`` steps (0: never) and after."""

    every: int = 10
    max_tokens: int = 12
    before: bool = True
    # > 1: also sample n responses per held-out prompt at `temperature` and report pass@k and
    # mean@k (Chen et al. 2021's unbiased estimator) for each k of `k`, per domain. 1: greedy only
    n: int = 1
    temperature: float = 1.0
    k: list = field(default_factory=list)  # the k of pass@k / mean@k ([]: 1 and n)


@dataclass
class CheckpointConfig:
    """``dir`` empty: no checkpoints. ``resume``: a checkpoint directory, or ``"auto"`` (the
    latest under ``dir``). ``keep > 0``: after each save only the newest ``keep`` ``step_<k>``
    directories under ``dir`` stay (never the one just written, never the one ``resume`` names)."""

    dir: str = ""
    every: int = 0
    resume: str = ""
    keep: int = 0  # 0: keep every checkpoint


@dataclass
class LoggingConfig:
    """Metrics go to ``<dir>/metrics.jsonl`` always, TensorBoard and a PNG plot when the
    packages are installed."""

    dir: str = "runs/rlvr"
    tensorboard: bool = True
    plot: bool = True
    progress: bool = True
    save_model: bool = True  # the trained policy as a HF model directory: <dir>/model (and per checkpoint)
    wandb: bool = False  # Weights & Biases (offline unless logging.online): <dir>/wandb
    swanlab: bool = False  # SwanLab (offline unless logging.online)
    online: bool = False  # let W&B / SwanLab sync to their servers
    project: str = "rollkit"  # the W&B / SwanLab project
    run_name: str = ""  # "" : the trackers' own naming


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    filter: FilterConfig = field(default_factory=FilterConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    tail_batching: TailBatchingConfig = field(default_factory=TailBatchingConfig)
    asynchronous: AsyncConfig = field(default_factory=AsyncConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    seed: int = 0


# --------------------------------------------------------------------------- the agentic trainer


@dataclass
class EnvConfig:
    """The environment: a registered name (``frozenlake``, ``sokoban``, ``calculator``,
    ``gem:<id>``) or ``"module:attr"``, its keyword arguments, and the episode limits."""

    name: str = "frozenlake"
    kwargs: dict = field(default_factory=lambda: {"size": 3, "hole_prob": 0.0, "max_turns": 6})
    max_turns: int = 6
    max_context: int = 1024  # tokens per episode, prompt included
    chat_template: str = "auto"  # "auto" (if the tokenizer has one), "on", "off"
    system_prompt: str = ""
    deadline_s: float = 30.0  # per reset / step; past it the env counts as hung and is replaced
    start_method: str = "forkserver"


@dataclass
class AgenticRolloutConfig(RolloutEngineConfig):
    """Sampling and scheduling. A step trains ``groups_per_step x group_size`` trajectories;
    ``async`` launches ``num_env_groups`` task groups (``0``: ``groups_per_step``) of
    ``group_size + redundancy`` episodes and keeps the first finishers."""

    engine: str = "hf"  # "hf" (transformers), "vllm" (in process) or "server" (vllm serve over HTTP)
    mode: str = "async"  # "lockstep" or "async"
    # "trajectory": an episode is one sequence (its horizon ends at env.max_context); "turn": each
    # turn is a sample of its own, its context the window of the last env.max_context - max_tokens
    # tokens (the prompt + the most recent whole action/observation pairs): long horizons
    sample_per: str = "trajectory"
    groups_per_step: int = 4
    group_size: int = 4
    num_env_groups: int = 0
    redundancy: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16  # per turn
    max_batch_size: int | None = None
    # rollout weights' dtype: "" = model.dtype; "auto" = bfloat16 where its matmuls are fast
    # (CUDA with bf16, CPUs with AMX), else model.dtype; or "float32" / "bfloat16" / "float16"
    dtype: str = ""
    max_staleness: int = 0  # 0: synchronous; >= 1: overlap collection with training, per-turn bound
    max_attempts: int = 0  # episodes launched per group before it is abandoned (0: 3 x launched)
    # an injected training-inference mismatch for experiments: > 0: the rollout engine samples
    # at this temperature while the trainer's log-probs use rollout.temperature. 0: off
    engine_temperature: float = 0.0


@dataclass
class WarmupConfig:
    """Optional supervised warm-up on well-formed random actions (teaches a tiny random model
    the action format, so that RL has successes to learn from). ``steps = 0``: off."""

    steps: int = 0
    batch_size: int = 16
    lr: float = 3e-3
    bare: bool = False  # target the action without \\boxed{} (the built-in games accept a bare word)


@dataclass
class AgenticEvalConfig:
    """Greedy success rate on ``episodes`` fixed tasks (seeds ``seed .. seed + episodes - 1``,
    disjoint from the training seeds), before training, every ``every`` steps and after."""

    episodes: int = 32
    every: int = 0
    before: bool = True
    max_tokens: int = 16
    seed: int = 1_000_000_000


def _agentic_algorithm() -> AlgorithmConfig:
    a = AlgorithmConfig()
    a.advantage = "starpo"
    return a


def _agentic_logging() -> LoggingConfig:
    log = LoggingConfig()
    log.dir = "runs/agentic"
    return log


@dataclass
class AgenticConfig:
    """The agentic trainer's configuration (:class:`trainers.loops.AgenticTrainer`); load it
    with ``load_config(argv, base=AgenticConfig())``. It shares the ``model``, ``train``,
    ``algorithm`` and ``logging`` sections with :class:`Config`."""

    model: ModelConfig = field(default_factory=ModelConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    rollout: AgenticRolloutConfig = field(default_factory=AgenticRolloutConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    algorithm: AlgorithmConfig = field(default_factory=_agentic_algorithm)
    critic: CriticConfig = field(default_factory=CriticConfig)
    warmup: WarmupConfig = field(default_factory=WarmupConfig)
    eval: AgenticEvalConfig = field(default_factory=AgenticEvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=_agentic_logging)
    # ray.enabled: the rollout, train and reference roles as Ray actors placed by `placement`, as in
    # the RLVR trainers (the environments stay in this process's workers)
    ray: RayConfig = field(default_factory=RayConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    seed: int = 0


#: Short command-line keys.
ALIASES = {
    "model": "model.path",
    "data": "data.train_file",
    "rollout": "rollout.engine",
    "train": "train.engine",
    "ray_address": "ray.address",
}
#: Command-line flags that take no value.
FLAGS = {"--ray": ("ray.enabled", "true")}

_NONE = (type(None),)


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "None"
    return getattr(tp, "__name__", str(tp))


def _yaml():
    try:
        import yaml
    except ImportError as e:  # pragma: no cover - pyyaml comes with transformers
        raise ImportError("YAML configs need pyyaml: pip install pyyaml") from e
    return yaml


def _convert(key: str, value: Any, tp: Any) -> Any:
    """``value`` (a string from the command line, or a YAML value) as type ``tp``."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None or (isinstance(value, str) and value.strip().lower() in ("none", "null", "~")):
            if type(None) in args:
                return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _convert(key, value, a)
            except ValueError as e:
                errors.append(str(e))
        raise ValueError(errors[0] if errors else f"{key}: cannot convert {value!r} to {_type_name(tp)}")
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise ValueError(f"{key}: expected str, got {value!r}")
    if isinstance(value, str) and tp in (int, float):
        try:
            return int(value) if tp is int else float(value)
        except ValueError:
            if tp is int:
                raise ValueError(f"{key}: expected int, got {value!r}") from None
            raise ValueError(f"{key}: expected float, got {value!r}") from None
    if isinstance(value, str) and tp is not str:
        try:
            value = _yaml().safe_load(value) if value.strip() else value
        except Exception as e:
            raise ValueError(f"{key}: cannot parse {value!r}: {e}") from None
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ValueError(f"{key}: expected bool (true/false), got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ValueError(f"{key}: expected int, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ValueError(f"{key}: expected float, got {value!r}")
    if tp is dict or origin is dict:
        if isinstance(value, dict):
            return dict(value)
        raise ValueError(f"{key}: expected a mapping such as '{{clip_high: 0.28}}', got {value!r}")
    if tp is list or origin is list:
        if isinstance(value, list):
            return list(value)
        raise ValueError(f"{key}: expected a list such as '[1, 2]', got {value!r}")
    raise ValueError(f"{key}: unsupported field type {_type_name(tp)}")  # pragma: no cover


def _field_names(obj: Any) -> list[str]:
    return [f.name for f in dataclasses.fields(obj)]


def set_value(cfg: Config, key: str, value: Any) -> None:
    """Set the dotted field ``key`` of ``cfg`` to ``value`` (converted and type-checked)."""
    parts = key.split(".")
    obj: Any = cfg
    for i, part in enumerate(parts):
        path = ".".join(parts[: i + 1])
        if not dataclasses.is_dataclass(obj) or part not in _field_names(obj):
            known = _field_names(obj) if dataclasses.is_dataclass(obj) else []
            where = ".".join(parts[:i]) or "the config"
            raise ValueError(f"{path}: unknown field of {where}; known: {', '.join(known)}")
        tp = _hints(type(obj))[part]
        if i == len(parts) - 1:
            if dataclasses.is_dataclass(tp):
                if not isinstance(value, dict):
                    raise ValueError(f"{path}: is a section; set its fields ({path}.<field>=...)")
                for k, v in value.items():
                    set_value(cfg, f"{path}.{k}", v)
                return
            setattr(obj, part, _convert(path, value, tp))
        else:
            obj = getattr(obj, part)


def apply_dict(cfg: Config, data: dict[str, Any], prefix: str = "") -> None:
    """Apply a nested mapping (a parsed YAML file) onto ``cfg``."""
    if not isinstance(data, dict):
        raise ValueError(
            f"config: expected a mapping at {prefix or 'the top level'}, got {type(data).__name__}"
        )
    for k, v in data.items():
        set_value(cfg, f"{prefix}{k}", v)


def parse_args(argv: list[str]) -> tuple[str | None, list[tuple[str, str]], bool]:
    """``(config_file, [(key, value), ...], help_requested)`` from command-line tokens."""
    config_file: str | None = None
    pairs: list[tuple[str, str]] = []
    want_help = False
    i = 0
    while i < len(argv):
        tok = argv[i]
        if tok in ("-h", "--help"):
            want_help = True
            i += 1
            continue
        if tok in FLAGS:
            pairs.append(FLAGS[tok])
            i += 1
            continue
        if tok.startswith("--"):
            body = tok[2:]
            if "=" in body:
                key, value = body.split("=", 1)
            else:
                if i + 1 >= len(argv):
                    raise ValueError(f"{body}: missing value after --{body}")
                key, value = body, argv[i + 1]
                i += 1
        elif "=" in tok:
            key, value = tok.split("=", 1)
        else:
            raise ValueError(f"argument {tok!r}: expected key=value or --key value")
        key = key.replace("-", "_") if key != "config" else key
        if key == "config":
            config_file = value
        elif key == "ray_address":  # --ray-address ADDR: use Ray, at ADDR
            pairs += [("ray.enabled", "true"), (key, value)]
        else:
            pairs.append((key, value))
        i += 1
    return config_file, pairs, want_help


def apply_overrides(cfg: Config, overrides: list[str] | list[tuple[str, str]]) -> Config:
    """Apply ``key=value`` strings (or ``(key, value)`` pairs) onto ``cfg``; returns it."""
    for o in overrides:
        if isinstance(o, str):
            if "=" not in o:
                raise ValueError(f"override {o!r}: expected key=value")
            k, v = o.split("=", 1)
        else:
            k, v = o
        k = k.strip()
        set_value(cfg, ALIASES.get(k, k), v)
    return cfg


def load_config(argv: list[str] | None = None, *, base: Config | None = None) -> Config:
    """A :class:`Config` from command-line tokens: ``--config FILE`` first, then overrides in order.

    ``--help`` raises ``SystemExit(0)`` after printing :func:`help_text`. The keyword arguments
    of the registry-named choices are then checked against the registered function's signature
    (:func:`check_registry_kwargs`), so a misspelt hyper-parameter stops here, before any model
    loads.
    """
    config_file, pairs, want_help = parse_args(list(argv or []))
    cfg = base if base is not None else Config()
    if want_help:
        print(help_text(cfg))
        raise SystemExit(0)
    if config_file:
        p = Path(config_file)
        if not p.is_file():
            raise ValueError(f"config: file not found: {config_file}")
        yaml = _yaml()
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f"{config_file} line {mark.line + 1}" if mark is not None else config_file
            raise ValueError(
                f"config: {where}: not valid YAML ({getattr(e, 'problem', None) or e})"
            ) from None
        apply_dict(cfg, data)
    apply_overrides(cfg, pairs)
    check_registry_kwargs(cfg)
    return cfg


def config_to_dict(cfg: Any) -> dict[str, Any]:
    """The config as plain nested dicts (YAML/JSON-serialisable)."""
    return dataclasses.asdict(cfg)


def save_config(cfg: Any, path: str | Path) -> Path:
    """Write the resolved config as YAML (``--config`` reads it back: the same run)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(_yaml().safe_dump(config_to_dict(cfg), sort_keys=False))
    return path


#: One-line ``--help`` descriptions (with the ROLL / verl name) of the fields that have one.
FIELD_HELP = {
    "algorithm.reward_clip": "> 0: clamp rewards to [-c, c] (ROLL reward_clip); 0: off",
    "algorithm.whiten_advantages": "whiten advantages over the batch's tokens (ROLL whiten_advantages)",
    "algorithm.advantage_clip": "> 0: clamp advantages to [-c, c] (ROLL advantage_clip); 0: off",
    "algorithm.kl.target": "> 0: adaptive KL coef, needs kl.mode=reward (ROLL target_kl, verl kl_ctrl.target_kl)",
    "algorithm.kl.horizon": "adaptive KL horizon in samples (ROLL kl_horizon, verl kl_ctrl.horizon)",
    "filter.accuracy_band": "drop groups with mean reward outside (accuracy_low, accuracy_high) (ROLL difficulty_mask)",
    "filter.accuracy_low": "accuracy band's low edge, exclusive (ROLL difficulty_low_threshold)",
    "filter.accuracy_high": "accuracy band's high edge, exclusive (ROLL difficulty_high_threshold)",
    "filter.max_len_mask": "no loss on samples cut at rollout.max_tokens (ROLL max_len_mask, DAPO overlong filtering)",
    "reward.overlong_buffer": "> 0: DAPO soft overlong punishment window (verl overlong_buffer.len); 0: off",
    "reward.overlong_penalty": "its largest penalty (verl overlong_buffer.penalty_factor)",
}


def _help_rows(obj: Any, prefix: str = "") -> list[tuple[str, str, str, str]]:
    rows = []
    for f in dataclasses.fields(obj):
        tp = _hints(type(obj))[f.name]
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(tp):
            rows.extend(_help_rows(value, f"{prefix}{f.name}."))
        else:
            name = f"{prefix}{f.name}"
            rows.append((name, _type_name(tp), repr(value), FIELD_HELP.get(name, "")))
    return rows


def help_text(cfg: Config | None = None) -> str:
    """Every field with its type and default, one per line."""
    cfg = cfg or Config()
    rows = _help_rows(cfg)
    w = max(len(r[0]) for r in rows)
    t = max(len(r[1]) for r in rows)
    alias = ", ".join(f"--{k.replace('_', '-')} = {v}" for k, v in ALIASES.items())
    alias += ", --ray = ray.enabled=true (--ray-address also sets it)"
    lines = [
        "usage: [--config FILE.yaml] [key=value | --key value] ...",
        "",
        "Dotted keys override the YAML file's values, in order; values are YAML scalars.",
        f"Aliases: {alias}.",
        "",
        f"{'field'.ljust(w)}  {'type'.ljust(t)}  default",
    ]
    d = max(len(r[2]) for r in rows if r[3]) if any(r[3] for r in rows) else 0
    for name, tp, default, desc in rows:
        line = f"{name.ljust(w)}  {tp.ljust(t)}  {default.ljust(d) if desc else default}"
        lines.append(f"{line}  {desc}" if desc else line)
    return os.linesep.join(lines)


# --------------------------------------------------------------------------- validation

ROLLOUT_ENGINES = ("hf", "vllm", "server")
TRAIN_ENGINES = ("torch", "deepspeed", "fsdp2", "megatron")
DTYPE_NAMES = ("float32", "bfloat16", "float16")
AGENTIC_MODES = ("lockstep", "async")


def _check_names(cfg: Any, rows: list[tuple[str, Any, tuple]]) -> None:
    for name, value, known in rows:
        if value not in known:
            raise ValueError(f"{name} must be one of {', '.join(map(str, known))}, got {value!r}")


def _check_registered(rows: list[tuple[str, Any, Any]]) -> None:
    for name, reg, value in rows:
        if value not in reg:
            raise ValueError(f"{name}: unknown {reg.kind} {value!r}; known: {', '.join(sorted(reg.names()))}")


def check_registry_kwargs(cfg: Any) -> None:
    """Check the keyword arguments of every registry-named choice of ``cfg`` against the
    registered function's signature (:func:`rollkit.registry.check_kwargs`), the way the
    trainers pass them: ``algorithm.policy_loss_kwargs`` to ``POLICY_LOSSES[algorithm.policy_loss]``,
    ``algorithm.advantage_kwargs`` to ``ADVANTAGE_ESTIMATORS[algorithm.advantage]`` (with a
    critic, ``gae`` / ``asyppo``, they go to the critic's GAE: :func:`validate` checks them).
    (``env.kwargs`` is not checked here: the environments are a layer above the config, and
    ``make_env`` names a bad key when the trainer builds them.) Tensor inputs that the trainer
    reads from the batch are refused as keys; a function with ``**kwargs`` takes any other.
    :func:`load_config` calls it; a bad key raises a one-line ``ValueError`` naming the field,
    the key and the accepted keys. A name that is not registered is left to :func:`validate` /
    the trainer (it may be registered after parsing), as are ``gem:`` ids and ``module:attr``
    environments.

    >>> cfg = Config()
    >>> cfg.algorithm.policy_loss_kwargs = {"clip_hihg": 0.28}
    >>> check_registry_kwargs(cfg)
    Traceback (most recent call last):
    ...
    ValueError: algorithm.policy_loss_kwargs: ppo does not take 'clip_hihg' (unknown key for the policy loss ppo_clip; accepted: clip_high, clip_low, dual_clip, log_ratio_clamp)
    """
    a = getattr(cfg, "algorithm", None)
    if isinstance(a, AlgorithmConfig):
        rows = [("algorithm.policy_loss_kwargs", POLICY_LOSSES, a.policy_loss, a.policy_loss_kwargs)]
        if not critic_needed(cfg):
            rows.append(("algorithm.advantage_kwargs", ADVANTAGE_ESTIMATORS, a.advantage, a.advantage_kwargs))
        for name, reg, value, kwargs in rows:
            if isinstance(value, str) and value in reg:
                reg.check_kwargs(value, kwargs, name)


def _check_numbers(rows: list[tuple[str, Any, str]]) -> None:
    """``(field, value, rule)`` with rule ``int>=0``, ``int>=1``, ``>0``, ``>=0`` (finite numbers) or
    ``(0,1]``: a value that breaks its rule raises ``ValueError`` naming the field."""
    for name, v, rule in rows:
        if rule.startswith("int"):
            low = int(rule[5:])
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"{name} must be an int >= {low}, got {v!r}")
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"{name} must be a finite number, got {v!r}")
        ok = {">0": v > 0, ">=0": v >= 0, "(0,1]": 0 < v <= 1}[rule]
        if not ok:
            text = {">0": "> 0", ">=0": ">= 0", "(0,1]": "in (0, 1]"}[rule]
            raise ValueError(f"{name} must be {text}, got {v!r}")


def _check_bools(rows: list[tuple[str, Any]]) -> None:
    for name, v in rows:
        if not isinstance(v, bool):
            raise ValueError(f"{name} must be true or false, got {v!r}")


def _check_train_scale(cfg: Any) -> None:
    """``train.gradient_checkpointing`` and ``train.fsdp2_cpu_offload`` (both trainers)."""
    t = cfg.train
    _check_bools([("train.gradient_checkpointing", t.gradient_checkpointing),
                  ("train.fsdp2_cpu_offload", t.fsdp2_cpu_offload)])  # fmt: skip
    critic_engine = getattr(getattr(cfg, "critic", None), "engine", "")
    if t.fsdp2_cpu_offload and "fsdp2" not in (t.engine, critic_engine):
        raise ValueError(
            f"train.fsdp2_cpu_offload: FSDP2's CPUOffloadPolicy needs train.engine=fsdp2, got {t.engine!r} "
            "(DeepSpeed offloads through ds_config's offload_param / offload_optimizer)"
        )


def _check_rollout_scale(c: Config) -> None:
    """``rollout.tensor_parallel_size`` and ``placement.offload_train``."""
    r, p = c.rollout, c.placement
    _check_numbers([("rollout.tensor_parallel_size", r.tensor_parallel_size, "int>=1")])
    if r.tensor_parallel_size > 1 and r.engine == "hf":
        raise ValueError(
            f"rollout.tensor_parallel_size={r.tensor_parallel_size}: the transformers engine (rollout.engine=hf) "
            "runs on one device; use rollout.engine=vllm or server, or tensor_parallel_size=1"
        )
    gpus = p.gpus_per_worker or 0
    if r.tensor_parallel_size > 1 and c.ray.enabled and gpus < r.tensor_parallel_size:
        raise ValueError(
            f"rollout.tensor_parallel_size={r.tensor_parallel_size}: each Ray rollout actor needs that many "
            f"GPUs in its bundle; set placement.gpus_per_worker >= {r.tensor_parallel_size} (got {p.gpus_per_worker})"
        )
    _check_bools([("placement.offload_train", p.offload_train)])
    if p.offload_train and c.ray.enabled and p.mode != "colocated":
        raise ValueError(
            f"placement.offload_train: applies to placement.mode=colocated (the train actors share the rollout's "
            f"devices), got placement.mode={p.mode!r}"
        )


def _check_lora(t: TrainConfig) -> None:
    """``train.lora_*`` against the engine."""
    if t.lora_rank and t.engine == "deepspeed" and t.zero_stage == 3:
        raise ValueError(
            "train.lora_rank: LoRA with train.engine=deepspeed needs train.zero_stage <= 2 (the merged export and "
            "the peft save read whole base and adapter weights, which ZeRO-3 keeps partitioned; not wired)"
        )
    if t.lora_rank and t.engine == "fsdp2":
        raise ValueError(
            "train.lora_rank: LoRA is wired for train.engine=torch and deepspeed (ZeRO 0-2), not fsdp2 (the merged "
            "export and the peft save read whole weights, which FSDP2 keeps as sharded DTensors; not wired)"
        )
    if t.lora_rank and not [s for s in t.lora_targets.split(",") if s.strip()]:
        raise ValueError("train.lora_targets: name at least one module (comma-separated), e.g. q_proj,v_proj")
    if t.lora_dropout >= 1:
        raise ValueError(f"train.lora_dropout must be in [0, 1), got {t.lora_dropout!r}")


def _check_master_weights(cfg: Any) -> None:
    """``train.master_weights`` needs the torch engine, low-precision weights and no autocast."""
    t = cfg.train
    if t.master_weights and (t.engine != "torch" or cfg.model.dtype not in ("bfloat16", "float16")):
        raise ValueError(
            "train.master_weights: needs train.engine=torch and model.dtype=bfloat16 or float16 "
            "(DeepSpeed's bf16 mode and FSDP2's mixed_precision keep float32 masters themselves)"
        )
    if t.master_weights and t.autocast != "off":
        raise ValueError(
            "train.master_weights: the parameters are already low precision; set train.autocast=off"
        )


def _check_megatron(cfg: Any) -> None:
    """``train.megatron_tp`` / ``megatron_pp`` and what the Megatron engine does not do."""
    t = cfg.train
    _check_numbers(
        [("train.megatron_tp", t.megatron_tp, "int>=1"), ("train.megatron_pp", t.megatron_pp, "int>=1")]
    )
    n = t.megatron_tp * t.megatron_pp
    critic = getattr(cfg, "critic", None)
    if critic is not None and getattr(cfg.algorithm, "advantage", "") in CRITIC_ADVANTAGES:
        if (critic.engine or t.engine) == "megatron":
            raise ValueError(
                "critic.engine: the Megatron engine trains the policy; set critic.engine=torch (or deepspeed)"
            )
    if t.engine != "megatron":
        if n > 1:
            raise ValueError(
                f"train.megatron_tp / megatron_pp: apply to train.engine=megatron, got {t.engine!r}"
            )
        return
    ray, workers = getattr(cfg, "ray", None), getattr(getattr(cfg, "placement", None), "train_workers", 1)
    if n > 1 and not (ray is not None and ray.enabled and workers % n == 0):
        raise ValueError(
            f"train.megatron_tp x megatron_pp = {n} ranks: needs ray.enabled=true and placement.train_workers "
            f"a multiple of {n} (got {workers}; in one process the world is one rank)"
        )
    refused = [("train.lora_rank", t.lora_rank), ("train.packing", t.packing), ("train.compile", t.compile),
               ("train.fsdp2_cpu_offload", t.fsdp2_cpu_offload)]  # fmt: skip
    for name, value in refused:
        if value:
            raise ValueError(f"{name}: not supported by train.engine=megatron (use train.engine=torch)")
    if cfg.model.path in TINY_VLM_NAMES:
        raise ValueError(
            f"model.path={cfg.model.path}: train.engine=megatron maps Llama / Qwen2 text models only"
        )
    if t.autocast in ("bfloat16", "float16") and not t.device.startswith("cuda"):
        raise ValueError(
            f"train.autocast={t.autocast}: Megatron-Core's linear layers autocast on CUDA only; on "
            f"train.device={t.device} use train.autocast=off or auto, or model.dtype=bfloat16"
        )


def _check_common(cfg: Any) -> None:
    """Checks of the sections both trainers share (model, train, algorithm, dtypes, sampling)."""
    t, r, a = cfg.train, cfg.rollout, cfg.algorithm
    _check_names(
        cfg,
        [
            ("model.dtype", cfg.model.dtype, DTYPE_NAMES),
            ("rollout.dtype", r.dtype, ("", "auto", *DTYPE_NAMES)),
            ("train.autocast", t.autocast, ("off", "auto", "bfloat16", "float16")),
            ("train.engine", t.engine, TRAIN_ENGINES),
            ("train.compile_backend", t.compile_backend, ("inductor", "aot_eager", "eager")),
            ("train.lr_schedule", t.lr_schedule, ("constant", "cosine")),
            ("train.zero_stage", t.zero_stage, (0, 1, 2, 3)),
            ("algorithm.kl.mode", a.kl.mode, ("loss", "reward")),
        ],
    )
    _check_numbers(
        [
            ("train.steps", t.steps, "int>=0"),
            ("train.lr", t.lr, ">0"),
            ("train.weight_decay", t.weight_decay, ">=0"),
            ("train.grad_clip", t.grad_clip, ">0"),
            ("train.warmup_steps", t.warmup_steps, "int>=0"),
            ("train.ppo_epochs", t.ppo_epochs, "int>=1"),
            ("train.mini_batch_size", t.mini_batch_size, "int>=0"),
            ("train.micro_batch_size", t.micro_batch_size, "int>=1"),
            ("train.max_tokens_per_micro_batch", t.max_tokens_per_micro_batch, "int>=0"),
            ("train.logprob_chunk_tokens", t.logprob_chunk_tokens, "int>=0"),
            ("train.lora_rank", t.lora_rank, "int>=0"),
            ("train.lora_alpha", t.lora_alpha, ">=0"),
            ("train.lora_dropout", t.lora_dropout, ">=0"),
            ("rollout.temperature", r.temperature, ">0"),
            ("rollout.top_p", r.top_p, "(0,1]"),
            ("rollout.max_tokens", r.max_tokens, "int>=1"),
            ("algorithm.entropy_coef", a.entropy_coef, ">=0"),
            ("algorithm.kl.coef", a.kl.coef, ">=0"),
            ("algorithm.kl.target", a.kl.target, ">=0"),
            ("algorithm.kl.horizon", a.kl.horizon, ">0"),
            ("algorithm.reward_clip", a.reward_clip, ">=0"),
            ("algorithm.advantage_clip", a.advantage_clip, ">=0"),
            ("model.tiny_heads", cfg.model.tiny_heads, "int>=0"),
            ("model.tiny_kv_heads", cfg.model.tiny_kv_heads, "int>=1"),
        ]
    )
    if r.top_k != -1 and (isinstance(r.top_k, bool) or r.top_k < 0):
        raise ValueError(f"rollout.top_k must be -1 or 0 (off) or a positive int, got {r.top_k!r}")
    if r.max_batch_size is not None:
        _check_numbers([("rollout.max_batch_size", r.max_batch_size, "int>=1")])
    _check_lora(t)
    _check_train_scale(cfg)
    if t.logprob_chunk_tokens and t.engine == "deepspeed" and t.zero_stage == 3:
        raise ValueError(
            "train.logprob_chunk_tokens: the memory-lean log-probs need the whole LM head weight; "
            "with train.engine=deepspeed use train.zero_stage <= 2 (or logprob_chunk_tokens=0)"
        )
    _check_master_weights(cfg)
    _check_megatron(cfg)
    if t.autocast in ("bfloat16", "float16") and t.engine not in ("torch", "megatron"):
        raise ValueError(
            f"train.autocast={t.autocast} applies to the torch engine; with "
            f"train.engine={t.engine} set model.dtype=bfloat16 (DeepSpeed's own bf16 mode)"
        )
    _check_registered(
        [
            ("algorithm.policy_loss", POLICY_LOSSES, a.policy_loss),
            ("algorithm.aggregation", AGGREGATIONS, a.aggregation),
            ("algorithm.kl.estimator", KL_ESTIMATORS, a.kl.estimator),
        ]
    )
    if a.advantage != "asyppo":  # AsyPPO (rollkit.critics) is not in the registry: [K, B, T] values
        _check_registered([("algorithm.advantage", ADVANTAGE_ESTIMATORS, a.advantage)])
    _check_correction(a)
    _check_model_path(cfg.model.path)


def _check_model_path(path: str, name: str = "model.path") -> None:
    if path not in ("", "tiny", *TINY_VLM_NAMES) and not Path(path).exists() and not is_hub_id(path):
        raise ValueError(
            f"{name}: {path} does not exist (give a local HF checkpoint directory, a hub name "
            "such as Qwen/Qwen2.5-0.5B-Instruct, or '' / tiny)"
        )


#: what the RLVR loops give the estimator and the policy loss (batch keys)
RLVR_ADVANTAGE_INPUTS = ("rewards", "group_ids", "response_mask", "response_length")
RLVR_LOSS_INPUTS = ("logprobs", "old_logprobs", "behavior_logprobs", "advantages", "response_mask")


def _check_inputs(name: str, entry: Any, available: tuple[str, ...], where: str) -> None:
    need = [k for arg, k in entry.in_keys.items() if entry.tensor_args().get(arg) and k not in available]
    if need:
        raise ValueError(
            f"{name}={entry.name!r} needs {need}, which {where} does not provide (it has {list(available)})"
        )


#: Policy losses that weight by ``behavior_logprobs`` themselves (a second correction would double it).
SELF_CORRECTING_LOSSES = ("tis", "decoupled-ppo")


def _check_correction(a: AlgorithmConfig) -> None:
    """``algorithm.correction``: names, bounds, and no double correction."""
    c = a.correction
    for name, v, allowed in (
        ("algorithm.correction.level", c.level, ("off", "token", "sequence", "geometric", "segment")),
        ("algorithm.correction.reject", c.reject, ("token", "sequence")),
    ):
        if v not in allowed:
            raise ValueError(f"{name}: expected one of {', '.join(allowed)}, got {v!r}")
    _check_numbers(
        [
            ("algorithm.correction.truncate", c.truncate, ">=0"),
            ("algorithm.correction.mask_low", c.mask_low, ">=0"),
            ("algorithm.correction.mask_high", c.mask_high, ">=0"),
            ("algorithm.correction.seq_k3_max", c.seq_k3_max, ">=0"),
        ]
    )
    if c.mask_high and c.mask_low > c.mask_high:
        raise ValueError(
            f"algorithm.correction.mask_low ({c.mask_low:g}) must be <= mask_high ({c.mask_high:g})"
        )
    if c.level != "off" and POLICY_LOSSES.entry(a.policy_loss).name in SELF_CORRECTING_LOSSES:
        raise ValueError(
            f"algorithm.correction.level={c.level}: algorithm.policy_loss={a.policy_loss!r} already weights "
            "by the behaviour log-probs; use a loss without its own correction (e.g. ppo) or level=off"
        )


def critic_needed(cfg: Any) -> bool:
    """Whether ``cfg.algorithm.advantage`` trains with a learned critic (:data:`CRITIC_ADVANTAGES`)."""
    name = cfg.algorithm.advantage
    if name != "asyppo" and name in ADVANTAGE_ESTIMATORS:
        name = ADVANTAGE_ESTIMATORS.entry(name).name
    return name in CRITIC_ADVANTAGES


def _check_critic(c: Any) -> None:
    """``critic.*``: numbers, names, and no critic settings without a critic advantage."""
    k = c.critic
    _check_numbers(
        [
            ("critic.lr", k.lr, ">0"),
            ("critic.weight_decay", k.weight_decay, ">=0"),
            ("critic.grad_clip", k.grad_clip, ">0"),
            ("critic.lr_warmup_steps", k.lr_warmup_steps, "int>=0"),
            ("critic.value_clip", k.value_clip, ">=0"),
            ("critic.value_coef", k.value_coef, ">0"),
            ("critic.warmup_steps", k.warmup_steps, "int>=0"),
            ("critic.num_critics", k.num_critics, "int>=0"),
            ("critic.ppo_epochs", k.ppo_epochs, "int>=0"),
            ("critic.advantage_mask_frac", k.advantage_mask_frac, ">=0"),
            ("critic.entropy_filter_frac", k.entropy_filter_frac, ">=0"),
        ]
    )
    for name, v in (
        ("critic.advantage_mask_frac", k.advantage_mask_frac),
        ("critic.entropy_filter_frac", k.entropy_filter_frac),
    ):
        if v > 1:
            raise ValueError(f"{name} must be in [0, 1] (a fraction of the response tokens), got {v!r}")
    _check_names(
        c,
        [
            ("critic.engine", k.engine, ("", *TRAIN_ENGINES)),
            ("critic.lr_schedule", k.lr_schedule, ("constant", "cosine")),
            ("critic.shard_level", k.shard_level, ("response", "prompt")),
        ],
    )
    if k.model_path:
        _check_model_path(k.model_path, "critic.model_path")
    if not critic_needed(c):
        if k.warmup_steps or k.num_critics:
            raise ValueError(
                f"critic.warmup_steps / critic.num_critics: algorithm.advantage={c.algorithm.advantage!r} trains "
                f"no critic; use one of {', '.join(CRITIC_ADVANTAGES)}"
            )
        return
    extra = sorted(set(c.algorithm.advantage_kwargs) - {"gamma", "lam"})
    if extra:
        raise ValueError(
            f"algorithm.advantage_kwargs: {extra} not taken by the critic's GAE (it takes gamma and lam; AsyPPO's "
            "fractions are critic.advantage_mask_frac / entropy_filter_frac)"
        )
    for key in ("gamma", "lam"):
        v = c.algorithm.advantage_kwargs.get(key, 1.0)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1:
            raise ValueError(f"algorithm.advantage_kwargs.{key} must be a number in [0, 1], got {v!r}")
    asy = c.algorithm.advantage == "asyppo"
    if not asy and k.num_critics > 1:
        raise ValueError(
            f"critic.num_critics={k.num_critics}: several mini-critics are AsyPPO's; set algorithm.advantage=asyppo "
            "(or critic.num_critics=1)"
        )
    if k.warmup_steps >= c.train.steps > 0:
        raise ValueError(
            f"critic.warmup_steps ({k.warmup_steps}) must be < train.steps ({c.train.steps}): the policy would "
            "never be trained"
        )
    if (k.engine or c.train.engine) == "fsdp2" and c.train.lora_rank:
        raise ValueError(
            "critic.engine: a LoRA critic is wired for torch and deepspeed (ZeRO 0-2), not fsdp2"
        )


def _check_algorithm(c: Config) -> None:
    """The estimator and loss get the tensors they need; group estimators get groups."""
    a = c.algorithm
    _check_inputs(
        "algorithm.policy_loss", POLICY_LOSSES.entry(a.policy_loss), RLVR_LOSS_INPUTS, "the RLVR trainer"
    )
    if critic_needed(c):  # the critic path builds token rewards and values itself
        return
    adv = ADVANTAGE_ESTIMATORS.entry(a.advantage)
    _check_inputs("algorithm.advantage", adv, RLVR_ADVANTAGE_INPUTS, "the RLVR trainer")
    if c.rollout.n == 1 and "group_ids" in adv.in_keys:
        raise ValueError(
            f"rollout.n=1: algorithm.advantage={a.advantage!r} compares the n samples of each prompt, so with "
            "one sample every advantage is 0 and nothing is learned; set rollout.n >= 2 or use a batch-level "
            "estimator (reinforce++, rebn)"
        )


def _check_roll_options(c: Config) -> None:
    """ROLL's reward / advantage / filter / adaptive-KL options (docs/trainer.md); the numbers
    of the ``algorithm`` ones are checked by :func:`_check_common`."""
    f, rw, kl = c.filter, c.reward, c.algorithm.kl
    _check_numbers(
        [
            ("filter.accuracy_low", f.accuracy_low, ">=0"),
            ("filter.accuracy_high", f.accuracy_high, ">=0"),
            ("reward.overlong_buffer", rw.overlong_buffer, "int>=0"),
            ("reward.overlong_penalty", rw.overlong_penalty, ">=0"),
        ]
    )
    if not f.accuracy_low < f.accuracy_high <= 1:
        raise ValueError(
            f"filter.accuracy_low / accuracy_high: need 0 <= accuracy_low < accuracy_high <= 1 (groups with "
            f"low < mean reward < high are kept), got {f.accuracy_low!r}, {f.accuracy_high!r}"
        )
    if f.accuracy_band and c.tail_batching.enabled:
        raise ValueError(
            "filter.accuracy_band: not wired in tail batching (its policy filters with filter.zero_variance "
            "only); set tail_batching.enabled=false or filter.accuracy_band=false"
        )
    if rw.overlong_buffer > c.rollout.max_tokens:
        raise ValueError(
            f"reward.overlong_buffer ({rw.overlong_buffer}) must be <= rollout.max_tokens ({c.rollout.max_tokens})"
        )
    if kl.target:
        if kl.mode != "reward" or not kl.coef:
            raise ValueError(
                f"algorithm.kl.target: the adaptive KL controller drives the KL reward penalty (as in ROLL and "
                f"verl): set algorithm.kl.mode=reward and algorithm.kl.coef > 0 (got mode={kl.mode}, "
                f"coef={kl.coef:g})"
            )
        batch = c.rollout.prompts_per_step * c.rollout.n
        if batch > 5 * kl.horizon:
            raise ValueError(
                f"algorithm.kl.horizon ({kl.horizon:g}) must be >= batch size / 5 = {batch / 5:g} (a larger "
                "update could make the KL coefficient negative)"
            )


#: ``algorithm`` options the RLVR trainer wires and the agentic one does not (field, value, off)
RLVR_ONLY_ALGORITHM = (
    ("algorithm.reward_clip", lambda a: a.reward_clip, 0.0),
    ("algorithm.advantage_clip", lambda a: a.advantage_clip, 0.0),
    ("algorithm.whiten_advantages", lambda a: a.whiten_advantages, False),
    ("algorithm.kl.target", lambda a: a.kl.target, 0.0),
)


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


#: the keys of one ``data.domains`` entry (:class:`DomainSpec`'s fields but ``name``)
DOMAIN_KEYS = (
    "weight",
    "task",
    "task_options",
    "train_file",
    "train_split",
    "eval_file",
    "eval_split",
    "eval_size",
    "verifier",
    "verifier_options",
)

#: ``model.path`` names of the tiny random vision-language models (trainers.engines.build.TINY_VLMS)
TINY_VLM_NAMES = ("tiny_vl", "tiny_idefics3")

#: procedural tasks a domain may name (``trainers.domains.TASKS``)
TASK_NAMES = ("addition", "functions", "formats", "choice", "shapes")


@dataclass(frozen=True)
class DomainSpec:
    """One checked ``data.domains`` entry. Prompts come from ``train_file`` (and ``eval_file``,
    else the first ``eval_size`` records are held out), from the procedural ``task`` (with
    ``task_options``), or, with neither, from the records of ``data.train_file`` whose
    ``domain`` field names this domain. ``verifier`` ("" = ``reward.verifier``) with
    ``verifier_options`` scores them; ``weight`` sets the domain's share of each step."""

    name: str
    weight: float = 1.0
    task: str = ""
    task_options: dict = field(default_factory=dict)
    train_file: str = ""
    train_split: str = "train"
    eval_file: str = ""
    eval_split: str = "test"
    eval_size: int | None = None  # held out from train_file / the task (None: data.eval_size, a task's own)
    verifier: str = ""
    verifier_options: dict = field(default_factory=dict)


def _domain_field(where: str, key: str, value: Any, default: Any) -> Any:
    """``value`` checked against the type of ``default`` (a one-line error naming ``where.key``)."""
    if isinstance(default, dict):
        if not isinstance(value, dict):
            raise ValueError(f"{where}.{key}: expected a mapping, got {value!r}")
        return dict(value)
    if isinstance(default, float):
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not math.isfinite(value)
            or value <= 0
        ):
            raise ValueError(f"{where}.{key}: expected a number > 0, got {value!r}")
        return float(value)
    if isinstance(default, int) or key == "eval_size":
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{where}.{key}: expected an int >= 0, got {value!r}")
        return value
    if not isinstance(value, str):
        raise ValueError(f"{where}.{key}: expected a string, got {value!r}")
    return value


def domain_specs(cfg: Config) -> list[DomainSpec]:
    """The checked ``data.domains`` entries of ``cfg``, in the order written; ``[]`` for a run with
    one domain. A bad entry raises ``ValueError`` naming ``data.domains.<name>.<key>``."""
    raw = cfg.data.domains
    if not isinstance(raw, dict):
        raise ValueError(f"data.domains: expected a mapping name -> settings, got {raw!r}")
    defaults = DomainSpec("_")
    out = []
    for name, entry in raw.items():
        where = f"data.domains.{name}"
        if not isinstance(name, str) or not name or not all(ch.isalnum() or ch in "_-." for ch in name):
            raise ValueError(f"data.domains: a domain name must be letters, digits, _ - or ., got {name!r}")
        if entry is None:
            entry = {}
        if not isinstance(entry, dict):
            raise ValueError(f"{where}: expected a mapping of {', '.join(DOMAIN_KEYS)}, got {entry!r}")
        unknown = sorted(set(entry) - set(DOMAIN_KEYS))
        if unknown:
            raise ValueError(f"{where}: unknown keys {unknown}; known: {', '.join(DOMAIN_KEYS)}")
        values = {k: _domain_field(where, k, v, getattr(defaults, k)) for k, v in entry.items()}
        spec = DomainSpec(name, **values)
        if spec.task and spec.train_file:
            raise ValueError(f"{where}: give task or train_file, not both")
        if spec.task and spec.task not in TASK_NAMES:
            raise ValueError(f"{where}.task: unknown task {spec.task!r}; known: {', '.join(TASK_NAMES)}")
        if not spec.task and not spec.train_file and not cfg.data.train_file:
            raise ValueError(
                f"{where}: no prompts: set its task or train_file, or data.train_file with records "
                f"whose 'domain' field is {name!r}"
            )
        if spec.eval_file and not spec.train_file:
            raise ValueError(f"{where}.eval_file: set {where}.train_file too")
        for key in ("train_file", "eval_file"):
            f = getattr(spec, key)
            if f and not Path(f).exists() and not is_hub_id(f):
                raise ValueError(f"{where}.{key}: no such file, directory or hub dataset name: {f}")
        out.append(spec)
    return out


def _check_data(c: Config) -> None:
    d = c.data
    specs = domain_specs(c)
    if specs:
        _check_domain_run(c)
        return
    _check_names(c, [("data.chat_template", d.chat_template, ("auto", "on", "off"))])
    _check_numbers([("data.eval_size", d.eval_size, "int>=0")])
    for name, f in (("data.train_file", d.train_file), ("data.eval_file", d.eval_file)):
        if f and not Path(f).exists() and not is_hub_id(f):
            raise ValueError(f"{name}: no such file, directory or hub dataset name: {f}")
    if d.eval_file and not d.train_file:
        raise ValueError(
            "data.eval_file: set data.train_file too (the procedural task has its own held-out split)"
        )
    if not d.train_file:
        _check_names(c, [("data.task", d.task, ("addition", "shapes")), ("data.digits", d.digits, (1, 2, 3))])


def _check_domain_run(c: Config) -> None:
    """What a run with ``data.domains`` cannot combine with."""
    if c.data.eval_file:
        raise ValueError("data.eval_file: with data.domains give each domain's eval_file instead")
    if c.tail_batching.enabled:
        raise ValueError(
            "tail_batching.enabled: its prompt queue has no domain quotas yet; set data.domains={} "
            "or tail_batching.enabled=false"
        )


def _check_eval(c: Config) -> None:
    e = c.eval
    _check_numbers([("eval.n", e.n, "int>=1"), ("eval.temperature", e.temperature, ">0")])
    for k in e.k:
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= e.n:
            raise ValueError(f"eval.k: every k must be an int in [1, eval.n={e.n}], got {k!r}")
    if e.k and e.n == 1:
        raise ValueError("eval.k: pass@k needs eval.n > 1 samples per prompt")


def _check_engine_temperature(v: object) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (v >= 0):
        raise ValueError(f"rollout.engine_temperature: expected a number >= 0 (0: off), got {v!r}")


def _check_rollout_extras(c: Config) -> None:
    """``rollout.lora_weights`` and ``rollout.engine_temperature`` (sync / async configs)."""
    r, t = c.rollout, c.train
    if r.lora_weights not in ("merged", "adapter"):
        raise ValueError(f"rollout.lora_weights: expected merged or adapter, got {r.lora_weights!r}")
    if r.lora_weights == "adapter" and not t.lora_rank:
        raise ValueError("rollout.lora_weights=adapter: needs a LoRA policy (train.lora_rank > 0)")
    if r.lora_weights == "adapter" and r.engine != "vllm":
        raise ValueError(
            f"rollout.lora_weights=adapter: served by vLLM's LoRA support (rollout.engine=vllm), "
            f"not rollout.engine={r.engine!r}; use lora_weights=merged"
        )
    _check_engine_temperature(r.engine_temperature)
    if r.lora_weights == "adapter" and c.placement.sleep_level == 2:
        raise ValueError(
            "placement.sleep_level=2 discards the rollout's base weights, which rollout.lora_weights=adapter "
            "does not resend: use sleep_level=1 or lora_weights=merged"
        )


def validate(cfg: Config) -> None:
    """Check ``cfg`` before anything is built; a bad value raises ``ValueError`` naming its field."""
    c = cfg
    _check_numbers(
        [
            ("rollout.prompts_per_step", c.rollout.prompts_per_step, "int>=1"),
            ("rollout.n", c.rollout.n, "int>=1"),
            ("rollout.prompts_per_request", c.rollout.prompts_per_request, "int>=1"),
            ("rollout.chunk_tokens", c.rollout.chunk_tokens, "int>=1"),
            ("rollout.gpu_memory_utilization", c.rollout.gpu_memory_utilization, "(0,1]"),
            ("filter.max_rounds", c.filter.max_rounds, "int>=1"),
            ("eval.every", c.eval.every, "int>=0"),
            ("eval.max_tokens", c.eval.max_tokens, "int>=1"),
            ("checkpoint.every", c.checkpoint.every, "int>=0"),
            ("reward.num_workers", c.reward.num_workers, "int>=1"),
            ("reward.max_workers", c.reward.max_workers, "int>=0"),
            ("reward.max_retries", c.reward.max_retries, "int>=0"),
            ("reward.timeout_s", c.reward.timeout_s, ">0"),
            ("reward.idle_s", c.reward.idle_s, ">0"),
            ("reward.cpus_per_worker", c.reward.cpus_per_worker, ">=0"),
            ("reward.judge_timeout_s", c.reward.judge_timeout_s, ">0"),
            ("placement.rollout_workers", c.placement.rollout_workers, "int>=1"),
            ("placement.train_workers", c.placement.train_workers, "int>=1"),
            ("placement.cpus_per_worker", c.placement.cpus_per_worker, ">0"),
            ("ray.timeout_s", c.ray.timeout_s, ">0"),
            ("ray.startup_timeout_s", c.ray.startup_timeout_s, ">0"),
        ]
    )
    if c.rollout.max_model_len is not None:
        _check_numbers([("rollout.max_model_len", c.rollout.max_model_len, "int>=1")])
    _check_names(
        c,
        [
            ("rollout.engine", c.rollout.engine, ROLLOUT_ENGINES),
            ("reward.backend", c.reward.backend, ("inline", "process", "ray")),
            ("reward.code_mode", c.reward.code_mode, ("all", "fraction")),
            ("placement.mode", c.placement.mode, ("colocated", "disaggregated")),
            ("placement.reference", c.placement.reference, ("train", "separate")),
            ("placement.critic", c.placement.critic, ("train", "separate")),
        ],
    )
    _check_common(c)
    _check_critic(c)
    _check_rollout_extras(c)
    _check_rollout_scale(c)
    _check_algorithm(c)
    _check_roll_options(c)
    _check_data(c)
    _check_eval(c)
    parse_length_dist(c.rollout.length_dist)
    _check_servers(c.rollout)
    if c.rollout.engine == "server" and c.ray.enabled:
        raise ValueError(
            "rollout.engine=server: the inference servers are the rollout workers (rollout.num_servers "
            "or rollout.servers); set ray.enabled=false"
        )
    if c.rollout.engine == "server" and c.asynchronous.num_engines != 1:
        raise ValueError(
            f"asynchronous.num_engines={c.asynchronous.num_engines}: with rollout.engine=server one engine "
            "routes over all servers; set rollout.num_servers (or rollout.servers) instead"
        )
    _check_checkpoint(c)
    _check_tail_batching(c)
    _check_vision(c)
    if c.asynchronous.enabled:
        validate_async(c)


def _qwen_vl(path: str) -> bool:
    """Whether ``model.path`` is a Qwen2-VL-family model (``tiny_vl`` or its config's model_type)."""
    return path == "tiny_vl" or str(checkpoint_config(path).get("model_type", "")).startswith("qwen2")


def _check_vision(c: Config) -> None:
    """What a vision-language policy (``model.path=tiny_vl`` or a checkpoint with a
    ``vision_config``) cannot do yet, by name."""
    if not (c.model.path in TINY_VLM_NAMES or (c.model.path and is_vision_checkpoint(c.model.path))):
        return
    refused = [
        (c.rollout.engine == "server", "rollout.engine=server",
         "vLLM's token-in completions API takes no images; use rollout.engine=vllm or hf"),
        (c.train.packing, "train.packing", "packed micro-batches do not carry image inputs yet"),
        (critic_needed(c), f"algorithm.advantage={c.algorithm.advantage}",
         "the critic's value forward does not take image inputs yet"),
        (c.train.engine == "fsdp2" and c.train.logprob_chunk_tokens > 0, "train.logprob_chunk_tokens",
         "the FSDP2 engine's lean head runs the text decoder only"),
        (c.rollout.engine == "vllm" and _qwen_vl(c.model.path) and importlib.util.find_spec("torchvision") is None,
         "rollout.engine=vllm", "vLLM's Qwen2-VL model needs torchvision, which is not installed; use "
         "rollout.engine=hf, or an Idefics3 / SmolVLM model (model.path=tiny_idefics3)"),
    ]  # fmt: skip
    for bad, field_, why in refused:
        if bad:
            raise ValueError(f"{field_}: not with a vision-language model ({c.model.path}): {why}")


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


def _check_servers(r: RolloutEngineConfig) -> None:
    """The ``rollout.engine=server`` fields (checked whatever the engine, as they are cheap)."""
    server_addresses(r.servers)
    _check_numbers(
        [
            ("rollout.num_servers", r.num_servers, "int>=1"),
            ("rollout.server_timeout_s", r.server_timeout_s, ">0"),
            ("rollout.server_request_timeout_s", r.server_request_timeout_s, ">0"),
            ("rollout.server_startup_timeout_s", r.server_startup_timeout_s, ">0"),
            ("rollout.server_kv_cache_gib", r.server_kv_cache_gib, "int>=1"),
        ]
    )
    if r.servers and r.engine != "server":
        raise ValueError(f"rollout.servers is set but rollout.engine={r.engine!r}: set rollout.engine=server")


def _check_checkpoint(c: Any) -> None:
    ck = c.checkpoint
    _check_numbers([("checkpoint.every", ck.every, "int>=0"), ("checkpoint.keep", ck.keep, "int>=0")])
    if ck.resume and ck.resume != "auto" and not Path(ck.resume).exists():
        raise ValueError(f"checkpoint.resume: no such checkpoint: {ck.resume}")
    if ck.resume == "auto" and not ck.dir:
        raise ValueError(
            "checkpoint.resume=auto: set checkpoint.dir (where to look for the latest checkpoint)"
        )


def _check_tail_batching(c: Config) -> None:
    tb = c.tail_batching
    if not tb.enabled:
        return
    for name, eta in (
        ("tail_batching.eta_prompts", tb.eta_prompts),
        ("tail_batching.eta_responses", tb.eta_responses),
    ):
        if not (math.isfinite(eta) and eta >= 1):
            raise ValueError(f"{name} must be a finite number >= 1 (1: no over-provisioning), got {eta}")


def validate_async(cfg: Config) -> None:
    """The checks of the ``asynchronous`` section (:class:`trainers.loops.AsyncTrainer`)."""
    ac = cfg.asynchronous
    if cfg.placement.offload_train:
        raise ValueError(
            "placement.offload_train: the asynchronous trainer trains while the rollout generates, so the "
            "training state cannot leave the device between phases; set placement.offload_train=false"
        )
    if cfg.ray.enabled and cfg.placement.mode != "disaggregated":
        raise ValueError(
            f"placement.mode={cfg.placement.mode!r}: the asynchronous trainer generates while it "
            "trains, so on Ray the rollout and train actors need resources of their own: set "
            "placement.mode=disaggregated"
        )
    if cfg.ray.enabled and ac.num_engines not in (1, cfg.placement.rollout_workers):
        raise ValueError(
            f"asynchronous.num_engines={ac.num_engines}: on Ray the engines are the "
            f"placement.rollout_workers={cfg.placement.rollout_workers} rollout actors; set that instead"
        )
    if ac.in_flight not in ("keep", "abort"):
        raise ValueError(f"asynchronous.in_flight must be 'keep' or 'abort', got {ac.in_flight!r}")
    if ac.extra_prompts < 0:
        raise ValueError(f"asynchronous.extra_prompts must be >= 0, got {ac.extra_prompts}")
    if ac.num_engines < 1:
        raise ValueError(f"asynchronous.num_engines must be >= 1, got {ac.num_engines}")
    if ac.ratio < 0:
        raise ValueError(f"asynchronous.ratio must be >= 0, got {ac.ratio}")
    _check_numbers([("asynchronous.overlap_steps", ac.overlap_steps, "int>=0")])
    if ac.deterministic and cfg.ray.enabled:
        raise ValueError(
            "asynchronous.deterministic: the reproducible schedule runs the engines in this process; "
            "Ray actors answer in their own time: set ray.enabled=false or asynchronous.deterministic=false"
        )


def _check_agentic_engine(r: AgenticRolloutConfig) -> None:
    """``rollout.engine`` of the agentic trainer and its vLLM / server fields."""
    if r.engine not in ROLLOUT_ENGINES:
        raise ValueError(f"rollout.engine must be one of {', '.join(ROLLOUT_ENGINES)}, got {r.engine!r}")
    _check_servers(r)
    _check_numbers([("rollout.tensor_parallel_size", r.tensor_parallel_size, "int>=1"),
                    ("rollout.gpu_memory_utilization", r.gpu_memory_utilization, "(0,1]")])  # fmt: skip
    if r.max_model_len is not None:
        _check_numbers([("rollout.max_model_len", r.max_model_len, "int>=1")])
    if r.tensor_parallel_size > 1 and r.engine == "hf":
        raise ValueError(
            "rollout.tensor_parallel_size: the transformers engine (rollout.engine=hf) runs on one device"
        )


def _check_agentic_ray(cfg: AgenticConfig) -> None:
    """The ``ray`` / ``placement`` sections of the agentic trainer."""
    p = cfg.placement
    _check_numbers([("placement.rollout_workers", p.rollout_workers, "int>=1"),
                    ("placement.train_workers", p.train_workers, "int>=1"),
                    ("placement.cpus_per_worker", p.cpus_per_worker, ">0"),
                    ("ray.timeout_s", cfg.ray.timeout_s, ">0"), ("ray.startup_timeout_s", cfg.ray.startup_timeout_s, ">0"),
                    ("rollout.prompts_per_request", cfg.rollout.prompts_per_request, "int>=1")])  # fmt: skip
    _check_names(cfg, [("placement.mode", p.mode, ("colocated", "disaggregated")),
                       ("placement.reference", p.reference, ("train", "separate"))])  # fmt: skip
    _check_rollout_scale(cfg)
    if p.offload_train:
        raise ValueError(
            "placement.offload_train: not wired in the agentic trainer (its rollout and update overlap)"
        )
    if not cfg.ray.enabled:
        return
    if cfg.rollout.engine == "server":
        raise ValueError(
            "rollout.engine=server: the inference servers are the rollout workers; set ray.enabled=false"
        )
    if critic_needed(cfg):
        raise ValueError(
            f"algorithm.advantage={cfg.algorithm.advantage}: the agentic critic runs in process; set ray.enabled=false"
        )


def validate_agentic(cfg: AgenticConfig) -> None:
    """Check an :class:`AgenticConfig`; a bad value raises ``ValueError`` naming its field."""
    r, a = cfg.rollout, cfg.algorithm
    _check_checkpoint(cfg)
    for name, v in (
        ("rollout.groups_per_step", r.groups_per_step),
        ("rollout.group_size", r.group_size),
        ("rollout.max_tokens", r.max_tokens),
        ("env.max_turns", cfg.env.max_turns),
        ("env.max_context", cfg.env.max_context),
        ("train.micro_batch_size", cfg.train.micro_batch_size),
        ("train.ppo_epochs", cfg.train.ppo_epochs),
        ("eval.episodes", cfg.eval.episodes),
    ):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}: expected an int >= 1, got {v!r}")
    for name, v in (
        ("rollout.redundancy", r.redundancy),
        ("rollout.max_staleness", r.max_staleness),
        ("rollout.num_env_groups", r.num_env_groups),
    ):
        if v < 0:
            raise ValueError(f"{name}: expected an int >= 0, got {v!r}")
    if r.mode not in AGENTIC_MODES:
        raise ValueError(f"rollout.mode: expected one of {AGENTIC_MODES}, got {r.mode!r}")
    if r.sample_per not in ("trajectory", "turn"):
        raise ValueError(f"rollout.sample_per: expected trajectory or turn, got {r.sample_per!r}")
    if r.sample_per == "turn" and r.max_tokens >= cfg.env.max_context:
        raise ValueError(
            f"rollout.sample_per=turn: rollout.max_tokens ({r.max_tokens}) must be below env.max_context "
            f"({cfg.env.max_context}), which bounds each turn's context and action"
        )
    if r.sample_per == "turn" and critic_needed(cfg):
        raise ValueError(
            f"rollout.sample_per=turn: algorithm.advantage={a.advantage} bootstraps a critic along the whole "
            "trajectory; use sample_per=trajectory, or a per-turn estimator (gigpo, discounted_return, starpo)"
        )
    if r.num_env_groups and r.num_env_groups < r.groups_per_step:
        raise ValueError(
            f"rollout.num_env_groups: {r.num_env_groups} < rollout.groups_per_step {r.groups_per_step}"
        )
    if r.mode == "lockstep" and (r.redundancy or r.num_env_groups > r.groups_per_step):
        raise ValueError(
            "rollout.redundancy / num_env_groups: redundant environments need rollout.mode=async"
        )
    if r.temperature <= 0:
        raise ValueError(f"rollout.temperature: training needs sampling (> 0), got {r.temperature}")
    _check_engine_temperature(r.engine_temperature)
    if cfg.env.chat_template not in ("auto", "on", "off"):
        raise ValueError(f"env.chat_template: expected auto, on or off, got {cfg.env.chat_template!r}")
    for name, get, off in RLVR_ONLY_ALGORITHM:
        if get(a) != off:
            raise ValueError(f"{name}: wired in the RLVR trainers only, not the agentic one; set it to {off}")
    _check_agentic_engine(r)
    _check_agentic_ray(cfg)
    _check_common(cfg)
    _check_critic(cfg)
