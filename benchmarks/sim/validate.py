"""The CPU calibration against real runs on this machine: predicted vs measured s/step.

    python -m benchmarks.sim.validate

Each job is simulated with :func:`benchmarks.sim.costs.cpu_smollm2` and the job's own settings
(the same length draws: the simulator runs the trainers' own ``RequestMaker`` with the job's
seed), then compared with the s/step measured by the command in :data:`JOBS` on a 2-core AMD
EPYC without AMX, float32. The decode constants come from ``benchmarks.sim.calibrate``; the
train constant was fitted on the W1 sync steps (so that row's rollout is a prediction, its
train time a fit); the tail-batching steps of the same run and the recipe's job are
predictions. The first step of every simulated run is a warm-up and not
compared (docs/simulator.md).
"""

from __future__ import annotations

import statistics

from benchmarks.sim.costs import cpu_smollm2
from benchmarks.sim.lengths import Lengths
from benchmarks.sim.run import Setting, run_queue, run_tail

__all__ = ["JOBS", "main"]

#: the chat-formatted 2-digit addition prompt of the recipes, in SmolLM2 tokens
PROMPT_LEN = 37

#: job -> (command, measured seconds of the timed steps, what the simulator runs)
JOBS = {
    "recipe (hf, 4 x 8, 12 tokens)": (
        "python recipes/rlvr_qwen.py  (its docstring: 9.3 s/step, 20 steps)",
        [9.3],
        dict(mode="sync", engine="hf", prompts=4, n=8, lengths=Lengths(12, 0.0, 12), mb=16, steps=6),
    ),
    "W1 sync (vLLM, 4 x 4)": (
        "python benchmarks/bench_tail_batching.py --model default --engine vllm --prompts 4 --n 4 "
        "--steps 3 --warmup 1 --micro-batch 8",
        [80.85, 32.76, 62.91],
        dict(mode="sync", engine="vllm", prompts=4, n=4, lengths=Lengths(16, 1.5, 512), mb=8, steps=4),
    ),
    "W1 tail batching (vLLM, 4 x 4)": (
        "(the same run)",
        [41.47, 12.91, 10.76],
        dict(mode="tail", engine="vllm", prompts=4, n=4, lengths=Lengths(16, 1.5, 512), mb=8, steps=4),
    ),
}


def simulate(job: dict) -> list[float]:
    """Seconds of the simulated steps after the first."""
    cost = cpu_smollm2(job["engine"])
    cost = cost.with_(train=cost.train.__class__(**{**cost.train.__dict__, "micro_batch": job["mb"]}))
    w1 = "lognormal:16:1.5" if job["lengths"].sigma else ""
    s = Setting(
        job["prompts"], job["n"], job["lengths"], cost, prompt_len=PROMPT_LEN, steps=job["steps"], w1=w1
    )
    res = run_tail(s) if job["mode"] == "tail" else run_queue(s, ratio=0, replicate=False)
    return [x.time for x in res.steps[1:]]


def main(argv: list[str] | None = None) -> dict[str, tuple[float, float]]:
    print(
        f"{'job':<34}{'measured s/step':>16}{'simulated':>11}{'error':>8}   per step (measured / simulated)"
    )
    out = {}
    for name, (_cmd, measured, job) in JOBS.items():
        sim = simulate(job)
        m, p = statistics.fmean(measured), statistics.fmean(sim)
        per = ""
        if len(measured) == len(sim):
            per = "  ".join(f"{a:.1f}/{b:.1f}" for a, b in zip(measured, sim))
        print(f"{name:<34}{m:>16.2f}{p:>11.2f}{100 * (p - m) / m:>7.0f}%   {per}")
        out[name] = (m, p)
    print("commands:")
    for name, (cmd, _, _) in JOBS.items():
        print(f"  {name}: {cmd}")
    return out


if __name__ == "__main__":
    main()
