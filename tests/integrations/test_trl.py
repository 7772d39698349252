"""rollkit inside TRL 1.16's GRPOTrainer: training runs with a rollkit loss and a rollkit
advantage estimator, and where both define the same loss the rollkit-plugged ``_compute_loss``
equals TRL's own on the same model and inputs (loss and gradients to 1e-6)."""

import pytest
import torch

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

from rollkit.integrations.trl import grpo_trainer_class, trl_advantage_kwargs  # noqa: E402
from trainers.models import char_tokenizer, save_model, tiny_qwen2  # noqa: E402

ALPHABET = "abcdefgh"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    tok = char_tokenizer(ALPHABET)
    return str(save_model(tiny_qwen2(tok, seed=0), tok, tmp_path_factory.mktemp("tiny")))


def count_a(completions, **kwargs):
    return [float(c.count("a")) for c in completions]


def make(trainer_cls, model_dir, tmp_path, **config):
    base = dict(
        output_dir=str(tmp_path),
        use_cpu=True,
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=5,
        max_steps=2,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        learning_rate=1e-3,
        seed=0,
        temperature=1.0,
    )
    args = trl.GRPOConfig(**{**base, **config})
    data = datasets.Dataset.from_dict({"prompt": ["ab", "ba", "cd", "dc", "ef", "fe", "gh", "hg"]})
    return trainer_cls(model=model_dir, reward_funcs=count_a, args=args, train_dataset=data)


def test_training_runs_with_rollkit_loss_and_estimator(model_dir, tmp_path):
    cls = grpo_trainer_class("ppo", advantage="rloo")
    trainer = make(cls, model_dir, tmp_path, beta=0.04, scale_rewards="none", loss_type="dapo")
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 2 and all(torch.isfinite(torch.tensor(h["loss"])) for h in logs)
    assert {"kl", "entropy", "clip_ratio/region_mean", "rollkit/approx_kl"} <= set(logs[0])


def test_rollkit_grpo_estimator_equals_trl_group_normalisation(model_dir, tmp_path):
    args = trl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", scale_rewards="group")
    from rollkit.advantages import grpo_advantages

    rewards = torch.tensor([1.0, 0.0, 2.0, 2.0, 0.5, 3.0])
    ours = grpo_advantages(rewards, torch.arange(6) // 3, **trl_advantage_kwargs(args, "grpo"))
    grouped = rewards.view(-1, 3)
    trls = (grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)
    assert torch.allclose(ours, trls.flatten(), atol=1e-6)


def fixed_inputs(trainer, beta):
    g = torch.Generator().manual_seed(1)
    B, P, T = 4, 3, 5
    vocab = trainer.model.config.vocab_size
    completion_mask = (torch.arange(T) < torch.tensor([5, 3, 1, 4])[:, None]).long()
    inputs = {
        "prompt_ids": torch.randint(3, vocab, (B, P), generator=g),
        "prompt_mask": torch.ones(B, P, dtype=torch.long),
        "completion_ids": torch.randint(3, vocab, (B, T), generator=g),
        "completion_mask": completion_mask,
        "advantages": torch.tensor([1.0, -0.7, 0.4, -1.2]),
        "num_items_in_batch": completion_mask.sum() * 2,
    }
    with torch.no_grad():
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
        att = torch.cat([inputs["prompt_mask"], completion_mask], 1)
        logps, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, att, T)
    inputs["old_per_token_logps"] = logps + 0.3 * torch.randn(B, T, generator=g)
    inputs["sampling_per_token_logps"] = logps + 0.2 * torch.randn(B, T, generator=g)
    if beta:
        inputs["ref_per_token_logps"] = logps + 0.5 * torch.randn(B, T, generator=g)
    return inputs


def loss_and_grads(trainer, inputs):
    trainer.model.train()
    trainer.model.zero_grad()
    trainer.current_gradient_accumulation_steps = 2
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in trainer.model.parameters() if p.grad is not None]


CASES = [
    ("ppo", dict(loss_type="grpo", beta=0.04)),
    ("ppo", dict(loss_type="bnpo", beta=0.04, epsilon_high=0.28)),
    ("ppo", dict(loss_type="dapo", beta=0.04, epsilon=0.1, epsilon_high=0.3)),
    ("ppo", dict(loss_type="dr_grpo", beta=0.0, delta=1.5)),
    ("ppo", dict(loss_type="luspo", beta=0.04, use_bias_correction_kl=True)),
    ("ppo", dict(loss_type="dapo", beta=0.04, top_entropy_quantile=0.5, off_policy_mask_threshold=0.05)),
    ("cispo", dict(loss_type="cispo", beta=0.04, epsilon_high=1.2)),
    (
        "gspo",
        dict(
            loss_type="grpo", beta=0.04, importance_sampling_level="sequence", epsilon=0.05, epsilon_high=0.1
        ),
    ),
]


@pytest.mark.parametrize(
    ("name", "config"), CASES, ids=[f"{n}-{c['loss_type']}-{i}" for i, (n, c) in enumerate(CASES)]
)
def test_rollkit_loss_equals_trl_loss(model_dir, tmp_path, name, config):
    theirs = make(trl.GRPOTrainer, model_dir, tmp_path / "trl", **config)
    ours = make(grpo_trainer_class(name), model_dir, tmp_path / "rk", **config)
    inputs = fixed_inputs(theirs, config["beta"])
    ref_loss, ref_grads = loss_and_grads(theirs, inputs)
    loss, grads = loss_and_grads(ours, inputs)
    assert torch.allclose(loss, ref_loss, atol=1e-6), (loss, ref_loss)
    assert len(grads) == len(ref_grads)
    for a, b in zip(grads, ref_grads, strict=True):
        assert torch.allclose(a, b, atol=1e-6)
    for key in ("kl", "clip_ratio/region_mean", "cispo_clip_ratio"):
        if theirs._metrics["train"].get(key):
            assert ours._metrics["train"][key][-1] == pytest.approx(
                theirs._metrics["train"][key][-1], abs=1e-6
            )


@pytest.mark.parametrize(
    ("name", "config", "setting"),
    [
        ("ppo", dict(loss_type="sapo"), "loss_type"),
        ("ppo", dict(loss_type="cispo", epsilon_high=5.0), "loss_type"),
        ("cispo", dict(loss_type="cispo", epsilon_high=0.28), "epsilon_high"),
        ("ppo", dict(loss_type="grpo", importance_sampling_level="sequence"), "importance_sampling_level"),
        ("gspo", dict(loss_type="grpo", delta=2.0, importance_sampling_level="sequence"), "delta"),
        ("ppo", dict(loss_type="grpo", entropy_coef=0.01), "entropy_coef"),
    ],
)
def test_unhonourable_settings_are_refused(model_dir, tmp_path, name, config, setting):
    with pytest.raises(ValueError, match=setting):
        make(grpo_trainer_class(name), model_dir, tmp_path, **config)


def test_estimator_refuses_unscaled_mismatch(model_dir, tmp_path):
    with pytest.raises(ValueError, match="scale_rewards"):
        make(grpo_trainer_class("ppo", advantage="rloo"), model_dir, tmp_path, scale_rewards="group")
