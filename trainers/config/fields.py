"""One mechanism for the configuration's per-field rules.

A field declares its rule once, where it is defined: its type (``int``, ``float``, ``bool``,
``str``, ``dict``, ``list``, ``X | None``; ``Literal[...]`` for a closed set of choices) and, with
:func:`setting`, bounds or the registry that must know its value::

    @dataclass
    class TrainConfig:
        lr_schedule: Literal["constant", "cosine"] = "constant"
        lr: float = setting(1e-5, gt=0)
        steps: int = setting(20, ge=0)

:func:`convert` turns a command-line string or a YAML value into the field's type (a wrong type
or an unknown choice raises at parse time), and :func:`check_fields` checks every rule of a
config tree (configs built in code too), each failure a one-line ``ValueError`` naming the
dotted field. Rules that relate several fields are the sections' validators (the ``check_*``
functions beside each section).

>>> from dataclasses import dataclass
>>> @dataclass
... class Section:
...     kind: Literal["a", "b"] = "a"
...     rate: float = setting(0.5, gt=0, le=1)
>>> s = Section(kind="c")
>>> check_fields(s, "section.")
Traceback (most recent call last):
...
ValueError: section.kind must be one of a, b, got 'c'
>>> check_fields(Section(rate=0.0), "section.")
Traceback (most recent call last):
...
ValueError: section.rate must be in (0, 1], got 0.0
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import MISSING
from typing import Any, Literal, Union

__all__ = ["Rule", "check_fields", "check_value", "convert", "hints", "setting", "type_name"]


@dataclasses.dataclass(frozen=True)
class Rule:
    """Bounds (``ge`` / ``gt`` / ``le`` / ``lt``) and a registry (``value in registry``) of one
    field; its type and ``Literal`` choices come from the annotation."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    registry: Any = None

    def bounds_text(self) -> str:
        """``"> 0"``, ``">= 1"``, ``"in (0, 1]"`` ..."""
        low = f"({self.gt:g}" if self.gt is not None else f"[{self.ge:g}" if self.ge is not None else ""
        high = f"{self.lt:g})" if self.lt is not None else f"{self.le:g}]" if self.le is not None else ""
        if low and high:
            return f"in {low}, {high}"
        if low:
            return f"> {self.gt:g}" if self.gt is not None else f">= {self.ge:g}"
        return f"< {self.lt:g}" if self.lt is not None else f"<= {self.le:g}"

    def holds(self, v: float) -> bool:
        return (
            (self.ge is None or v >= self.ge)
            and (self.gt is None or v > self.gt)
            and (self.le is None or v <= self.le)
            and (self.lt is None or v < self.lt)
        )


def setting(
    default: Any = MISSING,
    *,
    factory: Any = MISSING,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    registry: Any = None,
) -> Any:
    """A dataclass field with a rule: bounds on a number (``None`` values of an optional field
    are not checked) or a registry whose names the value must be one of."""
    rule = Rule(ge=ge, gt=gt, le=le, lt=lt, registry=registry)
    if factory is not MISSING:
        return dataclasses.field(default_factory=factory, metadata={"rule": rule})
    return dataclasses.field(default=default, metadata={"rule": rule})


def hints(cls: type) -> dict[str, Any]:
    """The resolved annotations of a dataclass."""
    return typing.get_type_hints(cls)


def _literal(tp: Any) -> tuple | None:
    return typing.get_args(tp) if typing.get_origin(tp) is Literal else None


