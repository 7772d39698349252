"""The trained policy saved as a model: ``save_pretrained`` at the end of a run (and with each
checkpoint), loadable by transformers with its tokenizer; the resolved config saved beside the
metrics, readable back with ``--config``. Real tiny Qwen2 models, real DeepSpeed (ZeRO-3)."""

import copy
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers")

import torch
import transformers

from trainers.config import config_to_dict, load_config
from trainers.engines import HFRolloutEngine, TorchTrainEngine
from trainers.loops import SyncTrainer
from trainers.models import char_tokenizer, tiny_qwen2

BASE = [
    "--model",
    "tiny",
    "data.digits=1",
    "data.eval_size=10",
    "eval.before=false",
    "eval.every=0",
    "rollout.prompts_per_step=2",
    "rollout.n=2",
    "rollout.max_tokens=3",
    "train.lr=1e-2",
    "logging.progress=false",
    "logging.tensorboard=false",
    "logging.plot=false",
    "algorithm.entropy_coef=0.5",
]  # fmt: skip  (the entropy term moves the weights whatever the rewards)


def _load(path):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return dict(model.named_parameters()), transformers.AutoTokenizer.from_pretrained(path)


def test_fit_saves_the_trained_model_and_the_config(tmp_path):
    cfg = load_config([*BASE, f"logging.dir={tmp_path / 'run'}", "train.steps=2",
                       f"checkpoint.dir={tmp_path / 'ckpt'}", "checkpoint.every=1"])  # fmt: skip
    tok = char_tokenizer()
    model = tiny_qwen2(tok, seed=0)
    before = {k: v.clone() for k, v in model.named_parameters()}
    train = TorchTrainEngine(model, lr=cfg.train.lr)
    with SyncTrainer(
        cfg, rollout=HFRolloutEngine(copy.deepcopy(model), tok), train=train, tokenizer=tok
    ) as tr:
        out = tr.fit()
        final = dict(tr.learner.export_weights())
    saved, saved_tok = _load(out["model_dir"])
    assert saved.keys() == final.keys()
    assert all(torch.equal(saved[k], final[k]) for k in final)  # the trained weights, exactly
    assert any(not torch.equal(saved[k], before[k]) for k in before)  # and they did train
    assert saved_tok("3+4=").input_ids == tok("3+4=").input_ids
    # one model per checkpoint, the step-1 one differs from the final one
    step1, _ = _load(tmp_path / "ckpt" / "step_000001" / "model")
    assert any(not torch.equal(step1[k], final[k]) for k in final)
    # the resolved config reads back to the same config
    again = load_config(["--config", out["config_file"]])
    assert config_to_dict(again) == config_to_dict(cfg)


def test_save_model_off(tmp_path):
    cfg = load_config([*BASE, f"logging.dir={tmp_path}", "train.steps=1", "logging.save_model=false"])
    tok = char_tokenizer()
    model = tiny_qwen2(tok, seed=0)
    with SyncTrainer(cfg, rollout=HFRolloutEngine(copy.deepcopy(model), tok), train=TorchTrainEngine(model),
                     tokenizer=tok) as tr:  # fmt: skip
        out = tr.fit()
    assert out["model_dir"] is None and not (tmp_path / "model").exists()


def test_deepspeed_zero3_saves_the_gathered_weights(tmp_path):
    pytest.importorskip("trainers.engines.deepspeed_train")
    pytest.importorskip("deepspeed")
    from trainers.engines.deepspeed_train import DeepSpeedTrainEngine

    tok = char_tokenizer()
    eng = DeepSpeedTrainEngine(
        tiny_qwen2(tok, seed=3),
        zero_stage=3,
        ds_config={"zero_optimization": {"stage3_param_persistence_threshold": 0}},  # every weight sharded
    )
    full = {k: v.clone() for k, v in eng.export_weights()}
    eng.save_model(tmp_path / "m", tok)
    saved, _ = _load(tmp_path / "m")
    assert all(torch.equal(saved[k], full[k]) for k in full) and all(v.numel() > 0 for v in saved.values())


def test_trackers_progress_and_config_from_the_config(tmp_path, capsys):
    """logging.wandb (offline) and TensorBoard get the run, TensorBoard the config as text; a
    progress bar with a time estimate for training and evaluation goes to stderr, the step lines
    to stdout."""
    pytest.importorskip("wandb")
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = load_config(
        [*BASE, f"logging.dir={tmp_path}", "train.steps=2", "logging.progress=true", "logging.tensorboard=true",
         "logging.wandb=true", "logging.run_name=t1", "logging.save_model=false", "eval.before=true"]
    )  # fmt: skip
    tok = char_tokenizer()
    model = tiny_qwen2(tok, seed=0)
    with SyncTrainer(cfg, rollout=HFRolloutEngine(copy.deepcopy(model), tok), train=TorchTrainEngine(model),
                     tokenizer=tok) as tr:  # fmt: skip
        out = tr.fit()
    assert out["steps"] == 2
    assert list((tmp_path / "wandb").glob("offline-run-*")), "no offline W&B run"
    ev = EventAccumulator(str(tmp_path / "tb"), size_guidance={"tensors": 0}).Reload()
    assert any("config" in t for t in ev.Tags()["tensors"])
    io = capsys.readouterr()
    assert "[step    2/2]" in io.out
    assert "train: 100%" in io.err and "eval: 100%" in io.err and "<00:00" in io.err  # tqdm's estimate
