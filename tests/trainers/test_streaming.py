"""Streaming generation (HFRolloutEngine.generate_iter, iter_generations) and scoring samples
as they finish (rollout_and_score), on the tiny Qwen2.

The streamed samples are generate()'s samples for the same seed (as a multiset), and a sample
comes out at the decoding step it finishes: the tests count the model's forward passes (a
forward hook) at the moment each sample arrives.
"""

import collections
import copy
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers")

from trainers.data import Prompt
from trainers.engines import HFRolloutEngine, SamplingParams
from trainers.engines.base import iter_generations
from trainers.models import char_tokenizer, tiny_qwen2
from trainers.rewards import RewardPool, exact_match_reward, rollout_and_score

TEXTS = ["12+34=", "7+5=", "Compute 3*9. "]


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    return tiny_qwen2(tok, seed=0)


@pytest.fixture(scope="module")
def prompts(tok):
    return [tok(t).input_ids for t in TEXTS]


def multiset(gens):
    return collections.Counter(
        (
            g.prompt_index,
            tuple(g.prompt_ids),
            tuple(g.token_ids),
            tuple(g.logprobs),
            g.finish_reason,
            g.policy_version,
        )
        for g in gens
    )


def stop_params(engine, prompts, **kw):
    """Params whose stop token (one the first sample emits at step 2) cuts some samples short."""
    base = SamplingParams(n=3, temperature=1.0, max_tokens=20, ignore_eos=True, seed=4, **kw)
    first = engine.generate(prompts, base)[0]
    return SamplingParams(**{**base.__dict__, "stop_token_ids": (first.token_ids[2],)})


@pytest.mark.parametrize(("max_batch_size", "temperature"), [(None, 1.0), (4, 0.7), (None, 0.0)])
def test_generate_iter_equals_generate(model, tok, prompts, max_batch_size, temperature):
    engine = HFRolloutEngine(copy.deepcopy(model), tok, max_batch_size=max_batch_size)
    params = SamplingParams(n=3, temperature=temperature, max_tokens=12, seed=3)
    batch = engine.generate(prompts, params)
    streamed = list(engine.generate_iter(prompts, params))
    assert len(streamed) == len(batch) == 9
    assert multiset(streamed) == multiset(batch)
    # with a stop token some samples finish early: still the same samples, in another order
    params = stop_params(engine, prompts)
    batch, streamed = engine.generate(prompts, params), list(engine.generate_iter(prompts, params))
    assert multiset(streamed) == multiset(batch)
    assert {g.finish_reason for g in batch} == {"stop", "length"}
    assert [g.prompt_index for g in batch] == [k // 3 for k in range(9)]  # generate's order is unchanged


def count_forwards(engine):
    calls = [0]
    handle = engine.model.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls, handle


def test_samples_arrive_at_the_step_they_finish(model, tok, prompts):
    engine = HFRolloutEngine(copy.deepcopy(model), tok)
    params = stop_params(engine, prompts)
    calls, handle = count_forwards(engine)
    try:
        arrivals = [
            (calls[0], len(g.token_ids), g.finish_reason) for g in engine.generate_iter(prompts, params)
        ]
        total = calls[0]
    finally:
        handle.remove()
    # one prefill and one forward per further step: a sample of L tokens that stopped is
    # yielded after exactly L forwards, while the rest of the batch is still decoding
    assert total == params.max_tokens
    for forwards, length, reason in arrivals:
        assert forwards == (length if reason == "stop" else total)
    assert arrivals[0][0] < total and arrivals[0][2] == "stop"
    assert [a[0] for a in arrivals] == sorted(a[0] for a in arrivals)


def test_chunks_stream_before_later_chunks_start(model, tok, prompts):
    """With max_batch_size smaller than the batch, the first chunk's samples all arrive before
    the second chunk's prefill."""
    engine = HFRolloutEngine(copy.deepcopy(model), tok, max_batch_size=3)
    params = SamplingParams(n=3, temperature=1.0, max_tokens=8, ignore_eos=True, seed=0)
    calls, handle = count_forwards(engine)
    try:
        arrivals = [calls[0] for _ in engine.generate_iter(prompts, params)]
    finally:
        handle.remove()
    assert arrivals == [8] * 3 + [16] * 3 + [24] * 3  # 8 forwards per chunk of 3 rows


def test_iter_generations_with_and_without_generate_iter(model, tok, prompts):
    engine = HFRolloutEngine(copy.deepcopy(model), tok)

    class GenerateOnly:  # the real engine, seen through generate() only
        def generate(self, prompts, params):
            return engine.generate(prompts, params)

    params = stop_params(engine, prompts)
    ref = engine.generate(prompts, params)
    streamed = list(iter_generations(engine, prompts, params))
    assert multiset(streamed) == multiset(ref)
    assert list(iter_generations(GenerateOnly(), prompts, params)) == ref  # fallback: generate's order


def test_rollout_and_score(model, tok, prompts):
    engine = HFRolloutEngine(copy.deepcopy(model), tok)
    params = stop_params(engine, prompts)
    answers = [Prompt(t, a) for t, a in zip(TEXTS, ["46", "12", "27"])]
    decode = tok.decode
    with RewardPool(lambda c, p: float(len(c)) + exact_match_reward(c, p.answer), backend="inline") as pool:
        gens, rewards = rollout_and_score(engine, prompts, params, answers, pool, decode)
        assert pool.metrics()["scored"] == 9
    assert [g.prompt_index for g in gens] == [k // 3 for k in range(9)]  # grouped by prompt
    assert multiset(gens) == multiset(engine.generate(prompts, params))
    for g, r in zip(gens, rewards):
        text = decode(g.token_ids)
        assert r == float(len(text)) + exact_match_reward(text, answers[g.prompt_index].answer)
    with pytest.raises(ValueError, match="prompts"):
        rollout_and_score(engine, prompts, params, answers[:2], RewardPool("exact_match"), decode)
