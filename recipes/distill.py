"""On-policy distillation: the student samples, a frozen teacher scores its tokens, the student
minimises its reverse KL to the teacher (docs/distillation.md, docs/offline.md).

With no arguments: the student is SmolLM2-135M-Instruct (the embedded default, the start of
``recipes/rlvr_qwen.py``) and the teacher is the model that ``python recipes/rlvr_qwen.py``
trains and saves (``runs/rlvr_qwen/model``, under the working directory), on 2-digit addition
with that recipe's rollout (4 prompts x 8 samples, 12 new tokens, temperature 0.7), learning
rate, 20 steps and held-out evaluation: the same budget as the RL run, from the same start
(``benchmarks/bench_distill.py`` compares the two over seeds). Without that model it stops
with a one-line error saying to run ``recipes/rlvr_qwen.py`` first or to pass ``--teacher DIR``.

``--tiny``: a random tiny Qwen2 student and a tiny teacher warmed up in process with 200
supervised steps on 1-digit addition (no checkpoint needed), 8 prompts x 4 samples of 4 tokens
at temperature 1, 60 steps, on CPU in under a minute (measured: reverse KL 6.6 -> 3.4 in 80
steps, 0.08 s per step on 2 cores).

    python recipes/rlvr_qwen.py && python recipes/distill.py   # train the teacher, then distill it
    python recipes/distill.py --teacher /ckpt/teacher            # any teacher of the student's tokenizer
    python recipes/distill.py distill.teacher_placement=ray     # the teacher in a Ray actor
    python recipes/distill.py --tiny                             # tiny models, no checkpoint, < 1 minute
    python recipes/distill.py --tiny distill.mode=rl distill.task_coef=1.0   # + the verifier's advantages, PPO loss
    python recipes/distill.py --model /ckpt/Qwen2.5-0.5B --teacher /ckpt/Qwen2.5-7B
    python recipes/distill.py --help                             # every field
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch

from trainers.config import Config, load_config
from trainers.data import build_prompts
from trainers.loops.distill import DistillConfig, DistillTrainer, validate_distill
from trainers.models import is_hub_id


def rlvr_defaults() -> Config:
    """``recipes/rlvr_qwen.py``'s defaults (loaded from its file)."""
    spec = importlib.util.spec_from_file_location("_rlvr_qwen", Path(__file__).with_name("rlvr_qwen.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod.recipe_defaults()


#: where ``python recipes/rlvr_qwen.py`` saves its trained model: the default teacher
RLVR_TEACHER = f"{rlvr_defaults().logging.dir}/model"


def recipe_defaults() -> DistillConfig:
    """The rlvr_qwen recipe's job (model, data, rollout, train, eval), its exported model as the teacher."""
    rl, cfg = rlvr_defaults(), DistillConfig()
    for f in dataclasses.fields(Config):
        setattr(cfg, f.name, getattr(rl, f.name))
    cfg.logging.dir = "runs/distill"
    cfg.distill.teacher = RLVR_TEACHER
    cfg.distill.teacher_warmup_steps = 0
    return cfg


def tiny_defaults() -> DistillConfig:
    """``--tiny``: tiny Qwen2 student and teacher (warmed up in process), 1-digit addition."""
    cfg = DistillConfig()
    cfg.model.path = "tiny"
    cfg.data.digits = 1
    cfg.data.eval_size = 30
    cfg.rollout.prompts_per_step = 8
    cfg.rollout.n = 4
    cfg.rollout.max_tokens = 4
    cfg.rollout.temperature = 1.0  # the student's own distribution: the reverse KL of what it samples
    cfg.train.steps = 60
    cfg.train.lr = 1e-2
    cfg.train.micro_batch_size = 32
    cfg.eval.every = 0
    cfg.eval.max_tokens = 4
    cfg.distill.teacher = "tiny"
    cfg.distill.teacher_tiny_seed = 1
    cfg.distill.teacher_warmup_steps = 200
    return cfg


def recipe_args(argv: list[str]) -> tuple[bool, list[str]]:
    """``(tiny, config tokens)``: ``--tiny`` taken out, ``--teacher DIR`` turned into ``distill.teacher=DIR``."""
    tiny, out, i = False, [], 0
    while i < len(argv):
        a = argv[i]
        if a == "--tiny":
            tiny = True
        elif a == "--teacher":
            if i + 1 >= len(argv):
                raise ValueError("--teacher: missing value (a model directory)")
            out.append(f"distill.teacher={argv[i + 1]}")
            i += 1
        elif a.startswith("--teacher="):
            out.append(f"distill.teacher={a.split('=', 1)[1]}")
        else:
            out.append(a)
        i += 1
    return tiny, out


def check_teacher(cfg: DistillConfig) -> None:
    """A teacher directory that does not exist: one line saying how to get one."""
    t = cfg.distill.teacher
    if t in ("", "tiny") or is_hub_id(t) or Path(t).exists():
        return
    if t == RLVR_TEACHER:
        raise ValueError(
            f"distill.teacher: {t} does not exist: train the teacher first with `python recipes/rlvr_qwen.py` "
            "(it saves its model there), or give one with --teacher DIR"
        )
    raise ValueError(f"distill.teacher: {t} does not exist (give a model directory with --teacher DIR)")


def _fail(e: BaseException) -> SystemExit:
    """A bad key, value, file or record: one line naming it, no traceback (ROLLKIT_DEBUG=1 shows it)."""
    if os.environ.get("ROLLKIT_DEBUG") == "1":
        raise e
    return SystemExit(f"error: {e}")


def main(argv: list[str] | None = None) -> dict:
    try:
        tiny, args = recipe_args(sys.argv[1:] if argv is None else list(argv))
        cfg = load_config(args, base=tiny_defaults() if tiny else recipe_defaults())
        validate_distill(cfg)
        check_teacher(cfg)
        train_prompts, eval_prompts = build_prompts(cfg)  # every record checked before a model loads
    except (ValueError, ImportError) as e:
        raise _fail(e) from None
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or 0) or os.cpu_count() or 1)
    t0 = time.perf_counter()
    try:
        trainer = DistillTrainer(cfg, train_prompts=train_prompts, eval_prompts=eval_prompts)
    except (ValueError, ImportError) as e:
        raise _fail(e) from None
    d = cfg.distill
    print(
        f"[distill] student {cfg.model.path or 'SmolLM2-135M-Instruct (embedded default)'}, teacher "
        f"{d.teacher or 'SmolLM2-135M-Instruct'}{f' + {d.teacher_warmup_steps} SFT steps' if d.teacher_warmup_steps else ''}"
        f"{' (Ray actor)' if d.teacher_placement == 'ray' else ''}, mode {d.mode}, "
        f"{cfg.rollout.prompts_per_step} prompts x {cfg.rollout.n} samples, {cfg.train.steps} steps; "
        f"built in {time.perf_counter() - t0:.1f}s",
        flush=True,
    )
    try:
        out = trainer.fit()
    finally:
        trainer.close()
    kls = [r["distill/reverse_kl"] for r in out["history"] if "distill/reverse_kl" in r]
    if kls:
        print(f"student reverse KL to the teacher: {kls[0]:.3f} (first step) -> {kls[-1]:.3f} (last step)")
    before = out["accuracy_before"]
    print(f"held-out accuracy: {'n/a' if before is None else f'{before:.3f}'} -> {out['accuracy_after']:.3f}")
    print(
        f"{out['steps']} steps, {out['seconds_per_step']:.2f} s/step, total {time.perf_counter() - t0:.0f} s"
    )
    print(f"metrics: {out['metrics_file']}")
    print(f"model: {out['model_dir'] or 'not saved (logging.save_model=false)'}")
    return out


if __name__ == "__main__":
    main()
