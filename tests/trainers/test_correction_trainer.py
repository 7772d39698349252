"""``algorithm.correction`` in the loops: the old log-probs recomputed on the trainer, the
behaviour (rollout engine) log-probs corrected by rollkit.correction's weights, mismatch
metrics every step. A real mismatch is made by running the transformers rollout in bfloat16
and the trainer in float32 (real tiny Qwen2, CPU)."""

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers")

import torch

from trainers.config import AgenticConfig, load_config
from trainers.loops import AgenticTrainer, SyncTrainer

BASE = ["--model", "tiny", "data.digits=1", "data.eval_size=10", "eval.before=false", "eval.every=0",
        "rollout.prompts_per_step=2", "rollout.n=4", "rollout.max_tokens=6", "train.steps=1",
        "algorithm.entropy_coef=0.01", "logging.progress=false", "logging.plot=false",
        "logging.tensorboard=false", "logging.save_model=false"]  # fmt: skip


def _step(tmp_path, *args):
    cfg = load_config([*BASE, f"logging.dir={tmp_path}", *args])
    with SyncTrainer(cfg) as tr:
        m = tr.step()
        w = dict(tr.learner.export_weights())
    assert all(torch.isfinite(v).all() for v in w.values())
    return m


def test_same_numerics_no_mismatch_and_unit_weights(tmp_path):
    m = _step(tmp_path, "rollout.dtype=float32", "algorithm.correction.level=token")
    assert m["mismatch/k3"] < 1e-8 and m["mismatch/ess_frac"] > 1 - 1e-6
    assert abs(m["correction/weight_mean"] - 1) < 1e-4 and m["correction/masked_token_frac"] == 0
    assert m["time/recompute"] > 0


def test_bf16_rollout_is_measured_and_corrected(tmp_path):
    m = _step(tmp_path, "rollout.dtype=bfloat16", "algorithm.correction.level=token")
    assert m["mismatch/k3"] > 1e-7 and m["mismatch/ratio_max"] > m["mismatch/ratio_min"]
    assert m["correction/weight_mean"] > 0 and "correction/truncated_frac" in m


def test_rejection_drops_tokens_outside_the_band(tmp_path):
    m = _step(
        tmp_path,
        "rollout.dtype=bfloat16",
        "algorithm.correction.level=token",
        "algorithm.correction.mask_low=0.999",
        "algorithm.correction.mask_high=1.001",
    )
    assert 0 < m["correction/masked_token_frac"] <= 1


def test_recompute_old_without_correction(tmp_path):
    """verl's default: the PPO ratio is taken against the trainer's recomputation; the engine's
    log-probs only feed the mismatch metrics."""
    m = _step(tmp_path, "rollout.dtype=bfloat16", "algorithm.correction.recompute_old=true")
    assert m["time/recompute"] > 0 and not any(k.startswith("correction/") for k in m)
    assert abs(m["loss/ratio_mean"] - 1) < 1e-5  # old == the trainer's own log-probs
    assert m["mismatch/k3"] > 1e-7


def test_agentic_segment_correction(tmp_path):
    cfg = load_config(
        ["--model", "tiny", "env.kwargs={size: 2, hole_prob: 0.0, max_turns: 2, end_on_format_error: false}",
         "env.max_turns=2", "env.max_context=800", "rollout.groups_per_step=2", "rollout.group_size=2",
         "rollout.max_tokens=6", "train.steps=1", "eval.episodes=2", "eval.before=false",
         "logging.progress=false", f"logging.dir={tmp_path}", "logging.save_model=false",
         "rollout.dtype=bfloat16", "algorithm.correction.level=segment"],
        base=AgenticConfig(),
    )  # fmt: skip
    with AgenticTrainer(cfg) as tr:
        m = tr.step()
    assert "correction/weight_mean" in m and "mismatch/k3" in m
