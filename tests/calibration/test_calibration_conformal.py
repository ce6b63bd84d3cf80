"""Split-conformal sets (calibration.conformal) against a brute-force implementation written
here from the definitions, against MAPIE (LAC) when it is installed, and the coverage
guarantee by simulation."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch

from calibration.conformal import (
    ConformalScore,
    CoverageAccumulator,
    all_label_scores,
    conformal_threshold,
    conformity_scores,
    coverage,
    prediction_sets,
    quantile_rank,
    set_sizes,
)
from calibration.errors import InvalidInputError


# ---- the brute force: loops over rows and labels, straight from the definitions ---------------
def brute_score(p: list[float], y: int, kind: str, u: float = 1.0, k_reg: int = 1,
                lam: float = 0.0) -> float:
    if kind == "lac":
        return 1.0 - p[y]
    ranking = sorted(range(len(p)), key=lambda j: (-p[j], j))
    rank = ranking.index(y)  # 0-based
    mass_above = math.fsum(p[j] for j in ranking[:rank])
    score = mass_above + u * p[y]
    if kind == "raps":
        score += lam * max(0, rank + 1 - k_reg)
    return score


def brute_threshold(scores: list[float], alpha: float) -> float:
    n = len(scores)
    k = math.ceil(Fraction(n + 1) * (1 - Fraction(alpha)))  # exact rational arithmetic
    return math.inf if k > n else sorted(scores)[k - 1]


def random_probs(n: int, c: int, seed: int, temperature: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(n, c, generator=g, dtype=torch.float64) * 2 / temperature,
                         dim=1)


def sample_labels(probs: torch.Tensor, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.multinomial(probs, 1, generator=g)[:, 0]


# float rounding of a sum of C probabilities in another order: C * eps relative to 1
SCORE_TOLERANCE = 16 * 2.2e-16


# every score with the forms it has (LAC has no randomised form: nothing to test, not a skip)
@pytest.mark.parametrize(("kind", "randomized"), [("lac", False), ("aps", False), ("aps", True),
                                                  ("raps", False), ("raps", True)])
def test_scores_match_the_brute_force(kind: str, randomized: bool) -> None:
    probs = random_probs(40, 6, seed=1)
    probs[0] = torch.tensor([0.25, 0.25, 0.25, 0.25, 0.0, 0.0], dtype=torch.float64)  # ties
    spec = ConformalScore(kind, randomized=randomized, k_reg=2, lam=0.05)
    u = torch.rand(40, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    scores = all_label_scores(probs, spec, uniforms=u)
    for i in range(40):
        p = probs[i].tolist()
        for y in range(6):
            expected = brute_score(p, y, kind, float(u[i]) if randomized else 1.0, 2,
                                   0.05 if kind == "raps" else 0.0)
            assert abs(float(scores[i, y]) - expected) <= SCORE_TOLERANCE


@pytest.mark.parametrize("kind", ["lac", "aps", "raps"])
@pytest.mark.parametrize("alpha", [0.05, 0.1, 0.2])
def test_sets_match_the_brute_force(kind: str, alpha: float) -> None:
    probs = random_probs(500, 10, seed=3)
    labels = sample_labels(probs, seed=4)
    cal, test = slice(0, 300), slice(300, 500)
    scores = conformity_scores(probs[cal], labels[cal], kind)
    threshold = conformal_threshold(scores, alpha)
    expected_t = brute_threshold([brute_score(probs[i].tolist(), int(labels[i]), kind,
                                              lam=0.01 if kind == "raps" else 0.0)
                                  for i in range(300)], alpha)
    assert abs(threshold - expected_t) <= SCORE_TOLERANCE
    sets = prediction_sets(probs[test], threshold, kind)
    assert sets.shape == (200, 10) and sets.dtype == torch.bool
    for row, i in enumerate(range(300, 500)):
        for y in range(10):
            s = brute_score(probs[i].tolist(), y, kind, lam=0.01 if kind == "raps" else 0.0)
            if abs(s - threshold) > SCORE_TOLERANCE:  # decided the same way by both
                assert bool(sets[row, y]) == (s <= threshold)


def test_a_calibration_rows_own_score_is_compared_bit_for_bit() -> None:
    # the threshold is one of the calibration scores; predicting that row must include y
    probs = random_probs(200, 10, seed=5)
    labels = sample_labels(probs, seed=6)
    for kind in ("lac", "aps", "raps"):
        scores = conformity_scores(probs, labels, kind)
        t = conformal_threshold(scores, 0.1)
        i = int(torch.nonzero(scores == t)[0, 0])
        assert bool(prediction_sets(probs[i:i + 1], t, kind)[0, labels[i]])


def test_sets_are_prefixes_of_the_ranking() -> None:
    probs = random_probs(300, 8, seed=7)
    order = torch.argsort(probs, dim=1, descending=True, stable=True)
    for spec in (ConformalScore("aps"), ConformalScore("raps", k_reg=1, lam=0.2),
                 ConformalScore("aps", randomized=True)):
        sets = prediction_sets(probs, 0.7, spec, generator=torch.Generator().manual_seed(0))
        ranked = sets.gather(1, order).int()
        assert bool((torch.diff(ranked, dim=1) <= 0).all())  # 1...1 0...0


def test_quantile_rank_is_exact() -> None:
    # (n + 1)(1 - alpha) is an integer here; the float product would round up past it
    assert quantile_rank(9, 0.1) == 9
    assert quantile_rank(19, 0.05) == 19
    assert quantile_rank(18, 0.05) == 19  # > n: no finite threshold
    for n in range(1, 200):
        for alpha in (0.01, 0.05, 0.1, 0.2, 0.5):
            assert quantile_rank(n, alpha) == math.ceil(Fraction(n + 1) * (1 - Fraction(alpha)))


def test_too_few_rows_give_every_label() -> None:
    probs = random_probs(18, 4, seed=8)
    labels = sample_labels(probs, seed=9)
    t = conformal_threshold(conformity_scores(probs, labels, "lac"), 0.05)
    assert t == math.inf
    assert bool(prediction_sets(probs, t, "lac").all())


def test_mapie_agrees_on_lac() -> None:
    mapie = pytest.importorskip("mapie.classification")
    from sklearn.base import BaseEstimator, ClassifierMixin

    class GivenProbabilities(ClassifierMixin, BaseEstimator):  # X holds the probabilities
        def fit(self, x, y):
            self.classes_ = np.arange(x.shape[1])
            return self

        def predict_proba(self, x):
            return np.asarray(x)

        def predict(self, x):
            return np.asarray(x).argmax(1)

    probs = random_probs(700, 7, seed=10)
    labels = sample_labels(probs, seed=11)
    p, y = probs.numpy(), labels.numpy()
    for alpha in (0.05, 0.1, 0.3):
        oracle = mapie.SplitConformalClassifier(GivenProbabilities().fit(p, y),
                                                confidence_level=1 - alpha,
                                                conformity_score="lac", prefit=True)
        oracle.conformalize(p[:400], y[:400])
        _, expected = oracle.predict_set(p[400:])
        t = conformal_threshold(conformity_scores(p[:400], y[:400], "lac"), alpha)
        assert np.array_equal(prediction_sets(p[400:], t, "lac").numpy(), expected[:, :, 0])


@pytest.mark.parametrize("spec", [ConformalScore("lac"), ConformalScore("aps", randomized=True),
                                  ConformalScore("raps", randomized=True, k_reg=2, lam=0.1)])
def test_coverage_guarantee_by_simulation(spec: ConformalScore) -> None:
    """Exchangeable rows (labels drawn from the probabilities, so scores almost surely distinct
    for the continuous and randomised scores): E[coverage] in [1 - a, 1 - a + 1/(n + 1)].

    Monte-Carlo tolerance. Given the threshold q, a split's test coverage over t rows is a
    mean of t Bernoulli(F(q)), F(q) ~ Beta(k, n + 1 - k) over calibration draws (k the
    threshold's rank). So the variance over splits is E[F(1 - F)] / t + Var(F) with
    E[F(1 - F)] <= E[F](1 - E[F]) <= 0.09 (Jensen; E[F] in [0.9, 0.92]) and
    Var(F) = k(n + 1 - k) / ((n + 1)^2 (n + 2)). With R splits the mean's standard error is
    the square root of that over R; we allow 4 standard errors (a false failure ~ 6e-5).
    """
    alpha, n, t, splits = 0.1, 50, 50, 400
    probs = random_probs(splits * (n + t), 6, seed=12, temperature=3.0)
    labels = sample_labels(probs, seed=13)
    g = torch.Generator().manual_seed(14)
    covered = []
    for r in range(splits):
        rows = slice(r * (n + t), (r + 1) * (n + t))
        p, y = probs[rows], labels[rows]
        q = conformal_threshold(conformity_scores(p[:n], y[:n], spec, generator=g), alpha)
        covered.append(coverage(prediction_sets(p[n:], q, spec, generator=g), y[n:]))
    mean = float(np.mean(covered))
    k = quantile_rank(n, alpha)
    beta_var = k * (n + 1 - k) / ((n + 1) ** 2 * (n + 2))
    tolerance = 4 * math.sqrt((0.09 / t + beta_var) / splits)
    assert mean >= 1 - alpha - tolerance  # the guarantee's lower side
    assert mean <= 1 - alpha + 1 / (n + 1) + tolerance  # and its upper side (no ties)
    assert tolerance < 1 / (n + 1)  # tight enough to see a threshold off by one rank


def test_accumulator_merges_exactly_and_matches_the_metrics() -> None:
    probs = random_probs(120, 5, seed=15)
    labels = sample_labels(probs, seed=16)
    sets = prediction_sets(probs, 0.8, "aps")
    parts = [CoverageAccumulator(5).update(sets[i:i + 40], labels[i:i + 40])
             for i in (0, 40, 80)]
    merged = parts[0]
    for part in parts[1:]:
        merged.merge(CoverageAccumulator.from_state_dict(part.state_dict()))
    whole = CoverageAccumulator(5).update(sets, labels).compute()
    assert merged.compute() == whole
    assert whole["coverage"] == coverage(sets, labels)
    assert whole["mean_set_size"] == pytest.approx(float(set_sizes(sets).double().mean()),
                                                   abs=1e-12)


def test_bad_input_is_refused_with_a_reason() -> None:
    probs = random_probs(10, 3, seed=0)
    with pytest.raises(InvalidInputError, match="alpha"):
        conformal_threshold(torch.rand(10), 1.5)
    with pytest.raises(InvalidInputError, match="unknown conformity score"):
        prediction_sets(probs, 0.5, "nope")
    with pytest.raises(InvalidInputError, match="randomised"):
        ConformalScore("lac", randomized=True)
    with pytest.raises(InvalidInputError):
        prediction_sets(probs * 2, 0.5, "lac")  # not probabilities
    with pytest.raises(InvalidInputError, match="finite"):
        conformal_threshold(torch.tensor([0.1, float("nan")]), 0.1)
    with pytest.raises(InvalidInputError, match="inconsistent"):
        CoverageAccumulator.from_state_dict({"counts": torch.tensor([3, 5]),
                                             "size_counts": torch.tensor([0, 3, 0, 0])})
