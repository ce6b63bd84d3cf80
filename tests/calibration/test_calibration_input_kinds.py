"""Every kind of array a caller can pass: converted when it is valid, refused clearly when not.

Each public entry (metrics, positive-class metrics, accumulator, bootstrap, report, diagram)
goes through the same conversion (calibration.inputs), so a valid input in an unusual form gives
exactly the number its plain float64 form gives, and an invalid one an InvalidInputError that
names the argument, what it holds, and what to pass instead.
"""

import warnings

import numpy as np
import pytest
import torch
from calibration_reference import calibrated_labels, random_probs

from calibration import (
    Accumulator,
    InvalidInputError,
    bootstrap_ece,
    ece,
    evaluate,
    positive_class_ece,
    reliability_stats,
    report,
)
from calibration.row_scores import SUM_TOLERANCE, sum_tolerance


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(4)
    probs = random_probs(rng, 300, 4)
    return probs, calibrated_labels(rng, probs)


def entry_points(probs, labels):
    """Every public entry that scores (probs, labels), as name -> zero-argument call."""

    def positive_class():
        binary = np.stack([1 - probs[:, 0], probs[:, 0]], axis=1)  # valid probs only
        return positive_class_ece(binary, labels)

    return {
        "ece": lambda: ece(probs, labels),
        "evaluate": lambda: evaluate(probs, labels),
        "quantile": lambda: reliability_stats(probs, labels, binning="quantile"),
        "accumulator": lambda: Accumulator(15).update(probs, labels).compute(),
        "bootstrap": lambda: bootstrap_ece(probs, labels, n_boot=20),
        "report": lambda: report(probs, labels).pooled,
        "positive_class": positive_class,
    }


# -- valid input in an unusual form works -------------------------------------------------------
@pytest.mark.parametrize("order", [">", "<"])
def test_either_byte_order_gives_the_native_result(data, order):
    probs, labels = data
    swapped_probs = probs.astype(np.dtype("f8").newbyteorder(order))
    swapped_labels = labels.astype(np.dtype("i8").newbyteorder(order))
    np.testing.assert_array_equal(swapped_probs, probs)  # same values, other byte order
    assert evaluate(swapped_probs, swapped_labels) == evaluate(probs, labels)
    got = report(swapped_probs, swapped_labels, client_ids=labels.astype(">i4"))
    assert got.pooled == report(probs, labels, client_ids=labels).pooled


def test_longdouble_is_rounded_to_float64(data):
    probs, labels = data
    wide = probs.astype(np.longdouble)
    assert evaluate(wide, labels) == evaluate(probs, labels)
    assert ece(probs, labels.astype(np.longdouble)) == ece(probs, labels)


def test_longdouble_beyond_float64_is_refused_not_made_infinite(data):
    probs, labels = data
    if np.finfo(np.longdouble).max <= np.finfo(np.float64).max:
        pytest.skip("np.longdouble is float64 on this platform: nothing lies beyond its range")
    logits = np.log(probs).astype(np.longdouble)
    logits[3, 1] = np.longdouble(10) ** 400
    with pytest.raises(InvalidInputError, match="beyond float64's range"):
        ece(logits, labels, from_logits=True)


def test_bfloat16_probabilities_are_scored(data):
    """bfloat16 keeps 8 significant bits: rounding alone moves a row sum by up to 2**-8."""
    probs, labels = data
    low = torch.softmax(torch.log(torch.tensor(probs)) * 3, dim=1).to(torch.bfloat16)
    sums = low.float().sum(1)
    assert float((sums - 1).abs().max()) > SUM_TOLERANCE  # the old fixed tolerance refused it
    expected = evaluate(low.float().numpy().astype(np.float64) / sums.numpy()[:, None], labels)
    got = evaluate(low, torch.tensor(labels))
    assert got["accuracy"] == expected["accuracy"]
    assert got["ece"] == pytest.approx(expected["ece"], abs=2**-8)  # the rounding of a row
    assert report(low, labels, client_ids=labels % 3).pooled.count == len(labels)


def test_the_row_sum_tolerance_follows_the_input_format():
    assert sum_tolerance(torch.float64) == sum_tolerance(torch.float32) == SUM_TOLERANCE
    assert sum_tolerance(torch.float16) == SUM_TOLERANCE  # eps 2**-10 < 1e-3
    assert sum_tolerance(torch.bfloat16) == 2**-7
    assert sum_tolerance(torch.int64) == SUM_TOLERANCE


