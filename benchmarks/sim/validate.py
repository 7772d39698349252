"""The CPU calibration against real runs on this machine: predicted vs measured s/step.

    python -m benchmarks.sim.validate

Each job is simulated with :func:`benchmarks.sim.costs.cpu_smollm2` and the job's own settings
(the same length draws: the simulator runs the trainers' own ``RequestMaker`` with the job's
seed), through the trainers' own collectors (``run_sync``: the synchronous ``GroupCollector``;
``run_tail``: the ``TailCollector``), then compared with the seconds per step measured by the command in :data:`JOBS` on a
2-core AMD EPYC without AMX, float32. What each row predicts and what it was fitted on:

* decode and prefill: ``benchmarks.sim.calibrate`` micro-benchmarks (never fitted on a job);
* train: the torch engine's update over six shapes, with one thread (calibrate), times one
  2-thread speed-up fitted on the recipe's ``time/train`` (the row "recipe, train phase"); so
  the recipe's whole step is a prediction of its rollout plus a fitted train phase, and both W1
  rows are predictions.

The first step of every simulated run is a warm-up and not compared (docs/simulator.md).
"""

from __future__ import annotations

import statistics

from benchmarks.sim.costs import cpu_smollm2
from benchmarks.sim.lengths import Lengths
from benchmarks.sim.run import Setting, run_sync, run_tail

__all__ = ["JOBS", "main", "simulate"]

#: the chat-formatted 2-digit addition prompt of the recipes, in SmolLM2 tokens
PROMPT_LEN = 37

_RECIPE = dict(engine="hf", prompts=4, n=8, lengths=Lengths(12, 0.0, 12), mb=16, sort=False, steps=6)
_W1 = dict(engine="vllm", prompts=4, n=4, lengths=Lengths(16, 1.5, 512), mb=8, sort=True, steps=4)

#: job -> (command and where the measurement is recorded, measured seconds, what is simulated;
#: ``part``: "step" (the whole step) or "train" (the train phase only))
JOBS = {
    "recipe (hf, 4 x 8, 12 tokens)": (
        "python recipes/rlvr_qwen.py seed=S, S = 0, 1, 2: s/step of each whole job, quiet machine "
        "(docs/engines.md, full fine-tuning)",
        [8.0, 8.7, 8.8],
        dict(mode="sync", part="step", **_RECIPE),
    ),
    "recipe, train phase (fitted)": (
        "python benchmarks/bench_server.py: median time/train of the in-process run's 20 steps "
        "(runs/bench_server/vllm/metrics.jsonl; the recipe's job with the vLLM engine)",
        [5.62],
        dict(mode="sync", part="train", **{**_RECIPE, "engine": "vllm"}),
    ),
    "W1 sync (vLLM, 4 x 4)": (
        "python benchmarks/bench_tail_batching.py --model default --engine vllm --prompts 4 --n 4 "
        "--steps 3 --warmup 1 --micro-batch 8  (load average about 3)",
        [80.85, 32.76, 62.91],
        dict(mode="sync", part="step", **_W1),
    ),
    "W1 tail batching (vLLM, 4 x 4)": (
        "(the same run)",
        [41.47, 12.91, 10.76],
        dict(mode="tail", part="step", **_W1),
    ),
}


def simulate(job: dict) -> list[float]:
    """Seconds of the simulated steps (or their train phases) after the first."""
    cost = cpu_smollm2(job["engine"], micro_batch=job["mb"], sort_by_length=job["sort"])
    w1 = "lognormal:16:1.5" if job["lengths"].sigma else ""
    s = Setting(
        job["prompts"], job["n"], job["lengths"], cost, prompt_len=PROMPT_LEN, steps=job["steps"], w1=w1
    )
    res = run_tail(s) if job["mode"] == "tail" else run_sync(s)
    return [x.train if job["part"] == "train" else x.time for x in res.steps[1:]]


def main(argv: list[str] | None = None) -> dict[str, tuple[float, float]]:
    print(
        f"{'job':<34}{'measured s/step':>16}{'simulated':>11}{'error':>8}   per step (measured / simulated)"
    )
    out = {}
    for name, (_cmd, measured, job) in JOBS.items():
        sim = simulate(job)
        m, p = statistics.fmean(measured), statistics.fmean(sim)
        per = ""
        if len(measured) == len(sim) and job["lengths"].sigma:
            per = "  ".join(f"{a:.1f}/{b:.1f}" for a, b in zip(measured, sim))
        print(f"{name:<34}{m:>16.2f}{p:>11.2f}{100 * (p - m) / m:>7.0f}%   {per}")
        out[name] = (m, p)
        if job["mode"] == "tail":  # the first timed step is an outlier (docs/simulator.md)
            m2, p2 = statistics.fmean(measured[1:]), statistics.fmean(sim[1:])
            name2 = "  without its first timed step"
            print(f"{name2:<34}{m2:>16.2f}{p2:>11.2f}{100 * (p2 - m2) / m2:>7.0f}%")
            out[name + ", without the first step"] = (m2, p2)
    print("commands:")
    for name, (cmd, _, _) in JOBS.items():
        print(f"  {name}: {cmd}")
    return out


if __name__ == "__main__":
    main()
