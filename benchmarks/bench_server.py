"""The sync RLVR recipe's job on ``vllm serve`` processes next to the in-process vLLM engine.

Runs ``recipes/rlvr_qwen.py``'s job (:func:`recipes.rlvr_qwen.main`, its defaults plus the
given overrides) twice in this process, one engine after the other, same model, seed and
settings: ``rollout.engine=vllm`` (in process) and ``rollout.engine=server`` with
``--servers`` local servers started by rollkit. Prints one table: held-out accuracy before and
after, seconds per step (``SyncTrainer.fit``'s mean) and the wall time including start-up.
Results are printed, never asserted; compare the rows of one run only (docs/server.md).

    python benchmarks/bench_server.py                                   # the recipe's defaults
    python benchmarks/bench_server.py --model tiny model.tiny_heads=2 model.tiny_kv_heads=1 \\
        data.digits=1 data.eval_size=30 train.steps=6                   # a small run
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "recipes"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the in-process engine
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import rlvr_qwen  # noqa: E402


def run(engine_args: list[str], overrides: list[str], log_dir: Path) -> dict:
    t0 = time.perf_counter()
    out = rlvr_qwen.main([*overrides, *engine_args, f"logging.dir={log_dir}"])
    return {
        "before": out["accuracy_before"],
        "after": out["accuracy_after"],
        "s_per_step": out["seconds_per_step"],
        "wall_s": time.perf_counter() - t0,
    }


def main(argv: list[str] | None = None) -> list[tuple[str, dict]]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--servers", type=int, default=2, help="local vllm serve processes")
    ap.add_argument("--log-dir", default="runs/bench_server")
    args, overrides = ap.parse_known_args(argv)
    log = Path(args.log_dir)
    rows = [
        ("vllm (in process)", run(["rollout.engine=vllm"], overrides, log / "vllm")),
        (
            f"server x{args.servers}",
            run(["rollout.engine=server", f"rollout.num_servers={args.servers}"], overrides, log / "server"),
        ),
    ]
    print(
        f"\ncommand: python benchmarks/bench_server.py {' '.join(argv if argv is not None else sys.argv[1:])}"
    )
    print(f"{'engine':<20} {'acc before':>10} {'acc after':>10} {'s/step':>8} {'wall s':>8}")
    for name, r in rows:
        before = float("nan") if r["before"] is None else r["before"]
        print(f"{name:<20} {before:>10.3f} {r['after']:>10.3f} {r['s_per_step']:>8.2f} {r['wall_s']:>8.0f}")
    return rows


if __name__ == "__main__":
    main()
