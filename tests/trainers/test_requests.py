"""Request-level rollout (trainers.engines.requests) on a real tiny Qwen2: transformers and vLLM.

The contract both engines keep: every request finishes within its own ``max_tokens``; the
reported log-probs are those the trainer recomputes for the same tokens (the processed
distribution); an aborted request keeps its tokens and, added again, continues after its last
token within the same budget; weights change only with nothing running.
"""

import copy
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
pytest.importorskip("transformers")

import torch

from trainers.engines import HFRolloutEngine, SamplingParams, TorchTrainEngine, pack_generations
from trainers.engines.requests import (
    HFRequestEngine,
    Request,
    RequestEngine,
    VLLMRequestEngine,
    as_request_engine,
)
from trainers.models import char_tokenizer, save_model, tiny_qwen2

ATOL = 1e-4
MODEL_KW = {"hidden_size": 64, "heads": 2, "kv_heads": 1}  # head_dim 32: vLLM's CPU attention
TEXTS = ["What is 12+34? Answer: ", "7+5=", "Compute 3*9. ", "1+1="]


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


@pytest.fixture(scope="module")
def base_model(tok):
    return tiny_qwen2(tok, seed=0, **MODEL_KW)


@pytest.fixture(scope="module")
def prompts(tok):
    return [tok(t).input_ids for t in TEXTS]


def recomputed_err(model, reqs, tok, temperature):
    gens = [r.to_generation(i) for i, r in enumerate(reqs)]
    b = pack_generations(gens, tok.pad_token_id)
    with torch.no_grad():
        lp = TorchTrainEngine(model).logprobs(
            b.input_ids, b.attention_mask, b.response_mask, temperature=temperature
        )
    return float((lp - b.old_logprobs).abs()[b.response_mask].max())


def run_all(engine, limit=10_000):
    done = []
    for _ in range(limit):
        if not engine.num_running:
            return done
        done += engine.step()
    raise AssertionError("requests did not finish")


def make(prompts, lengths, *, temperature=1.0, ignore_eos=True, seed=0):
    return [
        Request(
            f"r{i}",
            prompts[i % len(prompts)],
            SamplingParams(max_tokens=m, temperature=temperature, ignore_eos=ignore_eos, seed=seed + i),
            tag=i,
        )
        for i, m in enumerate(lengths)
    ]


def check_contract(engine, model, tok, prompts):
    assert isinstance(engine, RequestEngine)
    lengths = [1, 5, 23, 9, 2, 17]
    reqs = make(prompts, lengths)
    engine.add(reqs)
    assert engine.num_running == 6
    done = run_all(engine)
    assert sorted(r.tag for r in done) == list(range(6))
    for r in done:  # ignore_eos: every request runs to its own budget
        assert len(r.token_ids) == lengths[r.tag] and r.finish_reason == "length"
        assert r.token_versions == [0] * len(r.token_ids) and not r.resumed
    assert recomputed_err(model, done, tok, 1.0) < ATOL

    # Abort mid-way, then continue: the tokens so far are kept and the budget holds.
    reqs = make(prompts, [30, 30, 4], temperature=0.7, seed=100)
    engine.add(reqs)
    finished = []
    while not any(len(r.token_ids) >= 6 for r in reqs):
        finished += engine.step()
    with pytest.raises(RuntimeError, match="abort them first"):
        engine.update_weights([], version=1)
    partial = engine.abort(["r0", "r1", "nope"])
    assert engine.abort(["r0"]) == [] and {r.request_id for r in partial} <= {"r0", "r1"}
    kept = {r.request_id: list(r.token_ids) for r in partial}
    assert all(r.finish_reason is None for r in partial)
    engine.add(partial)
    finished += run_all(engine)
    by_id = {r.request_id: r for r in finished}
    for rid, toks in kept.items():
        r = by_id[rid]
        assert r.token_ids[: len(toks)] == toks and len(r.token_ids) == 30 and r.finish_reason == "length"
    assert len(by_id["r2"].token_ids) == 4
    assert recomputed_err(model, list(by_id.values()), tok, 0.7) < ATOL


def check_bad_input(engine, prompts):
    r = Request("x", prompts[0], SamplingParams(n=2, max_tokens=3))
    with pytest.raises(ValueError, match="n=2"):
        engine.add([r])
    with pytest.raises(ValueError, match="empty prompt"):
        engine.add([Request("x", [], SamplingParams(max_tokens=3))])
    with pytest.raises(ValueError, match="budget"):
        engine.add(
            [
                Request(
                    "x",
                    prompts[0],
                    SamplingParams(max_tokens=2),
                    token_ids=[5, 6],
                    logprobs=[0, 0],
                    token_versions=[0, 0],
                )
            ]
        )
    with pytest.raises(ValueError, match="log-probs"):
        engine.add([Request("x", prompts[0], SamplingParams(max_tokens=4), token_ids=[5], logprobs=[])])
    with pytest.raises(ValueError, match="already running"):
        engine.add(
            [
                Request("x", prompts[0], SamplingParams(max_tokens=3)),
                Request("x", prompts[0], SamplingParams(max_tokens=3)),
            ]
        )
    assert engine.num_running == 0  # a refused call adds nothing


