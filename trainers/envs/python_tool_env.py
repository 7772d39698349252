r"""A tool-use environment: arithmetic word problems that the model solves by running Python.

Each episode asks one word problem drawn from the reset seed, by default a product of two 3-4
digit numbers ("A warehouse has 347 crates and each crate holds 1289 bolts. How many bolts are
there in total?"), which a small model cannot do in its head. The model may run Python by
writing, anywhere in its turn, a fenced block or a Hermes / Qwen2.5 tool call::

    ```python
    print(347 * 1289)
    ```
    <tool_call>{"name": "python", "arguments": {"code": "print(347 * 1289)"}}</tool_call>

The code runs in rollkit's sandbox (:func:`trainers.envs.tools.python_tool`: no network, no
files, time and memory limits) and what it printed, or its error, is the next observation as
``<result>447283</result>``; the episode goes on. The model ends the episode with its answer in
``\boxed{447283}`` (``<answer>`` tags also count): reward 1 if it is the right number, else 0.
A turn with neither a tool call nor an answer is a format error (``format_penalty``; ends the
episode unless ``end_on_format_error=False``); ``truncated`` after ``max_turns`` turns; when a
turn holds both, the tool calls are ignored and the answer is graded. Tool errors and timeouts
are observations, never exceptions.

``ops`` picks the operations of the problems (``"mul"``, ``"add"``, ``"sub"``); ``words=True``
writes the numbers in English words ("three hundred forty-seven"). :meth:`sample_random_action`
is a random well-formed action for a supervised warm-up: a Python call that combines the
problem's two numbers with a random operator (``+ - *``), a boxed guess, or after a result a
boxed copy of it or a guess; it teaches the format, not which operator the words mean.
"""

from __future__ import annotations

import random
import re
from collections.abc import Hashable
from typing import Any

from trainers.envs.base import (
    FORMAT_PENALTY,
    Env,
    StepResult,
    check_action,
    check_positive_int,
    check_seed,
    extract_boxed,
)
from trainers.envs.tools import ToolRegistry, parse_tool_calls, python_tool

__all__ = ["OPS", "PythonToolEnv", "number_words"]

_ONES = "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen seventeen eighteen nineteen".split()
_TENS = "_ _ twenty thirty forty fifty sixty seventy eighty ninety".split()


