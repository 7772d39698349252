"""Compiled decoder layers and the fused AdamW (``train.compile``, ``train.fused_optimizer``;
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
