"""LLM-as-a-judge rewards: a judge model, asked through a rollout engine, grades each response.

Single-answer grading with a reference answer (Zheng et al. 2023, "Judging LLM-as-a-Judge with
MT-Bench and Chatbot Arena", arXiv:2306.05685): the judge reads the question, the reference
answer and the response and ends with ``Score: N``; the reward is ``(N - min_score) /
(max_score - min_score)``, or ``invalid_score`` when :func:`parse_judgment` rejects the
judgment. The parser is strict (one ``score:`` marker, a plain decimal number on its line,
nothing after it, in range, not truncated), so a malformed judgment never becomes a reward by
accident; each rejection is counted by reason (:data:`INVALID_REASONS`). The rules, the
template fields and measurements: ``docs/rewards-workers.md`` (LLM-as-a-judge rewards).

The judge runs in process (an engine, or a model built on first use) or is served: with
``server_url`` every judgment is a request to a running ``vllm serve`` through rollkit's
:class:`~trainers.engines.vllm_server.ServerClient`, with a deadline (``timeout_s``).

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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from trainers.data import Prompt, has_chat_template
from trainers.engines.base import SamplingParams
from trainers.engines.hf_rollout import HFRolloutEngine
from trainers.engines.vllm_server import ServerClient, ServerError, resolve_api_key
from trainers.models import char_tokenizer, default_model_path, load_model, tiny_qwen2

__all__ = [
    "DEFAULT_TEMPLATE",
    "DEFAULT_TIMEOUT_S",
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

#: a served judge's deadline per request when ``timeout_s`` is not given: under the reward
#: pool's default ``reward.timeout_s`` (10 s), so the judge's error comes before the pool's timeout
DEFAULT_TIMEOUT_S = 8.0
#: the most judge requests of one :meth:`JudgeReward.score_batch` in flight at once (served judge)
MAX_CONCURRENT_REQUESTS = 16

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


def _check_served(
    server_url: Any, engine: Any, tokenizer: Any, model: Any, device: Any, max_batch_size: Any
) -> None:
    """A served judge's settings: an http(s) address and nothing that builds a local judge."""
    if not isinstance(server_url, str) or not server_url.startswith(("http://", "https://")):
        raise ValueError(f"server_url must look like http://host:port, got {server_url!r}")
    given = {"engine": engine is not None, "tokenizer": tokenizer is not None, "device": device != "cpu"}
    given["max_batch_size"] = max_batch_size is not None
    for field in (f for f, g in given.items() if g):
        raise ValueError(f"{field}: not used by a served judge (server_url is set): leave it out")
    if model not in (None, ""):
        raise ValueError(
            f"judge_model: {model!r} contradicts server_url (the served model is the judge): leave it empty"
        )


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
        server_url: ``"http://host:port"`` of a running ``vllm serve``: the served model is the
            judge. Each judgment is one request through
            :class:`~trainers.engines.vllm_server.ServerClient` (greedy, ``max_tokens``, at most
            ``timeout_s`` per request; a batch's requests run concurrently), the same judge
            prompt and :func:`parse_judgment`, the same counters. The server tokenizes and
            applies its own chat template: ``chat_template`` ``"on"`` asks
            ``/v1/chat/completions`` (one user message), ``"off"`` ``/v1/completions`` (the
            plain text, no special tokens added, as in process), ``"auto"`` the chat endpoint
            until the server answers that its model has no chat template, then the plain one.
            A timeout, an unreachable server or an error answer raises
            :class:`~trainers.engines.vllm_server.ServerError` naming the URL (in a
            :class:`~trainers.rewards.RewardPool` the sample scores 0 and counts as an error).
            Nothing is built locally, so ``model`` must be ``None`` or ``""`` (the config's
            default, ``reward.judge_model``), and ``engine``, ``tokenizer``, ``device`` and
            ``max_batch_size`` must be left out. The judge pickles as plain settings (no open
            connection), so process and Ray pools' workers each ask the server.
        served_model: the model name sent to the server (``--served-model-name``); default the
            one base model its ``GET /v1/models`` lists (asked once). Only with ``server_url``.
        timeout_s: the deadline of each request to the server, a number > 0 (default
            :data:`DEFAULT_TIMEOUT_S`, under the reward pool's default ``timeout_s``). Only
            with ``server_url``.
        api_key: the server's API key, sent with every request; ``None``: the key of the
            server this process started at ``server_url``, else the ``VLLM_API_KEY``
            environment variable, else none
            (:func:`~trainers.engines.vllm_server.resolve_api_key`), found once, here, so
            a pool's workers use it too. Only with ``server_url``.

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
        server_url: str | None = None,
        served_model: str | None = None,
        timeout_s: float | None = None,
        api_key: str | None = None,
    ) -> None:
        if server_url is not None:
            _check_served(server_url, engine, tokenizer, model, device, max_batch_size)
            model = None  # "" (the config's default judge_model) is no local model here
        elif served_model is not None or timeout_s is not None or api_key is not None:
            given = {"served_model": served_model, "timeout_s": timeout_s, "api_key": api_key}
            field = next(f for f, v in given.items() if v is not None)
            raise ValueError(f"{field}: only for a served judge (give server_url)")
        elif (engine is None) == (model is None):
            raise ValueError(
                "give a judge engine, a judge model (a path, '' or 'tiny') or a server_url, exactly one"
            )
        if served_model is not None and (not isinstance(served_model, str) or not served_model):
            raise ValueError(f"served_model must be a non-empty str, got {served_model!r}")
        if timeout_s is not None and (
            isinstance(timeout_s, bool)
            or not isinstance(timeout_s, (int, float))
            or not math.isfinite(timeout_s)
            or timeout_s <= 0
        ):
            raise ValueError(f"timeout_s must be a finite number > 0, got {timeout_s!r}")
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
        self.server_url = None if server_url is None else server_url.rstrip("/")
        self.served_model = served_model
        self.timeout_s = None if server_url is None else float(timeout_s or DEFAULT_TIMEOUT_S)
        self._api_key = None if server_url is None else resolve_api_key(server_url, api_key)
        self._served_chat: bool | None = None  # "auto": does the server's model have a chat template
        self._lock = threading.Lock()
        self._counts = collections.Counter[str]()
        self.recent_invalid: collections.deque[tuple[str, str]] = collections.deque(maxlen=20)
        self.last_judgments: list[tuple[str, str, Judgment]] = []

    # ------------------------------------------------------------------ engine

    def setup(self) -> None:
        """Build the judge engine (with ``model``); a :class:`~trainers.rewards.RewardPool`
        worker calls it once before its first sample; a served judge has nothing to build (the
        server is first asked at the first judgment, so a server that is down fails samples,
        not the worker's start)."""
        if self.server_url is None:
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
        in one ``generate`` call (greedy, ``max_tokens``), or to the server as one request each
        (at most :data:`MAX_CONCURRENT_REQUESTS` at once)."""
        if len(completions) != len(prompts):
            raise ValueError(f"prompts: {len(prompts)} prompts for {len(completions)} completions")
        for c in completions:
            if not isinstance(c, str):
                raise TypeError(f"completions must be str, got {type(c).__name__}")
        if not completions:
            return []
        texts = [self.judge_prompt(c, p) for c, p in zip(completions, prompts)]
        if self.server_url is not None:
            answers = self._ask_server(texts)
        else:
            engine, tok = self._ensure_engine()
            params = SamplingParams(n=1, temperature=0.0, max_tokens=self.max_tokens, seed=0)
            gens = sorted(
                engine.generate([self._encode(t) for t in texts], params), key=lambda g: g.prompt_index
            )
            if len(gens) != len(texts):
                raise RuntimeError(
                    f"the judge engine returned {len(gens)} judgments for {len(texts)} prompts"
                )
            answers = [(tok.decode(g.token_ids, skip_special_tokens=True), g.finish_reason) for g in gens]
        out, last = [], []
        for text, (judgment, finish_reason) in zip(texts, answers):
            j = parse_judgment(judgment, min_score=self.min_score, max_score=self.max_score)
            if finish_reason == "length":
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

    # ------------------------------------------------------------------ served judge

    def _client(self) -> ServerClient:
        # no connection held
        return ServerClient(self.server_url, timeout_s=self.timeout_s, api_key=self._api_key)

    def served_model_name(self) -> str:
        """The model name the requests carry: ``served_model``, else the one base model the
        server's ``GET /v1/models`` lists (asked once, then remembered)."""
        if self.served_model is None:
            try:
                cards = self._client().models()
            except ServerError as e:
                raise ServerError(f"llm judge: {e} (timeout_s={self.timeout_s:g})", e.status) from None
            names = [str(c.get("id")) for c in cards if isinstance(c, dict) and not c.get("parent")]
            if len(names) != 1:
                raise ServerError(
                    f"llm judge: server {self.server_url} serves {names or 'no models'}; "
                    "name the judge with served_model"
                )
            self.served_model = names[0]
        return self.served_model

    def _ask_server(self, texts: list[str]) -> list[tuple[str, str | None]]:
        """``(judgment, finish_reason)`` of each judge prompt, one request each, concurrently."""
        self.served_model_name()
        head: list[tuple[str, str | None]] = []
        if self.chat_template == "auto" and self._served_chat is None:
            head, texts = [self._ask_one(texts[0])], texts[1:]  # learns which endpoint serves
        if len(texts) <= 1:
            return head + [self._ask_one(t) for t in texts]
        pool = ThreadPoolExecutor(min(len(texts), MAX_CONCURRENT_REQUESTS), thread_name_prefix="llm-judge")
        try:
            futures = [pool.submit(self._ask_one, t) for t in texts]
            return head + [f.result() for f in futures]
        finally:
            pool.shutdown(wait=True, cancel_futures=True)

    def _ask_one(self, text: str) -> tuple[str, str | None]:
        """One judge prompt's ``(judgment, finish_reason)`` from the server."""
        common = {
            "model": self.served_model_name(),
            "max_tokens": self.max_tokens,
            "temperature": 0.0,
            "n": 1,
            "skip_special_tokens": True,
        }
        chat = self.chat_template == "on" or (self.chat_template == "auto" and self._served_chat is not False)
        if chat:
            try:
                choice = self._post(
                    "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": text}]}
                )
            except ServerError as e:
                if self.chat_template == "on" or e.status != 400 or "chat template" not in str(e).lower():
                    raise
                self._served_chat = False  # the served model has no chat template: plain prompts from now on
            else:
                self._served_chat = True
                message = choice.get("message") or {}
                return str(message.get("content") or ""), choice.get("finish_reason")
        choice = self._post("/v1/completions", {**common, "prompt": text, "add_special_tokens": False})
        return str(choice.get("text") or ""), choice.get("finish_reason")

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """The first choice of one request, within ``timeout_s``; errors name the server."""
        try:
            answer = self._client().post(path, body)
        except ServerError as e:
            raise ServerError(f"llm judge: {e} (timeout_s={self.timeout_s:g})", e.status) from None
        choices = answer.get("choices") if isinstance(answer, dict) else None
        if not choices or not isinstance(choices[0], dict):
            raise ServerError(
                f"llm judge: server {self.server_url}: POST {path} answered no choices: {str(answer)[:200]}"
            )
        return choices[0]

    def __call__(self, completion: str, prompt: Prompt) -> float:
        """The reward of one sample (one judge call); a verifier for a RewardPool."""
        return self.score_batch([completion], [prompt])[0]

    def metrics(self) -> dict[str, float]:
        """``judged``, ``valid``, ``invalid`` and ``invalid/<reason>`` (class docstring)."""
        with self._lock:
            keys = ("judged", "valid", "invalid", *(f"invalid/{r}" for r in INVALID_REASONS))
            return {k: float(self._counts[k]) for k in keys}