def number_words(n: int) -> str:
    """``n`` (``0 <= n < 10**6``) in English words.

    >>> number_words(347), number_words(1289), number_words(40015)
    ('three hundred forty-seven', 'one thousand two hundred eighty-nine', 'forty thousand fifteen')
    """
    if not 0 <= n < 10**6:
        raise ValueError(f"n: expected 0 <= n < 1000000, got {n}")
    if n < 20:
        return _ONES[n]
    if n < 100:
        return _TENS[n // 10] + ("" if n % 10 == 0 else "-" + _ONES[n % 10])
    if n < 1000:
        return _ONES[n // 100] + " hundred" + ("" if n % 100 == 0 else " " + number_words(n % 100))
    return number_words(n // 1000) + " thousand" + ("" if n % 1000 == 0 else " " + number_words(n % 1000))


#: operation -> (Python operator, problem templates with {a} and {b})
OPS: dict[str, tuple[str, tuple[str, ...]]] = {
    "mul": (
        "*",
        (
            "A warehouse has {a} crates and each crate holds {b} bolts. How many bolts are there in total?",
            "A train travels {b} kilometres every day for {a} days. How many kilometres does it travel?",
            "Each of {a} students reads {b} pages. How many pages do they read altogether?",
            "A farm has {a} rows of trees with {b} trees in each row. How many trees are there?",
        ),
    ),
    "add": (
        "+",
        (
            "A library has {a} books and receives {b} more. How many books does it have now?",
            "A town had {a} residents and {b} people moved in. How many residents are there now?",
        ),
    ),
    "sub": (
        "-",
        (
            "A tank holds {a} litres and {b} litres are drained. How many litres are left?",
            "A shop had {a} apples and sold {b} of them. How many apples are left?",
        ),
    ),
}
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def _parse_int(text: str) -> int | None:
    cleaned = text.strip().replace(",", "").replace(" ", "").rstrip(".")
    try:
        value = float(cleaned)
    except ValueError:
        return None
    return int(value) if value.is_integer() else None


class PythonToolEnv(Env):
    """Arithmetic word problems with a sandboxed Python tool (module docstring).

    Args:
        digits: ``(low, high)`` digits of each number (3-4 by default).
        ops: the operations problems are drawn from (:data:`OPS` keys).
        words: write the numbers in words instead of digits.
        max_turns: turns before ``truncated``.
        max_calls_per_turn: tool calls run per turn (the rest are ignored, and said so).
        tool_timeout_s: the sandbox's wall-clock limit of one program.
        sandbox: other options of :func:`~trainers.rewards.sandbox.run_python` (``memory_mb``,
            ``isolation``, ...).
        format_penalty, end_on_format_error: a turn with neither a call nor an answer.

    >>> env = PythonToolEnv(tool_timeout_s=60.0)  # a deadline the example never reaches
    >>> obs, info = env.reset(seed=0)
    >>> obs.splitlines()[-1]
    'Problem: A farm has 1663 rows of trees with 9376 trees in each row. How many trees are there?'
    >>> env.step("```python\\nprint(1663 * 9376)\\n```")[:3]
    ('<result>15592288</result>', 0.0, False)
    >>> env.step(r"\\boxed{15592288}")[1:3]
    (1.0, True)
    """

    def __init__(
        self,
        digits: tuple[int, int] = (3, 4),
        ops: tuple[str, ...] | list[str] = ("mul",),
        *,
        words: bool = False,
        max_turns: int = 3,
        max_calls_per_turn: int = 2,
        tool_timeout_s: float = 5.0,
        sandbox: dict[str, Any] | None = None,
        format_penalty: float = FORMAT_PENALTY,
        end_on_format_error: bool = True,
    ) -> None:
        lo, hi = digits
        if not 1 <= lo <= hi <= 5:
            raise ValueError(f"digits: expected (low, high) with 1 <= low <= high <= 5, got {digits!r}")
        bad = [o for o in ops if o not in OPS]
        if bad or not ops:
            raise ValueError(f"ops: expected a non-empty list of {sorted(OPS)}, got {list(ops)!r}")
        self.digits, self.ops, self.words = (int(lo), int(hi)), tuple(ops), bool(words)
        self.max_turns = check_positive_int("max_turns", max_turns)
        self.max_calls_per_turn = check_positive_int("max_calls_per_turn", max_calls_per_turn)
        self.tools = ToolRegistry([python_tool(timeout_s=tool_timeout_s, **(sandbox or {}))], max_chars=500)
        self.format_penalty = float(format_penalty)
        self.end_on_format_error = bool(end_on_format_error)
        self.question, self.answer, self.operands = "", 0, (0, 0)
        self.results: tuple[str, ...] = ()
        self.turn, self.done = 0, True
        self._rng = random.Random(0)

    @staticmethod
    def instructions() -> str:
        return (
            "Solve the problem. You can run Python: write a ```python code block that prints the "
            "result; its output comes back as <result>...</result>.\n"
            "When you know the answer, write it as \\boxed{ANSWER}.\n"
        )

    def _number(self, rng: random.Random) -> int:
        d = rng.randint(*self.digits)
        return rng.randint(10 ** (d - 1), 10**d - 1)

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        check_seed(seed)
        rng = random.Random(seed)
        op = rng.choice(self.ops)
        symbol, templates = OPS[op]
        a, b = self._number(rng), self._number(rng)
        if op == "sub" and a < b:
            a, b = b, a
        say = number_words if self.words else str
        self.question = rng.choice(templates).format(a=say(a), b=say(b))
        self.operands = (a, b)
        self.answer = {"*": a * b, "+": a + b, "-": a - b}[symbol]
        self.results, self.turn, self.done = (), 0, False
        self._rng = random.Random(rng.random())
        return f"{self.instructions()}Problem: {self.question}", {"seed": seed, "answer": self.answer}

    def step(self, action: str) -> StepResult:
        check_action(action)
        if self.done:
            raise RuntimeError("step() after the episode ended: call reset()")
        self.turn += 1
        answer = extract_boxed(action)
        if answer is None:
            tags = _ANSWER_TAG.findall(action)
            answer = tags[-1] if tags else None
        info: dict[str, Any] = {"answer": answer}
        if answer is not None:
            correct = _parse_int(answer) == self.answer
            self.done, info["correct"] = True, correct
            return ("Correct!" if correct else "Wrong answer."), float(correct), True, False, info
        calls = parse_tool_calls(action)
        info["tool_calls"] = [c.name for c in calls]
        if not calls:
            terminated = self.end_on_format_error
            truncated = not terminated and self.turn >= self.max_turns
            self.done = terminated or truncated
            obs = "Your turn had no ```python block and no answer: run Python or answer in \\boxed{}."
            return obs, self.format_penalty, terminated, truncated, info
        results = [self.tools.call(c.name or "?", c.arguments) for c in calls[: self.max_calls_per_turn]]
        info["tool_errors"] = [r.error for r in results if not r.ok]
        self.results += tuple(r.content for r in results)
        obs = "\n".join(f"<result>{r.content}</result>" for r in results)
        if len(calls) > self.max_calls_per_turn:
            obs += f"\n(only the first {self.max_calls_per_turn} tool calls of a turn are run)"
        truncated = self.turn >= self.max_turns
        self.done = truncated
        if truncated:
            obs += "\nYou are out of turns."
        return obs, 0.0, False, truncated, info

    def sample_random_action(self) -> str:
        """A random well-formed action (module docstring)."""
        rng = self._rng
        guess = rng.randint(10 ** (self.digits[0] * 2 - 2), 10 ** (self.digits[1] * 2) - 1)
        if self.results and rng.random() < 0.5:
            return f"\\boxed{{{self.results[-1]}}}"
        if rng.random() < 0.25:
            return f"\\boxed{{{guess}}}"
        a, b = self.operands
        return f"```python\nprint({a} {rng.choice('+-*')} {b})\n```"

    def state_key(self) -> Hashable:
        return ("python-tool", self.question, self.results)
