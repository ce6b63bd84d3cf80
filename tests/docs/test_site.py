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


@pytest.mark.slow
def test_mkdocs_build_strict_passes(tmp_path):
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--clean",
                           "--site-dir", str(tmp_path / "site")], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stderr[-6000:]}"
    site = tmp_path / "site"
    # The API reference is generated: its pages hold the public functions' docstrings.
    api = (site / "api" / "bayesfl" / "index.html").read_text(encoding="utf-8")
    assert "simulate" in api and "Run a federated experiment" in api
    fedsi = (site / "strategies" / "fedsi" / "index.html").read_text(encoding="utf-8")
    assert "Federated Subnetwork Inference" in fedsi
    # Sphinx roles in docstrings are rewritten to code spans (tools/griffe_sphinx_roles.py):
    # none reaches a page raw (269 did on 8 pages before, issue 43)
    raw = re.compile(r":(?:func|class|mod|meth|attr|data|exc|obj|math):`")
    for page in site.rglob("*.html"):
        found = raw.findall(page.read_text(encoding="utf-8"))
        assert not found, f"{page.relative_to(site)} shows {len(found)} raw Sphinx roles"


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


def test_the_readme_names_every_strategy():
    """The README's strategy table is the front page's index of them: a new strategy must
    appear there (and on its family's page, which the table links)."""
    from bayesfl import STRATEGIES

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    missing = sorted(name for name in STRATEGIES if f"`{name}`" not in readme)
    assert not missing, f"README's strategy table lacks {missing}"
