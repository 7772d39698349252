"""The step batch (trainers.engines.step): one keyed object from the collector to the learner.

Checked here: its shape rules (a wrong tensor is a one-line error naming the key), rows / view /
replace, that the learner refuses anything else, and that a policy loss reads a new input from
the batch by key with no change to the learner (the point of the design: a new loss input is
the stage that writes the key plus the loss)."""

from __future__ import annotations

import contextlib
import copy
import pickle

import pytest
import torch

from rollkit.registry import POLICY_LOSSES
from rollkit.types import LossOutput
from trainers.engines import TorchTrainEngine, pack, pack_generations
from trainers.engines.base import Generation
from trainers.engines.step import TOKEN_KEEP, StepBatch
from trainers.learner import UpdateSpec, loss_inputs, ppo_update
from trainers.models import char_tokenizer, tiny_qwen2


@contextlib.contextmanager
def _policy_loss(name, fn, extra_key):
    """``fn`` registered as the policy loss ``name`` for the block: it reads ``logprobs``,
    ``advantages``, ``response_mask`` and the batch key ``extra_key`` (its last argument)."""
    keys = {"logprobs": "logprobs", "advantages": "advantages", "mask": "response_mask", extra_key: extra_key}
    POLICY_LOSSES.register(name, fn, in_keys=keys)
    try:
        yield name
    finally:
        POLICY_LOSSES._entries.pop(name, None)


def _packed():
    return pack([[5, 6, 7], [5, 6, 7], [8, 9]], [[10, 11], [12, 13, 14], [15]], 0)


def test_shapes_are_checked_by_key():
    b = StepBatch.from_packed(_packed(), rewards=torch.tensor([1.0, 0.0, 1.0]))
    assert (b.batch_size, b.prompt_len, b.response_len) == (3, 3, 3)
    assert set(b) == {"input_ids", "attention_mask", "response_mask", "rewards"}
    b["advantages"] = torch.zeros(3, 3)
    b["values_k"] = torch.zeros(3, 2, 3)  # an unknown key: only the leading [B] is checked
    with pytest.raises(ValueError, match=r"StepBatch\['advantages'\]: shape \(3, 2\), expected \[B=3, T=3"):
        b["advantages"] = torch.zeros(3, 2)
    with pytest.raises(ValueError, match=r"StepBatch\['rewards'\]: shape \(2,\), expected \[B=3"):
        b["rewards"] = torch.zeros(2)
    with pytest.raises(ValueError, match=r"StepBatch\['input_ids'\]: shape \(3, 5\), expected \[B=3, P \+ T=6\]"):
        b["input_ids"] = torch.zeros(3, 5, dtype=torch.long)
    with pytest.raises(ValueError, match=r"StepBatch\['kl'\]: a list, not a tensor"):
        b["kl"] = [0.0]
    b["advantages"] = None  # None removes the key
    assert "advantages" not in b and b.get("advantages") is None
    with pytest.raises(ValueError, match=r"no tensor for \['response_mask'\]"):
        StepBatch({"input_ids": torch.zeros(1, 2, dtype=torch.long), "attention_mask": torch.ones(1, 2)}, prompt_len=1)


def test_rows_view_replace_and_pickle():
    packed = _packed()
    b = StepBatch.from_packed(packed, advantages=torch.arange(9.0).reshape(3, 3))
    mb = b[torch.tensor([2, 0])]
    assert torch.equal(mb["advantages"], torch.tensor([[6.0, 7, 8], [0, 1, 2]]))
    assert torch.equal(mb.view().input_ids, packed.input_ids[[2, 0]]) and mb.prompt_len == 3
    keep = torch.tensor([[True, False, False], [True, True, False], [True, False, False]])
    b.keep_tokens(keep)
    b.keep_tokens(torch.ones(3, 3, dtype=torch.bool))  # ANDed
    v = b.view()
    assert torch.equal(v.keep, keep) and torch.equal(b.loss_mask, packed.response_mask & keep)
    assert v.old_logprobs is None and v.input_ids is packed.input_ids  # shares tensors
    r = b.replace(**{TOKEN_KEEP: None})
    assert TOKEN_KEEP in b and TOKEN_KEEP not in r and torch.equal(r.loss_mask, packed.response_mask)
    back = pickle.loads(pickle.dumps(b))  # the Ray payload
    assert set(back) == set(b) and all(torch.equal(back[k], b[k]) for k in b)
    td = b.to_tensordict()
    assert tuple(td.batch_size) == (3,) and torch.equal(td["advantages"], b["advantages"])


