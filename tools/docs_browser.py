"""Look at the built docs site in headless Chromium: what a reader's browser shows.

``python tools/docs_browser.py SITE_DIR [--width 1400] [--screenshots OUT]`` renders every page
of a site built by ``mkdocs build`` (loaded from ``file://``: the site needs no server and no
network) and prints, per page, what a reader would meet that the HTML alone does not tell:

- ``overflow``: elements whose box reaches past the right edge of the text column (a table or
  a formula cut off or pushed over the table of contents), and code blocks in a language whose
  lines are longer than the block is wide (their end hidden behind a scroll bar: they should
  wrap, docs/assets/stylesheets/extra.css);
- ``scrolls`` (not a problem, for information): tables and plain blocks (trees, aligned
  output) wider than the column, which scroll inside their own frame;
- ``math``: formulas KaTeX typeset (``.katex``), formulas it failed on (``.katex-error``) and
  formulas left as TeX source (``.arithmatex`` without KaTeX's markup);
- ``raw_roles``: Sphinx roles (``:func:`x```) in the text a reader sees;
- ``remote``: scripts, styles and fonts the page loads from another host (the site must work
  offline: KaTeX is vendored under ``docs/assets/katex``).

``--screenshots OUT`` also writes one PNG per page (``OUT/<page>.png``, the first screens of
it) to look at. tests/docs/test_site.py runs the check over the whole site where Chromium is
installed (``apt-get install chromium``; the test is skipped elsewhere).

Why a copy of each page with a probe script rather than a browser driver: Chromium's
``--dump-dom`` prints the DOM after the page's scripts ran, so a script appended to a copy
(``*.probe.html`` beside the page, so its relative asset paths resolve) can write its findings
into the DOM; no Python browser package is needed, only the ``chromium`` binary.
"""

from __future__ import annotations

import argparse
import html as html_lib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

#: What the probe measures, appended to a copy of a page before ``</body>``. It waits for the
#: page's ``load`` event (KaTeX typesets on Material's ``document$``, before it) and a tick.
PROBE = r"""
<script>
window.addEventListener("load", function () { setTimeout(function () {
  var column = document.querySelector("article.md-content__inner") || document.body;
  var edge = column.getBoundingClientRect().right;
  var overflow = [];
  function label(el) {
    return el.tagName.toLowerCase() + ": " + (el.textContent || "").trim().replace(/\s+/g, " ")
      .slice(0, 80);
  }
  function scrolled(el) {  // inside a box that scrolls (its overflow is counted below)
    for (var up = el.parentElement; up && up !== column; up = up.parentElement) {
      var style = getComputedStyle(up).overflowX;
      if (style === "auto" || style === "scroll" || style === "hidden") { return true; }
    }
    return false;
  }
  column.querySelectorAll("table, pre, img, .katex-display, .arithmatex, p, li")
    .forEach(function (el) {
      if (scrolled(el)) { return; }
      var past = el.getBoundingClientRect().right - edge;
      if (past > 1) { overflow.push(Math.round(past) + " px past the column: " + label(el)); }
    });
  var scrolls = [];  // a table or a plain block (tree) wider than the column: it scrolls
  column.querySelectorAll("pre > code").forEach(function (el) {
    var hidden = el.scrollWidth - el.clientWidth;
    if (hidden <= 1) { return; }
    var block = el.closest(".highlight");
    var text = block && (block.classList.contains("language-text") ||
                         !/\blanguage-/.test(block.className));
    (text ? scrolls : overflow).push(hidden + " px of a code block hidden: " + label(el));
  });
  column.querySelectorAll(".md-typeset__scrollwrap").forEach(function (el) {
    var hidden = el.scrollWidth - el.clientWidth;
    if (hidden > 1) { scrolls.push(hidden + " px of a table to scroll: " + label(el)); }
  });
  var source = column.querySelectorAll(".arithmatex").length
    - column.querySelectorAll(".arithmatex .katex").length;
  var remote = [];
  document.querySelectorAll("script[src], link[href]").forEach(function (el) {
    var url = el.src || el.href;
    if (/^https?:/.test(url)) { remote.push(url); }
  });
  (performance.getEntriesByType("resource") || []).forEach(function (entry) {
    if (/^https?:/.test(entry.name)) { remote.push(entry.name); }
  });
  var text = column.innerText || "";
  var report = {
    overflow: overflow,
    scrolls: scrolls,
    katex: column.querySelectorAll(".katex").length,
    katex_errors: column.querySelectorAll(".katex-error").length,
    math_source: source,
    raw_roles: (text.match(/:(func|class|mod|meth|attr|data|exc|obj|math):`/g) || []).length,
    remote: remote,
  };
  var out = document.createElement("pre");
  out.id = "docs-browser-report";
  out.textContent = JSON.stringify(report);
  document.body.appendChild(out);
}, 50); });
</script>
"""

