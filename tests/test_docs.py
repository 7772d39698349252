"""The docs cannot drift: every example runs, every signature, default and key is checked.

Pages: ``docs/*.md`` and ``README.md``.

* Every fenced code block must declare its language (```` ```python ````, ```` ```bash ````,
  ```` ```text ````, ...): a bare ```` ``` ```` is an error, so Python cannot hide in an
  unlabelled block, and ```` ```py ```` / ```` ```python-xxx ```` are rejected too.
* Every ```` ```python ```` block runs, each page's blocks in order in one namespace, as a
  reader would paste them. A line ``print(...)  # True`` is a claim: it must print ``True``.
  A block that cannot run (a signature, pseudo-code, GPU-only code) is marked on the line
  right before it with ``<!-- norun: why -->`` (it keeps its Python highlighting); the marks are
  counted per page against ``EXPECTED_NORUN`` below, so a new skip needs an edit here and
  nothing is skipped silently.
* Every signature ``name(arg, *, kw=default)`` of a rollkit callable, inline or in a norun
  block, matches the code: the arguments exist, documented defaults are the real defaults, and
  arguments after ``*`` are keyword-only. A call ``name(x, mask, eps=0.0)`` (no ``*``) must pass
  a valid number of positional arguments and existing keyword names. ``name=value`` items of a
  **Hyper-parameters.** bullet under a ``### `fn` `` heading are ``fn``'s defaults.
* Every backticked name in the first column of a "name (registry)" / "name (aliases)" table is
  registered; tables with in_keys/out_keys (reads/writes) columns state the registry's keys;
  every registry is named in concepts.md and tensordict.md; dotted ``rollkit.x.y`` references
  resolve; relative links point at existing files.
* The math renders as plain Markdown with ``$``/``$$`` LaTeX: delimiters come in pairs per
  paragraph, and no ``|`` inside ``$...$`` splits a table cell.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted((ROOT / "docs").glob("*.md")) + [p for p in [ROOT / "README.md"] if p.exists()]
PAGE_IDS = [str(p.relative_to(ROOT)) for p in PAGES]

# Blocks marked `<!-- norun: ... -->`, per page. Change only together with the docs.
EXPECTED_NORUN = {
    "docs/advantages.md": 2,  # two signature blocks (gigpo_advantages, starpo_advantages)
    "docs/engines.md": 1,  # the vLLM engine example: vllm is not in the docs environment
    "docs/tools.md": 1,  # an agent calling tools needs a policy that writes <tool_call> blocks
}

# Pages that must contain at least one runnable Python example.
MUST_RUN = {
    "docs/advantages.md",
    "docs/agentic.md",
    "docs/concepts.md",
    "docs/getting-started.md",
    "docs/index.md",
    "docs/integrations.md",
    "docs/losses.md",
    "docs/recipes.md",
    "docs/rewards.md",
    "docs/sandbox.md",
    "docs/tensordict.md",
}

RUNNABLE_INFO = "python"
NORUN_MARK = re.compile(r"^<!--\s*norun:\s*(\S.*?)\s*-->$")
FENCE = re.compile(r"^(\s*)(```+|~~~+)(.*)$")


@dataclass
class Block:
    page: str
    line: int  # 1-based line of the first code line
    info: str
    code: str
    norun: str | None  # the reason, if marked


def parse_blocks(path: Path) -> list[Block]:
    """Fenced blocks of a Markdown page, with their info string and an optional norun mark."""
    page = str(path.relative_to(ROOT))
    lines = path.read_text().splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, info = m.group(1), m.group(2), m.group(3).strip()
        j = i + 1
        while j < len(lines) and not (
            lines[j].strip().startswith(fence) and lines[j].strip().strip(fence[0]) == ""
        ):
            j += 1
        if j == len(lines):
            raise AssertionError(f"{page}:{i + 1}: unclosed code fence")
        body = [ln[len(indent) :] if ln.startswith(indent) else ln for ln in lines[i + 1 : j]]
        k = i - 1
        while k >= 0 and not lines[k].strip():
            k -= 1
        mark = NORUN_MARK.match(lines[k].strip()) if k >= 0 else None
        blocks.append(Block(page, i + 2, info, "\n".join(body) + "\n", mark.group(1) if mark else None))
        i = j + 1
    return blocks


BLOCKS = {page: parse_blocks(p) for page, p in zip(PAGE_IDS, PAGES)}


def _prose(path: Path) -> str:
    """The page without its fenced blocks (same line count)."""
    out, inside = [], None
    for ln in path.read_text().splitlines():
        m = FENCE.match(ln)
        if inside is None and m:
            inside = m.group(2)
            out.append("")
        elif inside is not None and ln.strip().startswith(inside) and ln.strip().strip(inside[0]) == "":
            inside = None
            out.append("")
        else:
            out.append("" if inside else ln)
    return "\n".join(out)


# ----------------------------------------------------------------------------- running examples


def test_pages_found():
    assert "docs/index.md" in PAGE_IDS and "docs/concepts.md" in PAGE_IDS
    assert MUST_RUN <= set(PAGE_IDS)


@pytest.mark.parametrize("page", PAGE_IDS)
def test_every_block_declares_its_language(page):
    bare = [b.line - 1 for b in BLOCKS[page] if not b.info]
    assert not bare, f"{page}: code fences without an info string at lines {bare} (use python/bash/text)"


@pytest.mark.parametrize("page", PAGE_IDS)
def test_norun_marks_are_counted(page):
    """Every skipped block is marked with a reason and counted in EXPECTED_NORUN."""
    marked = [b for b in BLOCKS[page] if b.norun is not None]
    for b in marked:
        assert b.info == RUNNABLE_INFO, f"{page}:{b.line}: a norun mark only makes sense on a python block"
        assert len(b.norun) >= 5, f"{page}:{b.line}: say why the block cannot run"
    assert len(marked) == EXPECTED_NORUN.get(page, 0), (
        f"{page}: {len(marked)} blocks marked norun at lines {[b.line for b in marked]}, "
        f"expected {EXPECTED_NORUN.get(page, 0)}; update EXPECTED_NORUN only if the skip is needed"
    )
    # nothing else can be skipped: the only Python-like info strings are exactly "python"
    odd = [b.line for b in BLOCKS[page] if b.info.lower().startswith(("py", "python")) and b.info != "python"]
    assert not odd, f"{page}: use ```python (plus a norun mark if needed), not another info string: {odd}"


@pytest.mark.parametrize("page", PAGE_IDS)
def test_examples_run(page, capsys):
    """The page's ```python blocks, in order, in one namespace, as a reader would run them."""
    blocks = [b for b in BLOCKS[page] if b.info == RUNNABLE_INFO and b.norun is None]
    if page in MUST_RUN:
        assert blocks, f"{page} has no runnable example"
    if not blocks:
        return
    threads = torch.get_num_threads()
    namespace: dict = {"__name__": f"docs_{Path(page).stem}"}
    try:
        with torch.random.fork_rng(devices=[]):  # the examples' RNG use leaves no trace
            torch.manual_seed(0)
            for b in blocks:
                # pad so that tracebacks point at the line of the page
                code = compile("\n" * (b.line - 1) + b.code, str(ROOT / page), "exec")
                exec(code, namespace)
    finally:
        torch.set_num_threads(threads)
    # a `print(...)  # True` in the docs is a claim: it must print True
    printed = capsys.readouterr().out.splitlines()
    claims = sum(len(re.findall(r"^\s*print\(.*\)\s*#\s*True\b", b.code, re.M)) for b in blocks)
    assert "False" not in printed, f"{page}: an example printed False"
    assert printed.count("True") == claims, f"{page}: {claims} `# True` claims, printed {printed}"


