"""The vLLM rollout engine on a tiny Qwen2, against the transformers / PyTorch engines.

Real vLLM (the ``vllm-cpu`` build on CPU, ``vllm`` on GPUs); skipped where vllm is not
installed. One engine is built per module (about 10 s on CPU) and shared by the tests; the
weight-update test restores the original weights when it ends.

Tolerance: vLLM's reported log-probs (``processed_logprobs``) and the trainer's recomputed
ones are both float32 computations over the same weights; they differ by about 5e-7 on CPU
(measured). ``ATOL = 1e-4`` leaves room for other CPU kernels and GPUs in float32.
"""

import copy
import dataclasses
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine core in this process
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
pytest.importorskip("transformers")
pytest.importorskip("vllm")

import torch

from rollkit.losses import aggregate, ppo_clip
from trainers.engines import (
    HFRolloutEngine,
    RolloutEngine,
    SamplingParams,
    TorchTrainEngine,
    pack_generations,
)
from trainers.engines.vllm_rollout import VLLMRolloutEngine
from trainers.models import char_tokenizer, save_model, tiny_qwen2

ATOL = 1e-4
TEXTS = ["What is 12+34? Answer: ", "7+5=", "Compute 3*9. "]
# head_dim 32 (64 / 2): vLLM's CPU attention supports head sizes 32, 64, 80, ... (not 16).
MODEL_KW = {"hidden_size": 64, "heads": 2, "kv_heads": 1}


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


@pytest.fixture(scope="module")
def base_model(tok):
    return tiny_qwen2(tok, seed=0, **MODEL_KW)


@pytest.fixture(scope="module")
def engine(base_model, tok, tmp_path_factory):
    path = save_model(base_model, tok, tmp_path_factory.mktemp("tiny_qwen2"))
    eng = VLLMRolloutEngine(path, dtype="float32", max_model_len=256, seed=0)
    yield eng
    eng.shutdown()


@pytest.fixture
def model(base_model):
    return copy.deepcopy(base_model)


@pytest.fixture(scope="module")
def prompts(tok):
    return [tok(t).input_ids for t in TEXTS]


def trainer_logprobs(model, gens, tok, temperature):
    b = pack_generations(gens, tok.pad_token_id)
    train = TorchTrainEngine(model)
    with torch.no_grad():
        lp = train.logprobs(b.input_ids, b.attention_mask, b.response_mask, temperature=temperature)
    return lp, b


def max_err(model, gens, tok, temperature):
    lp, b = trainer_logprobs(model, gens, tok, temperature)
    return float((lp - b.old_logprobs).abs()[b.response_mask].max())


def test_protocol(engine):
    assert isinstance(engine, RolloutEngine)
    assert engine.policy_version == 0
    assert engine.eos_token_ids == (2,) and engine.pad_token_id == 0


def test_torch_threads_stay_settable_after_an_in_process_engine(engine):
    """vLLM's in-process CPU worker swaps torch.set_num_threads for a no-op; the engine restores
    it, so the trainer's (and every later caller's) thread count is what it sets."""
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(1 if n != 1 else 2)
        assert torch.get_num_threads() == (1 if n != 1 else 2)
    finally:
        torch.set_num_threads(n)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_equal_trainer_logprobs(engine, model, tok, prompts, temperature):
    gens = engine.generate(prompts, SamplingParams(n=4, temperature=temperature, max_tokens=24, seed=0))
    assert sum(len(g.token_ids) for g in gens) > 40
    assert max_err(model, gens, tok, temperature) < ATOL