# --------------------------------------------------------------------------- transformers


@pytest.fixture
def hf(base_model, tok):
    return HFRequestEngine(HFRolloutEngine(copy.deepcopy(base_model), tok), chunk_tokens=4)


def test_hf_contract(hf, base_model, tok, prompts):
    check_contract(hf, base_model, tok, prompts)


def test_hf_bad_input(hf, prompts):
    check_bad_input(hf, prompts)
    with pytest.raises(ValueError, match="chunk_tokens"):
        HFRequestEngine(hf.engine, chunk_tokens=0)
    with pytest.raises(TypeError, match="engine"):
        as_request_engine(object())


def test_hf_stop_tokens_and_late_joiners(hf, base_model, tok, prompts):
    """A request added while others run joins at the next step; a stop token ends a request
    and is its last token; the batch is capped by max_batch_size, oldest first."""
    hf.max_batch_size = 2
    stop = list(range(3, 60))  # almost every character token stops
    hf.add([Request("s", prompts[0], SamplingParams(max_tokens=50, stop_token_ids=stop, seed=1))])
    hf.add(make(prompts, [12, 12]))
    first = hf.step()  # advances "s" and r0 (oldest two)
    assert hf.num_running >= 2
    done = first + run_all(hf)
    s = next(r for r in done if r.request_id == "s")
    assert s.finish_reason == "stop" and s.token_ids[-1] in stop
    assert all(len(r.token_ids) == 12 for r in done if r.request_id != "s")


def test_hf_weight_update_between_segments(base_model, tok, prompts):
    """A request stopped at version 0 and continued at version 1 records both versions; each
    token's log-prob is that of the policy that sampled it."""
    eng = HFRequestEngine(HFRolloutEngine(copy.deepcopy(base_model), tok), chunk_tokens=3)
    (r,) = make(prompts, [9])
    eng.add([r])
    eng.step()
    (r,) = eng.abort()
    new = tiny_qwen2(tok, seed=1, **MODEL_KW)
    eng.update_weights(new.state_dict().items(), version=1)
    eng.add([r])
    (r,) = run_all(eng)
    assert r.token_versions == [0, 0, 0] + [1] * 6 and r.resumed and r.start_version == 0
    old = pack_generations([r.to_generation()], tok.pad_token_id)
    with torch.no_grad():
        lp0 = TorchTrainEngine(base_model).logprobs(old.input_ids, old.attention_mask, old.response_mask)
        lp1 = TorchTrainEngine(new).logprobs(old.input_ids, old.attention_mask, old.response_mask)
    lp = torch.tensor(r.logprobs)
    assert torch.allclose(lp[:3], lp0[0, :3], atol=ATOL) and torch.allclose(lp[3:], lp1[0, 3:9], atol=ATOL)


# --------------------------------------------------------------------------- vLLM


@pytest.fixture(scope="module")
def vllm_engine(base_model, tok, tmp_path_factory):
    pytest.importorskip("vllm")
    from trainers.engines.vllm_rollout import VLLMRolloutEngine

    path = save_model(base_model, tok, tmp_path_factory.mktemp("tiny_qwen2_requests"))
    eng = VLLMRolloutEngine(path, dtype="float32", max_model_len=256, seed=0)
    yield as_request_engine(eng)
    eng.shutdown()


@pytest.mark.slow
def test_vllm_contract(vllm_engine, base_model, tok, prompts):
    assert isinstance(vllm_engine, VLLMRequestEngine)
    check_contract(vllm_engine, base_model, tok, prompts)
    check_bad_input(vllm_engine, prompts)


@pytest.mark.slow
def test_vllm_weight_update_between_segments(vllm_engine, base_model, tok, prompts):
    (r,) = make(prompts, [40])
    vllm_engine.add([r])
    while len(r.token_ids) < 3:
        vllm_engine.step()
    (r,) = vllm_engine.abort()
    k = len(r.token_ids)
    new = tiny_qwen2(tok, seed=1, **MODEL_KW)
    try:
        vllm_engine.update_weights(new.state_dict().items(), version=1)
        vllm_engine.add([r])
        (r,) = run_all(vllm_engine)
    finally:
        vllm_engine.update_weights(base_model.state_dict().items(), version=0)
    assert r.token_versions == [0] * k + [1] * (40 - k)
    b = pack_generations([r.to_generation()], tok.pad_token_id)
    with torch.no_grad():
        lp0 = TorchTrainEngine(base_model).logprobs(b.input_ids, b.attention_mask, b.response_mask)
        lp1 = TorchTrainEngine(new).logprobs(b.input_ids, b.attention_mask, b.response_mask)
    lp = torch.tensor(r.logprobs)
    assert torch.allclose(lp[:k], lp0[0, :k], atol=ATOL) and torch.allclose(lp[k:], lp1[0, k:40], atol=ATOL)
