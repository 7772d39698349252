"""Verifiers: ``(completion, prompt) -> reward`` rules, and the one registry that names them.

A **verifier** maps one completion to a scalar reward::

    Verifier = Callable[[str, Prompt], float]     # (completion text, prompt) -> reward

where the :class:`~trainers.data.Prompt` carries the ground truth (``.answer``) and its
``.data_source``. :data:`VERIFIERS` maps each name to a factory taking the verifier's options,
so a config picks one by name (``reward.verifier=exact_match|math_verify|llm_judge|code|reward_model``;
``reward_model`` is a learned reward model's score,
:class:`~trainers.rewards.reward_model.RewardModelVerifier`) and :func:`get_verifier` builds it.
Two more names: ``ifeval`` (IFEval's verifiable instructions,
:class:`~trainers.rewards.instructions.InstructionVerifier`) and ``multiple_choice`` (the chosen
letter, :class:`~trainers.rewards.choice.ChoiceVerifier`). Guide: ``docs/rewards-workers.md``.

>>> get_verifier("exact_match")("12+34=46", Prompt("12+34=", "46"))
1.0
>>> get_verifier("code", timeout_s=5.0).timeout_s
5.0
"""

from __future__ import annotations

import inspect
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rollkit.registry import UnknownNameError
from trainers.data import Prompt
from trainers.rewards.choice import ChoiceVerifier
from trainers.rewards.code import CodeVerifier
from trainers.rewards.instructions import InstructionVerifier
from trainers.rewards.judge import JudgeReward
from trainers.rewards.reward_model import RewardModelVerifier

__all__ = [
    "VERIFIERS",
    "MathVerifier",
    "Verifier",
    "exact_match",
    "exact_match_reward",
    "get_verifier",
    "llm_judge",
    "math_verify_reward",
    "parse_number",
    "register_verifier",
]

Verifier = Callable[[str, Prompt], float]

# True inside a RewardPool worker (process or Ray actor): its main thread may use signal.alarm.
_IN_POOL_WORKER = False


def mark_pool_worker() -> None:
    """Called once by each :class:`~trainers.rewards.RewardPool` worker as it starts: its main
    thread may use ``signal.alarm`` (:class:`MathVerifier`)."""
    global _IN_POOL_WORKER
    _IN_POOL_WORKER = True


def _signal_timeouts_allowed() -> bool:
    return _IN_POOL_WORKER and threading.current_thread() is threading.main_thread()


# --------------------------------------------------------------------------- exact match

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def parse_number(completion: str) -> str | None:
    """The last number in ``completion`` (commas between digits removed), or ``None``.

    >>> parse_number("a -3 b 4.5"), parse_number("1,046"), parse_number("x")
    ('4.5', '1046', None)
    """
    found = _NUMBER.findall(completion.replace(",", ""))
    return found[-1] if found else None


def exact_match_reward(completion: str, answer: str) -> float:
    """``1.0`` if the last number of ``completion`` equals ``answer`` (as numbers), else ``0.0``.

    >>> exact_match_reward("The answer is 46.", "46"), exact_match_reward("4 6", "46")
    (1.0, 0.0)
    """
    got = parse_number(completion)
    if got is None:
        return 0.0
    try:
        return float(float(got) == float(str(answer).replace(",", "")))
    except ValueError:
        return float(got.strip() == str(answer).strip())


def exact_match(completion: str, prompt: Prompt) -> float:
    """``1.0`` if the last number of ``completion`` equals ``prompt.answer`` as numbers, else ``0.0``
    (:func:`exact_match_reward`).

    >>> exact_match("12+34=46", Prompt("12+34=", "46")), exact_match("46.5", Prompt("q", "46"))
    (1.0, 0.0)
    """
    return exact_match_reward(completion, prompt.answer)


# --------------------------------------------------------------------------- Math-Verify


def _import_math_verify() -> Any:
    try:
        import math_verify
    except ImportError as e:
        raise ImportError(
            "the 'math_verify' verifier needs Math-Verify: pip install 'math-verify[antlr4_13_2]==0.9.0' "
            "(see scripts/install.sh)"
        ) from e
    return math_verify


def _as_latex(answer: str) -> str:
    a = str(answer).strip()
    return a if "$" in a or "\\(" in a or "\\[" in a or "\\boxed" in a else f"${a}$"


