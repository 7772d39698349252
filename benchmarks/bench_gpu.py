"""GPU checks and figures: the engines' CUDA paths, the log-prob primitive, tokens/s and MFU.

Each case runs in its own subprocess (a fresh CUDA context and process group) and prints one
JSON line; the driver collects them into a markdown table (``--out``, default stdout).

Cases:

- ``logprobs``: :func:`rollkit.logprobs.lean_token_logprobs` against the plain path (the
  ``[N, V]`` logits, then :func:`rollkit.logprobs.token_logprobs`), forward + backward of
  ``sum(logprobs) + sum(entropy)`` to the hidden states and the LM head, bf16 inputs;
  extra peak memory (``torch.cuda.max_memory_allocated`` above the inputs) and median time.
  ``lean``: the default (chunk matmuls in float32); ``lean bf16 matmul``: ``matmul_dtype=bf16``
  (the matmuls in bf16 like the plain path's, softmax in float32); ``lean bf16 matmul, fused``:
  the same with ``fused=True`` (each chunk's softmax statistics and logit gradient compiled by
  inductor; the warm-up call compiles). Plus the agreement of
  values and gradients in float32 on CUDA.
- ``torch``, ``torch-lean``, ``torch-bf16``, ``lora``, ``fsdp2``, ``deepspeed2``,
  ``deepspeed3``: one training step of a Qwen2-0.5B-config model (random weights; hidden 896,
  24 layers, 14 heads / 2 KV heads, MLP 4864, vocabulary 151936, tied embeddings) on the
  batch ``--rows`` x (``--prompt`` + ``--response``) tokens, micro-batches of ``--micro``
  rows: ``logprobs`` + ``backward`` of a token-mean NLL per micro-batch, then ``step``
  (AdamW, gradient clipping). ``torch``: fp32 master weights, bf16 autocast, full logits;
  ``torch-lean``: the same with ``train.logprob_chunk_tokens``; ``torch-bf16``: bf16 weights
  (no autocast), lean; ``lora``: rank-16 adapters on every projection, bf16 autocast, lean;
  ``fsdp2``: ``fully_shard`` over a world of 1 on NCCL, bf16 mixed precision, lean;
  ``deepspeed2`` / ``deepspeed3``: DeepSpeed ZeRO-2 / 3 over a world of 1 on NCCL, its bf16
  mode (lean at ZeRO-2; ZeRO-3 with full logits).
  Reported: tokens/s (every non-pad token of the batch, prompt and response), peak memory,
  and MFU = tokens/s x flops-per-token / peak, with flops-per-token =
  6 x N_matmul + 12 x L x H x S (PaLM, Chowdhery et al. 2022, app. B: N_matmul counts every
  matmul weight incl. the LM head, S the sequence length), peak = 989.4 TFLOP/s (H100 SXM
  dense bf16; ``--peak-tflops`` for another GPU). LoRA's MFU counts the same flops (its
  backward skips the frozen weights' gradients, so its MFU is an upper bound of useful work).
- ``torch-packed``, ``torch-compiled``, ``torch-packed-compiled``: ``torch-lean`` with
  ``train.packing`` (the packed path on a batch without padding: its overhead), with
  ``train.compile`` + ``train.fused_optimizer`` (inductor, each decoder layer), and both.
- ``ragged-padded``, ``ragged-packed``, ``ragged-packed-compiled``: ``torch-lean`` on a W1-shaped
  ragged batch (the same rows, ``--prompt``-token prompts, response lengths log-normal with
  median ``--response / 24`` and sigma 1.4 capped at ``--response``: the longest about 25-30x
  the median), padded micro-batches of ``--micro`` rows, packed ones of at most ``--micro`` x
  (``--prompt`` + ``--response``) / 4 real tokens (first-fit decreasing), and packed + compiled.
  Tokens/s counts the real tokens; MFU the flops of each sample at its own length (so padding
  is not counted as work): compare ``ragged-packed`` with ``torch-lean`` (no padding at all).
- ``rl-step``: a whole synchronous RL step without vLLM, random weights of the same model:
  rollout with the transformers engine (``HFRolloutEngine``, bf16, ``--rows`` / 4 prompts x 4
  samples, ``--gen`` tokens each with ``ignore_eos``), old log-probs, one packed + compiled
  update of the torch engine (bf16 autocast, lean head), weights pushed back to the rollout
  engine; reported: rollout tokens/s, train tokens/s and the step's seconds (median of
  ``--steps`` after ``--warmup``).
- ``megatron``, ``megatron-lean``: the same step on the Megatron-Core engine
  (:mod:`trainers.engines.megatron_train`, TP = PP = 1 over an NCCL world of 1, bf16 autocast over
  float32 weights as ``torch`` / ``torch-lean``; float32 on a CPU): its row beside the torch engine's.
- ``offload``: ``placement.offload_train`` on the torch and Megatron engines: device memory the
  training state holds after a step and after ``offload()``, and the seconds of ``offload()`` /
  ``onload()``.
- ``agree``: on CUDA, float32: one step of the torch engine and of FSDP2 (world 1) from the
  same tiny Qwen2 on the same batch (max abs weight difference), and the torch engine's
  lean log-probs and gradients against its plain ones.

    python benchmarks/bench_gpu.py                       # all cases (needs a CUDA GPU)
    python benchmarks/bench_gpu.py --cases logprobs agree
    python benchmarks/bench_gpu.py --device cpu --smoke  # tiny shapes on CPU: checks the script

Results are printed, not asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if __package__ in (None, "") and str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # run from a checkout

import torch  # noqa: E402

STEP_CASES = (
    "torch", "torch-lean", "torch-bf16", "lora", "fsdp2", "deepspeed2", "deepspeed3",
    "torch-packed", "torch-compiled", "torch-packed-compiled", "ragged-padded", "ragged-packed",
    "ragged-packed-compiled", "megatron", "megatron-lean",
)  # fmt: skip
CASES = ("logprobs", "agree", *STEP_CASES, "rl-step", "offload")

QWEN2_05B = dict(
    hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
    num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, rope_theta=1e6,
    tie_word_embeddings=True, rms_norm_eps=1e-6,
)  # fmt: skip
SMOKE = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=512, max_position_embeddings=512, tie_word_embeddings=True,
)  # fmt: skip


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _reset_peak(device: str) -> int:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    return 0


def _peak(device: str) -> int:
    return torch.cuda.max_memory_allocated() if device.startswith("cuda") else 0


# --------------------------------------------------------------------------- log-probs
def case_logprobs(a: argparse.Namespace) -> list[dict]:

    dev, rows = a.device, []
    H, vocabs, lengths = (64, (512,), (64,)) if a.smoke else (896, (49152, 151936), (2048, 8192))
    for V in vocabs:
        for T in lengths:
            N = a.lp_batch * T
            g = torch.Generator(device=dev).manual_seed(0)
            hid = torch.randn(N, H, device=dev, generator=g, dtype=torch.bfloat16).requires_grad_()
            w = (torch.randn(V, H, device=dev, generator=g, dtype=torch.bfloat16) * 0.02).requires_grad_()
            tok = torch.randint(0, V, (N,), device=dev, generator=g)

            fns = _lp_fns(hid, w, tok, a.chunk)
            for name, fn in fns.items():
                try:
                    fn()  # warm-up
                    hid.grad = w.grad = None
                    base = _reset_peak(dev)
                    fn()
                    _sync(dev)
                    peak = _peak(dev) - base
                    times = []
                    for _ in range(a.repeats):
                        hid.grad = w.grad = None
                        _sync(dev)
                        t0 = time.perf_counter()
                        fn()
                        _sync(dev)
                        times.append(time.perf_counter() - t0)
                    rows.append(dict(case="logprobs", path=name, V=V, T=T, N=N, H=H, peak_gib=peak / 2**30,
                                     ms=1e3 * statistics.median(times)))  # fmt: skip
                except torch.OutOfMemoryError:
                    rows.append(dict(case="logprobs", path=name, V=V, T=T, N=N, H=H, error="OOM"))
                hid.grad = w.grad = None
                if dev.startswith("cuda"):
                    torch.cuda.empty_cache()
    rows.append(_lean_agreement(dev))
    return rows


def _lp_fns(hid, w, tok, chunk: int) -> dict:
    from rollkit.logprobs import lean_token_logprobs, token_logprobs

    def plain():
        lp, ent = token_logprobs((hid @ w.T).float(), tok, with_entropy=True)
        (lp.sum() + ent.sum()).backward()

    def lean(mdt=None, fused=False):
        lp, ent = lean_token_logprobs(hid, w, tok, with_entropy=True, chunk_tokens=chunk, matmul_dtype=mdt,
                                      fused=fused)  # fmt: skip
        (lp.sum() + ent.sum()).backward()

    return {
        "plain": plain,
        "lean": lean,
        "lean bf16 matmul": lambda: lean(torch.bfloat16),
        "lean bf16 matmul, fused": lambda: lean(torch.bfloat16, fused=True),
    }


def _lean_agreement(dev: str) -> dict:
    from rollkit.logprobs import lean_token_logprobs, token_logprobs

    g = torch.Generator(device=dev).manual_seed(1)
    hid = torch.randn(1024, 128, device=dev, generator=g, requires_grad=True)
    w = torch.randn(8192, 128, device=dev, generator=g, requires_grad=True)
    tok = torch.randint(0, 8192, (1024,), device=dev, generator=g)
    out = {}
    for name, fn in (
        ("plain", lambda: token_logprobs(hid @ w.T, tok, temperature=0.9, top_k=50, top_p=0.95, with_entropy=True)),
        ("lean", lambda: lean_token_logprobs(hid, w, tok, temperature=0.9, top_k=50, top_p=0.95,
                                              with_entropy=True, chunk_tokens=100)),
    ):  # fmt: skip
        hid.grad = w.grad = None
        lp, ent = fn()
        (lp.sum() + 0.5 * ent.sum()).backward()
        out[name] = (lp.detach(), ent.detach(), hid.grad.clone(), w.grad.clone())
    d = [(x - y).abs().max().item() for x, y in zip(out["plain"], out["lean"], strict=True)]
    return dict(case="logprobs-agree", device=dev, dtype="float32", max_abs_logprob=d[0], max_abs_entropy=d[1],
                max_abs_grad_hidden=d[2], max_abs_grad_weight=d[3])  # fmt: skip


# --------------------------------------------------------------------------- train steps
def _model(cfg: dict, seed: int = 0):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    return Qwen2ForCausalLM(Qwen2Config(**cfg, attn_implementation="sdpa"))


def _batch(vocab: int, rows: int, prompt: int, response: int, seed: int = 0):
    from trainers.engines.base import pack

    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(4, vocab, (rows, prompt), generator=g).tolist()
    responses = torch.randint(4, vocab, (rows, response), generator=g).tolist()
    return pack(prompts, responses, pad_token_id=0)


def _ragged_batch(vocab: int, rows: int, prompt: int, response: int, seed: int = 0):
    from trainers.engines.base import pack

    g = torch.Generator().manual_seed(seed)
    x = torch.exp(torch.randn(rows, generator=g) * 1.4) * max(1.0, response / 24)
    lens = [int(min(max(1, round(float(v))), response)) for v in x]
    prompts = torch.randint(4, vocab, (rows, prompt), generator=g).tolist()
    responses = [torch.randint(4, vocab, (n,), generator=g).tolist() for n in lens]
    return pack(prompts, responses, pad_token_id=0)


def _engine(case: str, model, a: argparse.Namespace):
    dev, chunk = a.device, a.chunk
    bf16 = torch.bfloat16
    if case.startswith(("torch-packed", "torch-compiled", "ragged-")):
        from trainers.engines.torch_train import TorchTrainEngine

        compiled = case.endswith("compiled")
        return TorchTrainEngine(
            model, lr=1e-5, device=dev, share_prompts=False, autocast=bf16, logprob_chunk_tokens=chunk,
            packing="packed" in case, compile_backend="inductor" if compiled else None, fused_optimizer=compiled,
        )  # fmt: skip
    if case in ("torch", "torch-lean", "torch-bf16", "lora"):
        from trainers.engines.torch_train import TorchTrainEngine

        if case == "lora":
            from trainers.engines.lora import apply_lora

            model = apply_lora(model, rank=16)
        return TorchTrainEngine(
            model, lr=1e-5, device=dev, share_prompts=False,
            dtype=bf16 if case == "torch-bf16" else torch.float32,
            autocast=None if case == "torch-bf16" else bf16,
            logprob_chunk_tokens=0 if case == "torch" else chunk,
        )  # fmt: skip
    if case == "fsdp2":
        from trainers.engines.fsdp2_train import FSDP2TrainEngine

        return FSDP2TrainEngine(model, lr=1e-5, device=dev, mixed_precision=bf16, share_prompts=False,
                                logprob_chunk_tokens=chunk)  # fmt: skip
    if case in ("deepspeed2", "deepspeed3"):
        from trainers.engines.deepspeed_train import DeepSpeedTrainEngine

        stage = int(case[-1])
        return DeepSpeedTrainEngine(model, zero_stage=stage, lr=1e-5, device=dev, dtype=bf16, share_prompts=False,
                                    logprob_chunk_tokens=chunk if stage < 3 else 0)  # fmt: skip
    if case in ("megatron", "megatron-lean"):
        from trainers.engines.megatron_train import MegatronTrainEngine

        # bf16 autocast on CUDA (Megatron's linear layers autocast there only), float32 on a CPU
        return MegatronTrainEngine(model, lr=1e-5, device=dev, autocast=bf16 if dev.startswith("cuda") else None,
                                   logprob_chunk_tokens=chunk if case == "megatron-lean" else 0)  # fmt: skip
    raise ValueError(f"case: unknown {case!r}")


def _one_step(engine, b, micro: int, budget: int = 0) -> float:
    from rollkit.losses import aggregate, global_normalizers
    from rollkit.packing import pack_bins

    norms = global_normalizers(b.response_mask)
    total = 0.0
    rows = torch.arange(b.input_ids.shape[0])
    if budget:  # packed bins of real tokens, as train.max_tokens_per_micro_batch with train.packing
        groups = pack_bins(b.attention_mask.sum(-1).cpu(), budget)
    else:
        groups = [rows[lo : lo + micro] for lo in range(0, len(rows), micro)]
    for g in groups:
        mb = b[g.to(b.input_ids.device)]
        lp = engine.logprobs(mb.input_ids, mb.attention_mask, mb.response_mask)
        loss = aggregate(-lp, mb.response_mask, "token-mean", **norms)
        engine.backward(loss)
        total += float(loss.detach())
    engine.step()
    return total


def _flops_per_token(cfg: dict, seq: int) -> tuple[float, int]:
    H, L, inter, V = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"], cfg["vocab_size"]
    kv = H // cfg["num_attention_heads"] * cfg["num_key_value_heads"]
    per_layer = H * H + 2 * H * kv + H * H + 3 * H * inter  # q, k+v, o, gate/up/down
    n_matmul = L * per_layer + V * H  # + LM head
    return 6 * n_matmul + 12 * L * H * seq, n_matmul


def case_step(case: str, a: argparse.Namespace) -> list[dict]:
    dev = a.device
    cfg = SMOKE if a.smoke else QWEN2_05B
    model = _model(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    make = _ragged_batch if case.startswith("ragged-") else _batch
    b = make(cfg["vocab_size"], a.rows, a.prompt, a.response)
    budget = (
        a.micro * (a.prompt + a.response) // 4 if case in ("ragged-packed", "ragged-packed-compiled") else 0
    )
    b = type(b)(**{k: (v.to(dev) if isinstance(v, torch.Tensor) else v) for k, v in vars(b).items()})
    base = _reset_peak(dev)
    engine = _engine(case, model, a)
    losses, times = [], []
    for i in range(a.warmup + a.steps):
        _sync(dev)
        t0 = time.perf_counter()
        losses.append(_one_step(engine, b, a.micro, budget))
        _sync(dev)
        if i >= a.warmup:
            times.append(time.perf_counter() - t0)
    s = statistics.median(times)
    lens = b.attention_mask.sum(-1).cpu().tolist()
    tokens = int(sum(lens))
    flops = sum(n * _flops_per_token(cfg, n)[0] for n in lens)  # each sample at its own length
    n_matmul = _flops_per_token(cfg, a.prompt + a.response)[1]
    tps = tokens / s
    row = dict(case=case, device=dev, params=n_params, matmul_params=n_matmul, rows=a.rows,
               seq=a.prompt + a.response, micro=a.micro, tokens=tokens, s_per_step=s, tokens_per_s=tps,
               batch_padding_frac=1 - tokens / b.attention_mask.numel(), budget=budget,
               mfu=flops / s / (a.peak_tflops * 1e12), peak_gib=(_peak(dev) - base) / 2**30,
               loss_first=losses[0], loss_last=losses[-1], finite=all(map(lambda x: x == x, losses)))  # fmt: skip
    if case == "fsdp2" and torch.distributed.is_initialized():
        row["backend"] = torch.distributed.get_backend()
    if case.startswith("deepspeed"):
        import deepspeed

        row["deepspeed"] = deepspeed.__version__
        row["backend"] = torch.distributed.get_backend() if torch.distributed.is_initialized() else None
    return [row]


def case_rl_step(a: argparse.Namespace) -> list[dict]:
    import copy
    from types import SimpleNamespace

    from trainers.engines.base import SamplingParams, pack_generations
    from trainers.engines.hf_rollout import HFRolloutEngine

    dev, cfg = a.device, SMOKE if a.smoke else QWEN2_05B
    model = _model(cfg)
    tok = SimpleNamespace(eos_token_id=1, pad_token_id=0)
    low = torch.bfloat16 if dev.startswith("cuda") else torch.float32
    rollout = HFRolloutEngine(copy.deepcopy(model), tok, device=dev, dtype=low)
    engine = _engine("ragged-packed-compiled", model, a)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(4, cfg["vocab_size"], (max(1, a.rows // 4), a.prompt), generator=g).tolist()
    params = SamplingParams(n=4, temperature=1.0, max_tokens=a.gen, ignore_eos=True, seed=0)
    times, roll, train = [], [], []
    for i in range(a.warmup + a.steps):
        _sync(dev)
        t0 = time.perf_counter()
        gens = rollout.generate(prompts, params)
        _sync(dev)
        t1 = time.perf_counter()
        b = pack_generations(gens, 0)
        b = type(b)(**{k: (v.to(dev) if isinstance(v, torch.Tensor) else v) for k, v in vars(b).items()})
        budget = a.micro * (a.prompt + a.gen) // 4
        _one_step(engine, b, a.micro, budget)
        rollout.update_weights(engine.export_weights(), version=i + 1)
        _sync(dev)
        t2 = time.perf_counter()
        if i >= a.warmup:
            gen_tokens = sum(len(x.token_ids) for x in gens)
            times.append(t2 - t0)
            roll.append(gen_tokens / (t1 - t0))
            train.append(int(b.attention_mask.sum()) / (t2 - t1))
    return [dict(case="rl-step", device=dev, rows=len(prompts) * 4, prompt=a.prompt, gen=a.gen,
                 s_per_step=statistics.median(times), rollout_tokens_per_s=statistics.median(roll),
                 train_tokens_per_s=statistics.median(train))]  # fmt: skip


def case_offload(a: argparse.Namespace) -> list[dict]:
    """``placement.offload_train``: device memory held by the torch and Megatron engines' state
    after a step (weights, gradients of the next micro-batch, AdamW moments), after ``offload()``,
    and the seconds of ``offload()`` / ``onload()`` (median of ``--repeats``)."""
    dev, cfg = a.device, SMOKE if a.smoke else QWEN2_05B
    b = _batch(cfg["vocab_size"], a.rows, a.prompt, a.response)
    b = type(b)(**{k: (v.to(dev) if isinstance(v, torch.Tensor) else v) for k, v in vars(b).items()})
    out = []
    for case in ("torch-lean", "megatron-lean"):
        engine = _engine(case, _model(cfg), a)
        _one_step(engine, b, a.micro)
        mb = b[torch.arange(min(a.micro, a.rows), device=b.input_ids.device)]
        engine.backward(engine.logprobs(mb.input_ids, mb.attention_mask, mb.response_mask).sum() * 0)
        _sync(dev)
        held = torch.cuda.memory_allocated() if dev.startswith("cuda") else 0
        t_off, t_on = [], []
        for _ in range(a.repeats):
            t0 = time.perf_counter()
            engine.offload()
            _sync(dev)
            t1 = time.perf_counter()
            after = torch.cuda.memory_allocated() if dev.startswith("cuda") else 0
            engine.onload()
            _sync(dev)
            t_off.append(t1 - t0)
            t_on.append(time.perf_counter() - t1)
        out.append(dict(case="offload", engine=case, device=dev, held_gib=held / 2**30, offloaded_gib=after / 2**30,
                        offload_s=statistics.median(t_off), onload_s=statistics.median(t_on)))  # fmt: skip
        del engine
    return out


# --------------------------------------------------------------------------- agreement
def case_agree(a: argparse.Namespace) -> list[dict]:
    from trainers.engines.fsdp2_train import FSDP2TrainEngine
    from trainers.engines.torch_train import TorchTrainEngine

    dev, cfg = a.device, SMOKE
    b = _batch(cfg["vocab_size"], 8, 16, 24)
    b = type(b)(**{k: (v.to(dev) if isinstance(v, torch.Tensor) else v) for k, v in vars(b).items()})
    te = TorchTrainEngine(_model(cfg), lr=1e-3, device=dev)
    fe = FSDP2TrainEngine(_model(cfg), lr=1e-3, device=dev)
    _one_step(te, b, 4)
    _one_step(fe, b, 4)
    tw, fw = dict(te.export_weights()), dict(fe.export_weights())
    d_fsdp = max((tw[k].float().cpu() - fw[k].float().cpu()).abs().max().item() for k in tw)
    moved = max((tw[k].float().cpu() - v.float()).abs().max().item() for k, v in _model(cfg).state_dict().items()
                if k in tw)  # fmt: skip
    out = dict(case="agree", device=dev, backend=torch.distributed.get_backend(), fsdp2_vs_torch_max_abs=d_fsdp,
               step_moved_max_abs=moved)  # fmt: skip
    # lean vs plain log-probs and gradients through the torch engine
    grads = {}
    for chunk in (0, 7):
        e = TorchTrainEngine(_model(cfg), lr=1e-3, device=dev, logprob_chunk_tokens=chunk)
        lp = e.logprobs(b.input_ids, b.attention_mask, b.response_mask, temperature=0.8, top_k=40, top_p=0.9)
        lp.sum().backward()
        grads[chunk] = (lp.detach(), [p.grad.clone() for p in e.model.parameters()])
    out["lean_vs_plain_logprob_max_abs"] = (grads[0][0] - grads[7][0]).abs().max().item()
    out["lean_vs_plain_grad_max_abs"] = max(
        (x - y).abs().max().item() for x, y in zip(grads[0][1], grads[7][1])
    )
    return [out]


# --------------------------------------------------------------------------- driver
def _run_case(case: str, a: argparse.Namespace) -> list[dict]:
    if case == "logprobs":
        return case_logprobs(a)
    if case == "agree":
        return case_agree(a)
    if case == "rl-step":
        return case_rl_step(a)
    if case == "offload":
        return case_offload(a)
    return case_step(case, a)


def _table(rows: list[dict]) -> str:
    out = []
    lp = [r for r in rows if r.get("case") == "logprobs"]
    if lp:
        out += ["| V | T | N | path | extra peak GiB | ms (fwd+bwd) |", "|---|---|---|---|---|---|"]
        for r in lp:
            peak = f"{r['peak_gib']:.2f}" if "peak_gib" in r else r.get("error", "")
            ms = f"{r['ms']:.1f}" if "ms" in r else ""
            out.append(f"| {r['V']} | {r['T']} | {r['N']} | {r['path']} | {peak} | {ms} |")
        out.append("")
    st = [r for r in rows if r.get("case") in STEP_CASES and "tokens_per_s" in r]
    if st:
        out += [
            "| case | s/step | tokens/s | MFU | peak GiB | loss first -> last |",
            "|---|---|---|---|---|---|",
        ]
        for r in st:
            out.append(f"| {r['case']} | {r['s_per_step']:.3f} | {r['tokens_per_s']:.0f} | {100 * r['mfu']:.1f}% | "
                       f"{r['peak_gib']:.1f} | {r['loss_first']:.3f} -> {r['loss_last']:.3f} |")  # fmt: skip
        out.append("")
    for r in rows:
        if r.get("case") in ("agree", "logprobs-agree", "env", "rl-step") or (
            "error" in r and r.get("case") != "logprobs"
        ):
            out.append("- " + json.dumps(r))
    return "\n".join(out)


def _env(device: str) -> dict:
    import importlib.metadata as md

    info = dict(case="env", torch=torch.__version__, cuda=torch.version.cuda)
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name(0)
    for name in ("transformers", "peft", "tensordict", "deepspeed"):
        try:
            info[name] = md.version(name)
        except md.PackageNotFoundError:
            info[name] = None
    return info


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    p.add_argument("--device", default="cuda")
    p.add_argument("--smoke", action="store_true", help="tiny shapes (checks the script, e.g. on CPU)")
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--response", type=int, default=1536)
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--gen", type=int, default=512, help="tokens generated per sample in the rl-step case")
    p.add_argument("--chunk", type=int, default=1024, help="lean log-prob chunk (positions)")
    p.add_argument("--lp-batch", type=int, default=4, help="rows of the log-prob case (N = rows x T)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--peak-tflops", type=float, default=989.4)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per case")
    p.add_argument("--out", type=Path, default=None, help="also write the table and JSON lines here")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.smoke:
        a.rows, a.prompt, a.response, a.micro, a.chunk, a.lp_batch, a.gen = 4, 8, 16, 2, 5, 1, 8
        a.warmup, a.steps, a.repeats = 1, 1, 1
    if a.one:
        try:
            rows = _run_case(a.one, a)
        except Exception as e:  # reported as a row: one case's failure must not hide the others
            rows = [dict(case=a.one, error=f"{type(e).__name__}: {e}", trace=traceback.format_exc()[-2000:])]
        for r in rows:
            print("@@" + json.dumps(r), flush=True)
        return
    rows = [_env(a.device)]
    forwarded = [x for x in (argv if argv is not None else sys.argv[1:])]
    for case in a.cases:
        cmd = [sys.executable, __file__, *forwarded, "--one", case]
        env = dict(os.environ, MASTER_PORT=str(29500 + CASES.index(case)))
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout, env=env)
            got = [json.loads(line[2:]) for line in proc.stdout.splitlines() if line.startswith("@@")]
            if not got:
                got = [dict(case=case, error=f"exit {proc.returncode}", stderr=proc.stderr[-2000:])]
        except subprocess.TimeoutExpired:
            got = [dict(case=case, error=f"timed out after {a.timeout:.0f} s")]
        for r in got:
            r["wall_s"] = round(time.perf_counter() - t0, 1)
            print(json.dumps(r), flush=True)
        rows += got
    table = _table(rows)
    print(table)
    if a.out:
        a.out.write_text(table + "\n\n" + "\n".join(json.dumps(r) for r in rows) + "\n")


if __name__ == "__main__":
    main()
