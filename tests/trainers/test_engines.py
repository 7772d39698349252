"""Rollout (transformers) and training (plain PyTorch) engines on a tiny Qwen2.

The key property: the rollout engine's per-token log-probs equal the training engine's
recomputed log-probs on the same weights and tokens, before and after a weight update.
"""

import copy
import os
import socket

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers")

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rollkit.losses import aggregate, global_normalizers, ppo_clip
from trainers.engines import (
    HFRolloutEngine,
    RolloutEngine,
    SamplingParams,
    TorchTrainEngine,
    TrainEngine,
    pack,
    pack_generations,
    process_logits,
)
from trainers.models import char_tokenizer, tiny_qwen2

ATOL = 1e-5
TEXTS = ["What is 12+34? Answer: ", "7+5=", "Compute 3*9. "]


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


@pytest.fixture
def model(tok):
    return tiny_qwen2(tok, seed=0)


@pytest.fixture
def prompts(tok):
    return [tok(t).input_ids for t in TEXTS]  # different lengths: left padding matters


def engines(model, tok, **kw):
    rollout = HFRolloutEngine(copy.deepcopy(model), tok)
    train = TorchTrainEngine(model, lr=kw.pop("lr", 1e-2), **kw)
    return rollout, train


def max_err(train, batch, temperature):
    with torch.no_grad():
        lp = train.logprobs(
            batch.input_ids, batch.attention_mask, batch.response_mask, temperature=temperature
        )
    return float((lp - batch.old_logprobs).abs()[batch.response_mask].max())


def fake_advantages(gens, n):
    """Fraction of digits in each response, minus its prompt group's mean (GRPO-style)."""
    digits = set(char_tokenizer().convert_tokens_to_ids(list("0123456789")))
    r = torch.tensor([sum(t in digits for t in g.token_ids) / len(g.token_ids) for g in gens])
    r = r.view(-1, n)
    return (r - r.mean(-1, keepdim=True)).view(-1)


# --------------------------------------------------------------------------- layout


def test_pack_layout():
    b = pack([[5, 6, 7], [8]], [[9], [10, 11, 12]], pad_token_id=0)
    assert b.prompt_len == 3
    assert b.input_ids.tolist() == [[5, 6, 7, 9, 0, 0], [0, 0, 8, 10, 11, 12]]
    assert b.attention_mask.tolist() == [[1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1]]
    assert b.response_mask.tolist() == [[True, False, False], [True, True, True]]
    assert b.responses.tolist() == [[9, 0, 0], [10, 11, 12]]
    assert pack([[1]], [[2]], 0, response_width=4).response_mask.shape == (1, 4)
    with pytest.raises(ValueError):
        pack([[]], [[1]], 0)
    mb = b[1:]
    assert mb.input_ids.tolist() == [[0, 0, 8, 10, 11, 12]] and mb.prompt_len == 3


def test_protocols(model, tok):
    rollout, train = engines(model, tok)
    assert isinstance(rollout, RolloutEngine) and isinstance(train, TrainEngine)


