"""DeepSpeedTrainEngine (ZeRO 0-3 on CPU over gloo) against TorchTrainEngine on a tiny Qwen2.

The reference is the embedded engine: same initial weights, same torch optimizer, same
micro-batches and rollkit loss. DeepSpeed runs for real (its CPU accelerator, a one-process
gloo group in this process; two spawned gloo ranks in the slow test).
"""

import copy
import os
import socket

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers")
# Import the engine module before deepspeed: it sets DS_ACCELERATOR=cpu when there is no GPU.
pytest.importorskip("trainers.engines.deepspeed_train")
pytest.importorskip("deepspeed")

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rollkit.losses import aggregate, global_normalizers, ppo_clip
from trainers.engines import HFRolloutEngine, SamplingParams, TorchTrainEngine, TrainEngine, pack_generations
from trainers.engines.deepspeed_train import DeepSpeedTrainEngine, build_ds_config
from trainers.models import char_tokenizer, tiny_qwen2

STAGES = [0, 1, 2, 3]
TEXTS = ["What is 12+34? Answer: ", "7+5=", "Compute 3*9. "]
N = 4  # samples per prompt: B = 12
SPLITS = [slice(0, 5), slice(5, 7), slice(7, 12)]  # unequal micro-batches
# ZeRO-3 keeps parameters below this many elements whole on every rank (default 1e5: all of
# the tiny model); 0 partitions every parameter, so the gathers are really exercised.
Z3 = {"zero_optimization": {"stage3_param_persistence_threshold": 0}}
# After one AdamW step (lr 1e-3: each weight moves by about 1e-3) the engines' weights agree
# to 1e-5 (1% of the move). Not exactly: a few gradients are ~1e-10, below Adam's eps of 1e-8 (the k_proj bias,
# which softmax ignores, and some others), and there Adam's update lr * g / (|g| + eps) turns
# a float32 rounding difference in g (ZeRO-3 sums micro-batch gradients into its partitions
# in another order: measured ~1e-10) into up to lr * 1e-10 / eps = 1e-5. Measured: under 5e-6
# on earlier CPUs; 5.75e-6 (one gate_proj element, test_nonfinite_gradient_skips_the_step[3])
# on a 2-core AMD EPYC without AVX-512. The gradients themselves agree to float32 rounding
# (test_accumulation_equals_full_batch, with SGD).
ADAM_ATOL = 1e-5


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


def ds_engine(tok, stage, seed=0, **kw):
    cfg = kw.pop("ds_config", Z3 if stage == 3 else None)
    return DeepSpeedTrainEngine(tiny_qwen2(tok, seed=seed), zero_stage=stage, ds_config=cfg, **kw)


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


# --------------------------------------------------------------------------- equivalence


@pytest.mark.parametrize("stage", STAGES)
def test_step_matches_torch_engine(tok, batch, stage):
    """Same init, AdamW, micro-batches and loss: same log-probs, grad norm and weights."""
    ref = TorchTrainEngine(tiny_qwen2(tok, seed=0), lr=1e-3, grad_clip=0.5)
    eng = ds_engine(tok, stage, lr=1e-3, grad_clip=0.5)
    assert isinstance(eng, TrainEngine) and eng.world_size == 1
    if stage == 3:  # really partitioned: the module holds empty placeholders
        assert all(p.numel() == 0 for p in eng.model.parameters())
    b = batch
    with torch.no_grad():
        lp0, ent0 = ref.logprobs(
            b.input_ids, b.attention_mask, b.response_mask, temperature=0.7, with_entropy=True
        )
        lp1, ent1 = eng.logprobs(
            b.input_ids, b.attention_mask, b.response_mask, temperature=0.7, with_entropy=True
        )
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
        lp0 = ref.logprobs(b.input_ids, b.attention_mask, b.response_mask)
        lp1 = eng.logprobs(b.input_ids, b.attention_mask, b.response_mask)
    torch.testing.assert_close(lp1, lp0, rtol=0, atol=1e-5)


