"""The tables of the docs that list strategies, generated from the registry
(`bayesfl.strategies.registry`).

Each table lies in its page between ``<!-- strategies:NAME -->`` and ``<!-- /strategies -->``:

* ``readme`` (``README.md``): one row per family: its strategies and its docs page.
* ``architecture`` (``docs/architecture.md``): one row per strategy: its family, the module
  that defines it, and what goes down, up and what the server does with it.
* ``family:KEY`` (each family page under ``docs/strategies/``): every option the family's
  strategies declare, with its default, the strategies that take it and its meaning.

``python -m bayesfl.strategies.listing`` prints the tables, ``--write`` rewrites the blocks of
every page, and ``tests/docs/test_strategy_tables.py`` fails when a page and the registry
disagree. A strategy registered after the built-ins (a user's module, a test fixture) appears in
the tables rendered in that process.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from bayesfl.strategies.registry import FAMILIES, STRATEGIES, options_of

ROOT = Path(__file__).resolve().parents[2]
PAGES = (ROOT / "README.md", ROOT / "docs" / "architecture.md",
         *(ROOT / "docs" / f.page for f in FAMILIES.values()))
"""The pages that hold table blocks (the README first)."""

BLOCK = re.compile(r"(<!-- strategies:([\w:-]+) -->\n)(.*?)(<!-- /strategies -->)", re.S)


def _by_family(registry: Mapping[str, type]) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {key: [] for key in FAMILIES}
    for name, cls in registry.items():
        registration = getattr(cls, "registration", None)
        if registration is not None and registration.name == name:
            found[registration.family].append(name)
    return found


def _module(cls: type) -> str:
    """The defining module as a path under ``bayesfl/strategies/`` (or the module name of a
    class defined elsewhere)."""
    module = cls.__module__
    if module.startswith("bayesfl.strategies."):
        return module.removeprefix("bayesfl.strategies.").replace(".", "/") + ".py"
    return module


def readme_table(registry: Mapping[str, type] = STRATEGIES) -> str:
    """The README's table: family, its strategies, its page."""
    lines = ["| family | names | page |", "|---|---|---|"]
    for key, names in _by_family(registry).items():
        if not names:
            continue
        family = FAMILIES[key]
        listed = ", ".join(f"`{n}`" for n in names)
        if family.note:
            listed += " " + family.note
        lines.append(f"| {family.title} | {listed} | [{family.link}](docs/{family.page}) |")
    return "\n".join(lines) + "\n"


ARCHITECTURE_HEADER = "| family | strategy | module | down (broadcast) | up (upload) | aggregate |"


def architecture_table(registry: Mapping[str, type] = STRATEGIES) -> str:
    """``docs/architecture.md``'s table: one row per strategy."""
    lines = [ARCHITECTURE_HEADER, "|---|---|---|---|---|---|"]
    for key, names in _by_family(registry).items():
        for name in names:
            r = registry[name].registration
            lines.append(f"| {FAMILIES[key].label} | `{name}` | `{_module(registry[name])}` | "
                         f"{r.broadcast} | {r.upload} | {r.aggregate} |")
    return "\n".join(lines) + "\n"


_ROLE = re.compile(r":\w+:`~?([^`]+)`")
"""A Sphinx role in a help text (```x```): a code span on the page."""


def _shown(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return value if isinstance(value, str) else repr(value)


def family_table(key: str, registry: Mapping[str, type] = STRATEGIES) -> str:
    """A family page's options table: every option its strategies declare, once per
    declaration, with its default, the strategies that take it and its meaning."""
    names = _by_family(registry)[key]
    rows: dict[int, tuple[Any, list[str]]] = {}
    for name in names:
        for option in options_of(registry[name]).values():
            rows.setdefault(id(option), (option, []))[1].append(name)
    lines = ["| option | default | strategies | meaning |", "|---|---|---|---|"]
    for option, takers in rows.values():
        who = "all" if takers == names and len(names) > 1 else ", ".join(
            f"`{n}`" for n in takers)
        meaning = _ROLE.sub(r"`\1`", " ".join(option.help.replace("``", "`").split()))
        meaning = meaning.replace("|", "\\|")
        lines.append(f"| `{option.name}` | `{_shown(option.shown_default)}` | {who} | "
                     f"{meaning} |")
    return "\n".join(lines) + "\n"


def tables(registry: Mapping[str, type] = STRATEGIES) -> dict[str, Callable[[], str]]:
    """Block name -> its generator."""
    found: dict[str, Callable[[], str]] = {
        "readme": lambda: readme_table(registry),
        "architecture": lambda: architecture_table(registry)}
    for key in FAMILIES:
        found[f"family:{key}"] = lambda key=key: family_table(key, registry)
    return found


def render(page: str, registry: Mapping[str, type] = STRATEGIES) -> str:
    """``page`` with every strategy table block regenerated from ``registry``."""
    generators = tables(registry)
    return BLOCK.sub(lambda m: m.group(1) + generators[m.group(2)]() + m.group(4), page)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="rewrite the blocks of the pages")
    args = parser.parse_args(argv)
    if args.write:
        for page in PAGES:
            text = page.read_text(encoding="utf-8")
            if render(text) != text:
                page.write_text(render(text), encoding="utf-8")
                print(f"rewrote {page.relative_to(ROOT)}")
        return 0
    for name, table in tables().items():
        print(f"<!-- strategies:{name} -->\n{table()}<!-- /strategies -->\n")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
