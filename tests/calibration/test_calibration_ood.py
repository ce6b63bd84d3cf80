"""OOD detection metrics against scikit-learn and a brute-force pair count; the mergeable AUROC."""

import itertools
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from sklearn.metrics import average_precision_score, roc_auc_score, roc_curve

import calibration
from calibration import AurocAccumulator, InvalidInputError, aupr, auroc, fpr_at_tpr, ood_report
from calibration.binning import MAX_BINS

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
ORACLE_TOL = 1e-12


def random_scores(rng, n, ties):
    """Scores with no ties, some, or heavy ties (a handful of distinct values), and labels
    with both classes."""
    if ties == "none":
        scores = rng.normal(size=n)
    elif ties == "some":
        scores = np.round(rng.normal(size=n), 1)
    else:
        scores = rng.integers(0, 3, size=n).astype(np.float64) / 2
    is_ood = rng.random(n) < rng.uniform(0.1, 0.9)
    is_ood[0], is_ood[1] = True, False
    return scores, is_ood


def brute_force_auroc(scores, is_ood):
    """O(N^2): mean over (OOD, in) pairs of 1[ood > in] + 1/2 1[ood == in]."""
    out, inside = scores[is_ood], scores[~is_ood]
    total = 0.0
    for o in out:
        for i in inside:
            total += 1.0 if o > i else 0.5 if o == i else 0.0
    return total / (len(out) * len(inside))


def sklearn_fpr_at_tpr(scores, is_ood, tpr=0.95):
    fpr, tpr_curve, _ = roc_curve(is_ood, scores, drop_intermediate=False)
    return fpr[np.searchsorted(tpr_curve, tpr)]


def brute_force_fpr_at_tpr(scores, is_ood, tpr=0.95):
    """Loop over thresholds, highest first: the first flagging >= tpr of OOD rows."""
    for t in sorted(set(scores.tolist()), reverse=True):
        flagged = scores >= t
        if flagged[is_ood].sum() / is_ood.sum() >= tpr:
            return flagged[~is_ood].sum() / (~is_ood).sum()
    raise AssertionError("unreachable: the lowest threshold flags every row")


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(2, 400),
       ties=st.sampled_from(["none", "some", "heavy"]))
def test_detection_metrics_equal_scikit_learn(seed, n, ties):
    rng = np.random.default_rng(seed)
    scores, is_ood = random_scores(rng, n, ties)
    assert auroc(scores, is_ood) == pytest.approx(roc_auc_score(is_ood, scores), abs=ORACLE_TOL)
    assert aupr(scores, is_ood) == pytest.approx(
        average_precision_score(is_ood, scores), abs=ORACLE_TOL)
    assert aupr(scores, is_ood, positive="in") == pytest.approx(
        average_precision_score(~is_ood, -scores), abs=ORACLE_TOL)
    for tpr in (0.95, 0.5, 0.8, 1.0):
        assert fpr_at_tpr(scores, is_ood, tpr) == pytest.approx(
            sklearn_fpr_at_tpr(scores, is_ood, tpr), abs=ORACLE_TOL)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("ties", ["none", "some", "heavy"])
def test_auroc_and_fpr_equal_brute_force(seed, ties):
    rng = np.random.default_rng(seed)
    scores, is_ood = random_scores(rng, 150, ties)
    assert auroc(scores, is_ood) == pytest.approx(brute_force_auroc(scores, is_ood),
                                                  abs=ORACLE_TOL)
    assert fpr_at_tpr(scores, is_ood) == pytest.approx(brute_force_fpr_at_tpr(scores, is_ood),
                                                       abs=ORACLE_TOL)


def test_fpr_at_95_counts_19_of_20_as_95_percent():
    # 20 OOD rows; the threshold at the 19th highest flags exactly 95% of them
    out = np.arange(20, dtype=float) + 10          # 10..29
    inside = np.array([9.5, 10.5, 11.5, 50.0])     # 10.5..50 sit above the 19th OOD score (11)
    scores = np.concatenate([out, inside])
    is_ood = np.r_[np.ones(20, bool), np.zeros(4, bool)]
    assert fpr_at_tpr(scores, is_ood) == 0.5       # flags 11.5 and 50.0 of the 4 in-rows
    assert fpr_at_tpr(scores, is_ood) == sklearn_fpr_at_tpr(scores, is_ood)


def test_ties_count_one_half_and_all_tied_is_chance():
    assert auroc([1.0, 1.0], [True, False]) == 0.5
    assert auroc(np.zeros(7), [1, 0, 1, 0, 0, 1, 1]) == 0.5
    assert auroc([0.0, -0.0, 1.0], [1, 0, 1]) == 0.75  # -0.0 ties with 0.0
    assert auroc([3.0, 1.0], [True, False]) == 1.0
    assert auroc([3.0, 1.0], [True, False], higher_is_ood=False) == 0.0


