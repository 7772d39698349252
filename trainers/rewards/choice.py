"""Multiple-choice rewards: ``1.0`` if the completion picks the correct option letter.

**Gold.** ``prompt.answer`` is the correct letter: ``"B"``, ``"(B)"``, ``"B) text"`` or
``"B. text"`` (the letter is taken, upper-cased); an answer without one, or with a letter
outside ``letters``, raises a one-line ``ValueError`` (the reward pool counts it as an error).

**The completion's choice** (:func:`extract_choice`), the first rule that matches decides:

1. the last ``\\boxed{B}`` (also ``\\boxed{(B)}``, ``\\boxed{\\text{B}}``; a lower-case boxed
   letter is upper-cased);
2. else the last ``answer is B`` / ``answer: B`` / ``answer is: B`` (``answer`` in any case; the
   letter may be wrapped in ``(B)`` and / or markdown ``**B**``; the letter itself must be upper
   case and not followed by a letter or digit, so ``the answer is a bit long`` picks nothing);
3. else a completion whose stripped text is a single upper-case letter, or starts with ``(B)``,
   ``B.`` or ``B)`` followed by whitespace or the end.

**Reward**: ``1.0`` if the choice equals the gold letter, else ``0.0``; no choice, or a choice
outside ``letters`` (option, default ``"ABCD"``), scores ``0.0``.

>>> v = ChoiceVerifier()
>>> v("The answer is (B).", Prompt("q", "B")), v("\\\\boxed{C}", Prompt("q", "(B)"))
(1.0, 0.0)
>>> v("B) Paris, because ...", Prompt("q", "B. Paris")), v("I'd pick B", Prompt("q", "B"))
(1.0, 0.0)
>>> ChoiceVerifier(letters="ABCDE")("Answer: E", Prompt("q", "E")), v("Answer: E", Prompt("q", "B"))
(1.0, 0.0)
"""

from __future__ import annotations

import re
import string
from dataclasses import dataclass

from trainers.data import Prompt

__all__ = ["ChoiceVerifier", "extract_choice", "gold_letter"]

_BOXED = re.compile(r"\\boxed\{\s*(?:\\text\{\s*)?\(?([A-Za-z])\)?\s*\}?\s*\}")
_ANSWER = re.compile(r"(?i:answer)\s*(?:(?i:is)\s*:?|:)\s*\**\s*\(?([A-Z])\)?\**(?![A-Za-z0-9])")
_LEADING = re.compile(r"(?:\(([A-Z])\)|([A-Z])[.)])(?:\s|$)")
_GOLD = re.compile(r"\(?([A-Za-z])(?:\)|\.|\s|$)")


def extract_choice(completion: str) -> str | None:
    """The letter the completion chooses, by the rules of the module docstring, or ``None``.

    >>> extract_choice("so \\\\boxed{D}"), extract_choice("Answer: (A) is it"), extract_choice("(C)")
    ('D', 'A', 'C')
    >>> extract_choice("the answer is a bit long"), extract_choice("A cat sat."), extract_choice("")
    (None, None, None)
    """
    if not isinstance(completion, str):
        raise TypeError(f"completion must be a str, got {type(completion).__name__}")
    boxed = _BOXED.findall(completion)
    if boxed:
        return boxed[-1].upper()
    answers = _ANSWER.findall(completion)
    if answers:
        return answers[-1]
    text = completion.strip()
    if len(text) == 1 and text in string.ascii_uppercase:
        return text
    m = _LEADING.match(text)
    return (m.group(1) or m.group(2)) if m else None


def gold_letter(answer: str, letters: str = "ABCD") -> str:
    """The correct letter of ``answer`` (``"B"``, ``"(B)"``, ``"B) text"``, ``"B. text"``).

    >>> gold_letter("(b)"), gold_letter("C. Paris")
    ('B', 'C')
    """
    m = _GOLD.match(str(answer).strip())
    if m is None:
        raise ValueError(f"answer: expected an option letter such as 'B', '(B)' or 'B) text', got {answer!r}")
    letter = m.group(1).upper()
    if letter not in letters:
        raise ValueError(f"answer: letter {letter!r} is not one of letters={letters!r}")
    return letter


@dataclass(frozen=True)
class ChoiceVerifier:
    """``1.0`` if :func:`extract_choice` of the completion equals the gold letter of
    ``prompt.answer`` and lies in ``letters`` (unique upper-case ASCII letters), else ``0.0``.
    The rules: the module docstring.

    >>> ChoiceVerifier()("**Answer:** B", Prompt("q", "B"))
    1.0
    """

    letters: str = "ABCD"

    def __post_init__(self) -> None:
        ok = (
            isinstance(self.letters, str)
            and self.letters != ""
            and all(c in string.ascii_uppercase for c in self.letters)
            and len(set(self.letters)) == len(self.letters)
        )
        if not ok:
            raise ValueError(
                f"letters must be unique upper-case ASCII letters such as 'ABCD', got {self.letters!r}"
            )

    def __call__(self, completion: str, prompt: Prompt) -> float:
        gold = gold_letter(prompt.answer, self.letters)
        choice = extract_choice(completion)
        return 1.0 if choice is not None and choice in self.letters and choice == gold else 0.0
