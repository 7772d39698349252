"""Train a reward model on preference pairs with the Bradley-Terry loss: the first link of the
RLHF chain pairs -> reward model -> RL against it.

With no arguments: the embedded SmolLM2-135M-Instruct with a new scalar head
(``AutoModelForSequenceClassification``, ``num_labels=1``), trained with
``rollkit.losses.bradley_terry`` (``offline.loss=rm`` of the offline loop) on the pairs that
``recipes/sft_dpo.py`` reads: generated from 1-digit addition (``chosen`` the right sum,
``rejected`` a wrong one; 80 train / 20 held-out pairs, written to ``<logging.dir>/data``).
It prints the held-out preference accuracy (the share of held-out pairs with
r(chosen) > r(rejected)) before and after, writes it to
``<logging.dir>/preference_accuracy.json`` and saves the reward model (model + tokenizer) to
``<logging.dir>/model``, which the RL recipe then scores with:

    python recipes/reward_model.py                                  # -> runs/reward_model/model
    python recipes/rlvr_qwen.py reward.verifier=reward_model reward.rm_path=runs/reward_model/model \\
        data.digits=1 data.eval_size=20 train.steps=2 logging.dir=runs/rlhf
    python recipes/reward_model.py model.path=tiny train.steps=40 train.lr=3e-3   # seconds, tiny Qwen2
    python recipes/reward_model.py --model /ckpt/Qwen2.5-0.5B --data pairs.jsonl data.eval_file=held.jsonl
    python recipes/reward_model.py --help                           # every field

See docs/rewards-workers.md (A learned reward model).
"""

from __future__ import annotations

import json
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
from trainers.engines.build import train_autocast
from trainers.loops.offline import OfflineConfig, OfflineTrainer, load_offline_data, validate_offline


def recipe_defaults() -> OfflineConfig:
    cfg = OfflineConfig()
    cfg.offline.loss = "rm"
    cfg.model.path = ""  # the embedded SmolLM2-135M-Instruct
    cfg.train.steps = 10  # one epoch of the 80 pairs
    cfg.train.lr = 3e-5
    cfg.train.micro_batch_size = 8
    cfg.offline.batch_size = 8
    cfg.eval.before = True
    cfg.logging.dir = "runs/reward_model"
    return cfg


def _fail(e: BaseException) -> SystemExit:
    """A bad key, value, file or record: one line naming it, no traceback (ROLLKIT_DEBUG=1 shows it)."""
    if os.environ.get("ROLLKIT_DEBUG") == "1":
        raise e
    return SystemExit(f"error: {e}")


def _setup(argv: list[str]) -> tuple[OfflineConfig, OfflineTrainer]:
    cfg = load_config(argv, base=recipe_defaults())
    if cfg.offline.loss != "rm":
        raise ValueError(
            f"offline.loss: this recipe trains a reward model (rm), got {cfg.offline.loss!r}; "
            "recipes/sft_dpo.py trains the policy losses"
        )
    validate_offline(cfg)
    if not cfg.data.train_file:  # the addition pairs of recipes/sft_dpo.py
        train_f, eval_f = addition_pairs_file(
            Path(cfg.logging.dir) / "data", digits=cfg.data.digits, seed=cfg.seed
        )
        cfg.data.train_file, cfg.data.eval_file = str(train_f), str(eval_f)
    train_data, eval_data = load_offline_data(cfg)  # every record checked before a model loads
    if not eval_data:
        raise ValueError(
            "data.eval_size: the recipe measures held-out preference accuracy; hold out >= 1 pair"
        )
    return cfg, OfflineTrainer(cfg, train_data=train_data, eval_data=eval_data)


def main(argv: list[str] | None = None) -> dict:
    try:
        cfg, trainer = _setup(sys.argv[1:] if argv is None else argv)
    except (ValueError, ImportError) as e:
        raise _fail(e) from None
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or 0) or os.cpu_count() or 1)
    autocast = train_autocast(cfg, cfg.train.device)
    print(
        f"[reward model] Bradley-Terry on {cfg.data.train_file} ({len(trainer.train_data)} train / "
        f"{len(trainer.eval_data)} held-out pairs), model {cfg.model.path or 'SmolLM2-135M-Instruct (embedded default)'} "
        f"+ scalar head, {cfg.train.steps} steps x {cfg.offline.batch_size} pairs, lr {cfg.train.lr}, "
        f"{cfg.model.dtype}{f' (autocast {autocast})' if autocast else ''}",
        flush=True,
    )
    t0 = time.perf_counter()
    out = trainer.fit()
    seconds = time.perf_counter() - t0
    before, after = out["accuracy_before"], out["accuracy_after"]
    shown = "n/a" if before is None else f"{before:.3f}"
    print(f"held-out preference accuracy (r(chosen) > r(rejected)): {shown} -> {after:.3f}")
    print(f"{out['steps']} steps, {out['seconds_per_step']:.2f} s/step, total {seconds:.0f} s")
    summary = {
        "preference_accuracy_before": before,
        "preference_accuracy_after": after,
        "held_out_pairs": len(trainer.eval_data),
        "train_pairs": len(trainer.train_data),
        "steps": out["steps"],
        "seconds": seconds,
        "seconds_per_step": out["seconds_per_step"],
        "model": cfg.model.path or "SmolLM2-135M-Instruct",
        "seed": cfg.seed,
        "model_dir": out["model_dir"],
    }
    result = Path(cfg.logging.dir) / "preference_accuracy.json"
    result.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"results: {result}")
    print(f"metrics: {out['metrics_file']}")
    if out["model_dir"]:
        print(f"reward model: {out['model_dir']}")
        print(
            "RL against it: python recipes/rlvr_qwen.py reward.verifier=reward_model "
            f"reward.rm_path={out['model_dir']} data.digits={cfg.data.digits}"
        )
    else:
        print("reward model: not saved (logging.save_model=false)")
    return {**out, **summary}


if __name__ == "__main__":
    main()
