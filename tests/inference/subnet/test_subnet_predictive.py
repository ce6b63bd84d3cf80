"""The GLM predictive written once (issue 42): the full-covariance subnet posterior and the
diagonal posterior predict through one function, and a diagonal covariance written either way
gives the same predictive.

The check is independent of how each posterior forms ``J Sigma J^T``: a
`SubnetLaplacePosterior` over *every* parameter whose GGN block is the diagonal matrix
``diag(d)`` has covariance ``diag(1 / (d + prior))``, the covariance of the
`DiagonalLaplacePosterior` with GGN diagonal ``d``; the first goes through its Cholesky
factor (and its factored Linear-layer route), the second through squared scaled Jacobians. And
both against the brute force ``sum_r J_or^2 v_r`` from ``torch.func.jacrev``. Tolerance: float64,
the two routes differ by rounding only (the equilibrated Cholesky of a diagonal matrix is the
identity up to one rounding of ``sqrt``), ~1e-15 relative; 1e-11 catches a wrong scale (a
missing square root moves the variances by O(1)) or a transposed Jacobian.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.func import functional_call, jacrev

import inference.subnet.predictive as predictive
from inference.errors import InvalidInputError
from inference.subnet import DiagonalLaplacePosterior, SubnetLaplacePosterior

F64 = torch.float64


def network_and_inputs(seed: int):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 4)).to(F64)
    return model, torch.randn(9, 5, dtype=F64)


def brute_force_probit(model, x, variance):
    names = [n for n, _ in model.named_parameters()]
    params = tuple(p.detach() for _, p in model.named_parameters())

    def logits(*flat):
        return functional_call(model, dict(zip(names, flat, strict=True)), (x,))

    parts = jacrev(logits, argnums=tuple(range(len(params))))(*params)
    J = torch.cat([p.reshape(x.shape[0], 4, -1) for p in parts], dim=2)  # (B, C, P)
    f_var = (J.square() * variance).sum(2)
    with torch.no_grad():
        f = model(x)
    return torch.softmax(f / torch.sqrt(1.0 + math.pi / 8.0 * f_var), dim=-1)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("factored", [True, False])
def test_diagonal_covariance_either_way_gives_one_predictive(seed, factored):
    model, x = network_and_inputs(seed)
    mean = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    P = mean.numel()
    gen = torch.Generator().manual_seed(seed)
    d = torch.rand(P, dtype=F64, generator=gen) * 3.0
    prior = 0.5 + torch.rand(P, dtype=F64, generator=gen)
    full = SubnetLaplacePosterior(mean, torch.arange(P), torch.diag(d), prior, model=model)
    full.factored = factored
    diagonal = DiagonalLaplacePosterior(mean, d, prior, model=model)
    reference = brute_force_probit(model, x, 1.0 / (d + prior))
    for post in (full, diagonal):
        torch.testing.assert_close(post.predict_proba(x), reference, rtol=1e-11, atol=1e-14)
        torch.testing.assert_close(post.predict_proba(x, "map"),
                                   torch.softmax(model(x), dim=-1).detach(), rtol=1e-12,
                                   atol=1e-15)
    # glm_mc: the same draws (z, the Cholesky factor of the identity leaves them as they are)
    mc = [post.predict_proba(x, "glm_mc", n_samples=50,
                             generator=torch.Generator().manual_seed(7))
          for post in (full, diagonal)]
    torch.testing.assert_close(mc[0], mc[1], rtol=1e-11, atol=1e-14)


def test_both_posteriors_predict_through_the_one_function(monkeypatch):
    model, x = network_and_inputs(2)
    mean = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    P = mean.numel()
    calls = []
    original = predictive.glm_predict

    def spy(*args, **kwargs):
        calls.append(kwargs["logit_variance"])
        return original(*args, **kwargs)

    # the posteriors' modules import the function by name: patch where it is looked up
    import inference.subnet.diagonal_posterior as diagonal_module
    import inference.subnet.posterior as full_module
    monkeypatch.setattr(full_module, "glm_predict", spy)
    monkeypatch.setattr(diagonal_module, "glm_predict", spy)
    ones = torch.ones(P, dtype=F64)
    SubnetLaplacePosterior(mean, torch.arange(P), torch.eye(P, dtype=F64), ones,
                           model=model).predict_proba(x)
    DiagonalLaplacePosterior(mean, ones, ones, model=model).predict_proba(x)
    assert len(calls) == 2


def test_bad_method_or_sample_count_is_refused():
    with pytest.raises(InvalidInputError, match="method must be one of"):
        predictive.check_method("laplace", 10)
    with pytest.raises(InvalidInputError, match="n_samples"):
        predictive.check_method("glm_mc", 0)
