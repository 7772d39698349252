"""Padding-free micro-batches in the training engines (``train.packing``, trainers.engines.packed).

The packed path must be the padded path in another layout: log-probs, entropy (with the
top-k / top-p replay and the lean head), gradients and critic values equal to the padded
path's in float32, on the torch, DeepSpeed and FSDP2 engines; an update with packing gives the
padded update's weights; the packed attention leaves ordinary calls (generation) as they were.
"""

import copy
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers")

import torch
from _ragged import ragged_batch

from trainers.config import load_config
from trainers.critic import build_critic
from trainers.engines import TorchTrainEngine, pack
from trainers.engines.packed import PACKED_ATTENTION, enable_packing, packed_attention_forward
from trainers.engines.step import StepBatch
from trainers.learner import UpdateSpec, micro_batches, ppo_update
from trainers.models import char_tokenizer, tiny_qwen2

ATOL = 2e-6  # float32 rounding of a different reduction order (measured <= 8e-7)


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


def pair(tok, share=True, **kw):
    """A padded engine (no prompt sharing) and a packed one (``share``: rows that repeat a prompt
    share it in the packed row, the prefix-shared layout) on the same weights."""
    m = tiny_qwen2(tok, seed=0)
    padded = TorchTrainEngine(copy.deepcopy(m), share_prompts=False, **kw)
    packed = TorchTrainEngine(copy.deepcopy(m), packing=True, share_prompts=share, **kw)
    return padded, packed


def grad_gap(a, b):
    """The largest gradient difference relative to the largest gradient entry."""
    pairs = list(zip(a.model.parameters(), b.model.parameters(), strict=True))
    scale = max(p.grad.abs().max().item() for p, _ in pairs)
    return max((p.grad - q.grad).abs().max().item() for p, q in pairs) / scale


@pytest.mark.parametrize(
    "sampling",
    [{}, {"temperature": 0.7}, {"top_k": 5}, {"temperature": 0.8, "top_p": 0.7}],
    ids=["plain", "tempered", "top_k", "top_p"],
)
@pytest.mark.parametrize("chunk", [0, 4], ids=["logits", "lean"])
@pytest.mark.parametrize("share", [True, False], ids=["shared-prompts", "per-sample"])
def test_packed_logprobs_entropy_and_gradients_equal_the_padded_path(tok, sampling, chunk, share):
    """Rows 5 and 6 of the batch repeat a prompt: with ``share`` it appears once in the packed row."""
    padded, packed = pair(tok, share=share, logprob_chunk_tokens=chunk)
    ids, am, rm = ragged_batch()
    out = {}
    for name, eng in (("padded", padded), ("packed", packed)):
        lp, ent = eng.logprobs(ids, am, rm, with_entropy=True, **sampling)
        (lp * torch.linspace(0.5, 1.5, lp.numel()).view_as(lp)).sum().add(ent.sum()).backward()
        out[name] = (lp.detach(), ent.detach())
    assert (out["packed"][0][~rm] == 0).all() and (out["packed"][1][~rm] == 0).all()
    assert torch.allclose(out["padded"][0], out["packed"][0], atol=ATOL)
    assert torch.allclose(out["padded"][1], out["packed"][1], atol=ATOL)
    assert grad_gap(padded, packed) < 2e-6  # relative; measured <= 2.4e-7 (AMD EPYC, float32)
    # and the values are log-probs, not zeros: the check above cannot pass on an empty forward
    assert out["packed"][0][rm].lt(-0.1).all()


def test_packed_path_agrees_with_prompt_sharing_and_with_trailing_columns_cut(tok):
    """The default padded path (shared prompts) and a micro-batch of short rows in a wide batch
    (the unused response columns are cut before the forward) agree with the packed one."""
    m = tiny_qwen2(tok, seed=0)
    shared = TorchTrainEngine(copy.deepcopy(m))
    packed = TorchTrainEngine(copy.deepcopy(m), packing=True)
    ids, am, rm = ragged_batch()
    rows = torch.tensor([1, 3, 6])  # responses 2, 0 and 1 tokens in a 9-column batch
    for sel in (slice(None), rows):
        a = shared.logprobs(ids[sel], am[sel], rm[sel])
        b = packed.logprobs(ids[sel], am[sel], rm[sel])
        assert torch.allclose(a, b, atol=ATOL)


def test_packed_path_under_gradient_checkpointing(tok):
    """The recomputed layers get the packed call's varlen arguments again: same gradients."""
    padded, packed = pair(tok, gradient_checkpointing=True)
    ids, am, rm = ragged_batch()
    for eng in (padded, packed):
        lp, ent = eng.logprobs(ids, am, rm, with_entropy=True)
        (lp.sum() + ent.sum()).backward()
    assert grad_gap(padded, packed) < 2e-6


