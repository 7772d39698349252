"""LoRA weights to the vLLM rollout engine: merged full weights vs vLLM's own adapter path.

Runs ``recipes/rlvr_qwen.py``'s job (its defaults plus the given overrides) with a LoRA policy
(``train.lora_rank``) and ``rollout.engine=vllm`` (in process), once per mode and seed, each
run in its own subprocess (so peak RSS is the run's own), the modes alternating within a
seed: ``rollout.lora_weights=merged`` (every step the merged ``W + scale B A`` of every layer is
loaded into vLLM) and ``rollout.lora_weights=adapter`` (only the adapter is written and vLLM
serves it as a new LoRA adapter). Prints one markdown table: held-out accuracy before -> after,
seconds per step, the mean ``time/weight_sync`` and ``time/rollout`` per step, peak RSS.
Results are printed, never asserted; compare the rows of one run only (docs/engines.md).

    python benchmarks/bench_lora_rollout.py --seeds 0,1,2
    python benchmarks/bench_lora_rollout.py --seeds 0 --model tiny model.tiny_heads=2 \\
        model.tiny_kv_heads=1 data.digits=1 data.eval_size=20 train.steps=3     # a small run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: the LoRA settings of docs/engines.md's recipe runs (rank 16, alpha 32, ten times full FT's lr)
LORA = ["train.lora_rank=16", "train.lora_alpha=32", "train.lr=1e-4", "rollout.engine=vllm"]
MODES = ("merged", "adapter")

_CHILD = """
import json, resource, sys
sys.path.insert(0, {recipes!r})
import rlvr_qwen
out = rlvr_qwen.main({argv!r})
hist = out["history"]
def mean(k):
    xs = [r[k] for r in hist if k in r]
    return sum(xs) / len(xs) if xs else float("nan")
print("RESULT " + json.dumps({{
    "before": out["accuracy_before"], "after": out["accuracy_after"], "s_per_step": out["seconds_per_step"],
    "weight_sync_s": mean("time/weight_sync"), "rollout_s": mean("time/rollout"),
    "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
}}))
"""


def run(mode: str, seed: int, overrides: list[str], log_dir: Path, timeout_s: float) -> dict:
    argv = [*LORA, f"rollout.lora_weights={mode}", f"seed={seed}", *overrides, f"logging.dir={log_dir}"]
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "VLLM_ENABLE_V1_MULTIPROCESSING": os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0"),
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
    }
    code = _CHILD.format(recipes=str(ROOT / "recipes"), argv=argv)
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-15:])
        raise RuntimeError(f"run {mode} seed {seed} failed (exit {proc.returncode}):\n{tail}")
    return json.loads(lines[-1][len("RESULT ") :])


def table(results: dict[str, dict[int, dict]], seeds: list[int]) -> str:
    rows = [
        "| rollout.lora_weights | " + " | ".join(f"seed {s}" for s in seeds)
        + " | mean after | s/step | weight sync s/step | rollout s/step | peak RSS MiB |",
        "|---" * (len(seeds) + 6) + "|",
    ]  # fmt: skip
    for mode, by_seed in results.items():
        rs = [by_seed[s] for s in seeds]
        acc = " | ".join(f"{r['before']:.2f} -> {r['after']:.2f}" for r in rs)

        def per_seed(key: str, fmt: str, rs: list[dict] = rs) -> str:
            return " / ".join(format(r[key], fmt) for r in rs)

        rows.append(
            f"| {mode} | {acc} | {statistics.mean(r['after'] for r in rs):.3f} | {per_seed('s_per_step', '.1f')} "
            f"| {per_seed('weight_sync_s', '.3f')} | {per_seed('rollout_s', '.2f')} | {per_seed('rss_mib', '.0f')} |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> dict[str, dict[int, dict]]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0", help="comma-separated seeds, e.g. 0,1,2")
    ap.add_argument("--log-dir", default="runs/bench_lora_rollout")
    ap.add_argument("--timeout-s", type=float, default=3600.0, help="deadline of each run")
    args, overrides = ap.parse_known_args(argv)
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        raise SystemExit(f"error: --seeds: expected comma-separated ints, got {args.seeds!r}") from None
    if not seeds:
        raise SystemExit("error: --seeds: give at least one seed")
    results: dict[str, dict[int, dict]] = {m: {} for m in MODES}
    for seed in seeds:
        for mode in MODES if seed % 2 == 0 else MODES[::-1]:  # alternate which mode runs first
            r = run(mode, seed, overrides, Path(args.log_dir) / f"{mode}-{seed}", args.timeout_s)
            results[mode][seed] = r
            print(f"{mode} seed {seed}: {json.dumps(r)}", flush=True)
    print(
        f"\ncommand: python benchmarks/bench_lora_rollout.py {' '.join(argv if argv is not None else sys.argv[1:])}"
    )
    print(table(results, seeds))
    return results


if __name__ == "__main__":
    main()
