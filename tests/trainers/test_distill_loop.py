"""On-policy distillation (trainers.loops.distill) on the tiny Qwen2 + character tokenizer, CPU.

Task: 1-digit addition prompts; the student samples with the HF rollout engine, a frozen
teacher scores the sampled tokens.
"""

import copy
import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers")

import torch

from trainers.config import load_config
from trainers.engines import HFRolloutEngine, TorchTrainEngine
from trainers.loops.distill import DistillConfig, DistillTrainer
from trainers.models import char_tokenizer, tiny_qwen2

BASE = [
    "--model",
    "tiny",
    "data.digits=1",
    "data.eval_size=30",
    "eval.before=false",
    "eval.every=0",
    "rollout.prompts_per_step=8",
    "rollout.n=4",
    "rollout.max_tokens=4",
    "rollout.temperature=1.0",
    "train.micro_batch_size=32",
    "logging.progress=false",
]


def make(*overrides, lr=1e-2, teacher=None, optimizer=None):
    cfg = load_config([*BASE, f"train.lr={lr}", *overrides], base=DistillConfig())
    tok = char_tokenizer()
    model = tiny_qwen2(tok, seed=0)
    train = TorchTrainEngine(
        model, **({"optimizer_factory": optimizer, "grad_clip": None} if optimizer else {"lr": lr})
    )
    rollout = HFRolloutEngine(copy.deepcopy(model), tok)
    return DistillTrainer(cfg, rollout=rollout, train=train, tokenizer=tok, teacher=teacher)


def test_teacher_equal_to_student_gives_zero_loss_and_no_update():
    """The teacher is the student itself (the same weights, the same forward): every advantage
    is exactly 0, so the gradient is 0 and not even Adam moves the weights."""
    cfg = load_config([*BASE, "train.lr=1e-2"], base=DistillConfig())
    tok = char_tokenizer()
    model = tiny_qwen2(tok, seed=0)
    train = TorchTrainEngine(model, lr=1e-2)
    tr = DistillTrainer(
        cfg, rollout=HFRolloutEngine(copy.deepcopy(model), tok), train=train, tokenizer=tok, teacher=train
    )
    w0 = [p.detach().clone() for p in tr.engine.model.parameters()]
    m = tr.step()
    assert m["loss/distill"] == 0.0 and m["distill/reverse_kl"] == 0.0 and m["distill/advantage_mean"] == 0.0
    assert m["optim/grad_norm"] == 0.0
    for a, b in zip(w0, tr.engine.model.parameters()):
        assert torch.equal(a, b)
    for (_, a), (_, b) in zip(tr.engine.export_weights(), tr.rollout.model.named_parameters()):
        assert torch.equal(a, b)
    tr.close()
    # a teacher that is a copy of the student (a second model in memory): zero up to float rounding
    tr = make(teacher=tiny_qwen2(tok, seed=0))
    m = tr.step()
    assert abs(m["distill/reverse_kl"]) < 1e-5 and abs(m["loss/distill"]) < 1e-5
    tr.close()


def test_student_reverse_kl_to_a_warm_teacher_falls():
    """A teacher warmed up with 100 supervised steps on the addition prompts, a random student:
    the k1 estimate of the student's reverse KL on its own samples falls (measured: about 5.2
    over the first 3 steps, 3.9 over the last 3 of 10)."""
    tr = make("distill.teacher_warmup_steps=100", "distill.teacher_tiny_seed=1")
    kls = [tr.step()["distill/reverse_kl"] for _ in range(10)]
    first, last = sum(kls[:3]) / 3, sum(kls[-3:]) / 3
    print(f"reverse KL {first:.3f} -> {last:.3f}: {[round(k, 2) for k in kls]}")
    assert last < first - 0.5, kls
    tr.close()


