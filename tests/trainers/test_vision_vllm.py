"""Vision-language rollout on real vLLM (in process): the tiny Idefics3 / SmolVLM, whose vLLM
model needs no torchvision (Qwen2-VL's does, and the CPU machines have none)."""

from __future__ import annotations

import copy
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
pytest.importorskip("vllm")
pytest.importorskip("PIL.Image")

import torch

from trainers.config import load_config, validate
from trainers.data import Prompt, encode_prompt
from trainers.domains import shapes_task
from trainers.engines.base import SamplingParams, pack_generations
from trainers.engines.torch_train import TorchTrainEngine
from trainers.engines.vllm_rollout import VLLMRolloutEngine
from trainers.loops import SyncTrainer
from trainers.models import save_model
from trainers.vision import tiny_idefics3, vision_tokenizer


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tok = vision_tokenizer("idefics3")
    model, _ = tiny_idefics3(tok, seed=0)
    path = save_model(model, tok, tmp_path_factory.mktemp("idefics3"))
    engine = VLLMRolloutEngine(str(path), dtype="float32", max_model_len=512, seed=0)
    yield model, tok, engine
    engine.shutdown()


def _diff(train, batch):
    with torch.no_grad():
        lp = train.logprobs(batch.input_ids, batch.attention_mask, batch.response_mask, **batch.model_inputs())
    return float(((lp - batch.old_logprobs).abs() * batch.response_mask).max())


def test_vllm_logprobs_equal_the_trainers_before_and_after_a_weight_sync(setup):
    """One image, two images and none in one call: vLLM's processed log-probs equal the training
    forward's (float32), so an on-policy PPO ratio is 1; after a training step and a weight sync
    (which resets vLLM's image-feature cache) they still do, on the same images."""
    model, tok, engine = setup
    train, _ = shapes_task(train_size=2, eval_size=0, seed=3)
    prompts = [train[0], Prompt("<image> or <image>?", "1", images=train[0].images + train[1].images), Prompt("Hi", "2")]
    ids = [encode_prompt(tok, p) for p in prompts]
    gens = engine.generate(ids, SamplingParams(n=2, max_tokens=6, temperature=1.0, seed=0))
    batch = pack_generations(gens, tok.pad_token_id)
    assert batch.images is not None and batch.images[-1] is None
    assert [list(g.prompt_ids) for g in gens[::2]] == [list(i) for i in ids]  # the expanded ids come back
    te = TorchTrainEngine(copy.deepcopy(model), lr=1e-2)
    assert _diff(te, batch) < 1e-5
    lp = te.logprobs(batch.input_ids, batch.attention_mask, batch.response_mask, **batch.model_inputs())
    te.backward(-(lp * batch.response_mask).sum() / batch.response_mask.sum())
    te.step()
    assert _diff(te, batch) > 1e-3  # the step moved the policy
    engine.update_weights(te.export_weights(), 1)
    gens = engine.generate(ids, SamplingParams(n=2, max_tokens=6, temperature=1.0, seed=1))
    assert _diff(te, pack_generations(gens, tok.pad_token_id)) < 1e-5


def test_trainer_step_on_vllm(tmp_path):
    cfg = load_config([
        "--model", "tiny_idefics3", "data.task=shapes", "data.eval_size=4", "reward.verifier=exact_match",
        "rollout.engine=vllm", "rollout.prompts_per_step=2", "rollout.n=4", "rollout.max_tokens=3",
        "eval.max_tokens=3", "eval.before=false", "eval.every=0", "train.steps=2", "train.lr=1e-3",
        "algorithm.entropy_coef=0.01", "logging.progress=false", f"logging.dir={tmp_path}",
    ])  # fmt: skip
    validate(cfg)
    tr = SyncTrainer(cfg)
    try:
        out = tr.fit()
        assert out["steps"] == 2 and tr.rollout.policy_version == 2
        rows = [r for r in out["history"] if "optim/grad_norm" in r]
        assert all(r["optim/grad_norm"] > 0 for r in rows)
        assert (tmp_path / "model" / "processor_config.json").is_file()
    finally:
        tr.close()
