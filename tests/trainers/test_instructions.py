"""The ``ifeval`` verifier (trainers/rewards/instructions.py): every IFEval instruction id on the
examples of the published tests (google-research ``instruction_following_eval/instructions_test.py``,
responses and expected results reproduced as data), strict vs loose, ``mode``, bad answers and
options, pickling, and a run through a process ``RewardPool``."""

from __future__ import annotations

import json
import pickle

import pytest

from trainers.data import Prompt
from trainers.rewards import VERIFIERS, InstructionVerifier, RewardPool, check_instructions, get_verifier
from trainers.rewards.instructions import (
    INSTRUCTIONS,
    count_sentences,
    count_words,
    loose_variants,
    parse_instructions,
    split_sentences,
)

LT, AL = "less than", "at least"

# --------------------------------------------------------------------------- published examples

BULLET_1 = """
  A Markdown bullet point is a way of formatting text to create a list. To
  create a bullet point, start each line with an asterisk (*). For example:
  * This is a bullet point.
  *(no space required)Another bullet point.
  * (no newline ending required)Another bullet point.
  markdown bullet points are often used to create to-do lists or to list items
  in a step-by-step guide."""
BULLET_2 = """
  Check that inline asterisk (*), *, will not be counted. Only * that starts a
  bullet list will be counted:
    * This is a bullet point.
    * Another bullet point.
    . dot is not counted"""
BULLET_3 = """
  Here are three bullets starting with asterisk:
  * I am a large language model, also known as a conversational AI.
  * I am trained on a massive amount of text data, and I am able to communicate.
  * I am still under development, but I am learning new things every day."""
BULLET_4 = """
  Here are three markdown bullets:
  - I am a large language model, also known as a conversational AI.
  - I am trained on a massive amount of text data, and I am able to communicate.
  -I am still under development, but I am learning new things every day."""
BULLET_5 = """
  Paragraph 1
  ***
  Paragraph 2
  ***
  Paragraph 3
  * only one bullet point
  """

HIGHLIGHT_1 = """
  To highlight text with Markdown, you can use the * character before and after
  the text you want to highlight. For example, if you want to highlight the
  word `hello`, you would type:*hello*, You can also use the ** character to
  create bold text. For example, if you want to bold the word `hello`, you
  would type: **hello** """
HIGHLIGHT_2 = """
  Sure, here are the numerical methods for solving partial differential
  equations highlighted with Markdown:
  *Finite difference methods
  *Finite element methods*
  *Boundary element methods
  *Monte Carlo methods
  I hope this helps!"""
HIGHLIGHT_3 = """
  There is allowed to be *two different* highlighted *sections in the same*
  line. **This is also true** for **double markdown highlights.**
  """

SECTION_1 = """
  Your response must have multiple sections. Mark the beginning of each section
  with "Section X", such as:
  Section 1
  [content of section 1]
  Section 2
  [content of section 2]"""
SECTION_2 = """SECTION 1
  [content of section 1]
  SECTION 2
  [content of section 2]"""

PARAGRAPH_1 = """
  paragraph 1
  ***
  paragraph 2
  ***
  paragraph 3"""
PARAGRAPH_2 = """
          ***
  paragraph 1
          ***
      paragraph 2
          ***
      paragraph 3"""
PARAGRAPH_3 = """
  paragraph 1
          ***
      paragraph 2
          ***
      paragraph 3
          ***"""
PARAGRAPH_4 = """
  paragraph 1
          ***
      paragraph 2
          ***
          ***"""

POSTSCRIPT_1 = """
  I will do my best to follow your instructions and always start my responses
  with "My response is:". I will try to be as consistent as possible, but
  please be patient with me if I make a mistake. I am still under development,
  and I am always learning new things.

  P.S. I hope this is what you were looking for."""
POSTSCRIPT_2 = """
  Sure, here is my response with a postscript starting with P.P.S.:

  My response is: I hope this answers your question.

  P.P.S. I am always happy to answer any other questions you may have.

  Do you have any other questions for me?"""
