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
    python benchmarks/bench_lora_rollout.py --engine-only     # weight sync and sampling alone

``--engine-only`` times the two paths without training, side by side in one process on the
embedded SmolLM2 (float32): one vLLM engine as each mode builds it (``lora=None`` for merged,
``lora=adapter_config(16, 32)`` for adapter), a LoRA r16 policy whose ``lora_B`` is drawn
(std 0.01), then ``--repeats`` x (``update_weights`` of merged weights / of the adapter, and a
generate of the recipe's batch: 4 prompts x 8 samples, 12 tokens, temperature 0.7); medians.
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


def _acc(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def engine_only(repeats: int) -> list[tuple[str, float, float]]:
    """``[(mode, median update_weights s, median generate s)]`` (module docstring)."""
    import copy
    import time

    import torch

    sys.path.insert(0, str(ROOT))
    from trainers.engines import SamplingParams
    from trainers.engines.lora import (
        LORA_TARGETS,
        adapter_config,
        adapter_weights,
        apply_lora,
        merged_weights,
    )
    from trainers.engines.vllm_rollout import VLLMRolloutEngine
    from trainers.models import default_model_path, load_model

    path = default_model_path()
    model, tok = load_model(path, dtype=torch.float32)
    policy = apply_lora(copy.deepcopy(model), rank=16, alpha=32.0, seed=0)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.01)
    prompts = [tok(f"What is {a}+{b}? Answer:").input_ids for a, b in ((12, 34), (56, 7), (80, 19), (45, 45))]
    params = SamplingParams(n=8, temperature=0.7, max_tokens=12, ignore_eos=True, seed=0)
    rows = []
    for mode in MODES:
        lora = adapter_config(16, 32.0, LORA_TARGETS) if mode == "adapter" else None
        eng = VLLMRolloutEngine(path, dtype="float32", max_model_len=512, seed=0, lora=lora)
        sync, gen = [], []
        for k in range(repeats + 1):  # the first round warms up and is not counted
            weights = adapter_weights(policy) if mode == "adapter" else merged_weights(policy)
            t0 = time.perf_counter()
            eng.update_weights(weights, version=k + 1)
            t1 = time.perf_counter()
            eng.generate(prompts, params)
            t2 = time.perf_counter()
            if k:
                sync.append(t1 - t0)
                gen.append(t2 - t1)
        eng.shutdown()
        rows.append((mode, statistics.median(sync), statistics.median(gen)))
        print(f"{mode}: update_weights {rows[-1][1]:.3f} s, generate {rows[-1][2]:.3f} s", flush=True)
    return rows


def table(results: dict[str, dict[int, dict]], seeds: list[int]) -> str:
    rows = [
        "| rollout.lora_weights | " + " | ".join(f"seed {s}" for s in seeds)
        + " | mean after | s/step | weight sync s/step | rollout s/step | peak RSS MiB |",
        "|---" * (len(seeds) + 6) + "|",
    ]  # fmt: skip
    for mode, by_seed in results.items():
        rs = [by_seed[s] for s in seeds]
        acc = " | ".join(f"{_acc(r['before'])} -> {_acc(r['after'])}" for r in rs)

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
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of merged,adapter")
    ap.add_argument("--engine-only", action="store_true", help="time weight sync and sampling alone")
    ap.add_argument("--repeats", type=int, default=5, help="--engine-only: timed rounds per mode")
    args, overrides = ap.parse_known_args(argv)
    if args.engine_only:
        if args.repeats < 1:
            raise SystemExit(f"error: --repeats: expected an int >= 1, got {args.repeats}")
        rows = engine_only(args.repeats)
        print(
            "\n| rollout.lora_weights | update_weights s (median) | generate 4 x 8 x 12 tokens s (median) |"
        )
        print("|---|---|---|")
        for mode, sync, gen in rows:
            print(f"| {mode} | {sync:.3f} | {gen:.3f} |")
        return {}
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        raise SystemExit(f"error: --seeds: expected comma-separated ints, got {args.seeds!r}") from None
    if not seeds:
        raise SystemExit("error: --seeds: give at least one seed")
    modes = tuple(m for m in MODES if m in args.modes.split(","))
    if not modes or set(args.modes.split(",")) - set(MODES):
        raise SystemExit(f"error: --modes: expected a subset of {','.join(MODES)}, got {args.modes!r}")
    results: dict[str, dict[int, dict]] = {m: {} for m in modes}
    for seed in seeds:
        for mode in modes if seed % 2 == 0 else modes[::-1]:  # alternate which mode runs first
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