def test_block_counts_summary():
    """Counts every block by kind, so that the totals show in a failure and cannot go to 0."""
    counts = {"run": 0, "norun": 0, "other": 0}
    for blocks in BLOCKS.values():
        for b in blocks:
            kind = "other" if b.info != RUNNABLE_INFO else ("norun" if b.norun else "run")
            counts[kind] += 1
    assert counts["norun"] == sum(EXPECTED_NORUN.values()), counts
    assert counts["run"] >= 10, counts


# ----------------------------------------------------------------------------- names and signatures

_MODULES = [
    "rollkit.advantages",
    "rollkit.advantages.outcome",
    "rollkit.advantages.gae",
    "rollkit.advantages.agentic",
    "rollkit.losses",
    "rollkit.losses.policy",
    "rollkit.losses.aggregation",
    "rollkit.losses.kl",
    "rollkit.losses.entropy",
    "rollkit.losses.value",
    "rollkit.rewards",
    "rollkit.critics",
    "rollkit.packing",
    "rollkit.filters",
    "rollkit.ops",
    "rollkit.validation",
    "rollkit.registry",
    "rollkit.td",
    "rollkit.types",
    "rollkit.testing",
    "rollkit.keys",
    "rollkit.interop.torchrl",
    "rollkit.trajectory",
    "rollkit.buffer",
    "rollkit.scheduling",
    "rollkit.domains",
]


