"""Docstrings are Markdown for the docs site (mkdocstrings, Google style): code is cited as a
code span or a cross-reference (``[`fit_head`][inference.fit_head]``), never as a Sphinx role,
which mkdocstrings shows raw (269 roles did on 8 pages, issue 43). The cross-references are
checked by ``mkdocs build --strict`` (tests/docs/test_site.py): one that does not resolve
fails the build."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ROLE = re.compile(r":(?:py:)?(?:func|class|mod|meth|attr|data|obj|exc|const|math|ref):`[^`]+`")
XREF = re.compile(r"\[`[^`]+`\]\[(?P<target>[\w.]+)\]")
SOURCES = sorted(p for d in ("inference", "calibration", "bayesfl", "bench")
                 for p in (ROOT / d).rglob("*.py"))


def test_the_role_pattern_finds_a_role_and_not_plain_code():
    assert ROLE.search("see :func:`inference.fit_head` and :class:`~a.B`")
    assert not ROLE.search("a `code span`, a ratio 3:1, [`x`][inference.x]")


def test_sources_cite_code_without_sphinx_roles():
    found = {str(p.relative_to(ROOT)): ROLE.findall(p.read_text(encoding="utf-8"))
             for p in SOURCES}
    found = {path: roles for path, roles in found.items() if roles}
    assert not found, f"write `name` or [`name`][module.name] instead: {found}"


def test_cross_references_name_the_full_dotted_path():
    # autorefs resolves identifiers, not names relative to the module: a bare name fails the
    # strict build only on a page that renders it, so check every one here
    targets = {m.group("target") for p in SOURCES
               for m in XREF.finditer(p.read_text(encoding="utf-8"))}
    assert targets, "no cross-reference found: the pattern no longer matches the sources"
    roots = {"inference", "calibration", "bayesfl"}
    bare = sorted(t for t in targets if t.split(".")[0] not in roots)
    assert not bare, bare
