"""FedLog's server chooses the feature scale under its own prior: the evidence of the summed
statistics with ``prior_nu``'s pseudo-count, so the scale moves with ``prior_nu`` (the
evidence itself is checked against the model's quadrature and Gaussian marginal likelihood in
tests/inference/conjugate/test_conjugate_evidence_prior.py)."""

import pytest
import torch
from strategy_helpers import NUM_CLASSES, network_output, run_round

from inference.conjugate import ConjugatePrior, SufficientStatistics, evidence_feature_scale


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
