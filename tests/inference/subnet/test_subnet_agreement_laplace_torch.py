"""The fast subnet path agrees with laplace-torch 0.3's FullSubnetLaplace (AsdlGGN backend).

Reference: ``Laplace(model, "classification", subset_of_weights="subnetwork",
hessian_structure="full", subnetwork_indices=idx, backend=AsdlGGN)`` with the per-parameter
subnet prior set through ``la._prior_precision`` before ``fit`` (spec fedsi.md §7.2.3).
Tolerance: 1e-5 absolute (the acceptance bar) on float64 models, and on a float32 model for
the probabilities.
"""

from __future__ import annotations

import copy

import pytest
import torch
from subnet_cases import laplace_subnet_reference

from inference.subnet import fit_subnet_laplace, flat_trainable_parameters, select_subnet

TOL = 1e-5


def per_parameter_prior(model, seed=3):
    n = flat_trainable_parameters(model).numel()
    g = torch.Generator().manual_seed(seed)
    return 0.5 + 2.0 * torch.rand(n, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("case", ["mlp_case", "cnn_case"])
def test_precision_marginal_std_and_probit_match_laplace_torch(case, request):
    model, loader, x_test = request.getfixturevalue(case)
    prior = per_parameter_prior(model)
    idx = select_subnet(model, loader, 0.4, prior)
    post = fit_subnet_laplace(model, loader, idx, prior)
    la = laplace_subnet_reference(model, loader, idx, prior[idx])

    assert torch.allclose(post.precision, la.posterior_precision, atol=TOL, rtol=0)
    std_ref = la.posterior_covariance.diagonal().sqrt()
    std_full = post.marginal_std_full()
    assert torch.allclose(std_full[idx], std_ref, atol=TOL, rtol=0)
    outside = torch.ones_like(std_full, dtype=torch.bool)
    outside[idx] = False
    assert bool((std_full[outside] == 0).all())
    probs_ref = la(x_test, pred_type="glm", link_approx="probit")
    assert torch.allclose(post.predict_proba(x_test), probs_ref, atol=TOL, rtol=0)


def test_unsorted_indices_keep_their_order_like_laplace_torch(mlp_case):
    model, loader, x_test = mlp_case
    prior = per_parameter_prior(model)
    n = flat_trainable_parameters(model).numel()
    idx = torch.randperm(n, generator=torch.Generator().manual_seed(5))[:25]
    post = fit_subnet_laplace(model, loader, idx, prior)
    la = laplace_subnet_reference(model, loader, idx, prior[idx])
    assert torch.equal(post.subnet_indices, idx)
    assert torch.allclose(post.precision, la.posterior_precision, atol=TOL, rtol=0)
    probs_ref = la(x_test, pred_type="glm", link_approx="probit")
    assert torch.allclose(post.predict_proba(x_test), probs_ref, atol=TOL, rtol=0)


def test_float32_model_probabilities_match_laplace_torch(mlp_case):
    model, loader, x_test = mlp_case
    model = model.float()
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(
            loader.dataset.tensors[0].float(), loader.dataset.tensors[1]
        ),
        batch_size=8,
    )
    idx = select_subnet(model, loader, 30, 1.0)
    post = fit_subnet_laplace(model, loader, idx, 1.0)
    la = laplace_subnet_reference(model, loader, idx, torch.ones(idx.numel()))
    probs_ref = la(x_test.float(), pred_type="glm", link_approx="probit")
    assert torch.allclose(post.predict_proba(x_test.float()), probs_ref, atol=TOL, rtol=0)
    assert torch.allclose(
        post.precision, la.posterior_precision.double(), atol=1e-4, rtol=1e-5
    )  # float32 GGN accumulation on both sides


@pytest.mark.parametrize("structure", ["full", "diag"])
def test_laplace_torch_backend_gives_the_same_posterior(structure, mlp_case):
    model, loader, x_test = mlp_case
    prior = per_parameter_prior(model)
    idx = select_subnet(model, loader, 40, prior)
    fast = fit_subnet_laplace(model, loader, idx, prior, hessian_structure=structure)
    reference = fit_subnet_laplace(
        model, loader, idx, prior, backend="laplace_torch", hessian_structure=structure
    )
    assert torch.allclose(fast.precision, reference.precision, atol=1e-10, rtol=0)
    assert torch.allclose(
        fast.predict_proba(x_test), reference.predict_proba(x_test), atol=1e-12, rtol=0
    )
    assert fast.n_data == reference.n_data == 30


def test_diagonal_structure_matches_laplace_torch_diag_subnet_laplace(mlp_case):
    model, loader, x_test = mlp_case
    idx = select_subnet(model, loader, 40, 2.0)
    post = fit_subnet_laplace(model, loader, idx, 2.0, hessian_structure="diag")
    la = laplace_subnet_reference(model, loader, idx, 2.0, structure="diag")
    assert torch.count_nonzero(post.precision - torch.diag(post.precision.diagonal())) == 0
    assert torch.allclose(post.precision.diagonal(), la.posterior_precision, atol=TOL, rtol=0)
    probs_ref = la(x_test, pred_type="glm", link_approx="probit")
    assert torch.allclose(post.predict_proba(x_test), probs_ref, atol=TOL, rtol=0)


def test_float32_predictive_stays_accurate_when_prior_precisions_span_14_decades(mlp_case):
    """FedSI's prior precision 1/g reaches 1e12 after variance shrinkage. The float32 predictive
    solves with the Jacobi-equilibrated Cholesky factor; reference: the same fit in float64.
    Tolerance 1e-5 on the probabilities."""
    model, loader, x_test = mlp_case
    n = flat_trainable_parameters(model).numel()
    prior = 10.0 ** torch.linspace(-2.0, 12.0, n, dtype=torch.float64)
    idx = torch.arange(0, n, 2)
    reference = fit_subnet_laplace(model, loader, idx, prior)
    model32 = copy.deepcopy(model).float()
    x32, y = loader.dataset.tensors
    loader32 = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x32.float(), y), batch_size=8
    )
    post32 = fit_subnet_laplace(model32, loader32, idx, prior)
    probs_ref = reference.predict_proba(x_test)
    assert not torch.allclose(probs_ref, reference.predict_proba(x_test, "map"), atol=1e-3)
    assert torch.allclose(post32.predict_proba(x_test.float()).double(), probs_ref, atol=TOL)
    assert torch.allclose(
        post32.marginal_std_full().double(), reference.marginal_std_full(), rtol=1e-4, atol=1e-9
    )
