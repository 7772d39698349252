"""LLM-as-a-judge rewards (trainers.rewards.judge): the strict score parser on well-formed and
malformed judgments (examples and hypothesis properties), and the judge's plumbing through a
real HFRolloutEngine over the tiny Qwen2 (whose judgments are random characters, so the tests
assert the contract: every reward is a normalised score or ``invalid_score``, the counts add
up, the judge prompt carries the fields, one ``generate`` call per batch)."""

import os
import pickle

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers")

from trainers.config import load_config
from trainers.data import Prompt
from trainers.engines import HFRolloutEngine
from trainers.models import char_tokenizer, tiny_qwen2
from trainers.rewards import RewardPool, get_verifier
from trainers.rewards.judge import (
    DEFAULT_TEMPLATE,
    INVALID_REASONS,
    JudgeReward,
    Judgment,
    normalize_score,
    parse_judgment,
)

Q = Prompt("12+34=", "46", "addition")

# --------------------------------------------------------------------------- the parser

WELL_FORMED = [
    ("Score: 7", 7.0),
    ("score:7", 7.0),
    ("SCORE :  10", 10.0),
    ("Score:\t0", 0.0),
    ("The response matches the reference answer.\nScore: 8", 8.0),
    ("It is wrong (45 instead of 46).\n\nScore: 1\n", 1.0),
    ("  Score: 7.5  \n\n", 7.5),
    ("Score: +3", 3.0),
    ("Score: 007", 7.0),
    ("Score: -0", 0.0),
    ("Final verdict - Score: 9", 9.0),  # text before the marker on its line is allowed
    ("The underscore: is not a marker.\nScore: 4", 4.0),  # 'underscore:' is not the word 'score'
]


@pytest.mark.parametrize(("text", "score"), WELL_FORMED)
def test_parser_accepts_well_formed_judgments(text, score):
    j = parse_judgment(text)
    assert j == Judgment(score, "ok") and j.ok
    assert str(j.score) != "-0.0"


MALFORMED = [
    ("", "empty"),
    ("  \n\t ", "empty"),
    ("Good answer, 10 out of 10.", "no_score"),
    ("Scores: 5", "no_score"),
    ("Rating: [[7]]", "no_score"),
    ("Score: 7\nScore: 8", "multiple_scores"),
    ("My first score: 3. Final Score: 4", "multiple_scores"),
    ("Score: seven", "bad_number"),
    ("Score: [[7]]", "bad_number"),
    ("Score:\n7", "bad_number"),  # the number must be on the marker's line
    ("Score: .5", "bad_number"),
    ("Score:", "bad_number"),
    ("Score: 7.", "trailing_text"),
    ("Score: 7/10", "trailing_text"),
    ("Score: 7 points", "trailing_text"),
    ("Score: 7\nThe response is close.", "trailing_text"),
    ("Score: 7.5.3", "trailing_text"),
    ("Score: 1e3", "trailing_text"),
    ("Score: 11", "out_of_range"),
    ("Score: -1", "out_of_range"),
    ("Score: 10.01", "out_of_range"),
    ("Score: " + "9" * 400, "out_of_range"),  # float('99...9') is inf
    ("Score: \u0667", "bad_number"),  # an Arabic-Indic 7: ASCII digits only
    ("\u017fcore: 7", "no_score"),  # a long s does not case-fold into the marker
]


@pytest.mark.parametrize(("text", "reason"), MALFORMED)
def test_parser_rejects_malformed_judgments(text, reason):
    assert parse_judgment(text) == Judgment(None, reason)
    assert reason in INVALID_REASONS


def test_parser_custom_range_and_bad_arguments():
    assert parse_judgment("Score: 1", min_score=1, max_score=5) == Judgment(1.0, "ok")
    assert parse_judgment("Score: 0", min_score=1, max_score=5).reason == "out_of_range"
    assert parse_judgment("Score: 0.25", min_score=0, max_score=1) == Judgment(0.25, "ok")
    assert normalize_score(3, 1, 5) == 0.5 and normalize_score(10, 0, 10) == 1.0
    with pytest.raises(ValueError, match="min_score must be < max_score"):
        parse_judgment("Score: 1", min_score=5, max_score=5)
    with pytest.raises(ValueError, match="max_score must be a finite number"):
        parse_judgment("Score: 1", max_score=float("inf"))
    with pytest.raises(TypeError, match="text must be a str"):
        parse_judgment(None)


_NO_MARKER = st.text(st.characters(codec="ascii"), max_size=80).filter(
    lambda t: parse_judgment(t).reason in ("empty", "no_score")
)


