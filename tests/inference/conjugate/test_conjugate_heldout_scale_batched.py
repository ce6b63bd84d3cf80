"""The batched held-out scoring (`heldout_nll_by_group`, which `heldout_nll_grid` and FedLog's
clients use) against the per-head, per-client loop of torch cross-entropies it replaced."""

import pytest
import torch

from inference.conjugate import ConjugatePrior, SufficientStatistics
from inference.conjugate.heldout_scale import (
    HELDOUT_SCALE_GRID,
    grid_heads,
    heldout_nll_by_group,
    heldout_nll_grid,
    heldout_nll_of_heads,
    scale_from_grid,
)
from inference.conjugate.posterior import ConjugatePosterior
from inference.errors import InvalidInputError

C, D = 10, 32

# The reference sums the same float64 per-example terms as the batched pass, in another order
# and with torch's log_softmax instead of logsumexp minus the label's logit: each term differs
# by a few ulps of the logits (|logits| ~ 1e2 at the grid's largest scale), and the sums by
# ~V ulps (the classes overlap, so no sum is near 0 where relative error means nothing);
# 1e-12 relative (about 5,000 ulps of the sums, ~1e4 below any gap between the grid's
# neighbours that could move the chosen scale) catches a wrong row, head, group or sign.
RTOL = 1e-12


def data(n, seed):
    g = torch.Generator().manual_seed(seed)
    means = 0.3 * torch.randn(C, D, generator=torch.Generator().manual_seed(7))
    y = torch.randint(0, C, (n,), generator=g)
    return (means[y] + 2 * torch.randn(n, D, generator=g)).double(), y


def loop_reference(stats, prior, features, labels):
    """The implementation before the batched pass: one MAP and one cross-entropy per scale."""
    inputs = torch.cat([torch.ones_like(features[:, :1]), features], dim=1)
    return torch.stack([
        torch.nn.functional.cross_entropy(
            inputs @ ConjugatePosterior(prior, stats, feature_scale=s).map().T, labels,
            reduction="sum")
        for s in HELDOUT_SCALE_GRID])


@pytest.mark.parametrize("nu", [1.0, 50.0])
def test_grid_equals_the_per_scale_loop(nu):
    x, y = data(400, 0)
    stats, prior = SufficientStatistics.from_features(x, y, C), ConjugatePrior(nu=nu)
    vx, vy = data(120, 1)
    got, want = heldout_nll_grid(stats, prior, vx, vy), loop_reference(stats, prior, vx, vy)
    torch.testing.assert_close(got, want, rtol=RTOL, atol=0)
    assert scale_from_grid(got) == pytest.approx(scale_from_grid(want), rel=1e-9)


def test_groups_equal_each_clients_own_scores_including_empty_ones():
    x, y = data(400, 2)
    stats = SufficientStatistics.from_features(x, y, C)
    heads = grid_heads(stats, ConjugatePrior())
    sizes = [3, 0, 1, 7, 0, 2]
    vx, vy = data(sum(sizes), 3)
    got = heldout_nll_by_group(heads, vx, vy, sizes)
    assert got.shape == (len(sizes), len(HELDOUT_SCALE_GRID)) and got.dtype == torch.float64
    for k, (fx, fy) in enumerate(zip(vx.split(sizes), vy.split(sizes), strict=True)):
        want = loop_reference(stats, ConjugatePrior(), fx, fy)
        torch.testing.assert_close(got[k], want, rtol=RTOL, atol=0)
        torch.testing.assert_close(heldout_nll_of_heads(heads, fx, fy), want, rtol=RTOL,
                                   atol=0)


def test_bad_group_sizes_are_refused():
    x, y = data(50, 4)
    heads = grid_heads(SufficientStatistics.from_features(x, y, C), ConjugatePrior())
    with pytest.raises(InvalidInputError, match="group sizes"):
        heldout_nll_by_group(heads, x, y, [20, 20])
    with pytest.raises(InvalidInputError, match="group sizes"):
        heldout_nll_by_group(heads, x, y, [60, -10])
