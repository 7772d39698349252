// MathJax configuration for pymdownx.arithmatex (generic mode): it wraps math in
// <span class="arithmatex">\( ... \)</span> and <div class="arithmatex">\[ ... \]</div>.
// MathJax itself is served with the site (mkdocs.yml: extra_javascript), copied from the npm
// package mathjax@3.2.2 by scripts/fetch_mathjax.sh: the formulas render offline.
window.MathJax = {
  tex: {
    inlineMath: [["\\(", "\\)"]],
    displayMath: [["\\[", "\\]"]],
    processEscapes: true,
    processEnvironments: true,
  },
  options: {
    ignoreHtmlClass: ".*|",
    processHtmlClass: "arithmatex",
  },
};

// Material's instant navigation swaps pages without a reload: typeset each new page.
document$.subscribe(() => {
  MathJax.startup.output.clearCache();
  MathJax.typesetClear();
  MathJax.texReset();
  MathJax.typesetPromise();
});