def test_bfloat16_rows_off_by_more_than_their_precision_are_refused(data):
    probs, labels = data
    low = torch.tensor(probs, dtype=torch.bfloat16)
    low[5] *= 1.05
    with pytest.raises(InvalidInputError, match="row 5 sums to"):
        ece(low, labels)


@pytest.mark.parametrize("n_bins", [np.int64(15), np.int32(15), np.uint8(15), torch.tensor(15)])
def test_any_integer_type_is_a_bin_count(data, n_bins):
    probs, labels = data
    assert ece(probs, labels, n_bins=n_bins) == ece(probs, labels, n_bins=15)
    assert Accumulator(n_bins).n_bins == 15 and type(Accumulator(n_bins).n_bins) is int
    assert report(probs, labels, n_bins=n_bins).to_dict()["n_bins"] == 15  # JSON-ready


def test_bootstrap_takes_numpy_integers(data):
    probs, labels = data
    assert (bootstrap_ece(probs, labels, n_boot=np.int64(50), seed=np.int64(3))
            == bootstrap_ece(probs, labels, n_boot=50, seed=3))


@pytest.mark.parametrize("dtype", [np.uint16, np.uint32, np.uint64, np.int8])
def test_labels_of_any_integer_dtype(data, dtype):
    probs, labels = data
    assert ece(probs, labels.astype(dtype)) == ece(probs, labels)


def test_a_label_beyond_int64_is_refused_with_its_value(data):
    probs, labels = data
    big = labels.astype(np.uint64)
    big[2] = 2**63 + 5
    with pytest.raises(InvalidInputError, match=str(2**63 + 5)):
        ece(probs, big)
    huge = labels.astype(float)
    huge[9] = 1e30
    with pytest.raises(InvalidInputError, match=r"label 1e\+30 is out of range"):
        ece(probs, huge)