def test_shared_prompts_appear_once_in_the_packed_row():
    """The prefix-shared layout: a group's prompt once, then each row's response; positions as
    the padded path's; the prompt's last token predicts every row's first response token."""
    from trainers.engines.packed import PackedCall

    m = tiny_qwen2(char_tokenizer(), seed=0)
    enable_packing(m)
    b = pack([[5, 6, 7], [5, 6, 7], [8, 9]], [[10, 11], [12, 13, 14], [15]], 0)
    call = PackedCall(m, b.input_ids, b.attention_mask, b.response_mask, share=True)
    assert call.shared
    assert call.kwargs["input_ids"].tolist() == [[5, 6, 7, 10, 11, 12, 13, 14, 8, 9, 15]]
    assert call.kwargs["position_ids"].tolist() == [[0, 1, 2, 3, 4, 3, 4, 5, 0, 1, 2]]
    assert call.kwargs["rollkit_prefix_groups"] == [(0, 3, [(3, 5), (5, 8)]), (8, 10, [(10, 11)])]
    assert call.keep.tolist() == [2, 3, 2, 5, 6, 9] and call.targets.tolist() == [[10, 11, 12, 13, 14, 15]]
    assert not PackedCall(m, b.input_ids[1:], b.attention_mask[1:], b.response_mask[1:], share=True).shared


def test_a_micro_batch_without_response_tokens_still_backpropagates(tok):
    """The masked row that keeps data-parallel collectives aligned: zero log-probs, a zero
    (finite) gradient, no error."""
    _, packed = pair(tok)
    ids, am, rm = ragged_batch()
    lp = packed.logprobs(ids[:1], am[:1], torch.zeros_like(rm[:1]))
    assert lp.abs().sum() == 0
    lp.sum().backward()
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in packed.model.parameters())


def test_ordinary_calls_on_a_packing_model_are_unchanged(tok):
    """enable_packing switches sdpa to rollkit_packed, which runs transformers' sdpa (with its
    mask) for every call without cu_seq_lens: a padded forward and greedy generation equal the
    untouched model's."""
    m = tiny_qwen2(tok, seed=0).eval()
    p = copy.deepcopy(m)
    assert enable_packing(p) == PACKED_ATTENTION and enable_packing(p) == PACKED_ATTENTION  # idempotent
    assert p.config._attn_implementation == PACKED_ATTENTION
    ids, am, _ = ragged_batch()
    with torch.no_grad():
        a = m(input_ids=ids, attention_mask=am).logits
        b = p(input_ids=ids, attention_mask=am).logits
    assert torch.allclose(a[am.bool()], b[am.bool()], atol=1e-6)
    prompt = torch.tensor([tok("12+3=").input_ids])
    ga = m.generate(prompt, max_new_tokens=6, do_sample=False)
    gb = p.generate(prompt, max_new_tokens=6, do_sample=False)
    assert torch.equal(ga, gb)


def test_varlen_attention_equals_the_dense_block_diagonal_mask():
    """The CPU varlen loop against SDPA with rollkit.packing.varlen_attention_mask, with grouped
    query heads and an empty sample."""
    from rollkit.packing import varlen_attention_mask

    g = torch.Generator().manual_seed(0)
    cu = torch.tensor([0, 3, 3, 8, 12], dtype=torch.int32)
    q = torch.randn(1, 4, 12, 8, generator=g, requires_grad=True)
    k = torch.randn(1, 2, 12, 8, generator=g, requires_grad=True)
    v = torch.randn(1, 2, 12, 8, generator=g, requires_grad=True)
    out, _ = packed_attention_forward(None, q, k, v, None, scaling=0.3, cu_seq_lens_q=cu, max_length_q=5)
    mask = varlen_attention_mask(cu)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=0.3, enable_gqa=True
    )
    assert out.shape == (1, 12, 4, 8)
    assert torch.allclose(out, ref.transpose(1, 2), atol=1e-6)
    with pytest.raises(ValueError, match="sliding-window"):
        packed_attention_forward(None, q, k, v, None, cu_seq_lens_q=cu, sliding_window=4)


def test_enable_packing_refuses_attention_it_cannot_pack(tok):
    m = tiny_qwen2(tok, seed=0)
    m.config._attn_implementation = "flex_attention"
    with pytest.raises(ValueError, match=r"train\.packing: .*flex_attention"):
        enable_packing(m)


@pytest.mark.parametrize("engine", ["torch", "fsdp2"])
def test_packed_critic_values_and_their_gradients_equal_the_padded_critic(tok, engine):
    """The critic's decoder + head (torch) and the whole-model forward (FSDP2's root) on the
    packed row give the padded critic's values, and after one update its values."""
    if engine == "fsdp2":
        pytest.importorskip("trainers.engines.fsdp2_train")
    b = pack([[5, 6, 7], [5, 6, 7], [8, 9], [8, 9], [4]], [[10, 11], [12, 13, 14], [15], [16, 17, 18], []], 0)
    out = {}
    for packing in ("false", "true"):
        cfg = load_config(
            [
                "--model",
                "tiny",
                "algorithm.advantage=gae",
                f"train.packing={packing}",
                f"critic.engine={engine}",
            ]
        )
        critic = build_critic(cfg, policy=tiny_qwen2(tok, seed=0))
        with torch.no_grad():  # a value head that is not zero: values to compare
            head = critic.engines[0].model.score.weight
            if hasattr(head, "full_tensor"):  # FSDP2: a DTensor shard
                head = head.to_local()
            head.normal_(generator=torch.Generator().manual_seed(1))
        v = critic.values(b)
        ret = torch.linspace(-1, 1, b.response_mask.numel()).view(b.response_mask.shape) * b.response_mask
        critic.update(b, v, ret, None, seed=0)
        out[packing] = (v, critic.values(b))
    assert out["true"][0].abs().sum() > 0
    assert torch.allclose(out["false"][0], out["true"][0], atol=ATOL)
    assert torch.allclose(out["false"][1], out["true"][1], atol=1e-5)  # after one Adam step