@settings(max_examples=300, deadline=None)
@given(
    lo=st.integers(-5, 5),
    width=st.integers(1, 20),
    data=st.data(),
    reasoning=_NO_MARKER,
    marker=st.sampled_from(["Score:", "score:", "SCORE:", "Score :", "score  :"]),
    spaces=st.sampled_from(["", " ", "  ", "\t"]),
    tail=st.sampled_from(["", "\n", "  \n\n", " "]),
)
def test_property_in_range_integers_parse_back(lo, width, data, reasoning, marker, spaces, tail):
    """Any in-range integer, written after a marker (with any reasoning before it that has no
    marker of its own), parses back exactly and normalises into [0, 1]."""
    hi = lo + width
    n = data.draw(st.integers(lo, hi))
    sep = "\n" if reasoning else ""
    j = parse_judgment(f"{reasoning}{sep}{marker}{spaces}{n}{tail}", min_score=lo, max_score=hi)
    assert j == Judgment(float(n), "ok")
    assert 0.0 <= normalize_score(j.score, lo, hi) <= 1.0


@settings(max_examples=500, deadline=None)
@given(
    text=st.one_of(
        st.text(max_size=120),
        st.text(st.sampled_from(list("Score: 0123456789.+-\n\t[]/xe")), max_size=40),
        st.builds(lambda a, b: f"{a}Score: {b}", st.text(max_size=20), st.text(max_size=20)),
    ),
    lo=st.integers(-3, 3),
    width=st.integers(1, 10),
)
def test_property_junk_never_scores_out_of_range(text, lo, width):
    hi = lo + width
    j = parse_judgment(text, min_score=lo, max_score=hi)
    assert (j.reason == "ok") == (j.score is not None)
    assert j.reason == "ok" or j.reason in INVALID_REASONS
    if j.ok:
        assert lo <= j.score <= hi and 0.0 <= normalize_score(j.score, lo, hi) <= 1.0


@settings(max_examples=200, deadline=None)
@given(n=st.integers(0, 10), junk=st.text(min_size=1, max_size=20).filter(lambda t: t.strip()))
def test_property_any_trailing_text_is_rejected(n, junk):
    j = parse_judgment(f"Score: {n}{junk}")
    # junk may extend the number ("Score: 1" + "0") or hold another marker; else it is trailing text
    assert j.reason in ("ok", "trailing_text", "multiple_scores", "out_of_range")
    if j.ok:
        assert float(f"{n}{junk.strip()}") == j.score


# --------------------------------------------------------------------------- the judge


class CountingEngine(HFRolloutEngine):
    """The real HFRolloutEngine, counting its ``generate`` calls."""

    calls = 0

    def generate(self, prompts, params):
        self.calls += 1
        self.last_params = params
        return super().generate(prompts, params)


@pytest.fixture(scope="module")
def tiny_engine():
    tok = char_tokenizer()
    return CountingEngine(tiny_qwen2(tok, seed=0), tok)


SAMPLES = [
    ("46", Prompt("12+34=", "46")),
    ("45", Prompt("12+34=", "46")),
    ("the sum is 12", Prompt("7+5=", "12")),
    ("", Prompt("1+1=", "2")),
    ("{response} {0} }{", Prompt([{"role": "user", "content": "3+4?"}], "7")),  # braces are data
]


def test_judge_end_to_end_with_a_real_tiny_engine(tiny_engine):
    judge = JudgeReward(tiny_engine, invalid_score=-1.0, max_tokens=24)
    before = tiny_engine.calls
    rewards = judge.score_batch([c for c, _ in SAMPLES], [p for _, p in SAMPLES])
    assert tiny_engine.calls == before + 1  # one generate call for the batch
    params = tiny_engine.last_params
    assert (params.n, params.temperature, params.max_tokens) == (1, 0.0, 24)
    assert len(rewards) == len(SAMPLES)
    assert all(r == -1.0 or 0.0 <= r <= 1.0 for r in rewards)
    m = judge.metrics()
    assert m["judged"] == len(SAMPLES) and m["valid"] + m["invalid"] == m["judged"]
    assert sum(m[f"invalid/{r}"] for r in INVALID_REASONS) == m["invalid"]
    assert sum(r == -1.0 for r in rewards) == m["invalid"]
    assert len(judge.recent_invalid) == m["invalid"]
    # the judge prompt carries the question, the reference and the response
    assert len(judge.last_judgments) == len(SAMPLES)
    for (completion, prompt), (sent, judgment, j) in zip(SAMPLES, judge.last_judgments):
        assert sent == judge.judge_prompt(completion, prompt)
        question = prompt.text if isinstance(prompt.text, str) else prompt.text[0]["content"]
        assert f"[Question]\n{question}\n" in sent and f"[Reference answer]\n{prompt.answer}\n" in sent
        assert f"[Response]\n{completion}\n" in sent and "from 0 (wrong) to 10 (fully correct)" in sent
        assert isinstance(judgment, str) and (j.reason == "ok") == (j.score is not None)
    # greedy: the same batch judges the same way; one sample alone as in the batch of one
    assert judge.score_batch([c for c, _ in SAMPLES], [p for _, p in SAMPLES]) == rewards
    single = judge(*SAMPLES[1])
    assert [single] == judge.score_batch([SAMPLES[1][0]], [SAMPLES[1][1]])
    assert judge.metrics()["judged"] == 2 * len(SAMPLES) + 2


