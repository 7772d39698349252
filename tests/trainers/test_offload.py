"""Training state offloaded between phases (``placement.offload_train``, trainers.engines.offload).

Real engines on the tiny Qwen2 (torch, DeepSpeed ZeRO 0 / 2 / 3 over a one-process gloo group,
FSDP2): after a step and a further backward, ``offload()`` empties the storage of every
parameter, gradient, optimizer state tensor (exp_avg, exp_avg_sq, step) and buffer, and
``onload()`` restores each bit for bit; the next step then equals a twin engine's that never
offloaded. On this CPU-only machine the "device" is the host, so the host copies are separate
storages and the originals are emptied: the same code path as on a GPU, minus the pinning.
"""

import copy
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers")
pytest.importorskip("trainers.engines.deepspeed_train")  # sets DS_ACCELERATOR=cpu first

import torch

from rollkit.losses import aggregate, global_normalizers, ppo_clip
from trainers.config import load_config
from trainers.engines import HFRolloutEngine, SamplingParams, TorchTrainEngine, pack_generations
from trainers.engines.deepspeed_train import DeepSpeedTrainEngine
from trainers.engines.fsdp2_train import FSDP2TrainEngine
from trainers.engines.offload import offload, onload, reachable_tensors
from trainers.loops import SyncTrainer
from trainers.models import char_tokenizer, tiny_qwen2

TEXTS = ["What is 12+34? Answer: ", "7+5="]
Z3 = {"zero_optimization": {"stage3_param_persistence_threshold": 0}}  # every parameter partitioned


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


@pytest.fixture(scope="module")
def batch(tok):
    prompts = [tok(t).input_ids for t in TEXTS]
    gens = HFRolloutEngine(tiny_qwen2(tok, seed=0), tok).generate(
        prompts, SamplingParams(n=3, max_tokens=8, seed=1)
    )
    b = pack_generations(gens, tok.pad_token_id)
    b.extras["adv"] = torch.linspace(-1, 1, len(gens))
    return b


def build(kind, tok):
    model = tiny_qwen2(tok, seed=0)
    if kind == "torch":
        return TorchTrainEngine(model, lr=1e-3)
    if kind.startswith("zero"):
        stage = int(kind[4:])
        return DeepSpeedTrainEngine(model, zero_stage=stage, lr=1e-3, ds_config=Z3 if stage == 3 else None)
    return FSDP2TrainEngine(model, lr=1e-3)


def backward(engine, b):
    norms = global_normalizers(b.response_mask)
    for rows in (slice(0, 4), slice(4, 6)):
        mb = b[rows]
        lp = engine.logprobs(mb.input_ids, mb.attention_mask, mb.response_mask)
        out = ppo_clip(lp, mb.old_logprobs, b.extras["adv"][rows], mb.response_mask)
        engine.backward(aggregate(out.loss, mb.response_mask, "token-mean", **norms))


def local(t):
    return getattr(t, "_local_tensor", t)


def named_state(engine):
    """Every parameter (ZeRO-3: its partition), gradient, buffer and optimizer state tensor,
    by a readable name, as the test sees them (not through the offload module)."""
    out = {}
    for n, p in engine.model.named_parameters():
        out[f"param {n}"] = local(getattr(p, "ds_tensor", p))
        if p.grad is not None:
            out[f"grad {n}"] = local(p.grad)
    for n, b in engine.model.named_buffers():
        out[f"buffer {n}"] = b
    for i, st in enumerate(engine.optimizer.state.values()):
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                out[f"optimizer {i} {k}"] = local(v)
    return out


def as_bytes(t):
    return t.detach().reshape(-1).view(torch.uint8).clone()


@pytest.mark.parametrize("kind", ["torch", "zero0", "zero2", "zero3", "fsdp2"])
def test_offload_moves_every_tensor_and_restores_it_bit_identically(tok, batch, kind):
    eng, twin = build(kind, tok), build(kind, tok)
    for e in (eng, twin):
        backward(e, batch)
        e.step()
        backward(e, batch)  # gradients present at the offload
    state = named_state(eng)
    kinds = {k.split()[0] for k in state} | {k.split()[-1] for k in state if k.startswith("optimizer")}
    assert {"param", "buffer", "exp_avg", "exp_avg_sq", "step"} <= kinds, kinds
    if kind in ("torch", "zero0", "fsdp2"):
        assert "grad" in kinds  # ZeRO 2 / 3 keep gradients in their own buffers (checked below)
    before = {k: as_bytes(v) for k, v in state.items() if v.numel()}
    # DeepSpeed's own buffers (flat partitions, gradient buckets; its meta placeholders aside)
    ds = (
        [t for t in reachable_tensors(eng.engine.optimizer) if t.device.type == "cpu"]
        if kind[0] == "z"
        else []
    )
    ds_before = [as_bytes(t) for t in ds if t.numel()]
    eng.offload()
    eng.offload()  # idempotent
    assert eng.offloaded
    full = [k for k, v in state.items() if v.numel() and v.untyped_storage().nbytes()]
    assert not full, f"still on the device: {full[:5]}"
    assert not [t for t in ds if t.numel() and t.untyped_storage().nbytes()]
    eng.onload()
    eng.onload()  # idempotent
    assert not eng.offloaded
    changed = [k for k, v in state.items() if v.numel() and not torch.equal(as_bytes(v), before[k])]
    assert not changed, changed[:5]
    assert all(torch.equal(as_bytes(t), b) for t, b in zip([t for t in ds if t.numel()], ds_before))
    # the restored state trains on exactly like a twin that never left the device
    m1, m2 = eng.step(), twin.step()
    assert m1["grad_norm"] == m2["grad_norm"]
    for (n1, a), (n2, b) in zip(list(eng.export_weights()), list(twin.export_weights()), strict=True):
        assert n1 == n2 and torch.equal(a, b), n1


