#!/usr/bin/env bash
# MathJax for the docs site, served with it (no CDN): the es5 build of the npm package
# mathjax@3.2.2 into docs/javascripts/vendor/mathjax/ (git-ignored; mkdocs copies it into the
# site). Needs npm. `mkdocs build` works without it; the formulas then render as TeX source.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=3.2.2
DEST=docs/javascripts/vendor/mathjax
if [[ -f "$DEST/tex-mml-chtml.js" && "$(cat "$DEST/VERSION" 2>/dev/null)" == "$VERSION" ]]; then
    exit 0
fi
command -v npm >/dev/null || { echo "fetch_mathjax: npm not found; the docs site will show TeX source" >&2; exit 1; }
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
(cd "$TMP" && timeout 300 npm pack "mathjax@$VERSION" --silent >/dev/null && tar xzf "mathjax-$VERSION.tgz")
rm -rf "$DEST"
mkdir -p "$(dirname "$DEST")"
cp -r "$TMP/package/es5" "$DEST"
echo "$VERSION" > "$DEST/VERSION"
echo "fetch_mathjax: mathjax $VERSION in $DEST"