REPORT = re.compile(r'<pre id="docs-browser-report">(.*?)</pre>', re.S)


def chromium() -> str | None:
    """The Chromium (or Chrome) binary on ``PATH``, or None."""
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        found = shutil.which(name)
        if found:
            return found
    return None


def _run(browser: str, args: list[str], timeout: float) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory() as profile:  # a fresh profile: no state between pages
        return subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu",
                               "--hide-scrollbars", f"--user-data-dir={profile}",
                               "--allow-file-access-from-files", *args],
                              capture_output=True, text=True, timeout=timeout)


def check_page(page: Path, *, width: int = 1400, height: int = 1000, browser: str | None = None,
               screenshot: Path | None = None, timeout: float = 60.0) -> dict:
    """What a ``width``-pixel browser window shows of ``page`` (an ``index.html`` of a built
    site): the report of the module docstring. ``screenshot``: also a PNG of the page's first
    ``3 * height`` pixels."""
    browser = browser or chromium()
    if browser is None:
        raise RuntimeError("no chromium on PATH (apt-get install chromium)")
    text = page.read_text(encoding="utf-8")
    probe = page.with_name(page.stem + ".probe.html")
    probe.write_text(text.replace("</body>", PROBE + "</body>", 1), encoding="utf-8")
    try:
        done = _run(browser, [f"--window-size={width},{height}", "--virtual-time-budget=4000",
                              "--dump-dom", probe.as_uri()], timeout)
    finally:
        probe.unlink()
    found = REPORT.search(done.stdout)
    if found is None:
        raise RuntimeError(f"{page}: no report from the probe (chromium exit "
                           f"{done.returncode}): {done.stderr[-1500:]}")
    report = json.loads(html_lib.unescape(found.group(1)))
    if screenshot is not None:
        screenshot.parent.mkdir(parents=True, exist_ok=True)
        _run(browser, [f"--window-size={width},{3 * height}", "--virtual-time-budget=4000",
                       f"--screenshot={screenshot}", page.as_uri()], timeout)
    return report


def site_pages(site: Path) -> list[Path]:
    """The site's pages (``index.html`` of each), without mkdocs' 404 page."""
    return [p for p in sorted(site.rglob("index.html")) if "assets" not in p.parts]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("site", type=Path, help="a site built by mkdocs build")
    parser.add_argument("--width", type=int, default=1400, help="window width in pixels")
    parser.add_argument("--screenshots", type=Path, help="write one PNG per page here")
    parser.add_argument("--page", action="append", default=[],
                        help="only this page (path under the site, e.g. results); repeatable")
    args = parser.parse_args(argv)
    pages = site_pages(args.site)
    if args.page:
        wanted = {p.strip("/") for p in args.page}
        pages = [p for p in pages if p.parent.relative_to(args.site).as_posix() in wanted]
    problems = 0
    for page in pages:
        name = page.parent.relative_to(args.site).as_posix()
        name = name if name != "." else "index"
        shot = None if args.screenshots is None else \
            args.screenshots / (name.replace("/", "_") + ".png")
        report = check_page(page, width=args.width, screenshot=shot)
        bad = report["overflow"] or report["katex_errors"] or report["math_source"] \
            or report["raw_roles"] or report["remote"]
        problems += bool(bad)
        print(f"{name}: {report['katex']} formulas" + ("" if not bad else ", PROBLEMS"))
        for line in report["overflow"]:
            print(f"  {line}")
        for line in report["scrolls"]:
            print(f"  (scrolls) {line}")
        for key in ("katex_errors", "math_source", "raw_roles"):
            if report[key]:
                print(f"  {key}: {report[key]}")
        for url in report["remote"]:
            print(f"  remote: {url}")
    print(json.dumps({"pages": len(pages), "pages_with_problems": problems}))
    return 1 if problems else 0


if __name__ == "__main__":
    os.environ.setdefault("LANG", "C.UTF-8")
    sys.exit(main())
