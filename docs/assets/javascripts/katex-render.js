// Typesets the math that pymdownx.arithmatex marks up (generic mode, mkdocs.yml):
// <span class="arithmatex">\(...\)</span> inline and <div class="arithmatex">\[...\]</div> for
// display math, with the KaTeX vendored under docs/assets/katex (nothing is fetched at view time).
(function () {
  "use strict";

  function typeset(root) {
    root.querySelectorAll(".arithmatex").forEach(function (element) {
      if (element.dataset.typeset) {
        return;
      }
      var tex = element.textContent.trim();
      var display = element.tagName === "DIV";
      if (tex.startsWith("\\(") || tex.startsWith("\\[")) {
        tex = tex.slice(2, -2);
      }
      // a formula KaTeX cannot parse shows its source in red (class katex-error), not nothing
      katex.render(tex, element, { displayMode: display, throwOnError: false });
      element.dataset.typeset = "1";
    });
  }

  // Material for MkDocs announces every page (also with instant loading) through document$
  if (typeof document$ !== "undefined") {
    document$.subscribe(function () { typeset(document); });
  } else {
    document.addEventListener("DOMContentLoaded", function () { typeset(document); });
  }
})();