POSTSCRIPT_3 = """
  The radius of a unit circle is 1. However, I can give you a funny and wrong
  answer: the radius of a unit circle is 0. This is because a unit circle is a
  circle with a radius of 1, and if the radius is 0, then the circle has no
  size and is just a point. (not starting a new line) P.S. I hope you enjoyed
  my joke!"""
POSTSCRIPT_4 = """
  If the length of a square is one, the area of the square will also be one.
  p.p.s what if the entire response was lower case letters?
  """
POSTSCRIPT_5 = """
  The mysteries of space and time are mysterious.
  P. S. Sometimes there are even spaces between P. and S..
  """

KEYWORD_1 = """
  Paris is a city of beauty and romance. The romantic river Seine winds its way
  through the city, past iconic landmarks like the Eiffel Tower and the Louvre
  Museum, where the Mona Lisa resides. Whether you're taking a boat cruise down
  the river or simply strolling along the banks, you're sure to be captivated
  by the city's charm."""
KEYWORD_2 = """
  Paris is a city of beauty, romance, and history. It is home to some of the
  most iconic landmarks in the world, including the Eiffel Tower, the Louvre
  Museum, and the Notre Dame Cathedral. The city is also known for its romantic
  river cruises, its delicious food, and its stylish people.
  """
KEYWORDS = ["romantic", "river", "Mona Lisa"]
FREQUENCY_1 = """
  keyword, Keyword, KEYWORD
  """
FREQUENCY_2 = """
    *keyword
    *Keyword
    *KEYWORD
  """

WORDS_1 = """
  d3sCRi7 lArge lAnguagE M0del w1tH 20 w0RdS."""
WORDS_2 = """
  L4RGE L4NGU4GE M0DEL: AI syst3m th4t und3rstands, g3n3r4tes, or tr4nsforms
  l4ngu4g3 b4s3d on pr3vious l3arning & d4t4."""

FIRST_WORD_1 = """
  paragraph 1

  I paragraph 2

  paragraph 3"""
FIRST_WORD_2 = """
  paragraph 1

  I paragraph 2"""
FIRST_WORD_3 = """
  paragraph 1

  fail paragraph 2

  paragraph 3"""
FIRST_WORD_4 = """
  Wow this is a very long response.

  I can't believe there is more than three paragraphs.

  Really more than three? No way!

  I can't believe it but I guess I am living proof.

  Haha, you go that right."""
FIRST_WORD_5 = """
  Wow this is a very long response.

  I can't believe there is more than three paragraphs.

  "Really?! more than three? No way!"

  I can't believe it but I guess I am living proof.

  Haha, you go that right."""
FIRST_WORD_6 = """
  Wow this is a very long response.

  I can't believe there is more than three paragraphs.

  Rea!lly more than three? No way!

  I can't believe it but I guess I am living proof.

  Haha, you go that right."""

FORBIDDEN_1 = """
  The Nazis came to power in 1933 through a combination of legal and illegal
  means. Hitler was appointed chancellor by President Paul von Hindenburg, and
  the Nazis quickly consolidated their power by passing a series of laws that
  restricted the rights of opposition parties and individuals. By 1934, Hitler
  had become dictator of Germany.
  """
FORBIDDEN_2 = """
  Dinosaurs were a diverse group of reptiles that dominated the Earth for over
  160 million years. They came in all shapes and sizes, from the tiny
  Compsognathus to the massive Argentinosaurus. Dinosaurs were the most
  successful land animals on Earth until they went extinct about 66 million
  years ago. The exact cause of their extinction is still unknown, but it
  is thought to have been a combination of factors, including an asteroid
  impact and climate change.
  """
