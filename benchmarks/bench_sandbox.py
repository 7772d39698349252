"""Benchmark: code-reward time per step (W2: a timeout tail) and the per-run cost of each sandbox.

**W2** (docs/benchmarks.md): a step scores ``prompts x group`` completions of HumanEval
problems; ~5% of them loop forever (a ``while True: pass`` body), the rest are the canonical
solution or a wrong one (half each). The same completions, in the same order, are scored with
a *fixed* timeout (the 30 s of the papers scaled to ``--fixed 3`` s) and with RollPacker's
*adaptive* timeout, ``--workers`` reward threads in parallel. Prints reward time per step for
each, the first (cold) step apart from the warm ones, and the ratio.

The adaptive policy is ``rollkit.scheduling.AdaptiveTimeout(lam, t_min, t_max)`` when that
module exists, else :class:`LocalAdaptiveTimeout` below (the same rule, our reading of
RollPacker: a prompt's timeout is ``clip(lam * slowest correct run seen, t_min, t_max)``, and
``t_max`` until one of its responses has passed).

**Overhead**: median wall time of a trivial program (``print(1)``) as a plain subprocess
(``python -I -S -c``, no isolation), through the rlimit fallback and through bubblewrap.

    python benchmarks/bench_sandbox.py             # 4 steps of 8 x 8 completions (~1-2 min)
    python benchmarks/bench_sandbox.py --quick     # under a minute

Results are printed, not asserted.
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import sys
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

try:
    import trainers  # noqa: F401
except ImportError:  # run as a script from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainers.rewards.code import CodeVerifier, load_humaneval
from trainers.rewards.sandbox import bwrap_status, run_python, sandbox_python


class LocalAdaptiveTimeout:
    """RollPacker-style adaptive timeout: per prompt, ``clip(lam * slowest correct run, t_min, t_max)``.

    Used only when ``rollkit.scheduling.AdaptiveTimeout`` is not available.
    """

    def __init__(self, lam: float, t_min: float, t_max: float) -> None:
        self.lam, self.t_min, self.t_max = lam, t_min, t_max
        self._slowest: dict[str, float] = {}
        self._lock = threading.Lock()

    def timeout(self, problem_id: str) -> float:
        with self._lock:
            s = self._slowest.get(problem_id)
        return self.t_max if s is None else min(max(self.lam * s, self.t_min), self.t_max)

    def observe(self, problem_id: str, run_seconds: float, *, correct: bool) -> None:
        if correct:
            with self._lock:
                self._slowest[problem_id] = max(self._slowest.get(problem_id, 0.0), run_seconds)


def adaptive_policy(lam: float, t_min: float, t_max: float):
    try:
        from rollkit.scheduling import AdaptiveTimeout
    except ImportError:
        return LocalAdaptiveTimeout(
            lam, t_min, t_max
        ), "local LocalAdaptiveTimeout (rollkit.scheduling missing)"
    return AdaptiveTimeout(lam=lam, t_min=t_min, t_max=t_max), "rollkit.scheduling.AdaptiveTimeout"


def make_steps(n_steps: int, n_prompts: int, group: int, loop_frac: float, seed: int):
    """``n_steps`` lists of (problem, completion, kind); the same prompts every step (epochs)."""
    rng = random.Random(seed)
    probs = load_humaneval()[:n_prompts]
    steps = []
    for _ in range(n_steps):
        items = []
        for p in probs:
            for _ in range(group):
                items.append((p, p.reference if rng.random() < 0.5 else "    return None\n", "ok/wrong"))
        n_loop = max(1, round(loop_frac * len(items)))
        for i in rng.sample(range(len(items)), n_loop):
            items[i] = (items[i][0], "    while True:\n        pass\n", "loop")
        rng.shuffle(items)
        steps.append(items)
    return steps


def score_step(verifier: CodeVerifier, items, workers: int) -> tuple[float, list[float]]:
    t0 = time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        scores = list(pool.map(lambda it: verifier(it[1], it[0]), items))
    return time.perf_counter() - t0, scores


def w2(args) -> None:
    steps = make_steps(args.steps, args.prompts, args.group, args.loop_frac, args.seed)
    policy, which = adaptive_policy(args.lam, args.t_min, args.fixed)
    n = len(steps[0])
    loops = sum(k == "loop" for _, _, k in steps[0])
    iso = "bwrap" if bwrap_status()[0] else "rlimit"
    print(
        f"W2: {args.steps} steps x {n} completions ({args.prompts} HumanEval prompts x {args.group}), "
        f"{loops} looping per step ({100 * loops / n:.1f}%), {args.workers} reward workers, sandbox {iso}"
    )
    print(
        f"fixed timeout {args.fixed:g} s; adaptive: {which}, lam={args.lam:g}, t_min={args.t_min:g}, "
        f"t_max={args.fixed:g}"
    )
    fixed = CodeVerifier(timeout_s=args.fixed, isolation=iso)
    adaptive = CodeVerifier(timeout_policy=policy, isolation=iso)
    rows = {"fixed": [], "adaptive": []}
    for items in steps:  # interleaved: fixed then adaptive on the same completions, step by step
        tf, sf = score_step(fixed, items, args.workers)
        ta, sa = score_step(adaptive, items, args.workers)
        if sf != sa:
            print(f"  note: {sum(a != b for a, b in zip(sf, sa))} scores differ between the policies")
        rows["fixed"].append(tf)
        rows["adaptive"].append(ta)
    base_cold = rows["fixed"][0]
    base_warm = statistics.median(rows["fixed"][1:]) if len(steps) > 1 else base_cold
    print(f"\n{'timeout policy':<16}{'step 1 (cold) s':>18}{'steps 2+ median s':>20}{'speedup (warm)':>16}")
    for name, ts in rows.items():
        warm = statistics.median(ts[1:]) if len(ts) > 1 else ts[0]
        print(f"{name:<16}{ts[0]:>18.2f}{warm:>20.2f}{base_warm / warm:>15.2f}x")
    print(f"speedup of step 1: {base_cold / rows['adaptive'][0]:.2f}x")


def overhead(args) -> None:
    py = sandbox_python()
    cases = {"plain subprocess": None, "rlimit fallback": "rlimit"}
    if bwrap_status()[0]:
        cases["bwrap"] = "bwrap"
    times = {k: [] for k in cases}
    for _ in range(args.runs):  # interleaved
        for name, iso in cases.items():
            t0 = time.perf_counter()
            if iso is None:
                subprocess.run([py, "-I", "-S", "-c", "print(1)"], capture_output=True, check=True)
            else:
                assert run_python("print(1)", isolation=iso).stdout == "1\n"
            times[name].append(time.perf_counter() - t0)
    base = statistics.median(times["plain subprocess"])
    print(f"\nper-run overhead, print(1), median of {args.runs} ({py} -I -S)")
    print(f"{'runner':<20}{'ms / run':>10}{'vs plain':>10}")
    for name, ts in times.items():
        m = statistics.median(ts)
        print(f"{name:<20}{1000 * m:>10.1f}{m / base:>9.2f}x")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--loop-frac", type=float, default=0.05)
    ap.add_argument("--fixed", type=float, default=3.0, help="fixed timeout (30 s scaled) = adaptive t_max")
    ap.add_argument("--lam", type=float, default=3.0)
    ap.add_argument("--t-min", type=float, default=0.5)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--runs", type=int, default=30, help="runs per case for the overhead table")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="3 steps of 4 x 8, 15 overhead runs (< 1 min)")
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.prompts, args.group, args.runs = 3, 4, 8, 15
    warnings.filterwarnings("ignore", message="trainers.rewards.sandbox", category=RuntimeWarning)
    w2(args)
    overhead(args)


if __name__ == "__main__":
    main()