def test_top_k_logprobs_are_processed(engine, model, tok, prompts):
    """With top-k the reported log-probs are renormalised over the kept tokens (HF's rule)."""
    from trainers.engines import process_logits

    params = SamplingParams(n=2, temperature=0.7, top_k=5, max_tokens=12, seed=0)
    gens = engine.generate(prompts, params)
    b = pack_generations(gens, tok.pad_token_id)
    with torch.no_grad():
        from trainers.engines.base import position_ids_from_mask

        logits = model(
            input_ids=b.input_ids,
            attention_mask=b.attention_mask,
            position_ids=position_ids_from_mask(b.attention_mask),
        ).logits
    T = b.response_mask.shape[1]
    z = logits[:, -T - 1 : -1]
    lp = process_logits(z.reshape(-1, z.shape[-1]), 0.7, top_k=5).view(*z.shape)
    lp = lp.gather(-1, b.responses.unsqueeze(-1)).squeeze(-1)
    m = b.response_mask
    assert torch.isfinite(lp[m]).all()  # every sampled token is in the top 5
    assert float((lp - b.old_logprobs).abs()[m].max()) < ATOL
    full, _ = trainer_logprobs(model, gens, tok, 0.7)
    assert (b.old_logprobs[m] >= full[m] - ATOL).all()


def test_n_samples_ordering_and_seed(engine, prompts):
    params = SamplingParams(n=3, temperature=1.0, max_tokens=10, seed=7)
    gens = engine.generate(prompts, params)
    assert len(gens) == 3 * len(prompts)
    for k, g in enumerate(gens):
        assert g.prompt_index == k // 3 and g.prompt_ids == prompts[k // 3]
        assert len(g.logprobs) == len(g.token_ids) >= 1
        assert all(lp <= 0 for lp in g.logprobs)
        assert g.policy_version == 0
    again = engine.generate(prompts, params)
    assert [g.token_ids for g in again] == [g.token_ids for g in gens]
    flat = [lp for g in gens for lp in g.logprobs]
    assert [lp for g in again for lp in g.logprobs] == pytest.approx(flat, abs=1e-6)
    # the n samples of a prompt differ (different per-sample seeds)
    assert len({tuple(g.token_ids) for g in gens[:3]}) > 1


def test_identical_prompts_of_a_seeded_batch_draw_different_samples(engine, prompts):
    """Each prompt has a seed stream of its own (prompt_seed): two rows with the same context (the
    first turn of two episodes of one task) must not draw the same sample, in either path."""
    params = SamplingParams(n=1, temperature=1.0, max_tokens=16, ignore_eos=True, seed=5)
    same = [prompts[0]] * 4
    batch = engine.generate(same, params)
    assert len({tuple(g.token_ids) for g in batch}) > 1
    streamed = list(engine.generate_iter(same, params))
    assert _multiset(streamed) == _multiset(batch)
    # and the next call's seed (seed + 1) does not repeat this call's rows shifted by one
    nxt = engine.generate(same, dataclasses.replace(params, seed=6))
    assert [g.token_ids for g in nxt[:3]] != [g.token_ids for g in batch[1:]]


def test_stop_tokens_and_length(engine, prompts):
    base = SamplingParams(n=2, temperature=1.0, max_tokens=16, ignore_eos=True, seed=3)
    gens = engine.generate(prompts, base)
    assert all(len(g.token_ids) == 16 and g.finish_reason == "length" for g in gens)
    stop = gens[0].token_ids[4]  # a token the first sample generates at step 4
    stopped = engine.generate(prompts, SamplingParams(**{**base.__dict__, "stop_token_ids": (stop,)}))
    for g, s in zip(gens, stopped):
        if stop in g.token_ids:
            cut = g.token_ids.index(stop) + 1  # the stop token is kept, as the last token
            assert s.token_ids == g.token_ids[:cut] and s.finish_reason == "stop"
            assert s.logprobs == pytest.approx(g.logprobs[:cut], abs=1e-6)
        else:
            assert s.token_ids == g.token_ids and s.finish_reason == "length"
    assert len(stopped[0].token_ids) <= 5
    short = engine.generate(prompts, SamplingParams(n=1, max_tokens=3, ignore_eos=True, seed=0))
    assert all(len(g.token_ids) == 3 and g.finish_reason == "length" for g in short)


def test_eos_stops_unless_ignored(engine, prompts):
    eos = engine.eos_token_ids[0]
    gens = engine.generate(prompts, SamplingParams(n=8, temperature=1.5, max_tokens=40, seed=0))
    for g in gens:
        assert eos not in g.token_ids[:-1]
        assert (g.finish_reason == "stop") == (g.token_ids[-1] == eos)
    ignored = engine.generate(
        prompts, SamplingParams(n=8, temperature=1.5, max_tokens=40, ignore_eos=True, seed=0)
    )
    assert all(len(g.token_ids) == 40 and g.finish_reason == "length" for g in ignored)