def test_an_offloaded_engine_onloads_itself_when_used(tok, batch):
    eng = build("torch", tok)
    ref = {n: p.detach().clone() for n, p in eng.model.named_parameters()}
    eng.offload()
    sd = eng.state_dict()  # a checkpoint of an offloaded engine reads the real weights
    assert not eng.offloaded
    assert all(torch.equal(sd["model"][n], ref[n]) for n in ref)
    eng.offload()
    assert dict(eng.export_weights()).keys() == ref.keys() and not eng.offloaded


def test_offload_skips_other_devices_and_shares_storages():
    base = torch.arange(12.0)
    view = base[3:6]
    saved = offload([base, view, base.view(3, 4)], "cpu")
    assert len(saved.entries) == 1 and saved.nbytes == 48
    assert base.untyped_storage().nbytes() == 0
    onload(saved)
    assert torch.equal(view, torch.tensor([3.0, 4.0, 5.0]))
    assert offload([torch.ones(2)], "meta").entries == []  # only tensors on the named device move


def _sync_run(tmp_path, name, *extra):
    cfg = load_config(
        ["--model", "tiny", "data.digits=1", "data.eval_size=10", "eval.before=false", "eval.every=0",
         "train.lr=1e-3", "train.steps=2", "rollout.prompts_per_step=2", "rollout.n=4",
         "train.micro_batch_size=3", "logging.progress=false", "logging.save_model=false",
         f"logging.dir={tmp_path / name}", f"checkpoint.dir={tmp_path / name / 'ck'}", "checkpoint.every=1",
         *extra]
    )  # fmt: skip
    tok = char_tokenizer()
    model = tiny_qwen2(tok, seed=0)
    tr = SyncTrainer(
        cfg,
        rollout=HFRolloutEngine(copy.deepcopy(model), tok),
        train=TorchTrainEngine(model, lr=cfg.train.lr, grad_clip=cfg.train.grad_clip),
        tokenizer=tok,
    )
    return tr


def test_sync_training_with_offload_equals_without(tmp_path):
    """Two steps with a checkpoint after each, float32: the same weights bit for bit, and the
    train state is on the host between steps."""
    plain = _sync_run(tmp_path, "plain")
    off = _sync_run(tmp_path, "off", "placement.offload_train=true")
    assert off.roles.train_offload and not plain.roles.train_offload
    assert off.train.offloaded  # built offloaded: the first generation runs without it
    h1, h2 = plain.fit()["history"], off.fit()["history"]
    assert off.train.offloaded  # after the last checkpoint it went back to the host
    for (n1, a), (n2, b) in zip(
        list(plain.train.export_weights()), list(off.train.export_weights()), strict=True
    ):
        assert n1 == n2 and torch.equal(a, b), n1
    same = ("time/", "throughput/", "memory/")
    assert [{k: v for k, v in r.items() if not k.startswith(same)} for r in h1] == [
        {k: v for k, v in r.items() if not k.startswith(same)} for r in h2
    ]
    assert "time/offload" in h2[0] and "time/offload" not in h1[0]


def test_a_train_role_without_offload_is_refused_by_name(tmp_path):
    class NoOffload:
        def __init__(self, engine):
            self.engine = engine

        def __getattr__(self, name):
            if name in ("offload", "onload"):
                raise AttributeError(name)
            return getattr(self.engine, name)

    tok = char_tokenizer()
    model = tiny_qwen2(tok, seed=0)
    cfg = load_config(["--model", "tiny", "placement.offload_train=true", f"logging.dir={tmp_path}"])
    with pytest.raises(ValueError, match=r"placement\.offload_train: the train role NoOffload"):
        SyncTrainer(
            cfg,
            rollout=HFRolloutEngine(copy.deepcopy(model), tok),
            train=NoOffload(TorchTrainEngine(model)),
            tokenizer=tok,
        )
