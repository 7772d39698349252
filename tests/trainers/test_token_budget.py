"""Micro-batches by token budget (``train.max_tokens_per_micro_batch``): every row trained
exactly once, the budget kept, ranks aligned, and — with rollkit's global normalisers — the
same gradient as fixed-size micro-batches in every aggregation mode (real tiny Qwen2)."""

import copy
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers")

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rollkit.registry import AGGREGATIONS
from trainers.engines import TorchTrainEngine, pack
from trainers.engines.step import StepBatch
from trainers.learner import UpdateSpec, micro_batches, pack_by_tokens, ppo_update
from trainers.models import char_tokenizer, tiny_qwen2


@settings(max_examples=200, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 40), min_size=1, max_size=30),
    prompt_len=st.integers(1, 10),
    budget=st.integers(1, 400),
)
def test_pack_by_tokens_covers_every_row_once_within_the_budget(lengths, prompt_len, budget):
    resp = torch.tensor(lengths)
    rows = torch.randperm(len(lengths))
    mbs = pack_by_tokens(rows, resp, prompt_len, budget)
    assert sorted(torch.cat(mbs).tolist()) == sorted(rows.tolist())
    for mb in mbs:
        cost = len(mb) * (prompt_len + int(resp[mb].max()))
        assert cost <= budget or len(mb) == 1  # a row over the budget goes alone


@settings(max_examples=100, deadline=None)
@given(lengths=st.lists(st.integers(1, 20), min_size=1, max_size=25), world=st.integers(1, 4))
def test_ranks_get_the_same_number_of_micro_batches(lengths, world):
    b = pack([[1, 2]] * len(lengths), [[5] * n for n in lengths], 0)
    spec = UpdateSpec(max_tokens_per_micro_batch=30)
    rows_m = torch.arange(len(lengths))
    plans = [micro_batches(b, rows_m, spec, rank=r, world_size=world) for r in range(world)]
    assert len({len(p) for p in plans}) == 1
    got = sorted(torch.cat([torch.cat(p) for p in plans]).tolist())
    assert got == rows_m.tolist()


@pytest.fixture(scope="module")
def batch():
    """16 responses with a long-tailed length mix (1 to 30 tokens) after 3 prompts."""
    g = torch.Generator().manual_seed(0)
    lengths = [1, 1, 2, 2, 3, 3, 3, 4, 4, 5, 6, 8, 12, 18, 25, 30]
    prompts = [
        [4 + int(torch.randint(0, 20, (1,), generator=g)) for _ in range(3 + i % 3)] for i in range(16)
    ]
    responses = [[4 + int(torch.randint(0, 20, (1,), generator=g)) for _ in range(n)] for n in lengths]
    b = pack(prompts, responses, 0)
    b.old_logprobs = -torch.rand(b.response_mask.shape, generator=g) * b.response_mask
    adv = torch.randn(16, generator=g)[:, None] * b.response_mask
    return b, adv


@pytest.mark.parametrize("aggregation", sorted(AGGREGATIONS.names()))
def test_token_budget_gives_the_gradient_of_fixed_micro_batches(batch, aggregation):
    b, adv = batch
    model = tiny_qwen2(char_tokenizer(), seed=0)
    weights = []
    for spec in (
        UpdateSpec(aggregation=aggregation, micro_batch_size=4),
        UpdateSpec(aggregation=aggregation, max_tokens_per_micro_batch=64),
    ):
        eng = TorchTrainEngine(copy.deepcopy(model), optimizer_factory=lambda p: torch.optim.SGD(p, lr=1.0))
        stats = ppo_update(eng, StepBatch.from_packed(b, advantages=adv), spec).metrics()
        assert 0 <= stats["train/padding_frac"] < 1
        weights.append(dict(eng.export_weights()))
    moved = max(float((weights[0][k] - v.detach()).abs().max()) for k, v in model.named_parameters())
    assert moved > 1e-4  # the step did something
    diff = max(float((weights[0][k] - weights[1][k]).abs().max()) for k in weights[0])
    assert diff < 1e-5, diff  # float32 rounding of a differently ordered sum (SGD, lr 1)
