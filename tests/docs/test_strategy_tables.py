"""Every table of the docs that lists strategies (the README's, docs/architecture.md's, each
family page's) is what bayesfl.strategies.listing generates from the registry: a strategy added
or moved without regenerating the pages (`python -m bayesfl.strategies.listing --write`), or a
row typed by hand, fails here."""

from pathlib import Path

from bayesfl.strategies import FAMILIES, STRATEGIES, options_of
from bayesfl.strategies.listing import BLOCK, PAGES, render, tables

ROOT = Path(__file__).resolve().parents[2]


def builtin() -> dict[str, type]:
    """The package's own strategies (a test may have registered one of its own meanwhile)."""
    return {n: c for n, c in STRATEGIES.items() if c.__module__.startswith("bayesfl.")}


def test_every_table_block_equals_its_generation_from_the_registry():
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        assert render(text, builtin()) == text, (
            f"{page.relative_to(ROOT)} differs from the registry: run "
            "`python -m bayesfl.strategies.listing --write`")


def test_every_table_has_its_block_on_its_page():
    found = {m.group(2): page for page in PAGES
             for m in BLOCK.finditer(page.read_text(encoding="utf-8"))}
    assert set(found) == set(tables())
    assert found["readme"].name == "README.md"
    assert found["architecture"] == ROOT / "docs" / "architecture.md"
    for key, family in FAMILIES.items():
        assert found[f"family:{key}"] == ROOT / "docs" / family.page


def test_the_generated_tables_name_every_strategy_its_module_and_its_options():
    generated = tables(builtin())
    readme, architecture = generated["readme"](), generated["architecture"]()
    for name, cls in builtin().items():
        assert f"`{name}`" in readme and f"`{name}`" in architecture, name
        module = cls.__module__.removeprefix("bayesfl.strategies.").replace(".", "/") + ".py"
        assert f"| `{module}` |" in architecture, name
        assert (ROOT / "bayesfl" / "strategies" / module).is_file()
        family = generated[f"family:{cls.registration.family}"]()
        for option in options_of(cls).values():
            rows = [r for r in family.splitlines() if r.startswith(f"| `{option.name}` |")]
            assert any(f"`{name}`" in r or "| all |" in r for r in rows), (name, option.name)
