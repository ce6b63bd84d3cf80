"""The published tables of docs/results.md are what bench/published_tables.py generates from the
stored runs in bench/results/: a figure typed by hand, or a cache changed without regenerating
the page, fails here."""

import json

from bench.published_tables import (
    PAGE,
    README,
    TABLES,
    render,
    s1_shift_table,
    s1_verdict_table,
)


def test_every_table_block_of_the_results_page_equals_its_generation_from_the_caches():
    page, readme = PAGE.read_text(encoding="utf-8"), README.read_text(encoding="utf-8")
    for name in TABLES:
        assert f"<!-- table:{name} -->" in page + readme, f"no {name} table block"
    for text, where in ((page, "docs/results.md"), (readme, "README.md")):
        assert render(text) == text, (f"{where} differs from the caches: run "
                                      "`python bench/published_tables.py --write`")


def record(label, seed, nll30, auroc, plugin=True):
    shift = {"predictive/clean": {"accuracy": 0.9, "nll": 0.2, "ece": 0.01, "brier": 0.1},
             "predictive/30": {"accuracy": 0.7, "nll": nll30, "ece": 0.1, "brier": 0.4},
             "predictive/60": {"accuracy": 0.4, "nll": 2 * nll30, "ece": 0.2, "brier": 0.8},
             "predictive/auroc_entropy": auroc}
    if plugin:
        shift |= {f"map_plugin/{k[len('predictive/'):]}": v for k, v in shift.items()}
    return json.loads(json.dumps({"label": label, "seed": seed, "rounds": 30, "shift": shift}))


def test_the_shift_table_gives_mean_and_standard_error_over_seeds():
    table = s1_shift_table([record("A", 0, 1.0, 0.8), record("A", 1, 3.0, 0.9)])
    row = next(line for line in table.splitlines() if line.startswith("| A | headline"))
    assert "| 0,1 |" in row and "2.000 ± 1.000" in row and "0.850 ± 0.050" in row


def test_a_verdict_says_does_not_hold_where_the_other_method_is_better():
    from bench.published_tables import RECOMMENDED

    records = [record(RECOMMENDED, 0, 1.0, 0.80), record("FedPer", 0, 2.0, 0.90, plugin=False)]
    lines = s1_verdict_table(records).splitlines()
    nll = next(line for line in lines if "FedPer" in line and "NLL at 30°" in line)
    auroc = next(line for line in lines if "FedPer" in line and "AUROC" in line)
    assert nll.endswith("| holds |") and auroc.endswith("| does not hold |")