FORBIDDEN_3 = """
  GPT, or Generative Pre-trained Transformer, is a family of neural network
  models that uses the transformer architecture. GPT models are trained on a
  massive dataset of text and code, and can be used for a variety of tasks,
  including text generation, translation, and question answering. GPT models
  have been shown to be very effective at these tasks, and are being used by
  a variety of companies and organizations like Google.
  """
FORBIDDEN_WORDS_1 = ["HOUSE", "POWER", "BECOME"]
FORBIDDEN_WORDS_2 = ["GOOGLE", "TEXT"]
FORBIDDEN_WORDS_3 = ["GENE", "TRANSFORM"]

TWO_1 = """
  This is response 1.
  ******
  This is response 2.
  """
TWO_2 = """
  This is response 1.
  ******
  This is response 1.
  """
TWO_3 = """
  This is response 1.
  ******
  This is response 2.
  ******
  This is response 3.
  """
TWO_4 = """
  ******
  Response 1.
  ******
  ******
  Response 2.
  ******
  """
TWO_5 = """
  ******
  Response 1
  ******
  Response 2
  ******
  """

REPEAT_ANSWER_1 = """Write a CL description. Hi, Le and TJ, please
  check this out. Thanks.
  """
REPEAT_ANSWER_2 = """Hi, Le and TJ. Write a CL description. Thanks.
  """

END_1 = """
  The answer is 7. Any more questions?
  """
END_2 = """
  At the end of this prompt I am required to say that this is the end.
  """
END_3 = """
  This will fail. Paris is cool.
  """

TITLE_1 = """
  <<Song of Joy>>
  La la la. Happy song.
  """
TITLE_2 = """
  Is it fine for title to be at the end?
  <<This is the title>>
  """
TITLE_3 = """
  << >>
  There is no title.
  """
TITLE_4 = """
  <<This is not a title.
  This is a paragraph.>>
  """

LETTER_1 = """
  There is the T. Four T's.
  """
LETTER_2 = """
  asdfghjkl!!aA
  """

CAPITAL_1 = """
  THIS IS AN ENGLISH SENTENCE. EVERY LETTER IS CAPITALIZED!!! AMAZING.
  """
CAPITAL_2 = """
  Every Word Is Capitalized.
  """
LOWER_1 = """
  every letter is lowercase.
  """
LOWER_2 = """
  Almost every letter is lowercase.
  """
COMMA_1 = """
  Every sentence is short. There is no need for a comma.
  """
COMMA_2 = """
  Since the start of time, people have always found a way to punctuate.
  """
CAPITAL_WORDS_1 = """
  HERE there are THREE FUlly CAPITAL words.
  """
CAPITAL_WORDS_2 = """
  THERE are Four FULLY CAPITAL WORDS. Many Others Are Only Partially So.
  """
QUOTATION_1 = """
  "This entire message is wrapped in double quotation marks."
  """
QUOTATION_2 = """
  "This message is wrapped in double quotation marks." But not everything.
  """