def _public_callables() -> dict[str, object]:
    """Short name -> rollkit callable; names bound to two different objects are left out."""
    found: dict[str, set] = {}
    objs: dict[int, object] = {}
    for name in _MODULES:
        try:
            mod = importlib.import_module(name)
        except ImportError:  # an optional backend (torchrl) is missing
            continue
        for attr in sorted(set(dir(mod)) | set(getattr(mod, "__all__", ()))):
            if attr.startswith("_"):
                continue
            try:
                obj = getattr(mod, attr)
            except Exception:
                continue
            if callable(obj) and getattr(obj, "__module__", "").startswith("rollkit"):
                found.setdefault(attr, set()).add(id(obj))
                objs[id(obj)] = obj
    return {k: objs[next(iter(v))] for k, v in found.items() if len(v) == 1}


CALLABLES = _public_callables()


def _split_call(text: str) -> tuple[str, str] | None:
    """``[pkg.]name(args)[ -> ...]`` -> (name, args), with balanced parentheses; else None."""
    m = re.match(r"(?:[\w.]+\.)?(\w+)\(", text)
    if not m:
        return None
    depth, i = 1, m.end()
    while i < len(text) and depth:
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        i += 1
    rest = text[i:].strip()
    if depth or (rest and not rest.startswith(("->", "→"))):
        return None
    return m.group(1), text[m.end() : i - 1]


def _signature_texts(page: str, path: Path) -> list[tuple[int, str]]:
    """(line, text) of inline code spans and of norun python blocks that look like a call."""
    out = []
    prose = _prose(path)
    for m in re.finditer(r"`([^`\n]+(?:\n[^`\n]+){0,3})`", prose):
        out.append((prose.count("\n", 0, m.start()) + 1, m.group(1)))
    for b in BLOCKS[page]:
        if b.info == RUNNABLE_INFO and b.norun:
            out.append((b.line, re.sub(r"#.*", "", b.code).strip()))
    return out


def _parse_documented(args: str) -> ast.arguments | ast.Call | None:
    """A documented argument list: a signature if it has a ``*`` (``ast.arguments``), else a
    call (``ast.Call``); None if it is neither (prose, pseudo-code)."""
    args = re.sub(r"(\w)\s+\[[^\[\]]*\]", r"\1", " ".join(args.split()))  # "x [B, T]" -> "x"
    args = re.sub(r"\s*(\.\.\.|…)\s*", "", args)  # "..." stands for more arguments
    args = re.sub(r",\s*(?=,|\)|$)", "", args).strip().strip(",")
    try:
        sig = ast.parse(f"def f({args}): pass").body[0].args  # type: ignore[attr-defined]
        if sig.kwonlyargs or sig.vararg:
            return sig
    except SyntaxError:
        pass
    try:
        call = ast.parse(f"f({args})", mode="eval").body
    except SyntaxError:
        return None
    return call if isinstance(call, ast.Call) else None