@pytest.mark.parametrize("seed", range(4))
def test_flipping_the_convention_equals_negated_scores(seed):
    rng = np.random.default_rng(seed)
    scores, is_ood = random_scores(rng, 200, "some")
    assert auroc(scores, is_ood, higher_is_ood=False) == auroc(-scores, is_ood)
    assert auroc(scores, is_ood, higher_is_ood=False) == pytest.approx(
        1.0 - auroc(scores, is_ood), abs=ORACLE_TOL)
    assert aupr(scores, is_ood, higher_is_ood=False) == aupr(-scores, is_ood)
    assert fpr_at_tpr(scores, is_ood, higher_is_ood=False) == fpr_at_tpr(-scores, is_ood)
    # a confidence used as it is equals its negation as an OOD score
    probs = rng.dirichlet(np.ones(5), size=200)
    confidence = calibration.max_probability(probs)
    assert auroc(confidence, is_ood, higher_is_ood=False) == auroc(
        calibration.ood_scores(probs, kind="max_prob"), is_ood)


@pytest.mark.parametrize("seed", range(4))
def test_ood_report_equals_the_single_metrics(seed):
    rng = np.random.default_rng(seed)
    scores_in = np.round(rng.normal(size=120), 1)
    scores_out = np.round(rng.normal(0.7, 1.0, size=80), 1)
    scores = np.concatenate([scores_in, scores_out])
    is_ood = np.r_[np.zeros(120, bool), np.ones(80, bool)]
    report = ood_report(scores_in, scores_out, tpr=0.9)
    assert report == {
        "auroc": auroc(scores, is_ood), "aupr_out": aupr(scores, is_ood),
        "aupr_in": aupr(scores, is_ood, positive="in"),
        "fpr_at_tpr": fpr_at_tpr(scores, is_ood, 0.9), "tpr": 0.9, "n_in": 120, "n_ood": 80,
    }
    assert report["auroc"] == pytest.approx(roc_auc_score(is_ood, scores), abs=ORACLE_TOL)


@pytest.mark.parametrize("device", DEVICES)
def test_tensor_inputs_of_any_float_dtype(device):
    rng = np.random.default_rng(3)
    scores, is_ood = random_scores(rng, 300, "some")
    expected = roc_auc_score(is_ood, scores)
    for dtype in (torch.float32, torch.float64):
        s = torch.tensor(scores, dtype=dtype, device=device)
        y = torch.tensor(is_ood, device=device)
        assert auroc(s, y) == pytest.approx(roc_auc_score(is_ood, s.cpu().numpy()),
                                            abs=ORACLE_TOL)
        assert auroc(s, y.long()) == auroc(s, y)
    assert auroc(scores, is_ood.astype(np.float32)) == pytest.approx(expected, abs=ORACLE_TOL)


# -- the mergeable state ------------------------------------------------------------------------
def split_into_clients(rng, scores, is_ood, n_clients):
    cuts = np.sort(rng.choice(np.arange(1, len(scores)), n_clients - 1, replace=False))
    return list(zip(np.split(scores, cuts), np.split(is_ood, cuts), strict=True))


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(8, 300), n_clients=st.integers(1, 6),
       ties=st.sampled_from(["none", "some", "heavy"]))
def test_merged_state_equals_the_pooled_computation_exactly(seed, n, n_clients, ties):
    rng = np.random.default_rng(seed)
    scores, is_ood = random_scores(rng, n, ties)
    clients = split_into_clients(rng, scores, is_ood, n_clients)
    states = [AurocAccumulator().update(s, y) for s, y in clients]
    pooled = ood_report(scores[~is_ood], scores[is_ood])
    merged = AurocAccumulator.merged(states)
    assert merged.compute() == pooled  # bitwise: the merged counts are the pooled counts
    assert merged.auroc() == auroc(scores, is_ood)
    # any merge order, pairwise or all at once, sum() too
    for order in itertools.islice(itertools.permutations(states), 6):
        folded = order[0]
        for state in order[1:]:
            folded = folded + state
        assert folded.compute() == pooled
        assert sum(order).compute() == pooled
        for key in ("values", "in_counts", "ood_counts"):
            assert torch.equal(folded.state_dict()[key], merged.state_dict()[key])
    assert merged.compute()["auroc"] == pytest.approx(roc_auc_score(is_ood, scores),
                                                      abs=ORACLE_TOL)


