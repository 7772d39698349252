"""ROLL's reward / advantage / filter / adaptive-KL options of the RLVR trainers (issue 32).

Each key is off by default (tests/trainers/test_fingerprints.py pins the default runs), rejects
bad values with a one-line ``ValueError`` naming it, and changes what it should in a tiny run
on the tiny Qwen2 + character tokenizer (1-digit addition, 1-3 steps on CPU).
"""

import copy
import itertools
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers")

import torch

from rollkit.losses.kl import AdaptiveKLController
from trainers.config import AgenticConfig, help_text, load_config, set_value, validate, validate_agentic
from trainers.engines import HFRolloutEngine, TorchTrainEngine
from trainers.loops import AsyncTrainer, SyncTrainer
from trainers.models import char_tokenizer, tiny_qwen2

BASE = [
    "--model",
    "tiny",
    "data.digits=1",
    "data.eval_size=20",
    "eval.before=false",
    "eval.every=0",
    "rollout.prompts_per_step=2",
    "rollout.n=4",
    "rollout.max_tokens=4",
    "train.micro_batch_size=8",
    "train.lr=1e-3",
    "logging.progress=false",
]

ROLL_METRICS = (
    "reward/clipped_frac",
    "reward/overlong_penalty_mean",
    "reward/overlong_frac",
    "advantage/clipped_frac",
    "filter/accuracy_band_dropped",
    "filter/max_len_masked_frac",
    "kl/coef",
)


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "overrides, field",
    [
        (["algorithm.reward_clip=-1"], "algorithm.reward_clip"),
        (["algorithm.reward_clip=.nan"], "algorithm.reward_clip"),
        (["algorithm.reward_clip=.inf"], "algorithm.reward_clip"),
        (["algorithm.advantage_clip=-0.5"], "algorithm.advantage_clip"),
        (["algorithm.advantage_clip=.nan"], "algorithm.advantage_clip"),
        (["algorithm.whiten_advantages=maybe"], "algorithm.whiten_advantages"),
        (["algorithm.kl.target=-1"], "algorithm.kl.target"),
        (["algorithm.kl.horizon=0"], "algorithm.kl.horizon"),
        (["algorithm.kl.horizon=.nan"], "algorithm.kl.horizon"),
        (["algorithm.kl.target=0.1"], "algorithm.kl.target"),  # no KL (coef 0)
        (["algorithm.kl.target=0.1", "algorithm.kl.coef=0.1"], "algorithm.kl.target"),  # mode=loss
        (
            [
                "algorithm.kl.target=0.1",
                "algorithm.kl.coef=0.1",
                "algorithm.kl.mode=reward",
                "algorithm.kl.horizon=1",
            ],
            "algorithm.kl.horizon",  # batch of 8 > 5 * horizon
        ),
        (["filter.accuracy_band=1"], "filter.accuracy_band"),
        (["filter.accuracy_low=-0.1"], "filter.accuracy_low"),
        (["filter.accuracy_high=.nan"], "filter.accuracy_high"),
        (["filter.accuracy_low=0.8", "filter.accuracy_high=0.2"], "filter.accuracy_low"),
        (["filter.accuracy_low=0.5", "filter.accuracy_high=0.5"], "filter.accuracy_low"),
        (["filter.accuracy_high=1.5"], "filter.accuracy_low / accuracy_high"),
        (["filter.accuracy_band=true", "tail_batching.enabled=true"], "filter.accuracy_band"),
        (["filter.max_len_mask=yes please"], "filter.max_len_mask"),
        (["reward.overlong_buffer=-1"], "reward.overlong_buffer"),
        (["reward.overlong_buffer=1.5"], "reward.overlong_buffer"),
        (["reward.overlong_buffer=5"], "reward.overlong_buffer"),  # > rollout.max_tokens=4
        (["reward.overlong_penalty=-1"], "reward.overlong_penalty"),
        (["reward.overlong_penalty=.inf"], "reward.overlong_penalty"),
    ],
)
def test_bad_value_raises_naming_the_field(overrides, field):
    with pytest.raises(ValueError) as e:
        validate(load_config([*BASE, *overrides]))
    msg = str(e.value)
    assert msg.startswith(field) and "\n" not in msg, msg


