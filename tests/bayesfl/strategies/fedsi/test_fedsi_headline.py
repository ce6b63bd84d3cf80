"""FedSI's summary headline is its posterior predictive, and the plug-in is reported beside it:
the run's NLL, Brier and ECE equal those of each client's posterior predictive
(``result.posterior(k).predict_proba(x, predictive)``) on its test set, pooled, and
``summary["map_plugin"]`` equals those of the same posteriors' MAP plug-in — two predictives
chosen so that their metrics differ by far more than the comparison's tolerance."""

import pytest
import torch

import bayesfl
from calibration import ece

# FedSI-Fac at a wide prior (alpha 0.1) and FedSI with a 200-entry subnet at alpha 10: their
# predictives are visibly wider than their plug-ins (measured on seed 0, pooled ECE 0.235 vs
# 0.125 and 0.152 vs 0.112; NLL 0.533 vs 0.407 and 0.455 vs 0.419)
CASES = [
    ("fedsi-fac", {"finetune_epochs": 20, "prior_var": 0.1}),
    ("fedsi", {"finetune_epochs": 20, "prior_var": 10.0, "subnet_size": 200}),
]


def pooled_metrics(probs, labels):
    """NLL and Brier from their definitions; ECE (15 equal-width bins, the run's default) by
    `calibration.ece`, tested on its own against references."""
    p_true = probs[torch.arange(len(labels)), labels]
    onehot = torch.nn.functional.one_hot(labels, probs.shape[1]).to(probs.dtype)
    return {"nll": float(-p_true.clamp_min(1e-12).log().mean()),
            "brier": float((probs - onehot).pow(2).sum(dim=1).mean()),
            "ece": ece(probs, labels, n_bins=15)}


@pytest.mark.trained
@pytest.mark.parametrize("name, options", CASES)
def test_the_headline_is_the_posterior_predictive_and_the_plugin_sits_beside_it(name, options):
    result = bayesfl.simulate(name, dataset="digits", clients=3, partition="iid", rounds=2,
                              seed=0, progress=False, threads=1, body="mlp", feature_dim=16,
                              local_epochs=3, batch_size=32, strategy_options=options)
    predictive, plugin, labels = [], [], []
    method = result.strategy.predictive
    for k, client in enumerate(result.clients):
        posterior = result.posterior(k)
        x = client.data.test_x
        predictive.append(posterior.predict_proba(x, method).to(torch.float64))
        plugin.append(posterior.predict_proba(x, "map").to(torch.float64))
        labels.append(client.data.test_y)
    labels = torch.cat(labels)
    expected = pooled_metrics(torch.cat(predictive), labels)
    expected_plugin = pooled_metrics(torch.cat(plugin), labels)
    summary = result.summary
    # The run evaluates the same posteriors on the same inputs, its metrics summed over merged
    # float64 accumulators in another order: agreement to ~1e-12 relative; 1e-8 leaves room
    # for a differently chunked matrix product. ECE jumps when a confidence crosses a bin
    # edge, but only a confidence within ~1e-12 of one of 14 edges could, among 450 samples.
    tolerance = 1e-8
    for key in ("nll", "brier", "ece"):
        assert summary[key] == pytest.approx(expected[key], rel=tolerance, abs=tolerance), key
        assert summary["map_plugin"][key] == pytest.approx(expected_plugin[key], rel=tolerance,
                                                           abs=tolerance), key
    # the two predictives differ by much more than the tolerance (so neither can pass for the
    # other): NLL by 0.03 or more here; 1e-3 is the floor asserted
    assert abs(expected["nll"] - expected_plugin["nll"]) > 1e-3
