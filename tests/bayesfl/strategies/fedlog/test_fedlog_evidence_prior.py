"""FedLog chooses the feature scale under its own prior: the server's evidence of the summed
statistics with ``prior_nu``'s pseudo-count, so the scale moves with ``prior_nu`` (the
evidence itself is checked against the model's quadrature and Gaussian marginal likelihood in
tests/inference/conjugate/test_conjugate_evidence_prior.py), and the clients' held-out scores
under the MAP heads of that prior."""

import pytest
import torch
from strategy_helpers import NUM_CLASSES, network_output, run_round

from inference.conjugate import (
    ConjugatePosterior,
    ConjugatePrior,
    SufficientStatistics,
    evidence_feature_scale,
)
from inference.conjugate.heldout_scale import heldout_nll_grid


def test_the_servers_scale_is_the_evidence_choice_under_its_prior_nu(build):
    chosen = {}
    for nu in (1.0, 10.0, 100.0):
        strategy, clients, state = build("fedlog", feature_scale="evidence", prior_nu=nu,
                                         upload_dtype="float64")
        state, _ = run_round(strategy, clients, state, 0)
        state, _ = run_round(strategy, clients, state, 1)
        features = torch.cat([network_output(strategy, c) for c in clients]).double()
        labels = torch.cat([c.data.train_y for c in clients])
        stats = SufficientStatistics.from_features(features, labels, NUM_CLASSES)
        expected = evidence_feature_scale(stats, float(features.pow(2).sum()),
                                          prior=ConjugatePrior(nu=nu)).value
        chosen[nu] = float(state["feature_scale"])
        # summed float64 tables = pooled ones to ~1e-12 relative, so the same s to Brent's 1e-6
        assert chosen[nu] == pytest.approx(expected, rel=1e-5), nu
    # 39 samples: a prior worth 100 of them shrinks the class means and with them s (well
    # beyond the 1e-5 above: 2.03, 1.70, 1.13 at nu = 1, 10, 100; the bodies are trained with
    # the head of each nu, so only the direction and a clear gap are asserted, not values)
    assert chosen[100.0] < 0.9 * chosen[1.0]


def test_held_out_scores_and_the_head_use_the_strategys_prior_nu(build):
    # feature_scale="heldout" at prior_nu = 50: the clients' summed held-out NLL on the grid is
    # that of the MAP heads under nu = 50 (heldout_nll_grid, checked against a from-scratch MAP
    # in tests/inference/conjugate/test_conjugate_heldout_scale_prior.py), not under nu = 1,
    # and the round's head is the MAP of its statistics under nu = 50
    nu = 50.0
    strategy, clients, state = build("fedlog", feature_scale="heldout", heldout_fraction=0.25,
                                     prior_nu=nu, upload_dtype="float64")
    state, _ = run_round(strategy, clients, state, 0)
    stats = SufficientStatistics(state["statistics"], round(float(state["num_samples"])),
                                 privatized=True)
    held = [strategy.split_heldout(c.data)[1] for c in clients]
    features = [network_output(strategy, c, h.train_x).double() for c, h in zip(
        clients, held, strict=True)]
    expected = {prior_nu: sum(heldout_nll_grid(stats, ConjugatePrior(nu=prior_nu), f, h.train_y)
                              for f, h in zip(features, held, strict=True))
                for prior_nu in (nu, 1.0)}
    # nu = 50 against 1 moves the summed NLL by far more than the float64 tolerance below
    assert float((expected[nu] - expected[1.0]).abs().max()) > 1e-3
    state, ups = run_round(strategy, clients, state, 1)
    total = torch.stack([u.tensors["heldout_nll"] for u in ups]).sum(0)
    # float64 sums of the same terms in another order: 1e-10 relative
    torch.testing.assert_close(total, expected[nu], rtol=1e-10, atol=0)
    head_stats = SufficientStatistics(state["statistics"], round(float(state["num_samples"])),
                                      privatized=True)
    W = ConjugatePosterior(ConjugatePrior(nu=nu), head_stats, feature_scale=1.0).map()
    torch.testing.assert_close(state["head"].double(), W, rtol=1e-6, atol=1e-6 * W.abs().max())
