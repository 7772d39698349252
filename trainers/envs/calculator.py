"""A tool-use environment: arithmetic questions with a calculator tool the model calls in text.

Each episode asks for the value of an arithmetic expression drawn from the reset seed. The
model may call tools by writing, anywhere in its turn::

    <tool>calc: 37 * (12 + 5) - 8</tool>

and the environment answers each call (in order, at most ``max_calls_per_turn``) with
``<result>621</result>`` as the next observation; the episode goes on. The model ends the
episode by writing its answer as ``\\boxed{621}`` (GEM's convention; ``<answer>621</answer>``
is accepted too). The answer is checked numerically (relative tolerance ``1e-6``): reward 1
if right, 0 if wrong. A turn with neither a tool call nor an answer is a format error
(``format_penalty``, ends the episode unless ``end_on_format_error=False``); ``truncated``
after ``max_turns`` turns. When a turn holds both, the tool calls are ignored and the answer
is graded.

The calculator is :func:`safe_eval`: it walks the expression's syntax tree and evaluates only
numbers, ``+ - * / // % **``, parentheses and ``abs min max round sqrt`` -- never ``eval``.
A ``python:`` tool (``<tool>python: print(6 * 7)</tool>``) is offered when a
``python_runner(code) -> str`` is given (run the code in a sandbox; this environment never
executes Python itself); without one a ``python:`` call answers with an error.
"""

from __future__ import annotations

import ast
import math
import operator
import random
import re
from collections.abc import Callable, Hashable
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

__all__ = ["CalcError", "CalculatorEnv", "format_number", "parse_tool_calls", "safe_eval"]


class CalcError(ValueError):
    """An expression the calculator refuses or cannot evaluate (the message says why)."""


_BINOPS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_FUNCS: dict[str, Callable[..., Any]] = {
    "abs": abs,
    "min": min,
    "max": max,
    "round": round,
    "sqrt": math.sqrt,
}
_MAX_ABS = 1e100
_MAX_EXPONENT = 100


def safe_eval(expr: str, *, max_len: int = 200, max_depth: int = 30) -> int | float:
    """Evaluate an arithmetic expression by walking its AST (no ``eval``).

    Allowed: int / float literals, ``+ - * / // % **``, unary ``+ -``, parentheses and the
    functions ``abs min max round sqrt`` (positional arguments). Anything else (names,
    attributes, strings, comparisons, ...) raises :class:`CalcError`, as do division by zero,
    exponents above 100 in magnitude, results above ``1e100`` in magnitude, expressions longer
    than ``max_len`` characters or nested deeper than ``max_depth``.

    >>> safe_eval("37 * (12 + 5) - 8"), safe_eval("2 ** 10 / 4"), safe_eval("sqrt(16) + max(1, 2)")
    (621, 256.0, 6.0)
    >>> try:
    ...     safe_eval("__import__('os')")
    ... except CalcError as e:
    ...     print(e)
    unknown function '__import__'
    """
    if not isinstance(expr, str):
        raise CalcError(f"expected a string, got {type(expr).__name__}")
    if len(expr) > max_len:
        raise CalcError(f"expression longer than {max_len} characters")
    try:
        tree = ast.parse(expr.strip(), mode="eval")
    except SyntaxError:
        raise CalcError("not an arithmetic expression") from None

    def ev(node: ast.AST, depth: int) -> int | float:
        if depth > max_depth:
            raise CalcError(f"expression nested deeper than {max_depth}")
        if isinstance(node, ast.Constant):
            if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
                raise CalcError(f"unsupported literal {node.value!r}")
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            a, b = ev(node.left, depth + 1), ev(node.right, depth + 1)
            if isinstance(node.op, ast.Pow) and abs(b) > _MAX_EXPONENT:
                raise CalcError(f"exponent {b} too large")
            try:
                out = _BINOPS[type(node.op)](a, b)
            except ZeroDivisionError:
                raise CalcError("division by zero") from None
            except OverflowError:
                raise CalcError("result too large") from None
            return _check_size(out)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](ev(node.operand, depth + 1))
        if isinstance(node, ast.Call):
            if not isinstance(node.func, ast.Name) or node.func.id not in _FUNCS:
                name = node.func.id if isinstance(node.func, ast.Name) else ast.unparse(node.func)
                raise CalcError(f"unknown function {name!r}")
            if node.keywords:
                raise CalcError("keyword arguments are not supported")
            args = [ev(a, depth + 1) for a in node.args]
            try:
                return _check_size(_FUNCS[node.func.id](*args))
            except (TypeError, ValueError) as e:
                raise CalcError(f"{node.func.id}: {e}") from None
        raise CalcError(f"unsupported syntax: {type(node).__name__}")

    out = ev(tree.body, 0)
    if isinstance(out, complex):  # e.g. (-8) ** 0.5
        raise CalcError("complex result")
    return out


