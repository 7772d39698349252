"""The documentation site: ``mkdocs build --strict`` passes, and no page or module is left out.

* Every ``docs/**/*.md`` page is in the ``nav`` of ``mkdocs.yml`` and every nav entry exists,
  so a new page cannot be forgotten (mkdocs itself only logs omitted pages at INFO level).
* Every public module of ``rollkit/`` and ``trainers/`` has a ``::: module`` block on one of
  the API pages ``docs/api/*.md``, and every such block names an existing module.
* ``docs/_ext/griffe_rst.py`` (the griffe extension that turns the RST habits of the
  docstrings into Markdown) converts doctests, literal blocks, math and roles.
* The strict build runs (slow: a subprocess, several seconds) and its HTML has the API entries,
  the rendered doctests and the math. Skipped, with the reason, when MkDocs, Material or
  mkdocstrings is not installed (``pip install -e '.[docs]'``).
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
CONFIG = ROOT / "mkdocs.yml"
EXT = DOCS / "_ext" / "griffe_rst.py"


def _load_ext():
    spec = importlib.util.spec_from_file_location("griffe_rst", EXT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


def _nav_pages(nav) -> list[str]:
    """The page paths of a (nested) mkdocs nav, external links left out."""
    out: list[str] = []
    items = nav if isinstance(nav, list) else [nav]
    for item in items:
        if isinstance(item, str):
            out.append(item)
        elif isinstance(item, dict):
            for value in item.values():
                out += _nav_pages(value) if isinstance(value, (list, dict)) else [value]
    return [p for p in out if not re.match(r"[a-z]+://", p)]


def _config() -> dict:
    yaml = pytest.importorskip("yaml", reason="PyYAML is needed to read mkdocs.yml")
    return yaml.safe_load(CONFIG.read_text())


def _doc_pages() -> set[str]:
    """Every Markdown page of the site, relative to docs/ (docs/_ext is excluded from it)."""
    return {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md") if "_ext" not in p.relative_to(DOCS).parts}


def test_nav_covers_every_page():
    nav = _nav_pages(_config()["nav"])
    pages = _doc_pages()
    missing = sorted(pages - set(nav))
    assert not missing, f"pages missing from the nav of mkdocs.yml (add them there): {missing}"
    dangling = sorted(set(nav) - pages)
    assert not dangling, f"nav entries of mkdocs.yml without a page: {dangling}"
    assert len(nav) == len(set(nav)), "a page is listed twice in the nav"
    assert "index.md" in nav and "getting-started.md" in nav and "integrations.md" in nav


def _modules(package: str) -> set[str]:
    """Dotted names of the public modules of a package directory (no private path parts)."""
    out = set()
    for path in (ROOT / package).rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__" or any(p.startswith("_") for p in parts):
            continue
        out.add(".".join(parts))
    return out


def _api_identifiers() -> dict[str, str]:
    """``::: identifier`` -> the API page that holds it."""
    found = {}
    for page in sorted((DOCS / "api").glob("*.md")):
        for ident in re.findall(r"^:::\s+([\w.]+)\s*$", page.read_text(), re.M):
            assert ident not in found, f"{ident} is documented twice ({found[ident]}, {page.name})"
            found[ident] = page.name
    return found


def test_api_pages_cover_every_module():
    documented = _api_identifiers()
    modules = _modules("rollkit") | _modules("trainers") | _modules("ablations")
    assert len(modules) >= 20, modules
    missing = sorted(modules - set(documented))
    assert not missing, f"modules without a `::: module` block on a docs/api/*.md page: {missing}"
    for ident in documented:  # each names a module file (or a package) that exists
        base = ROOT / Path(*ident.split("."))
        assert base.with_suffix(".py").is_file() or (base / "__init__.py").is_file(), (
            f"docs/api/{documented[ident]}: `::: {ident}` names no module"
        )


def test_rst_docstrings_become_markdown():
    conv = _load_ext().rst_to_markdown
    doc = (
        "Summary, see :func:`~rollkit.losses.aggregate` and :class:`rollkit.types.LossOutput`.\n"
        "\n"
        "With :math:`\\alpha \\ge 0`:\n"
        "\n"
        ".. math::\n"
        "\n"
        "    x = \\frac{a}{b}\n"
        "\n"
        "Shown as::\n"
        "\n"
        "    f(x) -> y\n"
        "\n"
        "Args:\n"
        "    gamma, lam: discounts in ``[0, 1]``;\n"
        "        both of them.\n"
        "    x: a tensor.\n"
        "\n"
        ">>> f(1)\n"
        "2\n"
        "\n"
        "```python\n"
        ":func:`kept` >>> as is\n"
        "```"
    )
    md = conv(doc)
    assert "`aggregate`" in md and "`rollkit.types.LossOutput`" in md and ":func:" in md.split("```python")[1]
    assert "$\\alpha \\ge 0$" in md
    assert "$$\nx = \\frac{a}{b}\n$$" in md
    assert "Shown as:\n\n```text\nf(x) -> y\n```" in md and "::" not in md.split("```python")[0]
    assert "    gamma: discounts in ``[0, 1]``;\n        both of them.\n    lam: discounts" in md
    assert "```pycon\n>>> f(1)\n2\n```" in md
    assert md.endswith("```python\n:func:`kept` >>> as is\n```")
    # a literal block holding a doctest is highlighted as one
    assert conv("Example::\n\n    >>> 1 + 1\n    2") == "Example:\n\n```pycon\n>>> 1 + 1\n2\n```"
    # a role spanning two lines, and a one-line math directive
    assert conv("so :math:`a +\n  b` holds") == "so $a +\n  b$ holds"
    assert conv(".. math::  y = 1") == "$$\ny = 1\n$$"
    assert conv("plain text, unchanged") == "plain text, unchanged"


def _require_mkdocs():
    for mod, what in (
        ("mkdocs", "MkDocs"),
        ("material", "mkdocs-material"),
        ("mkdocstrings_handlers.python", "mkdocstrings-python"),
        ("pymdownx", "pymdown-extensions"),
    ):
        if importlib.util.find_spec(mod.split(".")[0]) is None or importlib.util.find_spec(mod) is None:
            pytest.skip(f"{what} is not installed (pip install -e '.[docs]'): the site is not built")


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    _require_mkdocs()
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONWARNINGS": "ignore"}
    t0 = time.perf_counter()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "--site-dir",
            str(out),
            "--config-file",
            str(CONFIG),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    log = proc.stdout + proc.stderr
    problems = [ln for ln in log.splitlines() if re.match(r"(WARNING|ERROR)\b", ln)]
    assert proc.returncode == 0, "mkdocs build --strict failed:\n" + "\n".join(
        problems or log.splitlines()[-40:]
    )
    print(f"mkdocs build --strict: {time.perf_counter() - t0:.1f} s")
    return out


@pytest.mark.slow
def test_strict_build_renders_pages_api_and_math(site):
    for page in _doc_pages():
        html = site / ("index.html" if page == "index.md" else page.removesuffix(".md") + "/index.html")
        assert html.is_file(), f"{page} was not built"
    api = (site / "api" / "losses" / "index.html").read_text()
    assert 'id="rollkit.losses.policy.cispo"' in api and 'id="rollkit.losses.aggregation.aggregate"' in api
    assert '<span class="gp">&gt;&gt;&gt; </span>' in api, "doctests are not rendered as code"
    for page in (site / "api").rglob("index.html"):
        text = page.read_text()
        assert "<blockquote>" not in text, f"{page}: a doctest rendered as a block quote"
        assert not re.search(r":(func|class|meth|math|data|mod):`", text), f"{page}: an RST role left"
    assert 'class="arithmatex"' in (site / "api" / "buffer" / "index.html").read_text()
    assert 'class="arithmatex"' in (site / "advantages" / "index.html").read_text()
    assert "mathjax" in (site / "index.html").read_text().lower()


def test_mathjax_is_served_with_the_site_not_from_a_cdn():
    """Every extra_javascript is a file of the site (MathJax comes from the npm package through
    scripts/fetch_mathjax.sh, which .ci/run runs), so the formulas render offline."""
    import yaml

    cfg = yaml.safe_load(re.sub(r"!!python/\S+", "", CONFIG.read_text()))
    scripts = cfg["extra_javascript"]
    assert scripts and not [s for s in scripts if "://" in str(s)], scripts
    assert "javascripts/vendor/mathjax/tex-mml-chtml.js" in scripts


@pytest.mark.slow
def test_the_site_carries_mathjax(site):
    if not (ROOT / "docs" / "javascripts" / "vendor" / "mathjax" / "tex-mml-chtml.js").is_file():
        pytest.skip("MathJax not fetched (bash scripts/fetch_mathjax.sh; needs npm)")
    assert (site / "javascripts" / "vendor" / "mathjax" / "tex-mml-chtml.js").is_file()
    assert (site / "javascripts" / "vendor" / "mathjax" / "output" / "chtml" / "fonts" / "woff-v2").is_dir()
