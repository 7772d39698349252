"""Algorithm ablations: a grid of rollkit choices x seeds, resumable, with a table and plots.

    python recipes/ablate.py \\
        --grid algorithm.advantage=grpo,dr-grpo,lite-ppo \\
        --grid algorithm.aggregation=token-mean,seq-mean-token-mean \\
        --seeds 0,1,2 --out runs/ablate/adv_x_agg -- train.steps=20

Every ``--grid key=a,b,...`` is a factor (any config field of ``recipes/rlvr_qwen.py --help``;
levels are split at top-level commas, so ``'{clip_high: 0.28},{}'`` works); the overrides
after ``--`` are the same for every cell. Each cell (levels x seed) runs
``python recipes/rlvr_qwen.py <fixed> <levels> seed=<s> logging.dir=<out>/cells/<id>``, or with
``--sft-steps N`` a supervised warm-up of N steps then RL (for the tiny model, which needs a
starting accuracy). Cells that finished (``done.json``) are not run again: re-running the
command resumes an interrupted ablation. ``--ray`` runs cells as Ray tasks of
``--cpus-per-cell`` CPUs; a cell still running after ``--cell-timeout`` seconds fails.
Outputs in ``--out``: ``metrics.csv`` / ``metrics.parquet`` (per step, every cell),
``summary.md`` (final held-out accuracy and AUC, mean ± 95% CI over seeds, wall time,
tokens) and ``curves.png`` (one panel per factor). The logic is the ``ablations`` package.
See docs/ablations.md.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import torch  # noqa: E402
from rlvr_qwen import recipe_defaults  # noqa: E402

import ablations as ab  # noqa: E402
from ablations.warm_start import warm_start_fit  # noqa: E402
from trainers.config import load_config, parse_args  # noqa: E402


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="recipes/ablate.py",
        description="Run a grid of config overrides x seeds with recipes/rlvr_qwen.py; "
        "fixed overrides go after --.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--grid", action="append", default=[], metavar="KEY=A,B", help="an ablated factor (repeat)"
    )
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (default 0,1,2)")
    p.add_argument("--out", default="runs/ablate", help="output directory (default runs/ablate)")
    p.add_argument("--parallel", type=int, default=0, help="cells at once (default: CPUs // --cpus-per-cell)")
    p.add_argument("--cpus-per-cell", type=int, default=1, help="threads / Ray CPUs per cell (default 1)")
    p.add_argument("--ray", action="store_true", help="run cells as Ray tasks (needs ray)")
    p.add_argument(
        "--cell-timeout",
        type=float,
        default=ab.CELL_TIMEOUT_S,
        help=f"seconds before a cell's command is killed and the cell fails (default {ab.CELL_TIMEOUT_S:.0f})",
    )
    p.add_argument("--sft-steps", type=int, default=0, help="supervised warm-up steps before RL (default 0)")
    p.add_argument("--sft-lr", type=float, default=3e-3, help="warm-up learning rate (default 3e-3)")
    p.add_argument("--sft-batch-size", type=int, default=64, help="warm-up batch size (default 64)")
    p.add_argument(
        "--plot-metrics",
        default="eval/accuracy,reward/mean",
        help="plot rows, comma-separated (default eval/accuracy,reward/mean)",
    )
    p.add_argument("--title", default="", help="title of summary.md")
    p.add_argument("--dry-run", action="store_true", help="list the cells and their commands; run nothing")
    p.add_argument("--no-run", action="store_true", help="only collect and summarise the finished cells")
    p.add_argument("--cell", action="store_true", help=argparse.SUPPRESS)  # internal: run one warm-start cell
    return p


def _run_cell(args: argparse.Namespace, overrides: list[str]) -> None:
    """The body of a ``--sft-steps`` cell: the recipe's config, warm-up, then RL."""
    cfg = load_config(overrides, base=recipe_defaults())
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or os.cpu_count() or 1))
    out = warm_start_fit(
        cfg, sft_steps=args.sft_steps, sft_lr=args.sft_lr, sft_batch_size=args.sft_batch_size
    )
    print(f"held-out accuracy before: {out['accuracy_before']}, after: {out['accuracy_after']:.3f}")