def test_the_learner_takes_the_step_batch_only():
    packed = _packed()
    eng = TorchTrainEngine(tiny_qwen2(char_tokenizer(), seed=0), lr=1e-2)
    with pytest.raises(ValueError, match="ppo_update: batch is a PackedBatch, not a StepBatch"):
        ppo_update(eng, packed, UpdateSpec())
    with pytest.raises(ValueError, match=r"ppo_update: the step batch has no \['advantages', 'old_logprobs'\]"):
        ppo_update(eng, StepBatch.from_packed(packed), UpdateSpec())


def test_a_policy_loss_reads_a_new_key_from_the_batch():
    """A loss that needs ``token_weights`` (a key no trainer module names) gets it from the
    step batch: zero weights leave the model as it was, unit weights train it."""

    def weighted_pg(logprobs, advantages, mask, token_weights):
        loss = -advantages * token_weights * logprobs * mask
        return LossOutput(loss, {"weight_mean": token_weights[mask].mean().detach()})

    with _policy_loss("test-weighted-pg", weighted_pg, "token_weights") as name:
        tok = char_tokenizer()
        model = tiny_qwen2(tok, seed=0)
        gens = [
            Generation(prompt_index=0, prompt_ids=[5, 6, 7], token_ids=[10, 11], logprobs=[-1.0, -1.0], finish_reason="stop"),
            Generation(prompt_index=1, prompt_ids=[8, 9], token_ids=[12, 13, 14], logprobs=[-1.0] * 3, finish_reason="stop"),
        ]
        packed = pack_generations(gens, 0)
        spec = UpdateSpec(policy_loss=name, micro_batch_size=1)
        moved = {}
        for w in (0.0, 1.0):
            eng = TorchTrainEngine(copy.deepcopy(model), lr=1e-2)
            b = StepBatch.from_packed(packed, advantages=torch.ones(2, 3), token_weights=torch.full((2, 3), w))
            m = ppo_update(eng, b, spec).metrics()
            assert m["loss/weight_mean"] == pytest.approx(w)
            new = dict(eng.export_weights())
            moved[w] = max(float((new[k] - v.detach()).abs().max()) for k, v in model.named_parameters())
        assert moved[0.0] == 0.0 and moved[1.0] > 1e-4, moved
        # the loss's view of a micro-batch: every key, the loss mask as response_mask, no is_weights
        b["is_weights"] = torch.ones(2, 3)
        b.keep_tokens(torch.tensor([[True, False, False], [True, True, True]]))
        avail = loss_inputs(b, torch.zeros(2, 3))
        assert "token_weights" in avail and "is_weights" not in avail
        assert torch.equal(avail["response_mask"], b.loss_mask) and avail["behavior_logprobs"] is b["old_logprobs"]


def test_the_config_accepts_a_loss_that_reads_what_the_step_batch_will_hold():
    """A policy loss that reads ``ref_logprobs`` (a KL-regularised loss of the user's) passes
    validation where the run has a reference (``algorithm.kl.coef > 0``: the stage adds the key)
    and is refused, before any model loads, naming the key, where it has none."""
    from trainers.config import load_config

    def ref_anchored_pg(logprobs, advantages, mask, ref_logprobs):
        return LossOutput(-(advantages * logprobs + 0.1 * ref_logprobs) * mask, {})

    with _policy_loss("test-ref-anchored-pg", ref_anchored_pg, "ref_logprobs") as name:
        base = ["--model", "tiny", f"algorithm.policy_loss={name}"]
        cfg = load_config([*base, "algorithm.kl.coef=0.1"])
        assert cfg.algorithm.policy_loss == name
        with pytest.raises(ValueError, match=rf"algorithm.policy_loss='{name}' needs \['ref_logprobs'\]"):
            load_config(base)
