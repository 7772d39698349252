// MathJax configuration for pymdownx.arithmatex (generic mode): it wraps math in
// <span class="arithmatex">\( ... \)</span> and <div class="arithmatex">\[ ... \]</div>.
// MathJax itself is loaded from a CDN when a page is viewed (mkdocs.yml: extra_javascript),
// so building the site needs no network.
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
