"""Instruction-following rewards: rollkit's implementation of IFEval's verifiable instructions.

IFEval (Zhou et al. 2023, "Instruction-Following Evaluation for Large Language Models",
arXiv:2311.07911) attaches to each prompt a list of instructions that a program can check
("answer in fewer than 200 words", "no commas", "end with *Any other questions?*"). This module
re-implements its 25 registered checkers (:data:`INSTRUCTIONS`) without nltk, and
:class:`InstructionVerifier` (``get_verifier("ifeval")``) turns them into a reward.

**Ground truth** travels in ``Prompt.answer`` as JSON in IFEval's own input format::

    {"instruction_id_list": ["punctuation:no_comma", "length_constraints:number_words"],
     "kwargs": [{}, {"relation": "less than", "num_words": 50}]}

``kwargs[i]`` are instruction ``i``'s arguments; a ``None`` value counts as absent (the
published data fills unused keys with ``null``); a missing ``kwargs`` means no arguments. A
malformed answer (not JSON, an unknown id, a missing / unknown / ill-typed argument) raises a
one-line ``ValueError`` naming the instruction and the argument.

**Reward.** With ``f_i`` = 1 if instruction ``i`` is followed: ``mode="all"`` gives
``prod_i f_i`` (IFEval's prompt-level accuracy), ``mode="fraction"`` gives ``mean_i f_i`` (its
instruction-level accuracy). An empty (whitespace-only) response follows nothing. ``loose=True``
is IFEval's loose variant: instruction ``i`` counts as followed if any of 8 variants of the
response passes: the response with / without its first line, its last line, both, each with
and without every ``*`` removed.

**Where the counts may differ from the published (nltk-based) checker**: words are
``\\w+`` runs (identical to nltk's ``RegexpTokenizer(r"\\w+")``); sentences come from
:func:`split_sentences` (terminal punctuation followed by space, with a fixed abbreviation list)
where IFEval uses nltk's trained Punkt model; capital words come from :func:`split_words`
(hyphen / apostrophe / dot-joined words are one token; nltk's ``word_tokenize`` splits
``DON'T`` into ``DO`` + ``N'T``). Keywords, markers and splitters are matched as literal text
(the published code uses them as regular expressions). ``docs/rewards-workers.md`` lists every
departure.

>>> import json
>>> spec = json.dumps({"instruction_id_list": ["punctuation:no_comma", "startend:quotation"],
...                    "kwargs": [{}, {}]})
>>> v = InstructionVerifier()
>>> v('"Hello world"', Prompt("q", spec)), v('"Hello, world"', Prompt("q", spec))
(1.0, 0.0)
>>> InstructionVerifier(mode="fraction")('"Hello, world"', Prompt("q", spec))
0.5
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from trainers.data import Prompt

__all__ = [
    "INSTRUCTIONS",
    "Instruction",
    "InstructionVerifier",
    "check_instructions",
    "count_sentences",
    "count_words",
    "loose_variants",
    "parse_instructions",
    "split_sentences",
    "split_words",
]

MODES = ("all", "fraction")
RELATIONS = ("less than", "at least")

# --------------------------------------------------------------------------- language detection

_LANGDETECT: Any = None


def _langdetect() -> Any:
    """langdetect, imported once, with its seed fixed (IFEval fixes it too: detection is random)."""
    global _LANGDETECT
    if _LANGDETECT is None:
        try:
            import langdetect
        except ImportError as e:
            raise ImportError(
                "the 'ifeval' verifier's language checks need langdetect: pip install langdetect==1.0.9 "
                "(see scripts/install.sh)"
            ) from e
        langdetect.DetectorFactory.seed = 0
        _LANGDETECT = langdetect
    return _LANGDETECT


def _language_is(text: str, code: str) -> bool:
    """``langdetect.detect(text) == code``; text langdetect cannot classify (no letters) passes,
    as in IFEval."""
    ld = _langdetect()
    try:
        return bool(ld.detect(text) == code)
    except ld.LangDetectException:
        return True


# --------------------------------------------------------------------------- words and sentences

_WORD = re.compile(r"\w+")
_TOKEN = re.compile(r"\w+(?:[-'\u2019.]\w+)*")
# Abbreviations after which a period does not end a sentence (lower case, without the dot).
_ABBREVIATIONS = frozenset(
    "mr mrs ms dr prof sr jr st vs etc e.g i.e a.m p.m u.s u.k inc ltd co corp no fig approx "
    "dept est jan feb mar apr jun jul aug sep sept oct nov dec mt gen col lt capt sgt rev".split()
)
_BOUNDARY = re.compile(r"([.!?]+)([\"'\u201d\u2019)\]]*)(?=\s|$)")


def count_words(text: str) -> int:
    """The number of ``\\w+`` runs (IFEval's word count; nltk's ``RegexpTokenizer(r"\\w+")``).

    >>> count_words("d3sCRi7 lArge lAnguagE M0del w1tH 20 w0RdS.")
    7
    """
    return len(_WORD.findall(text))


def split_words(text: str) -> list[str]:
    """Word tokens for ``change_case:capital_word_frequency``: ``\\w+`` runs joined by ``-``,
    ``'``, ``’`` or ``.`` count as one (``well-known``, ``DON'T``, ``U.S``); punctuation is dropped.

    >>> split_words("HERE there are THREE FUlly-CAPITAL words, U.S. DON'T.")
    ['HERE', 'there', 'are', 'THREE', 'FUlly-CAPITAL', 'words', 'U.S', "DON'T"]
    """
    return _TOKEN.findall(text)


def _ends_sentence(text: str, end: int, punct: str) -> bool:
    """Whether the terminal punctuation ``punct`` ending at ``text[:end]`` closes a sentence."""
    if punct != ".":
        return True if punct[0] != "." else _next_is_upper(text, end)
    word = re.search(r"(\S+)\.$", text[:end])
    if word is None:
        return True
    token = word.group(1).lstrip("\"'(\u201c[").lower()
    if token in _ABBREVIATIONS:
        return False
    if len(token) == 1 and token.isalpha():  # an initial: "J. Smith"
        return not _next_is_upper(text, end)
    return True


def _next_is_upper(text: str, end: int) -> bool:
    nxt = re.match(r"\s*(\S)", text[end:])
    return nxt is None or nxt.group(1).isupper() or not nxt.group(1).isalpha()


def split_sentences(text: str) -> list[str]:
    """Sentences of ``text``: a sentence ends at ``.``, ``!`` or ``?`` (runs such as ``?!``,
    then closing quotes or brackets) followed by whitespace or the end, except a ``.`` after an
    abbreviation (``Dr.``, ``e.g.``, ...), an initial followed by a capitalised word
    (``J. Smith``), or an ellipsis ``...`` followed by a lower-case word. Newlines alone do not
    split (as in Punkt); text after the last terminal punctuation is a sentence of its own.

    >>> split_sentences("Dr. Smith arrived. Was he late?! No... he was early. Bye")
    ['Dr. Smith arrived.', 'Was he late?!', 'No... he was early.', 'Bye']
    """
    sentences, start = [], 0
    for m in _BOUNDARY.finditer(text):
        if _ends_sentence(text, m.start(2), m.group(1)):
            piece = text[start : m.end()].strip()
            if piece:
                sentences.append(piece)
            start = m.end()
    rest = text[start:].strip()
    if rest:
        sentences.append(rest)
    return sentences


def count_sentences(text: str) -> int:
    """``len(split_sentences(text))``.

    >>> count_sentences("xx,x. xx,x! xx/x. x{x}x?")
    4
    """
    return len(split_sentences(text))


# --------------------------------------------------------------------------- the checkers


def _compare(count: int, relation: str, threshold: int) -> bool:
    return count < threshold if relation == "less than" else count >= threshold


def _keywords_existence(r: str, *, keywords: Sequence[str]) -> bool:
    low = r.lower()
    return all(k.lower() in low for k in keywords)


def _keywords_frequency(r: str, *, keyword: str, frequency: int, relation: str) -> bool:
    n = len(re.findall(re.escape(keyword.strip()), r, flags=re.IGNORECASE))
    return _compare(n, relation, frequency)


def _forbidden_words(r: str, *, forbidden_words: Sequence[str]) -> bool:
    return not any(re.search(rf"\b{re.escape(w)}\b", r, flags=re.IGNORECASE) for w in forbidden_words)


def _letter_frequency(r: str, *, letter: str, let_frequency: int, let_relation: str) -> bool:
    return _compare(r.lower().count(letter.lower()), let_relation, let_frequency)


def _response_language(r: str, *, language: str) -> bool:
    return _language_is(r, language)


def _number_sentences(r: str, *, num_sentences: int, relation: str) -> bool:
    return _compare(count_sentences(r), relation, num_sentences)


def _number_paragraphs(r: str, *, num_paragraphs: int) -> bool:
    parts = re.split(r"\s?\*\*\*\s?", r)
    if any(not p.strip() for p in parts[1:-1]):
        return False  # an empty paragraph between two dividers
    return sum(1 for p in parts if p.strip()) == num_paragraphs


def _number_words(r: str, *, num_words: int, relation: str) -> bool:
    return _compare(count_words(r), relation, num_words)


def _first_word(paragraph: str) -> str:
    word = paragraph.split()[0].lstrip("'\"")
    return re.split(r"[.,?!'\"]", word, maxsplit=1)[0].lower()


def _nth_paragraph_first_word(r: str, *, num_paragraphs: int, nth_paragraph: int, first_word: str) -> bool:
    paragraphs = [p.strip() for p in r.split("\n\n") if p.strip()]
    if len(paragraphs) != num_paragraphs or nth_paragraph > len(paragraphs):
        return False
    return _first_word(paragraphs[nth_paragraph - 1]) == first_word.lower()


def _number_placeholders(r: str, *, num_placeholders: int) -> bool:
    return len(re.findall(r"\[.*?\]", r)) >= num_placeholders


def _postscript(r: str, *, postscript_marker: str) -> bool:
    marker = postscript_marker.strip()
    if marker == "P.P.S":
        pattern = r"p\.\s?p\.\s?s"
    elif marker == "P.S.":
        pattern = r"p\.\s?s\."
    else:
        pattern = re.escape(marker.lower())
    return re.search(pattern, r.lower()) is not None


def _number_bullet_lists(r: str, *, num_bullets: int) -> bool:
    n = 0
    for line in r.splitlines():
        s = line.lstrip()
        n += s.startswith("-") or (len(s) > 1 and s[0] == "*" and s[1] != "*")
    return n == num_bullets


_CONSTRAINED = ("My answer is yes.", "My answer is no.", "My answer is maybe.")


def _constrained_response(r: str) -> bool:
    return any(option in r.strip() for option in _CONSTRAINED)


def _number_highlighted_sections(r: str, *, num_highlights: int) -> bool:
    single = [h for h in re.findall(r"\*[^\n*]*\*", r) if h.strip("*").strip()]
    double = [h for h in re.findall(r"\*\*[^\n*]*\*\*", r) if h[2:-2].strip()]
    return len(single) + len(double) >= num_highlights


def _multiple_sections(r: str, *, section_spliter: str, num_sections: int) -> bool:
    sections = re.split(r"\s?" + re.escape(section_spliter.strip()) + r"\s?\d+\s?", r)
    return len(sections) - 1 >= num_sections


def _json_format(r: str) -> bool:
    text = r.strip()
    for fence in ("```json", "```Json", "```JSON", "```"):
        if text.startswith(fence):
            text = text[len(fence) :]
            break
    text = text.removesuffix("```").strip()
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _title(r: str) -> bool:
    return any(t[2:-2].strip("<> \t") for t in re.findall(r"<<[^\n]+>>", r))


def _two_responses(r: str) -> bool:
    parts = r.split("******")
    if any(not p.strip() for p in parts[1:-1]):
        return False
    kept = [p.strip() for p in parts if p.strip()]
    return len(kept) == 2 and kept[0] != kept[1]


def _repeat_prompt(r: str, *, prompt_to_repeat: str) -> bool:
    return r.strip().lower().startswith(prompt_to_repeat.strip().lower())


def _end_checker(r: str, *, end_phrase: str) -> bool:
    return r.strip().strip('"').lower().endswith(end_phrase.strip().lower())


def _capital_word_frequency(r: str, *, capital_frequency: int, capital_relation: str) -> bool:
    n = sum(1 for w in split_words(r) if w.isupper())
    return _compare(n, capital_relation, capital_frequency)


def _english_capital(r: str) -> bool:
    return r.isupper() and _language_is(r, "en")


def _english_lowercase(r: str) -> bool:
    return r.islower() and _language_is(r, "en")


def _no_comma(r: str) -> bool:
    return "," not in r


def _quotation(r: str) -> bool:
    s = r.strip()
    return len(s) > 1 and s[0] == '"' and s[-1] == '"'


# --------------------------------------------------------------------------- argument checks

_INT, _STR, _STRS, _REL, _LETTER, _LANG = "int", "str", "strs", "relation", "letter", "language"


def _bad(iid: str, name: str, why: str) -> ValueError:
    return ValueError(f"instruction {iid!r}: kwarg {name!r} {why}")


def _check_arg(iid: str, name: str, kind: str, value: Any) -> Any:
    """``value`` if it is a valid ``kind`` argument, else a one-line ``ValueError``."""
    if kind == _INT:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise _bad(iid, name, f"must be an int >= 0, got {value!r}")
    elif kind in (_STR, _LANG, _REL, _LETTER):
        if not isinstance(value, str) or not value.strip():
            raise _bad(iid, name, f"must be a non-empty str, got {value!r}")
        if kind == _REL and value not in RELATIONS:
            raise _bad(iid, name, f"must be one of {list(RELATIONS)}, got {value!r}")
        if kind == _LETTER and (len(value.strip()) != 1):
            raise _bad(iid, name, f"must be a single non-whitespace character, got {value!r}")
        if kind == _LANG and not re.fullmatch(r"[a-z]{2,3}(-[a-z]{2})?", value):
            raise _bad(iid, name, f"must be an ISO 639-1 code such as 'en' or 'zh-cn', got {value!r}")
    elif kind == _STRS:
        if (
            isinstance(value, str)
            or not isinstance(value, Sequence)
            or not value
            or not all(isinstance(v, str) and v.strip() for v in value)
        ):
            raise _bad(iid, name, f"must be a non-empty list of non-empty str, got {value!r}")
        return list(value)
    return value.strip() if isinstance(value, str) else value


@dataclass(frozen=True)
class Instruction:
    """One verifiable instruction: ``check(response, **kwargs) -> bool`` and the arguments it
    takes (``params``: name -> kind, all required). Calling it validates ``kwargs`` (``None``
    values dropped) and checks ``response``.

    >>> INSTRUCTIONS["punctuation:no_comma"]("no commas here"), INSTRUCTIONS["punctuation:no_comma"]("a, b")
    (True, False)
    >>> INSTRUCTIONS["length_constraints:number_words"]("one two", num_words=3, relation="less than")
    True
    """

    id: str
    check: Callable[..., bool]
    params: tuple[tuple[str, str], ...] = ()

    def validate(self, kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
        """The validated arguments (``None`` values dropped); a one-line ``ValueError`` naming
        the instruction and the argument otherwise."""
        if kwargs is None:
            kwargs = {}
        if not isinstance(kwargs, Mapping):
            raise ValueError(
                f"instruction {self.id!r}: kwargs must be an object, got {type(kwargs).__name__}"
            )
        given = {k: v for k, v in kwargs.items() if v is not None}
        kinds = dict(self.params)
        unknown = sorted(set(given) - set(kinds))
        if unknown:
            takes = sorted(kinds) if kinds else "no kwargs"
            raise ValueError(f"instruction {self.id!r}: unknown kwarg(s) {unknown}; it takes {takes}")
        out = {}
        for name, kind in self.params:
            if name not in given:
                raise ValueError(f"instruction {self.id!r}: kwarg {name!r} is missing")
            out[name] = _check_arg(self.id, name, kind, given[name])
        if self.id == "length_constraints:nth_paragraph_first_word" and not (
            1 <= out["nth_paragraph"] <= out["num_paragraphs"]
        ):
            raise _bad(
                self.id, "nth_paragraph", f"must be in [1, num_paragraphs], got {out['nth_paragraph']}"
            )
        return out

    def __call__(self, response: str, **kwargs: Any) -> bool:
        return bool(response.strip()) and bool(self.check(response, **self.validate(kwargs)))


def _registry() -> dict[str, Instruction]:
    specs: list[tuple[str, Callable[..., bool], tuple[tuple[str, str], ...]]] = [
        ("keywords:existence", _keywords_existence, (("keywords", _STRS),)),
        (
            "keywords:frequency",
            _keywords_frequency,
            (("keyword", _STR), ("frequency", _INT), ("relation", _REL)),
        ),
        ("keywords:forbidden_words", _forbidden_words, (("forbidden_words", _STRS),)),
        (
            "keywords:letter_frequency",
            _letter_frequency,
            (("letter", _LETTER), ("let_frequency", _INT), ("let_relation", _REL)),
        ),
        ("language:response_language", _response_language, (("language", _LANG),)),
        (
            "length_constraints:number_sentences",
            _number_sentences,
            (("num_sentences", _INT), ("relation", _REL)),
        ),
        ("length_constraints:number_paragraphs", _number_paragraphs, (("num_paragraphs", _INT),)),
        ("length_constraints:number_words", _number_words, (("num_words", _INT), ("relation", _REL))),
        (
            "length_constraints:nth_paragraph_first_word",
            _nth_paragraph_first_word,
            (("num_paragraphs", _INT), ("nth_paragraph", _INT), ("first_word", _STR)),
        ),
        ("detectable_content:number_placeholders", _number_placeholders, (("num_placeholders", _INT),)),
        ("detectable_content:postscript", _postscript, (("postscript_marker", _STR),)),
        ("detectable_format:number_bullet_lists", _number_bullet_lists, (("num_bullets", _INT),)),
        ("detectable_format:constrained_response", _constrained_response, ()),
        (
            "detectable_format:number_highlighted_sections",
            _number_highlighted_sections,
            (("num_highlights", _INT),),
        ),
        (
            "detectable_format:multiple_sections",
            _multiple_sections,
            (("section_spliter", _STR), ("num_sections", _INT)),
        ),
        ("detectable_format:json_format", _json_format, ()),
        ("detectable_format:title", _title, ()),
        ("combination:two_responses", _two_responses, ()),
        ("combination:repeat_prompt", _repeat_prompt, (("prompt_to_repeat", _STR),)),
        ("startend:end_checker", _end_checker, (("end_phrase", _STR),)),
        (
            "change_case:capital_word_frequency",
            _capital_word_frequency,
            (("capital_frequency", _INT), ("capital_relation", _REL)),
        ),
        ("change_case:english_capital", _english_capital, ()),
        ("change_case:english_lowercase", _english_lowercase, ()),
        ("punctuation:no_comma", _no_comma, ()),
        ("startend:quotation", _quotation, ()),
    ]
    return {iid: Instruction(iid, fn, params) for iid, fn, params in specs}


#: instruction id -> :class:`Instruction` (IFEval's 25 registered instructions).
INSTRUCTIONS: dict[str, Instruction] = _registry()

# --------------------------------------------------------------------------- the verifier


def loose_variants(response: str) -> list[str]:
    """IFEval's 8 loose variants: the response, without its first line, without its last line,
    without both; each as is and with every ``*`` removed (the cut ones stripped).

    >>> loose_variants("Sure:\\n*yes*\\nBye")[:5]
    ['Sure:\\n*yes*\\nBye', 'Sure:\\nyes\\nBye', '*yes*\\nBye', 'Sure:\\n*yes*', '*yes*']
    """
    lines = response.split("\n")
    cuts = ["\n".join(lines[1:]).strip(), "\n".join(lines[:-1]).strip(), "\n".join(lines[1:-1]).strip()]
    return [response, response.replace("*", ""), *cuts, *(c.replace("*", "") for c in cuts)]


def parse_instructions(answer: str) -> tuple[list[str], list[dict[str, Any]]]:
    """``(instruction ids, kwargs)`` from an IFEval JSON answer (module docstring): the ids are
    known and the kwargs are one object (or ``null``) per id; a one-line ``ValueError`` naming
    what is wrong otherwise. The arguments themselves are checked by :func:`check_instructions`.

    >>> parse_instructions('{"instruction_id_list": ["detectable_format:title"], "kwargs": [null]}')
    (['detectable_format:title'], [{}])
    """
    try:
        spec = json.loads(answer)
    except (json.JSONDecodeError, TypeError) as e:
        raise ValueError(
            f"answer: not IFEval JSON ({{'instruction_id_list': [...], 'kwargs': [...]}}): {e}"
        ) from None
    if not isinstance(spec, dict) or "instruction_id_list" not in spec:
        raise ValueError("answer: expected a JSON object with 'instruction_id_list' (and 'kwargs')")
    ids = spec["instruction_id_list"]
    kwargs = spec.get("kwargs")
    if not isinstance(ids, list) or not ids or not all(isinstance(i, str) for i in ids):
        raise ValueError(f"answer: instruction_id_list must be a non-empty list of str, got {ids!r}")
    if kwargs is None:
        kwargs = [{}] * len(ids)
    if not isinstance(kwargs, list) or len(kwargs) != len(ids):
        raise ValueError(
            f"answer: kwargs must be a list of {len(ids)} objects (one per instruction), got {kwargs!r}"
        )
    for iid, kw in zip(ids, kwargs):
        _instruction(iid)
        if kw is not None and not isinstance(kw, dict):
            raise ValueError(f"answer: kwargs of {iid!r} must be an object, got {kw!r}")
    return ids, [dict(kw or {}) for kw in kwargs]


def _instruction(iid: str) -> Instruction:
    found = INSTRUCTIONS.get(iid)
    if found is None:
        raise ValueError(
            f"instruction_id_list: unknown instruction id {iid!r}; known: {', '.join(sorted(INSTRUCTIONS))}"
        )
    return found


def check_instructions(
    response: str,
    instruction_ids: Sequence[str],
    kwargs: Sequence[Mapping[str, Any] | None],
    prompt_text: str = "",
    loose: bool = False,
) -> list[bool]:
    """Whether ``response`` follows each instruction (IFEval's ``follow_instruction_list``).

    ``kwargs[i]`` are instruction ``i``'s arguments (``None`` values dropped). ``prompt_text``
    stands in for ``combination:repeat_prompt``'s ``prompt_to_repeat`` when that is absent.
    ``loose``: a variant of :func:`loose_variants` passing counts. An empty response follows
    nothing.

    >>> check_instructions("Hi, all", ["punctuation:no_comma", "length_constraints:number_words"],
    ...                    [{}, {"num_words": 3, "relation": "less than"}])
    [False, True]
    """
    if not isinstance(response, str):
        raise TypeError(f"response must be a str, got {type(response).__name__}")
    if len(kwargs) != len(instruction_ids):
        raise ValueError(f"kwargs: {len(kwargs)} entries for {len(instruction_ids)} instruction ids")
    variants = loose_variants(response) if loose else [response]
    variants = [v for v in variants if v.strip()]
    out = []
    for iid, kw in zip(instruction_ids, kwargs):
        inst = _instruction(iid)
        kw = dict(kw or {})
        if iid == "combination:repeat_prompt" and kw.get("prompt_to_repeat") is None and prompt_text.strip():
            kw["prompt_to_repeat"] = prompt_text
        args = inst.validate(kw)
        out.append(any(inst.check(v, **args) for v in variants))
    return out


def _prompt_text(text: Any) -> str:
    """The text of a prompt: the string, or the content of the last user message."""
    if isinstance(text, str):
        return text
    if isinstance(text, Sequence):
        users = [m.get("content", "") for m in text if isinstance(m, Mapping) and m.get("role") == "user"]
        if users and isinstance(users[-1], str):
            return users[-1]
    return ""


@dataclass(frozen=True)
class InstructionVerifier:
    """IFEval reward: ``1.0`` if the completion follows every instruction of ``prompt.answer``
    (``mode="all"``, prompt-level accuracy) or the fraction it follows (``mode="fraction"``,
    instruction-level accuracy); ``loose`` uses IFEval's loose variants (:func:`loose_variants`).
    The answer format and the checkers: the module docstring and :data:`INSTRUCTIONS`.

    >>> spec = '{"instruction_id_list": ["detectable_format:title"], "kwargs": [{}]}'
    >>> InstructionVerifier()("<<A Poem>>\\nRoses.", Prompt("q", spec))
    1.0
    >>> InstructionVerifier()("**A Poem**", Prompt("q", spec))
    0.0
    """

    mode: str = "all"
    loose: bool = False

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {list(MODES)}, got {self.mode!r}")
        if not isinstance(self.loose, bool):
            raise ValueError(f"loose must be a bool, got {self.loose!r}")

    def setup(self) -> None:
        """Import langdetect once, when a pool worker starts (skipped if it is not installed:
        only the language checks need it)."""
        try:
            _langdetect()
        except ImportError:
            pass

    def __call__(self, completion: str, prompt: Prompt) -> float:
        ids, kwargs = parse_instructions(prompt.answer)
        followed = check_instructions(completion, ids, kwargs, _prompt_text(prompt.text), loose=self.loose)
        if self.mode == "all":
            return 1.0 if all(followed) else 0.0
        return sum(followed) / len(followed)
