"""The training engines' memory-lean log-probs (``train.logprob_chunk_tokens``): the decoder's
hidden states through rollkit.logprobs.lean_token_logprobs, no ``[B, T, V]`` logits. Same
log-probs, entropy and gradients as the plain path (real tiny Qwen2; torch and DeepSpeed)."""

import copy
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers")

import torch

from trainers.engines import HFRolloutEngine, SamplingParams, TorchTrainEngine, pack_generations
from trainers.engines.step import StepBatch
from trainers.learner import UpdateSpec, ppo_update
from trainers.models import char_tokenizer, tiny_qwen2

TEXTS = ["What is 12+34? Answer: ", "7+5=", "Compute 3*9. "]
SAMPLING = [{}, {"top_k": 20, "top_p": 0.8}]


@pytest.fixture(scope="module")
def setup():
    tok = char_tokenizer()
    model = tiny_qwen2(tok, seed=0)
    gens = HFRolloutEngine(copy.deepcopy(model), tok).generate(
        [tok(t).input_ids for t in TEXTS], SamplingParams(n=4, max_tokens=10, seed=1, temperature=0.9)
    )
    return model, pack_generations(gens, tok.pad_token_id)


def _forward_backward(engine, b, sampling):
    lp, ent = engine.logprobs(
        b.input_ids, b.attention_mask, b.response_mask, temperature=0.9, with_entropy=True, **sampling
    )
    (lp.sum() + 0.5 * ent.sum()).backward()
    grads = {n: p.grad.clone() for n, p in engine.model.named_parameters() if p.grad is not None}
    return lp.detach(), ent.detach(), grads


@pytest.mark.parametrize("sampling", SAMPLING, ids=["plain", "top_k_top_p"])
@pytest.mark.parametrize("chunk", [1, 7, 1024])
def test_lean_equals_plain_on_the_torch_engine(setup, sampling, chunk):
    model, b = setup
    ref = _forward_backward(TorchTrainEngine(copy.deepcopy(model)), b, sampling)
    got = _forward_backward(TorchTrainEngine(copy.deepcopy(model), logprob_chunk_tokens=chunk), b, sampling)
    assert torch.allclose(got[0], ref[0], atol=1e-5) and torch.allclose(got[1], ref[1], atol=1e-5)
    assert got[2].keys() == ref[2].keys()
    for k in ref[2]:
        assert torch.allclose(got[2][k], ref[2][k], atol=1e-5, rtol=1e-4), k


def test_ppo_update_with_lean_logprobs(setup):
    model, b = setup
    adv = torch.linspace(-1, 1, b.input_ids.shape[0])[:, None] * b.response_mask
    spec = UpdateSpec(temperature=0.9, micro_batch_size=5, entropy_coef=0.01)
    engines = [TorchTrainEngine(copy.deepcopy(model), lr=1e-3, logprob_chunk_tokens=c) for c in (0, 16)]
    metrics = [ppo_update(e, StepBatch.from_packed(b, advantages=adv), spec).metrics() for e in engines]
    assert abs(metrics[0]["loss/ratio_mean"] - metrics[1]["loss/ratio_mean"]) < 1e-6
    w0, w1 = (dict(e.export_weights()) for e in engines)
    assert max(float((w0[k] - w1[k]).abs().max()) for k in w0) < 1e-5


def test_deepspeed_zero2_lean_and_zero3_refused(setup):
    pytest.importorskip("trainers.engines.deepspeed_train")
    pytest.importorskip("deepspeed")
    from trainers.engines.deepspeed_train import DeepSpeedTrainEngine

    model, b = setup
    kw = {"temperature": 0.9, "top_k": 20, "top_p": 0.8}
    with torch.no_grad():
        ref = TorchTrainEngine(copy.deepcopy(model)).logprobs(
            b.input_ids, b.attention_mask, b.response_mask, **kw
        )
        ds = DeepSpeedTrainEngine(copy.deepcopy(model), zero_stage=2, logprob_chunk_tokens=8)
        got = ds.logprobs(b.input_ids, b.attention_mask, b.response_mask, **kw)
    assert torch.allclose(got, ref, atol=1e-5)
    with pytest.raises(ValueError, match=r"logprob_chunk_tokens: .*ZeRO-3"):
        DeepSpeedTrainEngine(copy.deepcopy(model), zero_stage=3, logprob_chunk_tokens=8)
