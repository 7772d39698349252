"""rollkit's RollkitPolicyLoss equals OpenRLHF 0.11.2's PolicyLoss (PPO clip, dual clip,
token- and sequence-level aggregation, GSPO, global normalisers), run inside the OpenRLHF venv
of setup_envs.sh (skipped when it is absent)."""

from _venv import run_checker


def test_openrlhf_rollkit_policy_loss_equals_openrlhf():
    out = run_checker("openrlhf", "check_openrlhf.py")
    assert "all openrlhf checks passed" in out and "FAIL" not in out
