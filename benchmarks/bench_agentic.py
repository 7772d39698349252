"""W3 benchmark: time per agentic training step with slow, flaky environments.

The workload W3 (docs/benchmarks.md, after ROLL Flash, Lu et al., 2025, arXiv:2510.11345):
text FrozenLake whose every ``step`` first sleeps a latency drawn from a Gaussian truncated at
0 (``--latency-mean``, ``--latency-std``; the papers use mean 10 s, std 1-10 s, scaled down
here) and fails with probability ``--fail-prob`` (``--fail-mode hang``: past the
``--deadline``; or ``raise``). One :class:`~trainers.loops.AgenticTrainer` trains
``--groups x --group-size`` trajectories per step (StarPO + PPO) in three rollout modes,
``lockstep``, ``async`` (environment-level asynchronous rollout) and ``async+redundant``
(``--num-env-groups`` task groups of ``--group-size + --redundancy`` episodes, the first
finishers kept), one after the other in one process, with the same engines, the same
environment worker processes and the initial weights restored before each mode.
``--warmup`` untimed steps per mode, then ``--steps`` timed steps; it prints the mean seconds
per training step, the environment fault counts and the speed-ups. Results are printed, not
asserted; the measured table is in docs/agentic.md.

    python benchmarks/bench_agentic.py --quick          # tiny model, < 60 s
    python benchmarks/bench_agentic.py                  # tiny model, mean 0.5 s, std 0.5 s, 1% failures
    python benchmarks/bench_agentic.py --model default  # SmolLM2-135M-Instruct (slow on CPU)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

try:
    import trainers  # noqa: F401
except ImportError:  # run as a script from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODES = ("lockstep", "async", "async+redundant")


def build_config(args: argparse.Namespace):
    from trainers.config import AgenticConfig

    cfg = AgenticConfig()
    cfg.model.path = "tiny" if args.model == "tiny" else ("" if args.model == "default" else args.model)
    cfg.env.name = "trainers.envs.wrappers:LatencyEnv"
    cfg.env.kwargs = {
        "env": "frozenlake",
        "env_kwargs": {
            "size": args.size,
            "hole_prob": 0.0,
            "max_turns": args.max_turns,
            "end_on_format_error": False,
        },
        "latency_mean_s": args.latency_mean,
        "latency_std_s": args.latency_std,
        "fail_prob": args.fail_prob,
        "fail_mode": args.fail_mode,
    }
    cfg.env.max_turns = args.max_turns
    cfg.env.max_context = 2048 if args.model != "tiny" else 1024
    cfg.env.deadline_s = args.deadline
    cfg.rollout.groups_per_step = args.groups
    cfg.rollout.group_size = args.group_size
    cfg.rollout.max_tokens = args.tokens
    cfg.train.lr = 1e-4 if args.model == "tiny" else 1e-6
    cfg.train.micro_batch_size = 16
    cfg.logging.progress = False
    cfg.seed = args.seed
    return cfg


def set_mode(cfg, mode: str, args: argparse.Namespace) -> None:
    r = cfg.rollout
    r.mode = "lockstep" if mode == "lockstep" else "async"
    r.redundancy = args.redundancy if mode == "async+redundant" else 0
    r.num_env_groups = args.num_env_groups if mode == "async+redundant" else 0


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes: finishes in under a minute")
    ap.add_argument(
        "--model", default="tiny", help="tiny | default (SmolLM2-135M-Instruct) | a checkpoint dir"
    )
    ap.add_argument("--steps", type=int, default=4, help="timed steps per mode")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps per mode")
    ap.add_argument("--groups", type=int, default=4, help="task groups trained per step")
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--num-env-groups", type=int, default=6, help="groups launched (async+redundant)")
    ap.add_argument("--redundancy", type=int, default=2, help="extra episodes per group (async+redundant)")
    ap.add_argument("--latency-mean", type=float, default=0.5)
    ap.add_argument("--latency-std", type=float, default=0.5)
    ap.add_argument("--fail-prob", type=float, default=0.01)
    ap.add_argument("--fail-mode", default="hang", choices=["hang", "raise", "kill"])
    ap.add_argument("--deadline", type=float, default=4.0, help="seconds before a step counts as hung")
    ap.add_argument("--size", type=int, default=3, help="FrozenLake size")
    ap.add_argument("--max-turns", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=8, help="max new tokens per turn")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.warmup = min(args.steps, 2), min(args.warmup, 1)
        args.latency_mean, args.latency_std = min(args.latency_mean, 0.2), min(args.latency_std, 0.2)
        args.deadline = min(args.deadline, 1.5)
        args.max_turns = min(args.max_turns, 3)

    import copy

    import torch

    from trainers.loops.agentic import AgenticTrainer

    torch.set_num_threads(args.threads or max(1, os.cpu_count() or 1))
    cfg = build_config(args)
    t_load = time.perf_counter()
    trainer = AgenticTrainer(cfg)
    init = copy.deepcopy(trainer.train.state_dict())
    set_mode(cfg, "async+redundant", args)
    trainer.prestart()  # the env workers of the largest mode, shared by all three
    load_s = time.perf_counter() - t_load
    print(
        f"W3 agentic rollout: FrozenLake {args.size}x{args.size}, max {args.max_turns} turns, "
        f"step latency ~ N({args.latency_mean}, {args.latency_std}) s truncated at 0, "
        f"fail p={args.fail_prob}/step ({args.fail_mode}, deadline {args.deadline} s); "
        f"model {args.model}; {args.groups} groups x {args.group_size} trajectories trained per step; "
        f"redundant: {args.num_env_groups} groups x ({args.group_size}+{args.redundancy}); "
        f"{trainer.rollout.num_env_workers} env workers, {torch.get_num_threads()} torch threads "
        f"(setup {load_s:.0f} s)",
        flush=True,
    )
    results: dict[str, dict[str, float]] = {}
    try:
        for mode in MODES:
            set_mode(cfg, mode, args)
            trainer.train.load_state_dict(copy.deepcopy(init))
            trainer.version = 0
            trainer.rollout.server.update_weights(trainer.train.export_weights(), 0)
            trainer._seeds.seed(args.seed)
            steps, faults = (
                [],
                dict.fromkeys(("env/hang", "env/error", "env/died", "env/replaced", "env/cancelled"), 0.0),
            )
            rollout_s, train_s, success = [], [], []
            for i in range(args.warmup + args.steps):
                m = trainer.step()
                if i < args.warmup:
                    continue
                steps.append(m["time/step"])
                rollout_s.append(m["time/rollout"])
                train_s.append(m["time/train"])
                success.append(m["success/rate"])
                for k in faults:
                    faults[k] += m[k]
            results[mode] = {
                "step_s": statistics.mean(steps),
                "rollout_s": statistics.mean(rollout_s),
                "train_s": statistics.mean(train_s),
                "success": statistics.mean(success),
                **faults,
            }
    finally:
        trainer.close()

    base = results["lockstep"]["step_s"]
    print(
        f"\n{'mode':<18}{'s/step':>9}{'rollout s':>11}{'train s':>9}  hang/error/died/replaced/cancelled  speedup"
    )
    for mode, r in results.items():
        counts = "/".join(
            f"{r[k]:.0f}" for k in ("env/hang", "env/error", "env/died", "env/replaced", "env/cancelled")
        )
        print(
            f"{mode:<18}{r['step_s']:>9.2f}{r['rollout_s']:>11.2f}{r['train_s']:>9.2f}  {counts:<34} "
            f"{base / r['step_s']:>6.2f}x"
        )
    a = base / results["async"]["step_s"]
    red = results["async"]["step_s"] / results["async+redundant"]["step_s"]
    print(
        f"\nspeedup: asynchrony {a:.2f}x, redundancy {red:.2f}x on top, total {a * red:.2f}x "
        f"(ROLL Flash, ALFWorld: 2.27x x 1.20x = 2.72x)"
    )
    return results


if __name__ == "__main__":
    main()