def type_name(tp: Any) -> str:
    """``int``, ``float | None``, ``{constant,cosine}`` ... (``--help``'s type column)."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        return " | ".join(type_name(a) for a in typing.get_args(tp))
    if origin is Literal:
        return "{" + ",".join(str(a) if a != "" else "''" for a in typing.get_args(tp)) + "}"
    if tp is type(None):
        return "None"
    return getattr(tp, "__name__", str(tp))


def _choices_error(key: str, value: Any, choices: tuple) -> ValueError:
    names = ", ".join("''" if c == "" else str(c) for c in choices)
    return ValueError(f"{key} must be one of {names}, got {value!r}")


def _yaml():
    try:
        import yaml
    except ImportError as e:  # pragma: no cover - pyyaml comes with transformers
        raise ImportError("YAML configs need pyyaml: pip install pyyaml") from e
    return yaml


def convert(key: str, value: Any, tp: Any) -> Any:
    """``value`` (a string from the command line, or a YAML value) as type ``tp``; a ``Literal``
    value must be one of its choices."""
    origin = typing.get_origin(tp)
    choices = _literal(tp)
    if choices is not None:
        for c in choices:
            try:
                v = convert(key, value, type(c))
            except ValueError:
                continue
            if v in choices and type(v) is type(c):
                return v
        raise _choices_error(key, value, choices)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None or (isinstance(value, str) and value.strip().lower() in ("none", "null", "~")):
            if type(None) in args:
                return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return convert(key, value, a)
            except ValueError as e:
                errors.append(str(e))
        raise ValueError(errors[0] if errors else f"{key}: cannot convert {value!r} to {type_name(tp)}")
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise ValueError(f"{key}: expected str, got {value!r}")
    if isinstance(value, str) and tp in (int, float):
        try:
            return int(value) if tp is int else float(value)
        except ValueError:
            raise ValueError(f"{key}: expected {tp.__name__}, got {value!r}") from None
    if isinstance(value, str) and tp is not str:
        try:
            value = _yaml().safe_load(value) if value.strip() else value
        except Exception as e:
            raise ValueError(f"{key}: cannot parse {value!r}: {e}") from None
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ValueError(f"{key}: expected bool (true/false), got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ValueError(f"{key}: expected int, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ValueError(f"{key}: expected float, got {value!r}")
    if tp is dict or origin is dict:
        if isinstance(value, dict):
            return dict(value)
        raise ValueError(f"{key}: expected a mapping such as '{{clip_high: 0.28}}', got {value!r}")
    if tp is list or origin is list:
        if isinstance(value, list):
            return list(value)
        raise ValueError(f"{key}: expected a list such as '[1, 2]', got {value!r}")
    raise ValueError(f"{key}: unsupported field type {type_name(tp)}")  # pragma: no cover


def _number(key: str, v: Any, integer: bool) -> None:
    if integer:
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"{key} must be an int, got {v!r}")
    elif isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError(f"{key} must be a finite number, got {v!r}")


def check_value(key: str, v: Any, tp: Any, rule: Rule | None = None) -> None:
    """Check one value against its field's type, choices and rule (``key`` names it)."""
    if typing.get_origin(tp) in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if v is None and len(args) < len(typing.get_args(tp)):
            return
        tp = args[0] if len(args) == 1 else tp
    choices = _literal(tp)
    if choices is not None:
        if v not in choices or isinstance(v, bool) != isinstance(choices[0], bool):
            raise _choices_error(key, v, choices)
    elif tp is bool:
        if not isinstance(v, bool):
            raise ValueError(f"{key} must be true or false, got {v!r}")
    elif tp in (int, float):
        bounded = rule is not None and any(b is not None for b in (rule.ge, rule.gt, rule.le, rule.lt))
        text = rule.bounds_text() if bounded else ""
        int_ge = tp is int and text.startswith(">=")  # "must be an int >= 1" for both failures
        try:
            _number(key, v, tp is int)
        except ValueError:
            if int_ge:
                raise ValueError(f"{key} must be an int {text}, got {v!r}") from None
            raise
        if bounded and not rule.holds(v):
            raise ValueError(f"{key} must be {'an int ' if int_ge else ''}{text}, got {v!r}")
    elif tp is str:
        if not isinstance(v, str):
            raise ValueError(f"{key} must be a string, got {v!r}")
    elif tp is dict or typing.get_origin(tp) is dict:
        if not isinstance(v, dict):
            raise ValueError(f"{key} must be a mapping, got {v!r}")
    elif tp is list or typing.get_origin(tp) is list:
        if not isinstance(v, list):
            raise ValueError(f"{key} must be a list, got {v!r}")
    if rule is not None and rule.registry is not None and v not in rule.registry:
        reg = rule.registry
        raise ValueError(f"{key}: unknown {reg.kind} {v!r}; known: {', '.join(sorted(reg.names()))}")


def check_fields(obj: Any, prefix: str = "") -> None:
    """Check every field of the dataclass ``obj`` (and of its sections, recursively) against its
    declared type, choices and :class:`Rule`, in field order; the first failure raises a one-line
    ``ValueError`` naming ``prefix + field``."""
    h = hints(type(obj))
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if dataclasses.is_dataclass(h[f.name]):
            check_fields(v, f"{prefix}{f.name}.")
        else:
            check_value(f"{prefix}{f.name}", v, h[f.name], f.metadata.get("rule"))
