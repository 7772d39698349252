"""Compiled decoder layers, the fused AdamW and master weights (``train.compile``,
``train.fused_optimizer``, ``train.master_weights``;
trainers/engines/compiled.py) on the tiny Qwen2, CPU.

Compilation must not change what is computed: the compiled engine's log-probs and weights after
a step equal the eager engine's (padded and packed). The tests use the ``aot_eager`` backend
(dynamo's graph capture and AOTAutograd's joint graph, the parts that can change semantics,
without inductor's C++ code generation, which would cost minutes on 2 cores); one test runs
inductor itself on a single layer.
"""

import copy
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers")

import torch
from _ragged import ragged_batch

from trainers.config import load_config
from trainers.engines import TorchTrainEngine
from trainers.engines.build import make_train_engine
from trainers.engines.compiled import adamw, compile_layers, decoder_layers
from trainers.models import char_tokenizer, tiny_qwen2


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


def _step(eng, ids, am, rm):
    lp, ent = eng.logprobs(ids, am, rm, with_entropy=True)
    eng.backward(-(lp.sum() + 0.1 * ent.sum()) / rm.sum())
    eng.step()
    with torch.no_grad():
        return lp.detach(), eng.logprobs(ids, am, rm)


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_compiled_layers_compute_what_eager_layers_compute(tok, packing):
    torch._dynamo.reset()
    ids, am, rm = ragged_batch()
    m = tiny_qwen2(tok, seed=0)
    eager = TorchTrainEngine(copy.deepcopy(m), lr=1e-2, packing=packing, share_prompts=False)
    comp = TorchTrainEngine(
        copy.deepcopy(m), lr=1e-2, packing=packing, share_prompts=False, compile_backend="aot_eager"
    )
    assert all(
        getattr(layer, "_compiled_call_impl", None) is not None for layer in decoder_layers(comp.model)
    )
    a0, a1 = _step(eager, ids, am, rm)
    b0, b1 = _step(comp, ids, am, rm)
    assert torch.allclose(a0, b0, atol=1e-5) and torch.allclose(a1, b1, atol=1e-5)
    assert (a1 - a0).abs().max() > 1e-3  # the step moved the weights: the comparison has teeth
    for x in (1, 2):  # other lengths (dynamic shapes): no error, same values
        sel = slice(0, 7 - x)
        with torch.no_grad():
            assert torch.allclose(
                eager.logprobs(ids[sel], am[sel], rm[sel]),
                comp.logprobs(ids[sel], am[sel], rm[sel]),
                atol=1e-5,
            )


def test_inductor_compiles_a_layer_on_this_cpu(tok):
    """The default backend, on one layer of a one-layer model (C++ code generation: the slow part)."""
    torch._dynamo.reset()
    m = tiny_qwen2(tok, seed=0, layers=1)
    ref = copy.deepcopy(m)
    assert compile_layers(m) == len(decoder_layers(m))
    assert compile_layers(m) == len(decoder_layers(m))  # idempotent
    ids, am, _ = ragged_batch()
    with torch.no_grad():
        assert torch.allclose(m(input_ids=ids, attention_mask=am).logits, ref(input_ids=ids, attention_mask=am).logits,
                              atol=1e-4)  # fmt: skip


def test_fused_adamw_takes_the_step_of_the_default_adamw():
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 8)
    ref = copy.deepcopy(lin)
    opt, opt_ref = (
        adamw(lin.parameters(), lr=1e-2, weight_decay=0.1, fused=True),
        adamw(ref.parameters(), lr=1e-2, weight_decay=0.1),
    )
    assert opt.defaults.get("fused") and not opt_ref.defaults.get("fused")
    x = torch.randn(4, 8)
    for _ in range(3):
        for mod, o in ((lin, opt), (ref, opt_ref)):
            mod(x).pow(2).sum().backward()
            o.step()
            o.zero_grad()
    assert torch.allclose(lin.weight, ref.weight, atol=1e-6)


def test_config_builds_compiled_fused_engines_and_refuses_unknown_backends(tok):
    cfg = load_config(
        ["--model", "tiny", "train.compile=true", "train.compile_backend=eager", "train.fused_optimizer=true"]
    )
    eng = make_train_engine(cfg, tiny_qwen2(tok, seed=0), device="cpu")
    assert eng.optimizer.defaults.get("fused")
    assert all(getattr(layer, "_compiled_call_impl", None) is not None for layer in decoder_layers(eng.model))
    from trainers.config import validate

    with pytest.raises(ValueError, match=r"train\.compile_backend"):
        validate(load_config(["--model", "tiny", "train.compile=true", "train.compile_backend=tvm"]))
    with pytest.raises(ValueError, match=r"train\.compile: .*no decoder layers"):
        compile_layers(torch.nn.Linear(2, 2))