def _check_size(x: Any) -> Any:
    if isinstance(x, complex):
        raise CalcError("complex result")
    if isinstance(x, float) and not math.isfinite(x):
        raise CalcError("result is not finite")
    if abs(x) > _MAX_ABS:
        raise CalcError("result too large")
    return x


def format_number(x: int | float) -> str:
    """Integers as integers, floats with up to 12 significant digits (``12.0`` -> ``12``)."""
    if isinstance(x, float) and x.is_integer():
        x = int(x)
    return str(x) if isinstance(x, int) else format(x, ".12g")


_TOOL = re.compile(r"<tool>\s*([A-Za-z_]\w*)\s*:(.*?)</tool>", re.DOTALL)
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def parse_tool_calls(text: str) -> list[tuple[str, str]]:
    """``[(tool, argument), ...]`` for every ``<tool>name: argument</tool>`` in ``text``.

    >>> parse_tool_calls("first <tool>calc: 1+2</tool> then <tool> python :print(3)</tool>")
    [('calc', '1+2'), ('python', 'print(3)')]
    """
    return [(m.group(1).lower(), m.group(2).strip()) for m in _TOOL.finditer(text)]


def _parse_number(text: str) -> float | None:
    cleaned = text.strip().replace(",", "").replace(" ", "").rstrip(".")
    try:
        return float(cleaned)
    except ValueError:
        try:
            return float(safe_eval(cleaned))  # "621/1", "-(3)"
        except CalcError:
            return None


def _random_expression(rng: random.Random, num_operands: int) -> str:
    expr = str(rng.randint(2, 99))
    for i in range(num_operands - 1):
        op = rng.choice(["+", "-", "*"])
        operand = str(rng.randint(2, 99))
        if i > 0 and op == "*" and rng.random() < 0.5:
            expr = f"({expr})"
        expr = f"{expr} {op} {operand}"
    return expr