# --------------------------------------------------------------------------- rollout


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_rollout_logprobs_equal_trainer_logprobs(model, tok, prompts, temperature):
    rollout, train = engines(model, tok)
    n = 3
    gens = rollout.generate(prompts, SamplingParams(n=n, temperature=temperature, max_tokens=16, seed=7))
    assert len(gens) == n * len(prompts)
    assert [g.prompt_index for g in gens] == [i // n for i in range(len(gens))]
    assert all(g.prompt_ids == prompts[g.prompt_index] for g in gens)
    assert all(len(g.logprobs) == len(g.token_ids) >= 1 for g in gens)
    assert all(lp <= 0 for g in gens for lp in g.logprobs)
    batch = pack_generations(gens, tok.pad_token_id)
    assert max_err(train, batch, temperature) < ATOL
    # A single prompt alone (no padding) gives the same tokens' log-probs as in the batch.
    solo = pack_generations(gens[-1:], tok.pad_token_id)
    assert max_err(train, solo, temperature) < ATOL


def test_top_k_top_p_logprobs_are_processed(model, tok, prompts):
    rollout, train = engines(model, tok)
    params = SamplingParams(n=2, temperature=0.8, top_k=8, top_p=0.9, max_tokens=10, seed=3, ignore_eos=True)
    gens = rollout.generate(prompts, params)
    b = pack_generations(gens, tok.pad_token_id)
    with torch.no_grad():
        T = b.response_mask.shape[1]
        out = train.model(
            input_ids=b.input_ids,
            attention_mask=b.attention_mask,
            position_ids=(b.attention_mask.cumsum(-1) - 1).clamp(min=0),
        )
        logits = out.logits[:, -T - 1 : -1]
        full = train.logprobs(b.input_ids, b.attention_mask, b.response_mask, temperature=0.8)
    processed = process_logits(logits.reshape(-1, logits.shape[-1]), 0.8, 8, 0.9).view(*logits.shape)
    expect = processed.gather(-1, b.responses[..., None]).squeeze(-1)
    m = b.response_mask
    assert torch.isfinite(expect[m]).all()  # every sampled token was inside top-k / top-p
    assert (expect - b.old_logprobs).abs()[m].max() < ATOL
    assert (b.old_logprobs[m] >= full[m] - ATOL).all()  # renormalised over fewer tokens
    ranks = (logits > logits.gather(-1, b.responses[..., None])).sum(-1)
    assert (ranks[m] < 8).all()


def test_process_logits_top_p_keeps_at_least_one():
    x = torch.tensor([[5.0, 1.0, 0.0, -1.0]])
    lp = process_logits(x, 1.0, top_p=0.01)
    assert torch.isfinite(lp).sum() == 1 and lp[0, 0] == 0
    lp = process_logits(x, 1.0, top_k=2)
    assert torch.isfinite(lp).sum() == 2 and torch.isclose(lp.exp().sum(), torch.tensor(1.0))


def test_stop_tokens_and_length(model, tok, prompts):
    rollout, _ = engines(model, tok)
    # Every token stops: one-token samples, finish_reason "stop".
    gens = rollout.generate(
        prompts, SamplingParams(n=2, max_tokens=8, stop_token_ids=range(len(tok)), seed=0)
    )
    assert all(g.finish_reason == "stop" and len(g.token_ids) == 1 for g in gens)
    # No stop at all: exactly max_tokens, finish_reason "length".
    gens = rollout.generate(prompts, SamplingParams(n=2, max_tokens=5, ignore_eos=True, seed=0))
    assert all(g.finish_reason == "length" and len(g.token_ids) == 5 for g in gens)
    # Half the vocabulary stops: a "stop" sample ends with its first stop token.
    stop = set(range(0, len(tok), 2)) - {tok.eos_token_id}
    gens = rollout.generate(
        prompts, SamplingParams(n=4, max_tokens=6, stop_token_ids=stop, ignore_eos=True, seed=1)
    )
    reasons = {g.finish_reason for g in gens}
    assert reasons == {"stop", "length"} or reasons == {"stop"}
    for g in gens:
        hits = [i for i, t in enumerate(g.token_ids) if t in stop]
        if g.finish_reason == "stop":
            assert hits == [len(g.token_ids) - 1]
        else:
            assert hits == [] and len(g.token_ids) == 6


def test_eos_stops_unless_ignored(model, tok, prompts):
    rollout, _ = engines(model, tok)
    eos = tok.eos_token_id
    gens = rollout.generate(prompts, SamplingParams(n=4, max_tokens=30, seed=0))
    stopped = [g for g in gens if g.finish_reason == "stop"]
    assert stopped  # a random 100-token model emits <eos> about once per 100 tokens
    for g in gens:
        assert (eos in g.token_ids) == (g.finish_reason == "stop")
        assert eos not in g.token_ids[:-1]
    gens = rollout.generate(prompts, SamplingParams(n=4, max_tokens=30, seed=0, ignore_eos=True))
    assert all(g.finish_reason == "length" and len(g.token_ids) == 30 for g in gens)
    assert any(eos in g.token_ids[:-1] for g in gens)  # <eos> sampled and generation went on


def test_seed_reproducible(model, tok, prompts):
    rollout, _ = engines(model, tok)
    p = SamplingParams(n=2, max_tokens=12, seed=123)
    a, b = rollout.generate(prompts, p), rollout.generate(prompts, p)
    assert [g.token_ids for g in a] == [g.token_ids for g in b]
    assert [g.logprobs for g in a] == [g.logprobs for g in b]
    c = rollout.generate(prompts, SamplingParams(n=2, max_tokens=12, seed=124))
    assert [g.token_ids for g in a] != [g.token_ids for g in c]
    # Micro-batched generation is deterministic too.
    small = HFRolloutEngine(rollout.model, tok, max_batch_size=2)
    assert [g.token_ids for g in small.generate(prompts, p)] == [
        g.token_ids for g in small.generate(prompts, p)
    ]


def test_greedy_is_argmax(model, tok, prompts, tmp_path):
    rollout, train = engines(model, tok)
    gens = rollout.generate(prompts, SamplingParams(n=2, temperature=0, max_tokens=6, ignore_eos=True))
    assert gens[0].token_ids == gens[1].token_ids
    b = pack_generations(gens, tok.pad_token_id)
    assert max_err(train, b, 1.0) < ATOL
    # The engine also loads from a directory (save_pretrained) and gives the same samples.
    from trainers.models import save_model

    path = save_model(model, tok, tmp_path / "m")
    again = HFRolloutEngine(path).generate(
        prompts, SamplingParams(n=2, temperature=0, max_tokens=6, ignore_eos=True)
    )
    assert [g.token_ids for g in again] == [g.token_ids for g in gens]


# --------------------------------------------------------------------------- training


def rl_step(rollout, train, prompts, tok, n=4, temperature=1.0, seed=0):
    gens = rollout.generate(prompts, SamplingParams(n=n, temperature=temperature, max_tokens=12, seed=seed))
    b = pack_generations(gens, tok.pad_token_id)
    adv = fake_advantages(gens, n)
    assert adv.abs().sum() > 0
    lp = train.logprobs(b.input_ids, b.attention_mask, b.response_mask, temperature=temperature)
    out = ppo_clip(lp, b.old_logprobs, adv, b.response_mask)
    train.backward(aggregate(out.loss, b.response_mask, "token-mean"))
    return train.step()


def test_train_step_then_weight_sync(model, tok, prompts):
    rollout, train = engines(model, tok)
    before = {k: v.clone() for k, v in train.model.state_dict().items()}
    metrics = rl_step(rollout, train, prompts, tok, temperature=0.7)
    assert metrics["grad_norm"] > 0 and metrics["skipped"] == 0
    after = train.model.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    # The rollout engine still has the old weights: its log-probs now differ from the trainer's.
    assert rollout.policy_version == 0
    gens = rollout.generate(prompts, SamplingParams(n=2, temperature=0.7, max_tokens=10, seed=5))
    assert max_err(train, pack_generations(gens, tok.pad_token_id), 0.7) > 1e-4
    rollout.update_weights(train.export_weights(), version=1)
    assert rollout.policy_version == 1
    gens = rollout.generate(prompts, SamplingParams(n=2, temperature=0.7, max_tokens=10, seed=5))
    assert all(g.policy_version == 1 for g in gens)
    assert max_err(train, pack_generations(gens, tok.pad_token_id), 0.7) < ATOL


def test_update_weights_is_strict_and_atomic(model, tok):
    rollout, train = engines(model, tok)
    ref = {k: v.clone() for k, v in rollout.model.state_dict().items()}
    named = [(k, v + 1) for k, v in train.export_weights()]
    with pytest.raises(KeyError, match="unknown"):
        rollout.update_weights([*named, ("nope.weight", torch.zeros(1))], 1)
    bad = list(named)
    bad[0] = (bad[0][0], torch.zeros(3))
    with pytest.raises(ValueError, match="shape"):
        rollout.update_weights(bad, 1)
    with pytest.raises(KeyError, match="missing"):
        rollout.update_weights(named[1:], 1)
    assert all(torch.equal(ref[k], v) for k, v in rollout.model.state_dict().items())  # nothing copied
    assert rollout.policy_version == 0
    rollout.update_weights(named, 3)  # lm_head.weight is tied: covered by the embedding
    assert rollout.policy_version == 3
    assert torch.equal(rollout.model.lm_head.weight, ref["lm_head.weight"] + 1)


def test_sleep_wake(model, tok, prompts):
    rollout, train = engines(model, tok)
    p = SamplingParams(n=2, max_tokens=8, seed=9)
    ref = [g.token_ids for g in rollout.generate(prompts, p)]
    rollout.sleep(1)
    with pytest.raises(RuntimeError, match="asleep"):
        rollout.generate(prompts, p)
    rollout.wake()
    assert [g.token_ids for g in rollout.generate(prompts, p)] == ref
    rollout.sleep(2)
    assert rollout.model.model.embed_tokens.weight.is_meta
    rollout.wake()
    assert rollout.model.lm_head.weight is rollout.model.model.embed_tokens.weight  # still tied
    with pytest.raises(RuntimeError, match="update_weights"):
        rollout.generate(prompts, p)
    rollout.update_weights(train.export_weights(), 1)
    assert [g.token_ids for g in rollout.generate(prompts, p)] == ref


def test_entropy(model, tok, prompts):
    rollout, train = engines(model, tok)
    b = pack_generations(
        rollout.generate(prompts, SamplingParams(n=2, max_tokens=6, seed=0)), tok.pad_token_id
    )
    lp, ent = train.logprobs(
        b.input_ids, b.attention_mask, b.response_mask, temperature=0.5, with_entropy=True
    )
    m = b.response_mask
    assert (
        ent.shape == lp.shape
        and (ent[m] > 0).all()
        and (ent[m] <= torch.log(torch.tensor(len(tok))) + 1e-5).all()
    )
    assert (ent[~m] == 0).all() and ent.requires_grad


def grads_of(train):
    return {n: p.grad.clone() for n, p in train.model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_gradient_accumulation_equals_full_batch(model, tok, prompts, mode):
    rollout, train = engines(model, tok)
    n = 4
    gens = rollout.generate(prompts, SamplingParams(n=n, max_tokens=12, seed=2))
    b = pack_generations(gens, tok.pad_token_id)
    adv = fake_advantages(gens, n)

    def loss(mb, a, **norms):
        lp = train.logprobs(mb.input_ids, mb.attention_mask, mb.response_mask)
        out = ppo_clip(lp, mb.old_logprobs, a, mb.response_mask)
        return aggregate(out.loss, mb.response_mask, mode, **norms)

    train.backward(loss(b, adv))
    full = grads_of(train)
    train.zero_grad()
    norms = global_normalizers(b.response_mask)
    B = len(gens)
    for rows in (slice(0, 5), slice(5, B)):  # unequal micro-batches
        train.backward(loss(b[rows], adv[rows], **norms))
    acc = grads_of(train)
    assert full.keys() == acc.keys() and len(full) > 0
    for k in full:
        torch.testing.assert_close(acc[k], full[k], rtol=1e-5, atol=1e-7)


def test_checkpoint_round_trip(model, tok, prompts):
    rollout, train = engines(
        model, tok, scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    )
    rl_step(rollout, train, prompts, tok, seed=0)
    state = copy.deepcopy(train.state_dict())
    assert state["global_step"] == 1 and state["optimizer"]["state"]
    m2 = rl_step(rollout, train, prompts, tok, seed=1)
    expected = {k: v.clone() for k, v in train.model.state_dict().items()}

    other = TorchTrainEngine(
        tiny_qwen2(tok, seed=99),
        lr=1e-2,
        scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s)),
    )
    other.load_state_dict(state)
    m2b = rl_step(rollout, other, prompts, tok, seed=1)
    assert m2b["lr"] == m2["lr"] and m2b["grad_norm"] == pytest.approx(m2["grad_norm"], rel=1e-6)
    for k, v in other.model.state_dict().items():
        assert torch.equal(v, expected[k]), k


