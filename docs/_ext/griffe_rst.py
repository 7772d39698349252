"""A griffe extension that turns the reStructuredText bits of rollkit's docstrings into Markdown.

rollkit's docstrings are Google-style (``Args:``, ``Returns:``) with a few Sphinx/RST habits that
Markdown would mangle: ``>>>`` doctest lines (Markdown reads ``>`` as a block quote), literal
blocks introduced by ``::``, ``.. math::`` directives and ``:math:`` / ``:func:`` / ``:class:``
... roles. mkdocstrings loads this file (``mkdocs.yml``: ``extensions``) and rewrites each
docstring before it is parsed:

* a run of doctest lines (``>>>``, ``...`` and their output) becomes a ```` ```pycon ```` fence;
* ``text::`` + an indented block becomes ``text:`` + a fenced block (``pycon`` if it holds
  doctest lines, ``text`` otherwise);
* ``.. math:: x`` (one line or an indented block) becomes a ``$$ ... $$`` display block and
  ``:math:`x``` becomes ``$x$`` (rendered by MathJax through ``pymdownx.arithmatex``);
* ``:func:`~a.b.c``` and the other cross-reference roles become the code span ``c`` (``a.b.c``
  without the ``~``);
* ``a, b: description`` in an ``Args:`` section (one description for two parameters) is
  repeated for each name, so that griffe matches every documented name to the signature.

Indented blocks that are not introduced by ``::`` (the formulas of most primitives) are left
alone: Markdown shows them as code blocks, which is what they are.
"""

from __future__ import annotations

import re
from typing import Any

_DOCTEST = re.compile(r"^(\s*)>>>( |$)")
_MATH_DIRECTIVE = re.compile(r"^(\s*)\.\. math::\s*(.*)$")
_MATH_ROLE = re.compile(r":math:`([^`]+)`")
_XREF_ROLE = re.compile(r":(?:py:)?(?:func|class|meth|data|mod|attr|exc|obj|const|ref):`(~?)([^`]+)`")
_FENCE = re.compile(r"^\s*(```|~~~)")
_PARAMS_SECTION = re.compile(
    r"^(\s*)(Args|Arguments|Parameters|Keyword Args|Keyword Arguments|Other Parameters):\s*$"
)
_GROUPED_ITEM = re.compile(r"^(\s*)(\w+(?:\s*,\s*\w+)+)((?:\s*\([^)]*\))?:(?:\s.*)?)$")


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _block(lines: list[str], start: int, base: int) -> int:
    """End (exclusive) of the block of blank lines and lines indented deeper than ``base``
    that starts at ``start``, trailing blank lines excluded."""
    end = j = start
    while j < len(lines) and (not lines[j].strip() or _indent(lines[j]) > base):
        j += 1
        if lines[j - 1].strip():
            end = j
    return end


def _fenced(body: list[str], indent: str, info: str) -> list[str]:
    """``body`` dedented and wrapped in a fence at ``indent``, with blank lines around it."""
    nonblank = [ln for ln in body if ln.strip()]
    cut = min((_indent(ln) for ln in nonblank), default=0)
    inner = [indent + ln[cut:] if ln.strip() else "" for ln in body]
    return ["", f"{indent}```{info}", *inner, f"{indent}```", ""]


def _roles(line: str) -> str:
    line = _MATH_ROLE.sub(lambda m: f"${m.group(1).strip()}$", line)
    return _XREF_ROLE.sub(lambda m: f"`{m.group(2).rsplit('.', 1)[-1] if m.group(1) else m.group(2)}`", line)


def _split_grouped_params(lines: list[str]) -> list[str]:
    """In an ``Args:`` section, ``a, b: description`` documents both ``a`` and ``b`` (a habit
    griffe does not know): repeat the item, continuation lines included, once per name."""
    out: list[str] = []
    i = 0
    while i < len(lines):
        head = _PARAMS_SECTION.match(lines[i])
        out.append(lines[i])
        i += 1
        if not head:
            continue
        end = _block(lines, i, len(head.group(1)))
        item_indent = min((_indent(ln) for ln in lines[i:end] if ln.strip()), default=0)
        while i < end:
            m = _GROUPED_ITEM.match(lines[i]) if _indent(lines[i]) == item_indent else None
            if not m:
                out.append(lines[i])
                i += 1
                continue
            cont = _block(lines, i + 1, item_indent)
            for name in re.split(r"\s*,\s*", m.group(2)):
                out += [f"{m.group(1)}{name}{m.group(3)}", *lines[i + 1 : cont]]
            i = cont
    return out


def rst_to_markdown(text: str) -> str:
    """The Markdown form of a docstring that uses the RST constructs listed in the module doc."""
    lines = _split_grouped_params(text.splitlines())
    out: list[str] = []
    i, fence = 0, None
    while i < len(lines):
        line = lines[i]
        m = _FENCE.match(line)
        if fence is not None or m:  # an existing Markdown fence: copied as it is
            if fence is None:
                fence = m.group(1)
            elif line.strip().startswith(fence):
                fence = None
            out.append(line)
            i += 1
            continue
        m = _MATH_DIRECTIVE.match(line)
        if m:
            indent, rest = m.group(1), m.group(2).strip()
            end = _block(lines, i + 1, len(indent))
            body = ([rest] if rest else []) + [ln.strip() for ln in lines[i + 1 : end] if ln.strip()]
            out += ["", f"{indent}$$", *(indent + b for b in body), f"{indent}$$", ""]
            i = end
            continue
        m = _DOCTEST.match(line)
        if m:
            indent = m.group(1)
            end = i
            while end < len(lines) and lines[end].strip() and _indent(lines[end]) >= len(indent):
                end += 1
            out += _fenced(lines[i:end], indent, "pycon")
            i = end
            continue
        if line.rstrip().endswith("::") and not line.rstrip().endswith(":::"):
            base = _indent(line)
            end = _block(lines, i + 1, base)
            body = lines[i + 1 : end]
            if any(ln.strip() for ln in body):
                head = line.rstrip()[:-2].rstrip()
                if head.strip():
                    out.append(head + ":")
                info = "pycon" if any(_DOCTEST.match(ln) for ln in body) else "text"
                while body and not body[0].strip():
                    body = body[1:]
                out += _fenced(body, " " * base, info)
                i = end
                continue
        out.append(line)
        i += 1
    # roles (which may span lines) outside the fences, then collapse the runs of blank lines
    # that the fences may have introduced
    parts = re.split(r"(^[ \t]*```[^\n]*\n.*?^[ \t]*```[ \t]*$)", "\n".join(out), flags=re.M | re.S)
    text = "".join(part if k % 2 else _roles(part) for k, part in enumerate(parts))
    return re.sub(r"\n{3,}", "\n\n", text).strip("\n")


try:
    import griffe
except ImportError:  # the converter is importable (and tested) without griffe
    griffe = None  # type: ignore[assignment]

if griffe is not None:

    class RstToMarkdown(griffe.Extension):
        """Rewrites every docstring with :func:`rst_to_markdown` before griffe parses it."""

        def on_instance(self, *, obj: Any, **kwargs: Any) -> None:
            doc = getattr(obj, "docstring", None)
            if doc is not None and doc.value:
                doc.value = rst_to_markdown(doc.value)