@pytest.mark.parametrize("stage", STAGES)
def test_accumulation_equals_full_batch(tok, batch, stage):
    """k micro-batches with global normalisers == one full-batch backward, for two steps in a
    row (the partitions are reset by step), and zero_grad discards what was accumulated."""
    full = ds_engine(tok, stage, optimizer_factory=sgd, grad_clip=None)
    acc = ds_engine(tok, stage, optimizer_factory=sgd, grad_clip=None)
    micro_backward(acc, batch, [slice(0, 3)])  # discarded below
    acc.zero_grad()
    for _ in range(2):
        micro_backward(full, batch, [slice(0, 12)], mode="seq-mean-token-mean")
        micro_backward(acc, batch, SPLITS, mode="seq-mean-token-mean")
        mf, ma = full.step(), acc.step()
        assert ma["grad_norm"] == pytest.approx(mf["grad_norm"], rel=1e-5) and mf["grad_norm"] > 0
        # SGD with lr 1: the weights differ by the gradients' difference (grads are up to
        # ~1e-1; 2e-7 is the float32 rounding of weights of size ~1).
        assert_weights_close(weights(acc), weights(full), atol=2e-7)


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_nonfinite_gradient_skips_the_step(tok, batch, stage):
    sched = lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))  # noqa: E731
    eng = ds_engine(tok, stage, lr=1e-3, scheduler=sched)
    ref = TorchTrainEngine(tiny_qwen2(tok, seed=0), lr=1e-3, scheduler=sched)
    w0 = weights(eng)
    b = batch[0:4]
    lp = eng.logprobs(b.input_ids, b.attention_mask, b.response_mask)
    eng.backward(aggregate(lp, b.response_mask) * float("nan"))
    m = eng.step()
    assert m["skipped"] == 1 and not m["grad_norm"] < float("inf")
    assert_weights_close(weights(eng), w0, atol=0)
    assert eng.global_step == 0 and eng.optimizer.param_groups[0]["lr"] == 1e-3  # scheduler not stepped
    # The next step is the first real one: same as a fresh reference engine's first step.
    micro_backward(eng, batch, SPLITS)
    micro_backward(ref, batch, SPLITS)
    assert eng.step()["lr"] == ref.step()["lr"] == 1e-3
    assert eng.optimizer.param_groups[0]["lr"] == 0.5e-3
    assert_weights_close(weights(eng), weights(ref), atol=ADAM_ATOL)


# --------------------------------------------------------------------------- weights / checkpoints


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_resume_from_state_dict(tok, batch, stage):
    """2 steps, save, 2 more; a fresh engine loads the save and takes the same 2 steps."""
    sched = lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))  # noqa: E731
    eng = ds_engine(tok, stage, lr=1e-2, scheduler=sched)
    rounds = [[slice(0, 6), slice(6, 12)], [slice(0, 12)], [slice(3, 9)], [slice(0, 4), slice(8, 12)]]
    for splits in rounds[:2]:
        micro_backward(eng, batch, splits)
        eng.step()
    state = copy.deepcopy(eng.state_dict())
    assert state["global_step"] == 2 and state["zero_stage"] == stage
    metrics = []
    for splits in rounds[2:]:
        micro_backward(eng, batch, splits)
        metrics.append(eng.step())
    expected = weights(eng)

    other = ds_engine(tok, stage, seed=5, lr=1e-2, scheduler=sched)
    other.load_state_dict(state)
    assert other.global_step == 2
    for splits, m in zip(rounds[2:], metrics):
        micro_backward(other, batch, splits)
        m2 = other.step()
        assert m2["lr"] == m["lr"] and m2["grad_norm"] == pytest.approx(m["grad_norm"], rel=1e-6)
    assert_weights_close(weights(other), expected, atol=0)


