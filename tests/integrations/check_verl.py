"""Run inside the verl venv (tests/integrations/setup_envs.sh): rollkit registered in verl 0.9.1
equals verl's built-ins on verl's own call path. Prints one line per check; exit 1 on a mismatch."""

import copy
import sys

import numpy as np
import torch
from verl.trainer.config import AlgoConfig
from verl.trainer.ppo import core_algos
from verl.workers.config import ActorConfig

from rollkit.integrations.verl import register_advantage, register_policy_loss

torch.manual_seed(0)
B, T = 6, 7
lengths = torch.tensor([7, 4, 2, 7, 5, 3])
mask = torch.arange(T) < lengths[:, None]
old = -torch.rand(B, T) - 0.1
new = old + 0.3 * torch.randn(B, T)
adv = torch.randn(B, T) * mask
uid = np.array(["a", "a", "a", "b", "b", "b"], dtype=object)
failures = []


def close(what, a, b, tol=1e-6):
    ok = torch.allclose(
        torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64), atol=tol
    )
    print(("ok   " if ok else "FAIL ") + what)
    if not ok:
        failures.append(what)


def loss_and_grad(fn, cfg, mode, weights=None):
    """The step's loss as verl computes it: two micro-batches with the global batch info."""
    lp = new.clone().requires_grad_()
    total, metrics = 0.0, []
    for s in (slice(0, 3), slice(3, 6)):
        loss, m = fn(
            old_log_prob=old[s],
            log_prob=lp[s],
            advantages=adv[s],
            response_mask=mask[s],
            loss_agg_mode=mode,
            config=cfg,
            rollout_is_weights=None if weights is None else weights[s],
        )
        total = total + loss
        metrics.append(m)
    total.backward()
    return total.detach(), lp.grad, metrics


register_policy_loss("rollkit_ppo", "ppo")
register_policy_loss("rollkit_cispo", "cispo")
register_advantage("rollkit_grpo", "grpo")
weights = torch.rand(B, T) + 0.5
for mode in (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
):
    cfg = ActorConfig(
        strategy="fsdp",
        rollout_n=3,
        ppo_micro_batch_size_per_gpu=3,
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        clip_ratio_c=2.0,
        loss_scale_factor=16,
    )
    cfg.global_batch_info.update(  # what verl's ppo_loss writes before calling the loss
        dp_size=2,
        batch_num_tokens=int(mask.sum()),
        global_batch_size=B,
        loss_scale_factor=cfg.loss_scale_factor,
    )
    before = copy.deepcopy(cfg.global_batch_info)
    for verl_name, ours in (("vanilla", "rollkit_ppo"), ("cispo", "rollkit_cispo")):
        for w in (None, weights):
            ref = loss_and_grad(core_algos.get_policy_loss_fn(verl_name), cfg, mode, w)
            got = loss_and_grad(core_algos.get_policy_loss_fn(ours), cfg, mode, w)
            tag = f"{verl_name} {mode} {'is_weights' if w is not None else ''}"
            close(f"loss   {tag}", got[0], ref[0])
            close(f"grad   {tag}", got[1], ref[1])
            for key in ("actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"):
                close(f"metric {key} {tag}", [m[key] for m in got[2]], [m[key] for m in ref[2]])
    close(f"global_batch_info unchanged {mode}", float(cfg.global_batch_info == before), 1.0)

rewards = torch.zeros(B, T)
rewards[torch.arange(B), lengths - 1] = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.5, 1.0])
for norm in (True, False):
    ref, _ = core_algos.compute_grpo_outcome_advantage(
        rewards, mask.long(), uid, norm_adv_by_std_in_grpo=norm
    )
    # verl's compute_advantage calls a registered estimator with these keywords
    got, ret = core_algos.get_adv_estimator_fn("rollkit_grpo")(
        token_level_rewards=rewards,
        response_mask=mask.long(),
        config=AlgoConfig(norm_adv_by_std_in_grpo=norm),
        index=uid,
    )
    close(f"grpo advantages norm_adv_by_std_in_grpo={norm}", got, ref)

for bad in (
    lambda: register_policy_loss("x", "tis"),
    lambda: register_policy_loss("x", "ppo", clip_high=0.3),
):
    try:
        bad()
        failures.append("refusal")
        print("FAIL refusal")
    except ValueError as e:
        print(f"ok   refused: {e}")

print(f"{len(failures)} failed" if failures else "all verl checks passed")
sys.exit(1 if failures else 0)
