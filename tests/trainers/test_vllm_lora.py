"""vLLM's own LoRA path: a LoRA policy's adapter alone sent to the vLLM rollout engine.

Real vLLM (the ``vllm-cpu`` build on CPU) and real peft on a tiny Qwen2; skipped where vllm is
not installed. The engine is built with ``lora=adapter_config(...)`` (vLLM's LoRA support on),
receives :func:`trainers.engines.lora.adapter_weights` and serves them as a new adapter per
version; its processed log-probs must equal the trainer's (the peft model's) to the float32
tolerance of test_vllm_engine.py (measured: 4.8e-7).
"""

import copy
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("vllm")

import torch

from trainers.config import load_config
from trainers.engines import SamplingParams, TorchTrainEngine, pack_generations
from trainers.engines.lora import LORA_TARGETS, adapter_config, adapter_weights, apply_lora, merged_weights
from trainers.engines.requests import Request, VLLMRequestEngine
from trainers.engines.vllm_rollout import VLLMRolloutEngine
from trainers.models import char_tokenizer, save_model, tiny_qwen2

ATOL = 1e-4
RANK = 4
MODEL_KW = {"hidden_size": 64, "heads": 2, "kv_heads": 1}  # head_dim 32: vLLM CPU attention


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


@pytest.fixture(scope="module")
def base_model(tok):
    return tiny_qwen2(tok, seed=0, **MODEL_KW)


@pytest.fixture(scope="module")
def engine(base_model, tok, tmp_path_factory):
    path = save_model(base_model, tok, tmp_path_factory.mktemp("tiny_qwen2_lora"))
    eng = VLLMRolloutEngine(
        path, dtype="float32", max_model_len=256, seed=0, lora=adapter_config(RANK, 8.0, LORA_TARGETS)
    )
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def prompts(tok):
    return [tok(t).input_ids for t in ["7+5=", "What is 12+34? ", "Compute 3*9. "]]