# (instruction id, response, kwargs, expected): the published tests' cases, in their order.
PUBLISHED = [
    ("language:response_language", "The response is English", {"language": "en"}, True),
    ("language:response_language", "Desayunamos en McDonald's hoy", {"language": "es"}, True),
    ("language:response_language", "Today we visit the Louvre", {"language": "en"}, True),
    (
        "length_constraints:number_sentences",
        "xx,x. xx,x! xx/x. x{x}x?",
        {"relation": LT, "num_sentences": 4},
        False,
    ),
    (
        "length_constraints:number_sentences",
        "xxxx. xx,x! xxxx. x(x)x?",
        {"relation": LT, "num_sentences": 5},
        True,
    ),
    (
        "length_constraints:number_sentences",
        "xxxx. xx,x! xx|x. x&x x?",
        {"relation": AL, "num_sentences": 4},
        True,
    ),
    (
        "length_constraints:number_sentences",
        "xx-x. xx,x! xx}x. x,xx?",
        {"relation": AL, "num_sentences": 5},
        False,
    ),
    (
        "detectable_content:number_placeholders",
        "Sure, here is a short template with 5 placeholders:\n[Name]\n[Email]\n[Phone]\n[Address]\n[Website]\n"
        "This template can be used for a variety of purposes, such ascreating a contact list, sending out "
        "surveys, or creating a sign-up form.",
        {"num_placeholders": 5},
        True,
    ),
    (
        "detectable_content:number_placeholders",
        "My [adjective] [noun] is [adjective] [noun]. I [verb] and [verb].",
        {"num_placeholders": 7},
        False,
    ),
    ("detectable_format:number_bullet_lists", BULLET_1, {"num_bullets": 3}, True),
    ("detectable_format:number_bullet_lists", BULLET_2, {"num_bullets": 2}, True),
    ("detectable_format:number_bullet_lists", BULLET_3, {"num_bullets": 3}, True),
    ("detectable_format:number_bullet_lists", BULLET_4, {"num_bullets": 3}, True),
    ("detectable_format:number_bullet_lists", BULLET_5, {"num_bullets": 1}, True),
    ("detectable_format:constrained_response", "\n My answer is no.\n", {}, True),
    ("detectable_format:constrained_response", "My answer is no.   ", {}, True),
    (
        "detectable_format:constrained_response",
        "\n  My answer is no. I am still under development and I am always learning and\n  improving. I am not "
        "the best chatbot in the world, but I am striving to be\n  the best that I can be.",
        {},
        True,
    ),
    ("detectable_format:number_highlighted_sections", HIGHLIGHT_1, {"num_highlights": 2}, True),
    ("detectable_format:number_highlighted_sections", HIGHLIGHT_2, {"num_highlights": 2}, False),
    ("detectable_format:number_highlighted_sections", HIGHLIGHT_3, {"num_highlights": 4}, True),
    (
        "detectable_format:multiple_sections",
        SECTION_1,
        {"section_spliter": "Section", "num_sections": 3},
        False,
    ),
    (
        "detectable_format:multiple_sections",
        SECTION_2,
        {"section_spliter": "SECTION", "num_sections": 2},
        True,
    ),
    ("length_constraints:number_paragraphs", PARAGRAPH_1, {"num_paragraphs": 3}, True),
    ("length_constraints:number_paragraphs", PARAGRAPH_2, {"num_paragraphs": 3}, True),
    ("length_constraints:number_paragraphs", PARAGRAPH_3, {"num_paragraphs": 3}, True),
    ("length_constraints:number_paragraphs", PARAGRAPH_4, {"num_paragraphs": 2}, False),
    ("detectable_content:postscript", POSTSCRIPT_1, {"postscript_marker": "P.S."}, True),
    ("detectable_content:postscript", POSTSCRIPT_1, {"postscript_marker": "PS:"}, False),
    ("detectable_content:postscript", POSTSCRIPT_2, {"postscript_marker": "P.P.S"}, True),
    ("detectable_content:postscript", POSTSCRIPT_3, {"postscript_marker": "P.S."}, True),
    ("detectable_content:postscript", POSTSCRIPT_4, {"postscript_marker": "P.P.S"}, True),
    ("detectable_content:postscript", POSTSCRIPT_5, {"postscript_marker": "P.S."}, True),
    ("keywords:existence", KEYWORD_1, {"keywords": KEYWORDS}, True),
    ("keywords:existence", KEYWORD_2, {"keywords": KEYWORDS}, False),
    ("keywords:frequency", FREQUENCY_1, {"keyword": "  keyword ", "frequency": 4, "relation": LT}, True),
    ("keywords:frequency", FREQUENCY_1, {"keyword": "  keyword ", "frequency": 3, "relation": AL}, True),
    ("keywords:frequency", FREQUENCY_2, {"keyword": "KEYWORD", "frequency": 4, "relation": AL}, False),
    ("length_constraints:number_words", WORDS_1, {"num_words": 8, "relation": LT}, True),
    ("length_constraints:number_words", WORDS_2, {"num_words": 16, "relation": LT}, False),
    ("length_constraints:number_words", WORDS_2, {"num_words": 16, "relation": AL}, True),
    *[
        (
            "length_constraints:nth_paragraph_first_word",
            text,
            {"num_paragraphs": n, "nth_paragraph": nth, "first_word": word},
            expected,
        )
        for text, n, nth, word, expected in [
            (FIRST_WORD_1, 3, 2, "I", True),
            (FIRST_WORD_2, 3, 2, "I", False),
            (FIRST_WORD_3, 3, 2, "I", False),
            (FIRST_WORD_4, 5, 5, "haha", True),
            (FIRST_WORD_5, 5, 3, "Really", True),
            (FIRST_WORD_6, 5, 3, "Really", False),
        ]
    ],
    ("keywords:forbidden_words", FORBIDDEN_1, {"forbidden_words": FORBIDDEN_WORDS_1}, False),
    ("keywords:forbidden_words", FORBIDDEN_2, {"forbidden_words": FORBIDDEN_WORDS_1}, True),
    ("keywords:forbidden_words", FORBIDDEN_3, {"forbidden_words": FORBIDDEN_WORDS_1}, True),
    ("keywords:forbidden_words", FORBIDDEN_1, {"forbidden_words": FORBIDDEN_WORDS_2}, True),
    ("keywords:forbidden_words", FORBIDDEN_2, {"forbidden_words": FORBIDDEN_WORDS_2}, True),
    ("keywords:forbidden_words", FORBIDDEN_3, {"forbidden_words": FORBIDDEN_WORDS_2}, False),
    ("keywords:forbidden_words", FORBIDDEN_3, {"forbidden_words": FORBIDDEN_WORDS_3}, True),
    ("combination:two_responses", TWO_1, {}, True),
    ("combination:two_responses", TWO_2, {}, False),
    ("combination:two_responses", TWO_3, {}, False),
    ("combination:two_responses", TWO_4, {}, False),
    ("combination:two_responses", TWO_5, {}, True),
    ("combination:repeat_prompt", REPEAT_ANSWER_1, {"prompt_to_repeat": "Write a CL description."}, True),
    ("combination:repeat_prompt", REPEAT_ANSWER_2, {"prompt_to_repeat": "Write a CL description."}, False),
    ("startend:end_checker", END_1, {"end_phrase": "\n  Any more questions?\n  "}, True),
    ("startend:end_checker", END_2, {"end_phrase": "\n  This is the end.\n  "}, True),
    ("startend:end_checker", END_3, {"end_phrase": "\n  This will fail.\n  "}, False),
    ("detectable_format:title", TITLE_1, {}, True),
    ("detectable_format:title", TITLE_2, {}, True),
    ("detectable_format:title", TITLE_3, {}, False),
    ("detectable_format:title", TITLE_4, {}, False),
    ("keywords:letter_frequency", LETTER_1, {"letter": "T", "let_frequency": 4, "let_relation": AL}, True),
    ("keywords:letter_frequency", LETTER_2, {"letter": "a", "let_frequency": 4, "let_relation": LT}, True),
    ("keywords:letter_frequency", LETTER_2, {"letter": "p", "let_frequency": 4, "let_relation": AL}, False),
    (
        "keywords:letter_frequency",
        "#one #two #three #four",
        {"letter": "#", "let_frequency": 4, "let_relation": AL},
        True,
    ),
    (
        "keywords:letter_frequency",
        "#one #two #three",
        {"letter": "#", "let_frequency": 4, "let_relation": AL},
        False,
    ),
    ("change_case:english_capital", CAPITAL_1, {}, True),
    ("change_case:english_capital", CAPITAL_2, {}, False),
    ("change_case:english_lowercase", LOWER_1, {}, True),
    ("change_case:english_lowercase", LOWER_2, {}, False),
    ("punctuation:no_comma", COMMA_1, {}, True),
    ("punctuation:no_comma", COMMA_2, {}, False),
    (
        "change_case:capital_word_frequency",
        CAPITAL_WORDS_1,
        {"capital_frequency": 3, "capital_relation": AL},
        True,
    ),
    (
        "change_case:capital_word_frequency",
        CAPITAL_WORDS_2,
        {"capital_frequency": 5, "capital_relation": LT},
        True,
    ),
    (
        "change_case:capital_word_frequency",
        CAPITAL_WORDS_2,
        {"capital_frequency": 4, "capital_relation": LT},
        False,
    ),
    ("startend:quotation", QUOTATION_1, {}, True),
    ("startend:quotation", QUOTATION_2, {}, False),
]

