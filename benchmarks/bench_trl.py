"""Benchmark: rollkit's sync trainer vs TRL's ``GRPOTrainer`` on the same RLVR job, one run.

The default job of ``recipes/rlvr_qwen.py``: SmolLM2-135M-Instruct (the embedded default),
2-digit addition, 4 prompts x 8 samples per step, 12 new tokens, temperature 0.7, lr 1e-5
(constant), no KL, token-level PPO-clip loss with group-normalised (GRPO) advantages, 20 steps,
micro-batches of 16. Both trainers see
the same chat-formatted prompts and the same exact-match reward; held-out accuracy (greedy,
100 held-out pairs) is measured by the *same* function for both, before and after training.
Each trainer starts from a fresh copy of the same weights.

    python benchmarks/bench_trl.py                      # the full job (10-15 minutes on a 2-core CPU)
    python benchmarks/bench_trl.py --steps 5            # shorter
    python benchmarks/bench_trl.py --model tiny --steps 2 --eval-size 8   # smoke run

Needs TRL (``pip install -e '.[bench]'``); without it only rollkit runs. Any rollkit config
override can follow ``--`` (e.g. ``-- train.autocast=off`` for float32). Prints s/step and accuracies of
both and the ratio; nothing is asserted. The measured run (rollkit 2.5x faster per step, on a
2-core Intel CPU with AMX): docs/trainer.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_DISABLED", "true")

ROOT = Path(__file__).resolve().parents[1]
try:
    import trainers  # noqa: F401
except ImportError:  # run as a script from a checkout without `pip install -e .`
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402


def _recipe():
    spec = importlib.util.spec_from_file_location("_rlvr_qwen", ROOT / "recipes" / "rlvr_qwen.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


def held_out_accuracy(model, tok, prompts, chat_template: str, max_tokens: int) -> float:
    """Greedy exact-match accuracy through rollkit's HF engine (the trainer's own evaluation)."""
    from trainers.data import encode_prompt
    from trainers.engines import HFRolloutEngine, SamplingParams
    from trainers.rewards import exact_match_reward

    engine = HFRolloutEngine(model, tok)
    gens = engine.generate(
        [encode_prompt(tok, p, chat_template) for p in prompts],
        SamplingParams(n=1, temperature=0.0, max_tokens=max_tokens, seed=0),
    )
    scores = [
        exact_match_reward(tok.decode(g.token_ids, skip_special_tokens=True), prompts[g.prompt_index].answer)
        for g in gens
    ]
    return sum(scores) / len(scores)


def run_rollkit(cfg) -> dict:
    from trainers.loops import SyncTrainer

    trainer = SyncTrainer(cfg)
    out = trainer.fit()
    close = getattr(trainer, "close", None)
    if close is not None:
        close()
    times = [h["time/step"] for h in out["history"] if "time/step" in h]
    return {
        "before": out["accuracy_before"],
        "after": out["accuracy_after"],
        "s_per_step": statistics.median(times) if times else float("nan"),
        "mean_s_per_step": out["seconds_per_step"],
    }


def run_trl(cfg, train_prompts, eval_prompts) -> dict:
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from trainers.data import has_chat_template
    from trainers.engines.build import build_engines
    from trainers.rewards import exact_match_reward

    _, train_engine, tok = build_engines(cfg)  # the same initial weights as rollkit's run
    model = train_engine.model
    chat = cfg.data.chat_template == "on" or (cfg.data.chat_template == "auto" and has_chat_template(tok))

    def as_prompt(p):
        if not chat:
            return p.text
        q = p.text[:-1] if p.text.endswith("=") else p.text
        return [{"role": "user", "content": f"What is {q}? Answer with just the number."}]

    ds = Dataset.from_list([{"prompt": as_prompt(p), "answer": p.answer} for p in train_prompts])

    def reward(completions, answer, **_):
        texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
        return [exact_match_reward(t, a) for t, a in zip(texts, answer)]

    step_times: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            step_times.append(time.perf_counter() - self.t0)

    r, t = cfg.rollout, cfg.train
    mbs = min(t.micro_batch_size, r.prompts_per_step * r.n)
    with tempfile.TemporaryDirectory() as out_dir:
        args = GRPOConfig(
            output_dir=out_dir,
            per_device_train_batch_size=mbs,
            gradient_accumulation_steps=(r.prompts_per_step * r.n) // mbs,
            num_generations=r.n,
            max_completion_length=r.max_tokens,
            temperature=r.temperature,
            learning_rate=t.lr,
            lr_scheduler_type="constant",
            weight_decay=t.weight_decay,
            max_grad_norm=t.grad_clip,
            beta=0.0,
            num_iterations=t.ppo_epochs,
            max_steps=t.steps,
            logging_steps=1,
            save_strategy="no",
            report_to=[],
            use_cpu=True,
            bf16=False,
            seed=cfg.seed,
            disable_tqdm=True,
        )
        before = held_out_accuracy(model, tok, eval_prompts, cfg.data.chat_template, cfg.eval.max_tokens)
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=[reward],
            args=args,
            train_dataset=ds,
            processing_class=tok,
            callbacks=[Timer()],
        )
        t0 = time.perf_counter()
        trainer.train()
        wall = time.perf_counter() - t0
        after = held_out_accuracy(
            trainer.model, tok, eval_prompts, cfg.data.chat_template, cfg.eval.max_tokens
        )
    return {
        "before": before,
        "after": after,
        "s_per_step": statistics.median(step_times) if step_times else float("nan"),
        "mean_s_per_step": wall / max(len(step_times), 1),
    }


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1 :]
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="", help="HF checkpoint dir; '' = SmolLM2 (default); 'tiny'")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--eval-size", type=int, default=100)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    ap.add_argument("--skip-trl", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads or max(1, os.cpu_count() or 1))

    from trainers.config import load_config
    from trainers.data import build_prompts

    recipe = _recipe()
    overrides = [f"model.path={args.model}", f"train.steps={args.steps}", f"data.eval_size={args.eval_size}"]
    with tempfile.TemporaryDirectory() as logdir:
        cfg = load_config(
            [*overrides, f"logging.dir={logdir}", "logging.progress=false", *extra],
            base=recipe.recipe_defaults(),
        )
        train_prompts, eval_prompts = build_prompts(cfg)
        results = {"rollkit": run_rollkit(cfg)}
        if args.skip_trl or importlib.util.find_spec("trl") is None:
            print("TRL is not installed (pip install -e '.[bench]'): only rollkit ran")
        else:
            results["TRL GRPOTrainer"] = run_trl(cfg, train_prompts, eval_prompts)

    r = cfg.rollout
    print(
        f"\nRLVR job: model {cfg.model.path or 'SmolLM2-135M-Instruct'}, {r.prompts_per_step} prompts x {r.n} "
        f"samples, {r.max_tokens} new tokens, T={r.temperature}, lr {cfg.train.lr}, {cfg.train.steps} steps, "
        f"{torch.get_num_threads()} threads"
    )
    base = results["rollkit"]["s_per_step"]
    print(
        f"{'trainer':<18}{'s/step (median)':>16}{'s/step (mean)':>15}{'acc before':>12}{'acc after':>11}{'time vs rollkit':>17}"
    )
    for name, v in results.items():
        print(
            f"{name:<18}{v['s_per_step']:>16.2f}{v['mean_s_per_step']:>15.2f}{v['before']:>12.3f}"
            f"{v['after']:>11.3f}{v['s_per_step'] / base:>16.2f}x"
        )
    return results


if __name__ == "__main__":
    main()
