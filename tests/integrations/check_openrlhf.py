"""Run inside the OpenRLHF venv (tests/integrations/setup_envs.sh): rollkit's RollkitPolicyLoss
equals OpenRLHF 0.11.2's PolicyLoss where both define the loss. Exit 1 on a mismatch.

``openrlhf/models/__init__.py`` imports the actor, which needs flash-attn (CUDA only), so the
two files the loss lives in (``models/utils.py``, ``models/loss.py``) are loaded from the
installed package as the submodules of an ``openrlhf.models`` package without its ``__init__``.
"""

import importlib.util
import sys
import types
from pathlib import Path

import torch

from rollkit.integrations.openrlhf import RollkitPolicyLoss

root = Path(importlib.util.find_spec("openrlhf").submodule_search_locations[0]) / "models"
pkg = types.ModuleType("openrlhf.models")
pkg.__path__ = [str(root)]
sys.modules["openrlhf.models"] = pkg
try:
    for sub in ("utils", "loss"):
        spec = importlib.util.spec_from_file_location(f"openrlhf.models.{sub}", root / f"{sub}.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
except NameError as err:
    # DeepSpeed 0.19.6's runtime/zero/muon/muon_optimizer.py swallows an ImportError of its
    # original_muon module (whose import applies torch.compile) and then fails on the missing name.
    # Show the ImportError it hid, and exit with EX_TEMPFAIL: _venv.run_checker runs this once more.
    if "BaseMuonWithAuxAdam" not in str(err):
        raise
    import traceback

    print(f"deepspeed import failed: {err}; the ImportError it hid:", file=sys.stderr)
    try:
        torch.compile(lambda x: x)
        importlib.import_module("deepspeed.runtime.zero.muon.original_muon")
    except Exception:
        traceback.print_exc()
    sys.exit(75)
PolicyLoss = sys.modules["openrlhf.models.loss"].PolicyLoss

torch.manual_seed(0)
B, T = 6, 7
lengths = torch.tensor([7, 4, 2, 7, 5, 3])
mask = torch.arange(T) < lengths[:, None]
old = -torch.rand(B, T) - 0.1
new = old + 0.3 * torch.randn(B, T)
seq_adv = torch.randn(B)
failures = []


def close(what, a, b, tol=1e-6):
    ok = torch.allclose(a.double(), b.double(), atol=tol)
    print(("ok   " if ok else "FAIL ") + what)
    if not ok:
        failures.append(what)


def run(fn, adv, **normalisers):
    lp = new.clone().requires_grad_()
    loss, clip_ratio, ppo_kl, vllm_kl, _ = fn(lp, old, adv, action_mask=mask, **normalisers)
    loss.backward()
    return loss.detach(), lp.grad, clip_ratio, ppo_kl, vllm_kl


cases = [
    dict(clip_eps_low=0.2, clip_eps_high=0.28),
    dict(clip_eps_low=0.2, clip_eps_high=0.28, dual_clip=3.0),
    dict(clip_eps_low=0.1, clip_eps_high=0.2, token_level_loss=False),
    dict(clip_eps_low=0.05, clip_eps_high=0.08, policy_loss_type="gspo"),
]
normalisers = [{}, dict(dp_size=2, batch_num_tokens=float(mask.sum()), global_batch_size=float(B))]
for kw in cases:
    for norm in normalisers:
        theirs = PolicyLoss(**kw)
        ours = RollkitPolicyLoss.from_openrlhf(theirs)
        adv = (seq_adv[:, None] * mask).float()  # OpenRLHF passes [B, T]; GSPO needs one per sequence
        if kw.get("policy_loss_type") != "gspo":
            adv = adv + 0.1 * torch.randn(B, T) * mask
        ref, got = run(theirs, adv, **norm), run(ours, adv, **norm)
        tag = f"{kw} {norm}"
        close(f"loss {tag}", got[0], ref[0])
        close(f"grad {tag}", got[1], ref[1])
        close(f"ppo_kl {tag}", got[3], ref[3])
        if kw.get("policy_loss_type") != "gspo":
            close(f"clip_ratio {tag}", got[2], ref[2])

for bad in (dict(is_correction_level="token"), dict(policy_loss_type="gspo", dual_clip=3.0)):
    try:
        RollkitPolicyLoss(**bad)
        failures.append(f"refusal {bad}")
        print(f"FAIL refusal {bad}")
    except ValueError as e:
        print(f"ok   refused: {e}")

print(f"{len(failures)} failed" if failures else "all openrlhf checks passed")
sys.exit(1 if failures else 0)
