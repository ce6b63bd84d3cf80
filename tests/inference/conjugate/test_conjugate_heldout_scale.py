"""The held-out feature-scale criterion on a grid: additive over clients, equal to the
``"validation"`` choice of `fit_conjugate_head` (Brent on the same criterion) to within
the grid's parabolic refinement, and a deterministic choice from the summed vector."""

import itertools
import math

import pytest
import torch

from inference.conjugate import ConjugatePrior, SufficientStatistics
from inference.conjugate.feature_scale import fit_conjugate_head
from inference.conjugate.heldout_scale import (
    HELDOUT_SCALE_CAP,
    HELDOUT_SCALE_GRID,
    heldout_nll_grid,
    scale_from_grid,
)
from inference.errors import InvalidInputError

C, D = 4, 5


def blobs(n, seed, spread):
    g = torch.Generator().manual_seed(seed)
    means = torch.randn(C, D, generator=torch.Generator().manual_seed(7)) * 2
    y = torch.randint(0, C, (n,), generator=g)
    return (means[y] + spread * torch.randn(n, D, generator=g)).double(), y


def test_the_grid_is_geometric_from_1_32_to_8_four_points_an_octave():
    assert len(HELDOUT_SCALE_GRID) == 33
    assert HELDOUT_SCALE_GRID[0] == 1 / 32 and HELDOUT_SCALE_GRID[-1] == 8
    ratios = [b / a for a, b in itertools.pairwise(HELDOUT_SCALE_GRID)]
    assert ratios == pytest.approx([2 ** 0.25] * 32, rel=1e-12)


def test_scores_add_over_clients_to_the_pooled_scores():
    x, y = blobs(300, 0, 1.0)
    stats = SufficientStatistics.from_features(x, y, C)
    vx, vy = blobs(90, 1, 2.0)
    prior = ConjugatePrior()
    pooled = heldout_nll_grid(stats, prior, vx, vy)
    parts = sum(heldout_nll_grid(stats, prior, vx[i::3], vy[i::3]) for i in range(3))
    torch.testing.assert_close(parts, pooled, rtol=1e-12, atol=0)  # float64 sums reordered
    assert pooled.shape == (33,) and bool((pooled > 0).all())


def test_the_choice_is_the_validation_choice_of_fit_conjugate_head():
    # held-out examples twice as spread as the training ones: the best scale is interior
    x, y = blobs(400, 0, 1.0)
    vx, vy = blobs(200, 1, 2.0)
    stats = SufficientStatistics.from_features(x, y, C)
    scale = scale_from_grid(heldout_nll_grid(stats, ConjugatePrior(), vx, vy))
    reference = fit_conjugate_head(x, y, C, feature_scale="validation",
                                   validation_data=(vx, vy)).feature_scale_selection.value
    assert HELDOUT_SCALE_GRID[0] < scale < HELDOUT_SCALE_GRID[-1]
    # the parabola through three points 19% apart lands within 2% of Brent's minimum of the
    # same smooth criterion (a grid choice without the refinement is off by up to 9%)
    assert scale == pytest.approx(reference, rel=0.02)


def test_no_held_out_example_scores_zero():
    x, y = blobs(50, 0, 1.0)
    stats = SufficientStatistics.from_features(x, y, C)
    out = heldout_nll_grid(stats, ConjugatePrior(), x[:0], y[:0])
    assert torch.equal(out, torch.zeros(33, dtype=torch.float64))


def test_the_choice_is_the_vertex_of_a_quadratic_in_log_s_and_an_end_at_the_ends():
    logs = torch.tensor([math.log(s) for s in HELDOUT_SCALE_GRID], dtype=torch.float64)
    for target in (0.07, 0.5, 1.3, 5.0):
        choice = scale_from_grid((logs - math.log(target)) ** 2, cap=None)
        assert choice == pytest.approx(target, rel=1e-9)
    assert scale_from_grid(logs) == HELDOUT_SCALE_GRID[0]  # increasing: the smallest scale
    assert scale_from_grid(-logs, cap=None) == HELDOUT_SCALE_GRID[-1]


def test_the_choice_never_sharpens_past_the_cap():
    """`HELDOUT_SCALE_CAP` = 1: a minimiser above it gives the best scale up to it (the cap
    where the NLL falls up to it, a lower minimum where there is one), one below it is kept
    as it is, refinement included."""
    assert HELDOUT_SCALE_CAP == 1.0
    logs = torch.tensor([math.log(s) for s in HELDOUT_SCALE_GRID], dtype=torch.float64)
    for target in (0.07, 0.5, 0.97):  # 0.97: refined between the grid's 0.84 and 1
        assert scale_from_grid((logs - math.log(target)) ** 2) == pytest.approx(target, rel=1e-9)
    for target in (1.05, 1.3, 5.0):
        assert scale_from_grid((logs - math.log(target)) ** 2) == 1.0
    assert scale_from_grid(-logs) == 1.0  # no error seen: ever sharper is never chosen
    # two minima: the lower one above the cap, the other below it: the one below
    two = torch.minimum((logs - math.log(3.0)) ** 2, 0.5 + (logs - math.log(0.3)) ** 2)
    assert scale_from_grid(two, cap=None) == pytest.approx(3.0, rel=1e-9)
    assert scale_from_grid(two) == pytest.approx(0.3, rel=1e-9)
    assert scale_from_grid((logs - math.log(5.0)) ** 2, cap=2.0) == 2.0
    with pytest.raises(InvalidInputError, match="below the grid"):
        scale_from_grid(-logs, cap=0.01)
    flat = torch.zeros(33, dtype=torch.float64)
    assert scale_from_grid(flat) == HELDOUT_SCALE_GRID[0]  # ties: the smallest, deterministic


@pytest.mark.parametrize("bad", [torch.zeros(32), torch.full((33,), math.nan),
                                 torch.full((33,), math.inf)])
def test_scores_of_the_wrong_shape_or_not_finite_are_refused(bad):
    with pytest.raises(InvalidInputError, match="33 finite numbers"):
        scale_from_grid(bad)


def test_features_of_the_wrong_width_are_refused():
    x, y = blobs(50, 0, 1.0)
    stats = SufficientStatistics.from_features(x, y, C)
    with pytest.raises(InvalidInputError, match=r"\(V, 5\)"):
        heldout_nll_grid(stats, ConjugatePrior(), x[:, :3], y)