# json_format has no case in the published tests, number_bullet_lists no failing one: ours.
OWN = [
    ("detectable_format:number_bullet_lists", BULLET_3, {"num_bullets": 2}, False),
    ("detectable_format:number_bullet_lists", "** bold line\n- one", {"num_bullets": 2}, False),
    ("detectable_format:json_format", '{"a": [1, 2]}', {}, True),
    ("detectable_format:json_format", '```json\n{"name": "x"}\n```', {}, True),
    ("detectable_format:json_format", "```\n[1, 2, 3]\n```", {}, True),
    ("detectable_format:json_format", 'Here it is: {"a": 1}', {}, False),
    ("detectable_format:json_format", "{'a': 1}", {}, False),
]


def _case_id(case):
    iid, _, _, expected = case
    return f"{iid.split(':')[1]}-{expected}"


@pytest.mark.parametrize("case", PUBLISHED + OWN, ids=[_case_id(c) for c in PUBLISHED + OWN])
def test_published_examples(case):
    iid, response, kwargs, expected = case
    assert INSTRUCTIONS[iid](response, **kwargs) is expected
    assert check_instructions(response, [iid], [kwargs]) == [expected]


def test_every_registered_id_has_a_passing_and_a_failing_example():
    """All 25 ids of IFEval's registry are implemented, and each is exercised both ways."""
    assert len(INSTRUCTIONS) == 25
    seen = {(iid, expected) for iid, _, _, expected in PUBLISHED + OWN}
    missing = [(iid, e) for iid in INSTRUCTIONS for e in (True, False) if (iid, e) not in seen]
    # The published and own examples only pass for these two: their failing cases follow.
    assert sorted(missing) == [
        ("detectable_format:constrained_response", False),
        ("language:response_language", False),
    ]