def _check_args(args: argparse.Namespace) -> None:
    if not args.grid:
        raise ValueError("--grid: give at least one factor, e.g. --grid algorithm.advantage=grpo,rloo")
    for flag, value, low in (
        ("--parallel", args.parallel, 0),
        ("--cpus-per-cell", args.cpus_per_cell, 1),
        ("--sft-steps", args.sft_steps, 0),
        ("--sft-batch-size", args.sft_batch_size, 1),
    ):
        if value < low:
            raise ValueError(f"{flag}: must be >= {low}, got {value}")
    if not args.cell_timeout > 0:
        raise ValueError(f"--cell-timeout: must be > 0 seconds, got {args.cell_timeout}")


def _cell_command(args: argparse.Namespace) -> tuple[str, list[str]]:
    """``(runner, command)``: ``recipes/rlvr_qwen.py``, or this recipe's ``--cell`` warm-up body."""
    if not args.sft_steps:
        return "recipe", [sys.executable, str(HERE / "rlvr_qwen.py")]
    runner = f"sft(steps={args.sft_steps},lr={args.sft_lr},batch={args.sft_batch_size})"
    command = [sys.executable, str(HERE / "ablate.py"), "--cell", "--sft-steps", str(args.sft_steps)]
    return runner, [
        *command,
        "--sft-lr",
        str(args.sft_lr),
        "--sft-batch-size",
        str(args.sft_batch_size),
        "--",
    ]


def _plan(args: argparse.Namespace, fixed: list[str]) -> tuple[list[ab.Factor], list[ab.Cell], list[str]]:
    """The factors, the validated cells and the cell command (``ValueError`` on bad input)."""
    _check_args(args)
    factors = [ab.parse_factor(g) for g in args.grid]
    config_file, pairs, _ = parse_args(fixed)  # "--model tiny" -> "model=tiny"
    fixed = [*([f"config={config_file}"] if config_file else []), *(f"{k}={v}" for k, v in pairs)]
    runner, command = _cell_command(args)
    cells = ab.expand_grid(factors, ab.parse_seeds(args.seeds), fixed, runner=runner)
    ab.validate_cells(cells, base=recipe_defaults)  # before anything runs
    return factors, cells, command


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    invocation = shlex.join(["python", "recipes/ablate.py", *(a for a in argv if a != "--no-run")])
    fixed: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, fixed = argv[:i], argv[i + 1 :]
    args = parser().parse_args(argv)
    try:
        if args.cell:
            _run_cell(args, fixed)
            return 0
        factors, cells, command = _plan(args, fixed)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    if args.dry_run:
        for c in cells:
            print(
                f"{'done' if ab.is_done(out, c) else 'todo'} {c.id}: {shlex.join([*command, *c.overrides()])}"
            )
        return 0
    out.mkdir(parents=True, exist_ok=True)
    failed = []
    if not args.no_run:
        parallel = args.parallel or max(1, (os.cpu_count() or 1) // args.cpus_per_cell)
        results = ab.run_cells(
            cells,
            out,
            command,
            parallel=parallel,
            use_ray=args.ray,
            cpus_per_cell=args.cpus_per_cell,
            timeout_s=args.cell_timeout,
        )
        failed = [r for r in results if r.status == "failed"]
    title = args.title or f"Ablation: {', '.join(f.key for f in factors)}"
    plot_metrics = [m for m in args.plot_metrics.split(",") if m]
    try:
        report = ab.write_report(
            cells, factors, out, title=title, command=invocation, plot_metrics=plot_metrics
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(report.summary.read_text())
    print(f"[ablate] {out / 'metrics.csv'}, {report.summary}, {report.curves}")
    if failed:
        print(
            f"[ablate] {len(failed)} cell(s) failed: " + ", ".join(str(r.log) for r in failed),
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
