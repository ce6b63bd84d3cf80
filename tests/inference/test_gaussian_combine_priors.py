"""combine() with the defaults: clients that each chose their own prior precision by evidence
are combined under one prior whose precision maximises the federated evidence (the evidence of
the model whose client likelihoods are the Gaussian terms they sent; inference.gaussian.
aggregation's docstring), and the result is checked against the pooled-data fit."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sklearn.datasets import load_digits

import inference
from inference.gaussian import combine, gaussian_prior
from inference.laplace_head import fit_laplace_head
from tests.inference.ground_truth import linear_regression

F64 = torch.float64


def test_a_gaussian_likelihood_gets_the_pooled_evidence_maximiser_and_the_pooled_posterior():
    # Gaussian likelihood: each client's term is its exact likelihood, so the federated
    # evidence is the pooled evidence up to a constant and the combination is exact.
    truth = linear_regression(num_data=60)
    options = dict(likelihood="gaussian", noise_std=truth.noise_std)
    clients = [fit_laplace_head(x, y, 1, **options)
               for x, y in zip(truth.features.chunk(3), truth.targets.chunk(3), strict=True)]
    precisions = [float(c.prior.diag[0]) for c in clients]
    assert max(precisions) > 1.01 * min(precisions)  # each chose its own: the old refusal case
    combined = combine(clients)
    pooled = fit_laplace_head(truth.features, truth.targets, 1, **options)
    choice = combined.prior_selection
    assert choice.method == "federated_marglik" and not choice.hit_bound
    # Both are Brent optima of one smooth function (to 1e-6 in log λ, LOG_XATOL): 1e-5.
    assert abs(choice.value / pooled.prior_selection.value - 1) < 1e-5
    at_same_prior = fit_laplace_head(truth.features, truth.targets, 1, **options,
                                     prior_precision=choice.value)
    torch.testing.assert_close(combined.mean, at_same_prior.mean, atol=1e-10, rtol=0)
    torch.testing.assert_close(combined.covariance(), at_same_prior.covariance(), atol=1e-10,
                               rtol=0)
    assert combined.n_data == 60


def test_a_given_prior_precision_or_a_shared_prior_is_used_as_is():
    truth = linear_regression()
    options = dict(likelihood="gaussian", noise_std=truth.noise_std)
    clients = [fit_laplace_head(x, y, 1, **options)
               for x, y in zip(truth.features.chunk(2), truth.targets.chunk(2), strict=True)]
    given = combine(clients, prior=2.0)
    assert given.prior_selection is None
    assert given.prior.allclose(gaussian_prior((1, 3), 2.0))
    shared = [fit_laplace_head(x, y, 1, **options, prior_precision=3.0)
              for x, y in zip(truth.features.chunk(2), truth.targets.chunk(2), strict=True)]
    assert combine(shared).prior.allclose(gaussian_prior((1, 3), 3.0))
    assert combine(shared).prior_selection is None
    with pytest.raises(inference.InvalidInputError, match="prior precision > 0"):
        combine(clients, prior=-1.0)


def digits_splits():
    x, y = load_digits(return_X_y=True)
    order = np.random.default_rng(0).permutation(len(x))
    x, y = x[order] / 16, y[order]
    return [(x[k * 400:(k + 1) * 400], y[k * 400:(k + 1) * 400]) for k in range(3)], (
        x[:1200], y[:1200]), (torch.tensor(x[1200:]), y[1200:])


@pytest.mark.slow
def test_the_readme_snippet_runs_with_defaults_and_agrees_with_the_pooled_fit():
    splits, (x_pool, y_pool), (x_test, _) = digits_splits()
    # The README's snippet, as written (structure="diag", every other option the default).
    clients = [inference.fit_head("laplace", phi_k, y_k, 10, structure="diag")
               for phi_k, y_k in splits]
    global_post = inference.combine(clients)
    choice = global_post.prior_selection
    assert choice is not None and not choice.hit_bound
    assert global_post.n_data == 1200
    # Reference: the same head fitted on the pooled data with the same prior. One-shot
    # combination of Gaussian terms is not exact for a softmax likelihood (each term is the
    # client's expansion at its own posterior), so the check is relative: the combined
    # predictive must be far closer to the pooled one than any client's own is (measured:
    # mean total variation 0.03 against 0.14 per client, Laplace, pixels / 16).
    pooled = inference.fit_head("laplace", x_pool, y_pool, 10, structure="diag",
                                prior_precision=choice.value)

    def total_variation(post) -> float:
        reference = pooled.predict_proba(x_test)
        return float(0.5 * (post.predict_proba(x_test) - reference).abs().sum(1).mean())

    combined_tv = total_variation(global_post)
    client_tv = min(total_variation(c) for c in clients)
    assert combined_tv < 0.5 * client_tv, (combined_tv, client_tv)
    probs = global_post.predict_proba(x_test)
    torch.testing.assert_close(probs.sum(1), torch.ones(len(probs), dtype=probs.dtype),
                               rtol=0, atol=1e-12)
    average = inference.average(clients)  # the other aggregation runs with defaults too
    assert average.prior_selection.value == choice.value
