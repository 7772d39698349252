"""The keyword arguments of registry-named choices are checked by ``load_config`` itself, against
the registered function's signature: a misspelt key is one line naming the field, the key and
the accepted keys, at parse time (no model, no validation pass, no trainer)."""

import pytest

from trainers.config import AgenticConfig, Config, load_config, validate

PPO_KEYS = "clip_high, clip_low, dual_clip, log_ratio_clamp"
GRPO_KEYS = "batch_std, eps, leave_one_out, loo_std, mean_level, std_level, unbiased_std"


def _error(argv, base=None) -> str:
    with pytest.raises(ValueError) as e:
        load_config(["--model", "tiny", *argv], base=base)
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


def test_the_misspelt_clip_key_of_the_issue_stops_load_config():
    msg = _error(["algorithm.policy_loss_kwargs={clip_hihg: 0.28}"])
    assert msg == (
        "algorithm.policy_loss_kwargs: ppo does not take 'clip_hihg' (unknown key for the policy loss "
        f"ppo_clip; accepted: {PPO_KEYS})"
    )


@pytest.mark.parametrize(
    ("argv", "base", "field", "key", "accepted"),
    [
        (["algorithm.policy_loss=cispo", "algorithm.policy_loss_kwargs={eps_high: 0.3}"], None,
         "algorithm.policy_loss_kwargs", "eps_high", "clip_high, clip_low, log_ratio_clamp"),
        (["algorithm.advantage_kwargs={epsilon: 1e-6}"], None,
         "algorithm.advantage_kwargs", "epsilon", GRPO_KEYS),
    ],
    ids=["policy_loss_kwargs", "advantage_kwargs"],
)  # fmt: skip
def test_every_registry_kwargs_field_names_field_key_and_accepted_keys(argv, base, field, key, accepted):
    msg = _error(argv, base)
    assert msg.startswith(f"{field}: ") and f"'{key}'" in msg and f"accepted: {accepted})" in msg, msg


def test_the_last_name_counts_whatever_the_order():
    # dual_clip is PPO's; the override that picks cispo comes after the kwargs and wins
    load_config(["algorithm.policy_loss_kwargs={dual_clip: 3.0}"])
    msg = _error(["algorithm.policy_loss_kwargs={dual_clip: 3.0}", "algorithm.policy_loss=cispo"])
    assert "cispo does not take 'dual_clip'" in msg


def test_a_yaml_file_is_checked_too(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("algorithm:\n  advantage: rloo\n  advantage_kwargs: {gama: 0.9}\n")
    msg = _error(["--config", str(f)])
    assert msg == (
        "algorithm.advantage_kwargs: rloo does not take 'gama' (unknown key for the advantage estimator "
        "rloo_advantages; accepted: none)"
    )


def test_tensor_inputs_the_trainer_supplies_are_refused():
    msg = _error(["algorithm.policy_loss_kwargs={advantages: 1.0}"])
    assert msg.startswith("algorithm.policy_loss_kwargs: ppo does not take 'advantages' (read from the batch")
    # ppo's optional is_weights tensor is read from the batch too: not a hyper-parameter
    assert "'is_weights'" in _error(["algorithm.policy_loss_kwargs={is_weights: 1.0}"])
    assert "'group_ids'" in _error(["algorithm.advantage_kwargs={group_ids: 1}"])


def test_correct_kwargs_still_load():
    cfg = load_config(
        ["--model", "tiny", "algorithm.policy_loss_kwargs={clip_high: 0.28, clip_low: 0.2, dual_clip: 3.0}",
         "algorithm.advantage=grpo", "algorithm.advantage_kwargs={std_level: null, eps: 1.0e-4}"]
    )  # fmt: skip
    assert (
        cfg.algorithm.policy_loss_kwargs["clip_high"] == 0.28
        and cfg.algorithm.advantage_kwargs["eps"] == 1e-4
    )
    validate(cfg)
    agentic = load_config(
        ["--model", "tiny", "algorithm.advantage=gigpo", "algorithm.advantage_kwargs={gamma: 0.9}",
         "env.kwargs={size: 2, hole_prob: 0.0, max_turns: 2, end_on_format_error: false}"],
        base=AgenticConfig(),
    )  # fmt: skip
    assert agentic.env.kwargs["size"] == 2 and agentic.algorithm.advantage_kwargs == {"gamma": 0.9}
    assert load_config([], base=AgenticConfig()).env.name == "frozenlake"  # its default kwargs fit


def test_what_load_config_leaves_to_validate_and_the_trainer():
    # the critic's GAE takes gamma and lam (validate checks them, naming the field)
    cfg = load_config(["--model", "tiny", "algorithm.advantage=gae", "algorithm.advantage_kwargs={lam: 0.9}"])
    validate(cfg)
    # a name that is not registered stops where it is given (register your own before load_config)
    with pytest.raises(ValueError, match=r"^algorithm\.policy_loss: unknown policy loss 'mine'"):
        load_config(["--model", "tiny", "algorithm.policy_loss=mine", "algorithm.policy_loss_kwargs={k: 1}"])
    # ... and one set in code is validate's to report
    cfg = load_config(["--model", "tiny"])
    cfg.algorithm.policy_loss = "mine"
    with pytest.raises(ValueError, match=r"^algorithm\.policy_loss: unknown policy loss 'mine'"):
        validate(cfg)
    # environments the trainer builds itself: module:attr factories and gem: ids
    base = AgenticConfig()
    cfg = load_config(["env.name=trainers.envs.frozenlake:FrozenLakeEnv", "env.kwargs={x: 1}"], base=base)
    assert cfg.env.kwargs == {"x": 1}
    assert load_config([]) == Config()
