"""LLM-as-a-judge rewards: a judge model, asked through a rollout engine, grades each response.

Single-answer grading with a reference answer (Zheng et al. 2023, "Judging LLM-as-a-Judge with
MT-Bench and Chatbot Arena", arXiv:2306.05685): the judge reads the question, the reference
answer and the response and ends with ``Score: N``; the reward is ``(N - min_score) /
(max_score - min_score)``, or ``invalid_score`` when :func:`parse_judgment` rejects the
judgment. The parser is strict (one ``score:`` marker, a plain decimal number on its line,
nothing after it, in range, not truncated), so a malformed judgment never becomes a reward by
accident; each rejection is counted by reason (:data:`INVALID_REASONS`). The rules, the
template fields and measurements: ``docs/rewards-workers.md`` (LLM-as-a-judge rewards).

>>> parse_judgment("The response matches the reference.\\nScore: 8")
Judgment(score=8.0, reason='ok')
>>> parse_judgment("Score: 8\\nScore: 9").reason, parse_judgment("Score: 11").reason
('multiple_scores', 'out_of_range')
"""

from __future__ import annotations

import collections
import math
import re
import string
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from trainers.data import Prompt, has_chat_template
from trainers.engines.base import SamplingParams
from trainers.engines.hf_rollout import HFRolloutEngine
from trainers.models import char_tokenizer, default_model_path, load_model, tiny_qwen2

__all__ = [
    "DEFAULT_TEMPLATE",
    "INVALID_REASONS",
    "TEMPLATE_FIELDS",
    "JudgeReward",
    "Judgment",
    "normalize_score",
    "parse_judgment",
]

#: The default judge prompt: single-answer grading against a reference answer, ending with
#: ``Score: N`` on a scale of ``min_score`` to ``max_score``.
DEFAULT_TEMPLATE = (
    "You are an impartial judge. Grade the response to the question below. The reference "
    "answer is correct: judge whether the response agrees with it.\n\n"
    "[Question]\n{question}\n\n"
    "[Reference answer]\n{reference}\n\n"
    "[Response]\n{response}\n\n"
    "Explain your judgment in one or two sentences, then end with a last line of the form "
    '"Score: N", where N is an integer from {min_score} (wrong) to {max_score} (fully correct).'
)

#: The fields a template may use (``response`` is required).
TEMPLATE_FIELDS = ("question", "reference", "response", "min_score", "max_score")

#: Why a judgment was rejected, in the order the rules are checked: ``empty`` (only
#: whitespace), ``no_score`` / ``multiple_scores`` (not exactly one marker: the ASCII word
#: ``score``, any case, then a colon), ``bad_number`` (no plain decimal number on the marker's
#: line), ``trailing_text`` (anything but whitespace after it), ``out_of_range`` and
#: ``truncated`` (the judgment reached ``max_tokens``; :class:`JudgeReward` only).
INVALID_REASONS = (
    "empty",
    "no_score",
    "multiple_scores",
    "bad_number",
    "trailing_text",
    "out_of_range",
    "truncated",
)

_MARKER = re.compile(r"\bscore\s*:", re.IGNORECASE | re.ASCII)  # ASCII: no 'ſcore', no Unicode digits
_NUMBER = re.compile(r"[ \t]*([+-]?[0-9]+(?:\.[0-9]+)?)")


@dataclass(frozen=True)
class Judgment:
    """A parsed judgment: ``score`` (the raw score, ``None`` when rejected) and ``reason``
    (``"ok"`` or one of :data:`INVALID_REASONS`)."""

    score: float | None
    reason: str

    @property
    def ok(self) -> bool:
        return self.reason == "ok"


def _check_range(min_score: float, max_score: float) -> None:
    for name, v in (("min_score", min_score), ("max_score", max_score)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"{name} must be a finite number, got {v!r}")
    if not min_score < max_score:
        raise ValueError(f"min_score must be < max_score, got {min_score} and {max_score}")


def parse_judgment(text: str, *, min_score: float = 0, max_score: float = 10) -> Judgment:
    """The score of a judgment that ends with ``Score: N``, under the strict rules of
    :data:`INVALID_REASONS` (one marker, a plain decimal number on its line, nothing after it,
    in range).

    >>> parse_judgment("Correct.\\nScore: 10").score, parse_judgment("score:7.5  \\n").score
    (10.0, 7.5)
    >>> [parse_judgment(t).reason for t in ("", "Great!", "Score: 7/10", "Score: seven", "Score: -1")]
    ['empty', 'no_score', 'trailing_text', 'bad_number', 'out_of_range']
    """
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    _check_range(min_score, max_score)
    if not text.strip():
        return Judgment(None, "empty")
    markers = list(_MARKER.finditer(text))
    if not markers:
        return Judgment(None, "no_score")
    if len(markers) > 1:
        return Judgment(None, "multiple_scores")
    num = _NUMBER.match(text, markers[0].end())
    if num is None:
        return Judgment(None, "bad_number")
    if text[num.end() :].strip():
        return Judgment(None, "trailing_text")
    value = float(num.group(1)) + 0.0  # + 0.0: "-0" is 0.0
    if not min_score <= value <= max_score:
        return Judgment(None, "out_of_range")
    return Judgment(value, "ok")


