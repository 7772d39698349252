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
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

try:
    import trainers  # noqa: F401
except ImportError:  # run as a script from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

# bench_rollout's side-by-side timing of the two engines, loaded by path
_spec = importlib.util.spec_from_file_location("_bench_rollout", Path(__file__).with_name("bench_rollout.py"))
_bench_rollout = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_bench_rollout)  # type: ignore[union-attr]
compare_engines = _bench_rollout.compare_engines


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
        return compare_engines(d, HFRolloutEngine(model, tok, device=args.device), prompts, params, args.repeats)

if __name__ == "__main__":
    main()