def test_grad_clip_and_nonfinite_skip(model, tok, prompts):
    rollout, train = engines(model, tok, grad_clip=1e-3)
    b = pack_generations(
        rollout.generate(prompts, SamplingParams(n=1, max_tokens=4, seed=0)), tok.pad_token_id
    )
    lp = train.logprobs(b.input_ids, b.attention_mask, b.response_mask)
    train.backward(-aggregate(lp, b.response_mask))
    m = train.step()
    assert m["grad_norm"] > 1e-3 and m["skipped"] == 0
    before = {k: v.clone() for k, v in train.model.state_dict().items()}
    lp = train.logprobs(b.input_ids, b.attention_mask, b.response_mask)
    train.backward(aggregate(lp, b.response_mask) * float("nan"))
    assert train.step()["skipped"] == 1
    assert all(torch.equal(before[k], v) for k, v in train.model.state_dict().items())


def test_gradient_checkpointing_same_gradient(tok, prompts):
    gens = HFRolloutEngine(tiny_qwen2(tok), tok).generate(prompts, SamplingParams(n=2, max_tokens=6, seed=0))
    b = pack_generations(gens, tok.pad_token_id)
    out = []
    for ckpt in (False, True):
        train = TorchTrainEngine(tiny_qwen2(tok), gradient_checkpointing=ckpt)
        lp = train.logprobs(b.input_ids, b.attention_mask, b.response_mask)
        train.backward(-aggregate(lp, b.response_mask))
        out.append(grads_of(train))
    for k in out[0]:
        torch.testing.assert_close(out[0][k], out[1][k], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_shared_prompt_forward_equals_full_forward(tok, prompts, temperature):
    """n samples per prompt: the prompt runs once, the logits and gradients do not change."""
    gens = HFRolloutEngine(tiny_qwen2(tok), tok).generate(
        prompts, SamplingParams(n=4, max_tokens=7, seed=3, temperature=temperature)
    )
    b = pack_generations(gens, tok.pad_token_id)
    assert len({tuple(r) for r in b.input_ids[:, : b.prompt_len].tolist()}) == len(prompts) < len(gens)
    res = []
    for share in (False, True):
        train = TorchTrainEngine(tiny_qwen2(tok), share_prompts=share)
        lp, ent = train.logprobs(
            b.input_ids, b.attention_mask, b.response_mask, temperature=temperature, with_entropy=True
        )
        train.backward(-aggregate(lp + 0.1 * ent, b.response_mask))
        res.append((lp.detach(), ent.detach(), grads_of(train)))
    torch.testing.assert_close(res[0][0], res[1][0], rtol=0, atol=1e-5)
    torch.testing.assert_close(res[0][1], res[1][1], rtol=0, atol=1e-5)
    assert float((res[0][0] - b.old_logprobs).abs()[b.response_mask].max()) < ATOL
    for k in res[0][2]:
        torch.testing.assert_close(res[0][2][k], res[1][2][k], rtol=1e-4, atol=1e-6)
    # Distinct prompts only (nothing to share) and a one-token response take the same path as before.
    single = TorchTrainEngine(tiny_qwen2(tok))
    one = pack_generations(gens[::4], tok.pad_token_id)
    with torch.no_grad():
        lp = single.logprobs(one.input_ids, one.attention_mask, one.response_mask, temperature=temperature)
    torch.testing.assert_close(lp, res[0][0][::4][:, : lp.shape[1]], rtol=0, atol=1e-5)
    short = pack([p for p in prompts for _ in range(2)], [[5]] * 6, tok.pad_token_id)
    with torch.no_grad():
        a = single.logprobs(short.input_ids, short.attention_mask, short.response_mask)
        single.share_prompts = False
        c = single.logprobs(short.input_ids, short.attention_mask, short.response_mask)
    torch.testing.assert_close(a, c, rtol=0, atol=1e-5)


def test_autocast_bf16_keeps_fp32_master_weights(tok, prompts):
    gens = HFRolloutEngine(tiny_qwen2(tok), tok).generate(prompts, SamplingParams(n=2, max_tokens=6, seed=0))
    b = pack_generations(gens, tok.pad_token_id)
    full = TorchTrainEngine(tiny_qwen2(tok))
    mixed = TorchTrainEngine(tiny_qwen2(tok), autocast=torch.bfloat16)
    with torch.no_grad():
        lp32 = full.logprobs(b.input_ids, b.attention_mask, b.response_mask)
    lp16 = mixed.logprobs(b.input_ids, b.attention_mask, b.response_mask)
    assert lp16.dtype == torch.float32
    # bfloat16 matmuls: close to the float32 log-probs, but not equal (it is a different computation).
    err = float((lp16.detach() - lp32).abs()[b.response_mask].max())
    assert 0 < err < 0.1, err
    mixed.backward(-aggregate(lp16, b.response_mask))
    assert all(p.dtype == torch.float32 for p in mixed.model.parameters())
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in mixed.model.parameters())
    before = {k: v.clone() for k, v in mixed.model.state_dict().items()}
    assert mixed.step()["skipped"] == 0
    assert any(not torch.equal(before[k], v) for k, v in mixed.model.state_dict().items())
    with pytest.raises(ValueError, match="autocast"):
        TorchTrainEngine(tiny_qwen2(tok), autocast=torch.int8)