def test_rl_mode_takes_the_same_first_step_as_the_loss_mode():
    """On fresh samples the PPO ratio is 1, so PPO with the distillation advantages has the
    gradient of on_policy_distill: one SGD step of either mode gives the same weights."""
    sgd = lambda p: torch.optim.SGD(p, lr=0.1)  # noqa: E731
    teacher = tiny_qwen2(char_tokenizer(), seed=1)
    weights = {}
    for mode in ("loss", "rl"):
        tr = make(f"distill.mode={mode}", teacher=copy.deepcopy(teacher), optimizer=sgd)
        m = tr.step()
        assert m["distill/reverse_kl"] > 0.01
        weights[mode] = [p.detach().clone() for p in tr.learner.engine.model.parameters()]
        tr.close()
    for a, b in zip(weights["loss"], weights["rl"]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    tr = make("distill.mode=rl", "distill.task_coef=1.0", teacher=teacher)
    m = tr.step()
    for k in ("distill/reverse_kl", "advantage/abs_mean", "reward/mean", "optim/grad_norm"):
        assert k in m, k
    tr.close()


def test_bad_settings_are_one_line_errors():
    with pytest.raises(ValueError, match=r"^distill.mode must be one of loss, rl, got 'kd'$"):
        make("distill.mode=kd")
    with pytest.raises(ValueError, match=r"^distill.task_coef=1.0: task advantages need distill.mode=rl$"):
        make("distill.task_coef=1")
    with pytest.raises(ValueError, match=r"^distill.teacher: model.path: /nonexistent does not exist"):
        make("distill.teacher=/nonexistent")
    with pytest.raises(ValueError, match=r"^distill.teacher: model.path: /nonexistent does not exist"):
        make("distill.teacher=/nonexistent", "distill.teacher_placement=ray")  # before Ray starts
    with pytest.raises(
        ValueError, match=r"^distill.teacher_placement must be one of process, ray, got 'gpu'$"
    ):
        make("distill.teacher_placement=gpu")
    with pytest.raises(ValueError, match=r"^distill.teacher_chunk_tokens must be an int >= 0, got -1$"):
        make("distill.teacher_chunk_tokens=-1")
    with pytest.raises(ValueError, match=r"^distill.teacher_cpus must be > 0, got 0.0$"):
        make("distill.teacher_cpus=0")
    with pytest.raises(ValueError, match=r"^algorithm.advantage=gae: distillation trains without a critic"):
        make("distill.mode=rl", "algorithm.advantage=gae")


def test_rl_mode_runs_the_shared_stage_options():
    """distill.mode=rl trains through the shared update stage: the KL to the initial policy
    (``algorithm.kl.coef``), whitening and the advantage clip act on the teacher's advantages."""
    tr = make("distill.mode=rl", "algorithm.kl.coef=0.5", "algorithm.kl.mode=reward",
              "algorithm.whiten_advantages=true", "algorithm.advantage_clip=0.25")  # fmt: skip
    try:
        m = tr.step()
        assert m["kl/rollout"] >= 0 and "distill/reverse_kl" in m and 0 <= m["advantage/clipped_frac"] <= 1
        assert m["advantage/abs_mean"] <= 0.25 + 1e-6 and "time/teacher" in m and "time/reference" in m
    finally:
        tr.close()


def test_memory_lean_teacher_gives_the_same_step():
    """distill.teacher_chunk_tokens=3 (the teacher's log-probs through the memory-lean path, 3
    positions per chunk) takes the step of the plain teacher, up to float rounding."""
    teacher = tiny_qwen2(char_tokenizer(), seed=1)
    ms = [make(f"distill.teacher_chunk_tokens={c}", teacher=copy.deepcopy(teacher)).step() for c in (0, 3)]
    for k in ("distill/reverse_kl", "loss/distill", "optim/grad_norm"):
        assert abs(ms[0][k] - ms[1][k]) < 1e-5, (k, ms)


def _recipe():
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "recipes"))
    import distill

    return distill


def test_recipe_bad_input_is_one_line(tmp_path, monkeypatch):
    distill = _recipe()

    with pytest.raises(SystemExit, match=r"^error: distill.mode must be one of loss, rl, got 'kd'$"):
        distill.main(["distill.mode=kd"])
    with pytest.raises(
        SystemExit, match=r"^error: distill.teacher_dtype must be one of '', float32, bfloat16, float16, got 'int8'$"
    ):
        distill.main(["distill.teacher_dtype=int8"])

    with pytest.raises(SystemExit, match=r"^error: --teacher: missing value \(a model directory\)$"):
        distill.main(["--teacher"])
    # the default teacher is the model recipes/rlvr_qwen.py saves, under the working directory
    monkeypatch.chdir(tmp_path)
    assert distill.recipe_defaults().distill.teacher == "runs/rlvr_qwen/model"
    with pytest.raises(
        SystemExit,
        match=r"^error: distill.teacher: runs/rlvr_qwen/model does not exist: train the teacher first with "
        r"`python recipes/rlvr_qwen.py` \(it saves its model there\), or give one with --teacher DIR$",
    ):
        distill.main([])
    with pytest.raises(
        SystemExit, match=rf"^error: distill.teacher: {tmp_path}/t does not exist \(give a model"
    ):
        distill.main(["--teacher", f"{tmp_path}/t"])


def test_recipe_defaults_are_the_rlvr_job():
    """The student, data, rollout, train and eval sections are rlvr_qwen's: the same budget."""
    distill = _recipe()
    cfg, rl = distill.recipe_defaults(), distill.rlvr_defaults()
    for section in ("model", "data", "rollout", "train", "eval"):
        assert getattr(cfg, section) == getattr(rl, section), section
    assert cfg.model.path == "" and cfg.data.digits == 2 and cfg.distill.teacher_warmup_steps == 0


def test_recipe_tiny_switch_runs(tmp_path, capsys):
    distill = _recipe()
    out = distill.main(
        ["--tiny", "train.steps=2", "distill.teacher_warmup_steps=5", f"logging.dir={tmp_path}",
         "logging.progress=false", "logging.tensorboard=false", "logging.plot=false", "eval.before=false"]
    )  # fmt: skip
    assert out["steps"] == 2 and (tmp_path / "model").is_dir()
    assert "student tiny, teacher tiny + 5 SFT steps" in capsys.readouterr().out
