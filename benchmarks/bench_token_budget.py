"""Benchmark: micro-batches by token budget against fixed-size micro-batches, on a long-tailed
length mix (``train.max_tokens_per_micro_batch`` vs ``train.micro_batch_size``).

One batch of ``--batch`` responses whose lengths follow a log-normal (median ``--median``,
sigma ``--sigma``, capped at ``--cap``) after ``--prompt``-token prompts, on a random-weight
Qwen2-config model (``--hidden``, ``--layers``, vocabulary ``--vocab``). Three ways to split it,
the same rows and tokens every time (equal work): fixed micro-batches of ``--mbs`` rows in
batch order, the same sorted by length (``train.sort_by_length``), and packed longest-first
up to ``--budget`` computed tokens. Each mode runs one ``ppo_update`` (SGD, one epoch) per
round, the modes taking turns for ``--repeats`` rounds after a warm-up round, so machine load
affects them alike; prints the padding share (computed tokens that are padding), the number
of micro-batches, the median seconds per update and the ratio to fixed micro-batches. The
gradient is the same in every mode (tests/trainers/test_token_budget.py); results are printed,
not asserted.

    python benchmarks/bench_token_budget.py              # a few minutes on 2 CPU cores
    python benchmarks/bench_token_budget.py --quick      # smoke run
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
from trainers.learner import UpdateSpec, ppo_update


def lengths(n: int, median: float, sigma: float, cap: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    x = torch.exp(torch.randn(n, generator=g) * sigma) * median
    return [int(min(max(1, round(float(v))), cap)) for v in x]


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--median", type=float, default=48)
    ap.add_argument("--sigma", type=float, default=1.0)
    ap.add_argument("--cap", type=int, default=512)
    ap.add_argument("--mbs", type=int, default=8)
    ap.add_argument(
        "--budget", type=int, default=0, help="tokens per micro-batch (0: mbs x (prompt + 2 x median))"
    )
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    ap.add_argument("--quick", action="store_true", help="a short smoke run")
    a = ap.parse_args(argv)
    if a.quick:
        a.batch, a.median, a.cap, a.hidden, a.layers, a.vocab, a.repeats = 16, 8, 64, 32, 1, 256, 1
    torch.set_num_threads(a.threads or max(1, os.cpu_count() or 1))
    budget = a.budget or int(a.mbs * (a.prompt + 2 * a.median))
    tf = require("transformers")
    cfg = tf.Qwen2Config(
        vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=4 * a.hidden, num_hidden_layers=a.layers,
        num_attention_heads=max(1, a.hidden // 64), num_key_value_heads=max(1, a.hidden // 128),
        max_position_embeddings=a.prompt + a.cap + 8,
    )  # fmt: skip
    torch.manual_seed(0)
    model = tf.Qwen2ForCausalLM(cfg)
    g = torch.Generator().manual_seed(1)
    lens = lengths(a.batch, a.median, a.sigma, a.cap, seed=2)
    prompts = [torch.randint(1, a.vocab, (a.prompt,), generator=g).tolist() for _ in lens]
    responses = [torch.randint(1, a.vocab, (n,), generator=g).tolist() for n in lens]
    b = pack(prompts, responses, 0)
    b.old_logprobs = torch.zeros(b.response_mask.shape)
    adv = torch.randn(a.batch, generator=g)[:, None] * b.response_mask
    modes = {
        f"fixed {a.mbs} rows": UpdateSpec(micro_batch_size=a.mbs),
        f"fixed {a.mbs} rows, sorted": UpdateSpec(micro_batch_size=a.mbs, sort_by_length=True),
        f"budget {budget} tokens": UpdateSpec(max_tokens_per_micro_batch=budget),
    }
    times: dict[str, list[float]] = {k: [] for k in modes}
    info: dict[str, dict[str, float]] = {}
    for i in range(a.repeats + 1):
        for name, spec in modes.items():
            eng = TorchTrainEngine(
                copy.deepcopy(model), optimizer_factory=lambda p: torch.optim.SGD(p, lr=1e-3)
            )
            t0 = time.perf_counter()
            m = ppo_update(eng, StepBatch.from_packed(b, advantages=adv), spec).metrics()
            if i:
                times[name].append(time.perf_counter() - t0)
            info[name] = {"padding_frac": m["train/padding_frac"]}
    base = statistics.median(times[next(iter(modes))])
    tokens = int(b.attention_mask.sum())
    print(
        f"Qwen2 config, random weights: hidden {a.hidden}, {a.layers} layers, vocab {a.vocab}; "
        f"{a.batch} responses, lengths lognormal(median {a.median:g}, sigma {a.sigma:g}) capped at {a.cap} "
        f"(min {min(lens)}, median {statistics.median(lens):g}, max {max(lens)}), prompts {a.prompt}; "
        f"{tokens} real tokens; float32, {torch.get_num_threads()} threads, median of {a.repeats}"
    )
    print(f"{'mode':<28} {'padding':>8} {'s/update':>9} {'vs fixed':>9}")
    for name, ts in times.items():
        med = statistics.median(ts)
        info[name].update(seconds=med, ratio=med / base)
        print(f"{name:<28} {info[name]['padding_frac']:>8.3f} {med:>9.2f} {med / base:>8.2f}x")
    return info


if __name__ == "__main__":
    main()
