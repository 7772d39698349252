"""The ``multiple_choice`` verifier (trainers/rewards/choice.py): extraction order, gold forms,
negatives, ``letters`` validation, the registry."""

from __future__ import annotations

import pickle

import pytest

from trainers.data import Prompt
from trainers.rewards import VERIFIERS, ChoiceVerifier, extract_choice, get_verifier
from trainers.rewards.choice import gold_letter


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        # 1. \boxed{...}, the last one
        ("so the answer is \\boxed{C}", "C"),
        ("\\boxed{A} no wait \\boxed{(D)}", "D"),
        ("\\boxed{\\text{B}}", "B"),
        ("\\boxed{b}", "B"),
        # boxed beats an "answer is" phrase, wherever it is
        ("\\boxed{A}. The answer is B", "A"),
        # 2. "answer is X" / "answer: X", case-insensitive keyword, last occurrence
        ("The answer is (B).", "B"),
        ("answer: C", "C"),
        ("Answer: (D)", "D"),
        ("ANSWER IS A", "A"),
        ("The answer is: B", "B"),
        ("**Answer:** C", "C"),
        ("The answer is **D**.", "D"),
        ("My first answer is A. On reflection the final answer is C.", "C"),
        # 3. a bare letter, or a leading "(B)", "B." or "B)"
        ("B", "B"),
        ("  C \n", "C"),
        ("(A)", "A"),
        ("D.", "D"),
        ("B) Paris, since ...", "B"),
        ("(C) 42 because", "C"),
        ("A. The mitochondria", "A"),
        # negatives
        ("", None),
        ("I'm not sure.", None),
        ("the answer is a bit long", None),  # lower-case letter after "answer is"
        ("The answer is Paris", None),  # a word, not a letter
        ("A cat sat on the mat.", None),  # leading letter without "." / ")"
        ("I'd pick B", None),
        ("b", None),  # a bare lower-case letter
        ("U.S. is the answer", None),
        ("Answer: 4", None),
        ("\\boxed{42}", None),
    ],
)
def test_extract_choice(completion, expected):
    assert extract_choice(completion) == expected


@pytest.mark.parametrize(
    ("answer", "gold"),
    [("B", "B"), ("(B)", "B"), ("B) Paris", "B"), ("B. Paris", "B"), (" c ", "C"), ("D)", "D")],
)
def test_gold_forms(answer, gold):
    assert gold_letter(answer) == gold
    assert ChoiceVerifier()(f"Answer: {gold}", Prompt("q", answer)) == 1.0
    wrong = "A" if gold != "A" else "B"
    assert ChoiceVerifier()(f"Answer: {wrong}", Prompt("q", answer)) == 0.0


@pytest.mark.parametrize(
    ("answer", "match"),
    [
        ("", "answer: expected an option letter"),
        ("Paris", "answer: expected an option letter"),
        ("42", "answer: expected an option letter"),
        ("E", "answer: letter 'E' is not one of letters='ABCD'"),
    ],
)
def test_bad_gold_raises_naming_answer(answer, match):
    with pytest.raises(ValueError, match=match):
        ChoiceVerifier()("A", Prompt("q", answer))


def test_choice_outside_letters_scores_zero():
    assert ChoiceVerifier()("Answer: E", Prompt("q", "A")) == 0.0
    assert ChoiceVerifier(letters="ABCDE")("Answer: E", Prompt("q", "E")) == 1.0
    # the first matching rule decides: a boxed letter outside `letters` is not skipped
    assert ChoiceVerifier()("\\boxed{F}. Answer: A", Prompt("q", "A")) == 0.0
    assert ChoiceVerifier()("nothing chosen", Prompt("q", "A")) == 0.0


@pytest.mark.parametrize("letters", ["", "abcd", "AAB", "AB1", "ÄB", ["A", "B"]])
def test_letters_validated(letters):
    with pytest.raises(ValueError, match="letters must be unique upper-case ASCII letters"):
        ChoiceVerifier(letters=letters)


def test_registry_and_options():
    assert VERIFIERS["multiple_choice"] is ChoiceVerifier
    v = get_verifier("multiple_choice", letters="ABCDE")
    assert isinstance(v, ChoiceVerifier) and v.letters == "ABCDE"
    assert v("The answer is (E)", Prompt("q", "(E)")) == 1.0
    assert get_verifier("multiple_choice")("The answer is (E)", Prompt("q", "A")) == 0.0
    with pytest.raises(TypeError, match="unknown options"):
        get_verifier("multiple_choice", choices="AB")
    assert pickle.loads(pickle.dumps(v)) == v
