"""The learner passes ``PackedBatch.step_ids`` to a policy loss that reads ``"step_ids"``
(IPA's chunk ids): ``ppo_update`` with ``policy_loss="ipa"`` over micro-batches gives the
gradient of the whole batch's token-mean IPA loss with those chunks."""

from __future__ import annotations

import torch

from rollkit.losses import aggregate, ipa_loss
from trainers.engines.base import PackedBatch
from trainers.engines.step import StepBatch
from trainers.learner import UpdateSpec, ppo_update


class _TableEngine:
    """A stand-in train engine: the log-prob of row ``i`` is the parameter row ``theta[i]``
    (row ``i`` is named by its first input id), so the test reads the exact gradient."""

    def __init__(self, theta: torch.Tensor) -> None:
        self.theta = theta.clone().requires_grad_(True)

    def logprobs(self, input_ids, attention_mask, response_mask, **kwargs):
        lp = self.theta.index_select(0, input_ids[:, 0])
        return lp, torch.zeros_like(lp)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> dict[str, float]:
        return {}


def _batch() -> tuple[PackedBatch, torch.Tensor, torch.Tensor]:
    mask = torch.tensor([[True, True, False, True, True], [True, True, True, False, False]])
    step_ids = torch.tensor([[0, 0, -1, 1, 1], [0, 0, 1, -1, -1]])
    old = torch.tensor([[-1.0, -1.2, 0.0, -0.5, -0.7], [-2.0, -0.1, -0.3, 0.0, 0.0]])
    prompt = torch.tensor([[0, 9], [1, 9]])  # the first id names the row
    ids = torch.cat([prompt, torch.zeros(2, 5, dtype=torch.long)], 1)
    batch = PackedBatch(ids, torch.ones_like(ids), mask, 2, old_logprobs=old * mask, step_ids=step_ids)
    adv = torch.tensor([[0.5, 0.5, 0.0, -1.0, -1.0], [2.0, 2.0, 0.3, 0.0, 0.0]])
    return batch, adv, old + torch.tensor([[0.05, 0.10, 0.0, -0.02, 0.04], [0.01, -0.03, 0.02, 0.0, 0.0]])


def test_ppo_update_passes_step_ids_to_the_ipa_loss():
    batch, adv, theta = _batch()
    spec = UpdateSpec(policy_loss="ipa", micro_batch_size=1, policy_loss_kwargs={"clip_high": 0.5})
    engine = _TableEngine(theta)
    stats = ppo_update(engine, StepBatch.from_packed(batch, advantages=adv), spec)
    assert stats.metrics()["loss/num_chunks"] > 1  # per micro-batch: a row's turns, not one chunk
    # the reference: the whole batch at once, chunks = the turns
    lp = theta.clone().requires_grad_(True)
    out = ipa_loss(lp, batch.old_logprobs, adv, batch.response_mask, batch.step_ids, clip_high=0.5)
    aggregate(out.loss, batch.response_mask, "token-mean").backward()
    torch.testing.assert_close(engine.theta.grad, lp.grad)
    # without the turns, each row is one chunk: a different gradient
    lp1 = theta.clone().requires_grad_(True)
    one = ipa_loss(lp1, batch.old_logprobs, adv, batch.response_mask, None, clip_high=0.5)
    aggregate(one.loss, batch.response_mask, "token-mean").backward()
    assert not torch.allclose(lp1.grad, lp.grad)


def test_micro_batches_carry_step_ids():
    batch, _, _ = _batch()
    assert torch.equal(batch[torch.tensor([1])].step_ids, batch.step_ids[1:])
    assert PackedBatch(batch.input_ids, batch.attention_mask, batch.response_mask, 2)[0:1].step_ids is None
