"""GaussianPosterior's centred probit (the default predictive) and the full logit covariance."""

from __future__ import annotations

import math

import pytest
import torch

from inference.gaussian import GaussianPosterior, gaussian_prior

F64 = torch.float64
STRUCTURES = ["diag", "full", "lowrank"]


def head_posterior(structure: str, seed: int = 0, C: int = 3, m: int = 2):
    """A random posterior over a (C, m + 1) head in the given structure."""
    from inference.gaussian import GaussianTerm

    gen = torch.Generator().manual_seed(seed)
    d = C * (m + 1)
    shift = torch.randn(d, generator=gen, dtype=F64)
    if structure == "diag":
        lik = GaussianTerm("diag", shift, diag=torch.rand(d, generator=gen, dtype=F64) * 3)
    elif structure == "full":
        a = torch.randn(d, d, generator=gen, dtype=F64)
        lik = GaussianTerm("full", shift, dense=a @ a.T)
    else:
        lik = GaussianTerm("lowrank", shift, diag=torch.rand(d, generator=gen, dtype=F64),
                           factor=torch.randn(d, 2, generator=gen, dtype=F64))
    return GaussianPosterior(gaussian_prior((C, m + 1), 0.7), lik, (C, m + 1))


def dense_logit_covariance(post, x):
    """Independent: J Σ Jᵀ with the dense covariance and J = I_C ⊗ [1, x]."""
    C = post.shape[0]
    inputs = torch.cat([torch.ones(len(x), 1, dtype=F64), x], 1)
    jac = torch.einsum("ck,bp->bckp", torch.eye(C, dtype=F64), inputs).reshape(len(x), C, -1)
    return jac @ post.covariance().to(F64) @ jac.transpose(1, 2)


@pytest.mark.parametrize("structure", STRUCTURES)
def test_logit_covariance_is_the_jacobian_quadratic_form(structure):
    post = head_posterior(structure)
    x = torch.randn(7, 2, generator=torch.Generator().manual_seed(1), dtype=F64)
    _, cov = post.logit_covariance(x)
    # both exact in float64 from the same precision (a Cholesky / Woodbury apart): 1e-10
    torch.testing.assert_close(cov, dense_logit_covariance(post, x), atol=1e-10, rtol=0)
    torch.testing.assert_close(cov.diagonal(dim1=1, dim2=2), post.logit_moments(x)[1],
                               atol=1e-10, rtol=0)


@pytest.mark.parametrize("structure", STRUCTURES)
def test_centred_probit_is_the_probit_of_the_centred_logits_and_the_default(structure):
    post = head_posterior(structure)
    x = torch.randn(7, 2, generator=torch.Generator().manual_seed(1), dtype=F64)
    mean, _ = post.logit_moments(x)
    cov = dense_logit_covariance(post, x)
    centring = torch.eye(3, dtype=F64) - 1.0 / 3
    var = torch.diagonal(centring @ cov @ centring, dim1=1, dim2=2)
    expected = torch.softmax((mean @ centring) / torch.sqrt(1 + math.pi / 8 * var), -1)
    torch.testing.assert_close(post.predict_proba(x, "centred_probit"), expected,
                               atol=1e-12, rtol=0)
    torch.testing.assert_close(post.predict_proba(x), expected, atol=1e-12, rtol=0)


def test_variance_of_a_common_shift_of_all_logits_changes_nothing():
    """softmax(f + c·1) = softmax(f): uncertainty about a shift shared by every class is no
    uncertainty about the class. The centred probit ignores it (as Monte Carlo does); the
    marginal probit counts it and flattens the probabilities."""
    base = head_posterior("full")
    C, width = base.shape
    shared = torch.kron(torch.ones(C, 1, dtype=F64), torch.eye(width, dtype=F64))  # (d, P)
    covariance = base.covariance() + 25.0 * shared @ shared.T  # sd 5 on every shared shift
    widened = GaussianPosterior.from_mean_and_precision(
        base.mean, torch.linalg.inv(covariance), base.prior)
    x = torch.randn(50, 2, generator=torch.Generator().manual_seed(2), dtype=F64)
    torch.testing.assert_close(widened.predict_proba(x), base.predict_proba(x),
                               atol=1e-9, rtol=0)  # an inverse of an inverse: ~1e-12
    mc = widened.predict_proba(x, "mc", n_samples=20_000,
                               generator=torch.Generator().manual_seed(3))
    centred_error = float((widened.predict_proba(x) - mc).abs().mean())
    marginal_error = float((widened.predict_proba(x, "probit") - mc).abs().mean())
    assert centred_error < 0.25 * marginal_error
