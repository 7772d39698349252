"""Tail batching (RollPacker) vs plain synchronous RL on the W1 long-tail workload.

W1 (docs/benchmarks.md; :mod:`trainers.loops.lengths`): every response gets its own
``max_tokens`` drawn from a log-normal distribution clipped to a cap and generates with
``ignore_eos``, so a step's longest response is about 25x its median (RollPacker, Gao et al.
2025, arXiv:2509.21009, Table 1). Both modes run :class:`~trainers.loops.SyncTrainer` with the
same model, engine, threads, seed and trained samples per step (``--prompts`` x ``--n``),
through the request-level rollout engine: **sync** (each step waits for its longest response)
and **tail batching** (``tail_batching.enabled=true``: short rounds over-provision prompts and
responses and keep the first to finish; the prompts that lost the race are trained later, in a
long round). Each mode runs ``--warmup`` untimed steps, then ``--steps`` timed steps; the table
gives the median and mean seconds per step (with ``P0 = 8`` and ``eta = 1.25`` one step in five
is a long round: the mean over whole cycles is the end-to-end figure), the median rollout
seconds, the rollout share and the speed-ups. Results are printed, never asserted; compare the
rows of one run only. The measured table: docs/scheduling.md.

    python benchmarks/bench_tail_batching.py                       # default model, vLLM if importable
    python benchmarks/bench_tail_batching.py --model tiny --engine hf --steps 4 --prompts 4 --n 4  # smoke

``--model default`` is SmolLM2-135M-Instruct (cap 512 by default); ``--model tiny`` the tiny
Qwen2 of the tests (cap 64 by default).

``--epoch K`` times one epoch of ``K`` fixed prompts instead, sync and tail batching in this
process, with trained tokens per second as the headline (``run_epoch`` of bench_async.py, which
also runs async on Ray; the accounting is described there):

    python benchmarks/bench_tail_batching.py --epoch 32 --prompts 4 --n 4 --micro-batch 8
"""

from __future__ import annotations

import argparse
import copy
import gc
import importlib.util
import os
import shlex
import statistics
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")

try:
    import trainers  # noqa: F401
except ImportError:  # run as a script from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

MODES = ("sync", "tail batching")


def overrides(args: argparse.Namespace, mode: str) -> list[str]:
    """The trainer config of one mode (everything but ``tail_batching.enabled`` is shared)."""
    tiny = args.model == "tiny"
    over = [
        "--model",
        "tiny" if tiny else "",
        f"--rollout={args.engine}",
        f"train.device={args.device}",
        "data.digits=1" if tiny else "data.digits=2",
        "data.eval_size=10",
        f"rollout.prompts_per_step={args.prompts}",
        f"rollout.n={args.n}",
        f"rollout.max_tokens={args.cap}",
        f"rollout.length_dist={args.length_dist}",
        f"rollout.chunk_tokens={args.chunk_tokens}",
        f"train.micro_batch_size={args.micro_batch}",
        "train.sort_by_length=true",
        "rollout.dtype=auto",
        "train.autocast=auto",
        f"rollout.gpu_memory_utilization={args.gpu_memory_utilization}",
        f"tail_batching.enabled={'true' if mode == 'tail batching' else 'false'}",
        f"tail_batching.eta_prompts={args.eta_prompts}",
        f"tail_batching.eta_responses={args.eta_responses}",
        f"seed={args.seed}",
        "logging.progress=false",
        "logging.tensorboard=false",
        "logging.plot=false",
        "logging.dir=runs/bench_tail_batching",
    ]
    if tiny and args.engine == "vllm":  # vLLM's CPU attention needs a head size of 32
        over += ["model.tiny_heads=2", "model.tiny_kv_heads=1", f"rollout.max_model_len={args.cap + 64}"]
    elif args.engine == "vllm":
        over += [f"rollout.max_model_len={args.cap + 128}"]
    return over


def run_mode(mode: str, args: argparse.Namespace, model, tok) -> dict[str, object]:
    """Warm-up + timed steps of one mode: per-step metrics of the timed steps."""
    from trainers.config import load_config
    from trainers.loops import SyncTrainer

    cfg = load_config(overrides(args, mode))
    tr = SyncTrainer(cfg, model=copy.deepcopy(model), tokenizer=tok)
    try:
        for _ in range(args.warmup):
            tr.step()
        steps = [tr.step() for _ in range(args.steps)]
    finally:
        tr.close()
        shutdown = getattr(tr.rollout, "shutdown", None)
        if callable(shutdown):
            shutdown()
        del tr
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    step = [m["time/step"] for m in steps]
    rollout = [m.get("time/rollout", 0.0) for m in steps]
    return {
        "step_median": statistics.median(step),
        "step_mean": statistics.fmean(step),
        "rollout_median": statistics.median(rollout),
        "rollout_share": statistics.median(rollout) / max(statistics.median(step), 1e-12),
        "steps": step,
        "rollout": rollout,
        "train": [m.get("time/train", 0.0) for m in steps],
        "long_rounds": sum(m.get("tail/round", 0.0) for m in steps),
        "aborted": statistics.fmean(m.get("tail/aborted_responses", 0.0) for m in steps),
        "launched": statistics.fmean(m.get("tail/launched_responses", args.prompts * args.n) for m in steps),
        "length": statistics.fmean(m["response/length_mean"] for m in steps),
    }