def test_good_values_pass():
    validate(
        load_config(
            [
                *BASE,
                "algorithm.reward_clip=0.5",
                "algorithm.advantage_clip=2",
                "algorithm.whiten_advantages=true",
                "algorithm.kl.coef=0.1",
                "algorithm.kl.mode=reward",
                "algorithm.kl.target=0.05",
                "algorithm.kl.horizon=100",
                "filter.accuracy_band=true",
                "filter.accuracy_low=0.1",
                "filter.accuracy_high=0.95",
                "filter.max_len_mask=true",
                "reward.overlong_buffer=4",
                "reward.overlong_penalty=0.5",
            ]
        )
    )


@pytest.mark.parametrize(
    "override",
    [
        "algorithm.reward_clip=1",
        "algorithm.reward_normalizer=true",
        "algorithm.batch_reward_norm=true",
    ],
)
def test_agentic_trainer_rejects_rlvr_only_options(override):
    """The RLVR credit's reward shaping (one reward per sample) is refused for agents; the shared
    update stage's options (whitening, advantage clip, adaptive KL) are not
    (tests/trainers/test_agentic_trainer.py trains with them)."""
    with pytest.raises(ValueError, match=rf"^{override.split('=')[0]}: wired in the RLVR trainers only"):
        load_config([override], base=AgenticConfig())  # load_config validates
    cfg = AgenticConfig()
    key, value = override.split("=")
    set_value(cfg, key, value)  # the same value set in code: validate_agentic refuses it
    with pytest.raises(ValueError, match=rf"^{key}: wired in the RLVR trainers only"):
        validate_agentic(cfg)
    load_config(["algorithm.whiten_advantages=true", "algorithm.advantage_clip=1", "algorithm.kl.coef=0.1",
                 "algorithm.kl.target=1"], base=AgenticConfig())  # fmt: skip


def test_help_names_each_option_with_its_roll_or_verl_name():
    lines = {ln.split()[0]: ln for ln in help_text().splitlines() if ln.strip()}
    for key, name in (
        ("algorithm.reward_clip", "ROLL reward_clip"),
        ("algorithm.advantage_clip", "ROLL advantage_clip"),
        ("algorithm.whiten_advantages", "ROLL whiten_advantages"),
        ("algorithm.kl.target", "ROLL target_kl"),
        ("algorithm.kl.horizon", "ROLL kl_horizon"),
        ("filter.accuracy_band", "ROLL difficulty_mask"),
        ("filter.accuracy_low", "ROLL difficulty_low_threshold"),
        ("filter.accuracy_high", "ROLL difficulty_high_threshold"),
        ("filter.max_len_mask", "ROLL max_len_mask"),
        ("reward.overlong_buffer", "verl overlong_buffer.len"),
        ("reward.overlong_penalty", "verl overlong_buffer.penalty_factor"),
    ):
        assert name in lines[key], key


# --------------------------------------------------------------------------- tiny runs


def make(tmp_path, *overrides, cls=SyncTrainer, **kw):
    cfg = load_config([*BASE, f"logging.dir={tmp_path / 'run'}", *overrides])
    tok = char_tokenizer()
    model = tiny_qwen2(tok, seed=0)
    return cls(
        cfg,
        rollout=HFRolloutEngine(copy.deepcopy(model), tok),
        train=TorchTrainEngine(model, lr=cfg.train.lr),
        tokenizer=tok,
        **kw,
    )


class Spy:
    """Records what the trainer hands the advantage estimator and the learner."""

    def __init__(self, tr):
        self.rewards, self.batches, self.advantages = [], [], []
        entry, learner_update = tr.update.adv_entry, tr.learner.update
        spy = self

        class Entry:
            def call(self, inputs, **kw):
                spy.rewards.append(inputs["rewards"].clone())
                return entry.call(inputs, **kw)

        def update(batch, *, seed):
            spy.batches.append(batch.view())  # the packed view: keep, old / behaviour log-probs
            spy.advantages.append(batch["advantages"].clone())
            return learner_update(batch, seed=seed)

        tr.update.adv_entry = Entry()
        tr.learner.update = update


