"""Offline SFT or preference training (DPO, IPO, SimPO, ORPO) on a JSONL / Parquet file.

With no arguments: the tiny Qwen2 + character tokenizer, SFT on a pairs file generated from
1-digit addition (``chosen`` the right sum, ``rejected`` a wrong one; written to
``<logging.dir>/data``), 40 steps of 32 examples, on CPU in seconds. ``offline.loss=dpo``
trains DPO on the same file; start it from the SFT model to run the usual SFT -> DPO pipeline:

    python recipes/sft_dpo.py                                           # SFT -> runs/sft_dpo/model
    python recipes/sft_dpo.py offline.loss=dpo --model runs/sft_dpo/model logging.dir=runs/dpo
    python recipes/sft_dpo.py offline.loss=simpo offline.beta=2.0 offline.gamma=1.0
    python recipes/sft_dpo.py --model /ckpt/Qwen2.5-0.5B --data pairs.jsonl offline.loss=dpo
    python recipes/sft_dpo.py --help                                    # every field

See docs/offline.md.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch

from trainers.config import load_config
from trainers.data_pairs import addition_pairs_file
from trainers.loops.offline import OfflineConfig, OfflineTrainer, load_offline_data, validate_offline


def recipe_defaults() -> OfflineConfig:
    cfg = OfflineConfig()
    cfg.model.path = "tiny"
    cfg.train.steps = 40
    cfg.train.lr = 3e-3
    cfg.train.micro_batch_size = 32
    cfg.offline.batch_size = 32
    cfg.eval.every = 10
    cfg.logging.dir = "runs/sft_dpo"
    return cfg


def _fail(e: BaseException) -> SystemExit:
    """A bad key, value, file or record: one line naming it, no traceback (ROLLKIT_DEBUG=1 shows it)."""
    if os.environ.get("ROLLKIT_DEBUG") == "1":
        raise e
    return SystemExit(f"error: {e}")


def main(argv: list[str] | None = None) -> dict:
    try:
        cfg = load_config(sys.argv[1:] if argv is None else argv, base=recipe_defaults())
        validate_offline(cfg)
        if not cfg.data.train_file:  # the generated addition pairs
            train_f, eval_f = addition_pairs_file(
                Path(cfg.logging.dir) / "data", digits=cfg.data.digits, seed=cfg.seed
            )
            cfg.data.train_file, cfg.data.eval_file = str(train_f), str(eval_f)
        train_data, eval_data = load_offline_data(cfg)  # every record checked before a model loads
        trainer = OfflineTrainer(cfg, train_data=train_data, eval_data=eval_data)
    except (ValueError, ImportError) as e:
        raise _fail(e) from None
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or 0) or os.cpu_count() or 1)
    print(
        f"[offline] {cfg.offline.loss} on {cfg.data.train_file} ({len(train_data)} train / {len(eval_data)} held out), "
        f"model {cfg.model.path or 'SmolLM2-135M-Instruct (embedded default)'}, {cfg.train.steps} steps x "
        f"{cfg.offline.batch_size}",
        flush=True,
    )
    t0 = time.perf_counter()
    before = trainer.evaluate()
    out = trainer.fit()
    after = out["history"][-1] if out["history"] else {}
    print(
        f"held-out loss: {before.get('eval/loss', float('nan')):.4f} -> {after.get('eval/loss', float('nan')):.4f}"
    )
    if "eval/accuracy" in before:
        print(
            f"held-out pairs preferring chosen: {before['eval/accuracy']:.3f} -> {out['accuracy_after']:.3f}"
        )
    print(
        f"{out['steps']} steps, {out['seconds_per_step']:.2f} s/step, total {time.perf_counter() - t0:.0f} s"
    )
    print(f"metrics: {out['metrics_file']}")
    print(f"model: {out['model_dir'] or 'not saved (logging.save_model=false)'}")
    print(f"config: {out['config_file']}")
    return out


if __name__ == "__main__":
    main()
