"""The seed streams of trainers.engines.server.GenerationServer: the lock-step path (generate) counts
its own engine calls, so its samples depend only on how many lock-step calls came before, never on
how many asynchronous (submit) batches ran in between -- a lock-step collection after an
environment-level asynchronous one (the agentic trainer's greedy evaluation) is reproducible.
Real tiny Qwen2, the transformers rollout engine and real environments in worker processes."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from trainers.engines import HFRolloutEngine, SamplingParams
from trainers.engines.server import ASYNC_SEED_OFFSET, GenerationServer
from trainers.envs.chaos import CounterEnv
from trainers.envs.episodes import EpisodeRunner
from trainers.envs.turns import TurnEncoder
from trainers.models import char_tokenizer, tiny_qwen2

PARAMS = SamplingParams(max_tokens=6, seed=0)


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


@pytest.fixture(scope="module")
def engine(tok):
    return HFRolloutEngine(tiny_qwen2(tok), tok)


def samples(gens) -> list[list[int]]:
    return [list(g.token_ids) for g in gens]


def test_lockstep_seeds_ignore_asynchronous_calls(engine, tok):
    contexts = [tok("abc").input_ids, tok("hello").input_ids]
    runs = []
    for n_async in (0, 1, 3):
        server = GenerationServer(engine)
        try:
            for k in range(n_async):  # asynchronous batches in between the lock-step calls
                server.submit(tok(f"x{k}").input_ids, PARAMS).result(timeout=120)
            first = server.generate(contexts, PARAMS)
            server.submit(tok("y").input_ids, PARAMS).result(timeout=120)
            second = server.generate(contexts, PARAMS)
            assert server.stats["calls"] == n_async + 3
            runs.append((samples(first), samples(second)))
        finally:
            server.close()
    assert runs[0] == runs[1] == runs[2]
    # the i-th lock-step call uses params.seed + i: the same as the engine called directly
    first, second = runs[0]
    assert first == samples(engine.generate(contexts, PARAMS))
    assert second == samples(engine.generate(contexts, SamplingParams(max_tokens=6, seed=1)))
    assert first != second  # a fresh seed per call (and so the check above can fail)


def test_asynchronous_batches_use_their_own_seed_range(engine, tok):
    server = GenerationServer(engine)
    try:
        context = tok("abc").input_ids
        g = server.submit(context, PARAMS).result(timeout=120)
    finally:
        server.close()
    direct = engine.generate([context], SamplingParams(max_tokens=6, seed=ASYNC_SEED_OFFSET))[0]
    assert list(g.token_ids) == list(direct.token_ids)


@pytest.mark.slow
def test_lockstep_collect_after_async_collects_is_reproducible(engine, tok):
    """A lock-step collect after one asynchronous collect gives the same samples as after two
    (which made more, and a timing-dependent number of, engine calls)."""
    lockstep = []
    for async_seeds in ([[20, 21]], [[20, 21], [30, 31, 32]]):
        runner = EpisodeRunner(engine, TurnEncoder(tok), CounterEnv, {"max_turns": 3}, deadline_s=30.0)
        try:
            for seeds in async_seeds:
                runner.collect(seeds, PARAMS, group_size=2, mode="async")
            async_calls = runner.server.stats["calls"]
            res = runner.collect([3, 4], PARAMS, group_size=2, mode="lockstep")
            assert res.metrics["rollout/engine_calls"] == 3  # one call per turn for the whole batch
            lockstep.append((async_calls, [[list(t.action_ids) for t in e.turns] for e in res.episodes]))
        finally:
            runner.close()
    (calls_1, eps_1), (calls_2, eps_2) = lockstep
    assert calls_2 > calls_1  # the second run's lock-step calls came after more async calls
    assert len(eps_1) == 4 and all(len(turns) == 3 for turns in eps_1)
    assert eps_1 == eps_2