@dataclass(frozen=True)
class MathVerifier:
    """Math-Verify (Hugging Face, 2025) equivalence of the completion's answer and the gold answer.

    * gold: ``prompt.answer``, wrapped in ``$...$`` unless it already is LaTeX (``$``,
      ``\\(``, ``\\[`` or ``\\boxed``), parsed with Math-Verify's default extraction; an answer
      it cannot parse raises ``ValueError`` (the pool counts it as an error and scores 0).
    * prediction: Math-Verify's ``parse(completion)`` with the LaTeX extraction (a
      ``\\boxed{...}`` answer first, then the last LaTeX expression) and the plain-expression
      extraction (the last number or expression, e.g. ``x=3`` gives 3); nothing extracted
      scores 0.
    * reward: ``1.0`` if ``verify(gold, prediction)`` (symbolic / numeric equality, sets,
      intervals, equations) else ``0.0``.

    ``timeout_s`` (whole seconds) bounds each Math-Verify parse / comparison with its own
    ``signal.alarm`` timeouts, which are used only in the main thread of a pool worker;
    elsewhere they are disabled (no ``SIGALRM`` handler is installed in the trainer) and the
    caller must bound the time (:class:`~trainers.rewards.RewardPool`'s ``timeout_s``). A
    Math-Verify timeout scores 0 (it is not an error: Math-Verify returns "not equal").

    >>> v = MathVerifier()
    >>> v("so \\\\boxed{\\\\frac{1}{2}}", Prompt("q", "0.5")), v("x=3", Prompt("q", "3")), v("7", Prompt("q", "3"))
    (1.0, 1.0, 0.0)
    """

    timeout_s: int = 5

    def __post_init__(self) -> None:
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, int) or self.timeout_s < 1:
            raise ValueError(f"timeout_s must be a whole number of seconds >= 1, got {self.timeout_s!r}")

    def setup(self) -> None:
        """Import Math-Verify (and sympy / antlr) once, when a pool worker starts."""
        _import_math_verify()

    def __call__(self, completion: str, prompt: Prompt) -> float:
        mv = _import_math_verify()
        t = self.timeout_s if _signal_timeouts_allowed() else None
        gold = mv.parse(_as_latex(prompt.answer), parsing_timeout=t)
        if not gold:
            raise ValueError(f"math_verify cannot parse the answer {prompt.answer!r}")
        pred = mv.parse(
            completion,
            extraction_config=[mv.LatexExtractionConfig(), mv.ExprExtractionConfig()],
            parsing_timeout=t,
        )
        if not pred:
            return 0.0
        return 1.0 if mv.verify(gold, pred, timeout_seconds=t) else 0.0


math_verify_reward = MathVerifier()


# --------------------------------------------------------------------------- the registry


def _exact_match_factory() -> Verifier:
    return exact_match


def llm_judge(*, judge_model: str = "", **options: Any) -> Verifier:
    """A :class:`~trainers.rewards.judge.JudgeReward` whose engine is built from ``judge_model``
    on first use (``""``: the embedded SmolLM2-135M-Instruct, ``"tiny"``: the tiny random Qwen2,
    else a checkpoint directory); ``options`` are its other keyword arguments (``max_tokens``,
    ``invalid_score``, ``template``, ...)."""
    return JudgeReward(model=judge_model, **options)


#: name -> factory(**options) -> verifier: the one registry a config picks verifiers from
#: (``get_verifier("math_verify", timeout_s=3)``, ``get_verifier("code", mode="fraction")``).
VERIFIERS: dict[str, Callable[..., Verifier]] = {
    "exact_match": _exact_match_factory,
    "math_verify": MathVerifier,
    "llm_judge": llm_judge,
    "code": CodeVerifier,
    "reward_model": RewardModelVerifier,
    "ifeval": InstructionVerifier,
    "multiple_choice": ChoiceVerifier,
}


def register_verifier(name: str, factory: Callable[..., Verifier], *, overwrite: bool = False) -> None:
    """Add ``factory`` (keyword options -> verifier) to :data:`VERIFIERS` under ``name``, so a
    config can choose it; a taken name raises ``ValueError`` unless ``overwrite``."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty str, got {name!r}")
    if not callable(factory):
        raise TypeError(f"factory must be callable (options -> verifier), got {type(factory).__name__}")
    if name in VERIFIERS and not overwrite:
        raise ValueError(f"name: verifier {name!r} is already registered (pass overwrite=True)")
    VERIFIERS[name] = factory


def _check_options(name: str, factory: Callable[..., Verifier], options: dict[str, Any]) -> None:
    """A one-line ``TypeError`` for options the factory does not take."""
    params = inspect.signature(factory).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return  # the factory checks its own
    known = sorted(p.name for p in params if p.kind is not inspect.Parameter.VAR_POSITIONAL)
    unknown = sorted(set(options) - set(known))
    if unknown:
        takes = f"it takes {known}" if known else "it takes no options"
        raise TypeError(f"verifier {name!r}: unknown options {unknown}; {takes}")


def get_verifier(name_or_fn: str | Verifier, **options: Any) -> Verifier:
    """A new verifier from the factory called ``name_or_fn`` in :data:`VERIFIERS` (called with
    ``options``), or ``name_or_fn`` itself if it is callable (then no options).

    >>> get_verifier("exact_match") is exact_match
    True
    >>> get_verifier("llm_judge", judge_model="tiny", max_tokens=16).max_tokens
    16
    """
    if isinstance(name_or_fn, str):
        factory = VERIFIERS.get(name_or_fn)
        if factory is None:
            raise UnknownNameError(
                f"verifier: unknown name {name_or_fn!r}; known: {', '.join(sorted(VERIFIERS))}"
            )
        _check_options(name_or_fn, factory, options)
        return factory(**options)
    if callable(name_or_fn):
        if options:
            raise TypeError(
                f"options are for verifiers chosen by name, got {sorted(options)} with a callable"
            )
        return name_or_fn
    raise TypeError(
        f"verifier must be a name in {sorted(VERIFIERS)} or a callable (completion, prompt) -> float, "
        f"got {type(name_or_fn).__name__}"
    )