def run_epoch(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """``--epoch``: sync and tail batching over one epoch of ``args.epoch`` fixed prompts."""
    spec_ = importlib.util.spec_from_file_location("_bench_async", Path(__file__).with_name("bench_async.py"))
    ba = importlib.util.module_from_spec(spec_)
    spec_.loader.exec_module(ba)  # type: ignore[union-attr]
    try:
        spec = ba.EpochSpec(
            args.epoch,
            ["sync", "tail batching"],
            "process",
            "tiny" if args.model == "tiny" else "",
            args.engine,
            args.prompts,
            args.n,
            args.length_dist,
            args.cap,
            args.micro_batch,
            args.eta_prompts,
            args.eta_responses,
            args.seed,
            args.threads,
        )
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    return ba.run_epoch(spec)


def main(argv: list[str] | None = None) -> dict[str, dict[str, object]]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default", choices=("default", "tiny"))
    ap.add_argument(
        "--engine", default="auto", choices=("auto", "hf", "vllm"), help="auto: vllm if importable"
    )
    ap.add_argument("--steps", type=int, default=10, help="timed steps per mode")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps per mode first")
    ap.add_argument("--prompts", type=int, default=8, help="P0: prompts trained per step")
    ap.add_argument("--n", type=int, default=8, help="R0: responses per prompt")
    ap.add_argument("--length-dist", default="lognormal:16:1.5", help="W1: lognormal:MEDIAN:SIGMA")
    ap.add_argument("--cap", type=int, default=None, help="max_tokens (default 512; tiny model 64)")
    ap.add_argument("--eta-prompts", type=float, default=1.25)
    ap.add_argument("--eta-responses", type=float, default=1.25)
    ap.add_argument("--chunk-tokens", type=int, default=16, help="hf engine: tokens per request step")
    ap.add_argument(
        "--micro-batch", type=int, default=None, help="train micro-batch (default P0 x R0, max 16)"
    )
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.3, help="vLLM on GPUs")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--epoch", type=int, default=0, help="K > 0: time one epoch of K fixed prompts per mode")
    args = ap.parse_args(argv)
    if args.engine == "auto":
        args.engine = "vllm" if importlib.util.find_spec("vllm") is not None else "hf"
    if args.cap is None:
        args.cap = 64 if args.model == "tiny" else 512
    if args.micro_batch is None:
        args.micro_batch = min(args.prompts * args.n, 16)
    for name in ("steps", "prompts", "n", "cap", "chunk_tokens", "micro_batch", "threads"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    torch.set_num_threads(args.threads)
    if args.epoch:
        return run_epoch(args)

    from trainers.config import load_config
    from trainers.engines.build import build_model

    model, tok = build_model(load_config(overrides(args, "sync")))
    results = {mode: run_mode(mode, args, model, tok) for mode in MODES}

    base = results["sync"]
    print(
        f"\nW1 long-tail rollout: {args.model} model, {args.engine} engine on {args.device} "
        f"({args.threads} threads), {args.prompts} prompts x {args.n} responses trained per step, "
        f"lengths {args.length_dist} capped at {args.cap}, eta {args.eta_prompts:g}/{args.eta_responses:g}, "
        f"{args.steps} timed steps (+{args.warmup} warm-up) per mode"
    )
    print(
        f"{'mode':<15}{'step median s':>15}{'step mean s':>13}{'rollout med s':>15}{'rollout share':>15}"
        f"{'speedup (median)':>18}{'speedup (mean)':>16}"
    )
    for mode, r in results.items():
        print(
            f"{mode:<15}{r['step_median']:>15.3f}{r['step_mean']:>13.3f}{r['rollout_median']:>15.3f}"
            f"{100 * r['rollout_share']:>14.0f}%"
            f"{base['step_median'] / r['step_median']:>17.2f}x{base['step_mean'] / r['step_mean']:>15.2f}x"
        )
    print()
    t = results["tail batching"]
    print(
        f"tail batching: {t['long_rounds']:.0f} long rounds of {args.steps}; per step "
        f"{t['launched']:.1f} responses launched, {t['aborted']:.1f} aborted; mean trained length "
        f"{t['length']:.1f} tokens (sync {base['length']:.1f})"
    )
    for mode, r in results.items():
        print(f"{mode} seconds per step: " + " ".join(f"{s:.2f}" for s in r["steps"]))
        for part in ("rollout", "train"):
            print(f"{mode} {part} seconds per step: " + " ".join(f"{s:.2f}" for s in r[part]))
    cmd = [
        "python benchmarks/bench_tail_batching.py",
        *(f"--{k.replace('_', '-')} {shlex.quote(str(v))}" for k, v in vars(args).items()),
    ]
    print("command: " + " ".join(cmd))
    return results


if __name__ == "__main__":
    main()
