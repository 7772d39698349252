"""Benchmark: the training-inference mismatch and its correction (``algorithm.correction``).

Three experiments, each over ``--seeds`` seeds, each printing one markdown table (mean ± sd):

``tiny``
    Injected mismatch on the tiny Qwen2 after its supervised warm-up on 1-digit addition (the
    set-up of the learning tests): the asynchronous trainer with ``asynchronous.ratio=4``
    (samples up to 4 policy versions old, the stale engine's log-probs as the behaviour policy)
    and plain PPO, without correction and with each correction mode (:data:`TINY_MODES`).
    Columns: held-out and trained-prompt greedy accuracy before / after, the step means of
    ``mismatch/k3``, ``correction/masked_token_frac`` and ``staleness/mean``.
``temperature``
    Injected mismatch of another kind, same tiny set-up and warm-up: the synchronous trainer (no
    staleness) whose rollout engine samples at ``rollout.engine_temperature`` (``--engine-temperature``)
    while the trainer's log-probs use ``rollout.temperature=1.0``. Rows: a matched baseline (no
    injection), the injected run without correction (the PPO ratio against the trainer's
    recomputation, and the sync default: against the engine's log-probs) and with each
    correction mode of ``tiny`` (:func:`temperature_modes`). Columns: greedy accuracy before /
    after, the sampled reward of the last steps, the step means of ``mismatch/*`` and
    ``correction/*``.
``vllm``
    A real mismatch: the default recipe's job (``recipes/rlvr_qwen.py``, SmolLM2-135M) with the
    vLLM CPU build sampling in bfloat16 and the torch train engine in float32, without and
    with ``algorithm.correction.level=token`` (one subprocess per run). Columns: held-out
    accuracy before / after, the step means of ``mismatch/*`` and ``correction/*``, wall time.

    python benchmarks/bench_correction.py --experiment tiny            # 5 modes x 3 seeds
    python benchmarks/bench_correction.py --experiment temperature     # 7 rows x 3 seeds
    python benchmarks/bench_correction.py --experiment vllm --vllm-steps 10
    python benchmarks/bench_correction.py --smoke                      # seconds: tiny, 1 seed, 2 steps
    python benchmarks/bench_correction.py --smoke --experiment temperature

Results are printed, not asserted; the measured tables: docs/correction.md ("Measured").
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
try:
    import trainers  # noqa: F401
except ImportError:  # run as a script from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from trainers.config import load_config
from trainers.engines import HFRolloutEngine, TorchTrainEngine
from trainers.learner import supervised_warmup
from trainers.loops import AsyncTrainer, SyncTrainer
from trainers.models import char_tokenizer, tiny_qwen2

ROOT = Path(__file__).resolve().parents[1]

#: correction modes of the tiny experiment: config overrides of ``algorithm.correction``
TINY_MODES: dict[str, list[str]] = {
    "sync reference": ["asynchronous.enabled=false"],  # SyncTrainer: no staleness, no correction
    "off": [],
    "token": ["algorithm.correction.level=token"],
    "sequence": ["algorithm.correction.level=sequence"],
    "geometric": ["algorithm.correction.level=geometric"],
    "token + mask 0.5-2": [
        "algorithm.correction.level=token",
        "algorithm.correction.mask_low=0.5",
        "algorithm.correction.mask_high=2",
    ],
}
#: the injected temperature of ``--experiment temperature`` (chosen once, from one exploratory
#: run on seed 0: docs/correction.md, "Injected mismatch: a rollout temperature ...")
ENGINE_TEMPERATURE = 2.0


def temperature_modes(engine_temperature: float) -> dict[str, list[str]]:
    """The rows of ``--experiment temperature``: config overrides over the synchronous tiny run.
    Every row but ``matched (no injection)`` samples at ``engine_temperature`` (the trainer stays at 1.0)."""
    inj = ["asynchronous.enabled=false", f"rollout.engine_temperature={engine_temperature:g}"]
    rows = {
        "matched (no injection)": ["asynchronous.enabled=false"],
        "off (ratio vs recomputed old)": [*inj, "algorithm.correction.recompute_old=true"],
        "off (ratio vs engine; sync default)": inj,
    }
    for name, extra in TINY_MODES.items():
        if name not in ("sync reference", "off"):
            rows[name] = [*inj, *extra]
    return rows


#: the row names of ``--experiment temperature``
TEMPERATURE_ROWS = tuple(temperature_modes(ENGINE_TEMPERATURE))
#: the tiny task: the learning tests' settings (lr 2e-4, 60 steps, 8 prompts x 8 samples)
TINY_RL = [
    "--model",
    "tiny",
    "data.digits=1",
    "data.eval_size=30",
    "eval.every=0",
    "eval.before=true",
    "train.lr=2e-4",
    "rollout.prompts_per_step=8",
    "rollout.n=8",
    "rollout.temperature=1.0",
    "rollout.max_tokens=4",
    "eval.max_tokens=4",
    "train.micro_batch_size=64",
    "rollout.dtype=float32",
    "train.autocast=off",
    "algorithm.policy_loss=ppo",
    "asynchronous.enabled=true",
    "asynchronous.deterministic=true",
    "logging.progress=false",
    "logging.tensorboard=false",
    "logging.plot=false",
    "logging.save_model=false",
]
#: the real-mismatch job: vLLM in bfloat16 against the torch train engine in float32
VLLM_BASE = [
    "rollout.engine=vllm",
    "rollout.dtype=bfloat16",
    "train.autocast=off",
    "model.dtype=float32",
    "logging.plot=false",
    "logging.save_model=false",
]
VLLM_MODES: dict[str, list[str]] = {"off": [], "token": ["algorithm.correction.level=token"]}
MISMATCH_KEYS = ("k1", "k3", "ess_frac", "ratio_out_0.9_1.1", "ratio_min", "ratio_max", "mult_prob_error")


def mean_sd(xs: list[float]) -> str:
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    if not xs:
        return "n/a"
    sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
    return f"{statistics.mean(xs):.3f} ± {sd:.3f}"


def step_mean(history: list[dict], key: str) -> float:
    vals = [h[key] for h in history if key in h]
    return statistics.mean(vals) if vals else float("nan")


def warm_state(tok, seed: int, warmup: int) -> dict[str, torch.Tensor]:
    """The tiny Qwen2 of ``seed`` after ``warmup`` supervised steps on the task's train prompts."""
    cfg = load_config([*TINY_RL, f"seed={seed}", f"logging.dir={tempfile.mkdtemp()}"])
    model = tiny_qwen2(tok, seed=seed)
    warm = TorchTrainEngine(model, lr=3e-3)
    with AsyncTrainer(
        cfg, rollout=HFRolloutEngine(copy.deepcopy(model), tok), train=warm, tokenizer=tok
    ) as w:
        supervised_warmup(w.train, tok, w.train_prompts, steps=warmup, batch_size=64, seed=seed)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def tiny_run(tok, state: dict, seed: int, extra: list[str]) -> dict[str, float]:
    cfg = load_config([*TINY_RL, f"seed={seed}", f"logging.dir={tempfile.mkdtemp()}", *extra])
    model = tiny_qwen2(tok, seed=seed)
    model.load_state_dict(state)
    train = TorchTrainEngine(model, lr=cfg.train.lr)
    cls = AsyncTrainer if cfg.asynchronous.enabled else SyncTrainer
    with cls(cfg, rollout=HFRolloutEngine(copy.deepcopy(model), tok), train=train, tokenizer=tok) as tr:
        t0 = time.perf_counter()
        train_before = tr.evaluate(tr.train_prompts)["eval/accuracy"]
        out = tr.fit()
        train_after = tr.evaluate(tr.train_prompts)["eval/accuracy"]
        wall = time.perf_counter() - t0
    h = out["history"]
    return {
        "before": out["accuracy_before"],
        "after": out["accuracy_after"],
        "train_before": train_before,
        "train_after": train_after,
        "k3": step_mean(h, "mismatch/k3"),
        "ess": step_mean(h, "mismatch/ess_frac"),
        "out_0.5_2": step_mean(h, "mismatch/ratio_out_0.5_2"),
        "masked": step_mean(h, "correction/masked_token_frac"),
        "truncated": step_mean(h, "correction/truncated_frac"),
        "clip": step_mean(h, "loss/clip_frac"),
        "reward_last": step_mean(h[-10:], "reward/mean"),
        "stale": step_mean(h, "staleness/mean"),
        "wall": wall,
    }


