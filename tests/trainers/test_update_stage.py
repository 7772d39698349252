"""The shared update stage (trainers.loops.stage.UpdateStage) over a credit written from scratch:
what a new pipeline writes is its credit, and the stage's options act on it.

Real roles on the tiny Qwen2 (in process): a transformers rollout, a PyTorch train engine, the
frozen reference of ``algorithm.kl.coef``.
"""

from __future__ import annotations

import copy

import pytest

pytest.importorskip("transformers")

import torch

from trainers.config import load_config
from trainers.engines import HFRolloutEngine, SamplingParams, TorchTrainEngine, pack_generations
from trainers.engines.step import StepBatch
from trainers.loops.common import Timer
from trainers.loops.stage import UpdateStage, row_advantages
from trainers.models import char_tokenizer, tiny_qwen2
from trainers.roles import build_roles


class TokenSumCredit:
    """A pipeline's credit: each sample's reward is the sum of its response's token ids mod 5
    (it varies within a group); the registry estimator over the rows; it records the stage's
    calls."""

    def __init__(self, batch, group_size: int) -> None:
        self.mask = batch.response_mask
        self.rewards = ((batch.responses * self.mask).sum(-1) % 5).float()
        self.group_ids = torch.arange(self.mask.shape[0]) // group_size
        self.calls: list[str] = []
        self.penalty = None

    def penalize(self, kl_penalty, *, critic, metrics):
        self.calls.append("penalize")
        self.penalty = kl_penalty
        self.rewards = self.rewards - (kl_penalty * self.mask).sum(-1)

    def shape_rewards(self, metrics):
        self.calls.append("shape_rewards")

    def advantages(self, entry, kwargs, metrics):
        self.calls.append("advantages")
        return row_advantages(entry, {"rewards": self.rewards, "group_ids": self.group_ids, "response_mask": self.mask}, kwargs)

    def token_rewards(self):
        raise AssertionError("no critic here")

    def shape_advantages(self, batch, adv, metrics):
        self.calls.append("shape_advantages")
        return adv

    def report(self, adv, metrics):
        self.calls.append("report")
        metrics["length/mean"] = float(self.mask.sum(-1).float().mean())


def test_a_new_pipeline_is_a_credit(tmp_path):
    cfg = load_config(["--model", "tiny", f"logging.dir={tmp_path}", "algorithm.kl.coef=0.5",
                       "algorithm.kl.mode=reward", "algorithm.whiten_advantages=true", "train.lr=1e-2"])  # fmt: skip
    tok = char_tokenizer()
    model = tiny_qwen2(tok, seed=0)
    roles = build_roles(cfg, rollout=HFRolloutEngine(copy.deepcopy(model), tok),
                        train=TorchTrainEngine(model, lr=1e-2), tokenizer=tok)  # fmt: skip
    try:
        gens = roles.rollout.generate(
            [tok("1+2=").input_ids, tok("3+4=").input_ids], SamplingParams(n=4, max_tokens=6, temperature=1.0, seed=0)
        )
        batch = StepBatch.from_packed(pack_generations(gens, tok.pad_token_id))
        credit = TokenSumCredit(batch.view(), group_size=4)
        before = {k: v.detach().clone() for k, v in model.named_parameters()}
        seen = {}
        update = roles.learner.update

        def spy(b, *, seed):
            seen.update(adv=b["advantages"], ref=b.get("ref_logprobs"), batch=b)
            return update(b, seed=seed)

        roles.learner.update = spy
        m = UpdateStage(cfg, roles).run(batch, credit, 0, Timer())
        # the stage called the credit in its order, the KL penalty first (kl.mode=reward)
        assert credit.calls == ["penalize", "shape_rewards", "advantages", "shape_advantages", "report"]
        assert credit.penalty is not None and m["kl/rollout"] >= 0 and m["length/mean"] > 0
        # the learner got the credit's advantages, whitened over the trained tokens
        adv, mask = seen["adv"], batch["response_mask"]
        assert seen["batch"] is batch and seen["ref"] is not None
        # each stage added its keys to the one step batch the learner got
        assert {"ref_logprobs", "kl", "advantages", "old_logprobs"} <= set(batch)
        assert torch.equal(batch["kl"] * batch["response_mask"], batch["kl"])
        assert not adv[~mask].any()
        assert float(adv[mask].mean()) == pytest.approx(0.0, abs=1e-5)
        assert float(adv[mask].std()) == pytest.approx(1.0, abs=1e-4)
        assert m["advantage/abs_mean"] == pytest.approx(float(adv.abs().sum() / mask.sum()), rel=1e-6)
        assert "optim/grad_norm" in m
        assert any(not torch.equal(before[k], v) for k, v in model.named_parameters())  # it trained
    finally:
        roles.close()
