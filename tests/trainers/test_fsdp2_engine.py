"""FSDP2TrainEngine (torch ``fully_shard`` on CPU over gloo) against TorchTrainEngine on a tiny Qwen2.

The reference is the embedded engine: same initial weights, same optimizer, same micro-batches
and rollkit loss. FSDP2 runs for real: a one-process gloo group in this process, two spawned
gloo ranks (each holding half of every parameter) in the slow test.
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
import transformers
from torch.distributed.tensor import DTensor

from rollkit.losses import aggregate, global_normalizers, ppo_clip
from trainers.engines import HFRolloutEngine, SamplingParams, TorchTrainEngine, TrainEngine, pack_generations
from trainers.engines.fsdp2_train import FSDP2TrainEngine
from trainers.models import char_tokenizer, tiny_qwen2

TEXTS = ["What is 12+34? Answer: ", "7+5=", "Compute 3*9. "]
N = 4  # samples per prompt: B = 12 (prompt sharing is used: 3 distinct prompts)
SPLITS = [slice(0, 5), slice(5, 7), slice(7, 12)]  # unequal micro-batches
# One AdamW step (lr 1e-3) moves each weight by about lr. Where |g| is far above Adam's eps
# (1e-8) the update lr * m / (sqrt(v) + eps) is insensitive to float32 rounding of g (relative
# 1e-7 -> 1e-10 absolute). But a few gradients are ~1e-10 (the k_proj bias, which the softmax
# ignores): there the update lr * g / (|g| + eps) turns a rounding difference of ~1e-10 in g
# into up to ~lr * 1e-10 / 1e-8 = 1e-5 * ... ~1e-6 in the weight. A sharded engine sums the
# micro-batch gradients and the ranks' shares in another order than the reference, hence the
# same bound as the DeepSpeed test. In one process the FSDP2 engine runs the same float32 ops
# in the same order, and the measured difference is 0.
ADAM_ATOL = 5e-6
# SGD with lr 1: the weights differ by the gradients' difference; gradients are up to ~1e-1
# and weights ~1, so 2e-7 is float32 rounding of the weights themselves.
SGD_ATOL = 2e-7


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


@pytest.fixture(scope="module")
def batch(tok):
    prompts = [tok(t).input_ids for t in TEXTS]
    gens = HFRolloutEngine(tiny_qwen2(tok, seed=0), tok).generate(
        prompts, SamplingParams(n=N, max_tokens=10, seed=1)
    )
    b = pack_generations(gens, tok.pad_token_id)
    r = torch.tensor([sum(c.isdigit() for c in tok.decode(g.token_ids)) for g in gens], dtype=torch.float)
    r = r + torch.linspace(0, 1, len(gens))  # distinct rewards: non-zero advantages everywhere
    r = r.view(-1, N)
    b.extras["adv"] = (r - r.mean(-1, keepdim=True)).view(-1)
    return b


def fsdp_engine(tok, seed=0, **kw):
    return FSDP2TrainEngine(tiny_qwen2(tok, seed=seed), **kw)


def micro_backward(engine, b, splits, mode="token-mean"):
    """One accumulation round: logprobs + backward per micro-batch, global normalisers."""
    norms = global_normalizers(b.response_mask)
    adv = b.extras["adv"]
    for rows in splits:
        mb = b[rows]
        lp = engine.logprobs(mb.input_ids, mb.attention_mask, mb.response_mask)
        out = ppo_clip(lp, mb.old_logprobs, adv[rows], mb.response_mask)
        engine.backward(aggregate(out.loss, mb.response_mask, mode, **norms))


def weights(engine):
    return {k: v.detach().clone() for k, v in engine.export_weights()}


def assert_weights_close(a, b, atol):
    assert a.keys() == b.keys() and len(a) > 0
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=atol, msg=lambda m, k=k: f"{k}: {m}")


def sgd(params):  # lr 1: the update is minus the gradient, so weights compare gradients
    return torch.optim.SGD(params, lr=1.0)


def sched(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))


# --------------------------------------------------------------------------- equivalence


@pytest.mark.parametrize(("chunk", "reshard"), [(0, True), (5, True), (0, False), (5, False)])
def test_step_matches_torch_engine(tok, batch, chunk, reshard):
    """Same init, AdamW, micro-batches and loss: same log-probs, entropy, grad norm and weights
    (``chunk``: the memory-lean log-probs through the root forward; ``reshard``: the layers'
    reshard_after_forward, whose gathered weights must not go stale across the step)."""
    ref = TorchTrainEngine(tiny_qwen2(tok, seed=0), lr=1e-3, grad_clip=0.5, logprob_chunk_tokens=chunk)
    eng = fsdp_engine(tok, lr=1e-3, grad_clip=0.5, logprob_chunk_tokens=chunk, reshard_after_forward=reshard)
    assert isinstance(eng, TrainEngine) and eng.world_size == 1 and eng.rank == 0
    assert all(isinstance(p, DTensor) for p in eng.model.parameters())  # really sharded (1 rank)
    b = batch
    with torch.no_grad():
        kw = dict(temperature=0.7, with_entropy=True)
        lp0, ent0 = ref.logprobs(b.input_ids, b.attention_mask, b.response_mask, **kw)
        lp1, ent1 = eng.logprobs(b.input_ids, b.attention_mask, b.response_mask, **kw)
    torch.testing.assert_close(lp1, lp0, rtol=0, atol=1e-6)
    torch.testing.assert_close(ent1, ent0, rtol=0, atol=1e-6)
    micro_backward(ref, b, SPLITS)
    micro_backward(eng, b, SPLITS)
    m0, m1 = ref.step(), eng.step()
    assert m0["grad_norm"] > 0.5  # clipping is active
    assert m1["grad_norm"] == pytest.approx(m0["grad_norm"], rel=1e-5)
    assert m1["lr"] == m0["lr"] == 1e-3 and m1["skipped"] == m0["skipped"] == 0
    assert_weights_close(weights(eng), weights(ref), atol=ADAM_ATOL)
    before = dict(tiny_qwen2(tok, seed=0).named_parameters())
    assert all(not torch.equal(before[k], v) for k, v in weights(eng).items())  # every tensor moved
    with torch.no_grad():
        lp0 = ref.logprobs(b.input_ids, b.attention_mask, b.response_mask, top_k=20, top_p=0.9)
        lp1 = eng.logprobs(b.input_ids, b.attention_mask, b.response_mask, top_k=20, top_p=0.9)
    torch.testing.assert_close(lp1, lp0, rtol=0, atol=1e-5)


def test_accumulation_equals_full_batch(tok, batch):
    """k micro-batches with global normalisers == one full-batch backward, two steps in a row,
    and zero_grad discards what was accumulated."""
    full = fsdp_engine(tok, optimizer_factory=sgd, grad_clip=None)
    acc = fsdp_engine(tok, optimizer_factory=sgd, grad_clip=None, reshard_after_forward=False)
    micro_backward(acc, batch, [slice(0, 3)])  # discarded below
    acc.zero_grad()
    for _ in range(2):
        micro_backward(full, batch, [slice(0, 12)], mode="seq-mean-token-mean")
        micro_backward(acc, batch, SPLITS, mode="seq-mean-token-mean")
        mf, ma = full.step(), acc.step()
        assert ma["grad_norm"] == pytest.approx(mf["grad_norm"], rel=1e-5) and mf["grad_norm"] > 0
        assert_weights_close(weights(acc), weights(full), atol=SGD_ATOL)


def test_nonfinite_gradient_skips_the_step(tok, batch):
    eng = fsdp_engine(tok, lr=1e-3, scheduler=sched)
    ref = TorchTrainEngine(tiny_qwen2(tok, seed=0), lr=1e-3, scheduler=sched)
    w0 = weights(eng)
    b = batch[0:4]
    lp = eng.logprobs(b.input_ids, b.attention_mask, b.response_mask)
    eng.backward(aggregate(lp, b.response_mask) * float("nan"))
    m = eng.step()
    assert m["skipped"] == 1 and not m["grad_norm"] < float("inf")
    assert_weights_close(weights(eng), w0, atol=0)
    assert eng.global_step == 0 and eng.optimizer.param_groups[0]["lr"] == 1e-3  # scheduler not stepped
    micro_backward(eng, batch, SPLITS)  # the next step is the first real one
    micro_backward(ref, batch, SPLITS)
    assert eng.step()["lr"] == ref.step()["lr"] == 1e-3
    assert eng.optimizer.param_groups[0]["lr"] == 0.5e-3
    assert_weights_close(weights(eng), weights(ref), atol=ADAM_ATOL)


def test_bf16_mixed_precision_trains(tok, batch):
    eng = fsdp_engine(tok, lr=1e-3, mixed_precision=torch.bfloat16)
    ref = TorchTrainEngine(tiny_qwen2(tok, seed=0))
    b = batch
    with torch.no_grad():
        lp = eng.logprobs(b.input_ids, b.attention_mask, b.response_mask)
        lp_ref = ref.logprobs(b.input_ids, b.attention_mask, b.response_mask)
    assert lp.dtype == torch.float32 and 0 < (lp - lp_ref).abs().max() < 0.1  # bf16 compute
    w0 = weights(eng)
    micro_backward(eng, b, SPLITS)
    m = eng.step()
    assert m["skipped"] == 0 and 0 < m["grad_norm"] < float("inf")
    w1 = weights(eng)
    assert all(t.dtype == torch.float32 for t in w1.values())  # float32 master weights
    assert any(not torch.equal(w0[k], w1[k]) for k in w0)


# --------------------------------------------------------------------------- weights / checkpoints


def test_resume_from_state_dict(tok, batch):
    """2 steps, save, 2 more; a fresh engine loads the save and takes the same 2 steps."""
    eng = fsdp_engine(tok, lr=1e-2, scheduler=sched)
    rounds = [[slice(0, 6), slice(6, 12)], [slice(0, 12)], [slice(3, 9)], [slice(0, 4), slice(8, 12)]]
    for splits in rounds[:2]:
        micro_backward(eng, batch, splits)
        eng.step()
    state = copy.deepcopy(eng.state_dict())
    assert state["global_step"] == 2 and not any(isinstance(v, DTensor) for v in state["model"].values())
    metrics = []
    for splits in rounds[2:]:
        micro_backward(eng, batch, splits)
        metrics.append(eng.step())
    expected = weights(eng)

    other = fsdp_engine(tok, seed=5, lr=1e-2, scheduler=sched)
    other.load_state_dict(state)
    assert other.global_step == 2
    for splits, m in zip(rounds[2:], metrics):
        micro_backward(other, batch, splits)
        m2 = other.step()
        assert m2["lr"] == m["lr"] and m2["grad_norm"] == pytest.approx(m["grad_norm"], rel=1e-6)
    assert_weights_close(weights(other), expected, atol=0)
    with pytest.raises(ValueError, match="state must be a dict"):
        other.load_state_dict({"model": {}})


@pytest.mark.parametrize("tie", [True, False])
def test_export_weights_and_save_model(tok, batch, tmp_path, tie):
    eng = FSDP2TrainEngine(tiny_qwen2(tok, seed=0, tie_embeddings=tie), lr=1e-2)
    rollout = HFRolloutEngine(tiny_qwen2(tok, seed=0, tie_embeddings=tie), tok)
    micro_backward(eng, batch, SPLITS)
    eng.step()
    names = [n for n, _ in eng.export_weights()]
    assert names == [n for n, _ in rollout.model.named_parameters()]  # state_dict names, tied once
    assert ("lm_head.weight" in names) is not tie
    assert all(t.dtype == torch.bfloat16 for _, t in eng.export_weights(torch.bfloat16))
    prompts = [tok(t).input_ids for t in TEXTS]
    params = SamplingParams(n=2, temperature=0.7, max_tokens=10, seed=5)

    def err():
        b = pack_generations(rollout.generate(prompts, params), tok.pad_token_id)
        with torch.no_grad():
            lp = eng.logprobs(b.input_ids, b.attention_mask, b.response_mask, temperature=0.7)
        return float((lp - b.old_logprobs).abs()[b.response_mask].max())

    assert err() > 1e-4  # the rollout engine still has the initial weights
    rollout.update_weights(eng.export_weights(), version=1)
    assert err() < 1e-5

    out = eng.save_model(tmp_path / "policy", tok)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert type(loaded).__name__ == "Qwen2ForCausalLM"
    assert loaded.config.architectures == ["Qwen2ForCausalLM"]
    assert_weights_close(dict(loaded.named_parameters()), weights(eng), atol=0)
    assert transformers.AutoTokenizer.from_pretrained(out).decode(prompts[0]) == TEXTS[0]


# --------------------------------------------------------------------------- arguments


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"lr": 0.0}, "lr must be"),
        ({"lr": float("nan")}, "lr must be"),
        ({"weight_decay": -1.0}, "weight_decay must be"),
        ({"grad_clip": 0.0}, "grad_clip must be"),
        ({"grad_clip": True}, "grad_clip must be"),
        ({"dtype": torch.float64}, "dtype must be"),
        ({"mixed_precision": torch.int8}, "mixed_precision must be"),
        ({"device": "meta"}, "device must be"),
        ({"device": "nonsense"}, "device must be"),
        ({"optimizer_factory": "adamw"}, "optimizer_factory must be"),
        ({"reshard_after_forward": 1}, "reshard_after_forward must be a bool"),
        ({"share_prompts": None}, "share_prompts must be a bool"),
        ({"logprob_chunk_tokens": -1}, "logprob_chunk_tokens must be"),
        ({"logprob_chunk_tokens": True}, "logprob_chunk_tokens must be"),
    ],
)
def test_bad_arguments(tok, kwargs, match):
    with pytest.raises(ValueError, match=match) as e:
        FSDP2TrainEngine(tiny_qwen2(tok), **kwargs)
    assert "\n" not in str(e.value)


def test_bad_calls(tok, batch):
    with pytest.raises(ValueError, match=r"model must be a torch\.nn\.Module"):
        FSDP2TrainEngine("Qwen/Qwen2-0.5B")
    eng = fsdp_engine(tok)
    b = batch[0:2]
    lp = eng.logprobs(b.input_ids, b.attention_mask, b.response_mask)
    with pytest.raises(ValueError, match="loss must be a scalar"):
        eng.backward(lp)
    with pytest.raises(ValueError, match="temperature"):
        eng.logprobs(b.input_ids, b.attention_mask, b.response_mask, temperature=0)
    with pytest.raises(ValueError, match="does not fit"):
        eng.logprobs(b.input_ids, b.attention_mask, b.input_ids.bool())


# --------------------------------------------------------------------------- two gloo ranks

WORLD = 2
RANK_ROWS = [slice(0, 7), slice(7, 12)]  # unequal shares of the batch
TWO_RANK_RUNS = {  # name: engine kwargs
    "sgd": dict(optimizer_factory=sgd, grad_clip=None),
    "adamw": dict(lr=1e-3, grad_clip=0.5),
    "adamw-lean": dict(lr=1e-3, grad_clip=0.5, logprob_chunk_tokens=4, reshard_after_forward=False),
}


def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, port, out_dir, b):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        tok = char_tokenizer()
        mine = b[RANK_ROWS[rank]]
        mine.extras["adv"] = b.extras["adv"][RANK_ROWS[rank]]
        n = mine.input_ids.shape[0]
        out = {}
        for name, kw in TWO_RANK_RUNS.items():
            eng = fsdp_engine(tok, **kw)
            assert eng.world_size == WORLD and not eng.owns_process_group
            emb = eng.model.model.embed_tokens.weight  # each rank holds half of the rows
            assert emb.to_local().shape[0] * WORLD >= emb.shape[0] > emb.to_local().shape[0]
            micro_backward(eng, mine, [slice(0, 3), slice(3, n)])
            m = eng.step()
            out[name] = (m, weights(eng))  # every rank exports (a collective)
            if name == "adamw":
                state = eng.state_dict()  # full state, the same on both ranks
                out["state-keys"] = sorted(state["model"])
                if rank == 0:
                    torch.save(state, os.path.join(out_dir, "state.pt"))
                eng.save_model(os.path.join(out_dir, "policy"), tok)
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_ranks_equal_single_process_full_batch(tok, batch, tmp_path):
    mp.spawn(_worker, args=(_free_port(), str(tmp_path), batch), nprocs=WORLD, join=True)
    refs, ref_engines = {}, {}
    for name, kw in TWO_RANK_RUNS.items():
        ref = TorchTrainEngine(
            tiny_qwen2(tok, seed=0), **{k: v for k, v in kw.items() if k != "reshard_after_forward"}
        )
        micro_backward(ref, batch, [slice(0, 12)])
        refs[name] = (ref.step(), weights(ref))
        ref_engines[name] = ref
    outs = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    assert outs[0]["state-keys"] == outs[1]["state-keys"]
    for name in TWO_RANK_RUNS:
        (m0, w0), (m1, w1) = outs[0][name], outs[1][name]
        m_ref, expected = refs[name]
        # FSDP2 averages the reduce-scatter over the 2 ranks and global_normalizers' dp_size
        # cancels it: the same gradient norm as one process with the whole batch.
        assert m0 == m1 and m0["grad_norm"] == pytest.approx(m_ref["grad_norm"], rel=1e-5)
        assert_weights_close(w0, w1, atol=0)  # the ranks export identical weights
        assert_weights_close(w0, expected, atol=SGD_ATOL if name == "sgd" else ADAM_ATOL)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "policy")
    assert_weights_close(dict(loaded.named_parameters()), outs[0]["adamw"][1], atol=0)
    # The full checkpoint of the 2 ranks resumes in one process: same weights, and the next
    # step (AdamW moments restored) equals the reference's uninterrupted second step (the
    # first step's ADAM_ATOL differences carry over; the second adds at most as much).
    one = fsdp_engine(tok, seed=5, **TWO_RANK_RUNS["adamw"])
    one.load_state_dict(torch.load(tmp_path / "state.pt"))
    assert one.global_step == 1
    assert_weights_close(weights(one), outs[0]["adamw"][1], atol=0)
    for e in (one, ref_engines["adamw"]):
        micro_backward(e, batch, [slice(0, 12)])
        e.step()
    assert_weights_close(weights(one), weights(ref_engines["adamw"]), atol=2 * ADAM_ATOL)


def test_sync_trainer_on_fsdp2_saves_a_loadable_model(tmp_path):
    """train.engine=fsdp2 through the config: two RL steps, the model saved at the end."""
    import transformers

    from trainers.config import load_config
    from trainers.loops import SyncTrainer

    cfg = load_config(
        ["--model", "tiny", "train.engine=fsdp2", "data.digits=1", "data.eval_size=8", "eval.before=false",
         "rollout.prompts_per_step=2", "rollout.n=2", "rollout.max_tokens=3", "train.steps=2",
         "algorithm.entropy_coef=0.1", "logging.progress=false", f"logging.dir={tmp_path}"]
    )  # fmt: skip
    with SyncTrainer(cfg) as tr:
        out = tr.fit()
        final = dict(tr.learner.export_weights())
    saved = transformers.AutoModelForCausalLM.from_pretrained(out["model_dir"])
    assert all(torch.equal(p, final[k]) for k, p in saved.named_parameters())