def test_greedy_matches_hf_rollout(engine, model, tok, prompts):
    hf = HFRolloutEngine(model, tok)
    params = SamplingParams(n=2, temperature=0.0, max_tokens=24, ignore_eos=True)
    v, h = engine.generate(prompts, params), hf.generate(prompts, params)
    assert [g.token_ids for g in v] == [g.token_ids for g in h]
    assert v[0].token_ids == v[1].token_ids  # greedy n > 1: copies
    for a, b in zip(v, h):
        assert a.logprobs == pytest.approx(b.logprobs, abs=ATOL)  # log_softmax(logits)[token]


def rl_step(train, gens, tok, temperature):
    b = pack_generations(gens, tok.pad_token_id)
    adv = torch.linspace(-1.0, 1.0, len(gens))
    lp = train.logprobs(b.input_ids, b.attention_mask, b.response_mask, temperature=temperature)
    out = ppo_clip(lp, b.old_logprobs, adv, b.response_mask)
    train.backward(aggregate(out.loss, b.response_mask, "token-mean"))
    return train.step()


@pytest.mark.slow
def test_train_step_then_update_weights(engine, model, base_model, tok, prompts):
    params = SamplingParams(n=2, temperature=0.7, max_tokens=12, seed=5)
    train = TorchTrainEngine(model, lr=1e-2)
    try:
        gens = engine.generate(prompts, params)
        assert rl_step(train, gens, tok, 0.7)["skipped"] == 0
        train.model.eval()
        # before the update: vLLM still samples from the old weights
        assert max_err(train.model, engine.generate(prompts, params), tok, 0.7) > 1e-3
        engine.update_weights(train.export_weights(), version=1)
        assert engine.policy_version == 1
        new = engine.generate(prompts, params)
        assert all(g.policy_version == 1 for g in new)
        assert max_err(train.model, new, tok, 0.7) < ATOL
        assert max_err(base_model, new, tok, 0.7) > 1e-3  # and no longer the old weights'
    finally:
        engine.update_weights(base_model.state_dict().items(), version=0)
    assert max_err(base_model, engine.generate(prompts, params), tok, 0.7) < ATOL


def test_update_weights_is_strict(engine, base_model):
    sd = dict(base_model.state_dict())
    assert "lm_head.weight" in sd  # tied: accepted and dropped
    with pytest.raises(KeyError, match="unknown parameter 'nope'"):
        engine.update_weights([*sd.items(), ("nope", torch.zeros(1))], version=9)
    bad = {**sd, "model.norm.weight": torch.zeros(3)}
    with pytest.raises(ValueError, match=r"model\.norm\.weight"):
        engine.update_weights(bad.items(), version=9)
    del sd["model.norm.weight"]
    with pytest.raises(KeyError, match="missing parameters"):
        engine.update_weights(sd.items(), version=9)
    assert engine.policy_version == 0


def test_sleep_wake_protocol(engine, base_model, prompts):
    params = SamplingParams(n=1, temperature=0.0, max_tokens=8)
    ref = engine.generate(prompts, params)
    engine.sleep(1)
    assert engine.is_sleeping
    with pytest.raises(RuntimeError, match="asleep"):
        engine.generate(prompts, params)
    engine.wake()
    assert [g.token_ids for g in engine.generate(prompts, params)] == [g.token_ids for g in ref]
    engine.sleep(2)
    with pytest.raises(RuntimeError, match="asleep"):
        engine.update_weights(base_model.state_dict().items(), version=0)
    engine.wake()
    with pytest.raises(RuntimeError, match="update_weights"):
        engine.generate(prompts, params)
    engine.update_weights(base_model.state_dict().items(), version=0)
    assert [g.token_ids for g in engine.generate(prompts, params)] == [g.token_ids for g in ref]
    with pytest.raises(ValueError, match="level must be 1 or 2"):
        engine.sleep(3)