def by_answer(rewards):
    """A reward function: ``rewards[answer is odd]`` for any completion."""
    return lambda text, answer: rewards[int(answer) % 2]


def test_defaults_add_no_metric_and_no_mask(tmp_path):
    tr = make(tmp_path)
    spy = Spy(tr)
    m = tr.step()
    assert not set(ROLL_METRICS) & set(m)
    assert spy.batches[0].keep is None
    assert tr.update.state_dict() == {"normalizer": None}


def test_reward_clip_clamps_the_rewards(tmp_path):
    tr = make(tmp_path, "algorithm.reward_clip=0.5", reward_fn=by_answer({0: -2.0, 1: 3.0}))
    spy = Spy(tr)
    m = tr.step()
    r = spy.rewards[0]
    assert set(r.tolist()) <= {-0.5, 0.5} and m["reward/clipped_frac"] == 1.0
    raw = torch.where(r > 0, 3.0, -2.0)  # the rollout metric stays the verifier's reward
    assert m["reward/mean"] == pytest.approx(float(raw.mean()))


def test_overlong_penalty_is_added_to_the_rewards(tmp_path):
    # Random tiny model: responses run to rollout.max_tokens=4; the window is the last 2 tokens.
    tr = make(tmp_path, "reward.overlong_buffer=2", "reward.overlong_penalty=0.5", reward_fn=lambda t, a: 1.0)
    spy = Spy(tr)
    m = tr.step()
    lengths = spy.batches[0].response_mask.sum(-1).float()
    expected = 1.0 - 0.5 * ((lengths - 2).clamp(min=0) / 2)
    torch.testing.assert_close(spy.rewards[0], expected)
    assert m["reward/overlong_penalty_mean"] == pytest.approx(float(expected.mean() - 1.0), abs=1e-6)
    assert m["reward/overlong_frac"] == pytest.approx(float((lengths > 2).float().mean()))
    assert m["reward/overlong_frac"] > 0


def _varying_reward():
    calls = []

    def reward(text, answer):
        calls.append(1)
        return float(len(calls) % 3 == 0)

    return reward


def test_whiten_then_clip_advantages(tmp_path):
    tr = make(tmp_path, "algorithm.whiten_advantages=true", reward_fn=_varying_reward())
    spy = Spy(tr)
    tr.step()
    adv, mask = spy.advantages[0], spy.batches[0].response_mask
    sel = adv[mask]
    assert abs(float(sel.mean())) < 1e-5 and float(sel.std()) == pytest.approx(1.0, abs=1e-4)
    assert bool((adv[~mask] == 0).all())

    tr = make(
        tmp_path,
        "algorithm.whiten_advantages=true",
        "algorithm.advantage_clip=0.5",
        reward_fn=_varying_reward(),
    )
    spy = Spy(tr)
    m = tr.step()
    adv, mask = spy.advantages[0], spy.batches[0].response_mask
    assert float(adv.abs().max()) <= 0.5 and float(adv[mask].abs().max()) == 0.5
    assert 0 < m["advantage/clipped_frac"] <= 1


def test_accuracy_band_drops_groups_outside_and_refills(tmp_path):
    # groups of odd answers score 0.5 (kept by the band (0.2, 0.8)), even answers 1.0 (dropped)
    tr = make(
        tmp_path,
        "filter.accuracy_band=true",
        "filter.accuracy_low=0.2",
        "filter.accuracy_high=0.8",
        "filter.max_rounds=8",
        "rollout.prompts_per_step=4",
        reward_fn=by_answer({0: 1.0, 1: 0.5}),
    )
    spy = Spy(tr)
    m = tr.step()
    assert m["rollout/kept_groups"] == 4 and m["filter/accuracy_band_dropped"] > 0
    assert m["rollout/rounds"] > 1
    assert set(spy.rewards[0].tolist()) == {0.5}
    # nothing inside the band: every group dropped, no update
    tr = make(tmp_path, "filter.accuracy_band=true", "filter.max_rounds=2", reward_fn=lambda t, a: 1.0)
    m = tr.step()
    assert m["rollout/kept_groups"] == 0 and m["filter/accuracy_band_dropped"] == 4
    assert "optim/grad_norm" not in m