def normalize_score(score: float, min_score: float, max_score: float) -> float:
    """``(score - min_score) / (max_score - min_score)``, in ``[0, 1]`` for an in-range score.

    >>> normalize_score(7, 0, 10), normalize_score(1, 1, 10)
    (0.7, 0.0)
    """
    return (score - min_score) / (max_score - min_score) + 0.0


def _check_template(template: str) -> None:
    if not isinstance(template, str):
        raise TypeError(f"template must be a str, got {type(template).__name__}")
    try:
        fields = {f for _, f, _, _ in string.Formatter().parse(template) if f is not None}
    except ValueError as e:
        raise ValueError(f"template: not a valid format string: {e}") from None
    unknown = sorted(f for f in fields if f not in TEMPLATE_FIELDS)
    if unknown:
        raise ValueError(
            f"template: unknown fields {unknown} (use {{question}}, {{reference}}, {{response}}, "
            "{min_score}, {max_score}; write literal braces as {{ and }})"
        )
    if "response" not in fields:
        raise ValueError("template: must contain the {response} field")


def _fmt(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


class JudgeReward:
    """A judge model's grade of ``(completion, prompt)``, normalised to ``[0, 1]``.

    Args:
        engine: a rollout engine (anything with ``generate(token_prompts, SamplingParams)``
            returning :class:`~trainers.engines.base.Generation` s, e.g.
            :class:`~trainers.engines.HFRolloutEngine` or ``VLLMRolloutEngine``). Give
            ``engine`` or ``model``, not both.
        tokenizer: encodes judge prompts and decodes judgments; default ``engine.tokenizer``.
        model: build the judge engine (an ``HFRolloutEngine``) on first use, in the process that
            uses it: ``""`` is the embedded SmolLM2-135M-Instruct
            (:func:`trainers.models.default_model_path`), ``"tiny"`` the tiny random Qwen2 with
            the character tokenizer (tests: its judgments are noise), else a Hugging Face
            checkpoint directory. With ``model`` the verifier pickles without its engine, so a
            process pool's workers each build their own in ``setup()``.
        template: the judge prompt, a ``str.format`` template over :data:`TEMPLATE_FIELDS`
            (``{question}``: the prompt's text, chat messages joined by newlines;
            ``{reference}``: ``prompt.answer``; ``{response}``: the completion;
            ``{min_score}`` / ``{max_score}``). It must contain ``{response}``.
        min_score, max_score: the scale the judge is asked for; a score outside it is invalid.
        invalid_score: the reward of a rejected judgment (default 0.0), any finite number.
        max_tokens: the most tokens of one judgment (decoding is greedy); a judgment that
            reaches it is ``truncated``.
        chat_template: ``"auto"`` (the tokenizer's chat template, one user message, when it
            has one), ``"on"`` or ``"off"`` (the plain prompt text).
        device, max_batch_size: for the engine built from ``model``.

    :meth:`metrics` counts, over this object's life in this process: ``judged``, ``valid``,
    ``invalid`` and ``invalid/<reason>`` for each of :data:`INVALID_REASONS` (in a process or
    Ray pool these counts stay in the workers). ``recent_invalid`` keeps the last 20 rejected
    ``(reason, judgment)`` pairs and ``last_judgments`` the ``(judge prompt, judgment,
    Judgment)`` triples of the last call.

    >>> from trainers.engines import HFRolloutEngine
    >>> from trainers.models import char_tokenizer, tiny_qwen2
    >>> tok = char_tokenizer()
    >>> judge = JudgeReward(HFRolloutEngine(tiny_qwen2(tok), tok), max_tokens=8)
    >>> rewards = judge.score_batch(["46", "45"], [Prompt("12+34=", "46")] * 2)
    >>> all(r == 0.0 or 0.0 <= r <= 1.0 for r in rewards), judge.metrics()["judged"]
    (True, 2.0)
    """

    def __init__(
        self,
        engine: Any = None,
        tokenizer: Any = None,
        *,
        model: str | None = None,
        template: str = DEFAULT_TEMPLATE,
        min_score: float = 0,
        max_score: float = 10,
        invalid_score: float = 0.0,
        max_tokens: int = 64,
        chat_template: str = "auto",
        device: str = "cpu",
        max_batch_size: int | None = None,
    ) -> None:
        if (engine is None) == (model is None):
            raise ValueError("give a judge engine or a judge model (a path, '' or 'tiny'), exactly one")
        if engine is not None and not callable(getattr(engine, "generate", None)):
            raise TypeError(
                f"engine must have a generate(prompts, params) method, got {type(engine).__name__}"
            )
        if model is not None and not isinstance(model, str):
            raise TypeError(
                f"model must be a str (a checkpoint directory, '' or 'tiny'), got {type(model).__name__}"
            )
        if engine is not None and tokenizer is None:
            tokenizer = getattr(engine, "tokenizer", None)
            if tokenizer is None:
                raise ValueError("tokenizer: required when the engine has no .tokenizer")
        _check_template(template)
        _check_range(min_score, max_score)
        if (
            isinstance(invalid_score, bool)
            or not isinstance(invalid_score, (int, float))
            or not math.isfinite(invalid_score)
        ):
            raise ValueError(f"invalid_score must be a finite number, got {invalid_score!r}")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {max_tokens!r}")
        if chat_template not in ("auto", "on", "off"):
            raise ValueError(f"chat_template must be auto, on or off, got {chat_template!r}")
        self.engine, self.tokenizer, self.model = engine, tokenizer, model
        self.template = template
        self.min_score, self.max_score = min_score, max_score
        self.invalid_score = float(invalid_score)
        self.max_tokens = max_tokens
        self.chat_template = chat_template
        self.device, self.max_batch_size = device, max_batch_size
        self._lock = threading.Lock()
        self._counts = collections.Counter[str]()
        self.recent_invalid: collections.deque[tuple[str, str]] = collections.deque(maxlen=20)
        self.last_judgments: list[tuple[str, str, Judgment]] = []

    # ------------------------------------------------------------------ engine

    def setup(self) -> None:
        """Build the judge engine (with ``model``); a :class:`~trainers.rewards.RewardPool`
        worker calls it once before its first sample."""
        self._ensure_engine()

    def _ensure_engine(self) -> tuple[Any, Any]:
        if self.engine is None:
            if self.model == "tiny":
                tok = char_tokenizer()
                net = tiny_qwen2(tok, seed=0)
            else:
                net, tok = load_model(self.model or default_model_path())
            self.engine = HFRolloutEngine(net, tok, device=self.device, max_batch_size=self.max_batch_size)
            self.tokenizer = tok
        return self.engine, self.tokenizer

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        del state["_lock"]
        if self.model is not None:  # rebuilt from `model` where it is unpickled
            state["engine"] = state["tokenizer"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ judging

    def judge_prompt(self, completion: str, prompt: Prompt) -> str:
        """The text sent to the judge for one sample (the template with its fields filled in)."""
        question = prompt.text
        if not isinstance(question, str):
            question = "\n".join(str(m["content"]) for m in question)
        return self.template.format(
            question=question,
            reference=prompt.answer,
            response=completion,
            min_score=_fmt(self.min_score),
            max_score=_fmt(self.max_score),
        )

    def _encode(self, text: str) -> list[int]:
        tok = self.tokenizer
        if self.chat_template == "on" or (self.chat_template == "auto" and has_chat_template(tok)):
            ids = tok.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
            )
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
            return list(ids)
        return list(tok(text, add_special_tokens=False).input_ids)

    def score_batch(self, completions: Sequence[str], prompts: Sequence[Prompt]) -> list[float]:
        """Rewards of ``completions[i]`` for ``prompts[i]``; every judge prompt goes to the engine
        in one ``generate`` call (greedy, ``max_tokens``)."""
        if len(completions) != len(prompts):
            raise ValueError(f"prompts: {len(prompts)} prompts for {len(completions)} completions")
        for c in completions:
            if not isinstance(c, str):
                raise TypeError(f"completions must be str, got {type(c).__name__}")
        if not completions:
            return []
        engine, tok = self._ensure_engine()
        texts = [self.judge_prompt(c, p) for c, p in zip(completions, prompts)]
        params = SamplingParams(n=1, temperature=0.0, max_tokens=self.max_tokens, seed=0)
        gens = sorted(engine.generate([self._encode(t) for t in texts], params), key=lambda g: g.prompt_index)
        if len(gens) != len(texts):
            raise RuntimeError(f"the judge engine returned {len(gens)} judgments for {len(texts)} prompts")
        out, last = [], []
        for text, g in zip(texts, gens):
            judgment = tok.decode(g.token_ids, skip_special_tokens=True)
            j = parse_judgment(judgment, min_score=self.min_score, max_score=self.max_score)
            if g.finish_reason == "length":
                j = Judgment(None, "truncated")
            last.append((text, judgment, j))
            if j.score is None:
                out.append(self.invalid_score)
            else:
                out.append(normalize_score(j.score, self.min_score, self.max_score))
        with self._lock:
            self.last_judgments = last
            for _, judgment, j in last:
                self._counts["judged"] += 1
                if j.ok:
                    self._counts["valid"] += 1
                else:
                    self._counts["invalid"] += 1
                    self._counts[f"invalid/{j.reason}"] += 1
                    self.recent_invalid.append((j.reason, judgment))
        return out

    def __call__(self, completion: str, prompt: Prompt) -> float:
        """The reward of one sample (one judge call); a verifier for a RewardPool."""
        return self.score_batch([completion], [prompt])[0]

    def metrics(self) -> dict[str, float]:
        """``judged``, ``valid``, ``invalid`` and ``invalid/<reason>`` (class docstring)."""
        with self._lock:
            keys = ("judged", "valid", "invalid", *(f"invalid/{r}" for r in INVALID_REASONS))
            return {k: float(self._counts[k]) for k in keys}
