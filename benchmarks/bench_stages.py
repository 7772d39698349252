"""Per-stage time of one sync-trainer step: in-process vs Ray colocated vs Ray disaggregated.

The tiny Qwen2 (character tokenizer, 1-digit addition), the same config for the three
placements; each runs one untimed step (warm-up), then ``--steps`` timed steps, and the
table prints the mean seconds per step of each stage (``time/*`` metrics of
:meth:`trainers.loops.SyncTrainer.step`: rollout, reward, reference, offload (the
colocated rollout's sleep), train, weight_sync) and the time to build the roles. Results are
printed, never asserted; compare columns of one run only.

    python benchmarks/bench_stages.py --quick                       # < 60 s on 2 cores
    python benchmarks/bench_stages.py --steps 10 --kl 0.05
    python benchmarks/bench_stages.py --rollout vllm --train deepspeed

Ray runs locally (``ray.init(num_cpus=--cpus)``). Colocated: one bundle of ``--cpus`` CPUs
shared by the rollout, train and reference actors; disaggregated: one CPU bundle per actor.
In-process runs with ``--cpus`` torch threads.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

STAGES = ("rollout", "reward", "reference", "offload", "train", "weight_sync", "step")


def run(mode: str, args: argparse.Namespace, model, tok) -> dict[str, float]:
    import torch

    from trainers.config import load_config
    from trainers.loops import SyncTrainer

    over = [
        "--model",
        "tiny",
        "data.digits=1",
        "data.eval_size=10",
        f"rollout.prompts_per_step={args.prompts}",
        f"rollout.n={args.n}",
        "rollout.max_tokens=4",
        f"train.micro_batch_size={args.prompts * args.n}",
        "train.lr=1e-4",
        f"algorithm.kl.coef={args.kl}",
        "logging.progress=false",
        "logging.tensorboard=false",
        "logging.plot=false",
        "logging.dir=runs/bench_stages",
        f"--rollout={args.rollout}",
        f"--train={args.train}",
        "rollout.max_model_len=64",
        "rollout.prompts_per_request=2",
    ]
    if mode != "in-process":
        placement = mode.split()[-1]
        cpus = args.cpus if placement == "colocated" else max(args.cpus // 2, 1)
        over += ["ray.enabled=true", f"placement.mode={placement}", f"placement.cpus_per_worker={cpus}"]
    cfg = load_config(over)
    torch.set_num_threads(args.cpus)
    t0 = time.perf_counter()
    tr = SyncTrainer(cfg, model=copy.deepcopy(model), tokenizer=tok)
    out = {"build": time.perf_counter() - t0}
    try:
        tr.step()  # warm-up
        sums: dict[str, float] = {}
        for _ in range(args.steps):
            m = tr.step()
            for s in STAGES:
                sums[s] = sums.get(s, 0.0) + m.get(f"time/{s}", 0.0)
        out.update({s: v / args.steps for s, v in sums.items()})
    finally:
        tr.close()
    return out


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2 timed steps, small batch (< 60 s)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--kl", type=float, default=0.05, help="> 0 adds the reference role")
    ap.add_argument("--cpus", type=int, default=2)
    ap.add_argument("--rollout", default="hf", choices=("hf", "vllm"))
    ap.add_argument("--train", default="torch", choices=("torch", "deepspeed"))
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.prompts, args.n = 2, 4, 8

    import ray

    from trainers.models import char_tokenizer, tiny_qwen2

    tok = char_tokenizer()
    heads = (2, 1) if args.rollout == "vllm" else (4, 2)  # vLLM's CPU attention needs head size 32
    model = tiny_qwen2(tok, seed=0, heads=heads[0], kv_heads=heads[1])
    t0 = time.perf_counter()
    ray.init(
        num_cpus=args.cpus, object_store_memory=100 * 2**20, include_dashboard=False, log_to_driver=False
    )
    ray_init = time.perf_counter() - t0
    results = {}
    try:
        for mode in ("in-process", "ray colocated", "ray disaggregated"):
            results[mode] = run(mode, args, model, tok)
    finally:
        ray.shutdown()
    modes = list(results)
    print(
        f"\nper-stage seconds per step ({args.rollout} + {args.train}, {args.prompts} prompts x {args.n} samples, "
        f"KL {'on' if args.kl > 0 else 'off'}, {args.steps} steps; ray.init {ray_init:.1f}s)"
    )
    print(f"{'stage':<12}" + "".join(f"{m:>20}" for m in modes))
    for s in ("build", *STAGES):
        print(f"{s:<12}" + "".join(f"{results[m].get(s, 0.0):>20.3f}" for m in modes))
    base = results["in-process"]["step"]
    print(f"{'step ratio':<12}" + "".join(f"{results[m]['step'] / base:>19.2f}x" for m in modes))
    return results


if __name__ == "__main__":
    main()
