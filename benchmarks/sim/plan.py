"""Plan a run: predicted s/step and trained tokens/s of sync, async and tail batching.

    python -m benchmarks.sim.plan --lengths lognormal:median=1500,sigma=1.0,cap=16384 \\
        --model-size 7B --rollout-gpus 24 --train-gpus 8
    python -m benchmarks.sim.plan --lengths-file past.jsonl --model-size 14B --rollout-gpus 48 --train-gpus 16

Sync and tail batching run colocated on all ``rollout + train`` GPUs (rollout, then training on
every GPU); async runs rollout on ``--rollout-gpus`` and training on ``--train-gpus`` at every
ratio of ``--ratios``. The costs are :func:`benchmarks.sim.costs.gpu_model` (H800 assumptions,
training efficiency fitted to the papers' stage shares, ``--mfu`` to override; docs/simulator.md); ``--lengths-file`` is a JSONL of past response lengths (``{"length": n}``
or a bare number per line). Tokens/s counts the trained response tokens, so a mode that trains
shorter responses does not win by it.
"""

from __future__ import annotations

import argparse
import sys

from benchmarks.sim.costs import PAPER_MFU, gpu_model
from benchmarks.sim.lengths import Lengths
from benchmarks.sim.run import Result, Setting, run_queue, run_tail

__all__ = ["main", "plan"]


def _ratios(text: str) -> list[float]:
    try:
        out = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--ratios: expected comma-separated numbers, got {text!r}") from None
    if not out or any(not 0 < r <= 64 for r in out):
        raise ValueError(f"--ratios: every ratio must be in (0, 64], got {text!r}")
    return out


def plan(args: argparse.Namespace) -> dict[str, Result]:
    """Simulate every mode of ``args`` (the parsed command line); returns ``{mode: Result}``."""
    for name in ("rollout_gpus", "train_gpus", "prompts", "n", "prompt_len"):
        v = getattr(args, name)
        if v < 1:
            raise ValueError(f"--{name.replace('_', '-')}: must be >= 1, got {v}")
    if args.steps < 3:
        raise ValueError(f"--steps: must be >= 3, got {args.steps}")
    if (args.lengths is None) == (args.lengths_file is None):
        raise ValueError("--lengths / --lengths-file: give exactly one of them")
    lengths = (
        Lengths.parse(args.lengths) if args.lengths else Lengths.from_file(args.lengths_file, cap=args.cap)
    )
    ratios = _ratios(args.ratios)
    total = args.rollout_gpus + args.train_gpus
    if not 0 < args.mfu <= 1:
        raise ValueError(f"--mfu: must be in (0, 1], got {args.mfu}")
    colo = gpu_model(args.model_size, train_gpus=total, tp=args.tp, mfu=args.mfu)
    split = gpu_model(args.model_size, train_gpus=args.train_gpus, tp=args.tp, mfu=args.mfu)
    tp = int(colo.name.rsplit("tp", 1)[1])
    if args.rollout_gpus < tp:
        raise ValueError(
            f"--rollout-gpus: a {args.model_size} engine needs {tp} GPUs, got {args.rollout_gpus}"
        )

    def setting(cost, engines: int) -> Setting:
        return Setting(
            args.prompts, args.n, lengths, cost, engines=engines, prompt_len=args.prompt_len, steps=args.steps
        )

    out = {
        "sync (colocated)": run_queue(setting(colo, total // tp), ratio=0, replicate=False),
        "sync + prompt replication": run_queue(setting(colo, total // tp), ratio=0),
        "tail batching (colocated)": run_tail(setting(colo, total // tp)),
    }
    for r in ratios:
        out[f"async ratio {r:g}"] = run_queue(setting(split, args.rollout_gpus // tp), ratio=r)
    return out


def main(argv: list[str] | None = None) -> dict[str, Result]:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.sim.plan", description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", help="lognormal:median=M,sigma=S,cap=C[,prompt=R]")
    ap.add_argument("--lengths-file", help="JSONL of past response lengths")
    ap.add_argument("--cap", type=int, default=None, help="--lengths-file: length cap (default: the longest)")
    ap.add_argument("--model-size", default="7B", help="7B, 8B, 14B, 32B or any <x>B")
    ap.add_argument("--rollout-gpus", type=int, required=True)
    ap.add_argument("--train-gpus", type=int, required=True)
    ap.add_argument("--tp", type=int, default=None, help="GPUs per rollout engine (default by size)")
    ap.add_argument("--prompts", type=int, default=64, help="prompts per step")
    ap.add_argument("--n", type=int, default=8, help="responses per prompt")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--ratios", default="1,2,4", help="async ratios to try")
    ap.add_argument("--mfu", type=float, default=PAPER_MFU, help="training efficiency (fraction of peak)")
    ap.add_argument("--steps", type=int, default=8, help="simulated steps per mode (the first is not timed)")
    args = ap.parse_args(argv)
    try:
        res = plan(args)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    base = res["sync (colocated)"].s_per_step
    print(
        f"{args.model_size}, {args.prompts} prompts x {args.n} per step, rollout {args.rollout_gpus} GPUs + "
        f"train {args.train_gpus} GPUs (H800 cost model)"
    )
    print(f"{'mode':<28}{'s/step':>9}{'trained tok/s':>15}{'mean length':>13}{'vs sync':>9}")
    for mode, r in res.items():
        print(
            f"{mode:<28}{r.s_per_step:>9.1f}{r.tokens_per_s:>15.0f}{r.mean_length:>13.0f}{base / r.s_per_step:>8.2f}x"
        )
    best = max(res, key=lambda m: res[m].tokens_per_s)
    print(f"best (trained tokens/s): {best}")
    sys.stdout.flush()
    return res


if __name__ == "__main__":
    main()
