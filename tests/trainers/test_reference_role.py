"""The in-process KL / DPO reference is a frozen copy of the *initial* weights on every train engine
(DeepSpeed, FSDP2 and Megatron run their forward on the live, possibly sharded weights, so a shallow
copy of the engine would track the policy)."""

from __future__ import annotations

import copy

import pytest
import torch

from trainers.config import load_config
from trainers.engines import TorchTrainEngine
from trainers.engines.build import frozen_reference
from trainers.models import char_tokenizer, tiny_qwen2
from trainers.roles import build_roles

ENGINES = {
    "torch": [],
    "deepspeed": ["train.zero_stage=0"],
    "fsdp2": [],
    "megatron": [],
}


def _batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 100, (3, 10), generator=g)
    am = torch.ones_like(ids)
    am[0, :2] = 0
    rm = torch.ones(3, 4, dtype=torch.bool)
    return ids, am, rm


@pytest.mark.parametrize("engine", list(ENGINES))
def test_the_reference_keeps_the_initial_weights_while_the_policy_moves(engine):
    if engine == "deepspeed":
        pytest.importorskip("deepspeed")
    if engine == "megatron":
        pytest.importorskip("megatron.core")
    tok = char_tokenizer()
    model = tiny_qwen2(tok, seed=2)
    initial = TorchTrainEngine(copy.deepcopy(model))
    cfg = load_config(["--model", "tiny", "train.lr=1e-2", "algorithm.kl.coef=0.1",
                       f"train.engine={engine}", *ENGINES[engine]])  # fmt: skip
    roles = build_roles(cfg, model=copy.deepcopy(model), tokenizer=tok)
    try:
        ids, am, rm = _batch()
        train = roles.train
        train.backward(-(train.logprobs(ids, am, rm) * rm).sum())
        train.step()
        with torch.no_grad():
            ref_lp = roles.reference.logprobs(ids, am, rm)
            torch.testing.assert_close(ref_lp, initial.logprobs(ids, am, rm), rtol=0, atol=1e-5)
            moved = (train.logprobs(ids, am, rm) - ref_lp).abs().max()
        assert moved > 1e-3, f"the policy did not move ({moved})"
        assert frozen_reference(train) is not train
    finally:
        roles.close()