def test_bad_arguments(tok, tmp_path):
    with pytest.raises(ValueError, match="dtype"):
        VLLMRolloutEngine(tmp_path, dtype="int8")
    with pytest.raises(ValueError, match="logprobs_mode"):
        VLLMRolloutEngine(tmp_path, logprobs_mode="raw_logprobs")
    with pytest.raises(FileNotFoundError, match="model_path"):
        VLLMRolloutEngine(tmp_path)
    from vllm.platforms import current_platform

    if current_platform.is_cpu():  # tiny_qwen2's default head_dim 16 (64 / 4)
        path = save_model(tiny_qwen2(tok), tok, tmp_path / "head16")
        with pytest.raises(ValueError, match="head_dim 16"):
            VLLMRolloutEngine(path)


# --------------------------------------------------------------------------- streaming
# (before test_untied_lm_head_update: shutting its second in-process engine down tears down
# the process's vLLM parallel groups, which the shared engine needs)


def _multiset(gens):
    import collections

    return collections.Counter(
        (g.prompt_index, tuple(g.prompt_ids), tuple(g.token_ids), g.finish_reason) for g in gens
    )


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_generate_iter_equals_generate(engine, prompts, temperature):
    """Streaming (one vLLM request per sample, seed + j) gives generate()'s samples and log-probs."""
    params = SamplingParams(n=3, temperature=temperature, max_tokens=20, seed=11)
    batch = engine.generate(prompts, params)
    streamed = list(engine.generate_iter(prompts, params))
    assert len(streamed) == len(batch) == 3 * len(prompts)
    assert _multiset(streamed) == _multiset(batch)
    by_key = {(g.prompt_index, tuple(g.token_ids)): g.logprobs for g in batch}
    for g in streamed:
        assert g.logprobs == pytest.approx(by_key[(g.prompt_index, tuple(g.token_ids))], abs=1e-6)
        assert g.policy_version == engine.policy_version


def test_generate_iter_yields_before_the_batch_is_done(engine, prompts):
    """The first sample arrives while vLLM still has unfinished requests; closing early aborts them."""
    from trainers.engines.base import iter_generations

    # a stop token cuts some samples short, the others run to max_tokens
    ref = engine.generate(
        prompts, SamplingParams(n=4, temperature=1.0, max_tokens=24, ignore_eos=True, seed=2)
    )
    stop = ref[0].token_ids[2]
    params = SamplingParams(
        n=4, temperature=1.0, max_tokens=24, ignore_eos=True, seed=2, stop_token_ids=(stop,)
    )
    lengths, unfinished_at = [], []
    for g in iter_generations(engine, prompts, params):
        lengths.append(len(g.token_ids))
        unfinished_at.append(engine.llm.llm_engine.get_num_unfinished_requests())
    assert min(lengths) <= 3 < max(lengths) == 24
    assert unfinished_at[0] > 0 and unfinished_at[-1] == 0
    assert lengths[0] == min(lengths)  # the shortest sample came out first
    # abandon a stream after its first sample: the rest are aborted, the engine stays usable
    it = engine.generate_iter(prompts, params)
    next(it)
    it.close()
    assert not engine.llm.llm_engine.has_unfinished_requests()
    assert _multiset(engine.generate(prompts, params)) == _multiset(
        list(engine.generate_iter(prompts, params))
    )


@pytest.mark.slow
def test_untied_lm_head_update(tok, prompts, tmp_path):
    """A separate ``lm_head`` is sent and reloaded like any other weight (a second engine)."""
    kw = {**MODEL_KW, "tie_embeddings": False}
    path = save_model(tiny_qwen2(tok, seed=0, **kw), tok, tmp_path / "untied")
    eng = VLLMRolloutEngine(path, max_model_len=256)
    try:
        new = tiny_qwen2(tok, seed=1, **kw)
        sd = dict(new.state_dict())
        with pytest.raises(KeyError, match=r"lm_head\.weight"):
            eng.update_weights([(k, v) for k, v in sd.items() if k != "lm_head.weight"], version=1)
        eng.update_weights(sd.items(), version=1)
        gens = eng.generate(prompts, SamplingParams(n=2, temperature=0.7, max_tokens=12, seed=0))
        assert max_err(new, gens, tok, 0.7) < ATOL
    finally:
        eng.shutdown()