class CalculatorEnv(Env):
    """Arithmetic with a calculator tool (module docstring).

    Args:
        num_operands: operands of the question's expression, ``(low, high)`` drawn per reset.
        max_turns: turns before ``truncated``.
        max_calls_per_turn: tool calls answered per turn (the rest are ignored, and said so).
        python_runner: ``code -> output`` for the ``python:`` tool (a sandbox), or None.
        format_penalty: reward of a turn with neither a tool call nor an answer.
        end_on_format_error: a format error ends the episode (GEM's behaviour).

    >>> env = CalculatorEnv()
    >>> obs, info = env.reset(seed=0)
    >>> obs.splitlines()[-1]
    'Question: what is 99 - 7 - 67 - 53?'
    >>> env.step("<tool>calc: 99 - 7 - 67 - 53</tool>")[:3]
    ('<result>-28</result>', 0.0, False)
    >>> env.step(r"The answer is \\boxed{-28}.")[1:3]
    (1.0, True)
    """

    def __init__(
        self,
        num_operands: tuple[int, int] = (3, 4),
        max_turns: int = 4,
        *,
        max_calls_per_turn: int = 4,
        python_runner: Callable[[str], str] | None = None,
        format_penalty: float = FORMAT_PENALTY,
        end_on_format_error: bool = True,
    ) -> None:
        lo, hi = num_operands
        if not 2 <= lo <= hi:
            raise ValueError(
                f"num_operands: expected (low, high) with 2 <= low <= high, got {num_operands!r}"
            )
        if python_runner is not None and not callable(python_runner):
            raise TypeError(f"python_runner: expected a callable or None, got {type(python_runner).__name__}")
        self.num_operands = (int(lo), int(hi))
        self.max_turns = check_positive_int("max_turns", max_turns)
        self.max_calls_per_turn = check_positive_int("max_calls_per_turn", max_calls_per_turn)
        self.python_runner = python_runner
        self.format_penalty = float(format_penalty)
        self.end_on_format_error = bool(end_on_format_error)
        self.question = ""
        self.answer: int | float = 0
        self.results: tuple[str, ...] = ()
        self.turn = 0
        self.done = True

    def instructions(self) -> str:
        tools = "calc (arithmetic: + - * / // % ** and abs, min, max, round, sqrt)"
        if self.python_runner is not None:
            tools += " and python (runs a Python program and returns what it prints)"
        return (
            "Answer the arithmetic question. You may use tools: " + tools + ".\n"
            "To call a tool write <tool>calc: EXPRESSION</tool>; its result comes back as <result>...</result>.\n"
            "When you know the answer, write it as \\boxed{ANSWER}.\n"
        )

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        check_seed(seed)
        rng = random.Random(seed)
        expr = _random_expression(rng, rng.randint(*self.num_operands))
        self.question = f"what is {expr}?"
        self.answer = safe_eval(expr)
        self.results = ()
        self.turn = 0
        self.done = False
        return f"{self.instructions()}Question: {self.question}", {"seed": seed, "answer": self.answer}

    def _run_tool(self, name: str, arg: str) -> str:
        if name == "calc":
            try:
                return format_number(safe_eval(arg))
            except CalcError as e:
                return f"error: {e}"
        if name == "python":
            if self.python_runner is None:
                return "error: the python tool is not available"
            try:
                return str(self.python_runner(arg)).strip()
            except Exception as e:  # the runner's own failure is the tool's answer
                return f"error: {type(e).__name__}: {e}"
        return f"error: unknown tool {name!r}"

    def check_answer(self, text: str) -> bool:
        value = _parse_number(text)
        return value is not None and math.isclose(value, self.answer, rel_tol=1e-6, abs_tol=1e-9)

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
            correct = self.check_answer(answer)
            self.done = True
            info["correct"] = correct
            obs = "Correct!" if correct else "Wrong answer."
            return obs, 1.0 if correct else 0.0, True, False, info
        calls = parse_tool_calls(action)
        info["tool_calls"] = calls
        if not calls:
            terminated = self.end_on_format_error
            truncated = not terminated and self.turn >= self.max_turns
            self.done = terminated or truncated
            obs = "Your turn had no tool call and no answer: call <tool>calc: ...</tool> or answer in \\boxed{}."
            return obs, self.format_penalty, terminated, truncated, info
        outs = [self._run_tool(n, a) for n, a in calls[: self.max_calls_per_turn]]
        self.results += tuple(outs)
        obs = "\n".join(f"<result>{o}</result>" for o in outs)
        if len(calls) > self.max_calls_per_turn:
            obs += f"\n(only the first {self.max_calls_per_turn} tool calls of a turn are run)"
        truncated = self.turn >= self.max_turns
        self.done = truncated
        if truncated:
            obs += "\nYou are out of turns."
        return obs, 0.0, False, truncated, info

    def state_key(self) -> Hashable:
        return ("calculator", self.question, self.results)