def test_load_state_dict_checks_the_layout(tok):
    eng = ds_engine(tok, 2)
    state = eng.state_dict()
    other = ds_engine(tok, 3, seed=3)
    with pytest.raises(ValueError, match="zero_stage, world_size, rank"):
        other.load_state_dict(state)
    other.load_state_dict(state, load_optimizer=False)  # weights only, fresh optimizer
    assert_weights_close(weights(other), weights(eng), atol=0)
    bad = dict(state, model={**state["model"], "nope.weight": torch.zeros(1)})
    with pytest.raises(KeyError, match=r"nope\.weight"):
        eng.load_state_dict(bad)


@pytest.mark.parametrize("stage", [2, 3])
def test_export_weights_updates_rollout_engine(tok, batch, stage):
    eng = ds_engine(tok, stage, lr=1e-2)
    rollout = HFRolloutEngine(tiny_qwen2(tok, seed=0), tok)
    micro_backward(eng, batch, SPLITS)
    eng.step()
    names = [n for n, _ in eng.export_weights()]
    assert names == [n for n, _ in rollout.model.named_parameters()]  # state_dict names, tied once
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


def test_gradient_checkpointing_zero3_same_gradient(tok, batch):
    plain = ds_engine(tok, 3, optimizer_factory=sgd, grad_clip=None)
    ckpt = ds_engine(tok, 3, optimizer_factory=sgd, grad_clip=None, gradient_checkpointing=True)
    for e in (plain, ckpt):
        micro_backward(e, batch, SPLITS)
        e.step()
    assert_weights_close(weights(ckpt), weights(plain), atol=1e-6)


def test_bf16_trains(tok, batch):
    eng = ds_engine(tok, 2, lr=1e-3, dtype=torch.bfloat16)
    ref = TorchTrainEngine(tiny_qwen2(tok, seed=0))
    b = batch
    with torch.no_grad():
        lp = eng.logprobs(b.input_ids, b.attention_mask, b.response_mask)
        lp_ref = ref.logprobs(b.input_ids, b.attention_mask, b.response_mask)
    assert lp.dtype == torch.float32 and (lp - lp_ref).abs().max() < 0.1
    w0 = weights(eng)
    micro_backward(eng, b, SPLITS)
    m = eng.step()
    assert m["skipped"] == 0 and 0 < m["grad_norm"] < float("inf")
    w1 = weights(eng)
    assert all(t.dtype == torch.bfloat16 for t in w1.values())
    assert any(not torch.equal(w0[k], w1[k]) for k in w0)


