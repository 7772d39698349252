r"""Every cost model of the simulator, each with its formula and its source (docs/simulator.md).

* **Decode** (one engine iteration: one new token for each of the :math:`B` running sequences,
  whose contexts hold :math:`K` tokens in all):

  .. math:: t_\text{iter}(B, K) = a + b\,B + c\,K

  :math:`a`: reading the weights once per iteration (decoding is memory-bound: Kwon et al. 2023,
  vLLM, SOSP; the roofline argument of ROLL Flash section 3), :math:`b`: the per-sequence
  compute (:math:`2N` FLOPs per token), :math:`c`: reading the KV cache (bytes per token of
  context). With the sequences fixed, :math:`k` iterations take
  :math:`k(a + bB + cK_0) + cB\,k(k-1)/2` (the KV grows by :math:`B` per iteration), which the
  engine uses in closed form.
* **Prefill** of :math:`P` prompt tokens (also the re-prefill of a request continued after a
  weight update, prompt + tokens so far): :math:`t = p_0 + p_1 P` (compute-bound, :math:`2N`
  FLOPs per token).
* **Train** on GPUs, on :math:`T` tokens (prompt + response, every sample of the batch):
  :math:`t = t_0 + k_\text{tok} T`, :math:`k_\text{tok} = 8N / (G\cdot\text{peak}\cdot
  \text{MFU})` (the :math:`6N` FLOPs per token of Kaplan et al. 2020 for forward and backward,
  plus :math:`2N` for the old-policy log-probs). On this CPU the cost depends on the batch's
  shape: per micro-batch of :math:`B` rows, :math:`U` distinct prompts of :math:`P` tokens and
  responses padded to :math:`R`, :math:`m_0 + k(UP + BR) + k_a BR(P + R)`, measured on the torch
  engine's own update (:class:`TrainCost`, :data:`_TRAIN_1_THREAD`).
* **Weight sync**: :math:`t = s_0 + 2N / \text{bw}` (bfloat16 weights broadcast to the rollout
  engines).
* **Reward and environment latency**: a distribution per call (constant, Gaussian truncated at
  0 as in ROLL Flash's agentic setting, or log-normal), served by ``workers`` parallel workers.

Two calibrations: :func:`cpu_smollm2` (this machine, measured by
``python -m benchmarks.sim.calibrate``) and :func:`gpu_model` (H800 figures and the papers'
settings; every constant is an assumption stated in its docstring).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

__all__ = [
    "CostModel",
    "DecodeCost",
    "Latency",
    "MODEL_SHAPES",
    "PAPER_MFU",
    "TWO_THREAD_SPEEDUP",
    "TrainCost",
    "cpu_smollm2",
    "cpu_train",
    "gpu_model",
]


@dataclass(frozen=True)
class DecodeCost:
    """One rollout engine: :math:`t_\\text{iter} = a + bB + cK`, prefill :math:`p_0 + p_1 P`.

    ``max_seqs``: the most sequences decoded together (vLLM's ``max_num_seqs``);
    ``kv_capacity``: the KV-cache size in tokens (a request waits while admitting it would
    exceed it; ``None``: unbounded); ``share_prefix``: requests of one prompt admitted together
    prefill it once (the transformers engine prefills each distinct prompt once and gathers its
    cache to the samples: ``trainers/engines/hf_rollout.py``).
    """

    a: float
    b: float
    c: float
    p0: float = 0.0
    p1: float = 0.0
    max_seqs: int = 256
    kv_capacity: int | None = None
    share_prefix: bool = False

    def iteration(self, running: int, kv_tokens: float) -> float:
        return self.a + self.b * running + self.c * kv_tokens

    def iterations(self, k: int, running: int, kv_tokens: float) -> float:
        """Seconds for ``k`` iterations of ``running`` sequences starting with ``kv_tokens``."""
        return k * self.iteration(running, kv_tokens) + self.c * running * k * (k - 1) / 2

    def max_iterations(self, seconds: float, running: int, kv_tokens: float) -> int:
        """The most whole iterations that fit in ``seconds`` (inverse of :meth:`iterations`)."""
        if seconds <= 0:
            return 0
        q = self.c * running / 2
        lin = self.iteration(running, kv_tokens) - q
        if q <= 0:
            k = math.floor(seconds / lin) if lin > 0 else 1 << 40
        else:
            k = math.floor((-lin + math.sqrt(lin * lin + 4 * q * seconds)) / (2 * q))
        while k > 0 and self.iterations(k, running, kv_tokens) > seconds + 1e-12:
            k -= 1
        while self.iterations(k + 1, running, kv_tokens) <= seconds + 1e-12:
            k += 1
        return k

    def prefill(self, tokens: int) -> float:
        return self.p0 + self.p1 * tokens if tokens > 0 else 0.0


@dataclass(frozen=True)
class TrainCost:
    r"""Training one batch, and the weight sync after it (``sync_s`` seconds, engines paused).

    * **Packed** (``micro_batch == 0``; the GPU models): :math:`t = t_0 + k\,T`, ``T`` the prompt
      + response tokens of every sample, each counted once.
    * **Micro-batched** (``micro_batch > 0``; this machine's torch engine): micro-batches of
      :math:`B` rows formed as the learner forms them (``trainers.learner.micro_batches``: rows
      in batch order, stably sorted by response length first with ``sort_by_length``), each
      computed up to its longest response :math:`R` after prompts of :math:`P` tokens:

      .. math:: t = t_0 + \sum_\text{mb} \left(m_0 + k\,(U P + B R) + k_a\,B R (P + R)\right)

      :math:`U`: the distinct prompts of the micro-batch with ``share_prompts`` (the torch
      engine runs each distinct prompt once and the responses on its KV cache:
      ``response_logits`` in ``trainers/engines/torch_train.py``), else :math:`B`;
      :math:`m_0` (``per_micro_batch``): the fixed work of a micro-batch; :math:`k_a`
      (``k_attn``): attention and the memory traffic that grow with the context;
      :math:`t_0`: the optimizer step and the update's fixed work. With :math:`m_0 = k_a = 0`
      and no prompt sharing this is :math:`t_0 + k \sum_\text{mb} B (P + R)`, padded tokens.
    """

    t0: float
    per_token: float = 0.0
    sync_s: float = 0.0
    micro_batch: int = 0
    sort_by_length: bool = True
    per_micro_batch: float = 0.0
    k_attn: float = 0.0
    share_prompts: bool = False

    def time(self, tokens: int) -> float:
        """The packed form: ``t0 + per_token * tokens``."""
        return self.t0 + self.per_token * tokens

    def micro_batches(self, responses: Sequence[int]) -> list[list[int]]:
        """Row indices of each micro-batch (all rows in one when ``micro_batch == 0``)."""
        rows = list(range(len(responses)))
        if self.micro_batch <= 0:
            return [rows] if rows else []
        if self.sort_by_length:
            rows.sort(key=lambda i: responses[i])  # stable, as torch.argsort(stable=True)
        mb = self.micro_batch
        return [rows[i : i + mb] for i in range(0, len(rows), mb)]

    def batch_time(
        self, responses: Sequence[int], *, prompt_len: int, groups: Sequence[int] | None = None
    ) -> float:
        """Seconds to train samples with these response lengths after prompts of ``prompt_len``
        tokens; ``groups[i]``: the prompt of sample ``i`` (default: every sample its own)."""
        if self.micro_batch <= 0:
            return self.time(sum(prompt_len + r for r in responses))
        groups = range(len(responses)) if groups is None else groups
        t = self.t0
        for rows in self.micro_batches(responses):
            B, R = len(rows), max(responses[i] for i in rows)
            U = len({groups[i] for i in rows}) if self.share_prompts else B
            t += self.per_micro_batch + self.per_token * (U * prompt_len + B * R)
            t += self.k_attn * B * R * (prompt_len + R)
        return t


@dataclass(frozen=True)
class Latency:
    """A latency distribution: ``const`` (``mean``), ``gauss`` (``mean``, ``std``, truncated at
    0: ROLL Flash / RollArt's environment latency) or ``lognormal`` (median ``mean``, sigma
    ``std``)."""

    kind: str = "const"
    mean: float = 0.0
    std: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in ("const", "gauss", "lognormal"):
            raise ValueError(f"kind: expected const, gauss or lognormal, got {self.kind!r}")
        if not (math.isfinite(self.mean) and self.mean >= 0 and math.isfinite(self.std) and self.std >= 0):
            raise ValueError(f"mean / std: must be finite and >= 0, got {self.mean!r} / {self.std!r}")

    def sample(self, rng: random.Random) -> float:
        if self.kind == "const" or self.std == 0:
            return self.mean
        if self.kind == "gauss":
            return max(0.0, rng.gauss(self.mean, self.std))
        return self.mean * math.exp(self.std * rng.gauss(0.0, 1.0))


@dataclass(frozen=True)
class CostModel:
    """Every cost of one set-up (``name`` and ``source`` say where the numbers come from)."""

    decode: DecodeCost
    train: TrainCost
    reward: Latency = field(default_factory=Latency)
    reward_workers: int = 1 << 30
    env: Latency = field(default_factory=Latency)
    name: str = ""
    source: str = ""

    def with_(self, **changes: object) -> CostModel:
        return replace(self, **changes)


# --------------------------------------------------------------------------- this machine

#: This machine (2-core AMD EPYC, KVM, no AMX; float32; torch threads 2), SmolLM2-135M-Instruct.
#: vllm / hf decode and prefill: ``python -m benchmarks.sim.calibrate`` on the quiet machine
#: (vLLM through the request-level view, one ``VLLMRequestEngine.step()`` per iteration; the
#: transformers engine's batch ``generate``; fits within 12%; small negative ``c`` set to 0).
#: Weight sync: vLLM 0.38 s (the same calibration), transformers 0.11 s
#: (``python -m benchmarks.sim.calibrate --skip vllm,hf,train``).
_CPU = {
    "vllm": DecodeCost(a=0.0377, b=0.00158, c=0.0, p0=0.059, p1=0.00115, max_seqs=256),
    "hf": DecodeCost(a=0.0452, b=0.0, c=0.000144, p0=0.0869, p1=0.00139, max_seqs=1 << 20, share_prefix=True),
    "sync_vllm": 0.38,
    "sync_hf": 0.11,
}

#: The torch engine's ``ppo_update`` on SmolLM2 (the micro-batched form of :class:`TrainCost`),
#: measured with ONE torch thread in process CPU seconds, which other jobs on the shared machine
#: delay but do not inflate: ``nice -n 5 python -m benchmarks.sim.calibrate --skip vllm,hf,sync
#: --threads 1`` (2-core AMD EPYC, float32; load average 8-10 from other jobs), six shapes of
#: prompt 37 + response 12 to 512 tokens, each the faster of two calls; the fit is within 13% of
#: every shape (docs/simulator.md has the table).
_TRAIN_1_THREAD = {"t0": 0.7946, "per_micro_batch": 1.0515, "per_token": 0.010789, "k_attn": 9.564e-06}

#: How much faster the same update runs on 2 threads than on 1: the model's 1-thread time of the
#: recipe's update (4 x 8 x (37 + 12) tokens, micro-batches of 16: 8.82 s) over the median
#: ``time/train`` of the recipe's job in ``benchmarks/bench_server.py``'s in-process run on this
#: machine (5.62 s over 20 steps: ``runs/bench_server/vllm/metrics.jsonl``, docs/server.md). The
#: one constant of the train model fitted on a run of a job, not on a micro-benchmark: the
#: recipe's train phase is therefore fitted, its rollout and W1's train are predictions.
TWO_THREAD_SPEEDUP = 1.568


def cpu_train(micro_batch: int = 8, *, sort_by_length: bool = True, sync_s: float = 0.0) -> TrainCost:
    """This machine's torch train engine on SmolLM2 with 2 threads (:data:`_TRAIN_1_THREAD` over
    :data:`TWO_THREAD_SPEEDUP`), micro-batches of ``micro_batch`` rows, prompts shared."""
    k = {name: v / TWO_THREAD_SPEEDUP for name, v in _TRAIN_1_THREAD.items()}
    return TrainCost(
        **k, sync_s=sync_s, micro_batch=micro_batch, sort_by_length=sort_by_length, share_prompts=True
    )


def cpu_smollm2(engine: str = "vllm", *, micro_batch: int = 8, sort_by_length: bool = True) -> CostModel:
    """This machine's costs for SmolLM2-135M (``engine``: ``"vllm"`` for the vLLM CPU build,
    ``"hf"`` for the transformers engine; the train micro-batches: ``micro_batch`` rows, sorted
    by length or not); rewards are exact-match, about free."""
    if engine not in ("vllm", "hf"):
        raise ValueError(f"engine: expected 'vllm' or 'hf', got {engine!r}")
    return CostModel(
        decode=_CPU[engine],
        train=cpu_train(micro_batch, sort_by_length=sort_by_length, sync_s=_CPU[f"sync_{engine}"]),
        reward=Latency("const", 0.0005),
        name=f"cpu-smollm2-{engine}",
        source="measured on this machine (2-core AMD EPYC, float32): costs._CPU, _TRAIN_1_THREAD, docs/simulator.md",
    )


# --------------------------------------------------------------------------- GPUs (papers)

#: (parameters, layers, KV heads, head dim) from the models' config.json (Qwen2.5 / Qwen3 cards)
MODEL_SHAPES = {
    "7B": (7.6e9, 28, 4, 128),  # Qwen2.5-7B
    "8B": (8.2e9, 36, 8, 128),  # Qwen3-8B
    "14B": (14.7e9, 48, 8, 128),  # Qwen2.5-14B
    "32B": (32.5e9, 64, 8, 128),  # Qwen2.5-32B
}

#: H800 SXM: 3.35 TB/s HBM3, 989 TFLOP/s dense bfloat16, 80 GB (NVIDIA's H100/H800 data sheet)
H800 = {"bw": 3.35e12, "peak": 989e12, "mem": 80e9}

#: the training efficiency at which a synchronous step of RollPacker's 14B setting spends 23% of
#: its time training (RollPacker Table 1, math: 72 / 5 / 23% rollout / reward / train):
#: ``benchmarks.sim.papers.calibrate_mfu()``. Far below a pre-training MFU: an RL trainer's
#: "train" phase also recomputes log-probs, reshards and reloads weights, and pads.
PAPER_MFU = 0.0227


def gpu_model(
    size: str = "8B",
    *,
    tp: int | None = None,
    train_gpus: int = 8,
    bw_eff: float = 0.6,
    flop_eff: float = 0.4,
    mfu: float = PAPER_MFU,
    sync_bw: float = 25e9,
    reward: Latency | None = None,
) -> CostModel:
    """H800 costs of a Qwen model of ``size`` (``7B``, ``8B``, ``14B``, ``32B``, or ``"<x>B"``
    for a dense model of ``x`` billion parameters shaped like Qwen2.5-14B per parameter).

    Assumptions (none of them measured here): bfloat16 weights and KV; an engine is ``tp`` GPUs
    (default 1 up to 14B, 2 for 32B); ``bw_eff`` of the HBM bandwidth and ``flop_eff`` of the
    peak reached in decoding, ``mfu`` of the peak in training (default :data:`PAPER_MFU`, fitted
    to the papers' stage shares);
    KV cache: 90% of the engine's memory minus the weights; per iteration 3 ms of scheduling
    overhead; weight sync at ``sync_bw`` bytes/s plus 2 s; train step overhead 5 s; rewards
    (math rule-based) log-normal with median 0.5 s, 64 workers unless ``reward`` is given.
    """
    if size in MODEL_SHAPES:
        n, layers, kv_heads, hd = MODEL_SHAPES[size]
    else:
        try:
            n = float(size.upper().rstrip("B")) * 1e9
        except ValueError:
            raise ValueError(f"model size: expected e.g. 7B, 8B, 14B, 32B or 70B, got {size!r}") from None
        if not (n > 0 and math.isfinite(n)):
            raise ValueError(f"model size: must be > 0, got {size!r}")
        n0, l0, h0, d0 = MODEL_SHAPES["14B"]
        layers, kv_heads, hd = max(1, round(l0 * (n / n0) ** (1 / 3))), h0, d0
    tp = tp if tp is not None else (1 if n <= 16e9 else 2 if n <= 40e9 else 4)
    bw, peak = H800["bw"] * bw_eff * tp, H800["peak"] * flop_eff * tp
    weights = 2 * n
    kv_per_token = 2 * layers * kv_heads * hd * 2
    capacity = int((0.9 * H800["mem"] * tp - weights) / kv_per_token)
    if capacity < 1:
        raise ValueError(f"model size: {size} does not fit on {tp} GPU(s) of 80 GB")
    decode = DecodeCost(
        a=weights / bw + 0.003,
        b=2 * n / peak,
        c=kv_per_token / bw,
        p0=0.005,
        p1=2 * n / (H800["peak"] * 0.5 * tp),
        max_seqs=256,
        kv_capacity=capacity,
    )
    train = TrainCost(
        t0=5.0,
        per_token=8 * n / (train_gpus * H800["peak"] * mfu),
        sync_s=2.0 + weights / sync_bw,
    )
    return CostModel(
        decode=decode,
        train=train,
        reward=reward if reward is not None else Latency("lognormal", 0.5, 0.5),
        reward_workers=64,
        name=f"h800-qwen-{size}-tp{tp}",
        source="assumed from H800 data-sheet figures and the models' shapes (gpu_model docstring)",
    )