def test_ties_across_clients_merge_into_one_count():
    a = AurocAccumulator().update([0.5, 0.5, 1.0], [1, 0, 1])
    b = AurocAccumulator().update([0.5, -0.0, 1.0], [0, 1, 0])
    merged = a + b
    state = merged.state_dict()
    assert state["values"].tolist() == [0.0, 0.5, 1.0]
    assert state["in_counts"].tolist() == [0, 2, 1]
    assert state["ood_counts"].tolist() == [1, 1, 1]
    scores = np.array([0.5, 0.5, 1.0, 0.5, 0.0, 1.0])
    is_ood = np.array([1, 0, 1, 0, 1, 0], bool)
    assert merged.auroc() == 7 / 18 == brute_force_auroc(scores, is_ood)  # correctly rounded
    assert merged.auroc() == pytest.approx(roc_auc_score(is_ood, scores), abs=ORACLE_TOL)
    assert merged.size == 3 and merged.n_in == 3 and merged.n_ood == 3


def test_clients_with_one_kind_of_rows_merge_into_a_scorable_state():
    only_in = AurocAccumulator().update([0.1, 0.2], [0, 0])
    only_out = AurocAccumulator().update([0.3, 0.15], [1, 1])
    with pytest.raises(InvalidInputError, match="no out-of-distribution"):
        only_in.compute()
    assert (only_in + only_out).auroc() == 0.75


def test_update_in_batches_equals_one_update():
    rng = np.random.default_rng(7)
    scores, is_ood = random_scores(rng, 500, "heavy")
    batched = AurocAccumulator()
    for start in range(0, 500, 64):
        batched.update(scores[start:start + 64], is_ood[start:start + 64])
    assert batched.compute() == AurocAccumulator().update(scores, is_ood).compute()


def test_state_dict_round_trip_and_validation():
    rng = np.random.default_rng(1)
    scores, is_ood = random_scores(rng, 100, "some")
    acc = AurocAccumulator().update(scores, is_ood)
    state = acc.state_dict()
    assert set(state) == {"values", "in_counts", "ood_counts"}
    back = AurocAccumulator.from_state_dict({k: v.numpy() for k, v in state.items()})
    assert back.compute() == acc.compute()
    assert AurocAccumulator.from_state_dict(AurocAccumulator().state_dict()).size == 0
    bad_order = dict(state, values=state["values"].flip(0))
    with pytest.raises(InvalidInputError, match="strictly increasing"):
        AurocAccumulator.from_state_dict(bad_order)
    with pytest.raises(InvalidInputError, match="negative"):
        AurocAccumulator.from_state_dict(dict(state, in_counts=-state["in_counts"] - 1))
    with pytest.raises(InvalidInputError, match="whole numbers"):
        AurocAccumulator.from_state_dict(dict(state, ood_counts=state["ood_counts"] + 0.5))
    with pytest.raises(InvalidInputError, match="shape"):
        AurocAccumulator.from_state_dict(dict(state, ood_counts=state["ood_counts"][1:]))
    with pytest.raises(InvalidInputError, match="keys"):
        AurocAccumulator.from_state_dict({"values": state["values"]})
    nan_values = state["values"].clone()
    nan_values[0] = float("nan")
    with pytest.raises(InvalidInputError, match="finite"):
        AurocAccumulator.from_state_dict(dict(state, values=nan_values))


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(4, 300), n_bins=st.integers(1, 50),
       ties=st.sampled_from(["none", "some", "heavy"]), n_clients=st.integers(1, 4))
@example(seed=0, n=30, n_bins=5, ties="some", n_clients=1)  # -0.2 sat 2 ulp below its edge
@example(seed=0, n=32, n_bins=5, ties="some", n_clients=1)
def test_binned_auroc_is_within_its_stated_bound(seed, n, n_bins, ties, n_clients):
    rng = np.random.default_rng(seed)
    scores, is_ood = random_scores(rng, n, ties)
    clients = split_into_clients(rng, scores, is_ood, min(n_clients, n - 1))
    # a range narrower than the scores: the outside rows fall in the end bins
    states = [AurocAccumulator(n_bins, score_range=(-1.0, 1.0)).update(s, y) for s, y in clients]
    merged = AurocAccumulator.merged(states)
    result = merged.compute()
    exact = auroc(scores, is_ood)
    assert abs(result["auroc"] - exact) <= result["auroc_error_bound"] + 1e-15
    # the edges are the floats nearest -1 + 2k/n_bins (exact rationals, rounded once): a score
    # written as an edge (-0.2, 0.2, ... with ties='some') opens its bin, whatever the rounding
    edges = np.array([float(Fraction(2 * k - n_bins, n_bins)) for k in range(n_bins + 1)])
    np.testing.assert_array_equal(merged.edges.numpy(), edges)
    bins = np.searchsorted(edges[1:-1], scores, side="right")
    # the bound is half the fraction of (OOD, in) pairs that share a bin, from the bins
    shared = sum((bins[is_ood] == b).sum() * (bins[~is_ood] == b).sum() for b in range(n_bins))
    assert result["auroc_error_bound"] == pytest.approx(
        shared / (2 * is_ood.sum() * (~is_ood).sum()), abs=1e-15)
    # binned AUROC = exact AUROC of the bin indices
    assert result["auroc"] == pytest.approx(roc_auc_score(is_ood, bins), abs=ORACLE_TOL)
    assert merged.state_dict()["in_counts"].shape == (n_bins,)