# --------------------------------------------------------------------------- data parallel

WORLD = 2


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def _dp_worker(rank, port, out_dir, batch, adv):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        tok = char_tokenizer()
        # SGD so that the new weights compare the gradients (Adam would amplify rounding).
        # Rank 1's different initialisation is overwritten by rank 0's broadcast.
        train = TorchTrainEngine(tiny_qwen2(tok, seed=rank), optimizer_factory=_sgd)
        rows = slice(0, 5) if rank == 0 else slice(5, batch.input_ids.shape[0])
        local, a = batch[rows], adv[rows]
        norms = global_normalizers(local.response_mask)
        for lo in range(0, local.input_ids.shape[0], 3):  # micro-batches of 3 rows
            mb = local[lo : lo + 3]
            lp = train.logprobs(mb.input_ids, mb.attention_mask, mb.response_mask)
            out = ppo_clip(lp, mb.old_logprobs, a[lo : lo + 3], mb.response_mask)
            train.backward(aggregate(out.loss, mb.response_mask, "token-mean", **norms))
        metrics = train.step()
        torch.save(
            {"state": train.model.state_dict(), "metrics": metrics}, os.path.join(out_dir, f"r{rank}.pt")
        )
    finally:
        dist.destroy_process_group()


def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_data_parallel_two_gloo_ranks_equal_single_process(tok, prompts, tmp_path):
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    model = tiny_qwen2(tok, seed=0)
    n = 4
    gens = HFRolloutEngine(copy.deepcopy(model), tok).generate(
        prompts, SamplingParams(n=n, max_tokens=10, seed=4)
    )
    b = pack_generations(gens, tok.pad_token_id)
    adv = fake_advantages(gens, n)
    mp.spawn(_dp_worker, args=(_free_port(), str(tmp_path), b, adv), nprocs=WORLD, join=True)
    single = TorchTrainEngine(model, optimizer_factory=_sgd)
    lp = single.logprobs(b.input_ids, b.attention_mask, b.response_mask)
    single.backward(
        aggregate(ppo_clip(lp, b.old_logprobs, adv, b.response_mask).loss, b.response_mask, "token-mean")
    )
    m = single.step()
    r0, r1 = torch.load(tmp_path / "r0.pt"), torch.load(tmp_path / "r1.pt")
    assert r0["metrics"]["grad_norm"] == pytest.approx(m["grad_norm"], rel=1e-5)
    for k, v in single.model.state_dict().items():
        assert torch.equal(r0["state"][k], r1["state"][k]), k  # ranks stay in sync
        torch.testing.assert_close(r0["state"][k], v, rtol=1e-5, atol=1e-6)