def test_accuracy_band_needs_rewards_in_0_1(tmp_path):
    tr = make(tmp_path, "filter.accuracy_band=true", reward_fn=lambda t, a: 2.0)
    with pytest.raises(ValueError, match=r"^filter\.accuracy_band: the rewards are its accuracies"):
        tr.step()


def test_max_len_mask_masks_truncated_samples(tmp_path):
    tr = make(tmp_path, "filter.max_len_mask=true", "rollout.max_tokens=3", reward_fn=_varying_reward())
    spy = Spy(tr)
    m = tr.step()
    b = spy.batches[0]
    masked = ~(b.response_mask & b.keep).any(-1)
    assert m["filter/max_len_masked_frac"] == pytest.approx(float(masked.float().mean()))
    assert m["filter/max_len_masked_frac"] > 0  # the random model rarely stops before 3 tokens
    assert bool((b.response_mask.sum(-1)[masked] == 3).all())  # only samples cut at the limit
    assert "optim/grad_norm" in m


def test_adaptive_kl_moves_the_coefficient_by_the_controller_formula(tmp_path):
    tr = make(
        tmp_path,
        "algorithm.kl.coef=0.1",
        "algorithm.kl.mode=reward",
        "algorithm.kl.target=0.001",
        "algorithm.kl.horizon=40",
        "train.lr=1e-2",
        reward_fn=_varying_reward(),
    )
    hist = [tr.step() for _ in range(3)]
    assert hist[0]["kl/coef"] == pytest.approx(0.1)
    B = 8
    for prev, nxt in itertools.pairwise(hist):
        ref = AdaptiveKLController(prev["kl/coef"], target=0.001, horizon=40)
        assert nxt["kl/coef"] == pytest.approx(ref.update(prev["kl/rollout"], n_steps=B), rel=1e-9)
        e = min(max(prev["kl/rollout"] / 0.001 - 1, -0.2), 0.2)
        assert (nxt["kl/coef"] - prev["kl/coef"]) * e >= 0  # up when KL > target, down below
    assert hist[1]["kl/rollout"] > 0.001 and hist[2]["kl/coef"] > hist[1]["kl/coef"]  # trained away
    state = tr.update.state_dict()["kl_ctrl"]
    assert state["target"] == 0.001 and state["value"] != hist[2]["kl/coef"]  # already updated


def test_async_trainer_shares_the_update_and_the_band(tmp_path):
    tr = make(
        tmp_path,
        "asynchronous.enabled=true",
        "asynchronous.deterministic=true",
        "asynchronous.ratio=0",
        "algorithm.reward_clip=0.5",
        "filter.accuracy_band=true",
        "filter.accuracy_low=0.2",
        "filter.accuracy_high=0.8",
        cls=AsyncTrainer,
        reward_fn=by_answer({0: 1.0, 1: 0.6}),
    )
    spy = Spy(tr)
    try:
        m = tr.step()
    finally:
        tr.close()
    assert set(spy.rewards[0].tolist()) == {0.5} and m["reward/clipped_frac"] == 1.0


def test_tail_batching_shares_the_update(tmp_path):
    tr = make(
        tmp_path,
        "tail_batching.enabled=true",
        "rollout.n=2",
        "rollout.max_tokens=8",
        "rollout.length_dist=lognormal:4:1.5",
        "rollout.chunk_tokens=2",
        "algorithm.reward_clip=0.5",
        "filter.max_len_mask=true",
        reward_fn=by_answer({0: -2.0, 1: 3.0}),
    )
    spy = Spy(tr)
    m = tr.step()
    assert set(spy.rewards[0].tolist()) <= {-0.5, 0.5} and m["reward/clipped_frac"] == 1.0
    assert "filter/max_len_masked_frac" in m and spy.batches[0].keep is not None
