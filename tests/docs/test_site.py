"""The docs site builds with ``mkdocs build --strict``: a broken link between pages, a page
missing from the navigation, or a docstring reference (``::: bayesfl.strategies.fedsi.fedsi``, the
API reference) that no longer resolves fails this test, hence ``make test`` and CI."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytest.importorskip("mkdocs", reason="the dev extra installs mkdocs (make test does)")


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site, built once for this module's tests with ``mkdocs build --strict``."""
    out = tmp_path_factory.mktemp("site") / "site"
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--clean",
                           "--site-dir", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stderr[-6000:]}"
    return out


def pages(site: Path) -> dict[str, str]:
    """Every HTML page of the built site by its path relative to the site."""
    return {p.relative_to(site).as_posix(): p.read_text(encoding="utf-8")
            for p in sorted(site.rglob("*.html"))}


@pytest.mark.slow
def test_mkdocs_build_strict_passes(site):
    # The API reference is generated: its pages hold the public functions' docstrings.
    api = (site / "api" / "bayesfl" / "index.html").read_text(encoding="utf-8")
    assert "simulate" in api and "Run a federated experiment" in api
    fedsi = (site / "strategies" / "fedsi" / "index.html").read_text(encoding="utf-8")
    assert "Federated Subnetwork Inference" in fedsi
    # Sphinx roles in docstrings are rewritten to code spans (tools/griffe_sphinx_roles.py):
    # none reaches a page raw (269 did on 8 pages before, issue 43)
    raw = re.compile(r":(?:func|class|mod|meth|attr|data|exc|obj|math):`")
    for name, html in pages(site).items():
        found = raw.findall(html)
        assert not found, f"{name} shows {len(found)} raw Sphinx roles"


SECTION_TABLE = re.compile(r'<span class="doc-section-title">(?P<title>Returns|Yields):</span>'
                           r"</p>\s*<table>(?P<table>.*?)</table>", re.S)


@pytest.mark.slow
def test_no_returns_table_has_junk_rows(site):
    """A Returns (or Yields) section is one value described in prose: its table has one row.
    Parsed as several items, every wrapped line of the prose became a row of its own, typed
    with the return annotation (load_run's table had 5 rows typed LoadedRun; 32 docstrings
    were broken so, issue 43); mkdocs.yml's ``returns_multiple_items: false`` reads them
    whole."""
    tables = 0
    for name, html in pages(site).items():
        for match in SECTION_TABLE.finditer(html):
            tables += 1
            rows = match.group("table").count('<tr class="doc-section-item">')
            assert rows == 1, f"{name}: a {match.group('title')} table with {rows} rows " \
                              f"(a wrapped description split into rows?)"
    assert tables >= 20  # 26 on the API pages (issue 43): the pattern still finds them


def test_the_docstring_options_read_a_wrapped_returns_section_whole():
    """mkdocs.yml's docstring options, applied by griffe as the site does: ``load_run``'s
    Returns section (five wrapped lines) is one value, typed by the annotation."""
    griffe = pytest.importorskip("griffe")
    import yaml

    text = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    config = yaml.safe_load(text)
    python = next(p["mkdocstrings"] for p in config["plugins"] if isinstance(p, dict)
                  and "mkdocstrings" in p)["handlers"]["python"]["options"]
    module = griffe.load("bayesfl.loaded_run", search_paths=[str(ROOT)])
    sections = module["load_run"].docstring.parse("google", **python["docstring_options"])
    returns = [s for s in sections if s.kind.value == "returns"]
    assert len(returns) == 1 and len(returns[0].value) == 1
    assert str(returns[0].value[0].annotation) == "LoadedRun"
    assert "exactly as the run had them at its end" in returns[0].value[0].description


def test_every_page_is_in_the_navigation():
    """A page under docs/ that the nav leaves out is unreachable from the site's menu."""
    nav = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    for page in (ROOT / "docs").rglob("*.md"):
        rel = page.relative_to(ROOT / "docs").as_posix()
        assert f" {rel}" in nav, f"docs/{rel} is not in mkdocs.yml's nav"


def slug(heading: str) -> str:
    """The anchor mkdocs (Python-Markdown's toc) gives a heading."""
    text = re.sub(r"[^\w\s-]", "", heading.replace("`", "")).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def test_the_readme_links_into_pages_and_headings_that_exist():
    """The README is not part of the site, so mkdocs does not check its links: this does."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    links = re.findall(r"\]\((docs/[^)#\s]+)(?:#([^)\s]+))?\)", readme)
    assert len(links) >= 10
    for path, anchor in links:
        page = ROOT / path
        assert page.is_file(), f"README links to {path}, which does not exist"
        if anchor:
            headings = re.findall(r"^#+ (.+)$", page.read_text(encoding="utf-8"), re.M)
            assert anchor in {slug(h) for h in headings}, f"README: no heading #{anchor} in {path}"