# --------------------------------------------------------------------------- master weights


def test_master_weights_keep_float32_masters_and_bf16_parameters(tok):
    """bf16 parameters, float32 masters: the optimizer steps the masters, the parameters are the
    masters rounded after each step; micro-batches accumulate into one float32 gradient."""
    ids, am, rm = ragged_batch()
    m = tiny_qwen2(tok, seed=0)
    eng = TorchTrainEngine(copy.deepcopy(m), dtype=torch.bfloat16, master_weights=True, lr=1e-2)
    masters = eng._master.params
    assert all(p.dtype == torch.bfloat16 for p in eng.model.parameters()) and all(
        x.dtype == torch.float32 for x in masters
    )
    assert all(g["params"][0].dtype == torch.float32 for g in eng.optimizer.param_groups)
    for half in (slice(0, 4), slice(4, 7)):  # two micro-batches
        lp = eng.logprobs(ids[half], am[half], rm[half])
        eng.backward(-lp.sum() / rm.sum())
    assert all(p.grad is None for p in eng.model.parameters())  # moved into the masters
    assert all(x.grad is not None and x.grad.dtype == torch.float32 for x in masters)
    out = eng.step()
    assert out["skipped"] == 0 and out["grad_norm"] > 0
    for p, x in eng._master.pairs:
        assert torch.equal(p, x.to(torch.bfloat16))
    moved = max((x - y.float()).abs().max().item() for x, y in zip(masters, m.parameters(), strict=True))
    assert moved > 1e-3
    # a checkpoint restores the masters exactly, not their bf16 rounding
    state = copy.deepcopy(eng.state_dict())
    other = TorchTrainEngine(copy.deepcopy(m), dtype=torch.bfloat16, master_weights=True, lr=1e-2)
    other.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(other._master.params, masters, strict=True))


def test_master_weights_keep_updates_that_bf16_weights_lose(tok):
    """An update far below half a bf16 ulp of the weights: stepped in bf16 it vanishes; with
    float32 masters it accumulates (SGD: the masters move by exactly lr * grad each step)."""
    ids, am, rm = ragged_batch()
    m = tiny_qwen2(tok, seed=0).to(torch.bfloat16)
    sgd = lambda params: torch.optim.SGD(params, lr=1e-6)  # noqa: E731
    plain = TorchTrainEngine(copy.deepcopy(m), dtype=torch.bfloat16, optimizer_factory=sgd, grad_clip=None)
    master = TorchTrainEngine(copy.deepcopy(m), dtype=torch.bfloat16, optimizer_factory=sgd, grad_clip=None,
                              master_weights=True)  # fmt: skip
    for eng in (plain, master):
        for _ in range(3):
            eng.backward(-eng.logprobs(ids, am, rm).sum() / rm.sum())
            eng.step()
    w0 = m.model.layers[0].mlp.up_proj.weight.float()
    assert torch.equal(plain.model.model.layers[0].mlp.up_proj.weight.float(), w0)  # lost
    masters = {id(p): x for p, x in master._master.pairs}
    up = master.model.model.layers[0].mlp.up_proj.weight
    assert torch.equal(up.float(), w0)  # the bf16 parameter has not moved yet either ...
    assert (masters[id(up)] - w0).abs().max() > 0  # ... but its master has: kept


def test_master_weights_config(tok):
    from trainers.config import validate

    ok = load_config(["--model", "tiny", "model.dtype=bfloat16", "train.master_weights=true"])
    validate(ok)
    eng = make_train_engine(ok, tiny_qwen2(tok, seed=0, dtype=torch.bfloat16), device="cpu")
    assert eng._master is not None
    with pytest.raises(ValueError, match=r"train\.master_weights: needs"):
        validate(load_config(["--model", "tiny", "train.master_weights=true"]))  # float32 model
    with pytest.raises(ValueError, match=r"train\.master_weights: .*autocast"):
        validate(load_config(["--model", "tiny", "model.dtype=bfloat16", "train.master_weights=true",
                              "train.autocast=bfloat16"]))  # fmt: skip
    with pytest.raises(ValueError, match="master_weights"):
        TorchTrainEngine(tiny_qwen2(tok, seed=0), master_weights=True)  # float32 parameters
