"""A strategy option's help exists once, in its declaration (``OPTIONS``): no class docstring
repeats it in an ``Args:`` section (the options tables of the docs, ``bayesfl strategies NAME``
and the CLI help are generated from the declarations; issue 42)."""

from __future__ import annotations

import inspect
import re

import pytest

from bayesfl.strategies import STRATEGIES, options_of

ENTRY = re.compile(r"^(\*{0,2}[\w, *]+?):\s")


def args_entries(doc: str) -> list[str]:
    """The names the ``Args:`` section of a (cleaned) docstring documents."""
    lines = doc.split("\n")
    names: list[str] = []
    for i, line in enumerate(lines):
        if line.strip() != "Args:":
            continue
        indent = len(line) - len(line.lstrip())
        for entry in lines[i + 1:]:
            if not entry.strip() or len(entry) - len(entry.lstrip()) <= indent:
                break
            if len(entry) - len(entry.lstrip()) == indent + 4 and ENTRY.match(entry.strip()):
                names += [n.strip().lstrip("*") for n in
                          ENTRY.match(entry.strip()).group(1).split(",")]
    return names


def test_args_entries_reads_a_google_section():
    doc = inspect.cleandoc('''Summary.

        Args:
            context: the run.
            mu, nu: two options
                on two lines.
            **options: more.

        Returns:
            x: not an argument.
        ''')
    assert args_entries(doc) == ["context", "mu", "nu", "options"]


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_no_docstring_repeats_an_options_help(name):
    cls = STRATEGIES[name]
    declared = set(options_of(cls))
    for klass in cls.__mro__:
        if not klass.__module__.startswith("bayesfl.strategies"):
            continue
        repeated = set(args_entries(inspect.cleandoc(klass.__doc__ or ""))) & (
            declared | {"options", "kwargs"})
        assert not repeated, f"{klass.__qualname__} documents options {sorted(repeated)}"
