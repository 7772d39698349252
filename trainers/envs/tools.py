"""Tools for agents: a registry of named tools with OpenAI function schemas, a Python-code tool
run in rollkit's sandbox, and the parsers of tool calls written as text.

A :class:`Tool` is a name, a description, JSON-schema ``parameters`` (OpenAI's function format)
and a call ``fn(**arguments) -> str``. :meth:`ToolRegistry.call` never raises: an unknown tool,
arguments that are not a JSON object or do not match the schema, an exception of the tool and a
call past its deadline all come back as a :class:`ToolResult` whose ``content`` is the error
text (``"error: ..."``), which the environment or the agent hands to the model as the tool's
answer; an episode never ends because a tool failed.

:func:`python_tool` runs the model's code with :func:`trainers.rewards.sandbox.run_python`, the
sandbox of the code rewards (bubblewrap: no network, no files outside a fresh tmpfs, an empty
environment; wall-clock and CPU limits, address-space, process and output caps; the weaker
rlimit fallback where bubblewrap cannot run, docs/sandbox.md), and answers with what the program
printed, or the error text (the last line of the traceback, or "timed out after N s").

Two text formats of a call are parsed (:func:`parse_tool_calls`): Hermes / Qwen2.5's
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (what a chat template with tool
support teaches), and a fenced ````` ```python ````` block, which calls the ``python`` tool.

>>> reg = ToolRegistry([python_tool(timeout_s=5)])
>>> reg.call("python", {"code": "print(347 * 1289)"}).content
'447283'
>>> reg.call("python", '{"code": "1/0"}').content
'error: ZeroDivisionError: division by zero'
>>> reg.call("nope", {}).content
"error: unknown tool 'nope' (tools: python)"
>>> [c.name for c in parse_tool_calls('<tool_call>{"name": "python", "arguments": {"code": "print(1)"}}</tool_call>')]
['python']
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from trainers.rewards.sandbox import check_options, run_python

__all__ = [
    "Tool",
    "ToolCall",
    "ToolRegistry",
    "ToolResult",
    "check_arguments",
    "format_run",
    "parse_tool_calls",
    "python_tool",
]

_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "object": (dict,),
    "array": (list,),
    "null": (type(None),),
}


@dataclass(frozen=True)
class Tool:
    """A tool: ``fn(**arguments) -> str`` behind an OpenAI function schema.

    ``parameters`` is a JSON schema of an object (``{"type": "object", "properties": {...},
    "required": [...]}``); ``timeout_s`` is the deadline of one call (the registry answers with a
    timeout error past it; a tool with its own deadline, like :func:`python_tool`, stops itself
    first)."""

    name: str
    description: str
    parameters: Mapping[str, Any]
    fn: Callable[..., Any]
    timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not re.fullmatch(r"[A-Za-z_][\w-]{0,63}", self.name):
            raise ValueError(f"name: expected an identifier of at most 64 characters, got {self.name!r}")
        if not isinstance(self.parameters, Mapping) or self.parameters.get("type") != "object":
            raise ValueError(
                f"parameters: expected a JSON schema with type 'object', got {self.parameters!r}"
            )
        if not callable(self.fn):
            raise TypeError(f"fn: expected a callable, got {type(self.fn).__name__}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s: expected > 0, got {self.timeout_s!r}")

    def schema(self) -> dict[str, Any]:
        """The OpenAI ``tools`` entry: ``{"type": "function", "function": {...}}``."""
        fn = {"name": self.name, "description": self.description, "parameters": dict(self.parameters)}
        return {"type": "function", "function": fn}


@dataclass(frozen=True)
class ToolCall:
    """A call parsed from the model's text: ``arguments`` is the parsed JSON object, or the raw
    string when it did not parse (the registry answers that with an error)."""

    name: str
    arguments: dict[str, Any] | str
    id: str = ""


@dataclass(frozen=True)
class ToolResult:
    """The answer to one call: ``content`` goes back to the model; ``ok`` is False for every error
    (``error`` names its kind: ``unknown_tool``, ``bad_arguments``, ``exception``, ``timeout`` or
    the tool's own, e.g. the sandbox status)."""

    name: str
    content: str
    ok: bool
    error: str | None = None
    seconds: float = 0.0


def check_arguments(schema: Mapping[str, Any], arguments: Any) -> str | None:
    """Why ``arguments`` do not match the object ``schema`` (``required``, the ``type`` of each
    property, ``additionalProperties: false``), or None. A small subset of JSON schema, enough
    for function calling; nested schemas are not descended into.

    >>> s = {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}
    >>> check_arguments(s, {"code": "x"}) is None, check_arguments(s, {}), check_arguments(s, {"code": 1})
    (True, "missing required argument 'code'", "argument 'code': expected string, got int")
    """
    if not isinstance(arguments, dict):
        return f"arguments: expected a JSON object, got {type(arguments).__name__}"
    props = schema.get("properties") or {}
    for name in schema.get("required") or ():
        if name not in arguments:
            return f"missing required argument {name!r}"
    for name, value in arguments.items():
        if name not in props:
            if schema.get("additionalProperties") is False:
                return f"unknown argument {name!r} (arguments: {', '.join(props) or 'none'})"
            continue
        want = props[name].get("type") if isinstance(props[name], Mapping) else None
        kinds = [want] if isinstance(want, str) else list(want or ())
        ok = not kinds or any(
            isinstance(value, _JSON_TYPES.get(k, object))
            and not (k in ("integer", "number") and isinstance(value, bool))
            for k in kinds
        )
        if not ok:
            return f"argument {name!r}: expected {'/'.join(kinds)}, got {type(value).__name__}"
    return None


class ToolRegistry:
    """Tools by name; :meth:`call` runs one with its deadline and never raises (module docstring).

    Args:
        tools: the tools (names must be unique).
        max_chars: the longest answer handed back (longer ones are cut, and say so).
    """

    def __init__(self, tools: Iterable[Tool] = (), *, max_chars: int = 2000) -> None:
        self._tools: dict[str, Tool] = {}
        self.max_chars = int(max_chars)
        for t in tools:
            self.register(t)

    def register(self, tool: Tool, *, overwrite: bool = False) -> None:
        if not isinstance(tool, Tool):
            raise TypeError(f"tool: expected a Tool, got {type(tool).__name__}")
        if tool.name in self._tools and not overwrite:
            raise ValueError(f"tool: {tool.name!r} is already registered (pass overwrite=True)")
        self._tools[tool.name] = tool

    def names(self) -> list[str]:
        return list(self._tools)

    def __contains__(self, name: object) -> bool:
        return name in self._tools

    def __getitem__(self, name: str) -> Tool:
        return self._tools[name]

    def schemas(self) -> list[dict[str, Any]]:
        """The OpenAI ``tools`` list of every registered tool."""
        return [t.schema() for t in self._tools.values()]

    def _cut(self, text: str) -> str:
        text = text.strip()
        if len(text) > self.max_chars:
            return text[: self.max_chars] + f"\n... (cut at {self.max_chars} characters)"
        return text

    def call(self, name: str, arguments: Mapping[str, Any] | str | None = None) -> ToolResult:
        """Run tool ``name`` with ``arguments`` (a dict, or its JSON text as a model writes it)."""
        t0 = time.perf_counter()

        def fail(kind: str, message: str) -> ToolResult:
            return ToolResult(str(name), f"error: {message}", False, kind, time.perf_counter() - t0)

        tool = self._tools.get(name) if isinstance(name, str) else None
        if tool is None:
            return fail("unknown_tool", f"unknown tool {name!r} (tools: {', '.join(self._tools) or 'none'})")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError as e:
                return fail("bad_arguments", f"arguments are not valid JSON ({e.msg})")
        arguments = {} if arguments is None else arguments
        why = check_arguments(tool.parameters, arguments)
        if why is not None:
            return fail("bad_arguments", why)
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                box["out"] = tool.fn(**dict(arguments))
            except Exception as e:  # the tool's failure is its answer
                box["err"] = f"{type(e).__name__}: {e}"

        worker = threading.Thread(target=run, name=f"rollkit-tool-{tool.name}", daemon=True)
        worker.start()
        worker.join(tool.timeout_s)
        if worker.is_alive():  # the thread is abandoned (daemon); its answer is never read
            return fail("timeout", f"tool {tool.name!r} timed out after {tool.timeout_s:g} s")
        if "err" in box:
            return fail("exception", box["err"])
        out = box.get("out")
        if isinstance(out, ToolResult):
            return out
        if isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], str):  # (text, error kind)
            text, kind = out
            return ToolResult(tool.name, self._cut(text), kind is None, kind, time.perf_counter() - t0)
        return ToolResult(tool.name, self._cut(str(out)), True, None, time.perf_counter() - t0)


