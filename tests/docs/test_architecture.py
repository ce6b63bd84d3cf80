"""docs/architecture.md's strategy table is the map of the registry: every registered strategy
has a row naming it and the module under ``bayesfl/strategies/`` that defines it, so the table
cannot drift again when a strategy is added or a module moves."""

import re
from pathlib import Path

from bayesfl.strategies import STRATEGIES

ROOT = Path(__file__).resolve().parents[2]
HEADER = "| family | strategy | module | down (broadcast) | up (upload) | aggregate |"


def strategy_rows() -> dict[str, str]:
    """Strategy name -> the first path in its row's module column."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    assert HEADER in text, "docs/architecture.md lost its strategy table header"
    rows: dict[str, str] = {}
    for line in text.split(HEADER, 1)[1].splitlines()[2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        module = re.search(r"`([^`]+\.py)`", cells[2]).group(1)
        for name in re.findall(r"`([^`]+)`", cells[1]):
            rows[name] = module
    return rows


def test_the_architecture_table_lists_every_registered_strategy_and_nothing_else():
    rows = strategy_rows()
    assert sorted(set(STRATEGIES) - set(rows)) == [], "registered but missing from the table"
    assert sorted(set(rows) - set(STRATEGIES)) == [], "in the table but not registered"


def test_each_row_names_the_module_that_defines_the_strategy():
    rows = strategy_rows()
    for name, cls in STRATEGIES.items():
        module = cls.__module__.removeprefix("bayesfl.strategies.").replace(".", "/") + ".py"
        assert rows[name] == module, f"{name}: the table says {rows[name]}, the class: {module}"
        assert (ROOT / "bayesfl" / "strategies" / module).is_file()
