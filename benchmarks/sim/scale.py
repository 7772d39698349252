"""The scheduling code at cluster scale: many engines, a million requests, invariants on every step.

    python -m benchmarks.sim.scale                                   # 1,000 engines, 1,000,000 requests
    python -m benchmarks.sim.scale --engines 100 --requests 50000    # a quick one

Runs :func:`benchmarks.sim.run.run_queue` (the real ``QueueScheduler`` and ``SampleBuffer``)
with async ratio ``--ratio`` until ``--requests`` single-sample requests were trained, checking
:func:`~benchmarks.sim.run.check_invariants` after every step (conservation of the buffer's
requests, staleness within the bound, every in-flight request finished, running or queued to
resume after each suspend / update / resume). Prints the wall time per simulated step (the
overhead of the scheduling code plus the simulator), the peak memory, and the counts: every
reserved request is trained once, or dropped by a stated rule (``aborted``: expired by the
freshness bound or filtered; ``dropped_stale``), or still in flight at the end.
"""

from __future__ import annotations

import argparse
import resource
import time

from benchmarks.sim.costs import gpu_model
from benchmarks.sim.lengths import Lengths
from benchmarks.sim.run import Setting, run_queue

__all__ = ["main"]


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", type=int, default=1000)
    ap.add_argument("--requests", type=int, default=1_000_000, help="requests (samples) to train")
    ap.add_argument("--prompts", type=int, default=1024, help="prompts per step")
    ap.add_argument("--n", type=int, default=8, help="samples per prompt")
    ap.add_argument("--ratio", type=float, default=2.0, help="async ratio")
    ap.add_argument("--lengths", default="lognormal:median=1000,sigma=1.0,cap=8192")
    ap.add_argument("--tick", type=float, default=1.0, help="least simulated seconds between producer steps")
    ap.add_argument("--size", default="8B", help="model size for the GPU cost model")
    args = ap.parse_args(argv)
    for name in ("engines", "requests", "prompts", "n"):
        if getattr(args, name) < 1:
            raise SystemExit(f"error: --{name}: must be >= 1, got {getattr(args, name)}")
    if args.ratio < 0 or args.tick < 0:
        raise SystemExit("error: --ratio / --tick: must be >= 0")
    try:
        lengths = Lengths.parse(args.lengths)
        cost = gpu_model(args.size, train_gpus=max(8, args.engines // 3))
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    per_step = args.prompts * args.n
    steps = -(-args.requests // per_step)
    s = Setting(
        args.prompts,
        args.n,
        lengths,
        cost,
        engines=args.engines,
        steps=steps,
        num_prompts=max(args.prompts * 4, args.requests // args.n),
        tick=args.tick,
    )
    t0 = time.perf_counter()
    res = run_queue(s, ratio=args.ratio)
    wall = time.perf_counter() - t0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    c = res.counts
    trained = sum(x.samples for x in res.steps)
    sim = sum(x.time for x in res.steps)
    print(
        f"{args.engines} engines, {steps} steps x {per_step} samples = {trained} trained samples, "
        f"async ratio {args.ratio:g}, {lengths.describe()}, tick {args.tick:g} s"
    )
    print(
        f"wall {wall:.1f} s: {wall / steps * 1e3:.1f} ms per simulated step ({sim / steps:.1f} simulated s/step); "
        f"peak RSS {rss:.0f} MiB"
    )
    print(
        f"requests (groups of {args.n}): reserved {c['reserved']}, trained {c['consumed']}, "
        f"aborted {c['aborted']}, dropped_stale {c['dropped_stale']}, held {c['held']}, running {c['running']}; "
        f"resubmitted {c['resubmitted']}; max staleness {max(max(x.staleness, default=0) for x in res.steps)}"
    )
    print("invariants: checked after every step, all held")
    return {"wall_s": wall, "ms_per_step": wall / steps * 1e3, "rss_mib": rss, "steps": steps}


if __name__ == "__main__":
    main()
