"""A griffe extension for the docs site: Sphinx roles in docstrings become code spans.

The package's docstrings cite code as Sphinx does (``:func:`inference.fit_head```,
``:class:`~inference.gaussian.GaussianPosterior```, ``:math:`x```). mkdocstrings parses Google
style and leaves those roles as they are, so the API pages showed them raw (269 times on 8 pages,
issue 43). This rewrites each role to a Markdown code span before the docstring is parsed: the
target's last component for ``~``-prefixed targets (as Sphinx shows them), the whole target
otherwise, and an explicit title (``:func:`title <target>```) as the title.

Why code spans and not cross-references: a cross-reference that does not resolve fails
``mkdocs build --strict``, and many cited objects (private helpers, other packages' classes)
have no page. Loaded by ``mkdocs.yml`` (``extensions:`` of the python handler).
"""

from __future__ import annotations

import re
from typing import Any

import griffe

#: ``:role:`target```, ``:py:role:`target``` and ``:role:`title <target>```.
ROLE = re.compile(r":(?:py:)?(?P<role>func|class|mod|meth|attr|data|obj|exc|const|term|ref|math"
                  r"|paramref|envvar|file|command|program|option):`(?P<target>[^`]+)`")


def rewrite_roles(text: str) -> str:
    """``text`` with every Sphinx role replaced by a code span (module notes); ``:math:`` by
    inline math, ``$...$``."""

    def span(match: re.Match[str]) -> str:
        target = match.group("target").strip()
        if match.group("role") == "math":  # typeset by the site's KaTeX (pymdownx.arithmatex)
            return f"${target}$"
        titled = re.fullmatch(r"(.+?)\s*<([^>]+)>", target)
        if titled:
            return f"`{titled.group(1).strip()}`"
        if target.startswith("~"):
            target = target[1:].rsplit(".", 1)[-1]
        return f"`{target.lstrip('!')}`"

    return ROLE.sub(span, text)


class SphinxRoles(griffe.Extension):
    """Rewrites the Sphinx roles of every docstring griffe loads."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = rewrite_roles(obj.docstring.value)


__all__ = ["ROLE", "SphinxRoles", "rewrite_roles"]