def format_run(result: Any, timeout_s: float) -> tuple[str, str | None]:
    """``(text, error kind)`` of a sandbox :class:`~trainers.rewards.sandbox.RunResult`: what the
    program printed; on an error also the last line of its traceback (``error: ...``); a
    timeout or kill says so."""
    out = result.stdout.rstrip()
    if result.status == "ok":
        return (out if out else "(no output)"), None
    if result.status == "timeout":
        why = f"error: the program timed out after {timeout_s:g} s"
    elif result.status == "output_limit":
        why = "error: the program printed too much and was stopped"
    elif result.status == "killed":
        why = f"error: the program was killed ({'; '.join(result.notes[-1:]) or 'a signal'})"
    else:
        lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
        why = "error: " + (lines[-1].strip() if lines else f"exit status {result.returncode}")
    return (f"{out}\n{why}" if out else why), result.status


def python_tool(
    *, timeout_s: float = 5.0, memory_mb: int = 256, name: str = "python", **sandbox: Any
) -> Tool:
    """A tool that runs ``code`` (a complete Python program, standard library only) in the
    sandbox of :func:`~trainers.rewards.sandbox.run_python` and answers with what it printed.

    ``timeout_s`` and ``memory_mb`` are the sandbox's wall-clock and per-process memory limits;
    ``sandbox`` takes its other options (``isolation``, ``max_procs``, ``max_output_bytes``,
    ``cpu_s``, ``work_mb``, ...; a misspelt one is a ``TypeError`` now, not an error on every
    call). The registry's deadline is ``timeout_s + 5`` s (the sandbox's start-up), so the
    sandbox stops a slow program first and kills everything it started."""
    opts = dict(sandbox, timeout_s=timeout_s, memory_mb=memory_mb)
    check_options(**opts)

    def run(code: str) -> tuple[str, str | None]:
        return format_run(run_python(code, **opts), timeout_s)

    params = {
        "type": "object",
        "properties": {
            "code": {"type": "string", "description": "A complete Python program; print the results."}
        },
        "required": ["code"],
        "additionalProperties": False,
    }
    desc = "Run a Python program (standard library, no network, no files) and return what it prints."
    return Tool(name, desc, params, run, timeout_s=float(timeout_s) + 5.0)