def test_logprobs_skip_unused_response_columns():
    """A micro-batch padded to a longer response than its own gives the same log-probs,
    entropies and gradients as the same rows packed tightly (the padding columns are cut)."""
    from trainers.engines import TorchTrainEngine, pack
    from trainers.models import char_tokenizer, tiny_qwen2

    tok = char_tokenizer()
    model = tiny_qwen2(tok, seed=0)
    prompts, responses = [[5, 6, 7], [8, 9]], [[10, 11], [12]]
    tight, wide = pack(prompts, responses, 0), pack(prompts, responses, 0, response_width=9)
    eng = TorchTrainEngine(model)
    lp_t, ent_t = eng.logprobs(tight.input_ids, tight.attention_mask, tight.response_mask, with_entropy=True)
    lp_w, ent_w = eng.logprobs(wide.input_ids, wide.attention_mask, wide.response_mask, with_entropy=True)
    assert lp_w.shape == (2, 9) and ent_w.shape == (2, 9)
    assert torch.equal(lp_w[:, :2], lp_t) and torch.equal(ent_w[:, :2], ent_t)
    assert not lp_w[:, 2:].any() and not ent_w[:, 2:].any()
    g_t = torch.autograd.grad(lp_t.sum(), list(model.parameters()))
    lp_w = eng.logprobs(wide.input_ids, wide.attention_mask, wide.response_mask)
    g_w = torch.autograd.grad(lp_w.sum(), list(model.parameters()))
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(g_t, g_w))