# -- invalid kinds are refused, at every entry ---------------------------------------------------
def refused_probs(probs):
    """Arrays that are no probabilities, with the words the refusal must contain."""
    dense = torch.tensor(probs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # sparse CSR / quantized are beta/deprecated
        cases = {
            "text": (probs.astype(str), r"holds text.*convert the strings"),
            "bytes": (probs.astype("S8"), "holds bytes"),
            "datetime64": (probs.astype("datetime64[s]"), "holds dates"),
            "timedelta64": (probs.astype("timedelta64[s]"), "holds time spans"),
            "object": (probs.astype(object), "Python objects"),
            "structured": (np.zeros(len(probs), dtype=[("a", "f8"), ("b", "f8")]), "structured"),
            "complex": (probs.astype(complex), "real-valued.*complex"),
            "sparse_coo": (dense.to_sparse(), r"sparse tensor.*to_dense\(\)"),
            "sparse_csr": (dense.to_sparse_csr(), r"sparse tensor.*to_dense\(\)"),
            "quantized": (torch.quantize_per_tensor(dense.float(), 0.01, 0, torch.quint8),
                          r"quantized.*dequantize\(\)"),
            "meta": (dense.to("meta"), "'meta' device and holds no values"),
            "nested": (torch.nested.nested_tensor([dense[0], dense[1, :3]],
                                                  layout=torch.jagged), "nested tensor"),
            "ragged list": ([[0.5, 0.5], [1.0]], "not a numeric array"),
            "list with None": ([[0.5, None]] * len(probs), "Python objects"),
            "bool": (probs > 0.5, "real-valued numbers"),
        }
    return cases


@pytest.mark.parametrize("case", list(refused_probs(np.full((3, 2), 0.5))))
def test_probabilities_that_are_no_numbers_are_refused_everywhere(data, case):
    probs, labels = data
    bad, message = refused_probs(probs)[case]
    for name, call in entry_points(bad, labels).items():
        if name == "positive_class":
            continue  # it builds its own two columns; checked below
        with pytest.raises(InvalidInputError, match=message):
            call()


def refused_labels(labels):
    """Label arrays that are no class indices, with the words the refusal must contain."""
    dense = torch.tensor(labels)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return {
            "text": (labels.astype(str), "holds text"),
            "datetime64": (labels.astype("datetime64[D]"), "holds dates"),
            "object": (labels.astype(object), "Python objects"),
            "complex": (labels.astype(complex), "complex"),
            "sparse": (dense.to_sparse(), "sparse tensor"),
            "quantized": (torch.quantize_per_tensor(dense.float(), 1.0, 0, torch.quint8),
                          "quantized"),
            "meta": (dense.to("meta"), "'meta' device"),
        }


@pytest.mark.parametrize("case", list(refused_labels(np.zeros(2, dtype=int))))
def test_labels_that_are_no_numbers_are_refused_everywhere(data, case):
    probs, labels = data
    bad, message = refused_labels(labels)[case]
    for call in entry_points(probs, bad).values():
        with pytest.raises(InvalidInputError, match=message):
            call()


@pytest.mark.parametrize("shape", ["1-D", "2-D"])
def test_positive_class_ece_refuses_complex_scores(data, shape):
    probs, labels = data
    positive = (labels == 0).astype(int)
    scores = probs[:, 0] if shape == "1-D" else np.stack([1 - probs[:, 0], probs[:, 0]], 1)
    assert positive_class_ece(scores, positive) >= 0  # the real values are fine
    with pytest.raises(InvalidInputError, match="complex"):
        positive_class_ece(scores.astype(complex), positive)
    with pytest.raises(InvalidInputError, match="complex"):
        positive_class_ece(torch.tensor(scores, dtype=torch.complex64), positive)


@pytest.mark.parametrize("value", [15.0, "15", True, None, 0, -1])
def test_a_bin_count_must_be_a_positive_integer(data, value):
    probs, labels = data
    with pytest.raises(InvalidInputError, match="n_bins must be a positive integer"):
        ece(probs, labels, n_bins=value)


@pytest.mark.parametrize(("argument", "value", "message"), [
    ("alpha", "x", "alpha must be a number"), ("alpha", float("nan"), r"alpha must lie in"),
    ("alpha", 1.0, "alpha must lie in"), ("seed", "x", "seed must be an integer"),
    ("seed", 2.0, "seed must be an integer"), ("seed", 2**64, "seed must be an integer in"),
    ("n_boot", 10.0, "n_boot must be a positive integer"),
])
def test_bootstrap_arguments_are_checked(data, argument, value, message):
    probs, labels = data
    with pytest.raises(InvalidInputError, match=message):
        bootstrap_ece(probs, labels, **{"n_boot": 10, argument: value})


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_from_logits_must_be_a_bool(data, value):
    probs, labels = data
    with pytest.raises(InvalidInputError, match="from_logits must be True or False"):
        ece(probs, labels, from_logits=value)
    assert ece(probs, labels, from_logits=np.bool_(False)) == ece(probs, labels)


def test_accumulator_arguments_are_checked(data):
    probs, labels = data
    with pytest.raises(InvalidInputError, match="device must be a torch device"):
        Accumulator(15, device="bogus")
    with pytest.raises(InvalidInputError, match="can only merge an Accumulator"):
        Accumulator(15).merge(5)
    with pytest.raises(InvalidInputError, match="expected Accumulators only; got a str"):
        Accumulator.merged([Accumulator(15), "x"])
    for bad in (None, 3, Accumulator(15)):
        with pytest.raises(InvalidInputError, match="expected an iterable of Accumulators"):
            Accumulator.merged(bad)
        with pytest.raises(InvalidInputError, match="expected an iterable of Accumulators"):
            Accumulator.compute_each(bad)
    with pytest.raises(InvalidInputError, match="debiased must be True or False"):
        from calibration import l2_calibration_error

        l2_calibration_error(probs, labels, debiased=np.array([1, 0]))
    with pytest.raises(InvalidInputError, match="mapping"):
        Accumulator.from_state_dict([1, 2])
    state = Accumulator(15).update(probs, labels).state_dict()
    state["bin_counts"] = state["bin_counts"].double() + 0.5
    with pytest.raises(InvalidInputError, match="whole numbers"):
        Accumulator.from_state_dict(state)


def test_accumulator_state_in_big_endian_numpy_is_read(data):
    probs, labels = data
    accumulator = Accumulator(10).update(probs, labels)
    state = {key: value.numpy().astype(value.numpy().dtype.newbyteorder(">"))
             for key, value in accumulator.state_dict().items()}
    assert Accumulator.from_state_dict(state).compute() == accumulator.compute()


@pytest.mark.parametrize(("groups", "message"), [
    (np.full(300, 0.5), r"groups\[0\] = 0.5"),
    (np.full(300, np.nan), r"groups\[0\] = nan"),
    (np.array(["a"] * 300), "holds text"),
    (np.full(300, 7), r"group 7 is out of range"),
    (np.zeros(299, dtype=int), r"groups must have shape \(300,\)"),
])
def test_per_group_refuses_groups_that_are_no_indices(data, groups, message):
    probs, labels = data
    with pytest.raises(InvalidInputError, match=message):
        Accumulator.per_group(probs, labels, groups, 3)


# -- client ids --------------------------------------------------------------------------------
CLIENT_CASES = {
    "None": ([None] * 100 + [1] * 200, r"client_ids\[0\] is missing \(None\)"),
    "NaN": ([1.0] * 100 + [np.nan] * 200, r"client_ids\[100\] is missing \(NaN\) \(200 such"),
    "NaN tensor": (torch.tensor([1.0] * 299 + [float("nan")]), r"client_ids\[299\] is missing"),
    "mixed list": ([1] * 100 + ["a"] * 200, "mix numbers .* and strings"),
    "mixed objects": (np.array(["a"] * 100 + [1] * 200, dtype=object),
                      r"mix numbers \(client_ids\[100\] = 1\) and strings"),
    "bool": ([True, False] * 150, r"client_ids\[0\] is a bool"),
    "bytes": (np.array([b"a"] * 300), "dtype |S1"),
    "dates": (np.zeros(300).astype("datetime64[D]"), "dtype datetime64"),
    "empty string": ([""] * 300, "empty string"),
    "tuple ids": ([(1, 2)] * 300, r"is a tuple"),
    "one string": ("abc", "got a single str"),
    "short": (list(range(10)), r"shape \(300,\)"),
}


@pytest.mark.parametrize("case", list(CLIENT_CASES))
@pytest.mark.parametrize("binning", ["uniform", "quantile"])
def test_client_ids_that_are_missing_mixed_or_not_ids_are_refused(data, case, binning):
    probs, labels = data
    ids, message = CLIENT_CASES[case]
    with pytest.raises(InvalidInputError, match=message):
        report(probs, labels, client_ids=ids, binning=binning)


def test_valid_client_ids_of_every_kind_give_the_same_report(data):
    probs, labels = data
    groups = np.arange(300) % 3
    expected = report(probs, labels, client_ids=groups)
    for ids in (groups.tolist(), groups.astype(np.uint64), torch.tensor(groups),
                groups.astype(float), np.array(["0", "1", "2"])[groups],
                np.array(["0", "1", "2"], dtype=object)[groups]):
        got = report(probs, labels, client_ids=ids)
        assert [row.count for row in got.clients] == [row.count for row in expected.clients]
        assert [row.ece for row in got.clients] == [row.ece for row in expected.clients]


def test_from_accumulators_refuses_missing_ids_and_non_accumulators(data):
    probs, labels = data
    acc = Accumulator(15).update(probs, labels)
    from calibration import CalibrationReport

    with pytest.raises(InvalidInputError, match="None"):
        CalibrationReport.from_accumulators({None: acc})
    with pytest.raises(InvalidInputError, match="expected an Accumulator"):
        CalibrationReport.from_accumulators({"a": acc, "b": 3})


# -- bad rows are counted over the whole input ---------------------------------------------------
def test_bad_rows_are_counted_over_all_clients(data):
    """With client ids every client is scored apart; the message must still count all rows."""
    probs, labels = data
    doubled = probs * 2  # every row sums to 2
    clients = np.arange(300) % 19
    for binning in ("uniform", "quantile"):
        with pytest.raises(InvalidInputError, match=r"row 0 sums to 2 \(300 bad rows\)"):
            report(doubled, labels, client_ids=clients, binning=binning)
    some = probs.copy()
    some[[40, 41, 250]] *= 2
    with pytest.raises(InvalidInputError, match=r"row 40 sums to 2 \(3 bad rows\)"):
        report(some, labels, client_ids=clients)