def tiny(seeds: int, steps: int, warmup: int, ratio: float, modes: list[str]) -> dict:
    tok = char_tokenizer()
    extra = [f"train.steps={steps}", f"asynchronous.ratio={ratio:g}"]
    res: dict[str, list[dict]] = {m: [] for m in modes}
    print(
        f"Injected mismatch: tiny Qwen2, 1-digit addition, {warmup} supervised warm-up steps, then "
        f"{steps} RL steps x 64 samples, AsyncTrainer ratio {ratio:g}, plain PPO, float32; "
        f"seeds 0-{seeds - 1}; {torch.get_num_threads()} threads",
        flush=True,
    )
    for seed in range(seeds):
        state = warm_state(tok, seed, warmup)
        for m in modes:
            r = tiny_run(tok, state, seed, [*extra, *TINY_MODES[m]])
            res[m].append(r)
            print(
                f"  seed {seed} {m:<22} held out {r['before']:.3f} -> {r['after']:.3f}, trained "
                f"{r['train_before']:.3f} -> {r['train_after']:.3f}, k3 {r['k3']:.4f}, masked "
                f"{r['masked']:.3f}, staleness {r['stale']:.2f}, {r['wall']:.0f} s",
                flush=True,
            )
    print()
    print(
        "| correction | held-out before | held-out after | trained before | trained after | "
        "mismatch/k3 | masked_token_frac | staleness | s/run |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for m, rs in res.items():
        cols = [mean_sd([r[k] for r in rs]) for k in ("before", "after", "train_before", "train_after")]
        k3 = statistics.mean(r["k3"] for r in rs)
        masked = statistics.mean(r["masked"] for r in rs)
        masked_s = "-" if math.isnan(masked) else f"{masked:.3f}"  # nan: no correction
        stale = statistics.mean(r["stale"] for r in rs)
        wall = statistics.mean(r["wall"] for r in rs)
        print(f"| {m} | {' | '.join(cols)} | {k3:.4f} | {masked_s} | {stale:.2f} | {wall:.0f} |")
    return res


def _frac(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.3f}"  # nan: the metric is not logged (no correction)


def temperature(
    seeds: int, steps: int, warmup: int, engine_temperature: float, rows_named: list[str] | None = None
) -> dict:
    """``--experiment temperature`` (module docstring): the rows of :func:`temperature_modes`
    (``rows_named``: a subset, by name) over ``seeds`` seeds, the same warm weights for every row
    of a seed."""
    tok = char_tokenizer()
    rows = temperature_modes(engine_temperature)
    if rows_named is not None:
        rows = {k: rows[k] for k in rows_named}
    res: dict[str, list[dict]] = {m: [] for m in rows}
    print(
        f"Injected temperature mismatch: tiny Qwen2, 1-digit addition, {warmup} supervised warm-up steps, "
        f"then {steps} RL steps x 64 samples, SyncTrainer, plain PPO, float32; the engine samples at "
        f"{engine_temperature:g}, the trainer's log-probs at 1.0; seeds 0-{seeds - 1}; "
        f"{torch.get_num_threads()} threads",
        flush=True,
    )
    t0 = time.perf_counter()
    for seed in range(seeds):
        state = warm_state(tok, seed, warmup)
        for m, extra in rows.items():
            r = tiny_run(tok, state, seed, [f"train.steps={steps}", *extra])
            res[m].append(r)
            print(
                f"  seed {seed} {m:<36} held out {r['before']:.3f} -> {r['after']:.3f}, trained "
                f"{r['train_before']:.3f} -> {r['train_after']:.3f}, reward (last 10) {r['reward_last']:.3f}, "
                f"k3 {r['k3']:.4f}, clip {r['clip']:.3f}, masked {_frac(r['masked'])}, {r['wall']:.0f} s",
                flush=True,
            )
    print(f"\nwall time: {time.perf_counter() - t0:.0f} s\n")
    print(
        "| run | held-out before | held-out after | trained before | trained after | reward, last 10 steps | "
        "mismatch/k3 | ess_frac | ratio_out_0.5_2 | loss/clip_frac | truncated_frac | masked_token_frac | s/run |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for m, rs in res.items():
        cols = [
            mean_sd([r[k] for r in rs])
            for k in ("before", "after", "train_before", "train_after", "reward_last")
        ]
        avg = {
            k: statistics.mean(r[k] for r in rs)
            for k in ("k3", "ess", "out_0.5_2", "clip", "truncated", "masked", "wall")
        }
        print(
            f"| {m} | {' | '.join(cols)} | {avg['k3']:.4f} | {avg['ess']:.3f} | {avg['out_0.5_2']:.3f} | "
            f"{avg['clip']:.3f} | {_frac(avg['truncated'])} | {_frac(avg['masked'])} | {avg['wall']:.0f} |"
        )
    print("\nheld-out after, per seed:")
    for m, rs in res.items():
        print(f"  {m}: " + " / ".join(f"{r['after']:.3f}" for r in rs))
    return res


def vllm_run(seed: int, steps: int, extra: list[str]) -> dict[str, float]:
    log_dir = tempfile.mkdtemp(prefix="rollkit-bench-correction-")
    cmd = [
        sys.executable,
        str(ROOT / "recipes" / "rlvr_qwen.py"),
        *VLLM_BASE,
        f"train.steps={steps}",
        f"seed={seed}",
        *extra,
        f"logging.dir={log_dir}",
    ]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=3600)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        print(p.stdout[-3000:], p.stderr[-3000:], sep="\n")
        raise SystemExit(f"the recipe failed ({p.returncode}): {' '.join(cmd)}")
    acc = {k: float(v) for k, v in re.findall(r"held-out accuracy (before|after):\s+([0-9.]+)", p.stdout)}
    hist = [json.loads(line) for line in open(Path(log_dir) / "metrics.jsonl")]
    steps_h = [h for h in hist if "time/step" in h]
    row = {f"mismatch/{k}": step_mean(steps_h, f"mismatch/{k}") for k in MISMATCH_KEYS}
    row["masked"] = step_mean(steps_h, "correction/masked_token_frac")
    row["weight_mean"] = step_mean(steps_h, "correction/weight_mean")
    row.update(
        before=acc.get("before", float("nan")),
        after=acc.get("after", float("nan")),
        s_per_step=step_mean(steps_h, "time/step"),
        wall=wall,
        nonfinite=sum(
            1 for h in steps_h for v in h.values() if isinstance(v, float) and not math.isfinite(v)
        ),
    )
    return row


def vllm(seeds: int, steps: int, modes: list[str]) -> dict:
    res: dict[str, list[dict]] = {m: [] for m in modes}
    print(
        f"Real mismatch: recipes/rlvr_qwen.py (SmolLM2-135M, 2-digit addition, 4 x 8 samples), "
        f"{steps} steps, vLLM CPU in bfloat16 vs torch train engine in float32; seeds 0-{seeds - 1}",
        flush=True,
    )
    for seed in range(seeds):
        for m in modes:
            r = vllm_run(seed, steps, VLLM_MODES[m])
            res[m].append(r)
            print(
                f"  seed {seed} {m:<6} held out {r['before']:.3f} -> {r['after']:.3f}, k3 "
                f"{r['mismatch/k3']:.5f}, ratio in [0.9, 1.1] missed {r['mismatch/ratio_out_0.9_1.1']:.4f}, "
                f"{r['s_per_step']:.1f} s/step, {r['wall']:.0f} s, non-finite metrics {r['nonfinite']}",
                flush=True,
            )
    print()
    print(
        "| correction | held-out before | held-out after | mismatch/k1 | mismatch/k3 | ess_frac | "
        "ratio_out_0.9_1.1 | ratio min / max | mult_prob_error | masked_token_frac | s/step | wall s/run |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for m, rs in res.items():

        def avg(k: str, rs=rs) -> float:
            return statistics.mean(r[k] for r in rs)

        masked = "-" if math.isnan(avg("masked")) else f"{avg('masked'):.4f}"  # nan: no correction

        print(
            f"| {m} | {mean_sd([r['before'] for r in rs])} | {mean_sd([r['after'] for r in rs])} | "
            f"{avg('mismatch/k1'):.2e} | {avg('mismatch/k3'):.2e} | {avg('mismatch/ess_frac'):.4f} | "
            f"{avg('mismatch/ratio_out_0.9_1.1'):.4f} | {avg('mismatch/ratio_min'):.3f} / "
            f"{avg('mismatch/ratio_max'):.3f} | {avg('mismatch/mult_prob_error'):.4f} | "
            f"{masked} | {avg('s_per_step'):.1f} | {avg('wall'):.0f} |"
        )
    return res


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experiment", default="both", choices=["tiny", "temperature", "vllm", "both"])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=60, help="tiny: RL steps")
    ap.add_argument("--warmup", type=int, default=100, help="tiny: supervised warm-up steps")
    ap.add_argument("--ratio", type=float, default=4.0, help="tiny: asynchronous.ratio")
    ap.add_argument("--modes", default=",".join(TINY_MODES), help="tiny: correction modes")
    ap.add_argument(
        "--engine-temperature",
        type=float,
        default=ENGINE_TEMPERATURE,
        help="temperature: the rollout engine's sampling temperature (the trainer's is 1.0)",
    )
    ap.add_argument("--rows", default=",".join(TEMPERATURE_ROWS), help="temperature: rows, by name")
    ap.add_argument("--vllm-steps", type=int, default=20, help="vllm: train.steps of every run")
    ap.add_argument("--vllm-modes", default=",".join(VLLM_MODES))
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    ap.add_argument("--smoke", action="store_true", help="seconds: tiny only, 1 seed, 2 steps, 2 modes")
    args = ap.parse_args(argv)
    torch.set_num_threads(max(1, args.threads))
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    vmodes = [m.strip() for m in args.vllm_modes.split(",") if m.strip()]
    for m in modes:
        if m not in TINY_MODES:
            raise SystemExit(f"--modes: unknown mode {m!r}; known: {', '.join(TINY_MODES)}")
    for m in vmodes:
        if m not in VLLM_MODES:
            raise SystemExit(f"--vllm-modes: unknown mode {m!r}; known: {', '.join(VLLM_MODES)}")
    rows = [m.strip() for m in args.rows.split(",") if m.strip()]
    for m in rows:
        if m not in TEMPERATURE_ROWS:
            raise SystemExit(f"--rows: unknown row {m!r}; known: {', '.join(TEMPERATURE_ROWS)}")
    if not args.engine_temperature > 0:
        raise SystemExit(f"--engine-temperature: expected a number > 0, got {args.engine_temperature!r}")
    if args.smoke and args.experiment == "temperature":
        return {"temperature": temperature(1, 2, 5, args.engine_temperature, list(TEMPERATURE_ROWS[:2]))}
    if args.smoke:
        return {"tiny": tiny(1, 2, 5, args.ratio, ["off", "token"])}
    out = {}
    if args.experiment == "temperature":
        out["temperature"] = temperature(args.seeds, args.steps, args.warmup, args.engine_temperature, rows)
    if args.experiment in ("tiny", "both"):
        out["tiny"] = tiny(args.seeds, args.steps, args.warmup, args.ratio, modes)
    if args.experiment in ("vllm", "both"):
        out["vllm"] = vllm(args.seeds, args.vllm_steps, vmodes)
    return out


if __name__ == "__main__":
    main()
