"""``algorithm.correction`` in the loops: the old log-probs recomputed on the trainer, the
behaviour (rollout engine) log-probs corrected by rollkit.correction's weights, mismatch
metrics every step. A real mismatch is made by running the transformers rollout in bfloat16
and the trainer in float32, an injected one by ``rollout.engine_temperature`` (the engine
samples at another temperature than the trainer's log-probs use); real tiny Qwen2, CPU."""

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers")

import torch

from trainers.config import AgenticConfig, load_config
from trainers.engines.base import batch_logprobs, pack_generations
from trainers.loops import AgenticTrainer, AsyncTrainer, SyncTrainer
from trainers.loops.collect import sampling_params
from trainers.loops.common import Timer

BASE = ["--model", "tiny", "data.digits=1", "data.eval_size=10", "eval.before=false", "eval.every=0",
        "rollout.prompts_per_step=2", "rollout.n=4", "rollout.max_tokens=6", "train.steps=1",
        "algorithm.entropy_coef=0.01", "logging.progress=false", "logging.plot=false",
        "logging.tensorboard=false", "logging.save_model=false"]  # fmt: skip


def _step(tmp_path, *args, cls=SyncTrainer):
    cfg = load_config([*BASE, f"logging.dir={tmp_path}", *args])
    with cls(cfg) as tr:
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


#: the same numerics on both sides (float32), the trainer's log-probs at temperature 1
F32 = ["rollout.dtype=float32", "rollout.temperature=1.0"]
TAIL = ["tail_batching.enabled=true", "rollout.n=2", "rollout.length_dist=lognormal:4:1.5",
        "rollout.chunk_tokens=2"]  # fmt: skip


@pytest.mark.parametrize("collector", ["group", "tail"])
def test_engine_samples_at_engine_temperature(tmp_path, collector):
    """The collected samples carry the engine's log-probs at rollout.engine_temperature (equal to
    the trainer's log-probs at that temperature), not at rollout.temperature."""
    extra = TAIL if collector == "tail" else []
    cfg = load_config([*BASE, f"logging.dir={tmp_path}", *F32, "rollout.engine_temperature=0.5", *extra])
    assert sampling_params(cfg, 0, 0).temperature == 0.5 and cfg.rollout.temperature == 1.0
    with SyncTrainer(cfg) as tr:
        groups, _, _ = tr.collector.collect(0, Timer())
        b = pack_generations([g for _, gs, _ in groups for g in gs], tr.codec.pad_id)
        m = b.response_mask

        def gap(temperature):
            lp = batch_logprobs(tr.train, b, temperature=temperature, micro_batch_size=8)
            return float((lp - b.old_logprobs)[m].abs().max())

        assert m.sum() > 0 and gap(0.5) < 1e-4 and gap(1.0) > 0.1


def test_injected_temperature_mismatch_is_measured(tmp_path):
    """Engine at 0.5, trainer at 1.0, same numerics otherwise: the step's mismatch metrics see it
    and the token correction's weights move off 1."""
    m = _step(tmp_path, *F32, "rollout.engine_temperature=0.5", "algorithm.correction.level=token")
    assert m["mismatch/k3"] > 1e-2 and m["mismatch/ess_frac"] < 0.99
    assert m["mismatch/ratio_out_0.9_1.1"] > 0.2 and m["mismatch/mult_prob_error"] > 1.05
    assert m["correction/weight_ess_frac"] < 0.99 and m["correction/weight_max"] > 1.2
    assert abs(m["loss/ratio_mean"] - 1) < 1e-5  # decoupled: the ratio is against the recomputation


def test_uncorrected_ratio_mixes_in_the_injected_temperature(tmp_path):
    """Correction off (the PPO ratio against the engine's log-probs): the on-policy ratio is
    pi_1 / mu_0.5, far from 1; with the engine at the trainer's temperature it is 1."""
    inj = _step(tmp_path / "inj", *F32, "rollout.engine_temperature=0.5")
    assert inj["mismatch/k3"] > 1e-2 and inj["mismatch/ratio_out_0.9_1.1"] > 0.2
    assert inj["loss/ratio_min"] < 0.8 and inj["loss/ratio_max"] > 1.2  # off 1 before any update
    same = _step(tmp_path / "same", *F32, "rollout.engine_temperature=1.0")
    assert same["mismatch/k3"] < 1e-8 and same["mismatch/ess_frac"] > 1 - 1e-6
    assert same["mismatch/ratio_out_0.9_1.1"] == 0
    assert abs(same["loss/ratio_min"] - 1) < 1e-5 and abs(same["loss/ratio_max"] - 1) < 1e-5


def test_async_loop_samples_at_engine_temperature(tmp_path):
    """The asynchronous loop's requests (queue scheduling) sample at rollout.engine_temperature:
    with ratio 0 there is no staleness, so the measured mismatch is the temperature's alone."""
    args = ["asynchronous.enabled=true", "asynchronous.ratio=0", "asynchronous.deterministic=true"]
    m = _step(tmp_path, *F32, *args, "rollout.engine_temperature=0.5", cls=AsyncTrainer)
    assert m["staleness/max"] == 0
    assert m["mismatch/k3"] > 1e-2 and m["mismatch/ratio_out_0.9_1.1"] > 0.2