_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
_PYTHON_BLOCK = re.compile(r"```[ \t]*python[ \t]*\n(.*?)```", re.DOTALL)


def _tool_call(raw: str, index: int) -> ToolCall:
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError:
        return ToolCall("", raw, f"call_{index}")
    if not isinstance(obj, dict):
        return ToolCall("", raw, f"call_{index}")
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            pass
    return ToolCall(str(obj.get("name", "")), args, f"call_{index}")


def parse_tool_calls(text: str, *, formats: Sequence[str] = ("tool_call", "python")) -> list[ToolCall]:
    """The tool calls written in ``text``, in order: ``<tool_call>{json}</tool_call>`` (a call
    whose JSON does not parse keeps the raw text as its arguments and an empty name, so the
    registry answers with an error) and, for ``"python"``, each fenced ```` ```python ```` block
    as ``ToolCall("python", {"code": ...})``. A ``<tool_call>`` left open at the end of the text
    (the model stopped on its closing tag) counts.

    >>> parse_tool_calls("Let me compute.\\n```python\\nprint(6 * 7)\\n```")
    [ToolCall(name='python', arguments={'code': 'print(6 * 7)\\n'}, id='call_0')]
    """
    found: list[tuple[int, ToolCall]] = []
    if "tool_call" in formats:
        found += [(m.start(), _tool_call(m.group(1), 0)) for m in _TOOL_CALL.finditer(text)]
    if "python" in formats:
        found += [(m.start(), ToolCall("python", {"code": m.group(1)})) for m in _PYTHON_BLOCK.finditer(text)]
    found.sort(key=lambda x: x[0])
    return [ToolCall(c.name, c.arguments, f"call_{i}") for i, (_, c) in enumerate(found)]