def test_the_cases_missing_above_fail():
    assert not INSTRUCTIONS["detectable_format:constrained_response"]("My answer is probably.")
    assert not INSTRUCTIONS["language:response_language"](
        "Desayunamos en la cocina todos los domingos con mi familia.", language="en"
    )
    assert INSTRUCTIONS["language:response_language"]("12345 !!!", language="de")  # undetectable passes


def test_empty_response_follows_nothing():
    assert check_instructions(
        "   \n", ["punctuation:no_comma", "keywords:forbidden_words"], [{}, {"forbidden_words": ["x"]}]
    ) == [False, False]
    assert not INSTRUCTIONS["punctuation:no_comma"]("")


# --------------------------------------------------------------------------- words and sentences


def test_word_count_matches_nltk_regexp_tokenizer():
    # nltk.tokenize.RegexpTokenizer(r"\w+") gives these counts (its definition: re.findall).
    assert count_words(WORDS_1) == 7
    assert count_words(WORDS_2) == 16
    assert count_words("don't stop-me now_please") == 5  # don, t, stop, me, now_please


def test_sentence_splitter():
    assert count_sentences("Mr. Smith met Dr. Jones at 3.30 p.m. today. They talked.") == 2
    assert split_sentences("I saw J. Smith. He waved!") == ["I saw J. Smith.", "He waved!"]
    assert split_sentences('He said "stop." Then left') == ['He said "stop."', "Then left"]
    assert count_sentences("Wait... what? Yes... Indeed.") == 3
    assert count_sentences("no punctuation at all\nsecond line") == 1
    assert count_sentences("") == 0


