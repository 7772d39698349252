"""Benchmark: on-policy distillation vs RL from the same start, held-out accuracy per step.

Both methods start from SmolLM2-135M-Instruct (the embedded default) and run the job of
``recipes/rlvr_qwen.py``: 2-digit addition, 4 prompts x 8 samples per step, 12 new tokens,
temperature 0.7, lr 1e-5, micro-batches of 16. **RL** is that recipe's job (GRPO advantages,
token-level PPO-clip, the exact-match reward). **Distillation** is ``recipes/distill.py``'s
default: the same rollout, learning rate and steps, the student minimising its sampled-token
reverse KL to a teacher, the model that the RL job itself exports after its 20 steps
(``runs/rlvr_qwen/model``). Equal steps and an equal sampling budget per step (prompts x samples
x max tokens); the table also gives the tokens each run actually sampled, and the plot's right
panel puts accuracy against them. Held-out accuracy (greedy, the 100 held-out pairs, the
trainers' own evaluation) at step 0, every ``--eval-every`` steps and at the end.

The teacher: ``--teacher DIR``, else ``runs/rlvr_qwen/model`` when ``python recipes/rlvr_qwen.py``
has been run, else trained here first (the RL job, seed 0, ``--teacher-steps`` steps), saved to
``runs/rlvr_qwen`` when that is exactly the recipe's default job, else to ``<out>/teacher``.

    python benchmarks/bench_distill.py                  # seeds 0,1,2, 20 steps, eval every 5
    python benchmarks/bench_distill.py --teacher runs/rlvr_qwen/model --seeds 0 --steps 10
    python benchmarks/bench_distill.py --steps 2 --seeds 0 --eval-every 1 --teacher-steps 1 -- data.eval_size=20
    python benchmarks/bench_distill.py --tiny           # tiny models, 1-digit addition: the pipeline in seconds

Any config override after ``--`` applies to every run (the teacher's too). Prints one markdown
table (per seed and mean) and writes one plot (``--plot``, default ``docs/img/distill_vs_rl.png``);
nothing is asserted.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[1]
try:
    import trainers  # noqa: F401
except ImportError:  # run as a script from a checkout without `pip install -e .`
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from trainers.config import load_config  # noqa: E402
from trainers.deps import require  # noqa: E402
from trainers.loops import SyncTrainer  # noqa: E402
from trainers.loops.distill import DistillTrainer  # noqa: E402

METHODS = ("RL", "distill")
#: --tiny: both jobs on the tiny Qwen2 (random start) and 1-digit addition; the numbers mean nothing
TINY = [
    "--model",
    "tiny",
    "data.digits=1",
    "data.eval_size=30",
    "rollout.max_tokens=4",
    "eval.max_tokens=4",
    "rollout.dtype=float32",
    "train.autocast=off",
    "train.lr=1e-3",
]


def _recipe(name: str):
    spec = importlib.util.spec_from_file_location(f"_recipe_{name}", ROOT / "recipes" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


def parse(argv: list[str] | None) -> argparse.Namespace:
    argv = list(sys.argv[1:] if argv is None else argv)
    rest = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--teacher", default="", help="the teacher's model directory (default: see the docstring)")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds")
    p.add_argument("--steps", type=int, default=20, help="training steps of every run")
    p.add_argument("--eval-every", type=int, default=5, help="held-out accuracy every this many steps")
    p.add_argument(
        "--teacher-steps", type=int, default=None, help="steps of the teacher's RL job (default 20)"
    )
    p.add_argument("--out", default="runs/bench_distill", help="the runs' directories")
    p.add_argument("--plot", default=str(ROOT / "docs" / "img" / "distill_vs_rl.png"), help="the PNG")
    p.add_argument("--tiny", action="store_true", help="tiny models, 1-digit addition (a smoke run)")
    args = p.parse_args(argv)
    try:
        args.seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        p.error(f"--seeds: expected comma-separated integers, got {args.seeds!r}")
    if not args.seeds:
        p.error("--seeds: at least one seed")
    if args.steps < 1 or args.eval_every < 1:
        p.error(f"--steps and --eval-every must be >= 1, got {args.steps} and {args.eval_every}")
    if args.teacher and not Path(args.teacher).is_dir():
        p.error(f"--teacher: {args.teacher} is not a directory")
    args.overrides = [*(TINY if args.tiny else []), *rest]
    return args


def _quiet(out_dir: Path) -> list[str]:
    return [f"logging.dir={out_dir}", "logging.tensorboard=false", "logging.plot=false"]


def ensure_teacher(args: argparse.Namespace, rlvr) -> tuple[str, float | None]:
    """``(teacher directory, its held-out accuracy if trained here)`` (module docstring)."""
    default = _recipe("distill").RLVR_TEACHER
    if args.teacher:
        return args.teacher, None
    if not args.tiny and Path(default).is_dir():
        return default, None
    base = rlvr.recipe_defaults()
    steps = base.train.steps if args.teacher_steps is None else args.teacher_steps
    is_recipe_job = not args.overrides and steps == base.train.steps
    out_dir = Path(default).parent if is_recipe_job else Path(args.out) / "teacher"
    print(f"[teacher] no exported teacher: training rlvr_qwen's job (seed 0, {steps} steps) into {out_dir}")
    cfg = load_config(["seed=0", f"train.steps={steps}", *_quiet(out_dir), *args.overrides], base=base)
    trainer = SyncTrainer(cfg)
    try:
        out = trainer.fit()
    finally:
        trainer.close()
    print(
        f"[teacher] held-out accuracy {out['accuracy_before']:.3f} -> {out['accuracy_after']:.3f}: {out['model_dir']}"
    )
    return out["model_dir"], out["accuracy_after"]


def teacher_accuracy(teacher: str, args: argparse.Namespace, rlvr) -> float:
    """The teacher's held-out accuracy, by the trainers' own evaluation."""
    cfg = load_config(
        [*args.overrides, f"model.path={teacher}", *_quiet(Path(args.out) / "teacher_eval")],
        base=rlvr.recipe_defaults(),
    )
    trainer = SyncTrainer(cfg)
    try:
        return trainer.evaluate()["eval/accuracy"]
    finally:
        trainer.close()


def run(method: str, seed: int, teacher: str, args: argparse.Namespace, rlvr, distill) -> dict:
    """One training run: ``{"acc": {step: accuracy}, "tokens": {step: sampled so far}, "s_per_step"}``."""
    out_dir = Path(args.out) / method / f"seed_{seed}"
    common = [
        f"seed={seed}",
        f"train.steps={args.steps}",
        f"eval.every={args.eval_every}",
        "eval.before=true",
        "logging.save_model=false",
        *_quiet(out_dir),
        *args.overrides,
    ]
    if method == "RL":
        trainer = SyncTrainer(load_config(common, base=rlvr.recipe_defaults()))
    else:
        cfg = load_config([*common, f"distill.teacher={teacher}"], base=distill.recipe_defaults())
        trainer = DistillTrainer(cfg)
    try:
        out = trainer.fit()
    finally:
        trainer.close()
    acc, tokens, total = {}, {0: 0}, 0.0
    for h in out["history"]:
        if "throughput/rollout_tokens_per_s" in h:  # sum(lengths) / rollout seconds, times those seconds
            total += h["throughput/rollout_tokens_per_s"] * max(h["time/rollout"], 1e-9)
            tokens[h["step"]] = round(total)
        if "eval/accuracy" in h:
            acc[h["step"]] = h["eval/accuracy"]
    print(
        f"[{method} seed {seed}] held-out accuracy {acc.get(0, float('nan')):.3f} -> "
        f"{acc[args.steps]:.3f}, {round(total)} sampled tokens, {out['seconds_per_step']:.1f} s/step",
        flush=True,
    )
    return {"acc": acc, "tokens": tokens, "s_per_step": out["seconds_per_step"]}


def table(results: dict[str, dict[int, dict]], teacher_acc: float | None) -> str:
    """The markdown table: accuracy at each evaluated step, per seed and mean, per method."""
    steps = sorted(next(iter(next(iter(results.values())).values()))["acc"])
    head = ["method", "seed", *[f"step {s}" for s in steps], "sampled tokens", "s/step"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for method, runs in results.items():
        for seed, r in runs.items():
            accs = " | ".join(f"{r['acc'][s]:.3f}" for s in steps)
            lines.append(
                f"| {method} | {seed} | {accs} | {r['tokens'][max(r['tokens'])]} | {r['s_per_step']:.1f} |"
            )
        mean = [statistics.mean(r["acc"][s] for r in runs.values()) for s in steps]
        tok = statistics.mean(r["tokens"][max(r["tokens"])] for r in runs.values())
        sps = statistics.mean(r["s_per_step"] for r in runs.values())
        lines.append(
            f"| **{method}** | **mean** | "
            + " | ".join(f"**{m:.3f}**" for m in mean)
            + f" | {tok:.0f} | {sps:.1f} |"
        )
    if teacher_acc is not None:  # its accuracy in the last step's column
        cells = [""] * (len(steps) - 1) + [f"{teacher_acc:.3f}"]
        lines.append("| teacher | - | " + " | ".join(cells) + " | | |")
    return "\n".join(lines)


def plot(results: dict[str, dict[int, dict]], path: str, title: str) -> str | None:
    """Accuracy vs step (left) and vs sampled tokens (right): thin lines per seed, thick means."""
    try:
        matplotlib = require("matplotlib")
    except ImportError as e:
        print(f"no plot: {e}")
        return None
    matplotlib.use("Agg")
    plt = require("matplotlib.pyplot")
    fig, (ax_s, ax_t) = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for color, (method, runs) in zip(("tab:blue", "tab:orange"), results.items()):
        steps = sorted(next(iter(runs.values()))["acc"])
        for r in runs.values():
            ys = [r["acc"][s] for s in steps]
            ax_s.plot(steps, ys, color=color, alpha=0.35, lw=1)
            ax_t.plot([r["tokens"].get(s, 0) for s in steps], ys, color=color, alpha=0.35, lw=1)
        mean = [statistics.mean(r["acc"][s] for r in runs.values()) for s in steps]
        mean_tok = [statistics.mean(r["tokens"].get(s, 0) for r in runs.values()) for s in steps]
        label = f"{method} (mean of {len(runs)} seeds)"
        ax_s.plot(steps, mean, color=color, lw=2.5, marker="o", label=label)
        ax_t.plot(mean_tok, mean, color=color, lw=2.5, marker="o", label=label)
    ax_s.set(xlabel="step", ylabel="held-out accuracy (greedy)", title="accuracy vs step")
    ax_t.set(xlabel="sampled tokens", title="accuracy vs sampled tokens")
    ax_s.legend()
    for ax in (ax_s, ax_t):
        ax.grid(alpha=0.3)
    fig.suptitle(f"{title}: on-policy distillation vs RL (thin lines: per seed)")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or 0) or os.cpu_count() or 1)
    rlvr, distill = _recipe("rlvr_qwen"), _recipe("distill")
    t0 = time.perf_counter()
    teacher, teacher_acc = ensure_teacher(args, rlvr)
    if teacher_acc is None:
        teacher_acc = teacher_accuracy(teacher, args, rlvr)
    print(f"[bench] teacher {teacher}; seeds {args.seeds}, {args.steps} steps, eval every {args.eval_every}")
    results: dict[str, dict[int, dict]] = {m: {} for m in METHODS}
    for seed in args.seeds:
        for method in METHODS:
            results[method][seed] = run(method, seed, teacher, args, rlvr, distill)
    print()
    print(table(results, teacher_acc))
    title = "tiny Qwen2, 1-digit addition" if args.tiny else "SmolLM2-135M-Instruct, 2-digit addition"
    png = plot(results, args.plot, title)
    print(f"\nplot: {png or 'none'}; total {time.perf_counter() - t0:.0f} s")
    return {"results": results, "teacher": teacher, "teacher_accuracy": teacher_acc, "plot": png}


if __name__ == "__main__":
    main()