def trained_adapter(base_model, seed):
    """A peft policy whose adapter is not the identity (lora_B drawn, as after training)."""
    policy = apply_lora(copy.deepcopy(base_model), rank=RANK, alpha=8.0, seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return policy


def max_err(policy, gens, tok, temperature=1.0):
    b = pack_generations(gens, tok.pad_token_id)
    with torch.no_grad():
        lp = TorchTrainEngine(policy).logprobs(
            b.input_ids, b.attention_mask, b.response_mask, temperature=temperature
        )
    return float((lp - b.old_logprobs).abs()[b.response_mask].max())


def test_adapter_updates_serve_the_trainers_logprobs(engine, base_model, tok, prompts):
    params = SamplingParams(n=4, temperature=1.0, max_tokens=16, seed=0)
    assert engine.lora_request is None
    first = trained_adapter(base_model, seed=1)
    engine.update_weights(adapter_weights(first), version=1)
    req1 = engine.lora_request
    assert engine.policy_version == 1 and req1 is not None and os.path.isdir(req1.lora_path)
    gens = engine.generate(prompts, params)
    assert sum(len(g.token_ids) for g in gens) > 30
    assert max_err(first, gens, tok) < ATOL
    assert max_err(base_model, gens, tok) > 1e-2  # the adapter changes the served distribution

    second = trained_adapter(base_model, seed=2)
    engine.update_weights(adapter_weights(second), version=2)
    assert engine.lora_request.lora_int_id != req1.lora_int_id
    assert not os.path.exists(req1.lora_path)  # the previous adapter's files are removed
    gens = engine.generate(prompts, params)
    assert all(g.policy_version == 2 for g in gens)
    assert max_err(second, gens, tok) < ATOL
    streamed = list(engine.generate_iter(prompts, params))  # the sync trainer's streaming path
    assert len(streamed) == len(gens) and max_err(second, streamed, tok) < ATOL

    # the request-level engine (async, tail batching) serves the current adapter too
    req = VLLMRequestEngine(engine)
    req.add([Request(f"r{i}", p, SamplingParams(max_tokens=12)) for i, p in enumerate(prompts)])
    done = []
    while req.num_running:
        done.extend(req.step())
    b_lp = [g for g in done if g.token_ids]
    assert b_lp
    for r in b_lp:
        ids = torch.tensor([list(r.prompt_ids) + list(r.token_ids)])
        mask = torch.zeros_like(ids, dtype=torch.bool)
        mask[0, len(r.prompt_ids) :] = True
        with torch.no_grad():
            lp = TorchTrainEngine(second).logprobs(
                ids, torch.ones_like(ids), mask[:, len(r.prompt_ids) :], temperature=1.0
            )
        assert float((lp[0] - torch.tensor(r.logprobs)).abs().max()) < ATOL

    # full weights afterwards replace base + adapter (merged weights: same distribution)
    engine.update_weights(merged_weights(second), version=3)
    assert engine.lora_request is None
    gens = engine.generate(prompts, params)
    assert max_err(second, gens, tok) < ATOL
    engine.update_weights(base_model.named_parameters(), version=4)  # restore the base


def test_bad_adapter_updates_name_the_tensor(engine, base_model, tok):
    policy = trained_adapter(base_model, seed=3)
    named = list(adapter_weights(policy))
    version = engine.policy_version
    with pytest.raises(ValueError, match="has shape"):
        engine.update_weights([(named[0][0], torch.zeros(RANK + 1, 64)), *named[1:]], version=9)
    with pytest.raises(KeyError, match="mixed with LoRA adapter tensors"):
        engine.update_weights([*named, ("model.norm.weight", torch.ones(64))], version=9)
    with pytest.raises(KeyError, match="does not have"):
        engine.update_weights([("base_model.model.model.nope.lora_A.weight", named[0][1])], version=9)
    assert engine.policy_version == version  # nothing was applied
    with pytest.raises(ValueError, match="level=2 discards the base weights"):
        engine.sleep(level=2)


def test_engine_without_lora_refuses_adapter_tensors(base_model, tok, tmp_path):
    eng = VLLMRolloutEngine(save_model(base_model, tok, tmp_path / "m"), dtype="float32", max_model_len=128)
    try:
        with pytest.raises(ValueError, match="built without lora="):
            eng.update_weights(adapter_weights(trained_adapter(base_model, seed=4)), version=1)
    finally:
        eng.shutdown()


def test_sync_trainer_serves_the_adapter_through_vllm(tmp_path):
    """rollout.lora_weights=adapter through the config: the learner exports only the adapter,
    the vLLM rollout serves it (a LoRA request per version) and its log-probs are the trainer's:
    the on-policy mismatch metrics are at float tolerance after two updates."""
    cfg = load_config(
        ["--model", "tiny", "model.tiny_heads=2", "model.tiny_kv_heads=1", "train.lora_rank=8",
         "rollout.lora_weights=adapter", "rollout.engine=vllm", "rollout.max_model_len=128",
         "train.lr=1e-2", "algorithm.entropy_coef=0.1", "data.digits=1", "data.eval_size=8", "eval.before=false",
         "rollout.prompts_per_step=2", "rollout.n=4", "rollout.max_tokens=4", "train.steps=3",
         "logging.progress=false", f"logging.dir={tmp_path}"]
    )  # fmt: skip
    from trainers.loops import SyncTrainer

    with SyncTrainer(cfg) as tr:
        out = tr.fit()
        exported = dict(tr.learner.export_weights())
        assert exported and all(".lora_A." in k or ".lora_B." in k for k in exported)
        # the adapter has moved (lora_B starts at 0): the served policy is not the base
        assert max(float(v.abs().max()) for k, v in exported.items() if ".lora_B." in k) > 1e-3
        assert tr.rollout.lora_request is not None and tr.rollout.policy_version == 3
    diffs = [r["mismatch/logp_abs_diff_max"] for r in out["history"] if "mismatch/logp_abs_diff_max" in r]
    assert len(diffs) == 3 and max(diffs) < ATOL, diffs  # steps 2-3 sampled under adapters 1-2
