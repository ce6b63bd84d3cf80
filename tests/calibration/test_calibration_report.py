"""Per-client reports: client rows, pooled (micro) row, macro row, renderings."""

import json

import numpy as np
import pytest
from calibration_reference import calibrated_labels, random_probs

from calibration.accumulator import Accumulator
from calibration.errors import InvalidInputError
from calibration.metrics import evaluate
from calibration.report import MACRO, POOLED, SPREAD, CalibrationReport, report

KEYS = ("accuracy", "ece", "mce", "brier", "nll")


def data(n=900, seed=0):
    rng = np.random.default_rng(seed)
    probs = random_probs(rng, n, 5)
    labels = calibrated_labels(rng, probs ** 0.6)
    clients = np.array(["north", "south", "east"])[rng.integers(0, 3, n)]
    return probs, labels, clients


@pytest.mark.parametrize("binning", ["uniform", "quantile"])
def test_rows_are_per_client_pooled_and_macro(binning):
    probs, labels, clients = data()
    result = report(probs, labels, clients, n_bins=10, binning=binning)
    assert [row.name for row in result.clients] == ["east", "north", "south"]
    for row in result.clients:
        expected = evaluate(probs[clients == row.name], labels[clients == row.name], 10, binning)
        assert row.count == expected["count"]
        for key in KEYS:
            assert getattr(row, key) == pytest.approx(expected[key], abs=1e-12)
    pooled = evaluate(probs, labels, 10, binning)
    assert result.pooled.name == POOLED and result.pooled.count == 900
    for key in KEYS:
        assert getattr(result.pooled, key) == pytest.approx(pooled[key], abs=1e-12)
        assert getattr(result.macro, key) == pytest.approx(
            np.mean([getattr(row, key) for row in result.clients]), abs=1e-12)
    assert result.macro.name == MACRO
    assert result.spread.name == SPREAD and result.rows[-1] is not None
    for key in KEYS:
        assert getattr(result.spread, key) == pytest.approx(
            np.std([getattr(row, key) for row in result.clients], ddof=1), abs=1e-12)


def test_from_accumulators_equals_report_on_the_pooled_arrays():
    probs, labels, clients = data()
    accumulators = {c: Accumulator(15).update(probs[clients == c], labels[clients == c])
                    for c in ("south", "north", "east")}
    merged = CalibrationReport.from_accumulators(accumulators)
    direct = report(probs, labels, clients)
    assert [row.name for row in merged.rows] == [row.name for row in direct.rows]
    for mine, theirs in zip(merged.rows, direct.rows, strict=True):
        assert mine.count == theirs.count
        for key in KEYS:  # merge order differs: float64 sums agree to rounding
            assert getattr(mine, key) == pytest.approx(getattr(theirs, key), abs=1e-12)
    np.testing.assert_array_equal(merged.pooled_bins.counts, direct.pooled_bins.counts)


def test_integer_client_ids_are_ordered_numerically():
    probs, labels, _ = data()
    ids = np.arange(900) % 12
    assert [row.name for row in report(probs, labels, ids).clients] == [str(i) for i in range(12)]


def test_without_clients_there_is_one_row():
    probs, labels, _ = data()
    result = report(probs, labels)
    assert result.clients == () and result.macro is None and result.pooled.name == "all"
    assert result.spread is None and len(result.rows) == 1
    assert json.loads(result.to_json())["client_range"] is None


def test_json_markdown_and_text_renderings():
    probs, labels, clients = data()
    result = report(probs, labels, clients)
    parsed = json.loads(result.to_json())
    assert parsed["pooled"]["name"] == POOLED and len(parsed["clients"]) == 3
    assert parsed["macro"]["name"] == MACRO and parsed["spread"]["name"] == SPREAD
    eces = [row["ece"] for row in parsed["clients"]]
    assert parsed["client_range"]["ece"] == [min(eces), max(eces)]
    assert sum(parsed["pooled_bins"]["counts"]) == 900
    markdown = result.to_markdown().splitlines()
    assert markdown[0].startswith("| group |") and len(markdown) == 2 + 6
    text = str(result)
    for name in ("east", "north", "south", POOLED, MACRO, SPREAD, "ECE", "Brier"):
        assert name in text


def test_plot_writes_the_pooled_diagram(tmp_path):
    probs, labels, clients = data()
    report(probs, labels, clients).plot(tmp_path / "pooled.png")
    assert (tmp_path / "pooled.png").read_bytes().startswith(b"\x89PNG")


def test_client_ids_of_the_wrong_length_are_refused():
    probs, labels, clients = data()
    with pytest.raises(InvalidInputError, match="client_ids"):
        report(probs, labels, clients[:-1])


def test_a_client_named_like_a_summary_row_is_refused():
    probs, labels, _ = data()
    with pytest.raises(InvalidInputError, match="reserved"):
        report(probs, labels, np.full(900, POOLED))


def test_one_client_has_no_spread():
    probs, labels, _ = data()
    result = report(probs, labels, np.zeros(900, dtype=int))
    assert all(getattr(result.spread, key) == 0.0 for key in KEYS)