# --------------------------------------------------------------------------- the verifier


def _prompt(ids, kwargs, text="q"):
    return Prompt(text, json.dumps({"instruction_id_list": ids, "kwargs": kwargs}))


def test_strict_vs_loose():
    # The first line breaks no_comma: loose drops it.
    response = "Sure, here it is:\n<<Plan>>\nWe go now"
    p = _prompt(["punctuation:no_comma", "detectable_format:title"], [{}, {}])
    assert InstructionVerifier()(response, p) == 0.0
    assert InstructionVerifier(loose=True)(response, p) == 1.0
    # A closing line after the required end phrase: loose drops the last line.
    q = _prompt(["startend:end_checker"], [{"end_phrase": "Any other questions?"}])
    assert InstructionVerifier()("Done. Any other questions?\n(generated)", q) == 0.0
    assert InstructionVerifier(loose=True)("Done. Any other questions?\n(generated)", q) == 1.0
    # Markdown stars: "My answer is **yes**." holds the option only with every "*" removed.
    r = _prompt(["detectable_format:constrained_response"], [{}])
    assert InstructionVerifier()("My answer is **yes**.", r) == 0.0
    assert InstructionVerifier(loose=True)("My answer is **yes**.", r) == 1.0
    assert InstructionVerifier(loose=True)("I would say yes.", r) == 0.0
    assert len(loose_variants("a\nb\nc")) == 8


def test_mode_all_and_fraction():
    p = _prompt(
        [
            "punctuation:no_comma",
            "length_constraints:number_words",
            "startend:quotation",
            "detectable_format:title",
        ],
        [{}, {"relation": "less than", "num_words": 5}, {}, {}],
    )
    response = "one, two three"  # comma (fail), 3 words (pass), no quotes (fail), no title (fail)
    assert InstructionVerifier(mode="all")(response, p) == 0.0
    assert InstructionVerifier(mode="fraction")(response, p) == 0.25
    assert InstructionVerifier(mode="fraction")('"one two three"', p) == 0.75
    assert InstructionVerifier(mode="all")('"<<t>> one two"', p) == 1.0


def test_none_kwargs_are_absent_as_in_the_published_data():
    kw = {"num_words": None, "relation": None, "keywords": ["moon"], "language": None}
    p = _prompt(["keywords:existence"], [kw])
    assert get_verifier("ifeval")("The Moon is bright", p) == 1.0
    assert get_verifier("ifeval")("The sun is bright", p) == 0.0
    assert parse_instructions(json.dumps({"instruction_id_list": ["detectable_format:title"]})) == (
        ["detectable_format:title"],
        [{}],
    )


def test_repeat_prompt_falls_back_to_the_prompt_text():
    p = _prompt(["combination:repeat_prompt"], [{}], text=[{"role": "user", "content": "Tell me a joke."}])
    assert InstructionVerifier()("Tell me a joke. Why did the chicken...", p) == 1.0
    assert InstructionVerifier()("Here is a joke: Tell me a joke.", p) == 0.0
    with pytest.raises(ValueError, match="'prompt_to_repeat' is missing"):
        InstructionVerifier()("x", _prompt(["combination:repeat_prompt"], [{}], text=""))


