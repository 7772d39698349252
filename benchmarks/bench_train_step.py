"""Benchmark: one training step of the recipe's batch, float32 vs bfloat16 autocast, with and
without the shared-prompt forward of :class:`~trainers.engines.TorchTrainEngine`.

The batch is the recipe's: 4 chat-formatted addition prompts x 8 samples of 12 tokens, micro-
batches of 16, forward + backward of a token-mean log-prob loss (no optimizer step, so every
variant sees the same weights). The four variants take turns, ``--repeats`` rounds after one
warm-up round; the median time of each and its ratio to float32 without sharing are printed.

    python benchmarks/bench_train_step.py                    # SmolLM2-135M-Instruct (embedded default)
    python benchmarks/bench_train_step.py --model tiny --repeats 1   # smoke run

bfloat16 autocast is fast on CPUs with AMX (and on CUDA); elsewhere it may be slower.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
try:
    import trainers  # noqa: F401
except ImportError:  # run as a script from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="", help="HF checkpoint dir; '' = SmolLM2 (default); 'tiny'")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads or max(1, os.cpu_count() or 1))

    from rollkit.losses import aggregate
    from trainers.data import addition_task, encode_prompt
    from trainers.engines import TorchTrainEngine, pack
    from trainers.engines.build import fast_bf16
    from trainers.models import char_tokenizer, default_model_path, load_model, tiny_qwen2

    if args.model == "tiny":
        tok = char_tokenizer()
        model = tiny_qwen2(tok, seed=0)
    else:
        model, tok = load_model(args.model or default_model_path())
    prompts, _ = addition_task(digits=2, eval_size=10, seed=0)
    ids = [encode_prompt(tok, p) for p in prompts[:4]]
    g = torch.Generator().manual_seed(0)
    vocab = min(len(tok), model.config.vocab_size)
    resp = [torch.randint(0, vocab, (12,), generator=g).tolist() for _ in range(32)]
    batch = pack([i for i in ids for _ in range(8)], resp, tok.pad_token_id or 0)

    variants = {
        "float32": dict(share_prompts=False),
        "float32, shared prompts": dict(share_prompts=True),
        "bf16 autocast": dict(share_prompts=False, autocast=torch.bfloat16),
        "bf16 autocast, shared prompts": dict(share_prompts=True, autocast=torch.bfloat16),
    }
    engines = {name: TorchTrainEngine(model, **kw) for name, kw in variants.items()}  # one set of weights

    def step(engine) -> float:
        t0 = time.perf_counter()
        for u in range(0, 32, 16):
            mb = batch[slice(u, u + 16)]
            lp = engine.logprobs(mb.input_ids, mb.attention_mask, mb.response_mask, temperature=0.7)
            engine.backward(-aggregate(lp, mb.response_mask))
        engine.zero_grad()
        return time.perf_counter() - t0

    times: dict[str, list[float]] = {name: [] for name in engines}
    for r in range(args.repeats + 1):
        for name, engine in engines.items():
            t = step(engine)
            if r:  # the first round warms up (oneDNN builds its kernels per shape)
                times[name].append(t)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    base = med["float32"]
    print(
        f"\ntrain step (fwd+bwd), model {args.model or 'SmolLM2-135M-Instruct'}, 4 prompts x 8 samples x 12 "
        f"tokens, prompt {len(ids[0])} tokens, micro-batch 16, {torch.get_num_threads()} threads, "
        f"AMX/fast bf16: {fast_bf16('cpu')}"
    )
    print(f"{'variant':<32}{'s/step':>10}{'speedup':>10}")
    for name, t in med.items():
        print(f"{name:<32}{t:>10.3f}{base / t:>9.2f}x")
    return med


if __name__ == "__main__":
    main()
