"""The rollout's sampling truncation replayed on the trainer (``rollout.top_k`` / ``top_p``).

The rollout engines report the log-probs of the *processed* distribution (temperature, top-k,
top-p, renormalised over the kept tokens). The trainer replays the same truncation on its own
logits, so that the on-policy PPO ratio is 1; without the replay it is the kept mass ``Z < 1``
and the low clip fires. Real engines: the transformers rollout and vLLM's CPU build, both in
float32, against the torch training engine; and one PPO update through ``ppo_update``.
"""

import copy
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
pytest.importorskip("transformers")

import torch

from trainers.engines import HFRolloutEngine, SamplingParams, TorchTrainEngine, pack_generations
from trainers.engines.step import StepBatch
from trainers.learner import UpdateSpec, ppo_update
from trainers.models import char_tokenizer, save_model, tiny_qwen2

TEXTS = ["What is 12+34? Answer: ", "7+5=", "Compute 3*9. "]
PARAMS = dict(temperature=0.9, top_k=20, top_p=0.8)
MODEL_KW = {"hidden_size": 64, "heads": 2, "kv_heads": 1}  # vLLM's CPU attention: head size 32


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    return tiny_qwen2(tok, seed=0, **MODEL_KW)


def _gap(train, batch, **sampling):
    """Trainer log-probs minus the rollout's, over the response tokens."""
    with torch.no_grad():
        lp = train.logprobs(batch.input_ids, batch.attention_mask, batch.response_mask, **sampling)
    return (lp - batch.old_logprobs)[batch.response_mask]


def _check(train, batch, atol):
    gap = _gap(train, batch, **PARAMS)
    assert gap.abs().max() < atol, float(gap.abs().max())
    # without the replay the trainer's log-probs are those of the full tempered softmax:
    # log Z (< 0) above the rollout's wherever top-k / top-p removed mass
    plain = _gap(train, batch, temperature=PARAMS["temperature"])
    assert plain.max() < atol and plain.mean() < -0.05, (float(plain.max()), float(plain.mean()))


def test_hf_rollout_replayed_on_the_trainer(tok, model):
    gens = HFRolloutEngine(copy.deepcopy(model), tok).generate(
        [tok(t).input_ids for t in TEXTS], SamplingParams(n=8, max_tokens=12, seed=3, **PARAMS)
    )
    batch = pack_generations(gens, tok.pad_token_id)
    _check(TorchTrainEngine(copy.deepcopy(model)), batch, atol=1e-5)


def test_vllm_rollout_replayed_on_the_trainer(tok, model, tmp_path):
    pytest.importorskip("vllm")
    from trainers.engines.vllm_rollout import VLLMRolloutEngine

    eng = VLLMRolloutEngine(
        save_model(model, tok, tmp_path / "m"), dtype="float32", max_model_len=256, seed=0
    )
    try:
        gens = eng.generate(
            [tok(t).input_ids for t in TEXTS], SamplingParams(n=8, max_tokens=12, seed=3, **PARAMS)
        )
    finally:
        eng.shutdown()
    batch = pack_generations(gens, tok.pad_token_id)
    _check(TorchTrainEngine(copy.deepcopy(model)), batch, atol=1e-4)  # both float32 (test_vllm_engine)


def test_on_policy_ppo_ratio_is_one(tok, model):
    """One on-policy PPO update: ratio 1 and no clipping with the replay; without it the low
    clip fires on the tokens whose kept mass is below 1 - clip_low."""
    gens = HFRolloutEngine(copy.deepcopy(model), tok).generate(
        [tok(t).input_ids for t in TEXTS], SamplingParams(n=8, max_tokens=12, seed=4, **PARAMS)
    )
    batch = pack_generations(gens, tok.pad_token_id)
    adv = torch.linspace(-1, 1, len(gens))[:, None] * batch.response_mask
    replay = UpdateSpec(temperature=0.9, top_k=20, top_p=0.8, mismatch=True)
    m = ppo_update(TorchTrainEngine(copy.deepcopy(model)), StepBatch.from_packed(batch, advantages=adv), replay).metrics()
    assert abs(m["loss/ratio_mean"] - 1) < 1e-5 and m["loss/clip_frac"] == 0
    assert m["mismatch/k3"] < 1e-9 and m["mismatch/ess_frac"] > 1 - 1e-6
    plain = ppo_update(
        TorchTrainEngine(copy.deepcopy(model)), StepBatch.from_packed(batch, advantages=adv), UpdateSpec(temperature=0.9)
    ).metrics()
    assert plain["loss/ratio_mean"] < 0.95 and plain["loss/clip_frac"] > 0