# --------------------------------------------------------------------------- arguments


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"zero_stage": 5}, ValueError, "zero_stage must be one of"),
        ({"zero_stage": "2"}, ValueError, "zero_stage must be one of"),
        ({"zero_stage": True}, ValueError, "zero_stage must be one of"),
        ({"lr": 0.0}, ValueError, "lr must be"),
        ({"grad_clip": 0.0}, ValueError, "grad_clip must be"),
        ({"weight_decay": -1.0}, ValueError, "weight_decay"),
        ({"dtype": torch.float64}, ValueError, "dtype must be"),
        ({"device": "meta"}, ValueError, "device must be"),
        ({"optimizer": "adamw"}, TypeError, "torch.optim.Optimizer"),
        ({"ds_config": [1]}, TypeError, "ds_config must be a dict"),
        ({"ds_config": {"optimizer": {"type": "Adam"}}}, ValueError, "must not contain 'optimizer'"),
        ({"ds_config": {"gradient_clipping": 2.0}}, ValueError, "grad_clip="),
        ({"ds_config": {"bf16": {"enabled": True}}}, ValueError, "dtype=torch.bfloat16"),
        ({"ds_config": {"gradient_accumulation_steps": 4}}, ValueError, "rollkit owns gradient accumulation"),
        ({"ds_config": {"zero_optimization": {"stage": 3}}}, ValueError, "disagrees with zero_stage=2"),
    ],
)
def test_bad_arguments(tok, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        DeepSpeedTrainEngine(tiny_qwen2(tok), **kwargs)


def test_bad_calls(tok, batch):
    eng = ds_engine(tok, 1)
    m = tiny_qwen2(tok)
    with pytest.raises(ValueError, match="not both"):
        DeepSpeedTrainEngine(m, optimizer=torch.optim.SGD(m.parameters(), lr=1), optimizer_factory=sgd)
    b = batch[0:2]
    lp = eng.logprobs(b.input_ids, b.attention_mask, b.response_mask)
    with pytest.raises(ValueError, match="loss must be a scalar"):
        eng.backward(lp)
    with pytest.raises(ValueError, match="temperature"):
        eng.logprobs(b.input_ids, b.attention_mask, b.response_mask, temperature=0)
    with pytest.raises(ValueError, match="does not fit"):
        eng.logprobs(b.input_ids, b.attention_mask, b.input_ids.bool())
    cfg = build_ds_config(3, grad_clip=1.0, dtype=torch.float32, ds_config=Z3)
    assert cfg["zero_optimization"] == {"stage": 3, "stage3_param_persistence_threshold": 0}
    assert cfg["gradient_accumulation_steps"] == 1 and cfg["managed_gradient_accumulation"] is False


# --------------------------------------------------------------------------- two gloo ranks

WORLD = 2
RANK_ROWS = [slice(0, 7), slice(7, 12)]  # unequal shares of the batch


def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, port, out_dir, b):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        tok = char_tokenizer()
        mine = b[RANK_ROWS[rank]]
        mine.extras["adv"] = b.extras["adv"][RANK_ROWS[rank]]
        n = mine.input_ids.shape[0]
        out = {}
        for stage, opt in [(2, "sgd"), (3, "sgd"), (3, "adamw")]:
            kw = (
                dict(lr=1e-3, grad_clip=0.5)
                if opt == "adamw"
                else dict(optimizer_factory=sgd, grad_clip=None)
            )
            eng = ds_engine(tok, stage, **kw)
            assert eng.world_size == WORLD and not eng.owns_process_group
            if stage == 3:  # each rank holds half of every parameter
                assert all(
                    p.ds_tensor.numel() * WORLD >= p.ds_numel > p.ds_tensor.numel()
                    for p in eng.model.parameters()
                )
            micro_backward(eng, mine, [slice(0, 3), slice(3, n)])
            m = eng.step()
            out[stage, opt] = (m, weights(eng))  # every rank exports (a collective under ZeRO-3)
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_ranks_equal_single_process_full_batch(tok, batch, tmp_path):
    mp.spawn(_worker, args=(_free_port(), str(tmp_path), batch), nprocs=WORLD, join=True)
    refs = {}
    for opt, kw in [
        ("adamw", dict(lr=1e-3, grad_clip=0.5)),
        ("sgd", dict(optimizer_factory=sgd, grad_clip=None)),
    ]:
        ref = TorchTrainEngine(tiny_qwen2(tok, seed=0), **kw)
        micro_backward(ref, batch, [slice(0, 12)])
        refs[opt] = (ref.step(), weights(ref))
    outs = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    assert set(outs[0]) == {(2, "sgd"), (3, "sgd"), (3, "adamw")}
    for (stage, opt), (m0, w0) in outs[0].items():
        m1, w1 = outs[1][stage, opt]
        m_ref, expected = refs[opt]
        # DeepSpeed averages over the 2 ranks, global_normalizers' dp_size cancels it: the
        # same gradient norm as one process with the whole batch (a factor 2 would show here).
        assert m0 == m1 and m0["grad_norm"] == pytest.approx(m_ref["grad_norm"], rel=1e-5)
        assert_weights_close(w0, w1, atol=0)  # the ranks export identical weights
        # SGD (lr 1): the gradient itself; AdamW: see ADAM_ATOL.
        assert_weights_close(w0, expected, atol=ADAM_ATOL if opt == "adamw" else 2e-7)