def test_packed_token_budget_bins_count_real_tokens():
    b = pack([[5, 6, 7], [5], [8, 9], [8, 9, 3, 4, 5, 6]], [[10, 11], [12, 13, 14, 4, 4, 4], [15], []], 0)
    spec = UpdateSpec(max_tokens_per_micro_batch=8, packing=True)
    mbs = micro_batches(b, torch.arange(4), spec)
    real = b.attention_mask.sum(-1)
    assert sorted(torch.cat(mbs).tolist()) == [0, 1, 2, 3]
    assert all(int(real[m].sum()) <= 8 or len(m) == 1 for m in mbs)
    assert len(mbs) == 3  # lengths 5, 7, 3, 6 in 8-token rows: FFD needs 3 (padded: 4)


def test_an_update_with_packing_gives_the_padded_update(tok):
    """ppo_update over micro-batches packed by a token budget vs rows of 2 padded: same weights
    after two optimizer steps (SGD: the gradients themselves, float32 rounding)."""
    ids, am, rm = ragged_batch()
    from trainers.engines.base import PackedBatch

    b = PackedBatch(ids, am, rm, old_logprobs=torch.zeros(rm.shape), prompt_len=ids.shape[1] - rm.shape[1])
    adv = torch.linspace(-1, 1, rm.numel()).view_as(rm.float()) * rm
    weights = {}
    for packing in (False, True):
        m = tiny_qwen2(tok, seed=0)
        sgd = lambda params: torch.optim.SGD(params, lr=0.5)  # noqa: E731
        eng = TorchTrainEngine(m, packing=packing, share_prompts=False, optimizer_factory=sgd, grad_clip=None)
        with torch.no_grad():
            b.old_logprobs = TorchTrainEngine(copy.deepcopy(tiny_qwen2(tok, seed=0))).logprobs(ids, am, rm)
        spec = UpdateSpec(micro_batch_size=2, mini_batch_size=4, max_tokens_per_micro_batch=20 if packing else 0,
                          packing=packing, entropy_coef=0.01)  # fmt: skip
        stats = ppo_update(eng, StepBatch.from_packed(b, advantages=adv), spec, seed=0)
        weights[packing] = torch.cat([p.detach().reshape(-1) for p in m.parameters()])
        if packing:
            assert stats.metrics()["train/padding_frac"] == 0.0
    moved = (
        (weights[False] - torch.cat([p.reshape(-1) for p in tiny_qwen2(tok, seed=0).parameters()]))
        .abs()
        .max()
    )
    assert moved > 1e-3
    assert torch.allclose(weights[False], weights[True], atol=1e-5)


@pytest.mark.parametrize(("engine", "stage"), [("deepspeed", 2), ("deepspeed", 3), ("fsdp2", 0)])
def test_sharded_engines_pack_like_the_torch_engine(tok, engine, stage):
    """DeepSpeed (ZeRO-2, and ZeRO-3 whose layers gather inside the packed forward) and FSDP2
    (the root forward) give the padded torch engine's log-probs and, after one step, weights."""
    pytest.importorskip(f"trainers.engines.{engine}_train")
    if engine == "deepspeed":
        pytest.importorskip("deepspeed")
        from trainers.engines.deepspeed_train import DeepSpeedTrainEngine as Engine

        kw = {"zero_stage": stage}
    else:
        from trainers.engines.fsdp2_train import FSDP2TrainEngine as Engine

        kw = {}
    ids, am, rm = ragged_batch()
    ref = TorchTrainEngine(tiny_qwen2(tok, seed=0), share_prompts=False, lr=1e-2)
    eng = Engine(tiny_qwen2(tok, seed=0), packing=True, lr=1e-2, **kw)
    for e in (ref, eng):
        lp, ent = e.logprobs(ids, am, rm, with_entropy=True)
        e.backward(lp.sum() + 0.1 * ent.sum())
        e.step()
    with torch.no_grad():
        a, b = ref.logprobs(ids, am, rm), eng.logprobs(ids, am, rm)
    assert a[rm].lt(-0.1).all()
    assert torch.allclose(a, b, atol=1e-4)  # one Adam step (the engines' test tolerance is 1e-5 per weight)