def _same_default(actual, documented) -> bool:
    """Equal values; a bool only equals a bool (``True == 1`` is not a match), 1 equals 1.0."""
    if isinstance(actual, bool) or isinstance(documented, bool):
        return type(actual) is type(documented) and actual == documented
    return actual == documented


def _check_signature(fn, doc: ast.arguments | ast.Call) -> list[str]:
    """Differences between a documented signature or call and ``fn``'s signature.

    A signature (it has a ``*``) documents names, defaults and keyword-only arguments; a call
    (``f(x, mask, eps=0.0)``) documents how many positional arguments it takes and the names of
    its keyword arguments (whose values are not defaults).
    """
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return []
    params = sig.parameters
    var_kw = any(p.kind is p.VAR_KEYWORD for p in params.values())
    var_pos = any(p.kind is p.VAR_POSITIONAL for p in params.values())
    problems = []
    if isinstance(doc, ast.Call):
        accepts = [p for p in params.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        starred = any(isinstance(a, ast.Starred) for a in doc.args)
        if len(doc.args) > len(accepts) and not var_pos and not starred:
            problems.append(f"called with {len(doc.args)} positional arguments, takes {len(accepts)}")
        for kw in doc.keywords:
            if kw.arg is not None and kw.arg not in params and not var_kw:
                problems.append(f"no argument {kw.arg!r}")
        return problems
    positional = doc.posonlyargs + doc.args
    pos_defaults = [None] * (len(positional) - len(doc.defaults)) + list(doc.defaults)
    documented = [(a, d, False) for a, d in zip(positional, pos_defaults)]
    documented += [(a, d, True) for a, d in zip(doc.kwonlyargs, doc.kw_defaults)]
    for arg in (doc.vararg, doc.kwarg):
        if arg is not None:
            documented.append((arg, None, False))
    for arg, default, kwonly in documented:
        p = params.get(arg.arg)
        if p is None:
            if not var_kw:
                problems.append(f"no argument {arg.arg!r}")
            continue
        if kwonly and p.kind is not p.KEYWORD_ONLY:
            problems.append(f"{arg.arg!r} is documented keyword-only but is not")
        if default is not None:
            try:
                value = ast.literal_eval(default)
            except ValueError:
                continue  # an expression (e.g. a name): not checked
            if p.default is p.empty:
                problems.append(f"{arg.arg!r} is documented with default {value!r} but has none")
            elif not _same_default(p.default, value):
                problems.append(f"{arg.arg!r}: documented default {value!r}, actual {p.default!r}")
    return problems


@pytest.mark.parametrize("page", PAGE_IDS)
def test_documented_signatures_match_the_code(page):
    path = ROOT / page
    problems, checked = [], 0
    for line, text in _signature_texts(page, path):
        split = _split_call(text.strip())
        if split is None or split[0] not in CALLABLES:
            continue
        doc = _parse_documented(split[1])
        if doc is None:
            continue
        checked += 1
        problems += [f"{page}:{line}: {split[0]}: {p}" for p in _check_signature(CALLABLES[split[0]], doc)]
    assert not problems, "\n".join(problems)
    if page in {"docs/advantages.md", "docs/losses.md", "docs/rewards.md", "docs/tensordict.md"}:
        assert checked >= 3, f"{page}: only {checked} signatures found; did the parser break?"


@pytest.mark.parametrize("page", PAGE_IDS)
def test_documented_hyper_parameter_defaults(page):
    """In a section headed by a function (``### `ppo_clip`: ...``), a **Hyper-parameters.**
    bullet lists defaults: each ``name=value`` there is the function's default."""
    problems, checked, fn = [], 0, None
    bullet = ""
    for ln in [*_prose(ROOT / page).splitlines(), ""]:
        if ln.startswith("#"):
            m = re.match(r"#+ `(\w+)`", ln)
            fn = CALLABLES.get(m.group(1)) if m else None
        if ln.startswith(("- ", "* ", "#")) or not ln.strip():
            if fn is not None and "**Hyper-parameters.**" in bullet:
                params = inspect.signature(fn).parameters
                for name, value in re.findall(r"`(\w+)=([^`]+)`", bullet):
                    if name not in params:
                        problems.append(f"{page}: {fn.__name__} has no argument {name!r}")
                        continue
                    checked += 1
                    if not _same_default(params[name].default, ast.literal_eval(value)):
                        problems.append(
                            f"{page}: {fn.__name__}: documented default {name}={value}, "
                            f"actual {params[name].default!r}"
                        )
            bullet = ""
        bullet += " " + ln
    assert not problems, "\n".join(problems)
    if page == "docs/losses.md":
        assert checked >= 10, checked


def test_signature_checker_can_fail():
    from rollkit.advantages import grpo_advantages

    good = _parse_documented('rewards [B], group_ids, *, eps=1e-6, mean_level="group", ...')
    bad = _parse_documented("rewards, group_ids, *, eps=1e-4, std=True, unbiased_std=1")
    assert isinstance(good, ast.arguments) and _check_signature(grpo_advantages, good) == []
    assert len(_check_signature(grpo_advantages, bad)) == 3
    call = _parse_documented("out.rewards, g, leave_one_out=True, std=1")
    assert isinstance(call, ast.Call)
    assert _check_signature(grpo_advantages, call) == ["no argument 'std'"]
    assert _check_signature(grpo_advantages, _parse_documented("r, g, 1")) != []
    assert _split_call("rollkit.ops.f(a, (b, c)) -> x") == ("f", "a, (b, c)")
    assert _split_call("f(a) + g(b)") is None
    assert _parse_documented("a b c") is None


@pytest.mark.parametrize("page", PAGE_IDS)
def test_dotted_references_resolve(page):
    prose = _prose(ROOT / page)
    problems = []
    for m in re.finditer(r"`(rollkit(?:\.\w+)+)", prose):
        parts = m.group(1).split(".")
        obj, i = None, len(parts)
        while i > 0:  # longest importable module prefix, then attributes
            try:
                obj = importlib.import_module(".".join(parts[:i]))
                break
            except ImportError:
                i -= 1
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                problems.append(f"{page}: {m.group(1)} does not resolve")
                break
            obj = getattr(obj, attr)
    assert not problems, "\n".join(problems)


def _is_registered(name: str) -> bool:
    from rollkit.registry import REGISTRIES

    return any(name in reg for reg in REGISTRIES.values())


@pytest.mark.parametrize("page", PAGE_IDS)
def test_registry_names_in_tables_are_registered(page):
    problems, checked = [], 0
    header = None
    for ln in (ROOT / page).read_text().splitlines():
        if not ln.startswith("|"):
            header = None
            continue
        cells = [c.strip() for c in ln.strip().strip("|").split("|")]
        if header is None:
            header = cells[0]
            continue
        if not re.match(r"name \((registry|aliases)\)", header) or set(cells[0]) <= set("-: "):
            continue
        for name in re.findall(r"`([^`]+)`", cells[0]):
            checked += 1
            if not _is_registered(name):
                problems.append(f"{page}: {name!r} is not registered")
    assert not problems, "\n".join(problems)
    if page in {"docs/advantages.md", "docs/losses.md", "docs/rewards.md"}:
        assert checked >= 5


def test_every_registry_is_documented():
    """concepts.md lists every registry constant, tensordict.md every key of REGISTRIES."""
    import rollkit.registry as registry

    concepts = (ROOT / "docs" / "concepts.md").read_text()
    td = (ROOT / "docs" / "tensordict.md").read_text()
    constants = [n for n, v in vars(registry).items() if isinstance(v, registry.Registry)]
    assert len(constants) >= 6
    missing = [n for n in constants if f"`{n}`" not in concepts]
    missing += [f'"{k}"' for k in registry.REGISTRIES if f'`"{k}"`' not in td]
    assert not missing, f"registries not named in docs/concepts.md / docs/tensordict.md: {missing}"


def _tables(page: str):
    """(header cells, row cells) of every Markdown table of a page."""
    header = None
    for ln in _prose(ROOT / page).splitlines():
        if not ln.startswith("|"):
            header = None
            continue
        cells = [c.strip() for c in ln.strip().strip("|").split("|")]
        if header is None:
            header = [c.lower() for c in cells]
        elif not set("".join(cells)) <= set("-: "):
            yield header, cells


def _keys(cell: str) -> list[str]:
    """Batch keys of a table cell: `a`, `arg` → `key` (the key is what counts)."""
    items = re.findall(r"`([^`]+)`(?:\s*(?:→|->)\s*`([^`]+)`)?", cell)
    return [b or a for a, b in items]


@pytest.mark.parametrize("page", PAGE_IDS)
def test_documented_batch_keys_match_the_registry(page):
    """Tables with in_keys / out_keys (or reads / writes) columns state the registry's keys."""
    from rollkit.registry import REGISTRIES

    problems, checked = [], 0
    for header, cells in _tables(page):
        cols = {h.split(" ")[0]: i for i, h in enumerate(header)}
        i_in, i_out = cols.get("in_keys", cols.get("reads")), cols.get("out_keys", cols.get("writes"))
        i_name = cols.get("name", cols.get("registry"))
        if i_in is None or i_out is None or i_name is None or len(cells) != len(header):
            continue
        names = re.findall(r"`\"?([^`\"]+)\"?`", cells[i_name])
        if not names:
            continue  # e.g. "(primitive)": not registered
        entries = [reg.entry(names[0]) for reg in REGISTRIES.values() if names[0] in reg]
        if not entries:
            problems.append(f"{page}: {names[0]!r} is not registered")
            continue
        checked += 1
        doc_in, doc_out = set(_keys(cells[i_in])), _keys(cells[i_out])
        if not any(set(e.in_keys.values()) == doc_in and list(e.out_keys) == doc_out for e in entries):
            actual = [(sorted(e.in_keys.values()), list(e.out_keys)) for e in entries]
            problems.append(
                f"{page}: {names[0]!r} documented in_keys {sorted(doc_in)} out_keys {doc_out}, "
                f"registered {actual}"
            )
    assert not problems, "\n".join(problems)
    if page in {"docs/advantages.md", "docs/rewards.md"}:
        assert checked >= 4, f"{page}: only {checked} rows with keys found; did the parser break?"


@pytest.mark.parametrize("page", PAGE_IDS)
def test_local_links_exist(page):
    prose = re.sub(r"`[^`\n]*`", "", _prose(ROOT / page))
    targets = re.findall(r"\]\(([^)\s]+)\)", prose)
    local = [t.split("#")[0] for t in targets if not re.match(r"[a-z]+:", t) and not t.startswith("#")]
    missing = [t for t in local if t and not ((ROOT / page).parent / t).exists()]
    assert not missing, f"{page}: links to missing files {missing}"


# ----------------------------------------------------------------------------- plain-Markdown LaTeX


@pytest.mark.parametrize("page", PAGE_IDS)
def test_math_delimiters_balance(page):
    prose = _prose(ROOT / page)
    prose = re.sub(r"`[^`\n]*`", "", prose)  # inline code may hold a $
    assert prose.count("$$") % 2 == 0, f"{page}: unbalanced $$"
    for para in re.split(r"\n\s*\n", prose.replace("$$", "")):
        n = len(re.findall(r"(?<!\\)\$", para))
        assert n % 2 == 0, f"{page}: odd number of $ in paragraph starting {para.strip()[:60]!r}"
    for ln in prose.splitlines():  # a | inside $...$ would split a table cell
        if ln.startswith("|"):
            bad = [m for m in re.findall(r"(?<!\\)\$([^$]*)\$", ln) if "|" in m]
            assert not bad, f"{page}: '|' inside math in a table row: {ln[:80]!r}"
