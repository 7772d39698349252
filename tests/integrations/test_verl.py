"""rollkit registered in verl 0.9.1's registries equals verl's built-ins (GRPO advantages, the
vanilla PPO clip and CISPO losses, every loss_agg_mode, global batch info, rollout IS weights),
run inside the verl venv of setup_envs.sh (skipped when it is absent)."""

from _venv import run_checker


def test_verl_registered_rollkit_equals_verl_builtins():
    out = run_checker("verl", "check_verl.py")
    assert "all verl checks passed" in out and "FAIL" not in out
