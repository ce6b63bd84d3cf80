"""The Linear-layer factorisation (``J[b, o, s] = G[o, b, unit_s] A[b, s]``) of the subnet
GGN and of the GLM-probit variance gives the same numbers as the full subnet Jacobian, and the
diagonal posterior (FedSI-Fac) agrees with laplace-torch's DiagLaplace.

Tolerances: the factored and unfactored paths sum the same float64 (GGN: float32 products of a
float64 model are not involved; the models here are float64) terms in another order, so they
agree to 1e-12 relative; against laplace-torch, 1e-5 absolute on probabilities (the project's
acceptance bar) and 1e-10 relative on the float64 variances.
"""

from __future__ import annotations

import copy

import pytest
import torch
from subnet_cases import make_loader, make_mlp

import inference.subnet.fit as fit_module
from inference.subnet import (
    DiagonalLaplacePosterior,
    fit_diagonal_laplace,
    fit_subnet_laplace,
    flat_trainable_parameters,
    select_subnet,
    subnet_ggn,
)
from inference.subnet.jacobian import SubnetJacobian
from tests.devices import DEVICES


def _case(seed=0):
    model = make_mlp(seed).eval()
    g = torch.Generator().manual_seed(seed + 10)
    x = torch.randn(40, 5, generator=g, dtype=torch.float64)
    return model, make_loader(x, 3), torch.randn(13, 5, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("order", ["sorted", "unsorted"])
def test_factored_ggn_equals_the_gram_of_the_subnet_jacobian(order, monkeypatch):
    model, loader, _ = _case()
    n = flat_trainable_parameters(model).numel()
    g = torch.Generator().manual_seed(4)
    idx = torch.randperm(n, generator=g)[:40]  # entries of all three Linear layers
    idx = idx.sort().values if order == "sorted" else idx
    engine = SubnetJacobian(model, idx, flat_trainable_parameters(model))
    assert engine.factorable
    factored, n_data = subnet_ggn(model, loader, idx)
    monkeypatch.setattr(fit_module, "FACTORED_GGN", False)
    plain, _ = subnet_ggn(model, loader, idx)
    assert n_data == 40
    assert torch.allclose(factored, plain, rtol=1e-12, atol=1e-14)


def test_factored_probit_equals_the_triangular_solve():
    model, loader, x_test = _case(1)
    prior = 0.5 + torch.rand(flat_trainable_parameters(model).numel(), dtype=torch.float64)
    idx = select_subnet(model, loader, 30, prior)
    post = fit_subnet_laplace(model, loader, idx, prior)
    factored = post.predict_proba(x_test)
    engine = post._subnet_jacobian()
    A, G, _ = engine.linear_factors(x_test)
    unit, _ = engine.units()
    # the factorisation itself reproduces the Jacobian entry by entry
    Jt, _ = engine(x_test)  # (S, C, B)
    assert torch.allclose(G[:, :, unit].permute(2, 0, 1) * A.T[:, None, :], Jt,
                          rtol=1e-12, atol=1e-14)
    post.factored = False
    solved = post.predict_proba(x_test)
    assert torch.allclose(factored, solved, rtol=0, atol=1e-12)
    assert not torch.allclose(factored, post.predict_proba(x_test, "map"), atol=1e-4)


def test_a_conv_subnet_keeps_the_unfactored_path(cnn_case):
    model, loader, _ = cnn_case
    idx = select_subnet(model, loader, 0.2, 1.0)
    engine = SubnetJacobian(model, idx, flat_trainable_parameters(model))
    assert not engine.factorable and engine.linear_factors(torch.zeros(2, 1, 8, 8,
                                                                        dtype=torch.float64)) \
        is None


def test_diagonal_posterior_matches_laplace_torch_diag_laplace():
    from laplace import Laplace
    from laplace.curvature import AsdlGGN

    model, loader, x_test = _case(2)
    model[-1].requires_grad_(False)  # a frozen head, as FedSI-Fac's
    n = flat_trainable_parameters(model).numel()
    prior = 0.5 + torch.rand(n, generator=torch.Generator().manual_seed(3),
                             dtype=torch.float64)
    post = fit_diagonal_laplace(model, loader, prior)
    la = Laplace(copy.deepcopy(model), "classification", subset_of_weights="all",
                 hessian_structure="diag", prior_precision=prior, backend=AsdlGGN)
    la.fit(loader)
    assert torch.allclose(post.variance, la.posterior_variance.double(), rtol=1e-10, atol=0)
    probs_ref = la(x_test, pred_type="glm", link_approx="probit")
    assert torch.allclose(post.predict_proba(x_test), probs_ref.double(), rtol=0, atol=1e-5)
    # the state round-trips, and sampling has the posterior's moments
    again = DiagonalLaplacePosterior.from_state_dict(post.state_dict(), model=model)
    assert torch.equal(again.predict_proba(x_test), post.predict_proba(x_test))
    draws = post.sample(20000, generator=torch.Generator().manual_seed(0))
    # 20,000 draws: the sample variance is within ~4 standard errors (sqrt(2/20000) = 1%)
    assert torch.allclose(draws.var(0) / post.variance, torch.ones(n, dtype=torch.float64),
                          atol=0.05)
    mc = post.predict_proba(x_test, "glm_mc", n_samples=4000,
                            generator=torch.Generator().manual_seed(1))
    assert torch.allclose(mc.sum(1), torch.ones(13, dtype=torch.float64))


def test_a_precomputed_ggn_diagonal_gives_the_same_posterior_and_a_bad_one_is_refused():
    # FedSI-Fac computes the diagonal once for its evidence and hands it on: the posterior must
    # be exactly the one that computes it itself (same function of the same numbers).
    from inference.errors import InvalidInputError
    from inference.subnet.diagonal import diagonal_ggn

    model, loader, x_test = _case(2)
    model[-1].requires_grad_(False)
    n = flat_trainable_parameters(model).numel()
    direct = fit_diagonal_laplace(model, loader, 2.0)
    diag = diagonal_ggn(model, loader)
    reused = fit_diagonal_laplace(model, None, 2.0, ggn_diagonal=diag)
    assert torch.equal(reused.variance, direct.variance)
    assert torch.equal(reused.predict_proba(x_test), direct.predict_proba(x_test))
    for bad in (diag[:-1], -diag - 1.0, diag.clone().fill_(float("nan")),
                torch.zeros(n, dtype=torch.int64)):
        with pytest.raises(InvalidInputError, match="ggn_diagonal"):
            fit_diagonal_laplace(model, loader, 2.0, ggn_diagonal=bad)


@pytest.mark.parametrize("device", DEVICES)
def test_the_diagonal_posterior_moves_as_a_copy_and_satisfies_the_protocol(device):
    from inference.posterior import Posterior

    model, loader, x_test = _case(2)
    model[-1].requires_grad_(False)
    post = fit_diagonal_laplace(model, loader, 2.0)
    assert isinstance(post, Posterior)
    moved = post.to(device)
    assert isinstance(moved, Posterior) and moved is not post
    assert moved.mean.device.type == torch.device(device).type
    # the same numbers, moved: equal on the CPU, and the original is untouched
    assert torch.equal(moved.mean.cpu(), post.mean) and torch.equal(moved.variance.cpu(),
                                                                     post.variance)
    assert next(post.model.parameters()).device.type == "cpu"
    probs = moved.predict_proba(x_test.to(device)).cpu()
    # the same GLM-probit on another device: float32 Jacobians round differently on a GPU
    assert torch.allclose(probs, post.predict_proba(x_test), rtol=0, atol=1e-5)
    assert post.to("cpu").model is post.model  # already there: the model is not copied