def test_judge_in_an_inline_reward_pool(tiny_engine):
    judge = JudgeReward(tiny_engine, max_tokens=8)
    with RewardPool(judge, backend="inline", timeout_s=60) as pool:
        for k, (c, p) in enumerate(SAMPLES):
            pool.submit(k, c, p)
        got = pool.gather()
        assert pool.metrics()["errors"] == 0
    assert sorted(got) == list(range(len(SAMPLES)))
    assert all(0.0 <= r <= 1.0 for r in got.values())
    m = judge.metrics()
    assert m["judged"] == len(SAMPLES) and m["invalid"] + m["valid"] == len(SAMPLES)


def test_judge_template_and_scale(tiny_engine):
    judge = JudgeReward(
        tiny_engine,
        template="Q: {question}\nA: {response}\nRate {min_score}-{max_score}. {{json}}",
        min_score=1,
        max_score=5,
        max_tokens=4,
    )
    assert judge.judge_prompt("it is 46", Q) == "Q: 12+34=\nA: it is 46\nRate 1-5. {json}"
    assert "{question}" in DEFAULT_TEMPLATE and "Score: N" in DEFAULT_TEMPLATE
    assert judge.score_batch([], []) == [] and judge.metrics()["judged"] == 0


def test_judge_bad_arguments(tiny_engine):
    for kwargs, exc, match in (
        ({}, ValueError, "exactly one"),
        ({"engine": tiny_engine, "model": "tiny"}, ValueError, "exactly one"),
        ({"engine": object()}, TypeError, "engine must have a generate"),
        ({"model": 3}, TypeError, "model must be a str"),
        ({"model": "tiny", "template": "no fields"}, ValueError, r"template: must contain the \{response\}"),
        ({"model": "tiny", "template": "{response} {answer}"}, ValueError, r"unknown fields \['answer'\]"),
        ({"model": "tiny", "template": "{response} {"}, ValueError, "not a valid format string"),
        ({"model": "tiny", "min_score": 10, "max_score": 0}, ValueError, "min_score must be < max_score"),
        ({"model": "tiny", "invalid_score": float("nan")}, ValueError, "invalid_score must be a finite"),
        ({"model": "tiny", "max_tokens": 0}, ValueError, "max_tokens must be an int >= 1"),
        ({"model": "tiny", "chat_template": "maybe"}, ValueError, "chat_template must be"),
    ):
        with pytest.raises(exc, match=match):
            JudgeReward(**kwargs)
    judge = JudgeReward(tiny_engine)
    with pytest.raises(ValueError, match="prompts: 1 prompts for 2 completions"):
        judge.score_batch(["a", "b"], [Q])
    with pytest.raises(TypeError, match="completions must be str"):
        judge.score_batch([1], [Q])


def test_judge_from_config_builds_its_model_lazily_and_pickles_without_it():
    cfg = load_config(["reward.verifier=llm_judge", "reward.judge_model=tiny", "reward.judge_max_tokens=6"])
    assert load_config([]).reward.verifier_options() == {}
    judge = get_verifier(cfg.reward.verifier, **cfg.reward.verifier_options())
    assert isinstance(judge, JudgeReward) and judge.model == "tiny" and judge.max_tokens == 6
    assert judge.engine is None  # nothing built yet
    r = judge("46", Q)
    assert judge.engine is not None and (r == 0.0 or 0.0 <= r <= 1.0)
    clone = pickle.loads(pickle.dumps(judge))
    assert clone.engine is None and clone.max_tokens == 6 and clone.metrics()["judged"] == 1
    assert clone("46", Q) == r  # rebuilt from the same seed: the same greedy judgment


@pytest.mark.slow
def test_judge_in_worker_processes():
    """Each worker builds its own tiny judge in setup(); the rewards are the in-process ones."""
    judge = get_verifier("llm_judge", judge_model="tiny", max_tokens=16)
    expected = [judge(c, p) for c, p in SAMPLES]
    fresh = get_verifier("llm_judge", judge_model="tiny", max_tokens=16)
    with RewardPool(fresh, backend="process", num_workers=2, timeout_s=60) as pool:
        for k, (c, p) in enumerate(SAMPLES):
            pool.submit(k, c, p)
        got = pool.gather()
        assert pool.metrics()["errors"] == 0 and pool.metrics()["crashes"] == 0
    assert [got[k] for k in range(len(SAMPLES))] == expected
