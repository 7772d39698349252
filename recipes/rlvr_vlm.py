"""Vision-language RLVR on a CPU: a tiny Qwen2-VL learns a visual task, first supervised, then by RL.

No pretrained VLM can be downloaded here, so with no ``--model`` the recipe builds a small
Qwen2-VL from its config (random weights, the character tokenizer with Qwen2-VL's vision
tokens, Qwen2-VL's image processor; :func:`trainers.vision.tiny_qwen2_vl`), gives it a short
supervised warm-up (40 steps of 32) on the synthetic ``shapes`` task
(:func:`trainers.domains.shapes_task`: 56 x 56 images of coloured squares on grey, "what colour
is the square?", answered 1-4; ``--kinds colour,position,count`` adds the square's quadrant and
the number of squares), then trains it with GRPO through the ordinary trainer, the images going
through the processor, the rollout engine and the training forward (M-RoPE positions, the
vision tower frozen: ``model.freeze_vision``). The data is written as JSONL with PNG files
(the layout of ``data.train_file``; docs/vision.md) and read back like any dataset.

Prints greedy held-out accuracy before RL (= after the warm-up) and after, s/step and peak
memory; writes curves, metrics and the model with its processor under ``logging.dir``.

    python recipes/rlvr_vlm.py
    python recipes/rlvr_vlm.py seed=1 train.steps=30
    python recipes/rlvr_vlm.py --model tiny_idefics3 rollout.engine=vllm   # Idefics3 / SmolVLM on vLLM
    python recipes/rlvr_vlm.py --warmup-steps 0             # RL from the random model
    python recipes/rlvr_vlm.py --kinds colour,position      # + where the square is
    python recipes/rlvr_vlm.py --model /ckpt/Qwen2-VL-2B-Instruct --data my_images.jsonl
    python recipes/rlvr_vlm.py --help                       # every config field

``--model tiny_idefics3``: the tiny Idefics3 (SmolVLM's architecture) instead of Qwen2-VL; vLLM
runs it on CPU (its Qwen2-VL model needs torchvision, which the CPU machines lack).
``--model PATH``: a real vision-language checkpoint (``AutoModelForImageTextToText``): no
warm-up; with no ``--data`` it trains on the shapes task. Measured figures: docs/vision.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from recipes import rlvr_qwen
from trainers.config import Config, load_config
from trainers.domains import shapes_task, write_image_records
from trainers.engines import TorchTrainEngine
from trainers.engines.build import TINY_VLMS
from trainers.learner import supervised_warmup
from trainers.loops.common import memory_metrics
from trainers.models import save_model
from trainers.vision import vision_tokenizer


def recipe_defaults() -> Config:
    """GRPO on the shapes task: 16 prompts x 8 samples, 4 new tokens, temperature 1, 100 steps at
    lr 5e-4 (a tiny model), exact-match reward, float32, the HF rollout engine."""
    cfg = Config()
    cfg.model.path = "tiny_vl"
    cfg.rollout.prompts_per_step = 16
    cfg.rollout.n = 8
    cfg.rollout.max_tokens = 4
    cfg.rollout.temperature = 1.0
    cfg.train.steps = 100
    cfg.train.lr = 5e-4
    cfg.train.micro_batch_size = 32
    cfg.reward.verifier = "exact_match"
    cfg.eval.before = True
    cfg.eval.every = 25
    cfg.eval.max_tokens = 4
    cfg.data.eval_size = 128
    cfg.logging.dir = "runs/rlvr_vlm"
    return cfg


def _args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--warmup-steps", type=int, default=40)
    ap.add_argument("--train-size", type=int, default=1024)
    ap.add_argument("--kinds", default="colour", help="questions of the shapes task: colour,position,count")
    return ap.parse_known_args(argv)


def prepare(cfg: Config, *, warmup_steps: int, train_size: int, kinds: str = "colour") -> list[str]:
    """Write the shapes data (unless ``data.train_file`` is set) and, for the tiny model, warm it
    up and save it; returns the overrides that point the run at them."""
    run = Path(cfg.logging.dir)
    extra = []
    if not cfg.data.train_file:
        kinds_ = tuple(k.strip() for k in kinds.split(",") if k.strip())
        try:
            train, held = shapes_task(kinds=kinds_, train_size=train_size, eval_size=cfg.data.eval_size, seed=cfg.seed)
        except ValueError as e:
            raise SystemExit(f"error: --kinds: {e}") from None
        data = run / "data"
        tf, ef = write_image_records(train, data / "train.jsonl"), write_image_records(held, data / "eval.jsonl")
        extra += [f"data.train_file={tf}", f"data.eval_file={ef}"]
    else:
        train = None
    if cfg.model.path not in TINY_VLMS:
        return extra
    family, make = TINY_VLMS[cfg.model.path]
    tok = vision_tokenizer(family)
    model, _ = make(tok, seed=cfg.seed)
    if warmup_steps:
        if train is None:
            raise SystemExit("error: --warmup-steps needs the shapes task (no --data), or pass --warmup-steps 0")
        t0 = time.perf_counter()
        engine = TorchTrainEngine(model, lr=3e-3, grad_clip=1.0)
        loss = supervised_warmup(engine, tok, train, steps=warmup_steps, batch_size=32, seed=cfg.seed)
        print(f"[warm-up] {warmup_steps} supervised steps, loss {loss:.3f}, {time.perf_counter() - t0:.0f} s", flush=True)
    path = save_model(model.eval(), tok, run / "warm_model")
    return [*extra, f"model.path={path}"]


def main(argv: list[str] | None = None) -> dict:
    opts, rest = _args(sys.argv[1:] if argv is None else argv)
    try:
        cfg = load_config(rest, base=recipe_defaults())
    except (ValueError, ImportError) as e:
        raise SystemExit(f"error: {e}") from None
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or 0) or os.cpu_count() or 1)
    extra = prepare(cfg, warmup_steps=opts.warmup_steps, train_size=opts.train_size, kinds=opts.kinds)
    out = rlvr_qwen.main([*rest, *extra], base=recipe_defaults())
    print(f"peak memory (this process): {memory_metrics()['memory/peak_rss_mib']:.0f} MiB", flush=True)
    return out


if __name__ == "__main__":
    main()