def test_binned_state_is_bounded_before_allocating_and_merges_only_like_bins():
    with pytest.raises(InvalidInputError, match="MAX_BINS"):
        AurocAccumulator(MAX_BINS + 1, score_range=(0, 1))
    with pytest.raises(InvalidInputError, match="score_range"):
        AurocAccumulator(10)
    with pytest.raises(InvalidInputError, match="n_bins"):
        AurocAccumulator(score_range=(0, 1))
    with pytest.raises(InvalidInputError, match="low < high"):
        AurocAccumulator(10, score_range=(1, 1))
    with pytest.raises(InvalidInputError, match="narrow"):
        AurocAccumulator(1000, score_range=(1.0, 1.0 + 1e-14))
    a = AurocAccumulator(10, score_range=(0, 1)).update([0.1, 0.9], [0, 1])
    with pytest.raises(InvalidInputError, match="same n_bins"):
        a.merge(AurocAccumulator(11, score_range=(0, 1)))
    with pytest.raises(InvalidInputError, match="same variant"):
        a.merge(AurocAccumulator())
    back = AurocAccumulator.from_state_dict(a.state_dict())
    assert back.binned and back.compute() == a.compute()
    assert a.compute()["auroc"] == 1.0 and a.compute()["auroc_error_bound"] == 0.0


@pytest.mark.parametrize("device", DEVICES)
def test_accumulator_on_a_device(device):
    rng = np.random.default_rng(5)
    scores, is_ood = random_scores(rng, 200, "some")
    acc = AurocAccumulator(device=device).update(torch.tensor(scores), torch.tensor(is_ood))
    assert acc.device.type == device
    assert acc.compute() == ood_report(scores[~is_ood], scores[is_ood])


# -- validation ---------------------------------------------------------------------------------
@pytest.mark.parametrize("scores, is_ood, match", [
    ([], [], "needs rows"),
    ([0.1, 0.2], [1, 1], "no in-distribution rows"),
    ([0.1, 0.2], [False, False], "no out-of-distribution rows"),
    ([0.1, float("nan")], [0, 1], "NaN or Inf"),
    ([0.1, float("inf")], [0, 1], "NaN or Inf"),
    ([0.1, 0.2, 0.3], [0, 1], "shape mismatch"),
    ([[0.1, 0.2]], [0, 1], "1-D"),
    ([0.1, 0.2], [0, 2], "is_ood"),
    ([0.1, 0.2], [0, 0.5], "is_ood"),
    ([0.1, 0.2], [[0, 1]], "1-D"),
])
def test_invalid_inputs_say_what_to_do(scores, is_ood, match):
    for metric in (auroc, aupr, fpr_at_tpr):
        with pytest.raises(InvalidInputError, match=match):
            metric(scores, is_ood)


def test_invalid_options():
    with pytest.raises(InvalidInputError, match="tpr"):
        fpr_at_tpr([0.1, 0.2], [0, 1], tpr=0.0)
    with pytest.raises(InvalidInputError, match="tpr"):
        fpr_at_tpr([0.1, 0.2], [0, 1], tpr=1.5)
    with pytest.raises(InvalidInputError, match="tpr"):
        fpr_at_tpr([0.1, 0.2], [0, 1], tpr="0.9")
    assert fpr_at_tpr([0.1, 0.2], [0, 1], tpr=np.float32(0.5)) == 0.0
    with pytest.raises(InvalidInputError, match="positive"):
        aupr([0.1, 0.2], [0, 1], positive="outlier")
    with pytest.raises(InvalidInputError, match="higher_is_ood"):
        auroc([0.1, 0.2], [0, 1], higher_is_ood=1)
    with pytest.raises(InvalidInputError, match="no out-of-distribution"):
        ood_report([0.1, 0.2], [])
    with pytest.raises(InvalidInputError, match="empty"):
        AurocAccumulator().compute()
    with pytest.raises(InvalidInputError, match="AurocAccumulator"):
        AurocAccumulator().merge(calibration.Accumulator())
