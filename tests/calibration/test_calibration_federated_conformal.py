"""The conformal threshold without pooling scores (calibration.federated_conformal): the exact
search equals the pooled threshold bit for bit; the one-shot quantile of quantiles has the
coverage the paper's formula states (checked by simulation)."""

from __future__ import annotations

import math

import pytest
import torch

from calibration.conformal import conformal_threshold, quantile_rank
from calibration.errors import InvalidInputError
from calibration.federated_conformal import (
    LocalQuantile,
    ThresholdCounts,
    counts_problem,
    exact_threshold_search,
    federated_threshold,
    float_key,
    key_float,
    one_shot_coverage,
    one_shot_ranks,
    one_shot_threshold,
    quantile_of_quantiles,
)


def test_float_keys_order_like_floats() -> None:
    values = [-math.inf, -1e300, -1.0, -5e-324, -0.0, 0.0, 5e-324, 0.3, 1.0, 1e300, math.inf]
    keys = [float_key(v) for v in values]
    assert keys == sorted(keys) and len(set(keys)) == len(keys)
    for v in values:
        assert math.copysign(1, key_float(float_key(v))) == math.copysign(1, v)
        assert key_float(float_key(v)) == v


@pytest.mark.parametrize("probes", [1, 3, 15])
def test_exact_search_equals_the_pooled_threshold_bit_for_bit(probes: int) -> None:
    g = torch.Generator().manual_seed(0)
    for trial in range(30):
        m = int(torch.randint(1, 8, (1,), generator=g))
        parts = [torch.rand(int(torch.randint(1, 40, (1,), generator=g)), generator=g,
                            dtype=torch.float64) * 1.5 for _ in range(m)]
        if trial % 3 == 0:  # ties, and scores spread over many binades
            parts = [p.round(decimals=2) for p in parts]
        if trial % 3 == 1:
            parts = [p ** 40 for p in parts]
        pooled = torch.cat(parts)
        for alpha in (0.01, 0.05, 0.1, 0.37):
            found = federated_threshold(parts, alpha, probes=probes)
            expected = conformal_threshold(pooled, alpha)
            assert float_key(found.threshold) == float_key(expected)  # the same float
            assert found.count == pooled.shape[0]
            assert found.rank == quantile_rank(pooled.shape[0], alpha)
            # steps: one for N, then ceil(64 / log2(probes + 1)) at most (the key range)
            if math.isfinite(expected):
                assert found.steps <= 1 + math.ceil(64 / math.log2(probes + 1)) + 1


def test_counts_are_the_only_thing_a_client_reveals() -> None:
    search = exact_threshold_search(0.1)
    first = next(search)
    assert first.tolist() == [math.inf]
    scores = torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64)
    answer = ThresholdCounts.of(scores, first)
    assert answer.at_most.tolist() == [3] and answer.count == 3
    proposal = search.send(answer + ThresholdCounts.of(torch.rand(20, dtype=torch.float64),
                                                       first))
    assert proposal.shape == (15,)


def test_dishonest_counts_are_spotted() -> None:
    t = torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64)
    honest = ThresholdCounts.of(torch.tensor([0.2, 0.6]), t)
    assert counts_problem(honest, 2) is None
    assert "fall" in counts_problem(ThresholdCounts(t, torch.tensor([2, 1, 2]), 2), 2)
    assert "[0, 2]" in counts_problem(ThresholdCounts(t, torch.tensor([0, 1, 3]), 2), 2)
    assert "changed" in counts_problem(honest, 5)


def test_one_shot_formula_against_closed_forms() -> None:
    # one client, local rank l of n: coverage l / (n + 1) (the usual split-conformal rank)
    for n, ell in ((10, 1), (10, 10), (49, 45)):
        assert one_shot_coverage([ell], [n], 1) == pytest.approx(ell / (n + 1), abs=1e-10)
    # max of m maxima = the pooled maximum: mn / (mn + 1)
    assert one_shot_coverage([7] * 4, [7] * 4, 4) == pytest.approx(28 / 29, abs=1e-10)
    # min of m minima = the pooled minimum: 1 / (mn + 1)
    assert one_shot_coverage([1] * 3, [5] * 3, 1) == pytest.approx(1 / 16, abs=1e-10)


@pytest.mark.parametrize(("sizes", "alpha"), [((20,) * 5, 0.1), ((10,) * 10, 0.05),
                                              ((8, 15, 30, 12), 0.1)])
def test_one_shot_coverage_holds_by_simulation(sizes: tuple[int, ...], alpha: float) -> None:
    """Scores uniform on (0, 1) (any continuous distribution gives the same ranks), so the
    coverage of a threshold q is q itself: the mean over R draws estimates E[F(q)] = M with no
    test-row noise. Tolerance: 4 standard errors of that mean (sample std / sqrt(R))."""
    m = len(sizes)
    uploads_ell = [LocalQuantile.of(torch.rand(n, dtype=torch.float64), alpha, m).ell
                   for n in sizes]
    bound = quantile_of_quantiles(
        [LocalQuantile(0.5, ell, n) for ell, n in zip(uploads_ell, sizes, strict=True)],
        alpha)
    assert bound.coverage_bound >= 1 - alpha
    g = torch.Generator().manual_seed(1)
    reps = 20000
    local = torch.stack([torch.sort(torch.rand(reps, n, generator=g, dtype=torch.float64),
                                    dim=1).values[:, ell - 1]
                         for n, ell in zip(sizes, uploads_ell, strict=True)], dim=1)
    thresholds = torch.sort(local, dim=1).values[:, bound.rank - 1]
    se = float(thresholds.std()) / math.sqrt(reps)
    assert abs(float(thresholds.mean()) - bound.coverage_bound) <= 4 * se
    assert float(thresholds.mean()) >= 1 - alpha - 4 * se


def test_one_shot_ranks_are_the_tightest_valid_pair() -> None:
    m, n, alpha = 6, 12, 0.1
    ell, k, cover = one_shot_ranks(m, n, alpha)
    assert ell in range(1, n + 1)  # a rank among a client's n scores
    assert k in range(1, m + 1)  # a rank among the m clients' quantiles
    assert cover >= 1 - alpha
    for other_k in range(1, m + 1):  # brute force over every pair
        for other_ell in range(1, n + 1):
            c = one_shot_coverage([other_ell] * m, [n] * m, other_k)
            if c >= 1 - alpha:
                assert c >= cover - 1e-12


def test_one_shot_with_too_few_scores_is_infinite() -> None:
    found = one_shot_threshold([torch.rand(3, dtype=torch.float64)], 0.05)
    assert found.threshold == math.inf and found.rank is None


def test_bad_input() -> None:
    with pytest.raises(InvalidInputError, match="probes"):
        next(exact_threshold_search(0.1, probes=0))
    with pytest.raises(InvalidInputError):
        federated_threshold([], 0.1)
    with pytest.raises(InvalidInputError, match="k <= m"):
        one_shot_coverage([1, 2], [3, 3], 3)