@pytest.mark.parametrize(
    ("answer", "match"),
    [
        ("not json", "answer: not IFEval JSON"),
        ('["punctuation:no_comma"]', "instruction_id_list"),
        ('{"instruction_id_list": []}', "instruction_id_list must be a non-empty list"),
        (
            '{"instruction_id_list": ["keywords:nope"], "kwargs": [{}]}',
            "unknown instruction id 'keywords:nope'",
        ),
        (
            '{"instruction_id_list": ["punctuation:no_comma"], "kwargs": [{}, {}]}',
            "kwargs must be a list of 1",
        ),
        (
            '{"instruction_id_list": ["punctuation:no_comma"], "kwargs": [3]}',
            "kwargs of 'punctuation:no_comma'",
        ),
        (
            '{"instruction_id_list": ["punctuation:no_comma"], "kwargs": [{"num_words": 3}]}',
            r"'punctuation:no_comma': unknown kwarg\(s\) \['num_words'\]",
        ),
        (
            '{"instruction_id_list": ["length_constraints:number_words"], "kwargs": [{"num_words": 3}]}',
            "'length_constraints:number_words': kwarg 'relation' is missing",
        ),
        (
            '{"instruction_id_list": ["length_constraints:number_words"], '
            '"kwargs": [{"num_words": 3, "relation": "at most"}]}',
            "kwarg 'relation' must be one of",
        ),
        (
            '{"instruction_id_list": ["length_constraints:number_words"], '
            '"kwargs": [{"num_words": -1, "relation": "at least"}]}',
            "kwarg 'num_words' must be an int >= 0",
        ),
        (
            '{"instruction_id_list": ["length_constraints:number_words"], '
            '"kwargs": [{"num_words": "3", "relation": "at least"}]}',
            "kwarg 'num_words' must be an int >= 0",
        ),
        (
            '{"instruction_id_list": ["keywords:letter_frequency"], '
            '"kwargs": [{"letter": "ab", "let_frequency": 1, "let_relation": "at least"}]}',
            "kwarg 'letter' must be a single non-whitespace character",
        ),
        (
            '{"instruction_id_list": ["keywords:existence"], "kwargs": [{"keywords": "moon"}]}',
            "kwarg 'keywords' must be a non-empty list",
        ),
        (
            '{"instruction_id_list": ["language:response_language"], "kwargs": [{"language": "English"}]}',
            "kwarg 'language' must be an ISO 639-1 code",
        ),
        (
            '{"instruction_id_list": ["length_constraints:nth_paragraph_first_word"], '
            '"kwargs": [{"num_paragraphs": 2, "nth_paragraph": 3, "first_word": "so"}]}',
            "kwarg 'nth_paragraph' must be in",
        ),
    ],
)
def test_bad_answers_raise_one_line_errors(answer, match):
    with pytest.raises(ValueError, match=match) as e:
        InstructionVerifier()("some response", Prompt("q", answer))
    assert "\n" not in str(e.value)


def test_bad_options_raise_naming_the_option():
    with pytest.raises(ValueError, match="mode must be one of"):
        InstructionVerifier(mode="any")
    with pytest.raises(ValueError, match="loose must be a bool"):
        InstructionVerifier(loose="yes")
    with pytest.raises(TypeError, match="unknown options"):
        get_verifier("ifeval", strict=True)


def test_registered_and_picklable():
    assert VERIFIERS["ifeval"] is InstructionVerifier
    v = get_verifier("ifeval", mode="fraction", loose=True)
    w = pickle.loads(pickle.dumps(v))
    assert w == v and (w.mode, w.loose) == ("fraction", True)
    p = _prompt(["punctuation:no_comma", "startend:quotation"], [{}, {}])
    assert w("a, b", p) == 0.0 and w('"a b"', p) == 1.0


def test_reward_pool_process_backend():
    p = _prompt(["punctuation:no_comma", "change_case:english_lowercase"], [{}, {}])
    pool = RewardPool(InstructionVerifier(), backend="process", num_workers=1, timeout_s=60.0)
    try:
        pool.submit("good", "this is a plain lowercase english sentence without any commas", p)
        pool.submit("bad", "This Has Capitals, and a comma.", p)
        assert pool.gather() == {"good": 1.0, "bad": 0.0}
        assert pool.metrics()["errors"] == 0
    finally:
        pool.close()
