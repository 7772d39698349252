"""The papers' settings on the simulator, their reported speed-ups side by side.

    python -m benchmarks.sim.papers                 # every table (about a minute)
    python -m benchmarks.sim.papers --only rollpacker --steps 6

* ROLL Flash (Lu et al. 2025, arXiv:2510.11345): RLVR on Qwen3-8B, sync (colocated on every
  GPU) against async (rollout and training on disjoint GPUs, best split of the same budget) at
  async ratio 1 / 2 / 4 / 8 and 16 to 128 GPUs; the best async ratio per model size, response
  length and rollout size (its Table 1); the agentic setting (environment latency Gaussian,
  mean 10 s).
* RollPacker (Gao et al. 2025, arXiv:2509.21009): Qwen2.5-7B / 14B / 32B, sync (veRL-like: a
  prompt's responses on one engine, no refill) against tail batching (eta = 1.25).

The paper figures quoted are the headline numbers of their abstracts and the settings are our
reading of them; every workload parameter we had to choose is in :data:`ROLL_FLASH` /
:data:`ROLLPACKER` and docs/simulator.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

from benchmarks.sim.agentic import AgenticSetting, run_agentic
from benchmarks.sim.costs import Latency, gpu_model
from benchmarks.sim.lengths import Lengths
from benchmarks.sim.run import Setting, run_queue, run_tail

__all__ = ["ROLLPACKER", "ROLL_FLASH", "best_async", "calibrate_mfu", "main"]

MFU = [0.3]  # set by main() from calibrate_mfu()
FAILURE = 0.02  # the share of failing environment steps in the agentic table's second part

#: our reading of ROLL Flash's RLVR setting: 64 prompts x 8 responses per step (512), Qwen3-8B
#: "Think"-style long tail (median 1.5k tokens, max/median > 10 at the 16k cap)
ROLL_FLASH = {
    "size": "8B",
    "prompts": 64,
    "n": 8,
    "lengths": "lognormal:median=1500,sigma=1.0,cap=16384",
    "gpus": (16, 32, 64, 128),
    "ratios": (1, 2, 4, 8),
    "paper_rlvr": {128: 2.24},  # "up to 2.24x" (abstract); Fig. 1b: 2.12x throughput
    "paper_agentic": 2.72,  # 2.27x async x 1.20x redundant environments
}

#: our reading of RollPacker's settings: 64 prompts x 8 responses, 16k cap, long prompts stay
#: long (half the log-variance per prompt), GPUs 32 / 64 / 128 for 7B / 14B / 32B
ROLLPACKER = {
    "prompts": 64,
    "n": 8,
    "lengths": "lognormal:median=1200,sigma=1.1,cap=16384,prompt=0.5",
    "models": {"7B": (32, 2.03), "14B": (64, 2.22), "32B": (128, 2.56)},
    "tail_alone": (1.30, 2.21),
}

SPLITS = (0.5, 0.625, 0.75, 0.875)
NEAR = 0.98  # "best" ratio: the smallest within 2% of the highest speed-up


def _best(ups: dict[float, float]) -> float:
    top = max(ups.values())
    return min(a for a, u in ups.items() if u >= NEAR * top)


#: RollPacker Table 1 (math): a synchronous step is 72% rollout, 5% reward, 23% training
TRAIN_SHARE = 0.23


def calibrate_mfu(steps: int = 6) -> float:
    """The training efficiency (``gpu_model``'s ``mfu``) at which the synchronous 14B RollPacker
    setting spends :data:`TRAIN_SHARE` of its step training (rollout and reward the rest): the
    papers' calibration of the train cost (docs/simulator.md)."""
    w = {k: ROLLPACKER[k] for k in ("prompts", "n", "lengths")}
    s = _setting("14B", 64, steps=steps, mfu=0.3, **w)
    r = run_queue(s, ratio=0, replicate=False)
    wait = sum(x.wait for x in r.measured) / len(r.measured)
    train = sum(x.train for x in r.measured) / len(r.measured)
    target = TRAIN_SHARE / (1 - TRAIN_SHARE) * wait
    return 0.3 * (train - s.cost.train.t0) / (target - s.cost.train.t0)


def _setting(
    size: str, gpus: int, *, prompts: int, n: int, lengths: str, steps: int, rollout_gpus=None, mfu=None
):
    mfu = MFU[0] if mfu is None else mfu
    cost = gpu_model(size, train_gpus=gpus if rollout_gpus is None else gpus - rollout_gpus, mfu=mfu)
    tp = int(cost.name.rsplit("tp", 1)[1])
    engines = max(1, (gpus if rollout_gpus is None else rollout_gpus) // tp)
    return Setting(prompts, n, Lengths.parse(lengths), cost, engines=engines, steps=steps)


def best_async(size: str, gpus: int, ratio: float, *, steps: int, splits=SPLITS, **w):
    """The :class:`~benchmarks.sim.run.Result` of the best split of ``gpus`` between rollout and
    training for async at ``ratio`` (best: most trained tokens per second)."""
    tp = 1 if size in ("7B", "8B", "14B") else 2
    best = None
    for f in splits:
        r = max(tp, int(gpus * f) // tp * tp)
        if r >= gpus:
            continue
        res = run_queue(_setting(size, gpus, steps=steps, rollout_gpus=r, **w), ratio=ratio)
        if best is None or res.tokens_per_s > best.tokens_per_s:
            best = res
    return best


def roll_flash_rlvr(steps: int) -> None:
    w = {k: ROLL_FLASH[k] for k in ("prompts", "n", "lengths")}
    print("\nROLL Flash, RLVR (Qwen3-8B; " + w["lengths"] + f"; {w['prompts']} x {w['n']} per step)")
    print("speed-up over sync in trained tokens/s (in s/step), async on the best rollout/train split;")
    print("best: the smallest ratio within 2% of the highest trained tokens/s")
    head = "".join(f"{'a=' + str(a):>16}" for a in ROLL_FLASH["ratios"])
    print(f"{'GPUs':>5}{'sync s/step':>13}{head}{'best':>6}{'paper':>8}")
    for g in ROLL_FLASH["gpus"]:
        sync = run_queue(_setting("8B", g, steps=steps, **w), ratio=0, replicate=False)
        res = {a: best_async("8B", g, a, steps=steps, **w) for a in ROLL_FLASH["ratios"]}
        tok = {a: r.tokens_per_s / sync.tokens_per_s for a, r in res.items()}
        best = _best(tok)
        paper = ROLL_FLASH["paper_rlvr"].get(g)
        cells = "".join(
            f"{f'{tok[a]:.2f}x ({sync.s_per_step / res[a].s_per_step:.2f}x)':>16}"
            for a in ROLL_FLASH["ratios"]
        )
        print(
            f"{g:>5}{sync.s_per_step:>13.1f}{cells}{'a=' + str(best):>6}{f'{paper:.2f}x' if paper else '-':>8}"
        )


def roll_flash_table1(steps: int) -> None:
    """Best async ratio per model size, response length (cap) and rollout size (ROLL Flash Table 1)."""
    print(
        "\nROLL Flash Table 1 analogue: best async ratio on 64 GPUs (by trained tokens/s; rollout on 1/2 or 3/4)"
    )
    print(
        f"{'model':>6}{'cap':>7}{'responses':>11}{'best ratio':>12}{'tokens/s x':>12}{'ratio 2':>9}{'paper':>7}"
    )
    for size in ("8B", "14B"):
        for cap in (8192, 16384):
            for prompts in (32, 64):
                w = {
                    "prompts": prompts,
                    "n": 8,
                    "lengths": f"lognormal:median={cap // 10},sigma=1.0,cap={cap}",
                }
                sync = run_queue(_setting(size, 64, steps=steps, **w), ratio=0, replicate=False)
                ups = {
                    a: best_async(size, 64, a, steps=steps, splits=(0.5, 0.75), **w).tokens_per_s
                    / sync.tokens_per_s
                    for a in (1, 2, 4, 8)
                }
                best = _best(ups)
                print(
                    f"{size:>6}{cap:>7}{prompts * 8:>11}{best:>12}{ups[best]:>11.2f}x{ups[2]:>8.2f}x{'2':>7}"
                )


def roll_flash_agentic(steps: int) -> None:
    """Same 16 GPUs: synchronous modes colocated (16 engines, then training on 16 GPUs), async
    on 8 rollout + 8 train GPUs."""
    env = Latency("gauss", 10.0, 5.0)
    lengths = Lengths(200, 0.6, 2048)
    colo = gpu_model("8B", train_gpus=16, mfu=MFU[0]).with_(env=env)
    split = gpu_model("8B", train_gpus=8, mfu=MFU[0]).with_(env=env)
    s16 = AgenticSetting(batch=128, turns=8, lengths=lengths, cost=colo, engines=16, steps=steps)
    s8 = AgenticSetting(batch=128, turns=8, lengths=lengths, cost=split, engines=8, steps=steps)
    rows = _agentic_rows(s16, s8)
    sync = rows["lock-step (sync)"]
    print(
        "\nROLL Flash, agentic (8B on 16 GPUs, 128 trajectories x 8 turns of ~200 tokens, env ~ N(10 s, 5 s))"
    )
    print(f"{'mode':<26}{'s/step':>9}{'speed-up':>10}")
    for name, t in rows.items():
        print(f"{name:<26}{t:>9.1f}{sync / t:>9.2f}x")
    print(f"paper: {ROLL_FLASH['paper_agentic']}x (2.27x async x 1.20x redundant environments)")
    # not in the paper: environments that fail (a hung or crashed environment), the failed
    # episode replaced by each mode's real schedule (lock-step replays it in another round)
    print(f"\nthe same with {FAILURE:.0%} of environment steps failing (not in the paper)")
    print(f"{'mode':<26}{'s/step':>9}{'speed-up':>10}{'vs no failures':>16}")
    failing = _agentic_rows(*(dataclasses.replace(x, failure=FAILURE) for x in (s16, s8)))
    for name, t in failing.items():
        print(f"{name:<26}{t:>9.1f}{failing['lock-step (sync)'] / t:>9.2f}x{t / rows[name]:>15.2f}x")


def _agentic_rows(s16: AgenticSetting, s8: AgenticSetting) -> dict[str, float]:
    """s/step of each agentic mode: the synchronous ones on ``s16`` (colocated), the
    overlapped ones on ``s8`` (8 rollout + 8 train GPUs)."""
    return {
        "lock-step (sync)": run_agentic(s16, "lockstep"),
        "env-level async": run_agentic(s16, "env-async"),
        "+ redundant envs (25%)": run_agentic(s16, "redundant", redundancy=0.25),
        "+ train overlap (8 + 8)": run_agentic(s8, "redundant", max_staleness=1, redundancy=0.25),
        "train overlap alone": run_agentic(s8, "env-async", max_staleness=1),
    }


def rollpacker(steps: int) -> None:
    w = {k: ROLLPACKER[k] for k in ("prompts", "n", "lengths")}
    print("\nRollPacker (Qwen2.5; " + w["lengths"] + f"; {w['prompts']} x {w['n']} per step)")
    print(
        f"{'model':>6}{'GPUs':>6}{'veRL-like s/step':>18}{'tail s/step':>13}{'s/step x':>10}"
        f"{'tokens/s x':>12}{'paper e2e':>11}"
    )
    for size, (g, paper) in ROLLPACKER["models"].items():
        sync = run_queue(_setting(size, g, steps=steps, **w), ratio=0, replicate=False)
        tail = run_tail(_setting(size, g, steps=steps, **w))
        up, tok = sync.s_per_step / tail.s_per_step, tail.tokens_per_s / sync.tokens_per_s
        print(
            f"{size:>6}{g:>6}{sync.s_per_step:>18.1f}{tail.s_per_step:>13.1f}{up:>9.2f}x{tok:>11.2f}x{paper:>10.2f}x"
        )
    lo, hi = ROLLPACKER["tail_alone"]
    print(f"paper: tail batching alone {lo}-{hi}x; end to end (with its other optimisations) above")


PARTS = {
    "roll-flash": roll_flash_rlvr,
    "table1": roll_flash_table1,
    "agentic": roll_flash_agentic,
    "rollpacker": rollpacker,
}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="comma-separated: " + ", ".join(PARTS))
    ap.add_argument("--steps", type=int, default=8, help="simulated steps per run (the first is not timed)")
    args = ap.parse_args(argv)
    only = [p.strip() for p in args.only.split(",") if p.strip()] or list(PARTS)
    bad = [p for p in only if p not in PARTS]
    if bad:
        raise SystemExit(f"error: --only: unknown part(s) {bad} (choose from {', '.join(PARTS)})")
    if args.steps < 2:
        raise SystemExit(f"error: --steps: must be >= 2, got {args.steps}")
    t = time.perf_counter()
    MFU[0] = calibrate_mfu()
    print(
        f"training efficiency calibrated to a {TRAIN_SHARE:.0%} train share of the sync 14B step: mfu {MFU[0]:.4f}"
    )
    for p in only:
        PARTS[p](args.steps)
    print(f"\n(simulated in {time.perf_counter() - t:.1f} s wall time)")


if __name__ == "__main__":
    main()
